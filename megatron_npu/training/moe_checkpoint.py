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
    current param_groups and the saved common step (every parameter's Adam step is the same)."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if saved_count == len(chained):
        return loaded
    saved_parts = [loaded[i] for i in range(saved_count)] if saved_count > 1 else [loaded]
    common_step = next((p["state"]["common_step"] for p in saved_parts if "common_step" in p.get("state", {})), None)
    current_parts = [loaded] if len(chained) == 1 else [loaded[i] for i in range(len(chained))]
    adapted = []
    for sub, part in zip(chained, current_parts, strict=True):
        part = {key: value for key, value in part.items() if not isinstance(key, int)}
        part["state"] = dict(part.get("state", {}))
        if common_step is not None:
            part["state"]["common_step"] = common_step
        part["param_groups"] = sub.state_dict()["param_groups"]
        adapted.append(part)
    return adapted[0] if len(chained) == 1 else dict(enumerate(adapted))
