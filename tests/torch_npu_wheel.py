"""The torch_npu wheel the npu target is checked against (read, never imported), fetched once into a cache.

The suite's set-up step (tests/conftest.py, after collection) downloads it when the run selects tests that read
it and may start processes; the fast lane (``-m "not launch"``) starts none, so there those tests skip with the
reason unless the wheel is cached. Cache: ``$MEGATRON_NPU_WHEEL_CACHE`` or ``~/.cache/megatron-npu/wheels``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_npu.accelerator.facts import TESTED_TORCH_NPU

CACHE_ENVVAR = "MEGATRON_NPU_WHEEL_CACHE"
SPEC = f"torch_npu=={TESTED_TORCH_NPU}"
GLOB = f"torch_npu-{TESTED_TORCH_NPU}-*.whl"
# The wheel's Python sources are the same on every platform: one manylinux x86-64 build for CPython 3.11.
PLATFORM = ("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "--only-binary=:all:")


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENVVAR) or Path.home() / ".cache" / "megatron-npu" / "wheels")


def cached() -> Path | None:
    found = sorted(cache_dir().glob(GLOB))
    return found[0] if found else None


def download() -> Path:
    """pip downloads the wheel into a private folder, then it is moved into the cache whole (a killed download
    leaves no half wheel there). RuntimeError with pip's message when the registry cannot be reached."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", SPEC, *PLATFORM, "-d", scratch, "-q"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        fetched = sorted(Path(scratch).glob(GLOB))
        if not fetched:
            raise RuntimeError(f"could not download {SPEC}: {done.stderr.strip()[-300:]}")
        target = cache / fetched[0].name
        shutil.move(fetched[0], target)
    return target
