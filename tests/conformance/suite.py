"""The suite under test: megatron-core 0.16.1's unit tests, unpacked to a short path.

Only two conftest changes, neither about the code under test: the session fixture that
downloads a data set from the network is no longer autouse (no network here; the few tests
that read /opt/data fail as a harness limit), and nothing else. The ``is_te_min_version``
call in ``set_env`` needs no edit: the patch layer answers it without Transformer Engine.
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "megatron-lm"
TARBALL = SHARED / "megatron-lm-core_v0.16.1-unit-tests.tar.gz"
# The suite imports megatron.training (dist_checkpointing/utils.py): Megatron-LM's checkout of the same
# tag sits beside it, as in upstream's repository; its megatron/ merges with the wheel's megatron.core.
TRAINING_TARBALL = SHARED / "megatron-lm-core_v0.16.1-training.tar.gz"
# The async checkpoint writer's unix socket lives under TMPDIR: keep every path short.
WORKDIR = Path("/tmp/mcut")
CONFTEST = "tests/unit_tests/conftest.py"
CONFTEST_EDITS = (
    (
        "from tests.test_utils.python_scripts.download_unit_tests_dataset import download_and_extract_asset\n",
        "",
    ),
    (
        '@pytest.fixture(scope="session", autouse=True)\ndef ensure_test_data():',
        '@pytest.fixture(scope="session")\ndef ensure_test_data():  # conformance: no network download',
    ),
)


class SuiteChanged(RuntimeError):
    """The tarball's conftest no longer has the text the harness edits."""


def _stamp(tarball: Path) -> str:
    digest = hashlib.sha256()
    with open(tarball, "rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def edit_conftest(root: Path) -> None:
    path = root / CONFTEST
    text = path.read_text()
    for old, new in CONFTEST_EDITS:
        if text.count(old) != 1:
            raise SuiteChanged(f"{path}: expected one {old.strip()!r}; update CONFTEST_EDITS for this release")
        text = text.replace(old, new)
    path.write_text(text)


def _training_members(archive: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """Megatron-LM's ``megatron/`` package, its ``tools/`` (test_tokenizer.py imports tools.preprocess_data) and its
    root modules (gpt_builders.py, model_provider.py, which megatron_fsdp's test utils import): the suite brings its
    own tests and pyproject.toml."""
    members = []
    for member in archive.getmembers():
        name = member.name.removeprefix("./")
        if name.startswith(("megatron/", "tools/")) or ("/" not in name and name.endswith(".py")):
            members.append(member)
    return members


def unpack(tarball: Path = TARBALL, workdir: Path = WORKDIR, training: Path = TRAINING_TARBALL) -> Path:
    """The suite's root (holding ``tests/unit_tests`` and ``megatron/training``), unpacked once per content."""
    root = workdir / "suite"
    stamp_file = workdir / "suite.stamp"
    stamp = _stamp(tarball) + _stamp(training) + _stamp(Path(__file__))  # this file says what is unpacked
    if stamp_file.exists() and stamp_file.read_text() == stamp and (root / CONFTEST).exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tarfile.open(tarball) as archive:
        archive.extractall(root, filter="data")
    with tarfile.open(training) as archive:
        archive.extractall(root, members=_training_members(archive), filter="data")
    edit_conftest(root)
    stamp_file.write_text(stamp)
    return root
