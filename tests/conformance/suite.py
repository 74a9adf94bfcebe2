"""The suite under test: megatron-core 0.16.1's unit tests, unpacked to a short path.

Only two conftest changes, neither about the code under test: the session fixture that
downloads a data set from the network is no longer autouse (no network here; the few tests
that read /opt/data fail as a harness limit), and nothing else. The ``is_te_min_version``
call in ``set_env`` needs no edit: the patch layer answers it without Transformer Engine. Megatron-LM files the
extracts lack (``LM_TOOLS``) are added, beside the extracts' own, only from a checkout the user names.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "megatron-lm"
#: Megatron-LM's tag the extracts are of; files taken from a user's checkout must be this tag's.
TAG = "core_v0.16.1"
TARBALL = SHARED / f"megatron-lm-{TAG}-unit-tests.tar.gz"
# The suite imports megatron.training (dist_checkpointing/utils.py): Megatron-LM's checkout of the same
# tag sits beside it, as in upstream's repository; its megatron/ merges with the wheel's megatron.core.
TRAINING_TARBALL = SHARED / f"megatron-lm-{TAG}-training.tar.gz"
#: Megatron-LM files the suite imports that the training extract lacks (it has tools/preprocess_data.py):
#: data/test_preprocess_data.py (imported by data/test_bin_reader.py and the top-level test_tokenizer.py) and
#: data/test_preprocess_mmdata.py import merge_datasets, the latter preprocess_mmdata, data/test_builder.py
#: build_sequences_per_dataset. Taken from a checkout only with ``--megatron-lm`` (tests/conformance/run.py).
LM_TOOLS = ("tools/merge_datasets.py", "tools/build_sequences_per_dataset.py", "tools/preprocess_mmdata.py")
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


class CheckoutError(RuntimeError):
    """The Megatron-LM checkout named with --megatron-lm cannot give its tag's files."""


def _stamp(tarball: Path) -> str:
    digest = hashlib.sha256()
    with open(tarball, "rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _files_stamp(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    return digest.hexdigest()[:16]


def missing_tools(training: Path = TRAINING_TARBALL) -> list[str]:
    """The files of ``LM_TOOLS`` the training extract lacks."""
    with tarfile.open(training) as archive:
        names = {name.removeprefix("./") for name in archive.getnames()}
    return [path for path in LM_TOOLS if path not in names]


def _at_tag(git: list[str], paths: list[str]) -> dict[str, bytes]:
    """``paths`` as committed at ``TAG`` in the repository ``git`` (git's -C / --git-dir arguments) names."""
    files = {}
    for path in paths:
        shown = subprocess.run(["git", *git, "show", f"{TAG}:{path}"], capture_output=True)
        if shown.returncode != 0:
            error = " ".join(shown.stderr.decode(errors="replace").split())  # git's own reason, one line
            raise CheckoutError(f"{git[-1]}: cannot read {path} at {TAG} ({error}); name a clone that has the tag")
        files[path] = shown.stdout
    return files


def megatron_lm_files(source: Path, paths: list[str]) -> tuple[dict[str, bytes], str]:
    """``paths`` from a Megatron-LM work tree or git directory (a bare clone, a .git), and where they came from.

    A git directory gives them as committed at ``TAG``; a work tree gives its own files, which must be the
    tag's when it is a git work tree (a checkout of another tag or with local changes is not the reference).
    """
    source = source.expanduser().resolve()
    if not (source / "tools").is_dir():
        return _at_tag(["--git-dir", str(source)], paths), f"from the git directory {source} at {TAG}"
    absent = [path for path in paths if not (source / path).is_file()]
    if absent:
        raise CheckoutError(f"{source}: no {', '.join(absent)}; name a checkout of Megatron-LM {TAG}")
    files = {path: (source / path).read_bytes() for path in paths}
    if not (source / ".git").exists():
        return files, f"from {source} (not a git work tree: not checked against {TAG})"
    differ = [path for path, tagged in _at_tag(["-C", str(source)], paths).items() if files[path] != tagged]
    if differ:
        raise CheckoutError(f"{source}: {', '.join(differ)} not as at {TAG}; check out {TAG} there")
    return files, f"from the work tree {source} (as at {TAG})"


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


def _extract(into: Path, tarball: Path, training: Path, added: dict[str, bytes]) -> None:
    with tarfile.open(tarball) as archive:
        archive.extractall(into, filter="data")
    with tarfile.open(training) as archive:
        archive.extractall(into, members=_training_members(archive), filter="data")
    for path, content in added.items():
        with open(into / path, "xb") as file:  # "x": a file of the extracts is never replaced
            file.write(content)
    edit_conftest(into)


def unpack(
    tarball: Path = TARBALL,
    workdir: Path = WORKDIR,
    training: Path = TRAINING_TARBALL,
    added: dict[str, bytes] | None = None,
) -> Path:
    """The suite's root (holding ``tests/unit_tests`` and ``megatron/training``), unpacked once per content;
    ``added``: Megatron-LM files the extracts lack (path -> content), added beside them, never replacing one."""
    added = added or {}
    stamp = _stamp(tarball) + _stamp(training) + _stamp(Path(__file__)) + _files_stamp(added)  # this file: how
    # One tree per content, never removed: when runs of other content (another harness version, files added or
    # not) shared one, a run removed the tree under the running ranks of the run beside it.
    root = workdir / f"suite-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}"
    if root.is_dir():
        return root
    workdir.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix="unpacking-", dir=workdir))
    try:
        _extract(fresh, tarball, training, added)
        with contextlib.suppress(OSError):  # a run beside this one unpacked the same content first
            fresh.rename(root)  # whole or not at all
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # gone once renamed
    return root
