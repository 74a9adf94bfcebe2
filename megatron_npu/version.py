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

#: The one statement of the megatron-core range; setup.py and every patch read it here. 0.12.x-0.16.x
#: install on Python 3.11 (0.16.1, the newest there, is the default install), 0.17.x-0.19.x declare
#: Python >= 3.12; pip picks by Python version. Each release line below was verified (tests/releases/).
TESTED_MEGATRON_CORE_RANGE = ">=0.12.0,<0.20"
TESTED_MEGATRON_CORE = SpecifierSet(TESTED_MEGATRON_CORE_RANGE)
SUPPORTED_MEGATRON_CORE_RANGE = TESTED_MEGATRON_CORE_RANGE
#: Release line -> the megatron-core wheel and the Megatron-LM tag its patches were verified with.
VERIFIED_RELEASES = {
    "0.12": ("0.12.1", "core_v0.12.1"),
    "0.13": ("0.13.1", "core_v0.13.1"),
    "0.14": ("0.14.0", "core_v0.14.0"),
    "0.15": ("0.15.3", "core_v0.15.3"),
    "0.16": ("0.16.1", "core_v0.16.1"),
    "0.17": ("0.17.1", "core_v0.17.1"),
    "0.18": ("0.18.2", "core_v0.18.2"),
    "0.19": ("0.19.2", "core_v0.19.0"),  # Megatron-LM's newest 0.19 tag
}
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


def release_line(version: str) -> str:
    """'0.15' of '0.15.3' (major.minor: what a Megatron-LM tag and a megatron-core wheel must share)."""
    release = Version(version).release
    return f"{release[0]}.{release[1] if len(release) > 1 else 0}"


def release_for_patches(found: str | None) -> str | None:
    """The megatron-core release whose patches apply: the installed one, or, for an untested one let in by
    MEGATRON_NPU_ALLOW_UNTESTED_MEGATRON, the nearest verified release (the oldest below the range, else the newest)."""
    if found is None or Version(found) in TESTED_MEGATRON_CORE:
        return found
    wheels = sorted((wheel for wheel, _ in VERIFIED_RELEASES.values()), key=Version)
    return wheels[0] if Version(found) < Version(wheels[0]) else wheels[-1]


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
#: The Megatron-LM tags the megatron_training patches were verified against, one per megatron-core release
#: line: a checkout must be one of these lines and the same line as the installed megatron-core wheel.
TESTED_MEGATRON_LM = ", ".join(tag for _, tag in VERIFIED_RELEASES.values())
TESTED_MEGATRON_LM_RANGE = TESTED_MEGATRON_CORE_RANGE


def megatron_lm_tag(megatron_core: str | None = None) -> str | None:
    """The Megatron-LM tag verified with ``megatron_core``'s release line (default: the installed wheel)."""
    found = megatron_core if megatron_core is not None else installed_megatron_core()
    if found is None:
        return None
    verified = VERIFIED_RELEASES.get(release_line(found))
    return verified[1] if verified else None


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
            f"megatron.training is not importable: put a Megatron-LM checkout "
            f"({megatron_lm_tag() or TESTED_MEGATRON_LM}) on PYTHONPATH"
        )
    version, source, root = found
    core = installed_megatron_core()
    same_line = core is not None and release_line(version) == release_line(core)
    if Version(version) in SpecifierSet(TESTED_MEGATRON_LM_RANGE) and same_line:
        return version
    expected = megatron_lm_tag(core)
    message = (
        f"Megatron-LM {version} at {root} (from {source}) is untested with megatron-npu {__version__} and "
        f"megatron-core {core}: its megatron_training patches are verified with Megatron-LM "
        f"{expected or TESTED_MEGATRON_LM} for megatron-core {core}"
        f"{'' if expected else f' (tested: {TESTED_MEGATRON_LM})'}; check out "
        f"{expected or 'one of those with its megatron-core'}, or set {ALLOW_UNTESTED_ENVVAR}=1 to patch it "
        "anyway at your own risk."
    )
    if untested_allowed():
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return version
    raise UnsupportedMegatronVersion(message)
