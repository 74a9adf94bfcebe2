"""Rank-to-node map: which node, device and TP/PP/DP/CP groups every global rank gets.

Groups come from megatron-core's own ``parallel_state.RankGenerator`` with the order
``initialize_model_parallel`` uses, so the map cannot drift from what the trainer builds.
Placement is torchrun's: node = rank // nproc_per_node, local rank = device id; a run that
already ran (``rank_map_from_run``) brings its own placement, layout.json's ``node`` field.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_npu.layout.cp_comm import placement_note
from megatron_npu.layout.parallel_dims import LayerSplit, LayoutError, ParallelDims

__all__ = ["LayoutError", "ParallelDims", "RankEntry", "RankMap", "build_rank_map", "rank_map_from_run"]

ORDER = "tp-cp-ep-dp-pp"  # initialize_model_parallel's default order
#: the groups every rank records in LOG_DIR/layout.json (training/initialize.py:layout_record)
RECORDED_GROUPS = ("tp", "pp", "dp", "cp")


@dataclass
class RankEntry:
    rank: int
    node: int
    local_rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_rank: int = 0
    host: str | None = None


@dataclass
class RankMap:
    """A validated layout (``dims``, the one holder of the degrees) placed on nodes: one entry
    per rank, in rank order, with the node it runs on, and every group the trainer builds."""

    dims: ParallelDims
    ranks: list[RankEntry]
    groups: dict[str, list[list[int]]]
    hosts: list[str] | None = field(default=None)

    # ---- the degrees, read from dims ----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def vpp(self) -> int | None:
        return self.dims.vpp

    @property
    def etp(self) -> int | None:
        return self.dims.etp

    @property
    def num_experts(self) -> int | None:
        return self.dims.num_experts

    # ---- the placement, read from the entries -------------------------------------------------
    @property
    def nnodes(self) -> int:
        return len({e.node for e in self.ranks})

    @property
    def nproc_per_node(self) -> int:
        per_node: dict[int, int] = {}
        for e in self.ranks:
            per_node[e.node] = per_node.get(e.node, 0) + 1
        return max(per_node.values())

    def node_of(self, rank: int) -> int:
        return self.ranks[rank].node

    def spans_nodes(self, group: list[int]) -> bool:
        return len({self.node_of(r) for r in group}) > 1

    def to_json(self) -> dict:
        keys = ("rank", "node", "local_rank", "tp_rank", "pp_rank", "dp_rank", "cp_rank")
        return {
            "world_size": self.world_size,
            "ranks": [{k: asdict(e)[k] for k in keys} for e in self.ranks],
            "groups": {k: self.groups[k] for k in RECORDED_GROUPS},
        }


def expert_groups(dims: ParallelDims) -> dict[str, list[list[int]]]:
    """The groups of megatron-core's expert grid (MoE parallel folding) and of the MoE collectives,
    from the generators initialize_model_parallel builds: ``ep`` the token all-to-all, ``edp`` the
    expert parameters' gradient reduction, ``tp_ep`` the alltoall dispatcher's token counts (expert
    TP x EP), ``expert_mp`` the expert optimizer's grad norm (expert TP x EP x PP), ``tp_cp`` the
    router's load-balancing reduce (attention TP x CP). EP sits next to expert TP in the order, so
    an EP group is ETP x EP contiguous ranks and stays inside a node whenever that divides the node."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=dims.cp, order=ORDER)
    experts = RankGenerator(tp=dims.expert_tp, ep=dims.ep, dp=dims.expert_dp, pp=dims.pp, cp=1, order=ORDER)
    return {
        "ep": experts.get_ranks("ep"),
        "edp": experts.get_ranks("dp"),
        "tp_ep": experts.get_ranks("tp-ep"),
        "expert_mp": experts.get_ranks("tp-ep-pp"),
        "tp_cp": dense.get_ranks("tp-cp"),
    }


def layout_groups(dims: ParallelDims) -> dict[str, list[list[int]]]:
    """Every group the trainer builds for a layout, by the same two generators
    initialize_model_parallel uses (expert TP defaults to TP): the one place groups are derived."""
    from megatron.core.parallel_state import RankGenerator, default_embedding_ranks

    gen = RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=dims.cp, order=ORDER)
    groups = {name: gen.get_ranks(name) for name in RECORDED_GROUPS}
    groups["mp"] = gen.get_ranks("tp-pp")  # model-parallel group (grad-norm all-reduce)
    groups["dp_cp"] = gen.get_ranks("dp-cp")  # DDP's gradient-reduction group
    groups["embd"] = [default_embedding_ranks(g) for g in groups["pp"]]
    groups.update(expert_groups(dims))
    return groups


def _index_in(groups: dict[str, list[list[int]]], name: str, rank: int) -> int:
    for group in groups[name]:
        if rank in group:
            return group.index(rank)
    raise AssertionError(f"rank {rank} in no {name} group")


def _entry(groups: dict[str, list[list[int]]], rank: int, node: int, local_rank: int, host: str | None) -> RankEntry:
    """One rank's place in every group (its index in the group: megatron-core's group rank)."""
    index = {name: _index_in(groups, name, rank) for name in ("tp", "pp", "dp", "cp", "ep")}
    return RankEntry(
        rank=rank,
        node=node,
        local_rank=local_rank,
        tp_rank=index["tp"],
        pp_rank=index["pp"],
        dp_rank=index["dp"],
        cp_rank=index["cp"],
        ep_rank=index["ep"],
        host=host,
    )


def build_rank_map(
    world_size: int | None = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    vpp: int | None = None,
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    hosts: list[str] | None = None,
    num_layers: int | None = None,
    etp: int | None = None,
    num_experts: int | None = None,
    split: LayerSplit | None = None,
) -> RankMap:
    """A launch's map: torchrun's placement (node = rank // nproc_per_node) of a checked layout."""
    dims = ParallelDims.for_launch(
        world_size,
        tp,
        pp,
        cp,
        ep,
        vpp,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        num_layers=num_layers,
        etp=etp,
        num_experts=num_experts,
        split=split,
    )
    nproc = dims.nproc_per_node or dims.world_size
    if hosts is not None and len(hosts) != dims.nnodes:
        raise LayoutError(f"--hosts lists {len(hosts)} hosts but --nnodes is {dims.nnodes}")
    groups = layout_groups(dims)
    ranks = [
        _entry(groups, r, r // nproc, r % nproc, hosts[r // nproc] if hosts else None) for r in range(dims.world_size)
    ]
    rmap = RankMap(dims, ranks, groups, hosts)
    bad = [g for g in groups["tp"] if rmap.spans_nodes(g)]
    if bad:  # cannot happen when tp | nproc; guards against a change of megatron's order
        raise LayoutError(f"TP group {bad[0]} spans nodes; TP must stay on one node")
    return rmap


def rank_map_from_run(args: Mapping[str, Any], layout: Mapping[str, Any]) -> RankMap:
    """The layout a run ran with, from its LOG_DIR/args.json and layout.json (as dicts).

    The degrees come from args.json through ``ParallelDims.from_args`` (no placement rule: the run
    ran), the placement from layout.json's ``node`` per rank (torchrun's GROUP_RANK, where each rank
    really ran), the groups from ``layout_groups``; the groups layout.json recorded must be those,
    so a map rebuilt here is the one the trainer built. Raises LayoutError naming the file to fix.
    """
    try:
        entries = sorted(layout["ranks"], key=lambda e: int(e["rank"]))
        placement = {int(e["rank"]): (int(e["node"]), int(e.get("local_rank", 0)), e.get("host")) for e in entries}
        recorded = {k: sorted(sorted(int(r) for r in g) for g in layout["groups"][k]) for k in RECORDED_GROUPS}
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"layout.json lacks {exc}") from None
    world = int(layout.get("world_size") or len(entries))
    if sorted(placement) != list(range(world)):
        raise LayoutError(f"layout.json lists ranks {sorted(placement)}, not 0..{world - 1}")
    try:
        dims = ParallelDims.from_args(args, world)
    except (TypeError, ValueError) as exc:  # LayoutError included
        raise LayoutError(f"args.json: {exc}") from None
    groups = layout_groups(dims)
    for name, built in recorded.items():
        if built != sorted(sorted(g) for g in groups[name]):
            raise LayoutError(
                f"layout.json's {name} groups {built} are not the ones args.json's layout builds "
                f"({sorted(sorted(g) for g in groups[name])}): the two files are from different runs"
            )
    ranks = [_entry(groups, r, *placement[r]) for r in range(world)]
    return RankMap(dims, ranks, groups)


def crossings(rmap: RankMap) -> dict[str, list]:
    """PP boundaries and DP/CP groups that cross nodes."""
    pp_cross = []
    for group in rmap.groups["pp"]:
        for a, b in zip(group, group[1:], strict=False):
            if rmap.node_of(a) != rmap.node_of(b):
                pp_cross.append((a, b))
    return {
        "pp_boundaries": pp_cross,
        "dp_groups": [g for g in rmap.groups["dp"] if rmap.spans_nodes(g)],
        "cp_groups": [g for g in rmap.groups["cp"] if len(g) > 1 and rmap.spans_nodes(g)],
        "ep_groups": [g for g in rmap.groups["ep"] if len(g) > 1 and rmap.spans_nodes(g)],
    }


def cp_placement(rmap: RankMap) -> str:
    """One line: whether each TP x CP block of contiguous ranks (megatron-core's order puts CP next to
    TP) stays inside a node, and what would fit when it does not (cp_comm.placement_note)."""
    note = placement_note(rmap.tp, rmap.cp, rmap.nproc_per_node)
    return note or f"TP {rmap.tp} x CP {rmap.cp} blocks: each inside one node (CP traffic on intra-node links)"


def format_table(rmap: RankMap) -> str:
    out = [
        f"world {rmap.world_size} = {rmap.nnodes} nodes x {rmap.nproc_per_node}; TP={rmap.tp} PP={rmap.pp} CP={rmap.cp} EP={rmap.ep} DP={rmap.dp}"
        + (f" VPP={rmap.vpp}" if rmap.vpp else "")
    ]
    for node in range(rmap.nnodes):
        host = f" ({rmap.hosts[node]})" if rmap.hosts else ""
        out.append(f"node {node}{host}")
        out.append("  rank  device  tp  pp  dp  cp")
        for e in rmap.ranks:
            if e.node == node:
                out.append(
                    f"  {e.rank:4d}  {e.local_rank:6d}  {e.tp_rank:2d}  {e.pp_rank:2d}  {e.dp_rank:2d}  {e.cp_rank:2d}"
                )
    cross = crossings(rmap)
    out.append("TP groups: all inside one node")
    if cross["pp_boundaries"]:
        out.append(
            f"PP boundaries crossing nodes: {len(cross['pp_boundaries'])} (e.g. {cross['pp_boundaries'][0][0]}->{cross['pp_boundaries'][0][1]})"
        )
    else:
        out.append("PP boundaries crossing nodes: none")
    out.append(
        f"DP groups crossing nodes: {len(cross['dp_groups'])} of {len(rmap.groups['dp'])}"
        + (f" (e.g. {cross['dp_groups'][0]})" if cross["dp_groups"] else "")
    )
    if rmap.cp > 1:
        out.append(f"CP groups crossing nodes: {len(cross['cp_groups'])} of {len(rmap.groups['cp'])}")
        out.append(cp_placement(rmap))
    if rmap.ep > 1:  # the token all-to-all runs in every MoE layer, forward and backward
        out.append(
            f"EP groups crossing nodes: {len(cross['ep_groups'])} of {len(rmap.groups['ep'])}"
            + (f" (e.g. {cross['ep_groups'][0]}; keep ETP x EP within a node)" if cross["ep_groups"] else "")
        )
    return "\n".join(out)


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    """The layout flags, under Megatron-LM's long names and the short ones (a launch script's flags paste)."""
    parser.add_argument("--nnodes", type=int, required=True, help="nodes in the job")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node (NPUs used per node)")
    for short, long, default, what in (
        ("--tp", "--tensor-model-parallel-size", 1, "tensor parallel size"),
        ("--pp", "--pipeline-model-parallel-size", 1, "pipeline parallel size"),
        ("--cp", "--context-parallel-size", 1, "context parallel size"),
        ("--ep", "--expert-model-parallel-size", 1, "expert parallel size"),
        ("--etp", "--expert-tensor-parallel-size", None, "expert tensor parallel size (default: --tp)"),
        ("--vpp", "--num-virtual-stages-per-pipeline-rank", None, "virtual pipeline stages per rank"),
    ):
        default_said = "" if default is None else f" (default: {default})"
        parser.add_argument(short, long, dest=short[2:], type=int, default=default, help=what + default_said)
    parser.add_argument("--num-experts", type=int, default=None, help="MoE: checked against --ep")
    parser.add_argument("--hosts", default=None, help="comma-separated host list, one per node")


def add_layer_split_args(parser: argparse.ArgumentParser) -> None:
    """The trainer's flags for splitting the layers over stages unevenly, so --num-layers is checked as it splits."""
    for flag, what in (
        ("--decoder-first-pipeline-num-layers", "layers of the first pipeline stage"),
        ("--decoder-last-pipeline-num-layers", "layers of the last pipeline stage"),
    ):
        parser.add_argument(flag, type=int, default=None, help=what)
    for flag, what in (
        ("--account-for-embedding-in-pipeline-split", "the embedding counts as a layer"),
        ("--account-for-loss-in-pipeline-split", "the loss counts as a layer"),
    ):
        parser.add_argument(flag, action="store_true", help=what)
    parser.add_argument("--pipeline-model-parallel-layout", default=None, help="the layers' layout string")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-npu rankmap", description=__doc__.splitlines()[0])
    add_layout_args(parser)
    parser.add_argument("--json", action="store_true", help="print the rank map as JSON")
    parser.add_argument("--num-layers", type=int, default=None, help="also check PP (x VPP) divides the layers")
    add_layer_split_args(parser)
    args = parser.parse_args(argv)
    hosts = args.hosts.split(",") if args.hosts else None
    try:
        rmap = build_rank_map(
            tp=args.tp,
            pp=args.pp,
            cp=args.cp,
            ep=args.ep,
            vpp=args.vpp,
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            hosts=hosts,
            num_layers=args.num_layers,
            etp=args.etp,
            num_experts=args.num_experts,
            split=LayerSplit(
                args.decoder_first_pipeline_num_layers,
                args.decoder_last_pipeline_num_layers,
                args.account_for_embedding_in_pipeline_split,
                args.account_for_loss_in_pipeline_split,
                args.pipeline_model_parallel_layout,
            ),
        )
    except LayoutError as exc:
        print(f"megatron-npu rankmap: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rmap.to_json()) if args.json else format_table(rmap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
