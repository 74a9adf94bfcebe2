"""Optimizer: megatron-core's ``Tensor.type()`` checks, and the torch-AdamW fallback.

Without apex or Transformer Engine (always the case on npu and cpu) megatron-core
falls back to ``torch.optim.AdamW``. Two kinds of patch live here:

* ``.type()`` checks. ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``
  and ``clip_grad_by_total_norm_fp32`` compare ``param.type()`` with
  ``'torch.cuda.FloatTensor'`` and friends; on NPU the string reads
  ``'torch.npu.FloatTensor'``. Inside exactly those functions (a thread-local
  scope), ``Tensor.type()`` reports accelerator tensors under the CUDA name.
* Three faults of ``DistributedOptimizer`` with the torch fallback, found when
  resuming from dist-checkpoints: an empty inner state before
  ``sharded_state_dict(is_loading=True)`` (AssertionError), ``KeyError: 'step'``
  in ``_set_main_param_and_optimizer_states``, and one ``step`` tensor shared by
  every parameter after ``load_state_dict``: torch's foreach AdamW then steps it
  once per parameter, a silent drift of the bias correction on resume.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "optimizer"
DIST_OPT = "megatron.core.optimizer.distrib_optimizer"
FOREIGN_TYPE_PREFIX = "torch.cuda."

_type_scope = threading.local()


def _in_type_scope() -> bool:
    return getattr(_type_scope, "depth", 0) > 0


def _scoped(original: Callable) -> Callable:
    """Run ``original`` with Tensor.type() reporting CUDA names."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _type_scope.depth = getattr(_type_scope, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _type_scope.depth -= 1

    return wrapper


@register(
    "torch.Tensor.type.cuda_names",
    "torch:Tensor.type",
    reason="inside megatron's optimizer checks only, accelerator tensors report torch.cuda.*Tensor",
    subsystem=SUBSYSTEM,
)
def _tensor_type(original: Callable, accelerator: Accelerator) -> Callable:
    own_prefix = accelerator.tensor_type_prefix() + "."

    @functools.wraps(original)
    def type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: A001
        name = original(self, *args, **kwargs)
        if args or kwargs or not _in_type_scope():
            return name
        if name.startswith(own_prefix) and "." not in name[len(own_prefix) :]:
            return FOREIGN_TYPE_PREFIX + name[len(own_prefix) :]
        return name

    return type


for _target in (
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
    f"{DIST_OPT}:DistributedOptimizer._build_model_and_main_param_groups",
    f"{DIST_OPT}:DistributedOptimizer.__init__",
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
):
    register(
        f"{_target.replace(':', '.')}.type_check",
        _target,
        reason="compares param.type() with 'torch.cuda.*Tensor' and raises TypeError off CUDA",
        subsystem=SUBSYSTEM,
    )(lambda original, accelerator: _scoped(original))


def prime_torch_adam_state(optimizer: torch.optim.Optimizer) -> int:
    """Give every parameter of a torch Adam/AdamW an initial state; return how many."""
    primed = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if optimizer.state.get(param):
                continue
            state = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            optimizer.state[param] = state
            primed += 1
    return primed


def _uses_torch_adam(dist_opt: Any) -> bool:
    return isinstance(getattr(dist_opt, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))


@register(
    "distrib_optimizer.sharded_state_dict.prime_state",
    f"{DIST_OPT}:DistributedOptimizer.sharded_state_dict",
    reason="state_dict() asserts one 'step' over an empty torch AdamW state when loading into a fresh optimizer",
    subsystem=SUBSYSTEM,
)
def _sharded_state_dict(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if is_loading and _uses_torch_adam(self):
            prime_torch_adam_state(self.optimizer)
        return original(self, *args, **kwargs)

    return sharded_state_dict


def keep_source_keys(precision_aware_field: str) -> Callable[[Callable, Accelerator], Callable]:
    """The patch of ``_set_main_param_and_optimizer_states``: copy the checkpoint's keys into the optimizer state,
    not the destination's (torch AdamW's 'step' is not in the checkpoint: KeyError). ``precision_aware_field``:
    the config switch that routes to megatron-core's own path (its name changed in 0.13; release_fixes.py
    registers this for 0.12)."""

    def build(original: Callable, accelerator: Accelerator) -> Callable:
        @functools.wraps(original)
        def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict) -> None:
            if getattr(self.config, precision_aware_field):
                return original(self, model_param, tensors)
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            destination = {"param": main_param, **self.optimizer.state[main_param]}
            for key, value in tensors.items():
                if key in destination:
                    destination[key].copy_(value)
            return None

        return _set_main_param_and_optimizer_states

    return build


register(
    "distrib_optimizer._set_main_param_and_optimizer_states.source_keys",
    f"{DIST_OPT}:DistributedOptimizer._set_main_param_and_optimizer_states",
    reason="iterates the destination keys, which include torch AdamW's 'step' that the checkpoint drops (KeyError)",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.13.0,<0.20",  # reads config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 (new in 0.13)
)(keep_source_keys("use_precision_aware_optimizer_no_fp8_or_ds_fp8"))


def unshare_step_tensors(optimizer: torch.optim.Optimizer) -> int:
    """Give each parameter its own 'step' tensor; return how many were shared."""
    seen: set[int] = set()
    shared = 0
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                shared += 1
            seen.add(id(step))
            state["step"] = step.clone()
    return shared


@register(
    "distrib_optimizer.load_state_dict.unshare_step",
    f"{DIST_OPT}:DistributedOptimizer.load_state_dict",
    reason="assigns one shared 'step' tensor to every param; foreach AdamW then advances it once per param (silent drift)",
    subsystem=SUBSYSTEM,
)
def _load_state_dict(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        result = original(self, state_dict)
        if _uses_torch_adam(self):
            unshare_step_tensors(self.optimizer)
        return result

    return load_state_dict


@register(
    "optimizer.get_standard_config_overrides.is_decoupled_lr",
    "megatron.core.optimizer:get_standard_config_overrides",
    reason="the --decoupled-lr override leaves is_decoupled_lr False, the key groups are matched by on load: "
    "after a resume every parameter trains on the decoupled schedule (silent)",
    subsystem=SUBSYSTEM,
    megatron_versions=">=0.16.0,<0.20",  # get_standard_config_overrides first appears in 0.16
)
def _standard_overrides(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def get_standard_config_overrides(config: Any) -> Any:
        overrides = original(config)
        # megatron-core 0.16 adds exactly one override with "max_lr": the decoupled one. The
        # optimizer matches checkpointed groups by (wd_mult, lr_mult, is_expert_parallel,
        # is_decoupled_lr): unmarked, the decoupled and default groups share a key.
        for override in overrides.values():
            if "max_lr" in override:
                override["is_decoupled_lr"] = True
        return overrides

    return get_standard_config_overrides
