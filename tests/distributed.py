"""Launching real multi-process jobs from tests.

megatron-core's import costs 5-10 s per process here, so tests launch as few
torchrun jobs as possible and let one job check several things: a worker script
prints one ``RESULT {json}`` line per rank, and ``torchrun()`` returns them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "RESULT "


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MEGATRON_NPU_DEVICE="cpu",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    env.update(extra)
    return env


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str

    def results(self) -> list[dict]:
        """The RESULT payloads, in the order the ranks printed them."""
        return [json.loads(line[len(RESULT_PREFIX) :]) for line in self.stdout.splitlines() if line.startswith(RESULT_PREFIX)]

    def by_rank(self) -> dict[int, dict]:
        return {result["rank"]: result for result in self.results()}

    def check(self) -> Job:
        if self.returncode != 0:
            raise AssertionError(f"job failed ({self.returncode})\n--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-6000:]}")
        return self


def torchrun(
    script: str | Path,
    *args: str,
    nproc: int,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    torchrun_args: tuple[str, ...] = (),
    cwd: str | Path | None = None,
) -> Job:
    """Run ``script`` under torchrun on one host with ``nproc`` ranks."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        *torchrun_args, str(script), *args,
    ]  # fmt: skip
    return run(command, timeout=timeout, env=env, cwd=cwd)


def run(command: list[str], timeout: float = 600, env: dict[str, str] | None = None, cwd: str | Path | None = None) -> Job:
    completed = subprocess.run(
        command,
        env=env or base_env(),
        cwd=str(cwd or ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return Job(completed.returncode, completed.stdout, completed.stderr)
