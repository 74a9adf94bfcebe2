"""megatron_npu/patches/optimizer_cpu_offload.py: megatron-core's HybridDeviceOptimizer (--optimizer-cpu-offload) told
device parameters by the accelerator, not by ``param.is_cuda`` (False for an npu tensor, as for every tensor on the
cpu target). Found by megatron-core's own test_optimizer_cpu_offloading.py (66 tests on the cpu target: KeyError in
cpu_copys_map_gpu_param). In process, a few seconds.

The npu answer is checked with an accelerator stand-in whose device is torch's ``meta`` device: like an npu tensor, a
meta tensor is not ``is_cuda`` and is not a host tensor, and the stand-in answers ``is_device_tensor`` with the
accelerator interface's own code, which NpuAccelerator inherits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.optim import SGD, AdamW

import megatron_npu  # noqa: F401  (patches on import)
from megatron_npu.accelerator.base import Accelerator
from megatron_npu.accelerator.cpu import CpuAccelerator
from megatron_npu.accelerator.npu import NpuAccelerator
from megatron_npu.patches.optimizer_cpu_offload import (
    _offload_to_cpu,
    move_optimizer_tensors,
    offloaded_params,
    place_states,
    split_param_groups,
)
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


# --- MegatronOptimizer.offload_to_cpu (RL) ---------------------------------------------------------------------------


class DeviceWithData(CpuAccelerator):
    """Answers as npu does, on a device whose tensors hold data: torch's lazy tensors (TorchScript backend, run on the
    host) are not is_cuda, not host tensors, and copy to the host and back; a meta tensor has no data to offload.
    Its ``is_device_tensor`` is the accelerator interface's own code, which NpuAccelerator inherits."""

    device_type = "lazy"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.device_type)


@pytest.fixture(scope="module")
def lazy_device() -> DeviceWithData:
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return DeviceWithData()


def _wrapped_adam_with_device_state(device: torch.device) -> tuple[SimpleNamespace, AdamW, torch.nn.Module]:
    """A MegatronOptimizer's view for offload_to_cpu (its torch optimizer as ``.optimizer``) after one step, with the
    step's state moved to ``device``. The parameters stay on the host: a lazy tensor cannot back a host parameter's
    ``.data`` (megatron-core's parameter loop, the same selection, runs on the cpu target below)."""
    model = _net()
    adam = AdamW(model.parameters(), lr=0.01)
    _steps(model, adam, 1)
    for state in adam.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = state[key].to(device)
    return SimpleNamespace(optimizer=adam), adam, model


def _state_devices(adam: AdamW) -> set[str]:
    return {v.device.type for state in adam.state.values() for k, v in state.items() if k != "step"}


def _optimizer_class() -> type:
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    return MegatronOptimizer


def test_offload_moves_device_state_that_is_not_is_cuda(lazy_device):
    """megatron-core's offload_to_cpu moved only .is_cuda tensors: on npu none, so nothing was freed. Patched, the
    accelerator's device tensors go to the host, with their values; the host parameters stay as they are."""
    original = REGISTRY.original_attribute(_optimizer_class(), "offload_to_cpu")
    wrapper, adam, _ = _wrapped_adam_with_device_state(lazy_device.device())
    original(wrapper)
    assert _state_devices(adam) == {"lazy"}  # what megatron-core did on npu: nothing moved

    wrapper, adam, model = _wrapped_adam_with_device_state(lazy_device.device())
    before = {id(p): {k: v.cpu() for k, v in s.items()} for p, s in adam.state.items()}
    storage = [p.data_ptr() for p in model.parameters()]
    offload_to_cpu = _offload_to_cpu(original, lazy_device)
    offload_to_cpu(wrapper)
    assert _state_devices(adam) == {"cpu"}
    for param, state in adam.state.items():
        for key, value in state.items():
            torch.testing.assert_close(value, before[id(param)][key], rtol=0, atol=0)
    assert [p.data_ptr() for p in model.parameters()] == storage  # host parameters: not selected, not copied


def test_offload_leaves_a_stub_optimizer_alone(lazy_device):
    """megatron-core's guard: a stub (a rank without parameters in that group) or a wrapper without an optimizer."""
    offload_to_cpu = _offload_to_cpu(REGISTRY.original_attribute(_optimizer_class(), "offload_to_cpu"), lazy_device)
    wrapper, adam, _ = _wrapped_adam_with_device_state(lazy_device.device())
    wrapper.is_stub_optimizer = True
    offload_to_cpu(wrapper)
    assert _state_devices(adam) == {"lazy"}
    offload_to_cpu(SimpleNamespace(optimizer=None))


def test_selected_parameters_move_by_data(lazy_device):
    """megatron-core's parameter loop: a selected parameter keeps its identity (DDP's buffers and the param groups
    hold it) and gets its data moved; a state tensor is replaced in its state dict."""
    model = _net()
    adam = AdamW(model.parameters(), lr=0.01)
    _steps(model, adam, 1)
    first = next(model.parameters())
    moved: list[torch.Tensor] = []

    def pick(tensor: torch.Tensor) -> bool:
        moved.append(tensor)
        return tensor is first

    move_optimizer_tensors(adam, pick, torch.device("cpu"))
    assert next(model.parameters()) is first and adam.param_groups[0]["params"][0] is first
    assert len(moved) == len(list(model.parameters())) + sum(len(s) for s in adam.state.values())


def test_offload_is_the_patched_one_for_every_megatron_optimizer():
    """ChainedOptimizer calls each optimizer's offload_to_cpu: the mixed-precision and distributed optimizers inherit
    MegatronOptimizer's, which is the patched one."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    patched = _optimizer_class().offload_to_cpu
    assert patched is not REGISTRY.original_attribute(_optimizer_class(), "offload_to_cpu")
    for cls in (DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer):
        assert cls.offload_to_cpu is patched
