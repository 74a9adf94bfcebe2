"""The tree is ruff clean and ruff formatted (config in pyproject.toml), so no file carries
per-line formatter exemptions."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUFF = shutil.which("ruff")

pytestmark = pytest.mark.skipif(RUFF is None, reason="ruff is in the [test] extra; install it to check style")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RUFF, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.launch
def test_ruff_check_is_clean():
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.launch
def test_ruff_format_leaves_every_file_unchanged():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout + result.stderr


def test_no_file_opts_out_of_the_formatter():
    marker = "fmt: " + "skip"
    offenders = [
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if ".git" not in path.parts and marker in path.read_text(encoding="utf-8")
    ]
    assert offenders == []
