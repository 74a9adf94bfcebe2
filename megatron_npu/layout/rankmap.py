"""Rank-to-node map: which node, device and TP/PP/DP/CP groups every global rank gets.

Groups come from megatron-core's own ``parallel_state.RankGenerator`` with the order
``initialize_model_parallel`` uses, so the map cannot drift from what the trainer builds.
Placement is torchrun's: node = rank // nproc_per_node, local rank = device id.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

from megatron_npu.layout.parallel_dims import LayoutError, ParallelDims

__all__ = ["LayoutError", "ParallelDims", "RankEntry", "RankMap", "build_rank_map"]

ORDER = "tp-cp-ep-dp-pp"  # initialize_model_parallel's default order


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
    world_size: int
    nnodes: int
    nproc_per_node: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    vpp: int | None
    ranks: list[RankEntry]
    groups: dict[str, list[list[int]]]
    hosts: list[str] | None = field(default=None)
    etp: int | None = None  # expert tensor parallel; None: TP
    num_experts: int | None = None

    def node_of(self, rank: int) -> int:
        return rank // self.nproc_per_node

    @property
    def dims(self) -> ParallelDims:
        """The layout without the placement (validated again: cheap, and a hand-built map gets checked)."""
        return ParallelDims(
            self.world_size, self.tp, self.pp, self.cp, self.ep, self.vpp, etp=self.etp, num_experts=self.num_experts
        )

    def spans_nodes(self, group: list[int]) -> bool:
        return len({self.node_of(r) for r in group}) > 1

    def to_json(self) -> dict:
        keys = ("rank", "node", "local_rank", "tp_rank", "pp_rank", "dp_rank", "cp_rank")
        return {
            "world_size": self.world_size,
            "ranks": [{k: asdict(e)[k] for k in keys} for e in self.ranks],
            "groups": {k: self.groups[k] for k in ("tp", "pp", "dp", "cp")},
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
) -> RankMap:
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
    )
    world, nnodes, nproc, dp = dims.world_size, dims.nnodes, dims.nproc_per_node or dims.world_size, dims.dp
    if hosts is not None and len(hosts) != nnodes:
        raise LayoutError(f"--hosts lists {len(hosts)} hosts but --nnodes is {nnodes}")
    from megatron.core.parallel_state import RankGenerator, default_embedding_ranks

    # the same two generators initialize_model_parallel builds (expert TP defaults to TP)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER)
    groups = {name: gen.get_ranks(name) for name in ("tp", "pp", "dp", "cp")}
    groups["mp"] = gen.get_ranks("tp-pp")  # model-parallel group (grad-norm all-reduce)
    groups["dp_cp"] = gen.get_ranks("dp-cp")  # DDP's gradient-reduction group
    groups["embd"] = [default_embedding_ranks(g) for g in groups["pp"]]
    groups.update(expert_groups(dims))

    def index_in(name: str, rank: int) -> int:
        for group in groups[name]:
            if rank in group:
                return group.index(rank)
        raise AssertionError(f"rank {rank} in no {name} group")

    ranks = [
        RankEntry(
            rank=r,
            node=r // nproc,
            local_rank=r % nproc,
            tp_rank=index_in("tp", r),
            pp_rank=index_in("pp", r),
            dp_rank=index_in("dp", r),
            cp_rank=index_in("cp", r),
            ep_rank=index_in("ep", r),
            host=hosts[r // nproc] if hosts else None,
        )
        for r in range(world)
    ]
    rmap = RankMap(world, nnodes, nproc, tp, pp, cp, ep, dp, vpp, ranks, groups, hosts, etp, num_experts)
    bad = [g for g in groups["tp"] if rmap.spans_nodes(g)]
    if bad:  # cannot happen when tp | nproc; guards against a change of megatron's order
        raise LayoutError(f"TP group {bad[0]} spans nodes; TP must stay on one node")
    return rmap


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
    if rmap.ep > 1:  # the token all-to-all runs in every MoE layer, forward and backward
        out.append(
            f"EP groups crossing nodes: {len(cross['ep_groups'])} of {len(rmap.groups['ep'])}"
            + (f" (e.g. {cross['ep_groups'][0]}; keep ETP x EP within a node)" if cross["ep_groups"] else "")
        )
    return "\n".join(out)


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: --tp)")
    parser.add_argument("--num-experts", type=int, default=None, help="MoE: checked against --ep")
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--hosts", default=None, help="comma-separated host list, one per node")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-npu rankmap", description=__doc__.splitlines()[0])
    add_layout_args(parser)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--num-layers", type=int, default=None, help="also check PP (x VPP) divides the layers")
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
        )
    except LayoutError as exc:
        print(f"rankmap: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rmap.to_json()) if args.json else format_table(rmap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
