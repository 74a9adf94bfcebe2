"""No process outlives a killed job (megatron_npu/lifetime.py).

Two 2-rank pretrain_gpt.py jobs that save every iteration run side by side (one launch's cost), each killed
with ``kill -9`` during a save. The first saves asynchronously (--async-save): torchrun alone is killed while
the forked writers are mid-write of iteration 3 (tests/fixtures/paused_writer.py holds them after
their files' first item) and the ranks train on. The second saves synchronously: torchrun and its direct
children (the ranks) are killed while both ranks pause inside the save. Before the fix, 16 processes of such a
job (ranks, dataloader workers, megatron-core's spawned checkpoint Manager, the resource tracker) trained and
saved on for minutes, and 2 (the Manager and the tracker) outlived the ranks' kill on a futex. Now every process
carrying the job's marker is gone within 30 s, the paused writers among them, and the checkpoint directory does
not change once they are gone, even when the writers' pause is released.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from distributed import base_env, running, torchrun_command
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
from pretrain_runs import MOCK_DATA, MODEL, PRETRAIN

JOB_TIMEOUT_S = 600  # hang guard for reaching the save on a busy machine
SAVED = "successfully saved checkpoint from iteration       2"
PAUSE = "pausing in the save of iteration 3"


def _command(script: Path, run_dir: Path, *extra: str) -> list[str]:
    flags = ["--train-iters", "1000", "--save-interval", "1", "--eval-iters", "0", "--num-workers", "2", *extra]
    save = ["--save", str(run_dir / "ckpt"), "--log-dir", str(run_dir / "logs")]
    return torchrun_command(script, *MODEL, *MOCK_DATA, *flags, *save, nproc=2)


@pytest.mark.launch
def test_killing_torchrun_ends_every_process_of_the_job(tmp_path):
    alone, children = new_marker(), new_marker()
    release = tmp_path / "release-the-writers"
    # the first job's writers of iteration 3 pause mid-write (after the save of 2 is published) while its ranks
    # train on; the second is killed while both ranks pause inside a synchronous save
    env_alone = base_env(**{MARKER_ENV: alone}, **paused_writer_env("iter_0000003.partial", release))
    env_children = base_env(**{MARKER_ENV: children, "MEGATRON_NPU_INJECT_FAULT": "pause-save@3"})
    with (
        running(
            _command(PAUSED_WRITER, tmp_path / "alone", "--async-save"),
            env=env_alone,
            timeout_s=JOB_TIMEOUT_S,
        ) as job_alone,
        running(_command(PRETRAIN, tmp_path / "children"), env=env_children, timeout_s=JOB_TIMEOUT_S) as job_children,
    ):
        job_alone.wait_until(
            lambda: SAVED in job_alone.log() and paused_writers(job_alone.log()),
            "the save of iteration 2 published and a writer of iteration 3 paused mid-write",
        )
        writers = paused_writers(job_alone.log())
        processes = {p.pid for p in job_processes(alone)}
        before = len(processes)
        assert set(writers) <= processes  # the writers are processes of the job, found by its marker
        os.kill(job_alone.process.pid, signal.SIGKILL)
        seconds = {"torchrun alone, writers mid-write": wait_until_gone(alone, time.monotonic())}
        settled = {"alone": directory_state(tmp_path / "alone" / "ckpt")}

        job_children.wait_until(lambda: job_children.log().count(PAUSE) == 2, "a paused save on both ranks")
        ranks = psutil.Process(job_children.process.pid).children()
        for process in [job_children.process, *ranks]:
            os.kill(process.pid, signal.SIGKILL)
        seconds["torchrun and its ranks, in a save"] = wait_until_gone(children, time.monotonic())
        settled["children"] = directory_state(tmp_path / "children" / "ckpt")
    release.touch()  # a writer that outlived the kill would write the rest of its file now
    print(f"RESULT processes of the job before the kill: {before}; seconds until none left: {seconds}")
    # torchrun, 2 ranks, their dataloader workers, Managers, forked writers: the count read the right table
    assert before >= 1 + 2 * 3 + len(writers)
    assert not job_processes(alone) and not job_processes(children)

    # what an orphan would have written meanwhile (the ranks saved every iteration)
    for name, state in settled.items():
        assert directory_state(tmp_path / name / "ckpt") == state, f"{name}: the checkpoint directory changed"
    for name in settled:  # the save killed in was never published
        assert (tmp_path / name / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        assert (tmp_path / name / "ckpt" / "iter_0000003.partial").is_dir()
    assert not (tmp_path / "alone" / "ckpt" / "iter_0000003.partial" / ".metadata").exists()  # mid-write


def test_a_child_trusts_only_the_parent_pid_written_for_its_own_job(monkeypatch):
    from megatron_npu import lifetime

    rank = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "1"}
    # a process of a rank (spawned: it inherited the rank's environment) lives under the rank
    child = {**rank, lifetime.PARENT_ENV: f"4242 {lifetime.job_key(rank)}"}
    assert lifetime.expected_parent(child) == 4242
    # a rank of a job launched from a bound process inherited that process's entry: not its parent
    nested = {**child, "MASTER_PORT": "29600", "RANK": "0"}
    assert lifetime.expected_parent(nested) == os.getppid()
    # not launched (started by hand, under nohup): never bound to its shell
    assert lifetime.expected_parent({}) is None
    assert lifetime.expected_parent({lifetime.PARENT_ENV: "4242 ////"}) is None
