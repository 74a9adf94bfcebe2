"""``megatron-npu plan --search``: the layouts of one model that fit the device, ranked by a predicted step time.

Enumerated: TP (a divisor of the node's ranks, so a TP group stays on HCCS), PP (dividing the layers),
VPP (none, 2, 4), EP (dividing the experts), recompute (none, selective, full uniform 1 layer), the
distributed optimizer (on, off); sequence parallelism whenever TP > 1; DP is what is left; the given
micro-batch size. Each candidate goes through the trainer's own validation (the flags printed are
flags pretrain_gpt.py accepts for this world size).

Fit: the memory model's largest rank (megatron_npu/layout/memory.py; first and last stages differ)
within the device's memory (PLANNING_FACTS.device_memory_gb: 910B 64 GB) less ``HEADROOM`` for what
the model leaves out (the caching allocator's fragmentation, workspaces, communication buffers,
torch_npu's own reserve).

Step time (ASSUMED figures, to rank layouts, not to promise a time):
* compute: the step's FLOPs per rank (Megatron-LM's count: 6 x params x tokens plus attention,
  x 4/3 with full recompute) at ``EFFICIENCY`` of the device's bf16 peak;
* the pipeline bubble, (PP - 1) / (VPP x micro-batches) of the compute;
* communication: the planner's wire bytes per rank at the link bandwidths (HCCS inside a node, RoCE
  between nodes), TP / CP / EP and pipeline traffic exposed (megatron-core does not overlap them
  here: TP comm overlap is refused on Ascend); DP gradient reduction and parameter gathering
  overlapped with the backward / forward compute (--overlap-grad-reduce / --overlap-param-gather, as
  the printed flags set), only what exceeds them exposed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from megatron_npu.accelerator.facts import PLANNING_FACTS
from megatron_npu.layout.memory import MemorySettings, RankMemory, predict, settings_from_args
from megatron_npu.layout.model_spec import ModelSpec
from megatron_npu.layout.parallel_dims import LayoutError, ParallelDims, divisors
from megatron_npu.layout.planner import plan

HEADROOM = 0.10  # of the device's memory, kept free for what the model does not count
EFFICIENCY = 0.40  # of the device's bf16 peak that the GEMMs reach (assumed MFU-like figure)
VPP_CHOICES = (None, 2, 4)
RECOMPUTE_CHOICES: dict[str, list[str]] = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}
DP_OVERLAP = 2 / 3  # the share of compute (the backward) that DP traffic hides behind
TIMED = 12  # candidates whose communication is planned (the fastest by compute and bubble)


@dataclass
class Candidate:
    tp: int
    pp: int
    vpp: int | None
    ep: int
    recompute: str
    dist_opt: bool
    flags: list[str] = field(default_factory=list)
    memory: list[RankMemory] = field(default_factory=list)
    compute_s: float = 0.0
    bubble_s: float = 0.0
    comm_s: float = 0.0
    crossing: list[str] = field(default_factory=list)
    dp: int = 1

    @property
    def peak_bytes(self) -> int:
        return max(m.total_bytes for m in self.memory)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s

    def layout_flags(self) -> list[str]:
        f = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        f += ["--num-virtual-stages-per-pipeline-rank", str(self.vpp)] if self.vpp else []
        f += ["--expert-model-parallel-size", str(self.ep)] if self.ep > 1 else []
        f += ["--sequence-parallel"] if self.tp > 1 else []
        f += ["--use-distributed-optimizer", "--overlap-param-gather"] if self.dist_opt else []
        f += ["--overlap-grad-reduce"] if self.dp > 1 else []
        return f + RECOMPUTE_CHOICES[self.recompute]


def _strip_layout(argv: list[str]) -> list[str]:
    """The user's flags without the ones the search chooses."""
    chosen_values = {
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--num-virtual-stages-per-pipeline-rank",
        "--num-layers-per-virtual-pipeline-stage",
        "--expert-model-parallel-size",
        "--recompute-granularity",
        "--recompute-method",
        "--recompute-num-layers",
    }
    chosen_switches = {
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--recompute-activations",
    }
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in chosen_values:
            skip = "=" not in tok
            continue
        if name not in chosen_switches:
            out.append(tok)
    return out


def step_flops(model: ModelSpec, recompute: str) -> float:
    """Megatron-LM's FLOPs of one step (forward + backward; full recompute adds a forward)."""
    shape, s, tokens = model.shape, model.seq_length, model.global_batch_size * model.seq_length
    h, layers = shape.hidden_size, model.num_layers
    q, kv = shape.num_attention_heads * shape.kv_channels, shape.num_query_groups * shape.kv_channels
    mlp = 3 if model.swiglu else 2
    dense_ffn = shape.ffn_hidden_size
    moe = sum(model.moe_layers(0, layers))
    per_token = 2 * (h * (q + 2 * kv) + q * h) + 2 * 2 * s * q  # projections, scores and values
    ffn = (layers - moe) * 2 * mlp * h * dense_ffn + moe * 2 * mlp * h * model.moe_ffn * model.moe_router_topk
    forward = tokens * (layers * per_token + ffn + 2 * h * model.padded_vocab(1))
    return forward * (4 if recompute == "full" else 3)


def _peak_flops() -> float:
    return PLANNING_FACTS.peak_tflops_bf16.get(PLANNING_FACTS.device, 0.0) * 1e12


def candidates(model: ModelSpec, world: int, nproc: int) -> list[Candidate]:
    """Every layout the enumeration covers (validity checked later by the trainer's validation)."""
    shape, out = model.shape, []
    experts = model.num_experts or 0
    for tp in divisors(nproc):
        if shape.num_attention_heads % tp or shape.num_query_groups % tp or shape.ffn_hidden_size % tp:
            continue
        for pp in [p for p in divisors(world // tp) if model.num_layers % p == 0]:
            dp = world // (tp * pp)
            if model.global_batch_size % (model.micro_batch_size * dp):
                continue
            vpps = [v for v in VPP_CHOICES if v is None or (pp > 1 and (model.num_layers // pp) % v == 0)]
            eps = [e for e in divisors(experts) if world % (tp * e * pp) == 0] if experts else [1]
            for vpp, ep, recompute, dist_opt in itertools.product(vpps, eps, RECOMPUTE_CHOICES, (True, False)):
                if dist_opt and dp == 1:
                    continue  # nothing to shard
                out.append(Candidate(tp, pp, vpp, ep, recompute, dist_opt, dp=dp))
    return out


def _layout_args(c: Candidate, base: argparse.Namespace, world: int) -> argparse.Namespace:
    """The model's settings with this candidate's layout (what its flags make validation derive)."""
    args = base.copy() if hasattr(base, "copy") else argparse.Namespace(**vars(base))
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = c.tp, c.pp
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = c.ep, c.tp
    args.virtual_pipeline_model_parallel_size = c.vpp
    args.microbatch_group_size_per_vp_stage = c.pp  # validation's default: the interleaved schedule's groups
    args.num_layers_per_virtual_pipeline_stage = args.num_virtual_stages_per_pipeline_rank = None
    args.sequence_parallel = c.tp > 1
    args.use_distributed_optimizer, args.overlap_grad_reduce = c.dist_opt, c.dp > 1
    args.recompute_granularity = {"none": None}.get(c.recompute, c.recompute)
    args.recompute_method, args.recompute_num_layers = ("uniform", 1) if c.recompute == "full" else (None, None)
    args.world_size = world
    return args


def _estimate(c: Candidate, base: argparse.Namespace, model: ModelSpec, world: int, nproc: int, nnodes: int) -> bool:
    """The candidate's memory per stage and compute time (False: a layout the rank map refuses)."""
    args = _layout_args(c, base, world)
    try:  # the layout's rules (ParallelDims); megatron-core's rank map is built only for the fastest
        dims = ParallelDims.for_launch(
            tp=c.tp, pp=c.pp, ep=c.ep, vpp=c.vpp, nnodes=nnodes, nproc_per_node=nproc, num_experts=model.num_experts
        )
    except LayoutError:
        return False
    c.memory = _stage_memory(model, dims, settings_from_args(args))
    c.compute_s = step_flops(model, c.recompute) / world / (_peak_flops() * EFFICIENCY)
    microbatches = model.global_batch_size // (model.micro_batch_size * c.dp)
    c.bubble_s = c.compute_s * (c.pp - 1) / ((c.vpp or 1) * microbatches)
    c._args = args  # type: ignore[attr-defined]
    return True


def _validate(c: Candidate, base_flags: list[str], world: int) -> bool:
    """The trainer's own parser and validation accept the candidate's flags for this world size."""
    from megatron_npu.plan.flags import parse_trainer_args
    from megatron_npu.policy import ConfigError

    c.flags = base_flags + c.layout_flags()
    try:
        parse_trainer_args(c.flags, world)
    except (ConfigError, ValueError):
        return False
    return True


def _crosses(rmap: Any, label: str) -> bool:
    return any(rmap.spans_nodes(g) for g in rmap.groups.get(label, []))


def _stage_memory(model: ModelSpec, dims: Any, st: MemorySettings) -> list[RankMemory]:
    """The first and the last pipeline stage's first rank: the stages whose peaks bound the others
    (a middle stage holds the same layers as the first, fewer micro-batches in flight, no embedding)."""
    per_stage = dims.world_size // dims.pp
    return [predict(model, dims, st, stage * per_stage) for stage in sorted({0, dims.pp - 1})]


def _communication(c: Candidate, nnodes: int, nproc: int, intra: float, inter: float) -> None:
    """Exposed communication seconds of the slowest stage: the planner's wire bytes per label."""
    from megatron_npu.layout.rankmap import build_rank_map
    from megatron_npu.plan.flags import specs_from_args

    model, par = specs_from_args(c._args)  # type: ignore[attr-defined]
    rmap = build_rank_map(
        tp=c.tp, pp=c.pp, vpp=c.vpp, ep=c.ep, nnodes=nnodes, nproc_per_node=nproc, num_experts=model.num_experts
    )
    c.crossing = sorted(label for label in ("tp", "pp", "dp", "cp", "ep") if _crosses(rmap, label))
    result = plan(model, rmap, par, intra, inter)
    per_stage = rmap.world_size // rmap.dims.pp
    worst = 0.0
    for stage in range(rmap.dims.pp):
        groups = result.ranks[stage * per_stage].by_label()
        secs = {k: v["wire_intra"] / (intra * 1e9) + v["wire_inter"] / (inter * 1e9) for k, v in groups.items()}
        dp = sum(v for k, v in secs.items() if k in ("dp_cp", "edp"))
        exposed = sum(v for k, v in secs.items() if k not in ("dp_cp", "edp")) + max(0.0, dp - DP_OVERLAP * c.compute_s)
        worst = max(worst, exposed)
    c.comm_s = worst


def search(
    base_flags: list[str], nnodes: int, nproc: int, intra: float, inter: float
) -> tuple[list[Candidate], list[Candidate]]:
    """(the fitting candidates the trainer validates, fastest first; every candidate estimated)."""
    from megatron_npu.layout.memory import model_spec_from_args
    from megatron_npu.plan.flags import parse_trainer_args

    world = nnodes * nproc
    base = parse_trainer_args(base_flags, 1)  # the model's flags, checked once (no layout yet)
    model = model_spec_from_args(base)
    limit = PLANNING_FACTS.device_memory_gb * 1e9 * (1 - HEADROOM)
    estimated = [c for c in candidates(model, world, nproc) if _estimate(c, base, model, world, nproc, nnodes)]
    fitting = sorted((c for c in estimated if c.peak_bytes <= limit), key=lambda c: c.compute_s + c.bubble_s)
    timed: list[Candidate] = []
    for c in fitting:
        if len(timed) == TIMED:
            break
        if _validate(c, base_flags, world):
            _communication(c, nnodes, nproc, intra, inter)
            timed.append(c)
    return sorted(timed, key=lambda c: c.step_s), estimated


def _row(c: Candidate, nnodes: int, nproc: int) -> dict[str, Any]:
    return {
        "tp": c.tp,
        "pp": c.pp,
        "vpp": c.vpp,
        "dp": c.dp,
        "ep": c.ep,
        "recompute": c.recompute,
        "distributed_optimizer": c.dist_opt,
        "flags": c.flags,
        "predicted_step_s": c.step_s,
        "compute_s": c.compute_s,
        "bubble_s": c.bubble_s,
        "exposed_comm_s": c.comm_s,
        "max_memory_bytes": c.peak_bytes,
        "memory": [m.to_json() for m in c.memory],
        "rank_map": {"nnodes": nnodes, "nproc_per_node": nproc, "groups_crossing_nodes": c.crossing},
    }


def _print(rows: list[Candidate], nnodes: int, nproc: int, valid: int) -> None:
    gb = PLANNING_FACTS.device_memory_gb
    print(
        f"{len(rows)} fastest of the layouts that fit {gb:.0f} GB x (1 - {HEADROOM:.0%} headroom) per "
        f"{PLANNING_FACTS.device} ({valid} layouts estimated) on {nnodes} x {nproc}; step time ASSUMES "
        f"{EFFICIENCY:.0%} of {_peak_flops() / 1e12:.0f} TFLOP/s bf16 and the planner's bandwidths"
    )
    for i, c in enumerate(rows, 1):
        mem = ", ".join(f"stage {m.pp_rank} rank {m.rank}: {m.total_bytes / 1e9:.1f} GB" for m in c.memory)
        cross = ", ".join(c.crossing) or "none"
        print(
            f"{i}. TP {c.tp} x PP {c.pp}{f' x VPP {c.vpp}' if c.vpp else ''} x DP {c.dp}"
            f"{f' (EP {c.ep})' if c.ep > 1 else ''}, recompute {c.recompute}, distributed optimizer "
            f"{'on' if c.dist_opt else 'off'}: step {c.step_s:.2f} s (compute {c.compute_s:.2f}, bubble "
            f"{c.bubble_s:.2f}, exposed comm {c.comm_s:.2f})"
        )
        print(f"   memory per card: {mem}")
        print(f"   rank map: TP groups inside a node; groups crossing nodes: {cross}")
        print(f"   flags: {' '.join(c.flags)}")


def run_search(a: argparse.Namespace, argv: list[str]) -> int:
    """The CLI's --search: prints the top layouts, or one line when none fits."""
    rows, valid = search(_strip_layout(argv), a.nnodes, a.nproc_per_node, a.intra_gbps, a.inter_gbps)
    if not rows:
        smallest = min((c.peak_bytes for c in valid), default=float("nan"))
        print(
            f"plan: no layout fits: {len(valid)} layouts on {a.nnodes} x {a.nproc_per_node}, the smallest needs "
            f"{smallest / 1e9:.1f} GB per card > {PLANNING_FACTS.device_memory_gb:.0f} GB less {HEADROOM:.0%} "
            "headroom; add nodes, lower --micro-batch-size or --seq-length",
            file=sys.stderr,
        )
        return 3
    top = rows[: a.top]
    if a.json:
        print(
            json.dumps(
                {
                    "headroom": HEADROOM,
                    "efficiency": EFFICIENCY,
                    "layouts": [_row(c, a.nnodes, a.nproc_per_node) for c in top],
                }
            )
        )
    else:
        _print(top, a.nnodes, a.nproc_per_node, len(valid))
    return 0
