"""Megatron-LM's training stack as a user's checkout: the unmodified extract in ../shared/megatron-lm/
unpacked, put on PYTHONPATH beside the installed megatron-core wheel, its scripts run through
``python -m megatron_npu.run`` under torchrun (tests of the patch layer against upstream's trainer)."""

from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

import pytest
from distributed import ROOT, Job, base_env, torchrun

TARBALL_ENVVAR = "MEGATRON_LM_TARBALL"
TAG = "core_v0.16.1"  # the release this project tracks
TARBALL_NAME = f"megatron-lm-{TAG}-training.tar.gz"
TARBALL = Path(os.environ.get(TARBALL_ENVVAR) or ROOT.parent / "shared" / "megatron-lm" / TARBALL_NAME)
#: a test that runs the extract: skipped, saying where it was looked for, where it is absent
NEEDS_EXTRACT = pytest.mark.skipif(
    not TARBALL.is_file(), reason=f"Megatron-LM extract not found at {TARBALL} (set {TARBALL_ENVVAR} to its .tar.gz)"
)
#: an iteration line of Megatron-LM's training_log (and this trainer's): (iteration, lm loss)
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")


def unpack(tarball: Path, root: Path) -> Path:
    """The extract unpacked under ``root``; returns the checkout (the folder holding pretrain_gpt.py)."""
    with tarfile.open(tarball) as archive:
        archive.extractall(root, filter="data")
    [checkout] = [p.parent for p in root.rglob("pretrain_gpt.py") if (p.parent / "megatron" / "training").is_dir()]
    return checkout


def env_for(checkout: Path) -> dict[str, str]:
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), env["PYTHONPATH"]])
    return env


def upstream(checkout: Path, *flags: str, nproc: int, cwd: Path | None = None, script: str = "pretrain_gpt.py") -> Job:
    """``torchrun --nproc_per_node N -m megatron_npu.run SCRIPT FLAGS`` as a user types it."""
    return torchrun(
        "megatron_npu.run",
        str(checkout / script),
        *flags,
        nproc=nproc,
        env=env_for(checkout),
        torchrun_args=("--module",),
        cwd=cwd,
        timeout=600,
    )
