"""The import graph of fsdptrace/ and cli/: which module imports which, and how.

The problem this solves: an import circle hides where code runs at import time only when it
is made at module level; circles made of imports inside functions or under ``TYPE_CHECKING``
import fine and still mean that no module of the circle can be read or tested alone. So every
arrow here carries its kind, and the circles are counted three times: module-level arrows only,
those plus function-level ones, and all three kinds.

An arrow goes to the module named: ``from fsdptrace.checks import order`` is an arrow to
``fsdptrace.checks.kernel.order`` (a submodule), ``from fsdptrace.checks import CHECKS`` one to
``fsdptrace.checks`` (the package's ``__init__``). The parent packages Python runs on the way
are not arrows: they would make every module of a package that re-exports its parts a circle.

Run it to print the figures: ``python tests/import_graph.py``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
# Each root folder and the top-level package it holds.
ROOTS = {REPO / "fsdptrace": "fsdptrace", REPO / "cli" / "fsdptrace_cli": "fsdptrace_cli"}

MODULE = "module-level"
FUNCTION = "function-level"
TYPE_ONLY = "type-only"
KINDS = (MODULE, FUNCTION, TYPE_ONLY)


class Arrow(NamedTuple):
    """One import statement's target, with the line that makes it."""

    source: str
    target: str
    kind: str
    line: int


def module_files() -> dict[str, Path]:
    """Every module of the package and the CLI, by dotted name."""
    modules = {}
    for root, package in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, kind: str = MODULE
             ) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under ``tree`` with its kind (inside a function: function-level,
    even under ``TYPE_CHECKING``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, kind
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _imports(node, FUNCTION)
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and kind == MODULE:
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), TYPE_ONLY)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), kind)
        else:
            yield from _imports(node, kind)


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement names."""
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ours (``a.b.c`` may be attribute c of a.b)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imported_names(modules: dict[str, Path] | None = None) -> list[Arrow]:
    """Every name each module imports, absolute (``pandas``, ``fsdptrace.checks.CHECKS``)."""
    modules = module_files() if modules is None else modules
    found = []
    for source, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, kind in _imports(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = _base(source, path.name == "__init__.py", node)
                names = [f"{base}.{alias.name}" for alias in node.names]
            found += [Arrow(source, name, kind, node.lineno) for name in names]
    return found


def arrows(modules: dict[str, Path] | None = None) -> list[Arrow]:
    """Every import from one of our modules to another, one per statement and name."""
    modules = module_files() if modules is None else modules
    found = []
    for arrow in imported_names(modules):
        target = _owner(arrow.target, modules)
        if target is not None and target != arrow.source:
            found.append(arrow._replace(target=target))
    return found


def edges(found: list[Arrow], kinds: tuple[str, ...]) -> set[tuple[str, str]]:
    """The (importer, imported) pairs made by imports of the given kinds."""
    return {(a.source, a.target) for a in found if a.kind in kinds}


def circles(pairs: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, list[str]] = {}
    for source, target in sorted(pairs):
        graph.setdefault(source, []).append(target)
        graph.setdefault(target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
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

    for node in graph:
        if node not in index:
            visit(node)
    return found


def figures() -> str:
    """Arrows by kind and the circles of each cumulative graph, as a few lines of text."""
    found = arrows()
    lines = [f"{len(module_files())} modules"]
    for kind in KINDS:
        statements = sum(a.kind == kind for a in found)
        lines.append(f"{kind}: {len(edges(found, (kind,)))} arrows ({statements} imported names)")
    lines.append(f"all kinds: {len(edges(found, KINDS))} arrows")
    for counted in (KINDS[:1], KINDS[:2], KINDS):
        found_circles = circles(edges(found, counted))
        sizes = ", ".join(str(len(c)) for c in found_circles) or "none"
        lines.append(f"circles counting {' + '.join(counted)}: {len(found_circles)} "
                     f"(modules: {sizes})")
    return "\n".join(lines)


if __name__ == "__main__":
    print(figures())
    for circle in circles(edges(arrows(), KINDS)):
        print("circle:", " ".join(circle))
