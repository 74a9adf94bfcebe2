"""``megatron-npu plan``: per-rank communication and memory of one layout, or ``--search`` for the layouts that fit.

Model and training flags are pretrain_gpt.py's own (a launch script's flags unchanged), parsed and
validated by the trainer's parser (megatron_npu.training.arguments, no torch) for the world of
``--nnodes`` x ``--nproc-per-node``; or ``--hf-config DIR`` gives the model flags of a Hugging Face
config through the converter's mapping. The launcher's spellings ``--tp --pp --cp --ep --etp --vpp``
and ``--dtype`` are accepted too. Data flags are not needed: without them the plan assumes
``--mock-data``, ``--train-iters 1`` without a length and ``--lr 1e-4`` without one (none changes a byte).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from megatron_npu.layout.memory import (
    RankMemory,
    predict,
    settings_from_args,
)
from megatron_npu.layout.model_spec import ModelSpec
from megatron_npu.layout.planner import HCCS_GBPS, ROCE_GBPS, plan
from megatron_npu.layout.rankmap import LayoutError, RankMap
from megatron_npu.layout.step_time import StepTime, assumptions, comm_seconds, step_time
from megatron_npu.plan.flags import (
    DTYPE_FLAGS,
    SHORT_FLAGS,
    parse_trainer_args,
    rank_map_for,
    specs_from_args,
    trainer_argv,
)

GB = 1e9  # every figure printed: GB = 1e9 bytes (--search's too)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-npu plan",
        description=__doc__.splitlines()[0],
        epilog="Every other flag is pretrain_gpt.py's (e.g. --num-layers, --bf16, --sequence-parallel).",
    )
    p.add_argument("--nnodes", type=int, required=True, help="nodes in the job")
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node (NPUs used per node)")
    p.add_argument("--hosts", default=None, help="comma-separated host list, one per node")
    for short, long in SHORT_FLAGS.items():
        p.add_argument(short, type=int, default=None, help=f"= {long}")
    p.add_argument("--dtype", choices=sorted(DTYPE_FLAGS), default=None, help="= --bf16 / --fp16 (fp32: neither)")
    p.add_argument("--hf-config", default=None, help="a Hugging Face model directory: its model flags")
    p.add_argument(
        "--intra-gbps", type=float, default=HCCS_GBPS, help=f"GB/s inside a node (ASSUMED {HCCS_GBPS}, HCCS)"
    )
    p.add_argument(
        "--inter-gbps", type=float, default=ROCE_GBPS, help=f"GB/s between nodes (ASSUMED {ROCE_GBPS}, RoCE)"
    )
    p.add_argument("--search", action="store_true", help="enumerate layouts, keep those that fit, rank by step time")
    p.add_argument("--top", type=int, default=5, help="--search: how many layouts to print")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def memory_by_stage(model: ModelSpec, rmap: RankMap, args: argparse.Namespace) -> list[RankMemory]:
    """One prediction per pipeline stage (its first rank: DP rank 0 of the first TP group)."""
    settings = settings_from_args(args)
    per_stage = rmap.world_size // rmap.dims.pp
    return [predict(model, rmap.dims, settings, stage * per_stage) for stage in range(rmap.dims.pp)]


def memory_table(memory: list[RankMemory]) -> str:
    out = [
        "predicted memory per rank (GB = 1e9 bytes; parameters + gradients + optimizer state + activations at the peak):",
        f"  {'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'act/mb':>8} {'in flight':>9} {'act peak':>9} "
        f"{'total':>8}",
    ]
    for m in memory:
        flight = sum(m.in_flight.values())
        act_mb = sum(m.saved_per_microbatch.values()) / GB
        out.append(
            f"  {m.pp_rank:5d} {m.param_bytes / GB:8.2f} {m.grad_bytes / GB:8.2f} {m.optimizer_bytes / GB:8.2f} "
            f"{act_mb:8.2f} {flight:9d} {m.saved_peak_bytes / GB:9.2f} {m.total_bytes / GB:8.2f}"
        )
    out.append("  (megatron_npu/layout/memory.py: what is measured and what is only modelled)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    a, rest = build_parser().parse_known_args(argv)
    from megatron_npu.policy import ConfigError

    try:
        targs = trainer_argv(a, rest)
        if a.search:
            from megatron_npu.plan.search import run_search

            return run_search(a, targs)
        args = parse_trainer_args(targs, a.nnodes * a.nproc_per_node)
        rmap = rank_map_for(args, a)
        model, par = specs_from_args(args)
        result = plan(model, rmap, par, a.intra_gbps, a.inter_gbps)
        memory = memory_by_stage(model, rmap, args)
    except (LayoutError, ConfigError, ValueError) as exc:
        print(f"megatron-npu plan: error: {exc}", file=sys.stderr)
        return 2
    if a.json:
        t = step_prediction(model, rmap, args, result)
        figures = {"tokens_per_s_per_npu": t.tokens_per_s_per_npu, "mfu": t.mfu, "step_s": t.step_s}
        out: dict[str, Any] = result.to_json() | {"memory": [m.to_json() for m in memory], "predicted": figures}
        print(json.dumps(out))
    else:
        print(result.table())
        print(memory_table(memory))
        print(step_line(model, rmap, args, result))
    return 0


def step_prediction(model: ModelSpec, rmap: RankMap, args: Any, result: Any) -> StepTime:
    """The step-time model for this layout, its communication plan ``result``'s exposed seconds in it."""
    exposed, dp = comm_seconds(result)
    return step_time(model, rmap.dims, args.recompute_granularity, exposed, dp)


def step_line(model: ModelSpec, rmap: RankMap, args: Any, result: Any) -> str:
    """The step-time model's figures for this layout, with its assumptions."""
    t = step_prediction(model, rmap, args, result)
    return (
        f"predicted: {t.tokens_per_s_per_npu:,.0f} tokens/s per NPU, MFU {t.mfu:.1%}, step {t.step_s:.2f} s "
        f"(matmul {t.matmul_s:.2f}, attention {t.attention_s:.2f}, bubble {t.bubble_s:.2f}, exposed comm "
        f"{t.exposed_comm_s:.2f}); {assumptions()}"
    )


if __name__ == "__main__":
    sys.exit(main())
