"""megatron-core's batch-invariant kernels module without triton (megatron_npu/patches/megatron_training.py).

megatron-core's own tests enter ``set_batch_invariant_mode(True)`` (a context manager) and some then skip on a
missing Transformer Engine; the stand-in had raised SystemExit on entering, before those skips. Now entering works
and each op whose batch-invariant kernel is missing refuses when it runs; Megatron-LM's start-up switch
(``enable_batch_invariant_mode``) still refuses the flag in one line."""

from __future__ import annotations

import pytest
import torch

from megatron_npu.accelerator.cpu import CpuAccelerator
from megatron_npu.patches.megatron_training import _batch_invariant_stand_in


def test_the_mode_is_entered_and_each_missing_kernel_refuses_when_it_runs():
    module = _batch_invariant_stand_in(CpuAccelerator())
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    reference = torch.mm(a, b)
    with module.set_batch_invariant_mode(True):
        assert module.is_batch_invariant_mode_enabled()
        with pytest.raises(RuntimeError, match=r"batch-invariant kernels \(aten::mm\) are triton"):
            torch.mm(a, b)
        with pytest.raises(RuntimeError, match=r"aten::addmm"):
            torch.addmm(torch.zeros(5), a, b)
        with module.set_batch_invariant_mode(False):  # re-entrant, as megatron-core's
            assert not module.is_batch_invariant_mode_enabled()
            assert torch.equal(torch.mm(a, b), reference)
        assert module.is_batch_invariant_mode_enabled()
    assert not module.is_batch_invariant_mode_enabled()
    assert torch.equal(torch.mm(a, b), reference)


def test_megatron_lms_start_up_switch_still_refuses_the_flag():
    module = _batch_invariant_stand_in(CpuAccelerator())
    with pytest.raises(SystemExit):
        module.enable_batch_invariant_mode()
    assert not module.is_batch_invariant_mode_enabled()
