"""megatron-npu: megatron-core pretraining on Ascend NPUs (and cuda, and cpu).

``import megatron_npu`` patches megatron-core and the ``torch.cuda`` device calls
for the selected accelerator (``MEGATRON_NPU_DEVICE=auto|npu|cuda|cpu``); set
``MEGATRON_NPU_AUTOPATCH=0`` to import without patching and call ``patch()``.

One exception: the ``megatron-npu`` command's own process (the console script, ``python -m
megatron_npu``, or a script that declares ``MEGATRON_NPU_LAUNCHER = True`` before importing)
leaves the patch to ``cli.main``, which applies it before the subcommands that need it
(``cli.PATCHED``): ``megatron-npu preprocess`` then starts without torch. The
accelerator (torch) is imported on first use for the same reason.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

from .lifetime import bind_to_launcher
from .version import __version__, check_megatron_core

# First, before anything that can take long: a rank (and whatever it starts) dies with its launcher
bind_to_launcher()

if TYPE_CHECKING:
    from .accelerator import get_accelerator
    from .registry import Patch

AUTOPATCH_ENVVAR = "MEGATRON_NPU_AUTOPATCH"
LAUNCHER_MARKER = "MEGATRON_NPU_LAUNCHER"
COMMAND = "megatron-npu"


def autopatch_enabled() -> bool:
    return os.environ.get(AUTOPATCH_ENVVAR, "1") not in ("0", "false", "no")


def patch() -> list[Patch]:
    """Apply the patch set for the selected accelerator (idempotent)."""
    from .accelerator import get_accelerator
    from .registry import REGISTRY

    check_megatron_core()
    quiet_expected_fallbacks()
    from . import patches  # noqa: F401  (registers the patch set)

    return REGISTRY.apply(get_accelerator())


def unpatch() -> None:
    """Restore every object the patch set replaced."""
    from .registry import REGISTRY

    REGISTRY.undo()


def applied_patches() -> list[Patch]:
    from .registry import REGISTRY

    return REGISTRY.applied()


def __getattr__(name: str) -> Any:
    """PEP 562: torch-importing names on first use, so that importing the package costs no torch."""
    if name == "get_accelerator":
        from .accelerator import get_accelerator

        return get_accelerator
    if name in ("REGISTRY", "Patch"):
        from . import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def quiet_expected_fallbacks(ask_accelerator: bool = True) -> None:
    """megatron-core warns at import that Transformer Engine / apex are missing and it falls
    back to torch; off CUDA that is how megatron-npu runs, so the warning is noise (x ranks).
    A tool that never runs a model (``ask_accelerator=False``) is quiet on every target."""
    if ask_accelerator:
        from .accelerator import get_accelerator

        if get_accelerator().is_upstream:
            return
    warnings.filterwarnings("ignore", message=r"(Transformer Engine|Apex).* not installed", category=UserWarning)


def launched_by_command() -> bool:
    """Whether this process is the ``megatron-npu`` command itself (see the module docstring)."""
    if getattr(sys.modules.get("__main__"), LAUNCHER_MARKER, False):
        return True
    if os.path.basename(sys.argv[0]) in (COMMAND, f"{COMMAND}.exe"):  # the console script
        return True
    argv = list(getattr(sys, "orig_argv", ()))
    # python -m megatron_npu: the package is imported before its __main__ runs
    return any(a == "-m" and argv[i + 1 : i + 2] == [__name__] or a == f"-m{__name__}" for i, a in enumerate(argv))


if not launched_by_command():
    quiet_expected_fallbacks()
    if autopatch_enabled():
        patch()

__all__ = ["__version__", "applied_patches", "get_accelerator", "patch", "unpatch"]
