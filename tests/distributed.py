"""Launching real multi-process jobs from tests.

megatron-core's import costs 5-10 s per process here, so tests launch as few
torchrun jobs as possible and let one job check several things: a worker script
prints one ``RESULT {json}`` line per rank, and ``torchrun()`` returns them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        WANDB_MODE="offline",  # runs with --wandb-project write to their save dir, never to the network
        WANDB_SILENT="true",
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
        return [
            json.loads(line[len(RESULT_PREFIX) :])
            for line in self.stdout.splitlines()
            if line.startswith(RESULT_PREFIX)
        ]

    def by_rank(self) -> dict[int, dict]:
        return {result["rank"]: result for result in self.results()}

    def check(self) -> Job:
        if self.returncode != 0:
            raise AssertionError(
                f"job failed ({self.returncode})\n--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-6000:]}"
            )
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
    return run(
        torchrun_command(script, *args, nproc=nproc, torchrun_args=torchrun_args), timeout=timeout, env=env, cwd=cwd
    )


def torchrun_command(script: str | Path, *args: str, nproc: int, torchrun_args: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *torchrun_args,
        str(script),
        *args,
    ]


def torchrun_nodes(
    script: str | Path,
    *args: str,
    nnodes: int,
    nproc_per_node: int,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> list[Job]:
    """``nnodes`` torchrun agents on this machine (``--node_rank`` 0..n-1, one rendezvous on
    127.0.0.1): a multi-node job as the launcher sees it. Returns one Job per node."""
    port = free_port()
    processes, logs = [], []
    for node_rank in range(nnodes):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc_per_node}",
            f"--nnodes={nnodes}",
            f"--node_rank={node_rank}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(script),
            *args,
        ]
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # pipes could fill and stall a node
        logs.append((out, err))
        processes.append(
            subprocess.Popen(
                command,
                env=env or base_env(),
                cwd=str(ROOT),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    jobs = []
    for process, (out, err) in zip(processes, logs, strict=True):
        out.seek(0)
        err.seek(0)
        jobs.append(Job(process.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return jobs


def run(
    command: list[str], timeout: float = 600, env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> Job:
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


class RunningJob:
    """A job a test acts on while it runs (signals it, kills it): its process and its log so far."""

    def __init__(self, process: subprocess.Popen, out: Any, timeout_s: float):
        self.process = process
        self._out = out
        self.timeout_s = timeout_s

    def log(self) -> str:
        """stdout and stderr so far."""
        self._out.seek(0)
        return self._out.read()

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Poll ``ready`` until it holds; fail naming ``what`` if the job ends first or time runs out."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            assert self.process.poll() is None, f"the job ended before {what}:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} within {self.timeout_s} s:\n{self.log()[-3000:]}"
            time.sleep(0.2)


@contextlib.contextmanager
def running(command: list[str], *, env: dict[str, str], timeout_s: float) -> Iterator[RunningJob]:
    """Start ``command`` in the repository root; it is killed on leaving the block if still running."""
    with tempfile.TemporaryFile("w+") as out:
        process = subprocess.Popen(
            command, env=env, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
        )
        try:
            yield RunningJob(process, out, timeout_s)
        finally:
            if process.poll() is None:
                process.kill()
