"""
svc-proxy's modules import one another without a circle (issue 45): no
two modules of svcd.proxy import each other through any path, so that
each can be read, and tested, knowing only what it imports.

Every import counts: at module level, inside a function, or under
C{if TYPE_CHECKING:}. An import only a type checker runs still ties the
two modules together for whoever reads them, and such a guard is how a
circle hides. A module counts as importing what it names (C{from a.b
import c} imports C{a.b.c} when that is a module, else C{a.b}), not the
parent packages Python runs on the way.

Read from the files with C{ast}: nothing is imported here.
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# An import of a module of the package: the module imported, and the line
# of the import.
Graph = dict[str, dict[str, int]]


def moduleFiles(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """
    Every module of C{package} under C{root}, by name: its file and
    whether it is a package's C{__init__}.
    """
    modules = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        isPackage = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if isPackage else parts)
        modules[name] = (path, isPackage)
    return modules


def importGraph(root: Path, package: str) -> Graph:
    """
    Which modules of C{package} each of its modules imports, with the
    line of the first such import.
    """
    modules = moduleFiles(root, package)

    def known(name: str) -> str | None:
        # The module C{name} is, or the nearest one it is inside of.
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: Graph = {}
    for name, (path, isPackage) in modules.items():
        imported: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if isPackage else name.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join([*here, *([base] if base else [])])
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                module = known(target)
                if module is not None and module != name:
                    imported.setdefault(module, node.lineno)
        graph[name] = imported
    return graph


def findCycle(graph: Graph) -> list[str] | None:
    """
    One circle of C{graph} as the modules along it, the first one again at
    the end; None when there is none. Depth first, in name order, so the
    same code always reports the same circle.
    """
    done: set[str] = set()
    path: list[str] = []
    onPath: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        onPath.add(module)
        for imported in sorted(graph.get(module, {})):
            if imported in onPath:
                return [*path[path.index(imported) :], imported]
            if imported not in done:
                cycle = visit(imported)
                if cycle is not None:
                    return cycle
        path.pop()
        onPath.discard(module)
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle is not None:
                return cycle
    return None


def describe(graph: Graph, cycle: list[str]) -> str:
    """
    A circle as the failure says it: each module and the line where it
    imports the next.
    """
    steps = [f"{module} (line {graph[module][following]})" for module, following in pairwise(cycle)]
    return " -> ".join([*steps, cycle[-1]])


def test_proxyImportsNoCircle() -> None:
    """
    No module of svcd.proxy imports itself through others.
    """
    graph = importGraph(ROOT, "svcd.proxy")
    assert {"svcd.proxy.http.edge", "svcd.proxy.recall", "svcd.proxy.observe"} <= set(graph)
    # The graph is read at all: the edge imports its route families.
    assert "svcd.proxy.http.routes.chat" in graph["svcd.proxy.http.edge"]
    cycle = findCycle(graph)
    if cycle is not None:
        pytest.fail("svcd.proxy imports in a circle: " + describe(graph, cycle))


def test_aCircleIsFoundAndNamed(tmp_path: Path) -> None:
    """
    A circle made of every kind of import (a relative one, one inside a
    function, one under TYPE_CHECKING) is found and named with its lines;
    a package without one has none.
    """
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("import os\n\n\ndef f():\n    from pkg.sub.c import x\n")
    (package / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import y\nx = 1\n"
    )
    (package / "leaf.py").write_text("import pkg.sub.c\n")
    graph = importGraph(tmp_path, "pkg")
    assert graph == {
        "pkg": {},
        "pkg.a": {"pkg.sub.b": 1},
        "pkg.leaf": {"pkg.sub.c": 1},
        "pkg.sub": {},
        "pkg.sub.b": {"pkg.sub.c": 5},
        "pkg.sub.c": {"pkg.a": 3},
    }
    cycle = findCycle(graph)
    assert cycle == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    assert describe(graph, cycle) == (
        "pkg.a (line 1) -> pkg.sub.b (line 5) -> pkg.sub.c (line 3) -> pkg.a"
    )
    (package / "sub" / "c.py").write_text("x = 1\n")
    assert findCycle(importGraph(tmp_path, "pkg")) is None
