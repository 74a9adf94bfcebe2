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

The parts of one rank's iteration and the balance figures are defined in ``load.DEFINITIONS``
(the report prints them). Three steps, one module each: ``load`` (the run, its rank map, the
per-rank breakdown), ``checks`` (the five points, thresholds there) and ``render`` (text,
Markdown, plots); ``analyse`` below joins the first two into the report dict.

AI Core utilisation on Ascend (not measured by the trainer): while training runs, sample each
card with ``npu-smi info -t usages -i CARD_ID`` (it prints ``Aicore Usage Rate(%) : N``), e.g.
``while sleep 1; do npu-smi info -t usages -i 0; done > RUN_DIR/npu_smi_card0.txt``; this report
reads every ``npu_smi*.txt`` in the run/log dir and lists mean / min / max of those lines. The
output format is taken from Huawei's npu-smi documentation and is not checked here.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megatron_npu.layout.memory import format_reports as format_memory_reports
from megatron_npu.layout.memory import read_reports as read_memory_reports
from megatron_npu.perf.checks import (
    BALANCE_SPREAD_LIMIT,
    BUBBLE_EXCESS_LIMIT,
    COMM_SHARE_LIMIT,
    DATA_WAIT_LIMIT,
    GRAD_SYNC_LIMIT,
    balance_check,
    communication_check,
    data_loader_check,
    grad_reduction_check,
    run_shape,
    traffic_check,
)
from megatron_npu.perf.load import (
    DEFINITIONS,
    PARTS,
    ReportError,
    Run,
    load_run,
    mean,
    select_iterations,
    summarise_ranks,
)
from megatron_npu.perf.render import TITLES, render_markdown, render_text, write_plots

__all__ = [
    "BALANCE_SPREAD_LIMIT",
    "BUBBLE_EXCESS_LIMIT",
    "COMM_SHARE_LIMIT",
    "DATA_WAIT_LIMIT",
    "GRAD_SYNC_LIMIT",
    "PARTS",
    "TITLES",
    "ReportError",
    "analyse",
    "load_run",
    "main",
]


def analyse(
    run: Run, skip: int = 1, intra_gbps: float | None = None, inter_gbps: float | None = None
) -> dict[str, Any]:
    """The report as a dict (what --json prints and the renderers read): the named steps above, joined."""
    from megatron_npu.layout.planner import HCCS_GBPS, ROCE_GBPS

    intra = intra_gbps or HCCS_GBPS
    inter = inter_gbps or ROCE_GBPS
    iterations, skip = select_iterations(run, skip)
    level2 = all("comm" in r for lines in run.records.values() for r in lines if r["iteration"] in iterations)
    ranks, per_iteration = summarise_ranks(run, iterations)
    shape = run_shape(run, ranks)
    mean_it = mean([r.iteration_s for r in ranks])
    parts_mean = {key: mean([r.parts[key] for r in ranks]) for key, _ in PARTS}
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
            "cp": shape.cp,
        },
        "timing_log_level": 2 if level2 else 1,
        "iterations": iterations,
        "skipped_iterations": skip,
        "parts": [key for key, _ in PARTS],
        "part_labels": dict(PARTS),
        "mean_iteration_s": mean_it,
        "mean_parts_s": parts_mean,
        "metrics_iteration_s": mean(metrics_it) if metrics_it else None,
        "add_up_error": add_up,
        "ranks": [asdict(r) for r in ranks],
        "per_iteration": {str(k): v for k, v in sorted(per_iteration.items())},
        "checks": checks,
        "definitions": DEFINITIONS.strip(),
    }


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
        print("megatron-npu perf-report: error: --skip-iterations must be >= 0", file=sys.stderr)
        return 2
    try:
        run = load_run(a.run_dir)
        report = analyse(run, a.skip_iterations, a.intra_gbps, a.inter_gbps)
    except ReportError as exc:
        print(f"megatron-npu perf-report: error: {exc}", file=sys.stderr)
        return 2
    plots = write_plots(report, a.plots_dir or a.run_dir / "perf_plots")
    markdown = a.markdown or a.run_dir / "perf_report.md"
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(render_markdown(report, plots, markdown.parent))
    report["outputs"] = {"markdown": str(markdown), "plots": [str(x) for x in plots]}
    report["memory"] = read_memory_reports(run.log_dir)  # --memory-report: predicted vs measured bytes
    print(json.dumps(report, indent=1, default=str) if a.json else render_text(report))
    if report["memory"] and not a.json:
        print(format_memory_reports(report["memory"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
