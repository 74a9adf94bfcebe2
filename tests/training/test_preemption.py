"""--exit-signal-handler: SIGTERM to torchrun (a scheduler preempting the job) ends training
at the same iteration on every rank, with that iteration saved, and the job resumes from it.

torchrun forwards SIGTERM to each rank's whole process group, so the ranks' data-loader
workers are signalled too (--num-workers 1 here): they must not die of it.
"""

from __future__ import annotations

import json
import signal

import pytest
from distributed import base_env, running, torchrun_command
from pretrain_runs import MOCK_DATA, MODEL, PRETRAIN, pretrain, train_losses

pytestmark = pytest.mark.launch  # every test here starts processes

PREEMPTED_AFTER = 3  # iterations logged before the signal is sent


def _launch_and_signal(run_dir, *flags: str) -> tuple[int, str]:
    """Start a 2-rank PP2 job, SIGTERM torchrun once PREEMPTED_AFTER iterations are logged."""
    command = torchrun_command(PRETRAIN, *MODEL, *MOCK_DATA, *flags, "--log-dir", str(run_dir / "logs"), nproc=2)
    metrics = run_dir / "logs" / "metrics.jsonl"

    def logged_iterations() -> int:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return sum("lm_loss" in json.loads(line) for line in lines if line.endswith("}"))

    with running(command, env=base_env(), timeout_s=300) as job:
        job.wait_until(lambda: logged_iterations() >= PREEMPTED_AFTER, f"{PREEMPTED_AFTER} logged iterations")
        job.process.send_signal(signal.SIGTERM)
        returncode = job.process.wait(timeout=600)
        return returncode, job.log()


def test_sigterm_saves_the_iteration_in_flight_stops_every_rank_and_resumes(tmp_path):
    save = tmp_path / "ckpt"
    flags = [
        "--pipeline-model-parallel-size",
        "2",
        "--num-workers",
        "1",
        "--exit-signal-handler",
        "--train-iters",
        "100000",
        "--save",
        str(save),
        "--save-interval",
        "100000",
    ]
    _, log = _launch_and_signal(tmp_path / "preempted", *flags)

    assert "DataLoader worker" not in log, log[-4000:]
    stopped = [line for line in log.splitlines() if "exiting program after receiving SIGTERM at iteration" in line]
    assert len(stopped) == 1, log[-4000:]
    iteration = int(stopped[0].rsplit(" ", 1)[1])
    assert iteration >= PREEMPTED_AFTER
    assert max(train_losses(tmp_path / "preempted")) == iteration  # nothing trained past the save
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(iteration)
    assert (save / f"iter_{iteration:07d}").is_dir()
    assert not [p.name for p in save.iterdir() if p.name.endswith(".partial")]

    resumed = pretrain(
        tmp_path / "resumed",
        "--pipeline-model-parallel-size",
        "2",
        "--load",
        str(save),
        "--train-iters",
        "100000",
        "--exit-interval",
        str(iteration + 1),
        "--eval-iters",
        "0",
        nproc=2,
    ).check()
    assert f"iteration {iteration + 1:8d}/  100000" in resumed.stdout, resumed.stdout[-3000:]
    assert sorted(train_losses(tmp_path / "resumed")) == [iteration + 1]
