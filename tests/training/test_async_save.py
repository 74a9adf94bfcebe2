"""--async-save: megatron-core's async writer under this trainer's atomic publish.

One 2-rank job saves asynchronously every 2 iterations and is killed (``kill -9`` of torchrun) while
the save of iteration 4 is written but not yet published; a second job resumes from what is on disk,
asynchronously too, and ends. Checked: training went on while a save was written (the next iteration
ran before the save was published), a killed save is never visible (the tracker names 2, the
previous checkpoint loads), the resumed losses equal the first job's, and the final save is waited
for (the tracker names the last iteration when the job has exited).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
from distributed import base_env, running, torchrun, torchrun_command
from pretrain_runs import MOCK_DATA, MODEL, NO_DROPOUT, PRETRAIN, SHAPE, train_losses

from megatron_npu.policy import ConfigError
from megatron_npu.training.arguments import parse_args

JOB_TIMEOUT_S = 600  # hang guard on a busy machine
PAUSE = "pausing in the save of iteration 4"


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


def _kill_in_publish(run_dir: Path, save: Path) -> str:
    """The first job, killed with torchrun alone once both ranks hold the written save of iteration 4."""
    command = torchrun_command(PRETRAIN, *_flags(run_dir, save), nproc=2)
    env = base_env(MEGATRON_NPU_INJECT_FAULT="pause-save@4")
    with running(command, env=env, timeout_s=JOB_TIMEOUT_S) as job:
        job.wait_until(lambda: job.log().count(PAUSE) == 2, "the written, unpublished save of iteration 4")
        everyone = psutil.Process(job.process.pid).children(recursive=True)
        os.kill(job.process.pid, signal.SIGKILL)
        job.process.wait()
        _, alive = psutil.wait_procs(everyone, timeout=JOB_TIMEOUT_S)  # the ranks follow their launcher
        assert not alive, alive
        return job.log()


@pytest.mark.launch
def test_async_saves_publish_when_written_and_resume_exactly(tmp_path):
    save = tmp_path / "ckpt"
    log = _kill_in_publish(tmp_path / "first", save)
    # the step after a save ran while the save was written: published only after it
    assert _line(log, "scheduled an asynchronous checkpoint save of iteration       2") < _line(
        log, "iteration        3/       6"
    )
    assert _line(log, "iteration        3/       6") < _line(
        log, "successfully saved checkpoint from iteration       2"
    )
    # the killed save is not visible; the previous one is whole
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (save / "iter_0000004.partial" / ".metadata").is_file()  # written by every rank, never published
    assert not (save / "iter_0000004").exists()
    first = train_losses(tmp_path / "first")

    resumed = torchrun(PRETRAIN, *_flags(tmp_path / "resumed", save), "--load", str(save), nproc=2).check()
    assert f"successfully loaded checkpoint from {save} at iteration 2" in resumed.stdout
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
