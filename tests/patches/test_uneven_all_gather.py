"""megatron_npu/patches/distributed.py, all_gather of unequal sizes on gloo: megatron-core's layer-wise distributed optimizer
gathers each rank's flattened parameters at that rank's size (dist_checkpointing/test_layer_wise_optimizer.py::
test_layer_wise_optimizer_step: 'ProcessGroupGloo::allgather: invalid tensor size'). Two ranks, about 20 s."""

from __future__ import annotations

import pytest
from distributed import ROOT, torchrun

from megatron_npu.accelerator.cpu import CpuAccelerator

WORKER = ROOT / "tests" / "fixtures" / "uneven_all_gather_worker.py"


def test_only_a_target_whose_library_refuses_unequal_sizes_pads_them():
    assert CpuAccelerator().capability("lacks_uneven_all_gather")


@pytest.mark.launch
def test_all_gather_of_unequal_sizes_delivers_every_ranks_part():
    results = torchrun(WORKER, nproc=2, timeout=300).check().by_rank()
    expected = [[], [100.0, 101.0, 102.0]]
    assert [results[rank]["uneven"] for rank in (0, 1)] == [expected, expected]
    assert [results[rank]["equal"] for rank in (0, 1)] == [[0.0, 1.0], [0.0, 1.0]]
