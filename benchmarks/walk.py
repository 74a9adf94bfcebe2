"""The walk from pretrain_gpt.py to the first training step: which of the project's files it passes through.

    python benchmarks/walk.py [--top 8] [-- <pretrain_gpt.py flags>]

One process on the cpu target (a 1-rank gloo group, no torchrun) runs pretrain_gpt.py on mock data with a
tiny model (or the flags given after ``--``) under ``sys.setprofile``, from its call of ``pretrain`` (imports
are not part of the walk) to the first call of ``TrainStep.__call__``. The walk is the sequence of project files (``megatron_npu/`` and pretrain_gpt.py)
that hold the innermost running project frame, one entry each time that file changes, on a call into a
project function or a return out of one; frames of torch, megatron-core and the standard library are
transparent. Reported (issue 34's figures) for two walks: files visited, returns (entries into a file the walk
had already left) and the files returned to most often.

  all     every project frame, whoever called it (megatron-core calling back into a patch, a property,
          ``Settings.__setattr__``);
  direct  the walk a reader follows: a project function called by a project function of the direct walk,
          dunder methods but ``__init__`` / ``__call__`` left out (with what they call).
"""

from __future__ import annotations

import argparse
import collections
import os
import runpy
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = ROOT / "pretrain_gpt.py"
PACKAGE = str(ROOT / "megatron_npu") + os.sep
STEP = (str(ROOT / "megatron_npu" / "training" / "step.py"), "__call__")
START = (str(ROOT / "megatron_npu" / "training" / "loop.py"), "pretrain")
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 1 --lr 1e-4 --mock-data --tokenizer-type "
    "NullTokenizer --vocab-size 128 --eval-iters 0 --log-interval 1"
).split()


class FirstStep(BaseException):
    """Raised from the profiler at the first training step: the walk ends there. Not an ``Exception``: pretrain()
    reports those as the run's failure and ends the process (``exit_now``), before the walk could be printed."""


DUNDERS_READ = ("__init__", "__call__")


class Walk:
    """The project files holding the innermost project frame, each change one entry."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.files: list[str] = []
        self.depth: list[str | None] = []  # per Python frame: its project file, or None (transparent)
        self.direct_files: list[str] = []
        self.direct: list[str | None] = []  # per Python frame: its file when it is on the direct walk
        self.started = self.reached_step = False

    def _project(self, frame: FrameType) -> str | None:
        name = frame.f_code.co_filename
        return name if name.startswith(PACKAGE) or name == str(PRETRAIN) else None

    @staticmethod
    def _enter(files: list[str], name: str | None) -> None:
        if name is not None and (not files or files[-1] != name):
            files.append(name)

    @staticmethod
    def _innermost(depth: list[str | None]) -> str | None:
        return next((f for f in reversed(depth) if f is not None), None)

    def _on_direct_walk(self, frame: FrameType, name: str | None) -> str | None:
        code = frame.f_code.co_name
        dunder = code.startswith("__") and code.endswith("__") and code not in DUNDERS_READ
        return name if name is not None and self.direct and self.direct[-1] is not None and not dunder else None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        where = (frame.f_code.co_filename, frame.f_code.co_name)
        if not self.started:
            if event == "call" and where == START:
                self.started, self.files, self.depth = True, [str(PRETRAIN)], [str(PRETRAIN)]
                self.direct_files, self.direct = [str(PRETRAIN)], [str(PRETRAIN)]
            else:
                return
        if event == "call":
            if where == STEP:  # reported here: the trainer turns the exception into its own failure report
                sys.setprofile(None)
                self.reached_step = True
                print(self.report(), flush=True)
                raise FirstStep
            name = self._project(frame)
            self.direct.append(self._on_direct_walk(frame, name))
            self.depth.append(name)
            self._enter(self.files, self._innermost(self.depth))
            self._enter(self.direct_files, self._innermost(self.direct))
        elif event == "return" and self.depth:
            self.depth.pop()
            self.direct.pop()
            self._enter(self.files, self._innermost(self.depth))
            self._enter(self.direct_files, self._innermost(self.direct))

    def report(self) -> str:
        return f"all:\n{self._figures(self.files)}\ndirect:\n{self._figures(self.direct_files)}"

    def _figures(self, files: list[str]) -> str:
        seen: set[str] = set()
        returns: collections.Counter[str] = collections.Counter()
        for name in files:
            if name in seen:
                returns[name] += 1
            seen.add(name)
        rel = lambda name: os.path.relpath(name, ROOT)  # noqa: E731
        most = ", ".join(f"{rel(name)} {n}" for name, n in returns.most_common(self.top))
        return (
            f"  files visited: {len(seen)}\n  file changes: {len(files) - 1}\n"
            f"  returns to a file already left: {sum(returns.values())}\n  most returned to: {most}"
        )


def _single_process_env() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MEGATRON_NPU_DEVICE", "cpu")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1 :] if "--" in argv else TINY
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=8, help="files returned to most often, how many")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    _single_process_env()
    walk = Walk(args.top)
    sys.argv = [str(PRETRAIN), *flags]
    sys.setprofile(walk)
    try:
        runpy.run_path(str(PRETRAIN), run_name="__main__")
    except FirstStep:
        pass
    finally:
        sys.setprofile(None)
    if not walk.reached_step:
        print("the run ended before its first training step", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
