"""FSDP's communication and per-rank state per sharding unit (a transformer layer), no torch.

Counted from megatron-core 0.16.1's source (fsdp/src/megatron_fsdp, torch_fully_sharded_data_parallel)
and torch 2.x FSDP2, in the planner's conventions (megatron_npu/layout/planner.py): the *payload*
of an all-gather is the rank's input shard, of a reduce-scatter or all-reduce the full input; the
*wire* bytes are what a ring makes the rank send (all-gather (g-1) x shard, reduce-scatter
(g-1)/g x N, all-reduce 2(g-1)/g x N). A unit's flat buffer is padded to a multiple of the group size.

Per training iteration of ``microbatches`` micro-batches, for one unit of ``numel`` parameters on a
data-parallel (x context-parallel) group of ``dp`` ranks:

A unit is what is reduced and gathered in one call: plan_cp_fsdp.fsdp_units says which parameters form one.

* Megatron-FSDP ``no_shard``: one gradient all-reduce (the last micro-batch's backward).
* ``optim``: one gradient reduce-scatter (last micro-batch), one parameter all-gather after the step.
* ``optim_grads``: a gradient reduce-scatter every micro-batch, one parameter all-gather after the step.
* ``optim_grads_params``: every micro-batch a parameter all-gather for the unit's forward and another for
  its backward (the unit is resharded after forward), a gradient reduce-scatter; plus the all-gather
  after the step, whose weights the first micro-batch's forward uses (no gather of its own). Units that
  are not FSDP units (embedding, output layer) are gathered once after the step and stay whole through
  the iteration. Counted with CommCounter on megatron-core 0.16.1 (cpu, gloo, DP2, 2 micro-batches, 2
  and 4 layers): calls equal, bytes 0.2-0.4% above this model (Megatron-FSDP pads a layer's bucket
  beyond a multiple of the group size; the padding is not modelled).
* torch FSDP2 (``fully_shard``): every micro-batch an all-gather before forward, another before backward
  when resharded after forward, and a reduce-scatter. megatron-core passes ``reshard_after_forward``
  explicitly to every ``fully_shard``, the root's included, so torch's rule of keeping the root gathered
  (it applies only when the argument is left unset) never holds there: the root is gathered twice too.
  Counted with CommCounter on megatron-core 0.16.1 (cpu, gloo, DP2, 2 micro-batches, 4 layers): calls and
  bytes equal to this model.

The other strategies were counted the same way (plan_cp_fsdp.py gives the figures). The per-rank state
(``state_bytes_per_rank``) is checked against benchmarks/fsdp_memory.py's measured figures.
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
            _gather(unit, "forward", microbatches - 1, numel, dp, param_bytes),  # the first: the step's gather
            _gather(unit, "backward", microbatches, numel, dp, param_bytes),
        ]
    return items


def torch_fsdp2_unit(
    unit: str,
    numel: int,
    dp: int,
    microbatches: int,
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
    if reshard_after_forward:
        items.append(_gather(unit, "backward", microbatches, numel, dp, param_bytes))
    return items


def state_bytes_per_rank(
    numel: int,
    dp: int,
    strategy: str,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    main_param_bytes: int = 4,
    moment_bytes: int = ADAM_STATE_BYTES,
) -> dict[str, int]:
    """Per-rank parameter, gradient and optimizer-state bytes of ``numel`` parameters under a scheme:
    ``ddp``, ``dist_opt``, a Megatron-FSDP strategy or ``torch_fsdp2`` (shards like
    ``optim_grads_params``). The fp32 main parameters count as optimizer state, sharded with it:
    Megatron-FSDP keeps them in its ``main_weight_buffer`` whatever the model's dtype (measured:
    benchmarks/fsdp_memory.py, fp32), the others only where the model's parameters are not fp32.
    ``moment_bytes``: Adam's two fp32 moments (SGD's momentum: 4)."""
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
    keeps_main = strategy in MEGATRON_FSDP_STRATEGIES or param_bytes != main_param_bytes
    main = main_param_bytes if keeps_main else 0
    return {
        "params": (shard if params_sharded else full) * param_bytes,
        "grads": (shard if grads_sharded else full) * grad_bytes,
        "optimizer": (shard if optim_sharded else full) * (moment_bytes + main),
    }


def totals(items: list[FsdpCollective]) -> dict[str, int]:
    """Payload and wire bytes per iteration, summed over calls."""
    return {
        "payload_bytes": sum(item.count * item.payload_bytes for item in items),
        "wire_bytes": sum(item.count * item.wire_bytes for item in items),
        "calls": sum(item.count for item in items),
    }
