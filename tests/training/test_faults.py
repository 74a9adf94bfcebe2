"""Faults during a run reach the user and never hang the job; a killed save loses nothing.

Each scenario is one real pretrain_gpt.py job under torchrun (the killed save adds the
restart that must load the previous checkpoint), with the fault injected through the test
seam MEGATRON_NPU_INJECT_FAULT (megatron_npu/training/faults.py): the rank kills itself
with SIGKILL, raises, has a parameter or its gradient poisoned with NaN, or pauses inside a save while the
test kills the whole job. Each asserts torchrun's failure summary (what the user reads)
and what is left on disk. A truncated or corrupt .bin/.idx is refused by the argument
checks, before any process group, so those cases call pretrain() in this process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from distributed import ROOT, Job, base_env, running, torchrun, torchrun_command
from pretrain_runs import MOCK_DATA, MODEL, PRETRAIN

sys.path.insert(0, str(ROOT))

# a 2-rank run of the small model takes 10-15 s on an idle 2-core machine, minutes on a busy one; under
# faults.PAUSE_S (3600 s), so a job that ends within it was not released by the injected hang's end
JOB_TIMEOUT_S = 600


def _run_with_fault(run_dir: Path, fault: str, *flags: str) -> Job:
    env = base_env(MEGATRON_NPU_INJECT_FAULT=fault)
    args = [*MODEL, *MOCK_DATA, "--eval-iters", "0", "--log-dir", str(run_dir / "logs"), *flags]
    return torchrun(PRETRAIN, *args, nproc=2, timeout=JOB_TIMEOUT_S, env=env)


def _failures(stderr: str) -> tuple[str, str]:
    """torchrun's summary: (the root cause's block, the other failures' block)."""
    assert "Root Cause (first observed failure):" in stderr, stderr[-3000:]
    head, root = stderr.split("Root Cause (first observed failure):", 1)
    return root.split("=" * 20, 1)[0], head.rsplit("Failures:", 1)[-1]


def _logged_iterations(run_dir: Path) -> list[int]:
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [record["iteration"] for record in map(json.loads, lines) if "lm_loss" in record]


def _assert_follower_was_stopped(stderr: str, others: str) -> None:
    # rank 0, waiting on rank 1 in a collective when it failed, is stopped by torchrun: its
    # own error ("Connection closed by peer") neither reaches the user nor takes the blame
    assert "rank      : 0 (local_rank: 0)" in others and "Signal 15 (SIGTERM)" in others, others
    assert "Connection closed" not in stderr, stderr[-3000:]


@pytest.mark.launch
def test_a_rank_killed_mid_run_stops_every_rank_and_is_named(tmp_path):
    job = _run_with_fault(tmp_path, "kill@3:1", "--train-iters", "6")

    assert job.returncode != 0
    root, others = _failures(job.stderr)
    assert "rank      : 1 (local_rank: 1)" in root and "Signal 9 (SIGKILL)" in root, root
    _assert_follower_was_stopped(job.stderr, others)
    assert _logged_iterations(tmp_path) == [1, 2]


@pytest.mark.launch
def test_an_exception_on_one_rank_is_the_root_cause_naming_rank_and_iteration(tmp_path):
    job = _run_with_fault(tmp_path, "raise@2:1", "--train-iters", "6")

    assert job.returncode != 0
    root, others = _failures(job.stderr)
    assert "rank      : 1 (local_rank: 1)" in root, root
    assert "megatron-npu: error: rank 1 failed at iteration 2: InjectedFault" in root, root
    _assert_follower_was_stopped(job.stderr, others)
    assert _logged_iterations(tmp_path) == [1]


@pytest.mark.launch
def test_a_hung_rank_fails_the_job_after_the_collective_timeout(tmp_path):
    """The case torchrun cannot see (a rank alive but stuck, as on a hung device or a lost
    link between nodes): the rank waiting on it fails when the collective times out. The hang
    lasts an hour; the job must end within JOB_TIMEOUT_S (start-up, 15 s of timeout, 5 s of grace)."""
    job = _run_with_fault(tmp_path, "hang@2:1", "--train-iters", "6", "--distributed-timeout-minutes", "0.25")

    assert job.returncode != 0
    root, others = _failures(job.stderr)
    assert "rank      : 0 (local_rank: 0)" in root, root
    assert "megatron-npu: error: rank 0 failed at iteration 2" in root and "Timed out" in root, root
    assert "rank      : 1 (local_rank: 1)" in others and "Signal 15 (SIGTERM)" in others, others
    assert _logged_iterations(tmp_path) == [1]


@pytest.mark.launch
def test_a_nan_loss_stops_the_job_naming_the_iteration(tmp_path):
    # the poisoned weights are on the first pipeline stage; the last one computes the loss
    job = _run_with_fault(tmp_path, "nan@3:0", "--pipeline-model-parallel-size", "2", "--train-iters", "6")

    assert job.returncode != 0
    root, others = _failures(job.stderr)
    assert "rank      : 1 (local_rank: 1)" in root, root
    assert "megatron-npu: error: iteration 3: the loss is nan on rank 1" in root, root
    assert "--check-for-nan-in-loss-and-grad" in root and "Traceback" not in root, root
    _assert_follower_was_stopped(job.stderr, others)
    assert _logged_iterations(tmp_path) == [1, 2]


@pytest.mark.launch
def test_a_nan_gradient_under_a_finite_loss_stops_the_job_naming_the_iteration(tmp_path):
    # DP2: rank 1's gradient is NaN, its loss is not; megatron-core's DDP finds it before the reduction
    job = _run_with_fault(tmp_path, "nan-grad@2:1", "--train-iters", "6")

    assert job.returncode != 0
    root, others = _failures(job.stderr)
    assert "rank      : 1 (local_rank: 1)" in root, root
    assert "megatron-npu: error: iteration 2: a gradient is nan on rank 1 (bucket #" in root, root
    assert "while the loss is finite" in root and "Traceback" not in root, root
    _assert_follower_was_stopped(job.stderr, others)
    assert _logged_iterations(tmp_path) == [1]


def test_a_run_failure_outside_torchrun_prints_its_traceback_then_where_it_happened(monkeypatch, capsys):
    """A plain process (no torchrun error file) has no grace to give: the traceback, then one line."""
    from megatron_npu.start_errors import report_run_failure

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    try:
        raise ValueError("boom")
    except ValueError as error:
        status = report_run_failure(error, "rank 0 failed at iteration 7")
    err = capsys.readouterr().err
    assert status == 1 and err.startswith("Traceback (most recent call last):"), err
    assert err.splitlines()[-1] == "megatron-npu: error: rank 0 failed at iteration 7: ValueError: boom"


def _kill_job_in_save(run_dir: Path, save: Path, iteration: int, *flags: str) -> str:
    """Run until every rank has written checkpoint ``iteration`` and paused before publishing
    it, then SIGKILL torchrun and every rank at once (a node losing power); returns the log."""
    command = torchrun_command(PRETRAIN, *MODEL, *MOCK_DATA, *flags, "--log-dir", str(run_dir / "logs"), nproc=2)
    pause = f"pausing in the save of iteration {iteration}"
    with running(
        command, env=base_env(MEGATRON_NPU_INJECT_FAULT=f"pause-save@{iteration}"), timeout_s=JOB_TIMEOUT_S
    ) as job:
        job.wait_until(lambda: job.log().count(pause) == 2, "paused save on both ranks")
        log = job.log()
        everyone = [psutil.Process(job.process.pid), *psutil.Process(job.process.pid).children(recursive=True)]
        for process in everyone:
            os.kill(process.pid, signal.SIGKILL)
        job.process.wait(timeout=120)
    return log


@pytest.mark.launch
def test_a_job_killed_during_a_save_resumes_from_the_previous_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    flags = ["--eval-iters", "0", "--save", str(save), "--save-interval", "2"]
    _kill_job_in_save(tmp_path / "killed", save, 4, *flags, "--train-iters", "6")

    # on disk: the tracker still names iteration 2, whose checkpoint is whole; 4 is unpublished
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (save / "iter_0000002" / ".metadata").is_file()
    assert (save / "iter_0000004.partial" / ".metadata").is_file()
    assert not (save / "iter_0000004").exists()

    resumed = torchrun(
        PRETRAIN,
        *MODEL,
        *MOCK_DATA,
        *flags,
        "--load",
        str(save),
        "--train-iters",
        "6",
        "--exit-interval",
        "3",
        nproc=2,
        timeout=JOB_TIMEOUT_S,
    ).check()
    assert f"removed {save / 'iter_0000004.partial'}: an unfinished checkpoint save" in resumed.stdout
    assert f"successfully loaded checkpoint from {save} at iteration 2" in resumed.stdout
    assert "iteration        3/       6" in resumed.stdout
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_a_save_stopped_between_moving_the_old_copy_aside_and_publishing_restores_it(tmp_path, capsys):
    """Saving an iteration that exists moves it to ITER.old first; a stop before the new copy
    is published leaves the tracker naming a directory that is not there: the next start puts
    it back. (The stop itself is the killed-save test's; this is the state it can leave.)"""
    from megatron_npu.training.checkpointing import _clean_unfinished_saves

    (tmp_path / "iter_0000004.old").mkdir()
    (tmp_path / "iter_0000004.old" / ".metadata").write_text("saved first")
    (tmp_path / "iter_0000004.partial").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    _clean_unfinished_saves(str(tmp_path))

    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "iter_0000004" / ".metadata").read_text() == "saved first"
    out = capsys.readouterr().out
    assert "restored" in out and "removed" in out and "iter_0000004.partial" in out


# --- .bin / .idx integrity, before any process group ---


def _write_dataset(prefix: Path) -> None:
    """Three documents in megatron-core's own writer's format."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for length in (40, 70, 55):
        builder.add_document(torch.arange(length) % 100, [length])
    builder.finalize(str(prefix) + ".idx")


def _truncate(path: Path, by: int) -> None:
    path.write_bytes(path.read_bytes()[:-by])


CORRUPTIONS = {
    "bin_truncated": (lambda p: _truncate(p.with_suffix(".bin"), 10), ".bin", "is truncated"),
    "bin_from_another_index": (
        lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes() + b"\0\0"),
        ".bin",
        "does not match its index",
    ),
    "idx_truncated": (lambda p: _truncate(p.with_suffix(".idx"), 8), ".idx", "is truncated"),
    "idx_bad_header": (
        lambda p: p.with_suffix(".idx").write_bytes(b"NOTANIDX!" + p.with_suffix(".idx").read_bytes()[9:]),
        ".idx",
        "is not a Megatron index file",
    ),
    "idx_empty": (lambda p: p.with_suffix(".idx").write_bytes(b""), ".idx", "bad or truncated header"),
}


@pytest.fixture(scope="module")
def pretrain_gpt():
    import pretrain_gpt

    return pretrain_gpt


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_a_corrupt_dataset_is_refused_before_training_naming_the_file(
    name, tmp_path, pretrain_gpt, monkeypatch, capsys
):
    import torch.distributed as dist

    prefix = tmp_path / "corpus_text_document"
    _write_dataset(prefix)
    corrupt, suffix, problem = CORRUPTIONS[name]
    corrupt(prefix)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    argv = [*MODEL, "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--data-path", str(prefix)]
    status = pretrain_gpt.pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        None,
        pretrain_gpt.forward_step,
        argv=[*argv, "--train-iters", "3"],
    )
    err = capsys.readouterr().err
    assert status == 2 and not dist.is_initialized()
    lines = [line for line in err.splitlines() if line.startswith("megatron-npu: error:")]
    assert len(lines) == 1, err
    assert f"--data-path: {prefix}{suffix} " in lines[0] and problem in lines[0], lines[0]
    assert "megatron-npu preprocess" in lines[0]


def test_the_integrity_check_accepts_what_megatron_core_writes_and_knows_its_token_types(tmp_path):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset

    from megatron_npu.data.indexed_format import DTYPES
    from megatron_npu.training.data_checks import check_indexed_dataset

    # the one statement of megatron-core's token-type codes agrees with megatron-core's own
    assert {code: dtype.type for code, dtype in DTYPES.items()} == {
        d.value: DType.dtype_from_code(d.value) for d in DType
    }
    prefix = tmp_path / "corpus"
    _write_dataset(prefix)
    check_indexed_dataset(str(prefix), "--data-path")
    assert len(IndexedDataset(str(prefix))) == 3  # the pair megatron-core reads is the pair checked
