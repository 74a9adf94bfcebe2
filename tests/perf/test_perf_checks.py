"""perf-report's load, checks and render steps on a hand-written run (no launch): every figure below
follows from the timer values written here, so each check's verdict is known in advance.

The run: PP2 x DP2 on two nodes, ranks 0, 1 on node 0 and 2, 3 on node 1 (torchrun would put them
the same way), so the pipeline crosses nodes and the DP gradient-sync groups stay inside them.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from megatron_npu.layout.rankmap import build_rank_map
from megatron_npu.perf import checks, render, report
from megatron_npu.perf.load import PARTS, breakdown, load_run

ARGS = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "max_position_embeddings": 32,
    "micro_batch_size": 1,
    "global_batch_size": 8,  # micro batch 1 x DP 2 x 4 micro-batches
    "vocab_size": 128,
    "padded_vocab_size": 128,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 2,
    "num_workers": 2,
}
# one iteration of every rank (level 1: no counter), seconds
TIMERS = {
    "iteration_s": 1.0,
    "forward_compute_s": 0.4,
    "backward_compute_s": 0.3,
    "data_wait_s": 0.1,
    "pp_wait_s": 0.1,
    "tp_grad_sync_s": 0.0,
    "grad_sync_s": 0.05,
    "param_gather_s": 0.0,
    "optimizer_s": 0.04,
    "forward_backward_s": 0.8,
    "num_microbatches": 4,
}


def write_run(directory: Path, layout_args: dict | None = None) -> Path:
    logs = directory / "logs"
    (logs / "timers").mkdir(parents=True)
    pp = (layout_args or ARGS)["pipeline_model_parallel_size"]
    layout = build_rank_map(nnodes=2, nproc_per_node=2, pp=pp).to_json()
    (logs / "layout.json").write_text(json.dumps(layout))
    (logs / "args.json").write_text(json.dumps(layout_args or ARGS))
    for rank in range(4):
        lines = [{"rank": rank, "iteration": i, **TIMERS} for i in (1, 2, 3)]
        (logs / "timers" / f"rank{rank:05d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return directory


def test_breakdown_of_one_record():
    parts = breakdown(TIMERS)
    expected = {"compute": 0.6, "data_wait": 0.1, "pp_wait": 0.1, "grad_sync": 0.05, "optimizer": 0.04}
    assert parts == pytest.approx({key: expected.get(key, 0.0) for key, _ in PARTS} | {"other": 0.11})


def test_fsdp_collectives_inside_forward_and_backward_are_split_out_of_compute():
    # level 2 under FSDP: the DP x CP group's calls run inside forward / backward, as TP's do
    record = TIMERS | {"comm": {"dp_cp": {"calls": 27, "bytes": 1, "seconds": 0.2}, "tp": {"seconds": 0.05}}}
    parts = breakdown(record, fsdp=True)
    assert parts["fsdp_comm"] == pytest.approx(0.2) and parts["tp_comm"] == pytest.approx(0.05)
    assert parts["compute"] == pytest.approx(0.6 - 0.05 - 0.2)
    assert breakdown(record)["fsdp_comm"] == 0.0  # DDP's DP x CP calls are the step's grad_sync, timed apart


def test_gradient_reduction_under_fsdp_names_its_levers_not_ddps(tmp_path):
    fsdp_args = {**ARGS, "pipeline_model_parallel_size": 1, "use_torch_fsdp2": True}
    run = load_run(write_run(tmp_path / "fsdp2", fsdp_args))
    g = report.analyse(run)["checks"]["grad_reduction"]
    # level 1: FSDP's calls are inside compute, so the check says how to see them
    assert g["figure"] == 0.0 and "--timing-log-level 2" in g["advice"][0]
    for rank in range(4):  # the same run at level 2, 0.15 s of 1 s in FSDP's collectives
        path = tmp_path / "fsdp2" / "logs" / "timers" / f"rank{rank:05d}.jsonl"
        lines = [
            json.loads(x) | {"comm": {"dp_cp": {"calls": 37, "bytes": 1, "seconds": 0.15}}}
            for x in path.read_text().splitlines()
        ]
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    g = report.analyse(load_run(tmp_path / "fsdp2"))["checks"]["grad_reduction"]
    assert g["figure"] == pytest.approx(0.15) and g["verdict"] == "FLAGGED"
    assert g["measures"] == "FSDP (torch_fsdp2) collectives on DP x CP"
    assert any("--torch-fsdp2-no-reshard-after-forward" in line for line in g["advice"])
    assert not any("--use-distributed-optimizer" in line or "--overlap-grad-reduce" in line for line in g["advice"])


def test_checks_on_a_known_run(tmp_path):
    run = load_run(write_run(tmp_path))
    assert [run.rank_map.node_of(r) for r in range(4)] == [0, 0, 1, 1] and run.rank_map.dp == 2
    rep = report.analyse(run)
    assert rep["iterations"] == [2, 3] and rep["layout"] == {
        "world_size": 4,
        "nodes": 2,
        "tp": 1,
        "pp": 2,
        "dp": 2,
        "vpp": None,
        "cp": 1,
    }
    c = rep["checks"]
    assert c["communication"]["figure"] == pytest.approx(0.15) and c["communication"]["verdict"] == "ok"
    t = c["traffic"]
    assert t["plan_error"] is None and t["verdict"] == "ok"  # PP across nodes is fine, DP stays inside
    pipelines = [[0, 2], [1, 3]]  # at TP1 the grad-norm (TP x PP) and embedding groups are the pipelines
    assert t["crossing_groups"] == {"pp": pipelines, "mp": pipelines, "embd": pipelines}
    assert t["dimensions"]["pp"]["crosses_nodes"] and t["dimensions"]["pp"]["wire_inter"] > 0
    assert t["dimensions"]["dp_cp"]["wire_inter"] == 0 and not t["dimensions"]["dp_cp"]["crosses_nodes"]
    b = c["balance"]
    assert b["bubble_theoretical"] == pytest.approx(1 / 5) and b["stages"][0]["bubble_measured"] == pytest.approx(0.125)
    assert b["rank_spread"] == pytest.approx(1.0) and b["verdict"] == "ok"
    d = c["data_loader"]
    assert d["figure"] == pytest.approx(0.1) and d["verdict"] == "FLAGGED"
    assert any("--num-workers (now 2)" in line for line in d["advice"])
    g = c["grad_reduction"]
    assert g["figure"] == pytest.approx(0.05) and g["verdict"] == "ok" and g["dp"] == 2
    text = render.render_text(rep)
    for name, title in render.TITLES.items():
        section = text.split(title)[1].split("\n\n")[0]
        assert f"verdict: {'FLAGGED' if name == 'data_loader' else 'ok'}" in section, name
    assert checks.DATA_WAIT_LIMIT < 0.1 < checks.GRAD_SYNC_LIMIT + 0.05


def test_files_of_two_runs_are_refused_by_name(tmp_path):
    """args.json says TP2 x PP2, layout.json records the PP2 x DP2 groups: one line naming both files."""
    write_run(tmp_path, {**ARGS, "tensor_model_parallel_size": 2})
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert report.main([str(tmp_path)]) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron-npu perf-report: error:")
    assert "layout.json's tp groups" in lines[0] and "args.json" in lines[0]
