"""Every shell block of README.md and docs/*.md runs as pasted.

A fenced ``bash`` block runs whole, with ``bash -e -o pipefail``, in a scratch directory that holds a link to
each top-level entry of this checkout (so ``scripts/...`` and ``tests/fixtures/...`` resolve and what a
block writes stays out of the tree). A block whose first line is ``# needs: WHAT`` needs what it names (an
Atlas node, a cluster, a Megatron-LM checkout, a downloaded model, hours): it is parsed (``bash -n``), the
``megatron-npu`` commands and the repository files it names must exist, and the two-node launcher is run
with ``--dry-run``. The README's first two blocks are the set-up commands: the second is what ``.ci/run``
runs (this test runs inside it), the first installs and starts the demo, whose quick-start twin
(``megatron-npu demo --iters 4``) is the one demo run here.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = "# needs:"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\s*$")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    text: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def needs(self) -> str | None:
        first = self.text.splitlines()[0].strip()
        return first[len(NEEDS) :].strip() if first.startswith(NEEDS) else None


def shell_blocks(page: Path) -> list[Block]:
    """The fenced shell blocks of one page, dedented as a list item's block is pasted."""
    blocks, lines, opened = [], page.read_text(encoding="utf-8").splitlines(), None
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if not fence:
            continue
        if opened is None:
            opened = (number, len(fence["indent"]), fence["lang"])
            continue
        start, indent, lang = opened
        opened = None
        if lang in SHELL_LANGS:
            body = [text[indent:] if text[:indent].strip() == "" else text for text in lines[start : number - 1]]
            blocks.append(Block(page, start, "\n".join(body) + "\n"))
    assert opened is None, f"{page}: a fence opened at line {opened[0]} is never closed"
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in shell_blocks(page)]
SETUP = ALL_BLOCKS[:2]  # README's install + demo, and the CI command
RUNNABLE = [block for block in ALL_BLOCKS[2:] if block.needs is None]
NEEDING = [block for block in ALL_BLOCKS[2:] if block.needs is not None]


def scratch_checkout(tmp_path: Path) -> Path:
    """A directory whose top-level entries link to this checkout's: blocks read the tree, write here."""
    work = tmp_path / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "megatron-npu-demo"):
            (work / entry.name).symlink_to(entry)
    return work


def run_block(text: str, cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MEGATRON_NPU_DEVICE="cpu", PYTHONWARNINGS="ignore")
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", *extra, "-c", text],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def commands(text: str) -> list[list[str]]:
    """Each command line of a block as words (continuations joined, comments dropped, `&&` splits)."""
    joined = text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1 :]
    return [words for words in out if words]


@pytest.mark.launch  # awk, as .ci/run runs it
def test_pages_have_shell_blocks_and_the_readme_opens_with_the_two_setup_commands():
    readme = shell_blocks(ROOT / "README.md")
    assert readme[0].text == "pip install torch==2.13.0 -e . && megatron-npu demo\n"
    assert readme[1].text == "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q tests\n"
    # .ci/run takes the first line of the README's second bash block: the same command
    ci = (ROOT / ".ci" / "run").read_text()
    awk = re.search(r"awk '([^']+)' README.md", ci)
    assert awk, ".ci/run no longer extracts the README's test command with awk"
    extracted = subprocess.run(["awk", awk[1], "README.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert extracted.stdout == readme[1].text
    assert len(RUNNABLE) >= 6 and len(NEEDING) >= 4, (len(RUNNABLE), len(NEEDING))


def test_setup_commands_name_what_is_installed():
    """The set-up blocks install this checkout with torch 2.13.0, then run a command this package provides."""
    import torch

    from megatron_npu import cli

    assert torch.__version__.split("+")[0] == "2.13.0"
    assert Path(cli.__file__).resolve().parent.parent == ROOT  # pip install -e . of this checkout
    for block in SETUP:
        pip, tool = commands(block.text)
        assert pip[:3] == ["pip", "install", "torch==2.13.0"] and pip[-2:] == ["-e", pip[-1]], pip
        assert tool[:2] in (["megatron-npu", "demo"], ["python", "-m"]), tool
    assert commands(SETUP[1].text)[1] == ["python", "-m", "pytest", "-q", "tests"]


def test_the_demo_quick_start_scales_the_first_command():
    """The README's first command runs the demo; its quick-start twin, run below, differs only in scale."""
    quick = [block for block in RUNNABLE if "megatron-npu demo" in block.text]
    assert len(quick) == 1 and quick[0].page.name == "README.md"
    words = commands(quick[0].text)[0]
    assert words[:2] == ["megatron-npu", "demo"] and set(words[2::2]) <= {"--iters", "--output-dir"}


@pytest.mark.launch
@pytest.mark.parametrize("block", RUNNABLE, ids=[block.name for block in RUNNABLE])
def test_block_runs_as_pasted(block: Block, tmp_path: Path):
    result = run_block(block.text, scratch_checkout(tmp_path))
    assert result.returncode == 0, f"{block.name} failed ({result.returncode}):\n{block.text}\n{result.stderr[-3000:]}"
    if "megatron-npu demo" in block.text:
        assert re.search(r"^loss \d+\.\d+ -> \d+\.\d+ over \d+ iterations", result.stdout, re.M), result.stdout[-2000:]


@pytest.mark.launch
@pytest.mark.parametrize("block", NEEDING, ids=[block.name for block in NEEDING])
def test_block_that_needs_a_cluster_parses_and_dry_runs(block: Block, tmp_path: Path):
    assert block.needs, f"{block.name}: '# needs:' must say what the block needs"
    parsed = run_block(block.text, ROOT, "-n")
    assert parsed.returncode == 0, f"{block.name} does not parse:\n{parsed.stderr}"
    from megatron_npu.cli import SUBCOMMANDS

    work = scratch_checkout(tmp_path)
    for words in commands(block.text):
        words = [word for word in words if "=" not in word or word.startswith("-")]  # drop VAR=value prefixes
        if words[0] == "megatron-npu":
            assert words[1] in SUBCOMMANDS, f"{block.name}: no command megatron-npu {words[1]}"
        for word in words:
            if re.match(r"^(scripts|tests|megatron_npu)/\S+\.(py|sh)$", word) or word == "pretrain_gpt.py":
                assert (ROOT / word).is_file(), f"{block.name}: {word} is not in the checkout"
        if words[:2] == ["bash", "scripts/pretrain_gpt_8x2.sh"]:
            # the runnable blocks check the rank map already: the dry run here only shows the command is whole
            dry = run_block("RANK_MAP_CHECK=0 " + shlex.join([*words, "--dry-run"]), work)
            assert dry.returncode == 0, f"{block.name}: {shlex.join(words)} --dry-run failed:\n{dry.stderr}"
        if words[:2] == ["python", "-m"]:
            module = subprocess.run(
                [sys.executable, "-c", f"import importlib.util as u; assert u.find_spec({words[2]!r})"], cwd=ROOT
            )
            assert module.returncode == 0, f"{block.name}: no module {words[2]}"
