"""Benchmarks and scripts run on demand, so no other test imports them: every name they import
from this project must exist (a refactor that moves or renames one breaks them silently otherwise).

An AST scan of ``benchmarks/*.py`` and ``scripts/*.py`` for ``from megatron_npu... import name``
and ``from pretrain_gpt import name`` (also inside functions, where the heavy imports live); each
module is imported here and each name looked up in it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])
OWN_MODULES = ("megatron_npu", "pretrain_gpt")


def project_imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) for each name ``path`` imports from this project."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OWN_MODULES:
            found.extend((node.module, alias.name, node.lineno) for alias in node.names)
    return found


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_an_entry_point_imports_from_the_project_exists(path: Path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    missing = []
    for module_name, name, line in project_imports(path):
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        if not hasattr(module, name) and importlib.util.find_spec(f"{module_name}.{name}") is None:
            missing.append(f"{path.name}:{line}: {module_name} has no {name}")
    assert not missing, "\n".join(missing)


def test_the_scan_finds_imports_inside_functions(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("def main():\n    from megatron_npu.training.loop import train\n")
    assert project_imports(script) == [("megatron_npu.training.loop", "train", 2)]
