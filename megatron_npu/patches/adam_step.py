"""The torch Adam fallback's missing ``step``: megatron-core writes Apex/TE FusedAdam's state layout into torch's Adam.

Without Apex or Transformer Engine (always so on npu and cpu) megatron-core builds ``torch.optim.AdamW``,
but its ``init_state_fn`` for Adam still writes what FusedAdam keeps per parameter, ``exp_avg`` and
``exp_avg_sq``: FusedAdam counts steps in its param groups, torch's Adam in each parameter's state, and
takes a non-empty state without ``step`` for a broken one. Every reader of such a state then fails with
``KeyError: 'step'``: the distributed optimizer's ``state_dict`` (which collects the torch step from the
per-parameter states), torch's ``load_state_dict`` (``Adam.__setstate__``) under the mixed-precision and
fp32 optimizers, and torch's next ``step()`` (``Adam._init_group``). Found by megatron-core's own
``dist_checkpointing/test_optimizer.py`` (64 failures: its helper initialises the state as
``init_state_fn`` does) and ``test_layer_wise_optimizer.py::test_layer_wise_optimizer_step`` (a step after it).
The saved state reads as the loaded one: the mixed-precision and fp32 optimizers' ``state_dict`` completes too
(``test_optimizer_common_state_dict``'s save/reload comparison). On 0.12-0.19 the code is the same; with TE or Apex
nothing here applies.

The answer is torch's own: a parameter whose state has no ``step`` has not been stepped, step 0
(``torch.optim.Adam`` starts each state at 0.0 and counts from there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megatron_npu.accelerator.base import Accelerator
from megatron_npu.registry import register

SUBSYSTEM = "optimizer"
RELEASES = ">=0.12.0,<0.20"  # init_state_fn and the readers below read alike on 0.12.1 ... 0.19.2
_OPTIMIZER = "megatron.core.optimizer.optimizer"
_DIST_OPT = "megatron.core.optimizer.distrib_optimizer"


def is_torch_adam(optimizer: Any) -> bool:
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def complete_steps(states: Iterable[Any]) -> int:
    """Give every non-empty per-parameter Adam state without ``step`` torch's initial one; return how many."""
    completed = 0
    for state in states:
        if isinstance(state, dict) and state and "step" not in state:
            state["step"] = torch.tensor(0.0)
            completed += 1
    return completed


@register(
    "distrib_optimizer.state_dict.torch_adam_step",
    f"{_DIST_OPT}:DistributedOptimizer.state_dict",
    reason="without Apex/TE reads s['step'] from every torch Adam state, which megatron-core's own init_state_fn "
    "leaves out (FusedAdam's layout): KeyError 'step' on save; a state without step is an unstepped one (0); and "
    "asserts one step where a DP shard holds no parameter (none): its groups keep their loaded step (0 before)",
    subsystem=SUBSYSTEM,
    megatron_versions=RELEASES,
)
def _dist_state_dict(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def state_dict(self: Any) -> Any:
        inner = getattr(self, "optimizer", None)
        if is_torch_adam(inner):
            complete_steps(inner.state.values())
            if holds_no_parameters(inner):
                return _with_shard_step(original, self, inner)
        return original(self)

    return state_dict


class _ShardStep:
    """The step megatron-core reads from a torch state (``.item()``), for a shard that holds no parameter."""

    def __init__(self, value: float) -> None:
        self.value = value

    def item(self) -> float:
        return self.value


def holds_no_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """A DP shard that holds no parameter (a small model's padded tail): its torch Adam has no state at all."""
    return not any(group["params"] for group in optimizer.param_groups)


def _with_shard_step(original: Callable, dist_opt: Any, inner: torch.optim.Optimizer) -> Any:
    """megatron-core's state_dict asserts exactly one step among the torch states, and a shard without parameters
    has none (under TE/Apex it allows none). Its groups keep the step they were loaded with, 0 before any load: the
    value is inert there (no state to step), and never saved (only DP rank 0's groups are, the common state, and DP
    rank 0 always holds parameters); sharded_state_dict(is_loading=True) loads it back into the same groups."""
    carried = next((group["step"] for group in inner.param_groups if group.get("step") is not None), 0.0)
    packed_state_dict = inner.state_dict

    def state_dict_with_shard_step() -> dict:
        packed = packed_state_dict()
        packed["state"] = {None: {"step": _ShardStep(float(carried))}}  # dropped with "state" once read
        return packed

    inner.state_dict = state_dict_with_shard_step  # type: ignore[method-assign]
    try:
        return original(dist_opt)
    finally:
        del inner.state_dict


def _incoming_states(state_dict: Any) -> Iterable[Any]:
    """The per-parameter states of a megatron optimizer's state dict (``optimizer`` / ``optimizer_state_dict``
    wrapping torch's, or torch's own), less the ``common_step`` megatron-core keeps beside them."""
    if not isinstance(state_dict, dict):
        return ()
    inner = state_dict.get("optimizer", state_dict.get("optimizer_state_dict", state_dict))
    states = inner.get("state", {}) if isinstance(inner, dict) else {}
    return (value for key, value in states.items() if key != "common_step")


def _completing_load(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        if is_torch_adam(getattr(self, "optimizer", None)):
            complete_steps(_incoming_states(state_dict))  # a common_step, where saved, still wins
        return original(self, state_dict)

    return load_state_dict


for _owner in ("Float16OptimizerWithFloat16Params", "FP32Optimizer"):
    register(
        f"optimizer.{_owner}.load_state_dict.torch_adam_step",
        f"{_OPTIMIZER}:{_owner}.load_state_dict",
        reason="hands torch Adam a state without 'step' (init_state_fn's FusedAdam layout; a save before the first "
        "step keeps no common_step, 'if step:' drops 0): Adam.__setstate__ raises KeyError 'step'; completed with 0",
        subsystem=SUBSYSTEM,
        megatron_versions=RELEASES,
    )(_completing_load)


def _completing_state_dict(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        if is_torch_adam(getattr(self, "optimizer", None)):
            complete_steps(self.optimizer.state.values())
        return original(self, *args, **kwargs)

    return state_dict


# A loaded state is completed (above), so the saved one must read the same: megatron-core's suite compares an
# optimizer's state_dict before a save with its reload's (dist_checkpointing/test_layer_wise_optimizer.py::
# test_optimizer_common_state_dict, check_equal: the same keys).
for _owner in ("Float16OptimizerWithFloat16Params", "FP32Optimizer"):
    register(
        f"optimizer.{_owner}.state_dict.torch_adam_step",
        f"{_OPTIMIZER}:{_owner}.state_dict",
        reason="returns init_state_fn's states without 'step' (FusedAdam's layout) while the same state loaded back "
        "has one (torch Adam needs it): a save and its reload differ by the key; an unstepped state reads step 0",
        subsystem=SUBSYSTEM,
        megatron_versions=RELEASES,
    )(_completing_state_dict)


def _completing_step(original: Callable, accelerator: Accelerator) -> Callable:
    @functools.wraps(original)
    def step_with_ready_grads(self: Any) -> Any:
        if is_torch_adam(getattr(self, "optimizer", None)):
            complete_steps(self.optimizer.state.values())
        return original(self)

    return step_with_ready_grads


# DistributedOptimizer.step_with_ready_grads steps through MixedPrecisionOptimizer's (super()).
for _owner in ("MixedPrecisionOptimizer", "FP32Optimizer"):
    register(
        f"optimizer.{_owner}.step_with_ready_grads.torch_adam_step",
        f"{_OPTIMIZER}:{_owner}.step_with_ready_grads",
        reason="steps torch Adam over the states init_state_fn wrote (FusedAdam's layout, no 'step'): "
        "Adam._init_group raises KeyError 'step' on the first step after it; completed with 0 first",
        subsystem=SUBSYSTEM,
        megatron_versions=RELEASES,  # the same step_with_ready_grads and init_state_fn on 0.12.1 ... 0.19.2
    )(_completing_step)
