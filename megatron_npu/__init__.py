"""megatron-npu: megatron-core pretraining on Ascend NPUs (and cuda, and cpu).

``import megatron_npu`` patches megatron-core and the ``torch.cuda`` device calls
for the selected accelerator (``MEGATRON_NPU_DEVICE=auto|npu|cuda|cpu``); set
``MEGATRON_NPU_AUTOPATCH=0`` to import without patching and call ``patch()``.
"""

from __future__ import annotations

import os

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


if os.environ.get(AUTOPATCH_ENVVAR, "1") not in ("0", "false", "no"):
    patch()

__all__ = ["__version__", "applied_patches", "get_accelerator", "patch", "unpatch"]
