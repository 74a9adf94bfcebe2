"""``megatron-npu plan --search``: the layouts of one model that fit the device, ranked by a predicted step time.

Enumerated: TP (a divisor of the node's ranks, so a TP group stays on HCCS), CP (TP x CP inside a node),
PP (dividing the layers, or uneven first / last stages: lighter ends, or the split a layer count
that PP does not divide needs), VPP (none, 2, 4), EP (dividing the experts), the micro-batch size (1,
2, 4), recompute (none, full uniform 1 layer; selective equals none under flash attention), the
distributed optimizer wherever DP x CP > 1; sequence parallelism whenever TP > 1; DP is what is
left. Each printed candidate passes the trainer's own validation (its flags are flags pretrain_gpt.py
accepts for this world size).

Fit: the memory model's largest rank (megatron_npu/layout/memory.py; every kind of pipeline stage: ends and middles differ)
within the device's memory (PLANNING_FACTS.device_memory_gb: 910B 64 GB) less ``HEADROOM`` for what
the model leaves out (the caching allocator's fragmentation, workspaces, communication buffers,
torch_npu's own reserve).

Rank: the step-time model (megatron_npu/layout/step_time.py, its assumptions printed): tokens/s per
NPU and MFU per layout. Layouts within 1% of each other's step time are ordered by memory headroom
(the most left first); rows that predict the same memory and time for the same degrees are folded
into one (e.g. recompute none and selective under flash attention).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any

from megatron_npu.accelerator.facts import PLANNING_FACTS
from megatron_npu.layout.memory import MemorySettings, RankMemory, predict, settings_from_args
from megatron_npu.layout.model_spec import ModelSpec
from megatron_npu.layout.parallel_dims import LayoutError, ParallelDims, divisors
from megatron_npu.layout.planner import plan
from megatron_npu.layout.rankmap import build_rank_map
from megatron_npu.layout.stages import chunk_layers
from megatron_npu.layout.step_time import StepTime, assumptions, comm_seconds, step_time

GB = 1e9  # the unit of every figure printed: GB = 1e9 bytes
HEADROOM = 0.10  # of the device's memory, kept free for what the model does not count
TIE = 0.01  # step times within 1% are a tie, broken by memory headroom
VPP_CHOICES = (None, 2, 4)
CP_CHOICES = (1, 2, 4, 8)
MBS_CHOICES = (1, 2, 4)
RECOMPUTE_CHOICES: dict[str, list[str]] = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}
SEARCHED_RECOMPUTE = ("none", "full")
# the planning device (PLANNING_FACTS: 910B) runs torch_npu's fused attention (npu_fusion_attention)
FLASH_ATTENTION = ["--use-flash-attn"]
TIMED = 24  # candidates whose communication is planned (the fastest by compute and bubble)
FLAG_WIDTH = 100  # printed flag lines wrap here, as a launch script's continuation lines


@dataclass
class Candidate:
    tp: int
    pp: int
    vpp: int | None
    ep: int
    recompute: str
    dist_opt: bool
    dp: int = 1
    cp: int = 1
    mbs: int = 1
    uneven: tuple[int, int] | None = None  # (first, last) stage layers
    flags: list[str] = field(default_factory=list)
    memory: list[RankMemory] = field(default_factory=list)
    time: StepTime | None = None
    crossing: list[str] = field(default_factory=list)
    dims: ParallelDims | None = None
    args: Any = None

    @property
    def peak_bytes(self) -> int:
        return max(m.total_bytes for m in self.memory)

    @property
    def step_s(self) -> float:
        return self.time.step_s if self.time else float("inf")

    def degrees(self) -> tuple:
        return (self.tp, self.pp, self.vpp, self.dp, self.ep, self.cp, self.mbs, self.uneven)

    def layout_flags(self) -> list[str]:
        f = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        f += ["--num-virtual-stages-per-pipeline-rank", str(self.vpp)] if self.vpp else []
        if self.uneven:
            f += ["--decoder-first-pipeline-num-layers", str(self.uneven[0])]
            f += ["--decoder-last-pipeline-num-layers", str(self.uneven[1])]
        f += ["--context-parallel-size", str(self.cp)] if self.cp > 1 else []
        f += ["--expert-model-parallel-size", str(self.ep)] if self.ep > 1 else []
        f += ["--sequence-parallel"] if self.tp > 1 else []
        f += ["--use-distributed-optimizer", "--overlap-param-gather"] if self.dist_opt else []
        f += ["--overlap-grad-reduce"] if self.dp * self.cp > 1 else []
        f += ["--micro-batch-size", str(self.mbs)]
        return f + FLASH_ATTENTION + RECOMPUTE_CHOICES[self.recompute]


CHOSEN_VALUES = {
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--num-virtual-stages-per-pipeline-rank",
    "--num-layers-per-virtual-pipeline-stage",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--context-parallel-size",
    "--expert-model-parallel-size",
    "--micro-batch-size",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
}
CHOSEN_SWITCHES = {
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--recompute-activations",
    "--use-flash-attn",
}


def _strip_layout(argv: list[str]) -> list[str]:
    """The user's flags without the ones the search chooses."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in CHOSEN_VALUES:
            skip = "=" not in tok
            continue
        if name not in CHOSEN_SWITCHES:
            out.append(tok)
    return out


def _stage_splits(num_layers: int, pp: int) -> list[tuple[int, int] | None]:
    """None (an even split) where PP divides the layers; uneven (first, last) splits with lighter ends,
    or the ones a layer count PP does not divide needs (megatron-core's first / last stage flags)."""
    out: list[tuple[int, int] | None] = [None] if num_layers % pp == 0 else []
    if pp < 2 or not {"first_stage_layers", "last_stage_layers"} <= {f.name for f in dataclasses.fields(ParallelDims)}:
        return out
    per = -(-num_layers // pp)
    for first, last in itertools.product(range(max(1, per - 2), per + 1), repeat=2):
        middle = num_layers - first - last
        if pp == 2 and middle == 0 or pp > 2 and middle > 0 and middle % (pp - 2) == 0:
            if (first, last) != (per, per) or num_layers % pp:
                out.append((first, last))
    return out[:3]


def candidates(model: ModelSpec, world: int, nproc: int) -> list[Candidate]:
    """Every layout the enumeration covers (validity checked later by the trainer's validation)."""
    shape, out = model.shape, []
    experts = model.num_experts or 0
    for tp, cp in itertools.product(divisors(nproc), CP_CHOICES):
        if shape.num_attention_heads % tp or shape.num_query_groups % tp or shape.ffn_hidden_size % tp:
            continue
        if tp * cp > nproc or model.seq_length % (2 * cp) or world % (tp * cp):
            continue
        for pp in [p for p in divisors(world // (tp * cp)) if p <= model.num_layers]:
            dp = world // (tp * cp * pp)
            for uneven, mbs in itertools.product(_stage_splits(model.num_layers, pp), MBS_CHOICES):
                if model.global_batch_size % (mbs * dp):
                    continue
                per = model.num_layers // pp
                vpps = [v for v in VPP_CHOICES if v is None or (pp > 1 and not uneven and per % v == 0)]
                eps = [e for e in divisors(experts) if (dp * cp) % e == 0] if experts else [1]
                # the distributed optimizer wherever there is a DP group to shard over (it never holds more,
                # and reduces the same bytes); recompute none or full: under flash attention selective
                # recompute has no [s, s] scores to drop, the same row as none
                dist_opt = dp * cp > 1
                for vpp, ep, recompute in itertools.product(vpps, eps, SEARCHED_RECOMPUTE):
                    out.append(Candidate(tp, pp, vpp, ep, recompute, dist_opt, dp, cp, mbs, uneven))
    return out


def _layout_args(c: Candidate, base: argparse.Namespace, world: int) -> argparse.Namespace:
    """The model's settings with this candidate's layout (what its flags make validation derive)."""
    args = argparse.Namespace(**vars(base))
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = c.tp, c.pp
    args.context_parallel_size, args.micro_batch_size = c.cp, c.mbs
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = c.ep, c.tp
    args.virtual_pipeline_model_parallel_size = c.vpp
    args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers = c.uneven or (None, None)
    args.microbatch_group_size_per_vp_stage = c.pp  # validation's default: the interleaved schedule's groups
    args.num_layers_per_virtual_pipeline_stage = args.num_virtual_stages_per_pipeline_rank = None
    args.sequence_parallel = c.tp > 1
    args.use_flash_attn = True
    args.use_distributed_optimizer, args.overlap_grad_reduce = c.dist_opt, c.dp * c.cp > 1
    args.recompute_granularity = {"none": None}.get(c.recompute, c.recompute)
    args.recompute_method, args.recompute_num_layers = ("uniform", 1) if c.recompute == "full" else (None, None)
    args.world_size = world
    return args


def _estimate(c: Candidate, base: argparse.Namespace, model: ModelSpec, world: int, nproc: int, nnodes: int) -> bool:
    """The candidate's memory per stage and compute time (False: a layout the layout rules refuse)."""
    c.args = _layout_args(c, base, world)
    try:  # the layout's rules (ParallelDims); megatron-core's rank map is built only for the fastest
        dims = ParallelDims.for_launch(
            tp=c.tp,
            pp=c.pp,
            cp=c.cp,
            ep=c.ep,
            vpp=c.vpp,
            nnodes=nnodes,
            nproc_per_node=nproc,
            num_experts=model.num_experts,
        )
        if c.uneven:
            dims = dataclasses.replace(dims, first_stage_layers=c.uneven[0], last_stage_layers=c.uneven[1])
        dims.check_num_layers(model.num_layers)
    except LayoutError:
        return False
    c.dims = dims
    m = dataclasses.replace(model, micro_batch_size=c.mbs)
    c.memory = _stage_memory(m, dims, settings_from_args(c.args))
    c.time = step_time(m, dims, c.recompute, 0.0, 0.0)  # compute and bubble; communication when timed
    return True


def _validate(c: Candidate, base_flags: list[str], world: int) -> bool:
    """The trainer's own parser and validation accept the candidate's flags for this world size."""
    from megatron_npu.plan.flags import parse_trainer_args
    from megatron_npu.policy import ConfigError

    c.flags = base_flags + c.layout_flags()
    try:
        parse_trainer_args(c.flags, world)
    except (ConfigError, ValueError, LayoutError):
        return False
    return True


def _stage_memory(model: ModelSpec, dims: ParallelDims, st: MemorySettings) -> list[RankMemory]:
    """The first rank of each pipeline stage that can hold the largest peak: the first and the last stage,
    and of the stages between, the earliest of each kind (its chunks' layer counts and MoE layers). A middle
    stage can outweigh the first: uneven stages give the first fewer layers, and dense-first MoE patterns
    give it dense layers only (DeepSeek-V3's); a later stage of the same kind has fewer micro-batches in
    flight and so no larger a peak."""
    per_stage = dims.world_size // dims.pp
    stages, kinds = {0, dims.pp - 1}, set()
    for stage in range(1, dims.pp - 1):
        chunks = chunk_layers(dims, model.num_layers, stage)
        kind = tuple((count, sum(model.moe_layers(start, count))) for start, count in chunks)
        if kind not in kinds:
            kinds.add(kind)
            stages.add(stage)
    return [predict(model, dims, st, stage * per_stage) for stage in sorted(stages)]


def _communication(c: Candidate, nnodes: int, nproc: int, intra: float, inter: float) -> None:
    """The planner's traffic for this layout, its exposed seconds into the step-time model."""
    from megatron_npu.plan.flags import specs_from_args

    model, par = specs_from_args(c.args)
    rmap = build_rank_map(
        tp=c.tp,
        pp=c.pp,
        cp=c.cp,
        vpp=c.vpp,
        ep=c.ep,
        nnodes=nnodes,
        nproc_per_node=nproc,
        num_experts=model.num_experts,
    )
    if c.uneven:
        rmap = dataclasses.replace(rmap, dims=c.dims)
    c.crossing = sorted(label for label in ("tp", "cp", "pp", "dp", "ep") if _crosses(rmap, label))
    exposed, dp = comm_seconds(plan(model, rmap, par, intra, inter))
    c.time = step_time(model, c.dims, c.recompute, exposed, dp)


def _crosses(rmap: Any, label: str) -> bool:
    return any(rmap.spans_nodes(g) for g in rmap.groups.get(label, []))


def _fold(rows: list[Candidate]) -> list[Candidate]:
    """One row per (degrees, predicted memory, predicted time): the first of identical ones."""
    seen: dict[tuple, Candidate] = {}
    for c in rows:
        key = (c.degrees(), round(c.peak_bytes / GB, 1), round(c.step_s, 3))
        seen.setdefault(key, c)
    return list(seen.values())


def rank(rows: list[Candidate]) -> list[Candidate]:
    """Fastest first; among step times within ``TIE`` of the fastest left, the most headroom first."""
    left, out = sorted(rows, key=lambda c: c.step_s), []
    while left:
        ties = [c for c in left if c.step_s <= left[0].step_s * (1 + TIE)]
        best = min(ties, key=lambda c: c.peak_bytes)
        out.append(best)
        left.remove(best)
    return out


def search(
    base_flags: list[str], nnodes: int, nproc: int, intra: float, inter: float
) -> tuple[list[Candidate], list[Candidate]]:
    """(the fitting candidates the trainer validates, ranked; every candidate estimated)."""
    from megatron_npu.layout.memory import model_spec_from_args
    from megatron_npu.plan.flags import parse_trainer_args

    world = nnodes * nproc
    base = parse_trainer_args(base_flags, 1)  # the model's flags, checked once (no layout yet)
    model = model_spec_from_args(base)
    limit = PLANNING_FACTS.device_memory_gb * GB * (1 - HEADROOM)
    estimated = [c for c in candidates(model, world, nproc) if _estimate(c, base, model, world, nproc, nnodes)]
    fitting = _fold(sorted((c for c in estimated if c.peak_bytes <= limit), key=lambda c: c.step_s))
    timed: list[Candidate] = []
    for c in fitting:
        if len(timed) == TIMED:
            break
        if _validate(c, base_flags, world):
            _communication(c, nnodes, nproc, intra, inter)
            timed.append(c)
    return rank(_fold(timed)), estimated


def _row(c: Candidate, nnodes: int, nproc: int) -> dict[str, Any]:
    t = c.time
    assert t is not None
    return {
        "tp": c.tp,
        "pp": c.pp,
        "vpp": c.vpp,
        "dp": c.dp,
        "cp": c.cp,
        "ep": c.ep,
        "micro_batch_size": c.mbs,
        "uneven_stages": list(c.uneven) if c.uneven else None,
        "recompute": c.recompute,
        "distributed_optimizer": c.dist_opt,
        "flags": c.flags,
        "predicted_step_s": t.step_s,
        "tokens_per_s_per_npu": t.tokens_per_s_per_npu,
        "mfu": t.mfu,
        "matmul_s": t.matmul_s,
        "attention_s": t.attention_s,
        "bubble_s": t.bubble_s,
        "exposed_comm_s": t.exposed_comm_s,
        "max_memory_bytes": c.peak_bytes,
        "memory": [m.to_json() for m in c.memory],
        "rank_map": {"nnodes": nnodes, "nproc_per_node": nproc, "groups_crossing_nodes": c.crossing},
    }


def wrap_flags(flags: list[str], indent: str = "   ") -> str:
    """A flag line as a launch script writes it: one flag and its value per token, continued at
    ``FLAG_WIDTH`` characters with `` \\``."""
    tokens, i = [], 0
    while i < len(flags):
        pair = flags[i : i + 2] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else flags[i : i + 1]
        tokens.append(" ".join(pair))
        i += len(pair)
    lines = textwrap.wrap(" ".join(tokens), FLAG_WIDTH - len(indent) - 4, break_on_hyphens=False)
    return f" \\\n{indent}  ".join(lines)


def describe(c: Candidate) -> str:
    t = c.time
    assert t is not None
    degrees = f"TP {c.tp} x PP {c.pp}{f' x VPP {c.vpp}' if c.vpp else ''} x CP {c.cp} x DP {c.dp}"
    degrees += f" (EP {c.ep})" if c.ep > 1 else ""
    degrees += f", stages {c.uneven[0]} / ... / {c.uneven[1]} layers" if c.uneven else ""
    return (
        f"{degrees}, micro-batch {c.mbs}, recompute {c.recompute}, distributed optimizer "
        f"{'on' if c.dist_opt else 'off'}: {t.tokens_per_s_per_npu:,.0f} tokens/s per NPU, MFU {t.mfu:.1%}, "
        f"step {t.step_s:.2f} s (matmul {t.matmul_s:.2f}, attention {t.attention_s:.2f}, bubble {t.bubble_s:.2f}, "
        f"exposed comm {t.exposed_comm_s:.2f})"
    )


def _print(rows: list[Candidate], nnodes: int, nproc: int, valid: int) -> None:
    limit = PLANNING_FACTS.device_memory_gb * (1 - HEADROOM)
    print(
        f"{len(rows)} fastest of the layouts that fit {PLANNING_FACTS.device_memory_gb:.0f} GB less "
        f"{HEADROOM:.0%} headroom = {limit:.1f} GB per {PLANNING_FACTS.device} ({valid} layouts estimated) on "
        f"{nnodes} x {nproc} (GB = 1e9 bytes); {assumptions()}"
    )
    for i, c in enumerate(rows, 1):
        mem = ", ".join(f"stage {m.pp_rank} {m.total_bytes / GB:.1f}" for m in c.memory)
        print(f"{i}. {describe(c)}")
        print(f"   memory per card (GB): {mem}; headroom {limit - c.peak_bytes / GB:.1f}")
        print(f"   rank map: TP groups inside a node; groups crossing nodes: {', '.join(c.crossing) or 'none'}")
        print(f"   flags: {wrap_flags(c.flags)}")


def run_search(a: argparse.Namespace, argv: list[str]) -> int:
    """The CLI's --search: prints the top layouts, or one line when none fits."""
    rows, valid = search(_strip_layout(argv), a.nnodes, a.nproc_per_node, a.intra_gbps, a.inter_gbps)
    if not rows:
        smallest = min((c.peak_bytes for c in valid), default=float("nan"))
        print(
            f"plan: no layout fits: {len(valid)} layouts on {a.nnodes} x {a.nproc_per_node}, the smallest needs "
            f"{smallest / GB:.1f} GB per card > {PLANNING_FACTS.device_memory_gb:.0f} GB less {HEADROOM:.0%} "
            "headroom; add nodes, lower --micro-batch-size or --seq-length",
            file=sys.stderr,
        )
        return 3
    top = rows[: a.top]
    if a.json:
        layouts = [_row(c, a.nnodes, a.nproc_per_node) for c in top]
        print(json.dumps({"headroom": HEADROOM, "assumptions": assumptions(), "layouts": layouts}))
    else:
        _print(top, a.nnodes, a.nproc_per_node, len(valid))
    return 0
