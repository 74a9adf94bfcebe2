"""Virtual environments of the other megatron-core releases, created once and reused from a cache.

Python 3.11 releases (0.12-0.15): ``python3.11 -m venv --system-site-packages`` over the default
install (torch 2.13.0 CPU and this project, editable, come from it) plus ``pip install
megatron-core==X``, which shadows the default 0.16.1 inside the venv.

Python 3.12 releases (0.17-0.19 declare Python >= 3.12): the registry's torch 2.13.0 for 3.12 is a
CUDA build (about 2.8 GB downloaded, 4.8 GB installed; it runs on the CPU). It is installed once,
with this project's dependencies, into a shared ``py3.12-torch`` venv; each release venv sees it
through a ``.pth`` line and holds only megatron-core and this project (editable, re-pointed when the
cache is used from another checkout).

Cache: ``$MEGATRON_NPU_RELEASES_CACHE`` or ``~/.cache/megatron-npu/releases``. A venv is built in
``<dir>.partial`` and renamed when complete, so an interrupted build is redone, never half-used.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE_ENVVAR = "MEGATRON_NPU_RELEASES_CACHE"
TORCH = "torch==2.13.0"
# this project's runtime dependencies but megatron-core and torch (setup.py install_requires)
PROJECT_DEPS = ("numpy", "packaging", "psutil", "pyyaml", "sentencepiece", "transformers")
READY = "ready.json"


@dataclass(frozen=True)
class Release:
    core: str  # the megatron-core wheel
    python: str  # the interpreter it installs on
    megatron_lm_tag: str  # the Megatron-LM tag of ../shared/megatron-lm/ for it

    @property
    def tarball_name(self) -> str:
        return f"megatron-lm-{self.megatron_lm_tag}-training.tar.gz"

    @property
    def vocab_size(self) -> int:
        # Before 0.16 megatron-core's MockGPTDataset draws token ids up to 4095 whatever the vocabulary.
        return 4096 if self.minor < 16 else 128

    @property
    def minor(self) -> int:
        return int(self.core.split(".")[1])


RELEASES = {
    r.core: r
    for r in (
        Release("0.12.1", "3.11", "core_v0.12.1"),
        Release("0.13.1", "3.11", "core_v0.13.1"),
        Release("0.14.0", "3.11", "core_v0.14.0"),
        Release("0.15.3", "3.11", "core_v0.15.3"),
        Release("0.17.1", "3.12", "core_v0.17.1"),
        Release("0.18.2", "3.12", "core_v0.18.2"),
        Release("0.19.2", "3.12", "core_v0.19.0"),  # the mirror's newest 0.19 tag
    )
}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENVVAR) or Path.home() / ".cache" / "megatron-npu" / "releases")


def interpreter(version: str) -> str | None:
    """A python``version`` executable: on PATH, or one of pyenv's installs."""
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv" / "versions" / f"{version}.*" / "bin" / "python3")))
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys, venv; print(sys.version)"], capture_output=True, text=True
        )
        if probe.returncode == 0 and probe.stdout.startswith(version + "."):
            return candidate
    return None


def _pip(python: Path, *args: str, log: list[str]) -> None:
    command = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *args]
    log.append(" ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build(target: Path, create: list[str], install: list[list[str]], pth: Path | None) -> dict:
    """``target`` built in ``target.partial`` and renamed; returns its ready record (with times)."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    start, log = time.monotonic(), []
    subprocess.run([*create, str(partial)], check=True, capture_output=True)
    python = partial / "bin" / "python"
    if pth is not None:
        (_site_packages(python) / "megatron_npu_shared_torch.pth").write_text(f"{pth}\n")
    for args in install:
        _pip(python, *args, log=log)
    record = {"seconds": round(time.monotonic() - start, 1), "commands": log}
    (partial / READY).write_text(json.dumps(record))
    os.rename(partial, target)  # console scripts keep the .partial path: everything runs as python -m
    return record


def shared_torch312() -> Path:
    """The Python 3.12 venv holding the CUDA torch build and this project's dependencies."""
    target = cache_dir() / "py3.12-torch"
    with _locked(target):
        if not (target / READY).is_file():
            python = interpreter("3.12")
            if python is None:
                raise RuntimeError("no python3.12 found (PATH or ~/.pyenv/versions/3.12.*)")
            _build(target, [python, "-m", "venv"], [[TORCH, *PROJECT_DEPS]], pth=None)
    return target


def release_env(release: Release) -> Path:
    """The venv's python for ``release``, built on first use; this checkout installed in it."""
    target = cache_dir() / release.core
    shared = shared_torch312() if release.python == "3.12" else None
    with _locked(target):
        if not (target / READY).is_file():
            python = interpreter(release.python)
            if python is None:
                raise RuntimeError(f"no python{release.python} found for megatron-core {release.core}")
            if shared is None:
                _build(
                    target, [python, "-m", "venv", "--system-site-packages"], [[f"megatron-core=={release.core}"]], None
                )
            else:
                pth = _site_packages(shared / "bin" / "python")
                _build(target, [python, "-m", "venv"], [[f"megatron-core=={release.core}"]], pth)
        if shared is not None:
            _point_at_checkout(target)
    return target / "bin" / "python"


def _point_at_checkout(target: Path) -> None:
    """A 3.12 venv has no system site: install this checkout (editable, no deps) unless it already is."""
    marker = target / "checkout.txt"
    if marker.is_file() and marker.read_text() == str(ROOT):
        return
    _pip(target / "bin" / "python", "--no-deps", "-e", str(ROOT), log=[])
    marker.write_text(str(ROOT))


def build_times() -> dict[str, float]:
    """Seconds each cached venv took to build (from its ready record)."""
    out = {}
    for ready in cache_dir().glob(f"*/{READY}"):
        out[ready.parent.name] = json.loads(ready.read_text())["seconds"]
    return out


if __name__ == "__main__":  # python tests/releases/envs.py [RELEASE ...]: build (or reuse) and time
    for name in sys.argv[1:] or list(RELEASES):
        began = time.monotonic()
        path = release_env(RELEASES[name])
        print(f"{name}: {path} ({time.monotonic() - began:.1f} s)", flush=True)
    print(json.dumps(build_times(), indent=1))
