"""The package's import graph, read from the source (ast, nothing imported): no circle anywhere in
megatron_npu, and the layout library imports nothing above itself.

Every import counts, module level or inside a function: a deferred import is still a dependency
(issue 34 found the circle memory -> planner -> plan_cli -> search -> plan_cli through two of them).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_npu"
# what megatron_npu/layout/ may import from the rest of the package: the target's hardware facts
# (a torch-free table); not the trainer, the converter, a command, or the package's top
LAYOUT_MAY_IMPORT = ("megatron_npu.layout", "megatron_npu.accelerator.facts")


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file (a package by its ``__init__.py``)."""
    out = {}
    for f in package.rglob("*.py"):
        parts = list(f.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name lives in (``a.b.func`` -> ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.AST, package: str) -> list[str]:
    """Absolute dotted names one import statement names (``from x import y`` names ``x.y``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: up from this module's package
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names] or [base]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from pkg import mod`` -> mod, ``from mod import f`` -> mod)."""
    modules = module_files(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for dotted in _imported(node, here):
                if dotted.split(".")[0] == package.name:
                    targets.add(_owner(dotted, modules))
        graph[name] = targets - {name, None}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward(graph: dict[str, set[str]], library: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """The library's modules that import something outside ``allowed``."""
    inside = [m for m in graph if m == library or m.startswith(library + ".")]
    bad = {m: sorted(t for t in graph[m] if not any(t == a or t.startswith(a + ".") for a in allowed)) for m in inside}
    return {m: targets for m, targets in bad.items() if targets}


def test_no_import_circle_in_the_package():
    assert cycles(import_graph()) == []


def test_layout_is_a_library():
    assert upward(import_graph(), "megatron_npu.layout", LAYOUT_MAY_IMPORT) == {}


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path):
    """The reader itself: a circle through a deferred import, and layout/ importing a command."""
    pkg = tmp_path / "megatron_npu"
    (pkg / "layout").mkdir(parents=True)
    (pkg / "plan").mkdir()
    for f in ("__init__.py", "layout/__init__.py", "plan/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "layout" / "a.py").write_text("from megatron_npu.layout import b\n")
    (pkg / "layout" / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "layout" / "c.py").write_text("def g():\n    from megatron_npu.plan.cli import main\n")
    (pkg / "plan" / "cli.py").write_text("from megatron_npu.layout.c import g\n")
    graph = import_graph(pkg)
    assert graph["megatron_npu.layout.b"] == {"megatron_npu.layout.a"}
    assert sorted(cycles(graph)) == [
        ["megatron_npu.layout.a", "megatron_npu.layout.b"],
        ["megatron_npu.layout.c", "megatron_npu.plan.cli"],
    ]
    assert upward(graph, "megatron_npu.layout", LAYOUT_MAY_IMPORT) == {
        "megatron_npu.layout.c": ["megatron_npu.plan.cli"]
    }
