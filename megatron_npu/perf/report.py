"""``megatron-npu perf-report RUN_DIR``: the five-point performance health check of a run.

Reads what ``pretrain_gpt.py --log-dir DIR --timing-log-level 1|2`` writes (``layout.json``,
``args.json``, ``metrics.jsonl``, ``timers/rank*.jsonl``; see megatron_npu.training.timing) and
answers, each with a figure, a verdict against a threshold below and advice:

1. communication share of the iteration, by dimension (TP, PP, DP gradient reduce, param all-gather);
2. intra- vs inter-node traffic per dimension (megatron_npu.layout.planner on the run's layout,
   layout.json's ``node`` being where ranks really ran), measured time per group at level 2,
   TP / gradient-sync groups crossing nodes flagged;
3. per-rank and per-stage balance of busy time, and the pipeline bubble vs theory;
4. data-loader stall;
5. gradient-reduction share.

The parts of one rank's iteration and the balance figures are defined in ``DEFINITIONS`` below
(the report prints them).

AI Core utilisation on Ascend (not measured by the trainer): while training runs, sample each
card with ``npu-smi info -t usages -i CARD_ID`` (it prints ``Aicore Usage Rate(%) : N``), e.g.
``while sleep 1; do npu-smi info -t usages -i 0; done > RUN_DIR/npu_smi_card0.txt``; this report
reads every ``npu_smi*.txt`` in the run/log dir and lists mean / min / max of those lines. The
output format is taken from Huawei's npu-smi documentation and is not checked here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# ---- thresholds (fractions of the mean iteration time unless said otherwise) -----------------------
# Exposed communication beyond a quarter of the step: scaling is bandwidth-bound; well-tuned
# Megatron runs hide most DP traffic and keep TP on the fast intra-node links.
COMM_SHARE_LIMIT = 0.25
# Busiest / idlest card: beyond 10 % the fastest cards idle that much every step.
BALANCE_SPREAD_LIMIT = 1.10
# Measured bubble may exceed (pp-1)/(v*m+pp-1) by this much (absolute) before it is flagged:
# send/recv transfer time and jitter count as bubble in the measurement.
BUBBLE_EXCESS_LIMIT = 0.10
# A loader that keeps up hides behind compute; 5 % of the step waiting for data is a stall.
DATA_WAIT_LIMIT = 0.05
# Gradient reduction is once per step: more than 10 % exposed means it is not overlapped or DP is large.
GRAD_SYNC_LIMIT = 0.10

# What each part of the iteration breakdown means: printed with every report.
DEFINITIONS = """\
Breakdown of one rank's iteration (seconds; every part is measured, ``other`` is the rest, so the
parts sum to ``iteration_s`` exactly; a negative ``other`` would mean overlapping timers):

  compute            forward_compute_s + backward_compute_s - data_wait_s - tp_comm
                     (megatron-core's ``batch-generator`` timer runs inside ``forward-compute``,
                     and so do the TP collectives of the layers)
  data_wait          data_wait_s
  tp_comm            level 2: host seconds in collectives on the TP group (synchronous gloo /
                     blocking HCCL calls) minus the SP/norm-grad all-reduce below; level 1: 0
                     (then inside ``compute``)
  tp_grad_sync       the ``non-tensor-parallel-grads-all-reduce`` timer (SP norm/bias grads over TP)
  pp_wait            pp_wait_s: pipeline send/recv waits, bubble included
  embedding_sync     the ``embedding-grads-all-reduce`` timer (tied embedding over the PP ends)
  grad_sync          grad_sync_s: DP gradient all-reduce / reduce-scatter (what overlap left exposed)
  param_gather       param_gather_s: distributed-optimizer param all-gather
  optimizer          optimizer_s - param_gather - small collectives inside the step
  small_collectives  level 2: grad-norm all-reduce (mp / dist_opt groups) and the trainer's
                     loss all-reduce over dp
  other              iteration_s minus all of the above (zero_grad, schedule overhead, ...)

``busy`` (point 3) = compute + optimizer: the rank's own work, nothing that waits on a peer or
the loader. Measured bubble of a stage = pp_wait / forward_backward_s; theoretical 1F1B bubble
(pp-1)/(m+pp-1), interleaved with v virtual stages (pp-1)/(v*m+pp-1), m = micro-batches.
"""

PARTS: tuple[tuple[str, str], ...] = (
    ("compute", "compute"),
    ("data_wait", "data wait"),
    ("tp_comm", "TP comm (in fwd/bwd)"),
    ("tp_grad_sync", "TP grad sync (SP/norm)"),
    ("pp_wait", "PP send/recv wait"),
    ("embedding_sync", "embedding grad sync"),
    ("grad_sync", "DP grad sync"),
    ("param_gather", "param all-gather"),
    ("optimizer", "optimizer"),
    ("small_collectives", "grad-norm/loss all-reduce"),
    ("other", "other"),
)
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "TP": ("tp_comm", "tp_grad_sync"),
    "PP": ("pp_wait", "embedding_sync"),
    "DP grad reduce": ("grad_sync",),
    "param all-gather": ("param_gather",),
    "other collectives": ("small_collectives",),
}
COMM_PARTS = tuple(p for parts in DIMENSIONS.values() for p in parts)
# planner label -> dimension shown in point 2; which ones are high-frequency (must stay on HCCS)
PLAN_DIMENSIONS = {
    "tp": "TP",
    "pp": "PP",
    "dp_cp": "DP grad sync",
    "embd": "embedding (PP ends)",
    "mp": "grad norm (TP x PP)",
    "dist_opt": "grad norm (dist. opt.)",
    "dp": "loss report (DP)",
    "ep": "expert all-to-all (EP)",
    "edp": "expert grad sync (expert DP)",
    "tp_ep": "expert token counts (ETP x EP)",
    "expert_mp": "expert grad norm",
    "tp_cp": "MoE aux loss (TP x CP)",
}
HIGH_FREQUENCY = ("tp", "dp_cp")


class ReportError(Exception):
    """Bad input: the message names the file or flag to fix."""


@dataclass
class Run:
    log_dir: Path
    args: dict[str, Any]
    layout: dict[str, Any]
    records: dict[int, list[dict[str, Any]]]  # rank -> timer lines
    metrics: list[dict[str, Any]] = field(default_factory=list)
    npu_smi: dict[str, list[float]] = field(default_factory=dict)


# ---- loading ------------------------------------------------------------------------------------------
def find_log_dir(run_dir: Path) -> Path:
    for candidate in (run_dir, run_dir / "logs"):
        if (candidate / "timers").is_dir():
            return candidate
    raise ReportError(
        f"no timers/ under {run_dir} or {run_dir / 'logs'}: run pretrain_gpt.py with --log-dir DIR --timing-log-level 1 (or 2)"
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if n == len(lines) and out:  # a run killed mid-write leaves a torn last line
                    break
                raise ReportError(f"{path}:{n}: not JSON ({exc.msg})") from None
    return out


def load_run(run_dir: Path) -> Run:
    log_dir = find_log_dir(run_dir)
    records: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((log_dir / "timers").glob("rank*.jsonl")):
        lines = _read_jsonl(path)
        if lines:
            records[int(lines[0].get("rank", int(path.stem[4:])))] = lines
    if not records:
        raise ReportError(f"{log_dir / 'timers'} holds no records: did the run train any iteration?")
    missing = [name for name in ("args.json", "layout.json") if not (log_dir / name).is_file()]
    if missing:
        raise ReportError(f"{log_dir} lacks {', '.join(missing)} (written by pretrain_gpt.py at start-up)")
    args = json.loads((log_dir / "args.json").read_text())
    layout = json.loads((log_dir / "layout.json").read_text())
    metrics = _read_jsonl(log_dir / "metrics.jsonl") if (log_dir / "metrics.jsonl").is_file() else []
    npu_smi: dict[str, list[float]] = {}
    for directory in {log_dir, run_dir}:
        for path in sorted(directory.glob("npu_smi*.txt")):
            values = [
                float(m.group(1)) for m in re.finditer(r"Aicore Usage Rate\(%\)\s*:\s*([\d.]+)", path.read_text())
            ]
            if values:
                npu_smi[path.name] = values
    return Run(log_dir, args, layout, records, metrics, npu_smi)


# ---- per-record breakdown -----------------------------------------------------------------------------
def _seconds(comm: dict[str, Any], *labels: str) -> float:
    return sum(float(comm.get(label, {}).get("seconds", 0.0)) for label in labels)


def breakdown(record: dict[str, Any]) -> dict[str, float]:
    """The named parts of one rank's iteration; they sum to ``iteration_s`` (``other`` is the rest)."""
    raw = record.get("timers", {})
    comm = record.get("comm", {})
    get = lambda key: float(record.get(key, 0.0) or 0.0)  # noqa: E731
    fwd_bwd = get("forward_compute_s") + get("backward_compute_s")
    data = min(get("data_wait_s"), fwd_bwd)
    norm_sync = float(raw.get("non-tensor-parallel-grads-all-reduce", 0.0))
    tp_comm = min(max(_seconds(comm, "tp") - norm_sync, 0.0), fwd_bwd - data)
    param_gather = get("param_gather_s")
    optimizer = max(get("optimizer_s") - param_gather, 0.0)
    in_step = min(_seconds(comm, "mp", "dist_opt"), optimizer)
    parts = {
        "compute": fwd_bwd - data - tp_comm,
        "data_wait": data,
        "tp_comm": tp_comm,
        "tp_grad_sync": norm_sync,
        "pp_wait": get("pp_wait_s"),
        "embedding_sync": max(get("tp_grad_sync_s") - norm_sync, 0.0),
        "grad_sync": get("grad_sync_s"),
        "param_gather": param_gather,
        "optimizer": optimizer - in_step,
        "small_collectives": in_step + _seconds(comm, "dp"),
    }
    parts["other"] = get("iteration_s") - sum(parts.values())
    return parts


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _spread(values: list[float]) -> float | None:
    return max(values) / min(values) if values and min(values) > 0 else None


# ---- analysis -----------------------------------------------------------------------------------------
def _ranks_info(run: Run) -> dict[int, dict[str, Any]]:
    info = {int(e["rank"]): e for e in run.layout.get("ranks", [])}
    for rank, lines in run.records.items():
        info.setdefault(
            rank, {"rank": rank, "node": 0, **{k: lines[0].get(k, 0) for k in ("tp_rank", "pp_rank", "dp_rank")}}
        )
    return info


def _select_iterations(run: Run, skip: int) -> tuple[list[int], int]:
    """Iterations every rank recorded, less the first ``skip`` (all of them, skip 0, if that leaves none)."""
    common = set.intersection(
        *({r.get("iteration") for r in lines if "iteration_s" in r} for lines in run.records.values())
    )
    ordered = sorted(i for i in common if i is not None)
    if not ordered:
        raise ReportError(
            f"the ranks in {run.log_dir / 'timers'} share no recorded iteration: did the run stop during the first step?"
        )
    return (ordered[skip:], skip) if len(ordered) > skip else (ordered, 0)


def _planner(run: Run, intra: float, inter: float) -> tuple[Any, str | None]:
    """The CommPlan of this run on the nodes layout.json recorded, or (None, why not)."""
    from megatron_npu.layout.model_shape import ModelShape
    from megatron_npu.layout.parallel_dims import LayoutError, ParallelDims
    from megatron_npu.layout.planner import ModelSpec, ParallelSpec, plan
    from megatron_npu.layout.rankmap import RankEntry, RankMap, expert_groups

    a, lay = run.args, run.layout
    try:
        entries = sorted(lay["ranks"], key=lambda e: e["rank"])
        nodes = {int(e["rank"]): int(e["node"]) for e in entries}
        groups = derived_groups(lay)
    except (KeyError, TypeError) as exc:
        return None, f"layout.json lacks {exc}"
    world = int(lay.get("world_size", len(entries)))

    class ObservedRankMap(RankMap):
        # the planner asks node_of(); torchrun's GROUP_RANK in layout.json is the truth
        def node_of(self, rank: int) -> int:
            return nodes[rank]

    per_node: dict[int, int] = {}
    for node in nodes.values():
        per_node[node] = per_node.get(node, 0) + 1
    ranks = [
        RankEntry(
            rank=int(e["rank"]),
            node=int(e["node"]),
            local_rank=int(e.get("local_rank", 0)),
            tp_rank=int(e["tp_rank"]),
            pp_rank=int(e["pp_rank"]),
            dp_rank=int(e["dp_rank"]),
            cp_rank=int(e.get("cp_rank", 0)),
        )
        for e in entries
    ]
    dtype = "bf16" if a.get("bf16") else "fp16" if a.get("fp16") else "fp32"
    try:
        # the run's own layout and shape objects, from its args.json (no placement rule: the run ran)
        dims = ParallelDims.from_args(a, world)
        groups.update(expert_groups(dims))  # layout.json records the attention grid only
        rmap = ObservedRankMap(
            world,
            len(per_node),
            max(per_node.values()),
            dims.tp,
            dims.pp,
            dims.cp,
            dims.ep,
            dims.dp,
            dims.vpp,
            ranks,
            groups,
            None,
            dims.etp,
            dims.num_experts,
        )
        shape = ModelShape.from_args({**a, "vocab_size": a.get("padded_vocab_size") or a["vocab_size"]})
        model = ModelSpec.from_shape(
            shape,
            seq_length=int(a["seq_length"]),
            micro_batch_size=int(a["micro_batch_size"]),
            global_batch_size=int(a["global_batch_size"]),
            untie_embeddings_and_output_weights=bool(a.get("untie_embeddings_and_output_weights")),
            add_bias_linear=a.get("add_bias_linear", True) is not False,
            normalization=a.get("normalization") or "LayerNorm",
            position_embedding_type=a.get("position_embedding_type") or "learned_absolute",
            max_position_embeddings=a.get("max_position_embeddings"),
            params_dtype=dtype,
            grad_reduce_in_fp32=a.get("accumulate_allreduce_grads_in_fp32"),
            num_experts=a.get("num_experts"),
            moe_router_topk=int(a.get("moe_router_topk") or 2),
            moe_layer_freq=a.get("moe_layer_freq") or 1,
            **_moe_fields(a),
        )
        par = ParallelSpec(
            sequence_parallel=bool(a.get("sequence_parallel")),
            use_distributed_optimizer=bool(a.get("use_distributed_optimizer")),
            overlap_grad_reduce=bool(a.get("overlap_grad_reduce")),
            bucket_size=a.get("ddp_bucket_size"),
            clip_grad=float(a.get("clip_grad") or 0.0),
            recompute_full=a.get("recompute_granularity") == "full",
            per_token_loss=bool(a.get("calculate_per_token_loss")),
        )
        return plan(model, rmap, par, intra, inter), None
    except (KeyError, TypeError, ValueError, LayoutError) as exc:
        return None, f"planner: {exc}"


def _moe_fields(a: dict[str, Any]) -> dict[str, Any]:
    """The planner's MoE fields a run's args.json holds (Megatron-LM's names)."""
    names = (
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
        "moe_token_dispatcher_type",
        "moe_pad_expert_input_to_capacity",
        "moe_router_load_balancing_type",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
    )
    return {name: a[name] for name in names if a.get(name) is not None}


def derived_groups(layout: dict[str, Any]) -> dict[str, list[list[int]]]:
    """layout.json's tp/pp/dp/cp groups plus the ones the planner labels: dp_cp, mp, embd."""
    entries = sorted(layout["ranks"], key=lambda e: e["rank"])
    groups = {k: [list(g) for g in layout["groups"][k]] for k in ("tp", "pp", "dp", "cp")}

    def same(*keys: str) -> list[list[int]]:
        out: dict[tuple, list[int]] = {}
        for e in entries:
            out.setdefault(tuple(e.get(k, 0) for k in keys), []).append(int(e["rank"]))
        return list(out.values())

    groups["dp_cp"] = same("tp_rank", "pp_rank")  # order tp-cp-ep-dp-pp: dp x cp share tp and pp rank
    groups["mp"] = same("dp_rank", "cp_rank")  # tensor x pipeline
    groups["embd"] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in groups["pp"]]  # default_embedding_ranks
    return groups


def _crossing(run: Run) -> dict[str, list[list[int]]]:
    """Groups of each kind whose ranks ran on more than one node (layout.json's node field)."""
    try:
        nodes = {int(e["rank"]): int(e["node"]) for e in run.layout["ranks"]}
        groups = derived_groups(run.layout)
    except (KeyError, TypeError):
        return {}
    return {kind: [g for g in gs if len({nodes.get(r, 0) for r in g}) > 1] for kind, gs in groups.items()}


def _verdict(flagged: bool) -> str:
    return "FLAGGED" if flagged else "ok"


# One typed result per step of the analysis; ``analyse`` joins them into the report dict the
# renderers and --json read (field order = the JSON's key order).
@dataclass
class RankSummary:
    """One rank's means over the selected iterations."""

    rank: int
    node: int
    host: str | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    iteration_s: float
    parts: dict[str, float]
    forward_backward_s: float
    busy_s: float
    comm_s: float
    num_microbatches: int | None
    comm_groups: dict[str, dict[str, float]]


@dataclass
class CommunicationCheck:
    figure: float
    max_rank_share: float
    per_rank_share: dict[int, float]
    by_dimension_s: dict[str, float]
    by_dimension_share: dict[str, float]
    threshold: float
    verdict: str
    measured_tp: bool
    advice: list[str]
    #: MoE: host seconds inside the EP group's all-to-all per iteration (level 2), mean over ranks.
    #: The timers count it as compute (it runs inside the layers' forward and backward).
    expert_all_to_all_s: float = 0.0


@dataclass
class TrafficCheck:
    nodes: int
    dimensions: dict[str, dict[str, Any]]
    crossing_groups: dict[str, list[list[int]]]
    tp_crossing: list[list[int]]
    grad_sync_crossing: list[list[int]]
    threshold: str
    verdict: str
    plan_error: str | None
    assumed_gbps: dict[str, float]
    est_comm_s: dict[int, float] | None
    advice: list[str]


@dataclass
class BalanceCheck:
    busy_definition: str
    busy_s: dict[int, float]
    rank_spread: float | None
    stages: dict[int, dict[str, float]]
    stage_spread: float | None
    bubble_formula: str
    pp: int
    vpp: int
    microbatches: int
    bubble_theoretical: float
    bubble_measured_worst: float
    threshold: dict[str, float]
    verdict: str
    advice: list[str]
    npu_smi_aicore_pct: dict[str, dict[str, float]] | None = None  # only when npu-smi samples exist

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.npu_smi_aicore_pct is None:
            del out["npu_smi_aicore_pct"]
        return out


@dataclass
class DataLoaderCheck:
    figure: float
    worst_rank: int
    wait_s_per_iteration: dict[int, float]
    share: dict[int, float]
    threshold: float
    verdict: str
    advice: list[str]


@dataclass
class GradReductionCheck:
    figure: float
    worst_rank: int
    grad_reduce_s: dict[int, float]
    share: dict[int, float]
    dp: int
    threshold: float
    verdict: str
    advice: list[str]


@dataclass
class RunShape:
    """What the checks need of the run's layout: degrees and micro-batches per step."""

    tp: int
    pp: int
    dp: int
    vpp: int  # 1 without interleaving
    microbatches: int
    nnodes: int


def summarise_ranks(run: Run, iterations: list[int]) -> tuple[list[RankSummary], dict[int, dict[str, float]]]:
    """Per-rank means over ``iterations``, and the per-iteration mean over ranks (for the plot)."""
    info = _ranks_info(run)
    ranks: list[RankSummary] = []
    per_iteration: dict[int, dict[str, float]] = {}
    for rank in sorted(run.records):
        lines = [r for r in run.records[rank] if r["iteration"] in iterations]
        parts = [breakdown(r) for r in lines]
        mean = {key: _mean([p[key] for p in parts]) for key, _ in PARTS}
        comm_groups: dict[str, dict[str, float]] = {}
        for r in lines:
            for label, s in r.get("comm", {}).items():
                d = comm_groups.setdefault(label, {"calls": 0.0, "bytes": 0.0, "seconds": 0.0})
                for k in d:
                    d[k] += float(s.get(k, 0.0)) / len(lines)
        ranks.append(
            RankSummary(
                rank=rank,
                node=info[rank].get("node", 0),
                host=info[rank].get("host"),
                tp_rank=info[rank].get("tp_rank", 0),
                pp_rank=info[rank].get("pp_rank", 0),
                dp_rank=info[rank].get("dp_rank", 0),
                iteration_s=_mean([float(r["iteration_s"]) for r in lines]),
                parts=mean,
                forward_backward_s=_mean([float(r.get("forward_backward_s", 0.0)) for r in lines]),
                busy_s=mean["compute"] + mean["optimizer"],
                comm_s=sum(mean[p] for p in COMM_PARTS),
                num_microbatches=lines[0].get("num_microbatches") if lines else None,
                comm_groups=comm_groups,
            )
        )
        for r, p in zip(lines, parts, strict=True):
            acc = per_iteration.setdefault(r["iteration"], {key: 0.0 for key, _ in PARTS} | {"iteration_s": 0.0})
            for key in p:
                acc[key] += p[key] / len(run.records)
            acc["iteration_s"] += float(r["iteration_s"]) / len(run.records)
    return ranks, per_iteration


def run_shape(run: Run, ranks: list[RankSummary]) -> RunShape:
    """The run's layout from args.json, through the one layout object (ParallelDims)."""
    from megatron_npu.layout.parallel_dims import LayoutError, ParallelDims

    a = run.args
    world = int(run.layout.get("world_size") or len(ranks))
    try:
        dims = ParallelDims.from_args(a, world)
    except (LayoutError, TypeError, ValueError) as exc:
        raise ReportError(f"{run.log_dir / 'args.json'}: {exc}") from None
    m = next((r.num_microbatches for r in ranks if r.num_microbatches), None) or max(
        1, int(a.get("global_batch_size", 1)) // (int(a.get("micro_batch_size", 1)) * dims.dp)
    )
    return RunShape(dims.tp, dims.pp, dims.dp, dims.virtual_stages, m, len({r.node for r in ranks}))


def communication_check(
    ranks: list[RankSummary], parts_mean: dict[str, float], mean_it: float, level2: bool
) -> CommunicationCheck:
    """Point 1: exposed communication's share of the iteration, by dimension."""
    shares = {r.rank: r.comm_s / r.iteration_s if r.iteration_s else 0.0 for r in ranks}
    by_dim = {dim: sum(parts_mean[p] for p in keys) for dim, keys in DIMENSIONS.items()}
    comm_share = _mean(list(shares.values()))
    top = max(by_dim, key=by_dim.get) if by_dim else None
    advice = []
    if not level2:
        advice.append(
            "TP collectives are counted inside compute at --timing-log-level 1: rerun with 2 to split them out."
        )
    if comm_share > COMM_SHARE_LIMIT:
        advice.append(f"largest exposed dimension: {top} ({by_dim[top] / mean_it:.0%} of the step).")
        advice += {
            "TP": [
                "keep TP inside one node (HCCS) and no larger than needed; add --sequence-parallel; "
                "trade TP for PP/DP if the model fits"
            ],
            "PP": [
                "PP wait is mostly bubble: raise the micro-batch count (global batch / (micro batch x DP)) "
                "or interleave (--num-layers-per-virtual-pipeline-stage); balance stages (point 3)"
            ],
            "DP grad reduce": ["see point 5: --overlap-grad-reduce, --use-distributed-optimizer, bucket size"],
            "param all-gather": [
                "--overlap-param-gather (with --use-distributed-optimizer) hides the all-gather behind the next forward"
            ],
            "other collectives": [
                "grad-norm / loss all-reduces are tiny: time here is waiting for the slowest rank, look at point 3"
            ],
        }.get(top, [])
    else:
        advice.append("communication is within budget; re-check at the target scale (more DP ranks, more nodes).")
    return CommunicationCheck(
        figure=comm_share,
        max_rank_share=max(shares.values()),
        per_rank_share=shares,
        by_dimension_s=by_dim,
        by_dimension_share={k: v / mean_it if mean_it else 0.0 for k, v in by_dim.items()},
        threshold=COMM_SHARE_LIMIT,
        verdict=_verdict(comm_share > COMM_SHARE_LIMIT),
        measured_tp=level2,
        advice=advice,
        expert_all_to_all_s=_mean([r.comm_groups.get("ep", {}).get("seconds", 0.0) for r in ranks]),
    )


def traffic_check(
    run: Run, ranks: list[RankSummary], parts_mean: dict[str, float], nnodes: int, intra: float, inter: float
) -> TrafficCheck:
    """Point 2: planned bytes per group (intra / inter node) beside the measured ones; crossing groups."""
    comm_plan, plan_error = _planner(run, intra, inter)
    crossing = _crossing(run)
    dims: dict[str, dict[str, Any]] = {}
    if comm_plan is not None:
        for rp in comm_plan.ranks:
            for label, v in rp.by_label().items():
                d = dims.setdefault(label, {"planned_bytes": 0.0, "wire_intra": 0.0, "wire_inter": 0.0})
                d["planned_bytes"] += v["bytes"] / len(comm_plan.ranks)
                d["wire_intra"] += v["wire_intra"] / len(comm_plan.ranks)
                d["wire_inter"] += v["wire_inter"] / len(comm_plan.ranks)
    for r in ranks:
        for label, v in r.comm_groups.items():
            d = dims.setdefault(label, {"planned_bytes": None, "wire_intra": None, "wire_inter": None})
            d["measured_bytes"] = d.get("measured_bytes", 0.0) + v["bytes"] / len(ranks)
            d["measured_s"] = d.get("measured_s", 0.0) + v["seconds"] / len(ranks)
    # exposed time from the timers: the counter's seconds are call-return times for async ops
    # (DDP's grad reduce, batched p2p), so they understate what the iteration waited
    exposed = {
        "tp": ("tp_comm", "tp_grad_sync"),
        "pp": ("pp_wait",),
        "dp_cp": ("grad_sync", "param_gather"),
        "embd": ("embedding_sync",),
    }
    for label, d in dims.items():
        d["exposed_s"] = sum(parts_mean[p] for p in exposed[label]) if label in exposed else d.get("measured_s")
        d["dimension"] = PLAN_DIMENSIONS.get(label, label)
        d["crosses_nodes"] = bool(crossing.get(label)) if label != "dist_opt" else nnodes > 1  # dist_opt: every rank
    tp_cross = [g for g in crossing.get("tp", []) if len(g) > 1]
    dp_cross = [g for g in crossing.get("dp_cp", []) if len(g) > 1]
    flagged = bool(tp_cross or dp_cross)
    advice = []
    if tp_cross:
        advice.append(
            f"TP group {tp_cross[0]} spans nodes: TP communicates every layer; make TP divide the ranks "
            "per node (ranks of a TP group are contiguous) so it stays on HCCS."
        )
    if dp_cross:
        advice.append(
            f"DP gradient-sync group {dp_cross[0]} spans nodes: its reduce runs at inter-node "
            "(RoCE) speed. Put PP across nodes before DP (raise PP / TP inside a node so DP "
            "groups shrink), and hide what remains with --overlap-grad-reduce and "
            "--use-distributed-optimizer."
        )
    if crossing.get("pp") and not flagged:
        advice.append("PP crosses nodes: fine, p2p is low-frequency; keep it that way.")
    if not advice:
        advice.append("all traffic is intra-node." if nnodes == 1 else "high-frequency groups stay inside nodes.")
    return TrafficCheck(
        nodes=nnodes,
        dimensions=dims,
        crossing_groups={k: v for k, v in crossing.items() if v},
        tp_crossing=tp_cross,
        grad_sync_crossing=dp_cross,
        threshold="no TP or DP gradient-sync group spans nodes",
        verdict=_verdict(flagged),
        plan_error=plan_error,
        assumed_gbps={"intra": intra, "inter": inter},
        est_comm_s=({rp.rank: comm_plan.time_s(rp.rank) for rp in comm_plan.ranks} if comm_plan else None),
        advice=advice,
    )


def balance_check(run: Run, ranks: list[RankSummary], shape: RunShape) -> BalanceCheck:
    """Point 3: busy time per rank and stage, and the measured pipeline bubble against theory."""
    pp, vpp, m = shape.pp, shape.vpp, shape.microbatches
    busy = {r.rank: r.busy_s for r in ranks}
    stages: dict[int, dict[str, float]] = {}
    for s in sorted({r.pp_rank for r in ranks}):
        members = [r for r in ranks if r.pp_rank == s]
        fb = _mean([r.forward_backward_s for r in members])
        stages[s] = {
            "busy_s": _mean([r.busy_s for r in members]),
            "bubble_measured": _mean([r.parts["pp_wait"] for r in members]) / fb if fb else 0.0,
        }
    theory = (pp - 1) / (vpp * m + pp - 1) if pp > 1 else 0.0
    rank_spread = _spread(list(busy.values()))
    stage_spread = _spread([s["busy_s"] for s in stages.values()])
    worst_bubble = max((s["bubble_measured"] for s in stages.values()), default=0.0) if pp > 1 else 0.0
    imbalance = rank_spread is not None and rank_spread > BALANCE_SPREAD_LIMIT
    bubble_flag = pp > 1 and worst_bubble > theory + BUBBLE_EXCESS_LIMIT
    advice = []
    if stage_spread is not None and stage_spread > BALANCE_SPREAD_LIMIT and pp > 1:
        heavy = max(stages, key=lambda s: stages[s]["busy_s"])
        advice.append(
            f"stage {heavy} is the busiest ({stage_spread:.2f}x the idlest): the first stage holds the "
            "embedding, the last the output layer and loss; with a large vocabulary prefer more layers per "
            "stage (fewer PP stages) or virtual stages (--num-layers-per-virtual-pipeline-stage); uneven "
            "splits (Megatron-LM's --decoder-first/last-pipeline-num-layers) are not supported by "
            "pretrain_gpt.py yet."
        )
    elif imbalance:
        advice.append(
            "ranks of one stage differ: a slow or shared card/host (check npu-smi for throttling, "
            "other jobs, CPU binding) or uneven data."
        )
    if bubble_flag:
        advice.append(
            f"bubble {worst_bubble:.0%} vs theory {theory:.0%}: more micro-batches per step (m={m}) "
            "or virtual pipeline stages cut it; excess over theory is stage imbalance or slow p2p."
        )
    if not advice:
        advice.append("cards are evenly loaded.")
    npu_smi = (
        {k: {"mean": _mean(v), "min": min(v), "max": max(v), "samples": len(v)} for k, v in run.npu_smi.items()}
        if run.npu_smi
        else None
    )
    return BalanceCheck(
        busy_definition="compute + optimizer (forward+backward compute minus data wait and TP comm, plus the optimizer step)",
        busy_s=busy,
        rank_spread=rank_spread,
        stages=stages,
        stage_spread=stage_spread,
        bubble_formula="(pp-1)/(v*m+pp-1)",
        pp=pp,
        vpp=vpp,
        microbatches=m,
        bubble_theoretical=theory,
        bubble_measured_worst=worst_bubble,
        threshold={"spread": BALANCE_SPREAD_LIMIT, "bubble_excess": BUBBLE_EXCESS_LIMIT},
        verdict=_verdict(imbalance or bubble_flag),
        advice=advice,
        npu_smi_aicore_pct=npu_smi,
    )


def data_loader_check(run: Run, ranks: list[RankSummary], m: int) -> DataLoaderCheck:
    """Point 4: the worst rank's wait for data, as a share of its iteration."""
    a = run.args
    iteration = {r.rank: r.iteration_s for r in ranks}
    wait = {r.rank: r.parts["data_wait"] for r in ranks}
    share = {k: v / iteration[k] if iteration[k] else 0.0 for k, v in wait.items()}
    worst = max(share, key=share.get)
    flagged = share[worst] > DATA_WAIT_LIMIT
    advice = (
        [
            f"rank {worst} waits {wait[worst] * 1e3:.1f} ms per step ({wait[worst] / m * 1e3:.1f} ms per micro-batch) "
            f"for data: raise --num-workers (now {a.get('num_workers')}), use preprocessed indexed datasets "
            "(megatron-npu preprocess) on local disk, keep tokenisation out of the loop"
            + (
                f"; --data-loader-delay-ms {a.get('data_loader_delay_ms')} is set (test option)"
                if a.get("data_loader_delay_ms")
                else ""
            )
        ]
        if flagged
        else ["the loader keeps up."]
    )
    return DataLoaderCheck(
        figure=share[worst],
        worst_rank=worst,
        wait_s_per_iteration=wait,
        share=share,
        threshold=DATA_WAIT_LIMIT,
        verdict=_verdict(flagged),
        advice=advice,
    )


def grad_reduction_check(run: Run, ranks: list[RankSummary], shape: RunShape, dp_cross: bool) -> GradReductionCheck:
    """Point 5: DP gradient reduction plus the param all-gather, as a share of the iteration."""
    a, dp, m = run.args, shape.dp, shape.microbatches
    iteration = {r.rank: r.iteration_s for r in ranks}
    grad = {r.rank: r.parts["grad_sync"] + r.parts["param_gather"] for r in ranks}
    share = {k: v / iteration[k] if iteration[k] else 0.0 for k, v in grad.items()}
    worst = max(share, key=share.get)
    flagged = share[worst] > GRAD_SYNC_LIMIT
    advice = []
    if dp == 1:
        advice.append("DP=1: no replicas to reduce over; the figure is the local finalize cost.")
    if flagged or dp > 1:
        if not a.get("overlap_grad_reduce"):
            advice.append("--overlap-grad-reduce: reduce buckets during backward instead of after it.")
        else:
            advice.append(
                f"--ddp-bucket-size (now {a.get('ddp_bucket_size') or 'default max(40M, 1M x DP) elements'}): "
                "smaller buckets start reducing earlier; too small costs per-call latency."
            )
        if not a.get("use_distributed_optimizer"):
            advice.append(
                "--use-distributed-optimizer: reduce-scatter + all-gather instead of all-reduce, "
                "optimizer state sharded over DP (add --overlap-param-gather)."
            )
        advice.append(
            f"more micro-batches per step (m={m}: raise --global-batch-size or lower --micro-batch-size) "
            "amortise the once-per-step reduction; gradient compression / less frequent sync for very large DP."
        )
        if dp_cross:
            advice.append(
                "the gradient-sync group crosses nodes (point 2): that reduce is bound by inter-node bandwidth."
            )
    if not advice:
        advice.append("gradient reduction is cheap.")
    return GradReductionCheck(
        figure=share[worst],
        worst_rank=worst,
        grad_reduce_s=grad,
        share=share,
        dp=dp,
        threshold=GRAD_SYNC_LIMIT,
        verdict=_verdict(flagged),
        advice=advice,
    )


def analyse(
    run: Run, skip: int = 1, intra_gbps: float | None = None, inter_gbps: float | None = None
) -> dict[str, Any]:
    """The report as a dict (what --json prints and the renderers read): the named steps above, joined."""
    from megatron_npu.layout.planner import HCCS_GBPS, ROCE_GBPS

    intra = intra_gbps or HCCS_GBPS
    inter = inter_gbps or ROCE_GBPS
    iterations, skip = _select_iterations(run, skip)
    level2 = all("comm" in r for lines in run.records.values() for r in lines if r["iteration"] in iterations)
    ranks, per_iteration = summarise_ranks(run, iterations)
    shape = run_shape(run, ranks)
    mean_it = _mean([r.iteration_s for r in ranks])
    parts_mean = {key: _mean([r.parts[key] for r in ranks]) for key, _ in PARTS}
    # the measured parts (all but the remainder 'other') against the measured iteration, worst rank
    add_up = max(abs(r.parts["other"]) / r.iteration_s for r in ranks if r.iteration_s > 0)
    metrics_it = [m["iteration_s"] for m in run.metrics if m.get("iteration") in iterations and "iteration_s" in m]
    traffic = traffic_check(run, ranks, parts_mean, shape.nnodes, intra, inter)
    checks = {
        "communication": asdict(communication_check(ranks, parts_mean, mean_it, level2)),
        "traffic": asdict(traffic),
        "balance": balance_check(run, ranks, shape).to_json(),
        "data_loader": asdict(data_loader_check(run, ranks, shape.microbatches)),
        "grad_reduction": asdict(grad_reduction_check(run, ranks, shape, bool(traffic.grad_sync_crossing))),
    }
    return {
        "log_dir": str(run.log_dir),
        "layout": {
            "world_size": len(ranks),
            "nodes": shape.nnodes,
            "tp": shape.tp,
            "pp": shape.pp,
            "dp": shape.dp,
            "vpp": shape.vpp if shape.vpp > 1 else None,
            "cp": int(run.args.get("context_parallel_size") or 1),
        },
        "timing_log_level": 2 if level2 else 1,
        "iterations": iterations,
        "skipped_iterations": skip,
        "parts": [key for key, _ in PARTS],
        "part_labels": dict(PARTS),
        "mean_iteration_s": mean_it,
        "mean_parts_s": parts_mean,
        "metrics_iteration_s": _mean(metrics_it) if metrics_it else None,
        "add_up_error": add_up,
        "ranks": [asdict(r) for r in ranks],
        "per_iteration": {str(k): v for k, v in sorted(per_iteration.items())},
        "checks": checks,
        "definitions": DEFINITIONS.strip(),
    }


# ---- rendering ----------------------------------------------------------------------------------------
TITLES = {
    "communication": "1. Communication share of the iteration",
    "traffic": "2. Intra- vs inter-node traffic",
    "balance": "3. Per-rank balance and pipeline bubble",
    "data_loader": "4. Data-loader stall",
    "grad_reduction": "5. Gradient reduction",
}
SHORT = {
    "compute": "compute",
    "data_wait": "data",
    "tp_comm": "tp",
    "tp_grad_sync": "tp-grad",
    "pp_wait": "pp-wait",
    "embedding_sync": "embd",
    "grad_sync": "dp-grad",
    "param_gather": "p-gath",
    "optimizer": "optim",
    "small_collectives": "small",
    "other": "other",
}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def breakdown_table(report: dict[str, Any]) -> list[str]:
    keys = report["parts"]
    head = f"{'rank':>4} {'node':>4} {'tp':>2} {'pp':>2} {'dp':>2} {'iter ms':>8} " + " ".join(
        f"{SHORT[k]:>8}" for k in keys
    )
    out = [head, "-" * len(head)]
    for r in report["ranks"]:
        out.append(
            f"{r['rank']:4d} {r['node']:4d} {r['tp_rank']:2d} {r['pp_rank']:2d} {r['dp_rank']:2d} {_ms(r['iteration_s']):>8} "
            + " ".join(f"{_ms(r['parts'][k]):>8}" for k in keys)
        )
    mp = report["mean_parts_s"]
    out.append(
        f"{'mean':>4} {'':>4} {'':>2} {'':>2} {'':>2} {_ms(report['mean_iteration_s']):>8} "
        + " ".join(f"{_ms(mp[k]):>8}" for k in keys)
    )
    out.append(
        f"{'%':>4} {'':>4} {'':>2} {'':>2} {'':>2} {'100%':>8} "
        + " ".join(f"{mp[k] / report['mean_iteration_s']:>8.1%}" for k in keys)
    )
    return out


def _check_lines(name: str, c: dict[str, Any], report: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if name == "communication":
        out.append(
            f"figure: {_pct(c['figure'])} of the iteration is exposed communication (mean over ranks; "
            f"max rank {_pct(c['max_rank_share'])}); threshold {_pct(c['threshold'])}"
        )
        out.append(
            "by dimension: "
            + ", ".join(f"{k} {_ms(v)} ms ({_pct(c['by_dimension_share'][k])})" for k, v in c["by_dimension_s"].items())
        )
        if not c["measured_tp"]:
            out.append("(TP comm not measured at --timing-log-level 1; it is inside compute)")
        if c.get("expert_all_to_all_s"):
            ep_s = c["expert_all_to_all_s"]
            share = ep_s / report["mean_iteration_s"] if report.get("mean_iteration_s") else 0.0
            out.append(
                f"expert all-to-all (EP, inside compute): {_ms(ep_s)} ms ({_pct(share)}), host time in the calls"
            )
    elif name == "traffic":
        out.append(f"{c['nodes']} node(s); threshold: {c['threshold']}")
        out.append(
            f"  {'group':8} {'dimension':22} {'plan MB':>8} {'wire intra MB':>13} {'wire inter MB':>13} {'meas. MB':>8} "
            f"{'call ms':>8} {'exposed ms':>10}  crosses"
        )
        for label, d in c["dimensions"].items():
            out.append(
                f"  {label:8} {d['dimension']:22} {_mb(d['planned_bytes']):>8} {_mb(d['wire_intra']):>13} {_mb(d['wire_inter']):>13} "
                f"{_mb(d.get('measured_bytes')):>8} {_ms(d.get('measured_s')):>8} {_ms(d.get('exposed_s')):>10}  "
                f"{'YES' if d['crosses_nodes'] else 'no'}"
            )
        out.append(
            "  (per rank per iteration, mean over ranks; plan: megatron_npu.layout.planner; meas./call: level-2 "
            "counter, call = host time inside the calls; exposed: the timers' wait)"
        )
        if c["plan_error"]:
            out.append(f"  plan unavailable: {c['plan_error']}")
        elif c["est_comm_s"]:
            est = c["est_comm_s"]
            out.append(
                f"  est. communication at {c['assumed_gbps']['intra']} / {c['assumed_gbps']['inter']} GB/s intra/inter "
                f"(ASSUMED, --intra-gbps/--inter-gbps): max {max(est.values()) * 1e3:.3f} ms per iteration, no overlap"
            )
        for kind, groups in c["crossing_groups"].items():
            out.append(f"  {kind} groups spanning nodes: {groups}")
    elif name == "balance":
        out.append(f"busy = {c['busy_definition']}")
        spread = f"; spread max/min {c['rank_spread']:.2f}x" if c["rank_spread"] else ""
        out.append("busy per rank (ms): " + ", ".join(f"{k}: {_ms(v)}" for k, v in c["busy_s"].items()) + spread)
        for s, d in c["stages"].items():
            out.append(f"  stage {s}: busy {_ms(d['busy_s'])} ms, bubble measured {_pct(d['bubble_measured'])}")
        if c["pp"] > 1:
            out.append(
                f"bubble theory {c['bubble_formula']} = {_pct(c['bubble_theoretical'])} (pp={c['pp']}, v={c['vpp']}, "
                f"m={c['microbatches']}); worst measured {_pct(c['bubble_measured_worst'])}"
            )
        out.append(
            f"thresholds: spread <= {c['threshold']['spread']:.2f}x, bubble <= theory + {c['threshold']['bubble_excess']:.0%}"
        )
        for k, v in c.get("npu_smi_aicore_pct", {}).items():
            out.append(
                f"  npu-smi {k}: AI Core {v['mean']:.0f}% mean ({v['min']:.0f}-{v['max']:.0f}%, {v['samples']} samples)"
            )
        if "npu_smi_aicore_pct" not in c:
            out.append(
                "AI Core utilisation: not sampled (on npu, while training: "
                "`npu-smi info -t usages -i CARD_ID` > RUN_DIR/npu_smi_cardN.txt)"
            )
    elif name == "data_loader":
        out.append(
            f"figure: rank {c['worst_rank']} waits {_ms(c['wait_s_per_iteration'][c['worst_rank']])} ms per iteration for data "
            f"= {_pct(c['figure'])}; threshold {_pct(c['threshold'])}"
        )
    elif name == "grad_reduction":
        out.append(
            f"figure: rank {c['worst_rank']} spends {_ms(c['grad_reduce_s'][c['worst_rank']])} ms in DP grad reduce + param "
            f"all-gather = {_pct(c['figure'])} (DP={c['dp']}); threshold {_pct(c['threshold'])}"
        )
    out.append(f"verdict: {c['verdict']}")
    out += [f"advice: {line}" for line in c["advice"]]
    return out


def render_text(report: dict[str, Any]) -> str:
    lay = report["layout"]
    out = [
        f"megatron-npu perf-report: {report['log_dir']}",
        f"TP={lay['tp']} PP={lay['pp']} DP={lay['dp']}"
        + (f" VPP={lay['vpp']}" if lay["vpp"] else "")
        + f" on {lay['nodes']} node(s), {lay['world_size']} ranks; timing level {report['timing_log_level']}; "
        f"iterations {report['iterations']} ("
        + (
            f"first {report['skipped_iterations']} skipped: warm-up)"
            if report["skipped_iterations"]
            else "none skipped)"
        ),
        "",
        "per-rank mean iteration breakdown (ms; the parts sum to the iteration):",
        *breakdown_table(report),
        f"the measured parts (all but 'other') add up to the measured iteration time within {report['add_up_error']:.2%} (worst rank)"
        + (
            f"; metrics.jsonl (last rank) says {_ms(report['metrics_iteration_s'])} ms"
            if report["metrics_iteration_s"]
            else ""
        ),
    ]
    for name, title in TITLES.items():
        out += ["", title, *(f"  {line}" for line in _check_lines(name, report["checks"][name], report))]
    return "\n".join(out)


def render_markdown(report: dict[str, Any], plots: list[Path], md_dir: Path) -> str:
    lay = report["layout"]
    keys = report["parts"]
    labels = report["part_labels"]
    out = [
        "# Performance report",
        "",
        f"`{report['log_dir']}`: TP={lay['tp']} PP={lay['pp']} DP={lay['dp']}"
        + (f" VPP={lay['vpp']}" if lay["vpp"] else "")
        + f", {lay['world_size']} ranks on {lay['nodes']} node(s), timing level {report['timing_log_level']}, "
        f"iterations {report['iterations']}.",
        "",
        "| verdict | check | figure |",
        "|---|---|---|",
    ]
    figures = {
        "communication": _pct(report["checks"]["communication"]["figure"]),
        "traffic": "TP/DP crossing nodes"
        if report["checks"]["traffic"]["verdict"] != "ok"
        else "high-frequency traffic intra-node",
        "balance": f"spread {report['checks']['balance']['rank_spread'] or 0:.2f}x",
        "data_loader": _pct(report["checks"]["data_loader"]["figure"]),
        "grad_reduction": _pct(report["checks"]["grad_reduction"]["figure"]),
    }
    for name, title in TITLES.items():
        out.append(f"| {report['checks'][name]['verdict']} | {title} | {figures[name]} |")
    out += [
        "",
        "## Iteration breakdown (ms, mean per rank)",
        "",
        "| rank | node | pp | iteration | " + " | ".join(labels[k] for k in keys) + " |",
        "|" + "---|" * (4 + len(keys)),
    ]
    for r in report["ranks"]:
        out.append(
            f"| {r['rank']} | {r['node']} | {r['pp_rank']} | {_ms(r['iteration_s'])} | "
            + " | ".join(_ms(r["parts"][k]) for k in keys)
            + " |"
        )
    out += [
        "",
        f"The measured parts (all but 'other') add up to the measured iteration time within "
        f"{report['add_up_error']:.2%} (worst rank).",
        "",
    ]
    for name, title in TITLES.items():
        out += [f"## {title}", "", "```", *_check_lines(name, report["checks"][name], report), "```", ""]
    for plot in plots:
        out += [f"![{plot.stem}]({os.path.relpath(plot, md_dir)})", ""]
    out += ["## Definitions", "", "```", report["definitions"], "```", ""]
    return "\n".join(out)


def write_plots(report: dict[str, Any], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    keys = report["parts"]
    labels = report["part_labels"]
    colors = plt.get_cmap("tab20").colors
    out = []

    def stacked(ax: Any, names: list[str], rows: list[dict[str, float]]) -> None:
        bottom = [0.0] * len(rows)
        for i, k in enumerate(keys):
            values = [max(row[k], 0.0) * 1e3 for row in rows]
            ax.bar(names, values, bottom=bottom, label=labels[k], color=colors[i % len(colors)])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel("ms")

    fig, ax = plt.subplots(figsize=(9, 4.5))
    stacked(
        ax,
        [f"r{r['rank']}\npp{r['pp_rank']} n{r['node']}" for r in report["ranks"]],
        [r["parts"] for r in report["ranks"]],
    )
    ax.plot(
        range(len(report["ranks"])),
        [r["iteration_s"] * 1e3 for r in report["ranks"]],
        "k_",
        markersize=30,
        label="iteration",
    )
    ax.set_title("mean iteration time per rank, by part")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = directory / "per_rank_breakdown.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    out.append(path)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    iters = report["per_iteration"]
    stacked(ax, list(iters), list(iters.values()))
    ax.set_xlabel("iteration (mean over ranks)")
    ax.set_title("iteration breakdown over time")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = directory / "per_iteration_breakdown.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    out.append(path)
    return out


# ---- command ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-npu perf-report", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="the --log-dir of pretrain_gpt.py, or a directory holding logs/")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument("--markdown", type=Path, default=None, help="Markdown report (default RUN_DIR/perf_report.md)")
    p.add_argument("--plots-dir", type=Path, default=None, help="PNG plots (default RUN_DIR/perf_plots)")
    p.add_argument(
        "--skip-iterations", type=int, default=1, help="leading iterations to leave out (warm-up; default 1)"
    )
    p.add_argument("--intra-gbps", type=float, default=None, help="intra-node GB/s for the planner's estimate")
    p.add_argument("--inter-gbps", type=float, default=None, help="inter-node GB/s for the planner's estimate")
    a = p.parse_args(argv)
    if a.skip_iterations < 0:
        print("perf-report: error: --skip-iterations must be >= 0", file=sys.stderr)
        return 2
    try:
        run = load_run(a.run_dir)
        report = analyse(run, a.skip_iterations, a.intra_gbps, a.inter_gbps)
    except ReportError as exc:
        print(f"perf-report: error: {exc}", file=sys.stderr)
        return 2
    plots = write_plots(report, a.plots_dir or a.run_dir / "perf_plots")
    markdown = a.markdown or a.run_dir / "perf_report.md"
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(render_markdown(report, plots, markdown.parent))
    report["outputs"] = {"markdown": str(markdown), "plots": [str(x) for x in plots]}
    print(json.dumps(report, indent=1, default=str) if a.json else render_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
