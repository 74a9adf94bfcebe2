"""megatron_npu/patches/inference.py: megatron-core's inference broadcast / p2p asserted tensor.is_cuda
(False for an npu tensor, as for every tensor on the cpu target): the last pipeline stage failed before the broadcast
its peers waited in (megatron-core's inference/test_communication_utils.py hung 300 s per case). In process."""

from __future__ import annotations

import pytest
import torch

import megatron_npu  # noqa: F401  (patches on import)
from megatron_npu.accelerator.cpu import CpuAccelerator
from megatron_npu.patches.inference import _is_device_tensor


class DeviceElsewhere(CpuAccelerator):
    """Answers as npu does: its device (torch's meta device here) is not the host, and its tensors are not is_cuda."""

    device_type = "meta"


def test_the_last_stage_broadcasts_a_device_tensor_that_is_not_is_cuda(model_parallel):
    from megatron.core.inference.communication_utils import broadcast_from_last_pipeline_stage

    tensor = torch.arange(6.0).reshape(2, 3)
    assert not tensor.is_cuda  # a device tensor of the cpu target, as an npu tensor: AssertionError before
    received = broadcast_from_last_pipeline_stage(size=[2, 3], dtype=torch.float32, tensor=tensor)
    assert torch.equal(received, tensor)


def test_the_check_still_refuses_a_tensor_off_the_device_and_a_missing_one():
    check = _is_device_tensor(None, DeviceElsewhere())
    check(torch.empty(2, device="meta"))  # on the device, though not is_cuda
    with pytest.raises(AssertionError, match="cpu tensor, not on the accelerator's device"):
        check(torch.empty(2))
    with pytest.raises(AssertionError):
        check(None)


def test_without_flash_attn_no_minimum_flash_attn_version_is_met():
    """megatron.core.utils.is_fa_min_version raised ModuleNotFoundError (inference/engines/test_static_engine.py
    failed to import on its class-level skipif)."""
    import importlib.util

    from megatron.core.utils import is_fa_min_version

    assert importlib.util.find_spec("flash_attn") is None  # FlashAttention is CUDA kernels: never here
    assert is_fa_min_version("2.7.3") is False
    assert is_fa_min_version("0.0.1", check_equality=False) is False
