"""--exit-signal-handler: SIGTERM to torchrun (a scheduler preempting the job) ends training
at the same iteration on every rank, with that iteration saved, and the job resumes from it.

torchrun forwards SIGTERM to each rank's whole process group, so the ranks' data-loader
workers are signalled too (--num-workers 1 here): they must not die of it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
import time

from distributed import ROOT, base_env, torchrun_command
from pretrain_runs import MOCK_DATA, MODEL, PRETRAIN, pretrain, train_losses

PREEMPTED_AFTER = 3  # iterations logged before the signal is sent


def _launch_and_signal(run_dir, *flags: str) -> tuple[int, str]:
    """Start a 2-rank PP2 job, SIGTERM torchrun once PREEMPTED_AFTER iterations are logged."""
    command = torchrun_command(PRETRAIN, *MODEL, *MOCK_DATA, *flags, "--log-dir", str(run_dir / "logs"), nproc=2)
    metrics = run_dir / "logs" / "metrics.jsonl"
    with tempfile.TemporaryFile("w+") as out:
        job = subprocess.Popen(
            command,
            env=base_env(),
            cwd=str(ROOT),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        try:
            deadline = time.monotonic() + 300
            while True:
                assert job.poll() is None, "the job ended before it was signalled"
                assert time.monotonic() < deadline, "no progress within 300 s"
                lines = metrics.read_text().splitlines() if metrics.exists() else []
                if sum("lm_loss" in json.loads(line) for line in lines if line.endswith("}")) >= PREEMPTED_AFTER:
                    break
                time.sleep(0.2)
            job.send_signal(signal.SIGTERM)
            returncode = job.wait(timeout=120)
        finally:
            if job.poll() is None:
                job.kill()
        out.seek(0)
        return returncode, out.read()


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
