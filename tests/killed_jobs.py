"""Killing a launched job and checking what is left of it: its processes (found by a marker in their
environment, which every process a rank starts inherits) and its checkpoint directory.

Shared by tests/training/test_orphans.py and test_async_save.py; the paused-writer seam is
tests/fixtures/paused_writer.py.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from pathlib import Path

import psutil
import pytest
from distributed import ROOT

MARKER_ENV = "MEGATRON_NPU_TEST_JOB"
EXIT_WITHIN_S = 30.0  # the requirement, from the kill
POLL_S = 0.2
PAUSED_WRITER = ROOT / "tests" / "fixtures" / "paused_writer.py"
_PAUSED = re.compile(r"writer (\d+) of rank (\d+) paused in (\S+)")


def new_marker() -> str:
    return uuid.uuid4().hex


def paused_writer_env(save_dir: str, release: Path) -> dict[str, str]:
    """The seam's environment: the writers of the save into ``save_dir`` (``iter_0000004.partial``) pause
    after their file's first item until ``release`` exists."""
    return {"PAUSE_WRITE_IN": save_dir, "PAUSE_RELEASE": str(release)}


def paused_writers(log: str) -> dict[int, int]:
    """The writer processes the log says are paused: pid -> rank."""
    return {int(pid): int(rank) for pid, rank, _ in _PAUSED.findall(log)}


def job_processes(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if process.environ().get(MARKER_ENV) == marker:
                found.append(process)
    return found


def directory_state(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time."""
    state = {}
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            stat = path.stat()
            state[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return state


def wait_until_gone(marker: str, killed_at: float) -> float:
    """Seconds from the kill until no process of the job is left; fails past EXIT_WITHIN_S (killing the
    survivors, so that none outlives the test)."""
    while survivors := job_processes(marker):
        elapsed = time.monotonic() - killed_at
        if elapsed > EXIT_WITHIN_S:
            described = [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in survivors if p.is_running()]
            for process in survivors:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            pytest.fail(f"{len(described)} processes of the job alive {elapsed:.0f} s after the kill: {described}")
        time.sleep(POLL_S)
    return time.monotonic() - killed_at
