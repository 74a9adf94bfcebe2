"""One place per decision: only megatron_npu/accelerator/ decides by a device or backend name.

An AST scan (comments and docstrings are not code, so they never count) of the package, the
patch set, pretrain_gpt.py and scripts/ for code that compares with a device or backend name
("npu", "cuda", "cpu", "hccl", "nccl", "gloo"): ``x == "cpu"``, ``x in ("npu", "cuda")``,
``s.startswith("cuda")``, ``case "npu":``. Everything else asks the accelerator a behaviour
question (``runs_on_host``, ``collective_backend_for`` ...). Patches may *name* the foreign
thing they replace in a ``FOREIGN_*`` constant and compare with that. The same check by grep:

    grep -rnE '"(npu|cuda|cpu|hccl|nccl|gloo)"' megatron_npu patches pretrain_gpt.py scripts \\
        --include=*.py | grep -v megatron_npu/accelerator/
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMES = {"npu", "cuda", "cpu", "hccl", "nccl", "gloo"}
SCANNED = ("megatron_npu", "pretrain_gpt.py", "scripts")
EXEMPT = ROOT / "megatron_npu" / "accelerator"


def _names_in(node: ast.AST) -> set[str]:
    """Device/backend names a node spells as a constant (or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value.lower()} & NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names_in(e) for e in node.elts)) if node.elts else set()
    return set()


def decisions(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, code) of each comparison with a device or backend name in ``source``."""
    tree = ast.parse(source, filename)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        spelled: set[str] = set()
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                spelled |= _names_in(operand)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith", "__eq__")
            and node.args
        ):
            spelled |= _names_in(node.args[0])
        elif isinstance(node, ast.match_case):
            spelled |= {
                v.value.value.lower()
                for v in ast.walk(node.pattern)
                if isinstance(v, ast.MatchValue)
                and isinstance(v.value, ast.Constant)
                and isinstance(v.value.value, str)
            } & NAMES
        if spelled:
            line = getattr(node, "lineno", None) or node.pattern.lineno  # type: ignore[attr-defined]
            found.append((line, source.splitlines()[line - 1].strip()))
    return found


def _sources() -> list[Path]:
    files: list[Path] = []
    for entry in SCANNED:
        path = ROOT / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return [f for f in files if EXEMPT not in f.parents]


def test_the_scan_finds_decisions_and_skips_names():
    code = '''
"""Docstring: "cpu" and "nccl" are words here."""
FOREIGN_BACKEND = "nccl"  # a name, not a decision
if device.type == "cpu": pass
if backend in ("gloo", "x"): pass
if spec.startswith("cuda"): pass
if backend == FOREIGN_BACKEND: pass
t = torch.device("cpu")
match target:
    case "npu": pass
'''
    assert [line for line, _ in decisions(code)] == [4, 5, 6, 10]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_device_name_decision_outside_the_accelerator(path):
    found = decisions(path.read_text(encoding="utf-8"), str(path))
    assert not found, "ask get_accelerator() a behaviour question instead:\n" + "\n".join(
        f"{path.relative_to(ROOT)}:{line}: {code}" for line, code in found
    )
