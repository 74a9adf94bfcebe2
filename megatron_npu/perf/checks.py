"""perf-report, step 2: the five checks, each a typed result with a figure, a verdict against a
threshold below and advice (point 2 with the communication planner run on the run's own layout).

1. communication share of the iteration, by dimension (TP, PP, DP gradient reduce, param all-gather);
2. intra- vs inter-node traffic per dimension (megatron_npu.layout.planner on the rank map
   load.py rebuilt, layout.json's ``node`` being where ranks really ran), measured time per group
   at level 2, TP / gradient-sync groups crossing nodes flagged;
3. per-rank and per-stage balance of busy time, and the pipeline bubble vs theory;
4. data-loader stall;
5. gradient-reduction share.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from megatron_npu.layout.cp_comm import placement_note
from megatron_npu.layout.parallel_dims import LayoutError
from megatron_npu.layout.plan_cp_fsdp import fsdp_scheme
from megatron_npu.perf.load import DIMENSIONS, RankSummary, ReportError, Run, mean

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
    "cp": "CP attention",
    "cp_a2a": "CP a2a (a2a+p2p)",
    "cp_ring": "CP ring (a2a+p2p)",
}
HIGH_FREQUENCY = ("tp", "dp_cp")
# groups only a MoE run builds and uses (the rank map derives them for every layout)
EXPERT_GROUPS = ("ep", "edp", "tp_ep", "expert_mp", "tp_cp")
# the order point 2 lists groups that span nodes in
CROSSING_ORDER = ("tp", "pp", "dp", "cp", "dp_cp", "mp", "embd", *EXPERT_GROUPS)


def _verdict(flagged: bool) -> str:
    return "FLAGGED" if flagged else "ok"


def _spread(values: list[float]) -> float | None:
    return max(values) / min(values) if values and min(values) > 0 else None


@dataclass
class RunShape:
    """What the checks need of the run's layout: degrees and micro-batches per step."""

    tp: int
    pp: int
    dp: int
    cp: int
    vpp: int  # 1 without interleaving
    microbatches: int
    nnodes: int


def run_shape(run: Run, ranks: list[RankSummary]) -> RunShape:
    """The degrees from the run's rank map; micro-batches per step as the ranks recorded them,
    else from args.json's batch sizes by the layout's own rule (ParallelDims.microbatches)."""
    dims = run.rank_map.dims
    m = next((r.num_microbatches for r in ranks if r.num_microbatches), None)
    if m is None:
        a = run.args
        try:
            m = dims.microbatches(int(a.get("global_batch_size", 1)), int(a.get("micro_batch_size", 1)))
        except (LayoutError, TypeError, ValueError) as exc:
            raise ReportError(f"{run.log_dir / 'args.json'}: {exc}") from None
    return RunShape(dims.tp, dims.pp, dims.dp, dims.cp, dims.virtual_stages, m, run.rank_map.nnodes)


# ---- point 2's planner: the run's model and parallel settings from args.json --------------------------
def _planner(run: Run, intra: float, inter: float) -> tuple[Any, str | None]:
    """The CommPlan of this run on its rank map (the nodes layout.json recorded), or (None, why not)."""
    from megatron_npu.layout.model_shape import ModelShape
    from megatron_npu.layout.plan_cp_fsdp import cp_fsdp_fields
    from megatron_npu.layout.planner import ModelSpec, ParallelSpec, plan

    a = run.args
    dtype = "bf16" if a.get("bf16") else "fp16" if a.get("fp16") else "fp32"
    try:
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
            **cp_fsdp_fields(a),
        )
        return plan(model, run.rank_map, par, intra, inter), None
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


def _crossing(run: Run) -> dict[str, list[list[int]]]:
    """Groups of each kind the run built whose ranks ran on more than one node (the rank map's nodes)."""
    rmap = run.rank_map
    kinds = sorted(rmap.groups, key=lambda k: CROSSING_ORDER.index(k) if k in CROSSING_ORDER else len(CROSSING_ORDER))
    kinds = [k for k in kinds if rmap.num_experts or k not in EXPERT_GROUPS]
    return {kind: sorted(g for g in rmap.groups[kind] if rmap.spans_nodes(g)) for kind in kinds}


# One typed result per check; ``report.analyse`` joins them into the report dict the renderers
# and --json read (field order = the JSON's key order).
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
    measures: str = "DP grad reduce + param all-gather"


def communication_check(
    ranks: list[RankSummary], parts_mean: dict[str, float], mean_it: float, level2: bool
) -> CommunicationCheck:
    """Point 1: exposed communication's share of the iteration, by dimension."""
    shares = {r.rank: r.comm_s / r.iteration_s if r.iteration_s else 0.0 for r in ranks}
    by_dim = {dim: sum(parts_mean[p] for p in keys) for dim, keys in DIMENSIONS.items()}
    comm_share = mean(list(shares.values()))
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
            "FSDP gather/scatter": ["see point 5: what stays gathered between micro-batches, and overlap"],
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
        expert_all_to_all_s=mean([r.comm_groups.get("ep", {}).get("seconds", 0.0) for r in ranks]),
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
        "dp_cp": ("grad_sync", "param_gather", "fsdp_comm"),
        "embd": ("embedding_sync",),
    }
    for label, d in dims.items():
        d["exposed_s"] = sum(parts_mean[p] for p in exposed[label]) if label in exposed else d.get("measured_s")
        d["dimension"] = PLAN_DIMENSIONS.get(label, label)
        d["crosses_nodes"] = bool(crossing.get(label)) if label != "dist_opt" else nnodes > 1  # dist_opt: every rank
    tp_cross = [g for g in crossing.get("tp", []) if len(g) > 1]
    dp_cross = [g for g in crossing.get("dp_cp", []) if len(g) > 1]
    rmap = run.rank_map
    cp_note = placement_note(rmap.tp, rmap.cp, rmap.nproc_per_node) if crossing.get("cp") else None
    flagged = bool(tp_cross or dp_cross or cp_note)
    advice = [cp_note] if cp_note else []  # the CP ring / all-to-all runs every layer, forward and backward
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
        threshold="no TP, CP or DP gradient-sync group spans nodes",
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
        fb = mean([r.forward_backward_s for r in members])
        stages[s] = {
            "busy_s": mean([r.busy_s for r in members]),
            "bubble_measured": mean([r.parts["pp_wait"] for r in members]) / fb if fb else 0.0,
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
        {k: {"mean": mean(v), "min": min(v), "max": max(v), "samples": len(v)} for k, v in run.npu_smi.items()}
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
    replicas = dp * shape.cp  # gradients are reduced over DP x CP (CP ranks hold parts of the same samples)
    iteration = {r.rank: r.iteration_s for r in ranks}
    scheme = fsdp_scheme(a)
    if scheme is None:
        grad = {r.rank: r.parts["grad_sync"] + r.parts["param_gather"] for r in ranks}
    else:  # FSDP gathers and reduce-scatters inside forward / backward, where the step's timers do not look
        grad = {r.rank: r.parts["fsdp_comm"] for r in ranks}
    share = {k: v / iteration[k] if iteration[k] else 0.0 for k, v in grad.items()}
    worst = max(share, key=share.get)
    flagged = share[worst] > GRAD_SYNC_LIMIT
    if scheme is not None:
        advice = _fsdp_advice(a, scheme, replicas, flagged, dp_cross, any(r.comm_groups for r in ranks))
    else:
        advice = _ddp_advice(a, replicas, flagged, dp_cross, m)
    return GradReductionCheck(
        figure=share[worst],
        worst_rank=worst,
        grad_reduce_s=grad,
        share=share,
        dp=dp,
        threshold=GRAD_SYNC_LIMIT,
        verdict=_verdict(flagged),
        advice=advice,
        measures="DP grad reduce + param all-gather" if scheme is None else f"FSDP ({scheme}) collectives on DP x CP",
    )


def _ddp_advice(a: dict[str, Any], replicas: int, flagged: bool, dp_cross: bool, m: int) -> list[str]:
    advice = []
    if replicas == 1:
        advice.append("DP x CP = 1: no replicas to reduce over; the figure is the local finalize cost.")
    if flagged or replicas > 1:
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
    return advice or ["gradient reduction is cheap."]


def _fsdp_advice(
    a: dict[str, Any], scheme: str, replicas: int, flagged: bool, dp_cross: bool, counted: bool
) -> list[str]:
    """FSDP's levers: what stays gathered, and what overlaps (DDP's bucket and optimizer advice does not apply)."""
    if not counted:
        return [
            "FSDP's collectives run inside forward / backward: rerun with --timing-log-level 2 to count them "
            "(host time inside the calls, per group)."
        ]
    advice = []
    if replicas == 1:
        advice.append("DP x CP = 1: FSDP has no shards to gather or reduce over.")
    if flagged or replicas > 1:
        if scheme == "torch_fsdp2" and a.get("torch_fsdp2_reshard_after_forward", True):
            advice.append(
                "--torch-fsdp2-no-reshard-after-forward: each layer keeps its gathered weights from forward to "
                "backward, one all-gather fewer per layer and micro-batch (the layer's whole weights held meanwhile)."
            )
        if scheme == "optim_grads_params":
            advice.append(
                "--data-parallel-sharding-strategy optim_grads: weights stay whole, no gather per layer and "
                "micro-batch, where memory allows (`megatron-npu plan` gives the per-rank bytes of each strategy)."
            )
        if scheme != "torch_fsdp2" and not (a.get("overlap_grad_reduce") and a.get("overlap_param_gather")):
            advice.append(
                "--overlap-grad-reduce --overlap-param-gather: Megatron-FSDP then reduces and gathers "
                "each unit while the next one computes."
            )
        if scheme in ("optim_grads_params", "torch_fsdp2"):
            advice.append(
                "a larger --micro-batch-size (fewer micro-batches per step): the weights are gathered again "
                "for every micro-batch."
            )
        if dp_cross:
            advice.append(
                "the FSDP group crosses nodes (point 2): every gather and reduce-scatter is bound by "
                "inter-node bandwidth; keep DP x CP inside a node or use a larger TP."
            )
    return advice or ["FSDP's communication is cheap."]
