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


# ----- Megatron-LM (the training stack: megatron/training, pretrain_gpt.py) -------------------
#: The Megatron-LM release whose megatron/training the megatron_training patches were verified
#: against (tag core_v0.16.1, the tag of the megatron-core 0.16.1 wheel).
TESTED_MEGATRON_LM = "core_v0.16.1"
TESTED_MEGATRON_LM_RANGE = ">=0.16.1,<0.17"


def _package_info_version(path: str) -> str | None:
    """MAJOR.MINOR.PATCH[PRE_RELEASE] of a Megatron-LM megatron/core/package_info.py, read, not imported."""
    import re

    try:
        text = open(path, encoding="utf-8").read()
    except OSError:
        return None
    fields = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([\w.]*)['\"]?", text, re.M))
    if not {"MAJOR", "MINOR", "PATCH"} <= fields.keys():
        return None
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}"


def installed_megatron_lm() -> tuple[str, str, str] | None:
    """(version, how it was found, checkout root) of the importable megatron/training, or None.

    megatron/training carries no version of its own. A Megatron-LM checkout has
    megatron/core/package_info.py beside it (read as text: the wheel's megatron.core is the
    one imported, so importing would report the wheel). A checkout without megatron/core
    (an extract made to run against the wheel, as in CI) is taken to be the wheel's release:
    that is how such a tree is meant to be used, and the patches' private-name targets are
    then the check that it fits.
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec("megatron.training")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    training_dir = os.path.abspath(list(spec.submodule_search_locations)[0])
    root = os.path.dirname(os.path.dirname(training_dir))
    version = _package_info_version(os.path.join(root, "megatron", "core", "package_info.py"))
    if version is not None:
        return version, "megatron/core/package_info.py of the checkout", root
    core = installed_megatron_core()
    if core is None:
        return None
    return core, "the megatron-core wheel (no megatron/core/package_info.py beside megatron/training)", root


def check_megatron_lm() -> str:
    """The importable Megatron-LM's version, or raise naming it and the tested one."""
    found = installed_megatron_lm()
    if found is None:
        raise UnsupportedMegatronVersion(
            f"megatron.training is not importable: put a Megatron-LM checkout ({TESTED_MEGATRON_LM}) on PYTHONPATH"
        )
    version, source, root = found
    if Version(version) in SpecifierSet(TESTED_MEGATRON_LM_RANGE):
        return version
    message = (
        f"Megatron-LM {version} at {root} (from {source}) is untested with megatron-npu {__version__}: "
        f"its megatron_training patches are verified with Megatron-LM {TESTED_MEGATRON_LM} "
        f"(megatron-core {installed_megatron_core()}); check out {TESTED_MEGATRON_LM}, or set "
        f"{ALLOW_UNTESTED_ENVVAR}=1 to patch it anyway at your own risk."
    )
    if untested_allowed():
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return version
    raise UnsupportedMegatronVersion(message)
