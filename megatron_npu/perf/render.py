"""perf-report, step 3: the report (``report.analyse``'s dict) as text, Markdown and PNG plots."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
    "fsdp_comm": "fsdp",
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
            f"figure: rank {c['worst_rank']} spends {_ms(c['grad_reduce_s'][c['worst_rank']])} ms in {c['measures']} "
            f"= {_pct(c['figure'])} (DP={c['dp']}); threshold {_pct(c['threshold'])}"
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
