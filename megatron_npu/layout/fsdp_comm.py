"""FSDP's communication and per-rank state per sharding unit (a transformer layer), no torch.

Counted from megatron-core 0.16.1's source (fsdp/src/megatron_fsdp, torch_fully_sharded_data_parallel)
and torch 2.x FSDP2, in the planner's conventions (megatron_npu/layout/planner.py): the *payload*
of an all-gather is the rank's input shard, of a reduce-scatter or all-reduce the full input; the
*wire* bytes are what a ring makes the rank send (all-gather (g-1) x shard, reduce-scatter
(g-1)/g x N, all-reduce 2(g-1)/g x N). A unit's flat buffer is padded to a multiple of the group size.

Per training iteration of ``microbatches`` micro-batches, for one unit of ``numel`` parameters on a
data-parallel (x context-parallel) group of ``dp`` ranks:

* Megatron-FSDP ``no_shard``: one gradient all-reduce (the last micro-batch's backward).
* ``optim``: one gradient reduce-scatter (last micro-batch), one parameter all-gather after the step.
* ``optim_grads``: a gradient reduce-scatter every micro-batch, one parameter all-gather after the step.
* ``optim_grads_params``: every micro-batch a parameter all-gather before the unit's forward and again
  before its backward (the unit is resharded after forward), a gradient reduce-scatter; plus the
  all-gather after the step. Units that are not FSDP units (embedding, output layer) are gathered once
  after the step and stay whole through the iteration.
* torch FSDP2 (``fully_shard``): every micro-batch an all-gather before forward, another before backward
  when resharded after forward (never for the root module), and a reduce-scatter.

Not yet checked against a measured run (``megatron_npu.perf.comm.CommCounter``); the planner should
treat these as the model until a test compares them.
"""

from __future__ import annotations

from dataclasses import dataclass

MEGATRON_FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
#: Adam's two moments in fp32, per parameter
ADAM_STATE_BYTES = 8


@dataclass(frozen=True)
class FsdpCollective:
    unit: str
    op: str  # all_gather | reduce_scatter | all_reduce
    phase: str  # forward | backward | step
    count: int  # calls per iteration
    payload_bytes: int  # per call
    wire_bytes: int  # per call


def padded(numel: int, dp: int) -> int:
    """The flat buffer's length: a multiple of the group size, so every rank's shard is equal."""
    return -(-numel // dp) * dp


def _gather(unit: str, phase: str, count: int, numel: int, dp: int, element_bytes: int) -> FsdpCollective:
    shard = padded(numel, dp) // dp * element_bytes
    return FsdpCollective(unit, "all_gather", phase, count, shard, (dp - 1) * shard)


def _scatter(unit: str, count: int, numel: int, dp: int, element_bytes: int) -> FsdpCollective:
    full = padded(numel, dp) * element_bytes
    return FsdpCollective(unit, "reduce_scatter", "backward", count, full, (dp - 1) * full // dp)


def _all_reduce(unit: str, count: int, numel: int, dp: int, element_bytes: int) -> FsdpCollective:
    full = numel * element_bytes
    return FsdpCollective(unit, "all_reduce", "backward", count, full, 2 * (dp - 1) * full // dp)


def megatron_fsdp_unit(
    unit: str,
    numel: int,
    dp: int,
    microbatches: int,
    strategy: str,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    fsdp_unit: bool = True,
) -> list[FsdpCollective]:
    """Megatron-FSDP's collectives for one unit per iteration (``fsdp_unit``: a TransformerLayer,
    which ``optim_grads_params`` gathers just in time; False for the embedding and output layer)."""
    if strategy not in MEGATRON_FSDP_STRATEGIES:
        raise ValueError(f"unknown sharding strategy {strategy!r}; one of {', '.join(MEGATRON_FSDP_STRATEGIES)}")
    if dp == 1:
        return []
    if strategy == "no_shard":
        return [_all_reduce(unit, 1, numel, dp, grad_bytes)]
    every_microbatch = strategy in ("optim_grads", "optim_grads_params")
    items = [
        _scatter(unit, microbatches if every_microbatch else 1, numel, dp, grad_bytes),
        _gather(unit, "step", 1, numel, dp, param_bytes),
    ]
    if strategy == "optim_grads_params" and fsdp_unit:
        items += [
            _gather(unit, "forward", microbatches, numel, dp, param_bytes),
            _gather(unit, "backward", microbatches, numel, dp, param_bytes),
        ]
    return items


def torch_fsdp2_unit(
    unit: str,
    numel: int,
    dp: int,
    microbatches: int,
    root: bool = False,
    reshard_after_forward: bool = True,
    param_bytes: int = 4,
    grad_bytes: int = 4,
) -> list[FsdpCollective]:
    """torch FSDP2's collectives for one ``fully_shard`` unit per iteration."""
    if dp == 1:
        return []
    items = [
        _gather(unit, "forward", microbatches, numel, dp, param_bytes),
        _scatter(unit, microbatches, numel, dp, grad_bytes),
    ]
    if reshard_after_forward and not root:
        items.append(_gather(unit, "backward", microbatches, numel, dp, param_bytes))
    return items


def state_bytes_per_rank(
    numel: int, dp: int, strategy: str, param_bytes: int = 4, grad_bytes: int = 4, main_param_bytes: int = 4
) -> dict[str, int]:
    """Per-rank parameter, gradient and Adam-state bytes of ``numel`` parameters under a scheme:
    ``ddp``, ``dist_opt``, a Megatron-FSDP strategy or ``torch_fsdp2`` (shards like
    ``optim_grads_params``). fp32 main parameters are counted only where the model's are not fp32."""
    full, shard = padded(numel, dp), padded(numel, dp) // dp
    sharded = {
        "ddp": (False, False, False),
        "dist_opt": (False, False, True),
        "no_shard": (False, False, False),
        "optim": (False, False, True),
        "optim_grads": (False, True, True),
        "optim_grads_params": (True, True, True),
        "torch_fsdp2": (True, True, True),
    }
    if strategy not in sharded:
        raise ValueError(f"unknown scheme {strategy!r}; one of {', '.join(sharded)}")
    params_sharded, grads_sharded, optim_sharded = sharded[strategy]
    main = main_param_bytes if param_bytes != main_param_bytes else 0
    return {
        "params": (shard if params_sharded else full) * param_bytes,
        "grads": (shard if grads_sharded else full) * grad_bytes,
        "optimizer": (shard if optim_sharded else full) * (ADAM_STATE_BYTES + main),
    }


def totals(items: list[FsdpCollective]) -> dict[str, int]:
    """Payload and wire bytes per iteration, summed over calls."""
    return {
        "payload_bytes": sum(item.count * item.payload_bytes for item in items),
        "wire_bytes": sum(item.count * item.wire_bytes for item in items),
        "calls": sum(item.count for item in items),
    }
