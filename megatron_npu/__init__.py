"""megatron-npu: megatron-core pretraining on Ascend NPUs (and cuda, and cpu).

``import megatron_npu`` patches megatron-core and the ``torch.cuda`` device calls
for the selected accelerator (``MEGATRON_NPU_DEVICE=auto|npu|cuda|cpu``); set
``MEGATRON_NPU_AUTOPATCH=0`` to import without patching and call ``patch()``.
"""

from __future__ import annotations

import os
import warnings

from .accelerator import get_accelerator
from .registry import REGISTRY, Patch
from .version import __version__, check_megatron_core

AUTOPATCH_ENVVAR = "MEGATRON_NPU_AUTOPATCH"


def patch() -> list[Patch]:
    """Apply the patch set for the selected accelerator (idempotent)."""
    check_megatron_core()
    from . import patches  # noqa: F401  (registers the patch set)

    return REGISTRY.apply(get_accelerator())


def unpatch() -> None:
    """Restore every object the patch set replaced."""
    REGISTRY.undo()


def applied_patches() -> list[Patch]:
    return REGISTRY.applied()


def _quiet_expected_fallbacks() -> None:
    """megatron-core warns at import that Transformer Engine / apex are missing and it falls
    back to torch; off CUDA that is how megatron-npu runs, so the warning is noise (x ranks)."""
    if not get_accelerator().is_upstream:
        warnings.filterwarnings("ignore", message=r"(Transformer Engine|Apex).* not installed", category=UserWarning)


_quiet_expected_fallbacks()
if os.environ.get(AUTOPATCH_ENVVAR, "1") not in ("0", "false", "no"):
    patch()

__all__ = ["__version__", "applied_patches", "get_accelerator", "patch", "unpatch"]
