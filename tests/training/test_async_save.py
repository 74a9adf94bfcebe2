"""--async-save: megatron-core's async writer under this trainer's atomic publish.

One 2-rank job saves asynchronously every 2 iterations; the writers of iteration 4's save are held mid-write
(tests/fixtures/paused_writer.py: each has written its file's first item) while the ranks train on, and the job
is killed then (``kill -9`` of torchrun and its direct children, the ranks). A second job resumes from what is
on disk, asynchronously too, and ends. Checked: training went on while a save was written (the step after a
save ran before the save was published; iteration 5 ran while iteration 4's writers were mid-write); every
process of the killed job, the forked writers included, is gone within 30 s and nothing writes into the
checkpoint directory after that, even once the writers' pause is released; the killed save is never visible
(the tracker names 2, the previous checkpoint loads); the resumed losses equal the first job's; the final save is
waited for (the tracker names the last iteration when the job has exited).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from distributed import base_env, running, torchrun, torchrun_command
from killed_jobs import (
    MARKER_ENV,
    PAUSED_WRITER,
    directory_state,
    job_processes,
    new_marker,
    paused_writer_env,
    paused_writers,
    wait_until_gone,
)
from pretrain_runs import MOCK_DATA, MODEL, NO_DROPOUT, PRETRAIN, SHAPE, train_losses

from megatron_npu.policy import ConfigError
from megatron_npu.training.arguments import parse_args

JOB_TIMEOUT_S = 600  # hang guard on a busy machine
SAVED_2 = "successfully saved checkpoint from iteration       2"
ITERATION_5 = "iteration        5/       6"


def _flags(run_dir: Path, save: Path) -> list[str]:
    return [
        *MODEL,
        *MOCK_DATA,
        *NO_DROPOUT,
        "--train-iters",
        "6",
        "--eval-iters",
        "0",
        "--save",
        str(save),
        "--save-interval",
        "2",
        "--async-save",
        "--log-dir",
        str(run_dir / "logs"),
    ]


def _line(log: str, text: str) -> int:
    lines = log.splitlines()
    return next(i for i, line in enumerate(lines) if text in line)


def _kill_mid_write(run_dir: Path, save: Path, release: Path) -> tuple[str, float]:
    """The first job, killed with its ranks while the writers of iteration 4's save are mid-write (DP2 without the
    distributed optimizer, saved fully parallel: each rank's writer writes its share), iteration 5 has run and the save of 2 is published; returns its log and the seconds until none of its processes was left."""
    marker = new_marker()
    command = torchrun_command(PAUSED_WRITER, *_flags(run_dir, save), nproc=2)
    env = base_env(**{MARKER_ENV: marker}, **paused_writer_env("iter_0000004.partial", release))
    with running(command, env=env, timeout_s=JOB_TIMEOUT_S) as job:
        job.wait_until(
            lambda: all(line in job.log() for line in (ITERATION_5, SAVED_2)) and paused_writers(job.log()),
            "iteration 5 and the save of 2 published, with the writers of 4's save paused mid-write",
        )
        writers = paused_writers(job.log())
        assert set(writers) <= {p.pid for p in job_processes(marker)}
        for process in [job.process, *psutil.Process(job.process.pid).children()]:
            os.kill(process.pid, signal.SIGKILL)
        seconds = wait_until_gone(marker, time.monotonic())
        return job.log(), seconds


@pytest.mark.launch
def test_async_saves_publish_when_written_and_resume_exactly(tmp_path):
    save, release = tmp_path / "ckpt", tmp_path / "release-the-writers"
    log, seconds = _kill_mid_write(tmp_path / "first", save, release)
    print(f"RESULT seconds from the kill until no process of the job was left: {seconds:.1f}")
    # the step after a save ran while the save was written: published only after it
    assert _line(log, "scheduled an asynchronous checkpoint save of iteration       2") < _line(
        log, "iteration        3/       6"
    )
    assert _line(log, "iteration        3/       6") < _line(log, SAVED_2)
    # nothing of the killed job writes on, not even its writers once released
    settled = directory_state(save)
    release.touch()
    assert directory_state(save) == settled
    # the killed save is not visible, and was killed mid-write; the previous one is whole
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (save / "iter_0000004.partial").is_dir() and not (save / "iter_0000004.partial" / ".metadata").exists()
    assert not (save / "iter_0000004").exists()
    first = train_losses(tmp_path / "first")

    resumed = torchrun(PRETRAIN, *_flags(tmp_path / "resumed", save), "--load", str(save), nproc=2).check()
    assert f"successfully loaded checkpoint from {save} at iteration 2" in resumed.stdout
    assert "iter_0000004.partial: an unfinished checkpoint save" in resumed.stdout
    again = train_losses(tmp_path / "resumed")
    assert {i: again[i] for i in (3, 4, 5)} == {i: first[i] for i in (3, 4, 5)}
    # the last save was written after the last step and waited for at the end
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002", "iter_0000004", "iter_0000006"]


def test_async_save_is_a_torch_dist_flag():
    base = [*SHAPE, *MOCK_DATA, "--lr", "1e-3", "--train-iters", "2", "--save", "ckpt", "--save-interval", "1"]
    assert parse_args([*base, "--async-save"], world_size=1, check_paths=False).async_save
    fsdp = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--async-save"]
    with pytest.raises(ConfigError, match="--async-save writes --ckpt-format torch_dist only"):
        parse_args([*base, *fsdp], world_size=1, check_paths=False)
