"""The megatron-core version guard.

The patch set targets private names inside megatron-core; they move between
releases. An untested version is refused before anything is patched, unless the
user opts in with ``MEGATRON_NPU_ALLOW_UNTESTED_MEGATRON=1`` (then: a warning).
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__version__ = "0.1.0"

#: The one statement of the megatron-core range; setup.py and every patch read it here.
TESTED_MEGATRON_CORE_RANGE = ">=0.16.0,<0.17"
TESTED_MEGATRON_CORE = SpecifierSet(TESTED_MEGATRON_CORE_RANGE)
ALLOW_UNTESTED_ENVVAR = "MEGATRON_NPU_ALLOW_UNTESTED_MEGATRON"


class UnsupportedMegatronVersion(RuntimeError):
    """megatron-core is missing or outside the tested range."""


def installed_megatron_core() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def untested_allowed() -> bool:
    return os.environ.get(ALLOW_UNTESTED_ENVVAR, "") not in ("", "0")


def check_megatron_core(version: str | None = None) -> str:
    """Return the installed megatron-core version, or raise if it is untested."""
    found = version if version is not None else installed_megatron_core()
    if found is None:
        raise UnsupportedMegatronVersion(
            f"megatron-core is not installed; megatron-npu {__version__} is tested with "
            f"megatron-core{TESTED_MEGATRON_CORE}: pip install 'megatron-core{TESTED_MEGATRON_CORE}'"
        )
    if Version(found) in TESTED_MEGATRON_CORE:
        return found
    message = (
        f"megatron-core {found} is untested with megatron-npu {__version__} "
        f"(tested: megatron-core{TESTED_MEGATRON_CORE}). Install a tested version with "
        f"pip install 'megatron-core{TESTED_MEGATRON_CORE}', or set {ALLOW_UNTESTED_ENVVAR}=1 "
        "to patch it anyway at your own risk."
    )
    if untested_allowed():
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return found
    raise UnsupportedMegatronVersion(message)
