"""megatron-npu perf-report on real cpu runs of pretrain_gpt.py.

Three launches: TP2 x PP2 on 4 ranks at --timing-log-level 2 (figures add up, five sections,
plots, markdown, JSON); 1 rank with a slow data loader (flagged on point 4); TP2 x CP2 (ring) on two
simulated nodes (2 torchrun agents x 2 ranks), whose CP groups, and with them the DP x CP
gradient-sync groups, cross nodes (flagged on point 2; the CP ring's measured bytes beside the plan).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from distributed import torchrun_nodes
from pretrain_runs import MOCK_DATA, MODEL, PRETRAIN, SHAPE, pretrain

from megatron_npu.perf import report as perf_report
from megatron_npu.plan import cli as plan_cli

pytestmark = pytest.mark.launch  # every test reads a run its fixture launched

TITLES = list(perf_report.TITLES.values())


def run_report(run_dir: Path, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = perf_report.main([str(run_dir), *extra])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    run = tmp_path_factory.mktemp("perf_tp2pp2")
    # --swiglu without --ffn-hidden-size: the planner must size the MLP by SwiGLU's rule, as the trainer does
    pretrain(
        run,
        "--train-iters",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--swiglu",
        "--timing-log-level",
        "2",
        nproc=4,
    ).check()
    code, text, err = run_report(run)
    assert code == 0, err
    code, js, err = run_report(run, "--json")
    assert code == 0, err
    return run, text, json.loads(js)


@pytest.fixture(scope="module")
def slow_loader(tmp_path_factory):
    run = tmp_path_factory.mktemp("perf_slow")
    pretrain(run, "--train-iters", "3", "--timing-log-level", "1", "--data-loader-delay-ms", "200").check()
    code, js, err = run_report(run, "--json")
    assert code == 0, err
    return json.loads(js)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    run = tmp_path_factory.mktemp("perf_nodes")
    jobs = torchrun_nodes(
        PRETRAIN,
        *MODEL,
        *MOCK_DATA,
        "--train-iters",
        "3",
        "--tensor-model-parallel-size",
        "2",
        "--context-parallel-size",
        "2",
        "--attention-dropout",
        "0",
        "--timing-log-level",
        "2",
        "--log-dir",
        str(run / "logs"),
        nnodes=2,
        nproc_per_node=2,
    )
    for job in jobs:
        job.check()
    code, text, err = run_report(run)
    assert code == 0, err
    code, js, err = run_report(run, "--json")
    assert code == 0, err
    return text, json.loads(js)


def _timer_lines(run: Path) -> dict[int, list[dict]]:
    out = {}
    for path in sorted((run / "logs" / "timers").glob("rank*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        out[lines[0]["rank"]] = lines
    return out


def timed_parts_s(line: dict) -> float:
    """What the measured parts (all but ``other``) add up to, straight from one raw timer record:
    every timer the definitions name counted once (the SP/norm all-reduce is inside tp_grad_sync_s,
    the param all-gather inside optimizer_s, data wait and TP comm inside forward/backward)."""
    norm_sync = line.get("timers", {}).get("non-tensor-parallel-grads-all-reduce", 0.0)
    return (
        line["forward_compute_s"]
        + line["backward_compute_s"]
        + line["pp_wait_s"]
        + max(line["tp_grad_sync_s"], norm_sync)
        + line["grad_sync_s"]
        + line["param_gather_s"]
        + max(line["optimizer_s"] - line["param_gather_s"], 0.0)
        + line.get("comm", {}).get("dp", {}).get("seconds", 0.0)
    )


def test_figures_add_up_to_the_measured_iteration_time(tp2_pp2):
    run, _, rep = tp2_pp2
    assert rep["timing_log_level"] == 2 and rep["iterations"] == [2, 3, 4]  # iteration 1 skipped (warm-up)
    lines = _timer_lines(run)
    assert sorted(lines) == [0, 1, 2, 3]
    timed_per_rank, iteration_per_rank = [], []
    for r in rep["ranks"]:
        selected = [x for x in lines[r["rank"]] if x["iteration"] in rep["iterations"]]
        measured = [x["iteration_s"] for x in selected]
        assert r["iteration_s"] == pytest.approx(sum(measured) / len(measured), rel=1e-9)
        parts = r["parts"]
        assert set(parts) == {key for key, _ in perf_report.PARTS}
        # the measured parts are the raw timers, each counted once (``other`` alone is derived)
        timed = sum(timed_parts_s(x) for x in selected) / len(selected)
        assert sum(v for k, v in parts.items() if k != "other") == pytest.approx(timed, rel=1e-9)
        timed_per_rank.append(timed)
        iteration_per_rank.append(sum(measured) / len(measured))
        # the measured parts alone (all but the remainder) explain the iteration within 5 %
        assert abs(parts["other"]) <= 0.05 * r["iteration_s"], (r["rank"], parts)
        assert all(v >= 0 for k, v in parts.items() if k != "other"), parts
        assert parts["tp_comm"] > 0  # TP collectives measured at level 2
    assert rep["add_up_error"] <= 0.05
    # the means over ranks are of the raw records too
    assert rep["mean_iteration_s"] == pytest.approx(sum(iteration_per_rank) / 4, rel=1e-9)
    mean_timed = sum(v for k, v in rep["mean_parts_s"].items() if k != "other")
    assert mean_timed == pytest.approx(sum(timed_per_rank) / 4, rel=1e-9)
    # the last rank's timer record and metrics.jsonl time the same iteration
    assert rep["metrics_iteration_s"] == pytest.approx(rep["ranks"][-1]["iteration_s"], rel=0.05)
    # communication share is the sum of its dimensions
    c = rep["checks"]["communication"]
    assert sum(c["by_dimension_s"].values()) == pytest.approx(sum(r["comm_s"] for r in rep["ranks"]) / 4, rel=1e-9)


def test_five_sections_with_verdict_threshold_and_advice(tp2_pp2):
    run, text, rep = tp2_pp2
    for title in TITLES:
        assert title in text
    assert text.count("verdict: ") == 5 and text.count("advice: ") >= 5
    assert "compute" in text.splitlines()[4]  # the per-rank breakdown table header
    for name, check in rep["checks"].items():
        assert check["verdict"] in ("ok", "FLAGGED"), name
        assert check["threshold"] is not None and check["advice"], name
    markdown = (run / "perf_report.md").read_text()
    for title in TITLES:
        assert f"## {title}" in markdown
    assert "![per_rank_breakdown](perf_plots/per_rank_breakdown.png)" in markdown
    assert rep["outputs"]["markdown"] == str(run / "perf_report.md")


def test_plots_are_written_and_non_empty(tp2_pp2):
    run, _, _ = tp2_pp2
    for name in ("per_rank_breakdown.png", "per_iteration_breakdown.png"):
        data = (run / "perf_plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_traffic_matches_the_planner_and_stays_on_one_node(tp2_pp2):
    _, _, rep = tp2_pp2
    t = rep["checks"]["traffic"]
    assert t["nodes"] == 1 and t["verdict"] == "ok" and t["plan_error"] is None
    for label in ("tp", "pp", "dp_cp", "embd"):  # level-2 counter and planner count the same payload
        d = t["dimensions"][label]
        assert d["measured_bytes"] == pytest.approx(d["planned_bytes"]), label
        assert d["wire_inter"] == 0 and not d["crosses_nodes"], label
    b = rep["checks"]["balance"]
    assert b["bubble_theoretical"] == pytest.approx(1 / 5)  # (pp-1)/(m+pp-1), pp=2, m=4
    assert set(b["stages"]) == {"0", "1"}  # JSON keys
    busy = b["busy_s"]
    assert set(busy) == {"0", "1", "2", "3"} and min(busy.values()) > 0
    assert b["rank_spread"] == pytest.approx(max(busy.values()) / min(busy.values()), rel=1e-12)
    assert (b["verdict"] == "FLAGGED") == (
        b["rank_spread"] > perf_report.BALANCE_SPREAD_LIMIT
        or b["bubble_measured_worst"] > 1 / 5 + perf_report.BUBBLE_EXCESS_LIMIT
    )


def test_plan_cli_with_swiglu_counts_the_measured_bytes(tp2_pp2, capsys):
    """`megatron-npu plan --swiglu` (ffn from SwiGLU's rule, as the trainer sizes it) against the counted run."""
    run, _, rep = tp2_pp2
    args = json.loads((run / "logs" / "args.json").read_text())
    assert args["swiglu"] and args["ffn_hidden_size"] == 128  # int((4 * 64 * 2/3) / 64) * 64, not 4h = 256
    assert (
        plan_cli.main(
            [
                "--nnodes",
                "1",
                "--nproc-per-node",
                "4",
                "--tp",
                "2",
                "--pp",
                "2",
                *SHAPE,  # the run's own model and batch shape
                "--vocab-size",
                str(args["vocab_size"] + 1),  # NullTokenizer: ids + eod
                "--dtype",
                "fp32",
                "--swiglu",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    for label in ("tp", "pp", "dp_cp", "embd"):
        planned = sum(r["groups"].get(label, {}).get("bytes", 0) for r in plan["ranks"]) / len(plan["ranks"])
        assert planned == pytest.approx(rep["checks"]["traffic"]["dimensions"][label]["measured_bytes"]), label


def test_slow_data_loader_is_flagged(slow_loader, tp2_pp2):
    d = slow_loader["checks"]["data_loader"]
    assert d["verdict"] == "FLAGGED" and d["figure"] > perf_report.DATA_WAIT_LIMIT
    # 4 micro-batches x 200 ms
    assert d["wait_s_per_iteration"]["0"] == pytest.approx(0.8, rel=0.25)
    assert any("--num-workers" in line for line in d["advice"])
    assert d["figure"] > 5 * tp2_pp2[2]["checks"]["data_loader"]["figure"]
    assert slow_loader["checks"]["communication"]["measured_tp"] is False  # level 1


def test_gradient_sync_crossing_nodes_is_flagged(two_nodes):
    text, rep = two_nodes
    t = rep["checks"]["traffic"]
    assert rep["layout"]["nodes"] == 2 and rep["layout"]["cp"] == 2 and rep["layout"]["dp"] == 1
    assert [r["node"] for r in rep["ranks"]] == [0, 0, 1, 1]
    assert t["verdict"] == "FLAGGED"
    assert t["tp_crossing"] == [] and sorted(t["grad_sync_crossing"]) == [[0, 2], [1, 3]]
    dp = t["dimensions"]["dp_cp"]
    assert dp["crosses_nodes"] and dp["wire_inter"] > 0 and dp["wire_intra"] == 0
    assert dp["measured_bytes"] == pytest.approx(dp["planned_bytes"])
    assert not t["dimensions"]["tp"]["crosses_nodes"] and t["dimensions"]["tp"]["wire_inter"] == 0
    assert "spans nodes" in text and "verdict: FLAGGED" in text.split(TITLES[1])[1].split(TITLES[2])[0]
    assert any("crosses nodes" in line for line in rep["checks"]["grad_reduction"]["advice"])


def test_cp_ring_bytes_measured_beside_the_plan_and_the_placement_said(two_nodes):
    """TP2 x CP2 on 2 nodes of 2: megatron-core's order puts CP next to TP, so TP x CP = 4 ranks cannot
    stay in a node; the ring's K/V and dK/dV bytes (cp_comm.cp_calls) are what the CP group counted."""
    text, rep = two_nodes
    t = rep["checks"]["traffic"]
    cp = t["dimensions"]["cp"]
    assert cp["measured_bytes"] > 0 and cp["measured_bytes"] == pytest.approx(cp["planned_bytes"])
    assert cp["crosses_nodes"] and cp["wire_inter"] > 0 and cp["wire_intra"] == 0
    # 4 layers x 4 micro-batches x (fwd K/V 1 + bwd K/V 1 + dK/dV 2) ring shifts, each a send and a receive
    # of K and V [s/CP = 16, b = 2, 2 heads per TP rank, 16] fp32 = 8192 B (the fp32 dK/dV as many)
    assert cp["planned_bytes"] == 4 * 4 * (2 + 2 + 4) * 8192
    note = "TP 2 x CP 2 = 4 ranks do not fit in a node of 2"
    assert any(line.startswith(note) for line in t["advice"]) and note in text
    assert "CP attention" in text.split(TITLES[1])[1].split(TITLES[2])[0]


def test_npu_smi_samples_and_bad_input(tp2_pp2, tmp_path):
    run, _, _ = tp2_pp2
    copy = tmp_path / "run"
    shutil.copytree(run / "logs", copy / "logs")
    (copy / "npu_smi_card0.txt").write_text("Aicore Usage Rate(%)           : 80\nAicore Usage Rate(%) : 90\n")
    code, js, err = run_report(copy, "--json", "--plots-dir", str(tmp_path / "plots"))
    assert code == 0, err
    assert json.loads(js)["checks"]["balance"]["npu_smi_aicore_pct"]["npu_smi_card0.txt"]["mean"] == 85
    code, out, err = run_report(tmp_path / "nothing")
    assert (
        code == 2
        and err.startswith("megatron-npu perf-report: error:")
        and "--timing-log-level" in err
        and len(err.splitlines()) == 1
    )
