"""The planner's context-parallel and FSDP rows (megatron_npu/layout/planner.py calls these).

The arithmetic is cp_comm.py's (``cp_calls``: each call one layer's core attention makes) and
fsdp_comm.py's (each unit's all-gathers, reduce-scatters and all-reduces per iteration); this module
only places those calls on a rank's groups, under the labels ``CommCounter`` records them with
(megatron_npu/perf/comm.py's ``megatron_groups``):

* ``cp``: the CP group (``--cp-comm-type p2p``: the ring's send/recv; ``a2a``: the all-to-alls);
* ``cp_a2a`` / ``cp_ring``: the two levels of ``a2a+p2p`` (``--hierarchical-context-parallel-sizes
  A P``): megatron-core's ``create_hierarchical_groups`` puts A consecutive members of a CP group in
  an all-to-all group and members A apart in a ring;
* FSDP's collectives on ``dp_cp`` (megatron-core hands both Megatron-FSDP and FSDP2 the data-parallel
  group with context parallelism), instead of DDP's bucket reductions.

Megatron-FSDP units (``fsdp_units``): under ``optim_grads_params`` each transformer layer is one unit,
gathered just in time, and the rest of the chunk one bucket gathered once after the step; under the
other strategies the whole chunk is one bucket (``--ddp-bucket-size`` cuts it). FSDP2 units are
megatron-core's ``TorchFullyShardedDataParallel`` defaults for the local transformer (the only one here:
it leaves ColumnParallelLinear out): each TransformerLayer, the embedding, and the root (what is left:
the final norm and the output layer). Checked against CommCounter on cpu runs (pretrain_gpt.py, 4
layers, 2 micro-batches, DP2, fp32): the CP ring's rows equal a TP2 x CP2 run's counted bytes
(tests/perf/test_perf_report.py); Megatron-FSDP calls counted = planned under every strategy
(``no_shard`` 1, ``optim`` 2, ``optim_grads`` 3, and 27 with ``--ddp-bucket-size 20000``,
``optim_grads_params`` 27), bytes equal for ``no_shard`` and 0.05-0.35% above the plan otherwise (bucket
padding); FSDP2 37 calls and 3,758,084 bytes, counted = planned (with the gradient norm's all-reduce
over the DTensor gradients' DP group, which the planner adds beside the model-parallel one); MoE with EP2
x Megatron-FSDP on 4 ranks (``optim_grads_params``): the experts' units over expert DP 2 counted = planned
(2,097,152 bytes), the dense ones over DP 4 0.11% above. The a2a+p2p levels are unchecked.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from megatron_npu.layout.cp_comm import cp_calls
from megatron_npu.layout.fsdp_comm import MEGATRON_FSDP_STRATEGIES, megatron_fsdp_unit, torch_fsdp2_unit
from megatron_npu.layout.parallel_dims import arg_value

#: the planner's labels for the CP groups (perf/comm.py labels the measured groups the same way)
CP_LABELS = ("cp", "cp_a2a", "cp_ring")
FSDP_SCHEMES = (*MEGATRON_FSDP_STRATEGIES, "torch_fsdp2")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def comm_type_of_layer(comm_type: str | list[str], layer: int) -> str:
    """``--cp-comm-type``: one type for every layer, or one per layer (Megatron-LM's list form)."""
    return comm_type if isinstance(comm_type, str) else comm_type[layer]


def cp_subgroups(cp_group: list[int], rank: int, comm_type: str, sizes: list[int] | None) -> dict[str, list[int]]:
    """{"a2a": ranks, "ring": ranks} this rank communicates with for one comm type."""
    if comm_type == "p2p":
        return {"ring": cp_group}
    if comm_type == "a2a":
        return {"a2a": cp_group}
    a2a = (sizes or [len(cp_group), 1])[0]
    index = cp_group.index(rank)
    return {"a2a": cp_group[index // a2a * a2a :][:a2a], "ring": cp_group[index % a2a :: a2a]}


def plan_cp(
    model: Any,
    par: Any,
    layout: Any,
    rank: int,
    layers: list[int],
    microbatches: int,
    add: Callable[..., None],
    dtype_bytes: int,
) -> None:
    """One rank's CP attention calls: ``layers`` are the global indices of its transformer layers."""
    kv_heads, qk_head_dim, v_head_dim = model.core_attention_heads
    cp_group = next(g for g in layout.groups["cp"] if rank in g)
    for layer in layers:
        comm_type = comm_type_of_layer(par.cp_comm_type, layer)
        groups = cp_subgroups(cp_group, rank, comm_type, par.hierarchical_cp_sizes)
        label = {"a2a": "cp_a2a", "ring": "cp_ring"} if comm_type == "a2a+p2p" else {"a2a": "cp", "ring": "cp"}
        calls = cp_calls(
            seq_length=model.seq_length,
            micro_batch_size=model.micro_batch_size,
            num_attention_heads=model.num_attention_heads,
            num_query_groups=kv_heads,
            head_dim=qk_head_dim,
            v_head_dim=v_head_dim,
            tp=layout.dims.tp,
            cp=layout.dims.cp,
            comm_type=comm_type,
            hierarchical_sizes=par.hierarchical_cp_sizes,
            dtype_bytes=dtype_bytes,
        )
        for call in calls:
            group = groups[call.kind]
            if call.op == "all_to_all":
                inter = layout.spans_nodes(group)
            else:  # p2p goes by the peer's node: the next rank for a send, the previous for a receive
                step = 1 if call.op == "send" else -1
                peer = group[(group.index(rank) + step) % len(group)]
                inter = layout.node_of(peer) != layout.node_of(rank)
            what = f"CP {comm_type} {call.what} {call.phase}"
            add(label[call.kind], call.op, what, call.calls * microbatches, call.payload, group, inter)


def fsdp_units(
    params: list[tuple[str, int]], scheme: str, bucket_size: int | None = None
) -> list[tuple[str, int, bool]]:
    """(unit, numel, is a just-in-time unit) of one model chunk's (name, numel) list, in order.

    FSDP2: each transformer layer, the embedding, the root's rest. Megatron-FSDP makes each
    TransformerLayer a unit only under ``optim_grads_params`` (mcore_fsdp_adapter.py); every other
    parameter shares one bucket, cut where it reaches ``--ddp-bucket-size`` elements, if given
    (param_and_grad_buffer.py ``_get_parameter_groups``): under ``no_shard``, ``optim`` and
    ``optim_grads`` the whole chunk is reduced and gathered in one call each.
    """
    units: dict[str, int] = {}
    buckets = 0
    for name, numel in params:
        layer = _LAYER.match(name)
        if layer is not None and scheme in ("torch_fsdp2", "optim_grads_params"):
            unit = f"layer {layer.group(1)}"
        elif scheme == "torch_fsdp2":
            unit = "embedding" if name.startswith("embedding.") else "rest"
        else:
            unit = "rest" if buckets == 0 else f"rest {buckets}"
            if bucket_size and units.get(unit, 0) + numel >= bucket_size:
                buckets += 1  # this parameter still joins the bucket it fills
        units[unit] = units.get(unit, 0) + numel
    return [(unit, numel, unit.startswith("layer ")) for unit, numel in units.items()]


def plan_fsdp(
    scheme: str,
    chunks: list[list[tuple[str, int]]],
    dp_cp: int,
    microbatches: int,
    param_bytes: int,
    grad_bytes: int,
    group: list[int],
    inter: bool,
    add: Callable[..., None],
    bucket_size: int | None = None,
    label: str = "dp_cp",
) -> None:
    """One rank's FSDP collectives per iteration over the data-parallel (x CP) group, unit by unit
    (``label`` "edp": the experts' units over expert data parallel, which shard them under EP)."""
    if scheme not in FSDP_SCHEMES:
        raise ValueError(f"unknown FSDP scheme {scheme!r}; one of {', '.join(FSDP_SCHEMES)}")
    for params in chunks:
        for unit, numel, jit in fsdp_units(params, scheme, bucket_size):
            if scheme == "torch_fsdp2":
                items = torch_fsdp2_unit(unit, numel, dp_cp, microbatches, True, param_bytes, grad_bytes)
            else:
                items = megatron_fsdp_unit(unit, numel, dp_cp, microbatches, scheme, param_bytes, grad_bytes, jit)
            for item in items:
                what = f"FSDP {unit} {item.phase}"
                add(label, item.op, what, item.count, item.payload_bytes, group, inter)


def fsdp_scheme(args: Any) -> str | None:
    """``--use-megatron-fsdp`` (or its old name ``--use-custom-fsdp``) with its sharding strategy,
    ``torch_fsdp2`` for ``--use-torch-fsdp2``, None without FSDP (a Namespace or args.json)."""
    if arg_value(args, "use_torch_fsdp2", False):
        return "torch_fsdp2"
    if arg_value(args, "use_megatron_fsdp", False) or arg_value(args, "use_custom_fsdp", False):
        return arg_value(args, "data_parallel_sharding_strategy", "no_shard")
    return None


def cp_fsdp_fields(args: Any) -> dict[str, Any]:
    """The ParallelSpec fields of CP and FSDP from pretrain_gpt.py's settings (a Namespace or args.json)."""
    comm_type = arg_value(args, "cp_comm_type", "p2p")
    if not isinstance(comm_type, str):
        comm_type = comm_type[0] if len(comm_type) == 1 else list(comm_type)
    sizes = arg_value(args, "hierarchical_context_parallel_sizes")
    return {
        "cp_comm_type": comm_type,
        "hierarchical_cp_sizes": list(sizes) if sizes else None,
        "fsdp": fsdp_scheme(args),
    }
