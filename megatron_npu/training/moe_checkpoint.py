"""Optimizer state across expert-parallel sizes.

megatron-core (0.16.1) puts the expert parameters in an optimizer of their own only when EP > 1
(``param.allreduce`` is False only for expert-parallel experts): an EP1 run has one optimizer,
an EP > 1 run a ChainedOptimizer of two. The tensors (exp_avg, exp_avg_sq, step) are saved under
the same per-parameter keys either way (``chained_optim_avoid_prefix``, checkpointing.py), but
the per-group hyperparameters are common state in the saved structure, which the other structure
cannot read. Across such a change the current optimizer's own groups are used: they differ only in
``is_expert_parallel`` and the learning rate, which the scheduler's load sets again.
"""

from __future__ import annotations

from typing import Any


def saved_optimizer_count(common_optimizer: Any) -> int:
    """How many optimizers the checkpoint's common state holds (a ChainedOptimizer saves a dict by index)."""
    if isinstance(common_optimizer, dict) and common_optimizer and all(isinstance(k, int) for k in common_optimizer):
        return len(common_optimizer)
    return 1


def adapt_optimizer_state(loaded: Any, optimizer: Any, saved_count: int) -> Any:
    """``loaded`` (dist_checkpointing's result for ``optimizer``) in the current optimizer's structure
    when the checkpoint was saved by a different number of optimizers: each sub-optimizer gets its own
    current param_groups and the saved common step (every parameter's Adam step is the same).

    dist_checkpointing returns the saved structure for common (non-tensor) entries and the current one
    for the tensors: each part keeps its tensors and takes the other common entries from a saved part.
    The step is ``state.common_step`` for torch's optimizer and each param group's ``step`` for
    megatron-core's DistributedOptimizer, whose groups sit under ``optimizer``."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if saved_count == len(chained):
        return loaded
    saved_parts = [loaded[i] for i in range(saved_count)] if saved_count > 1 else [loaded]
    current_parts = [loaded] if len(chained) == 1 else [loaded[i] for i in range(len(chained))]
    common = {k: v for k, v in saved_parts[0].items() if not isinstance(k, int) and k not in _PER_OPTIMIZER}
    adapted = []
    for sub, part in zip(chained, current_parts, strict=True):
        part = common | {key: value for key, value in part.items() if not isinstance(key, int)}
        own = sub.state_dict()
        if "optimizer" in own:  # DistributedOptimizer: param groups without params, the step in each
            step = next(g["step"] for p in saved_parts for g in p["optimizer"]["param_groups"] if "step" in g)
            groups = [group | {"step": step} for group in own["optimizer"]["param_groups"]]
            part["optimizer"] = own["optimizer"] | {"param_groups": groups}
        else:
            step = next((p["state"]["common_step"] for p in saved_parts if "common_step" in p.get("state", {})), None)
            part["state"] = dict(part.get("state", {}))
            if step is not None:
                part["state"]["common_step"] = step
            part["param_groups"] = own["param_groups"]
        adapted.append(part)
    return adapted[0] if len(chained) == 1 else dict(enumerate(adapted))


# entries each optimizer has of its own (its groups, its tensors), never copied from another one
_PER_OPTIMIZER = ("optimizer", "param_groups", "state", "param_state")
