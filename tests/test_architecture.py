"""
The shape of the house (issue 45), read from the source with C{ast}: every
import counts, at module level or in a function, under C{TYPE_CHECKING} or
not, since each is a dependency a reader has to follow.

  - No module of C{svcd/} over 800 lines (the generated C{svcd/pb} aside):
    a file a reader can hold.
  - The four daemons' packages (svcd.auth, svcd.memory, svcd.proxy,
    svcd.worker) import nothing of one another: they share code only
    through the ground (svcd.common) and the shared packages.
  - The shared packages import no daemon's package. svcctl (svcd.ctl)
    operates both daemons' tables, and svcd.devkit scripts the daemons'
    counterparts (its model server knows svc-worker's extraction prompt):
    those two may import daemons, and nothing of the product imports
    svcd.devkit.
  - The packages of C{svcd} import one another without a ring: a package
    graph with no cycle, so that each package can be read, and tested,
    from the floor up.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SVCD = ROOT / "svcd"
MAX_LINES = 800
DAEMONS = frozenset({"auth", "memory", "proxy", "worker"})
# Above the daemons: the operator's tool and the first run's kit.
ABOVE = frozenset({"ctl", "devkit"})


def _sources() -> Iterator[Path]:
    for path in sorted(SVCD.rglob("*.py")):
        if "pb" not in path.relative_to(SVCD).parts[:1]:
            yield path


def _moduleName(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imported(path: Path) -> Iterator[str]:
    """
    The absolute names of every module C{path} imports, relative imports
    resolved.
    """
    module = _moduleName(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base)
                name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                name = node.module or ""
            yield name
            for alias in node.names:
                yield f"{name}.{alias.name}"


def _package(module: str) -> str | None:
    """
    The package of C{svcd} that C{module} is part of (C{svcd/devstack.py}
    and other top-level modules count as packages of their own).
    """
    parts = module.split(".")
    if parts[0] != "svcd" or len(parts) < 2:
        return None
    return parts[1]


def _packageGraph() -> dict[str, set[str]]:
    existing = {_package(_moduleName(path)) for path in _sources()} - {None}
    graph: dict[str, set[str]] = {}
    for path in _sources():
        source = _package(_moduleName(path))
        if source is None:  # svcd/__init__.py
            continue
        edges = graph.setdefault(source, set())
        for name in _imported(path):
            target = _package(name)
            if target is not None and target != source and target in existing:
                edges.add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """
    One cycle of C{graph}, as the list of its nodes, or C{None}.
    """
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return [*visiting[visiting.index(node) :], node]
        if node in done:
            return None
        visiting.append(node)
        for target in sorted(graph.get(node, ())):
            found = visit(target)
            if found:
                return found
        visiting.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node)
        if found:
            return found
    return None


def test_noModuleIsLong() -> None:
    """
    Every module of C{svcd/} (generated code aside) has at most 800 lines.
    """
    long = {
        str(path.relative_to(ROOT)): lines
        for path in _sources()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_daemonsImportNoOtherDaemon() -> None:
    """
    No daemon's package imports another's.
    """
    graph = _packageGraph()
    assert DAEMONS <= set(graph)
    crossings = {
        (daemon, target) for daemon in DAEMONS for target in graph[daemon] if target in DAEMONS
    }
    assert crossings == set()


def test_sharedPackagesImportNoDaemon() -> None:
    """
    The ground and the shared packages import no daemon's package.
    """
    graph = _packageGraph()
    crossings = {
        (package, target)
        for package, targets in graph.items()
        if package not in DAEMONS and package not in ABOVE
        for target in targets
        if target in DAEMONS
    }
    assert crossings == set()


def test_nothingOfTheProductImportsTheDevkit() -> None:
    """
    svcd.devkit (what tests, benchmarks and dev/gateway run) is imported by
    no other package of C{svcd}.
    """
    graph = _packageGraph()
    assert "devkit" in graph
    assert {package for package, targets in graph.items() if "devkit" in targets} == set()


def test_packagesFormNoRing() -> None:
    """
    The package graph of C{svcd} has no cycle.
    """
    assert _cycle(_packageGraph()) is None


def test_aRingIsFound() -> None:
    """
    The cycle finder finds a ring, and none in a chain.
    """
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
