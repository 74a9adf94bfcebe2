"""megatron-core's CPU-offloading optimizer (``--optimizer-cpu-offload``) told device parameters by the accelerator.

``HybridDeviceOptimizer`` (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py) splits the parameters
between a host sub-optimizer and a device one: the first ``offload_fraction`` (by element count) of the *device*
parameters get pinned host copies that the host optimizer steps, the rest stay with the device optimizer. It asks
``param.is_cuda`` which parameters are on the device, and that is False for an npu tensor (and for every tensor on
the cpu target, whose device is the host): megatron-core then sees no device parameter at all, offloads none,
hands every device parameter to the host optimizer without a device twin, and its first step raises
``KeyError`` in ``cpu_copys_map_gpu_param`` (megatron-core's own test_optimizer_cpu_offloading.py, 66 tests on
the cpu target). Loading a state has the same blind spot: ``_move_new_state_to_right_device`` moves a state to
the host when its optimizer is an instance of the host class, and without Transformer Engine both sub-optimizers
are torch's AdamW (``get_megatron_optimizer``: ``Adam`` and ``CPUAdam`` are one class), so the device optimizer's
state went to the host too.

Replaced: ``HybridDeviceOptimizer._get_sub_optimizer_param_groups`` (the split, asking the accelerator whether a
parameter is a device one) and ``_move_new_state_to_right_device`` (a state goes where its sub-optimizer steps:
the host sub-optimizers' to the host, the device one's to the accelerator's device). The split itself is
megatron-core's: the same threshold, order, pinned copies and fp32 master copies. 0.12-0.19 share both methods
(the module appeared in 0.12); on CUDA nothing here applies.

RL's optimizer offload (megatron/rl/rl_utils.py frees the optimizer's memory for the inference phase):
``MegatronOptimizer.offload_to_cpu`` moves the parameters and state tensors that are ``.is_cuda`` to the host. No npu
tensor is ``is_cuda``: the offload moved nothing and freed nothing, silently (the inference phase ran with the
optimizer's whole memory held). Replaced: ``offload_to_cpu`` (``ChainedOptimizer``'s calls each optimizer's), with
megatron-core's loops asking the accelerator (``is_device_tensor``) and its cache released through the accelerator.
Its twin ``restore_from_cpu`` is right as it is: it calls ``.cuda()`` on every tensor that is not ``is_cuda``, which
``patches/device_arguments.py`` sends to the accelerator's device (a device tensor's is itself). Both appear in 0.15
and are the same to 0.19 (read in the 0.15.3, 0.17.1, 0.18.2 and 0.19.2 wheels; 0.12-0.14 have none).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "optimizer"
RELEASES = ">=0.12.0,<0.20"
_HYBRID = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer"
_OPTIMIZER = "megatron.core.optimizer.optimizer:MegatronOptimizer"
OFFLOAD_RELEASES = ">=0.15.0,<0.20"  # MegatronOptimizer.offload_to_cpu: new in 0.15 (RL), the same to 0.19
HOST = torch.device("cpu")


def offloaded_params(
    params: Iterable[torch.Tensor], offload_fraction: float, on_device: Callable[[torch.Tensor], bool]
) -> list[torch.Tensor]:
    """The device parameters megatron-core offloads: in order, while fewer than ``offload_fraction`` of the device
    parameters' elements are offloaded (its threshold, so the last one may cross it)."""
    params = list(params)
    threshold = offload_fraction * sum(p.numel() for p in params if on_device(p))
    chosen, numel = [], 0
    for param in params:
        if numel < threshold and on_device(param):
            chosen.append(param)
            numel += param.numel()
    return chosen


@dataclass
class SubOptimizerGroups:
    """What ``_get_sub_optimizer_param_groups`` returns, in its order."""

    cpu_param_groups: list[dict] = field(default_factory=list)
    gpu_param_groups: list[dict] = field(default_factory=list)
    gpu_params_map_cpu_copy: dict = field(default_factory=dict)
    cpu_copys_map_gpu_param: dict = field(default_factory=dict)
    param_to_fp32_param: dict = field(default_factory=dict)

    def as_tuple(self) -> tuple:
        return (
            self.cpu_param_groups,
            self.gpu_param_groups,
            self.gpu_params_map_cpu_copy,
            self.cpu_copys_map_gpu_param,
            self.param_to_fp32_param,
        )


def split_param_groups(
    param_groups: list[dict], offload_fraction: float, in_fp32: bool, accelerator: Accelerator
) -> SubOptimizerGroups:
    """Each group split into its host part (offloaded copies, host parameters) and its device part."""
    on_device = accelerator.is_device_tensor
    offloaded = {
        id(p) for p in offloaded_params((p for g in param_groups for p in g["params"]), offload_fraction, on_device)
    }
    split = SubOptimizerGroups()
    for group in param_groups:
        host, device = {**group, "params": []}, {**group, "params": []}
        for param in group["params"]:
            inner = param
            if id(param) in offloaded:
                inner = accelerator.pin_memory(param.detach().clone().cpu())
            if in_fp32 and inner.dtype != torch.float32:
                inner = inner.detach().clone().float()
                split.param_to_fp32_param[param] = inner
            if id(param) in offloaded:
                split.gpu_params_map_cpu_copy[param] = inner
                split.cpu_copys_map_gpu_param[inner] = param
            stepped_on_device = id(param) not in offloaded and on_device(param)
            (device if stepped_on_device else host)["params"].append(inner)
        split.gpu_param_groups += [device] if device["params"] else []
        split.cpu_param_groups += [host] if host["params"] else []
    return split


@register(
    "optimizer.HybridDeviceOptimizer.sub_optimizer_param_groups",
    f"{_HYBRID}._get_sub_optimizer_param_groups",
    reason="tells device parameters by param.is_cuda, False for npu (and cpu-target) tensors: none is offloaded, "
    "every device parameter lands in the host optimizer without a device twin (KeyError in "
    "cpu_copys_map_gpu_param on the first step); the accelerator says which tensors are device tensors",
    subsystem=SUBSYSTEM,
    megatron_versions=RELEASES,
)
def _sub_optimizer_param_groups(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def get_sub_optimizer_param_groups(self: Any, offload_fraction: float) -> tuple:
        return split_param_groups(
            self.param_groups, offload_fraction, self.param_update_in_fp32, accelerator
        ).as_tuple()

    return get_sub_optimizer_param_groups


@register(
    "optimizer.HybridDeviceOptimizer.move_new_state_to_right_device",
    f"{_HYBRID}._move_new_state_to_right_device",
    reason="after a load, moves a sub-optimizer's state to the host when the optimizer is an instance of the host "
    "class, and without TE both are torch AdamW: the device optimizer's state went to the host; each state now "
    "goes where its sub-optimizer steps (the host ones' to the host, the device one's to the accelerator)",
    subsystem=SUBSYSTEM,
    megatron_versions=RELEASES,
)
def _move_new_state(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def move_new_state_to_right_device(self: Any) -> None:
        place_states(self, accelerator)

    return move_new_state_to_right_device


def place_states(hybrid: Any, accelerator: Accelerator) -> None:
    """Each sub-optimizer's state tensors where it steps (the host sub-optimizers' on the host, the device one's on
    the accelerator's device), mirrored in the hybrid optimizer's own state as megatron-core keeps it."""
    for optimizer in hybrid.sub_optimizers:
        target = accelerator.device() if optimizer is hybrid.gpu_optimizer else HOST
        for param, state in optimizer.state.items():
            orig_param = hybrid.inner_param_to_orig_param.get(param, param)
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    hybrid.state[orig_param][key] = state[key] = value.to(target)


def move_optimizer_tensors(
    optimizer: torch.optim.Optimizer, select: Callable[[torch.Tensor], bool], target: torch.device
) -> None:
    """megatron-core's two loops: each parameter (its ``.data``, so every reference to it stays valid) and each state
    tensor that ``select`` picks, moved to ``target``."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, torch.Tensor) and select(param):
                param.data = param.data.to(target)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and select(value):
                state[key] = value.to(target)


def _holds_optimizer(wrapper: Any) -> bool:
    """megatron-core's guard: a wrapper with a torch optimizer of its own that is not a stub (a rank with no
    parameters in that group)."""
    return getattr(wrapper, "optimizer", None) is not None and not getattr(wrapper, "is_stub_optimizer", False)


def _log(message: str) -> None:
    from megatron.core.utils import log_single_rank

    log_single_rank(logging.getLogger("megatron.core.optimizer.optimizer"), logging.INFO, message)


@register(
    "optimizer.MegatronOptimizer.offload_to_cpu",
    f"{_OPTIMIZER}.offload_to_cpu",
    reason="RL's offload moves the optimizer's .is_cuda tensors to the host; no npu tensor is is_cuda, so it moved "
    "nothing and freed nothing; the accelerator says which tensors are in device memory",
    subsystem=SUBSYSTEM,
    megatron_versions=OFFLOAD_RELEASES,
)
def _offload_to_cpu(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def offload_to_cpu(self: Any) -> None:
        if _holds_optimizer(self):
            _log("[OFFLOAD] moving optimizer state to CPU")
            move_optimizer_tensors(self.optimizer, accelerator.is_device_tensor, HOST)
            accelerator.empty_cache()

    return offload_to_cpu
