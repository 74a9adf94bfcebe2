"""Run an unmodified Megatron-LM script on the patch layer.

``torchrun --nproc_per_node 8 -m megatron_npu.run pretrain_gpt.py <flags>`` applies the
patch set for the selected accelerator, then runs the script as ``__main__`` exactly as
``python pretrain_gpt.py <flags>`` would: ``sys.argv`` is the script and its flags, the
script's directory is first on ``sys.path`` (so ``from gpt_builders import ...`` and the
checkout's ``megatron/training`` resolve), and its exit status is the process's.

Processes the script starts with multiprocessing's spawn method (megatron-core's
checkpoint writer starts a Manager) re-import ``__main__`` in a fresh interpreter
that has not been patched. ``__main__`` therefore names this module as its spec: a
spawned child runs this module as ``__mp_main__``, which patches, then runs the
script under that name (its ``if __name__ == "__main__"`` body stays off, as with
``python script.py``), so functions the script defines still unpickle in the child.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import types
from pathlib import Path

SCRIPT_ENVVAR = "MEGATRON_NPU_RUN_SCRIPT"  # the script, for spawned children
USAGE = "usage: python -m megatron_npu.run SCRIPT.py [SCRIPT FLAGS...]   (under torchrun for several ranks)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    script = Path(argv[0])
    if not script.is_file():
        # Before any import of megatron-core: one line, every rank, no traceback.
        print(f"megatron_npu.run: no such script: {script}\n{USAGE}", file=sys.stderr)
        return 2
    import megatron_npu

    megatron_npu.patch()  # idempotent; also when MEGATRON_NPU_AUTOPATCH=0 deferred it
    script_dir = str(script.resolve().parent)
    # `python -m megatron_npu.run` put the cwd first on sys.path; `python script.py` puts the
    # script's directory there instead (and not the cwd): do what the script expects.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    sys.argv = [str(script), *argv[1:]]
    os.environ[SCRIPT_ENVVAR] = str(script.resolve())
    _run_as_main(script.resolve())
    return 0


def _run_as_main(path: Path) -> None:
    """Execute ``path`` as ``__main__`` (what runpy.run_path does, with this module as the spec)."""
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    module.__spec__ = importlib.util.find_spec(__name__ if __name__ != "__main__" else "megatron_npu.run")
    module.__builtins__ = __builtins__
    code = compile(path.read_bytes(), str(path), "exec")
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous


def _spawned_child() -> None:
    """In a spawned child: patch, then define the script's names without running its main body."""
    import megatron_npu

    megatron_npu.patch()
    script = os.environ.get(SCRIPT_ENVVAR)
    if script:
        globals().update(runpy.run_path(script, run_name="__mp_main__"))


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__":
    _spawned_child()
