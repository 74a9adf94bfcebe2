"""megatron_npu/patches/distributed.py, a gloo group's works one at a time: torch 2.13's gloo runs a group's asynchronous works
on two threads, and two in flight at once corrupted the heap under Megatron-FSDP's prefetched all-gathers
(tests/training/test_fsdp.py's DP2 run died now and then with "malloc(): unaligned tcache chunk detected").
Groups are built here in this process, one rank each, on a HashStore: no launch."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_npu.accelerator.cpu import CpuAccelerator
from megatron_npu.accelerator.cuda import CudaAccelerator
from megatron_npu.patches.distributed import GLOO_INTERFACES_ENVVAR


def _group(*args):
    return c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, *args)


def test_only_a_target_whose_library_overlaps_works_unsafely_serializes_them():
    assert CpuAccelerator().capability("lacks_safe_work_overlap")
    assert not CudaAccelerator().capability("lacks_safe_work_overlap")


def test_a_gloo_group_torch_builds_runs_one_worker_with_the_timeout_it_was_given():
    group = _group(timedelta(seconds=77))
    assert isinstance(group, torch._C._distributed_c10d.ProcessGroupGloo)
    assert group.options._threads == 1
    assert group.options._timeout == timedelta(seconds=77)
    assert len(group.options._devices) == 1


def test_options_a_caller_built_are_kept():
    options = c10d.ProcessGroupGloo._Options()
    options._devices = [c10d.ProcessGroupGloo.create_default_device()]
    options._threads = 3
    assert _group(options).options._threads == 3


def test_the_interfaces_gloo_is_told_to_bind_are_bound(monkeypatch):
    monkeypatch.setenv(GLOO_INTERFACES_ENVVAR, "lo,lo")
    assert len(_group(timedelta(seconds=5)).options._devices) == 2


def test_torch_still_recognises_every_gloo_backend_as_a_gloo_backend():
    """A group hands its backend back as torch's own class once the Python object that built it is collected;
    torch's isinstance checks on the patched name (timeouts, sequence numbers) must still say gloo."""
    torchs_own = torch._C._distributed_c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    assert isinstance(torchs_own, c10d.ProcessGroupGloo)
    assert issubclass(type(torchs_own), c10d.ProcessGroupGloo)


@pytest.mark.parametrize("collective", ["allreduce", "broadcast"])
def test_a_one_worker_group_still_computes(collective):
    tensor = torch.arange(6.0)
    getattr(_group(timedelta(seconds=60)), collective)([tensor]).wait()
    assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
