"""--memory-report: what a rank holds, counted (megatron_npu/training/memory_report.py), and perf-report's
predicted-vs-measured table of a real pretrain_gpt.py run."""

from __future__ import annotations

import json

import pytest
import torch
from pretrain_runs import MOCK_DATA, NO_DROPOUT, pretrain

from megatron_npu.layout.memory import format_reports, read_reports
from megatron_npu.perf import report as perf_report
from megatron_npu.training.memory_report import SavedTensorTracker, state_bytes


def test_saved_tensors_are_counted_once_per_storage_and_the_peak_follows_backward():
    w = torch.randn(8, 8, requires_grad=True)
    tracker = SavedTensorTracker(exclude=[w])
    with tracker.active():
        with tracker.forward(0):
            x = torch.randn(4, 8)
            y = (x @ w).exp()  # saves x (w excluded) and exp's output
            z = y * y  # saves y twice: one storage
        assert tracker.per_microbatch() == {0: 2 * 4 * 8 * 4}
        del x, y
        z.sum().backward()
        del z
        with tracker.forward(0):
            t = torch.randn(2, 2, requires_grad=True)
            t.exp()
    assert tracker.peak == 2 * 4 * 8 * 4  # the first graph's tensors were freed by its backward
    assert [r["bytes"] for r in tracker.records] == [256, 16]


def test_state_bytes_of_a_model_and_adam():
    model = torch.nn.Linear(16, 4)
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    held = state_bytes([model], opt)
    n = 16 * 4 + 4
    assert held["param_bytes"] == held["grad_bytes"] == 4 * n
    assert held["optimizer_bytes"] == held["optimizer_moment_bytes"] == 8 * n and held["optimizer_master_bytes"] == 0
    assert held["optimizer_step_bytes"] == 2 * 4


@pytest.mark.launch
def test_memory_report_of_a_pretrain_run_and_perf_report(tmp_path, capsys):
    """TP2 x PP2 with sequence parallelism and the distributed optimizer, bf16: every rank's file, the
    model's state bytes equal to the measured ones, activations within 5%, and perf-report's table."""
    flags = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --bf16"
    job = pretrain(
        tmp_path,
        *flags.split(),
        "--use-distributed-optimizer",
        "--train-iters",
        "3",
        "--memory-report",
        "--timing-log-level",
        "1",
        *NO_DROPOUT,
        nproc=4,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert MOCK_DATA  # the run reads mock data: no corpus needed
    reports = read_reports(tmp_path / "logs")
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    for r in reports:
        p = r["predicted"]
        assert (p["param_bytes"], p["grad_bytes"], p["optimizer_bytes"]) == (
            r["param_bytes"],
            r["grad_bytes"],
            r["optimizer_bytes"],
        ), r["rank"]
        assert abs(p["saved_peak_bytes"] / r["saved_peak_bytes"] - 1) <= 0.05, (r["rank"], p, r)
    assert reports[0]["saved_per_microbatch"] != reports[2]["saved_per_microbatch"]  # first vs last stage
    assert perf_report.main([str(tmp_path / "logs"), "--plots-dir", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert format_reports(reports) in out and "predicted (megatron_npu/layout/memory.py) / measured" in out
    assert json.loads((tmp_path / "logs" / "memory" / "rank00000.json").read_text())["forwards"] > 0
