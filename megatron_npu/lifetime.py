"""No process outlives its launcher: every rank of a torchrun job, and every process a rank
starts, exits when its parent dies.

torchrun's ranks are session leaders of their own (``start_new_session``), so nothing ends them
when torchrun is killed with SIGKILL: measured on a 2-rank job saving every iteration, 16 processes
(ranks, dataloader workers, megatron-core's spawned checkpoint Manager, the resource tracker) trained
and saved on for minutes into the directory the next job resumes from. Linux offers
``prctl(PR_SET_PDEATHSIG)``, which torch does not set for torchrun's workers; so here:

- ``bind_to_launcher()`` (at ``import megatron_npu``, so in both trainers and in every process a rank
  spawns, which re-imports the rank's ``__main__``) asks for SIGKILL when the parent dies, then checks the
  parent did not die before the request (``os.getppid()`` against the parent's pid as it was: the pid a
  rank writes into the environment for its children, or, for a rank itself, the torchrun it started under).
- PDEATHSIG fires when the parent *thread* that started the child ends, not the parent process. torchrun
  starts ranks from its main thread, and the processes of a rank fork from its main thread; a process
  forked from another thread gets no death signal (a short-lived thread would kill it) and is left to the
  watchdog thread, which compares ``os.getppid()`` with the parent's pid once a second.
- A forked child (dataloader workers, megatron-core's checkpoint writers) runs no import: the at-fork hook
  applies the same to it. PDEATHSIG is cleared by fork and kept by exec.

Only processes of a launched job are bound (torchrun's ``TORCHELASTIC_RUN_ID``, or a child of a bound
process): a process started by hand, or under ``nohup``, keeps running when its shell ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PARENT_ENV = "MEGATRON_NPU_PARENT"  # "PID JOB": written by a bound process for the processes it starts
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun in each rank's environment
_JOB_ENV = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "RANK", "TORCHELASTIC_RESTART_COUNT")
_PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 1.0

_bound: dict[str, int] = {}  # "parent": the pid this process lives under, once bound


def bind_to_launcher() -> bool:
    """Bind this process's life to its parent's when it belongs to a launched job (idempotent).
    Returns whether it is bound."""
    if _bound.get("pid") == os.getpid():
        return True
    if not sys.platform.startswith("linux"):
        return False
    parent = expected_parent(os.environ)
    if parent is None:
        return False
    _bind(parent, from_main_thread=True)
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    return True


def job_key(environ: os._Environ | dict[str, str]) -> str:
    """What identifies one rank of one launched job: a rank's children share it, a rank of a job
    launched by them (another port, another rank) does not."""
    return "/".join(environ.get(name, "") for name in _JOB_ENV)


def expected_parent(environ: os._Environ | dict[str, str]) -> int | None:
    """The pid this process must live under, or None when it is not part of a launched job.

    A child of a bound process finds its parent's pid in PARENT_ENV, written with the same job key.
    Anything else under torchrun is a rank: its parent is the torchrun that started it. A rank whose
    torchrun died before this ran has been handed to PID 1 already (unless torchrun is PID 1 itself)."""
    if TORCHRUN_ENV not in environ:  # a rank's children inherit it
        return None
    pid, _, job = environ.get(PARENT_ENV, "").partition(" ")
    if pid.isdigit() and job == job_key(environ):
        return int(pid)
    parent = os.getppid()
    if parent == 1 and not _torchrun_is_init():
        _exit_orphaned("its torchrun died before it started")
    return parent


def _torchrun_is_init() -> bool:
    """A container whose entry point is torchrun: PID 1 is the launcher, not a reaper."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ")
    except OSError:
        return False
    return b"torch.distributed.run" in command or b"torchrun" in command


def _bind(parent: int, from_main_thread: bool) -> None:
    if from_main_thread:  # a death signal tied to a short-lived thread would kill a live process's child
        _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request: no signal will come
        _exit_orphaned(f"its parent (pid {parent}) died before it started")
    _bound.update(pid=os.getpid(), parent=parent)
    os.environ[PARENT_ENV] = f"{os.getpid()} {job_key(os.environ)}"
    threading.Thread(target=_watch, args=(parent,), name="megatron-npu-lifetime", daemon=True).start()


def _set_parent_death_signal(signum: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def _watch(parent: int) -> None:
    """The fallback for what the death signal misses (a fork from another thread, a parent that
    dies while the request is being made): the parent is gone when this process has another one."""
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    _exit_orphaned(f"its parent (pid {parent}) died")


def _exit_orphaned(why: str) -> None:
    # SIGKILL, not sys.exit: the main thread may be blocked in a collective that never returns
    print(f"megatron-npu: pid {os.getpid()} exits: {why} (the job was killed)", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


_forking_thread: dict[str, bool] = {}


def _before_fork() -> None:
    _forking_thread["main"] = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    """A forked child inherits the environment and this module's state, but neither the death
    signal nor the watchdog thread: bound again, under the process that forked it."""
    if "pid" not in _bound:
        return
    parent = _bound["pid"]  # the forking process: this child's parent
    _bound.clear()
    _bind(parent, from_main_thread=_forking_thread.get("main", False))
