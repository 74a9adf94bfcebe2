"""megatron_npu/patches/optimizer_cpu_offload.py: megatron-core's HybridDeviceOptimizer (--optimizer-cpu-offload) told
device parameters by the accelerator, not by ``param.is_cuda`` (False for an npu tensor, as for every tensor on the
cpu target). Found by megatron-core's own test_optimizer_cpu_offloading.py (66 tests on the cpu target: KeyError in
cpu_copys_map_gpu_param). In process, a few seconds.

The npu answer is checked with an accelerator stand-in whose device is torch's ``meta`` device: like an npu tensor, a
meta tensor is not ``is_cuda`` and is not a host tensor, and the stand-in answers ``is_device_tensor`` with the
accelerator interface's own code, which NpuAccelerator inherits."""

from __future__ import annotations

import pytest
import torch
from torch.optim import SGD, AdamW

import megatron_npu  # noqa: F401  (patches on import)
from megatron_npu.accelerator.base import Accelerator
from megatron_npu.accelerator.cpu import CpuAccelerator
from megatron_npu.accelerator.npu import NpuAccelerator
from megatron_npu.patches.optimizer_cpu_offload import offloaded_params, place_states, split_param_groups
from megatron_npu.registry import REGISTRY


class DeviceElsewhere(CpuAccelerator):
    """Answers as npu does where it matters here: its device is not the host, and its tensors are not is_cuda."""

    device_type = "meta"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.device_type)


def _hybrid_class() -> type:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    return HybridDeviceOptimizer


def test_npu_tells_device_tensors_with_the_interfaces_answer():
    assert NpuAccelerator.is_device_tensor is Accelerator.is_device_tensor  # the stand-in's answer is npu's
    assert NpuAccelerator.device_type == "npu"


def test_device_parameters_that_are_not_is_cuda_are_offloaded_up_to_the_fraction():
    """On npu megatron-core's split saw no device parameter (is_cuda False) and offloaded none."""
    device = [torch.empty(n, device="meta") for n in (6, 4, 2)]
    host = [torch.empty(8)]
    params = [device[0], host[0], device[1], device[2]]
    assert not any(p.is_cuda for p in params)
    on_device = DeviceElsewhere().is_device_tensor
    assert offloaded_params(params, 0.5, on_device) == [device[0]]  # 6 of 12 device elements
    assert offloaded_params(params, 0.6, on_device) == [device[0], device[1]]  # the threshold may be crossed
    assert offloaded_params(params, 1.0, on_device) == device
    assert offloaded_params(params, 0.0, on_device) == []


def test_device_parameters_not_offloaded_stay_with_the_device_optimizer():
    """megatron-core's original split (asked is_cuda) gives the host optimizer every parameter; the patched one keeps
    device parameters on the device sub-optimizer and host parameters on the host one."""
    device, host = torch.nn.Parameter(torch.empty(4, device="meta")), torch.nn.Parameter(torch.empty(3))
    groups = [{"params": [device, host], "lr": 0.1}]
    split = split_param_groups(groups, 0.0, in_fp32=False, accelerator=DeviceElsewhere())
    assert [g["params"] for g in split.gpu_param_groups] == [[device]]
    assert [g["params"] for g in split.cpu_param_groups] == [[host]]
    assert split.gpu_param_groups[0]["lr"] == 0.1

    original = REGISTRY.original_attribute(_hybrid_class(), "_get_sub_optimizer_param_groups")
    unpatched = original(_Groups(groups), 0.0)
    assert unpatched[1] == [] and unpatched[0][0]["params"] == [device, host]  # what megatron-core did on npu


class _Groups:
    """What _get_sub_optimizer_param_groups reads from its optimizer."""

    def __init__(self, param_groups: list[dict]) -> None:
        self.param_groups = param_groups
        self.param_update_in_fp32 = False


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 8)).square().sum().backward()
        optimizer.step()


@pytest.mark.parametrize("cls", [AdamW, SGD], ids=["adam", "sgd"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_half_offloaded_steps_as_the_device_optimizer_alone(cls, overlap):
    """megatron-core's test_multi_device_hybrid_optimizer on the cpu target (whose device is the host): half the
    parameters (by elements) are stepped by host copies, the rest by the device optimizer, and the model equals one
    stepped by the device optimizer alone. Before: KeyError in cpu_copys_map_gpu_param on the first step."""
    model, reference = _net(), _net()
    hybrid = _hybrid_class()(
        model.parameters(),
        offload_fraction=0.5,
        cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        lr=0.01,
    )
    offloaded = set(hybrid.gpu_params_map_cpu_copy)
    weights = list(model.parameters())
    assert offloaded == {weights[0]}  # 128 of 260 elements; the threshold is 130
    assert hybrid.gpu_optimizer is not None and hybrid.cpu_optimizers
    _steps(model, hybrid, 3)
    _steps(reference, cls(reference.parameters(), lr=0.01), 3)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_a_loaded_state_goes_where_its_sub_optimizer_steps():
    """Without TE both sub-optimizers are torch's AdamW, and megatron-core moved a state to the host when its
    optimizer was an instance of the host class: the device optimizer's state went to the host."""
    model = _net()
    hybrid = _hybrid_class()(
        model.parameters(), offload_fraction=0.5, cpu_optimizer_cls=AdamW, gpu_optimizer_cls=AdamW, lr=0.01
    )
    _steps(model, hybrid, 1)
    place_states(hybrid, DeviceElsewhere())
    for optimizer in hybrid.sub_optimizers:
        expected = "meta" if optimizer is hybrid.gpu_optimizer else "cpu"
        devices = {v.device.type for state in optimizer.state.values() for v in state.values() if v.dim()}
        assert devices == {expected}, (expected, devices)
    # the hybrid optimizer's own state mirrors its sub-optimizers' (megatron-core reads it in state_dict)
    device_param = next(p for p in model.parameters() if p not in hybrid.gpu_params_map_cpu_copy)
    assert hybrid.state[device_param]["exp_avg"].device.type == "meta"
