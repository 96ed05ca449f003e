"""
The packages a provider call is made of are layered, never a ring: the
providers' client (svcd.providers), the limits (svcd.limits) and the
ledger (svcd.ledger) import the values they share from the floor below
them (svcd.metering), which imports none of them, and none of the four
imports the metered call above them (svcd.metered), which joins the three.

The graph is drawn from the modules' own import statements (every one,
at any depth: a function's import or one under TYPE_CHECKING binds the
packages as surely as a module's), read with ast in a fresh interpreter
that imports none of them; a second fresh interpreter imports the floor
for real, since this test process has long imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The packages of the graph: the three and their floor.
LAYERED = ("providers", "limits", "ledger", "metering")
FLOOR = "metering"
ABOVE = "metered"

# Prints, as JSON, each package of svcd that each of the named packages
# imports (itself left out), with the module and line of each import.
_GRAPH = """
import ast, json, pathlib, sys

root = pathlib.Path("svcd")


def packageOf(name):
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "svcd" else None


edges = {}
for package in sys.argv[1:]:
    found = edges.setdefault(package, {})
    for path in sorted((root / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    raise SystemExit(f"{path}:{node.lineno}: a relative import")
                module = node.module or ""
                names = (
                    ["svcd." + alias.name for alias in node.names]
                    if module == "svcd"
                    else [module]
                )
            else:
                continue
            for name in names:
                other = packageOf(name)
                if other is not None and other != package:
                    found.setdefault(other, []).append(f"{path}:{node.lineno}")
print(json.dumps(edges))
"""

# Imports every module of the floor and prints which modules of the
# packages above it were loaded.
_FLOOR_ALONE = """
import importlib, json, pathlib, sys

for path in sorted(pathlib.Path("svcd/metering").glob("*.py")):
    name = ".".join(path.with_suffix("").parts).removesuffix(".__init__")
    importlib.import_module(name)
above = [
    name
    for name in sys.modules
    if name.split(".")[:2] in (["svcd", package] for package in sys.argv[1:])
]
print(json.dumps(sorted(above)))
"""


def _run(probe: str, *arguments: str) -> object:
    result = subprocess.run(
        [sys.executable, "-c", probe, *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(result.stdout)


def _importGraph() -> dict[str, dict[str, list[str]]]:
    graph = _run(_GRAPH, *LAYERED)
    assert isinstance(graph, dict)
    return graph


def test_noRingAmongProvidersLimitsLedgerAndTheirFloor() -> None:
    """
    Among svcd.providers, svcd.limits, svcd.ledger and svcd.metering, the
    packages' imports (every statement of every module) form no cycle.
    """
    graph = _importGraph()
    layered = {
        package: {other for other in imported if other in LAYERED}
        for package, imported in graph.items()
    }
    try:
        order = list(TopologicalSorter(layered).static_order())
    except CycleError as cycle:
        raise AssertionError(f"an import cycle: {cycle.args[1]}") from None
    assert order[0] == FLOOR


def test_theFloorImportsNoneOfTheThree() -> None:
    """
    The floor is below all three: no statement of svcd.metering imports
    svcd.providers, svcd.limits, svcd.ledger or svcd.metered.
    """
    graph = _importGraph()
    assert {
        other: where for other, where in graph[FLOOR].items() if other in (*LAYERED, ABOVE)
    } == {}


def test_noneOfTheFourImportsTheMeteredCall() -> None:
    """
    The metered call is above the packages it joins: none of the four
    imports svcd.metered, at any depth.
    """
    graph = _importGraph()
    assert {package: imported.get(ABOVE, []) for package, imported in graph.items()} == {
        package: [] for package in LAYERED
    }


def test_aProbeFindsAnImportInAFunction(tmp_path: Path) -> None:
    """
    The graph's probe sees an import made inside a function, as well as
    one at the top of a module: both name the package imported.
    """
    package = tmp_path / "svcd" / "probe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from svcd.metering.usage import Usage\n\n\ndef late():\n    import svcd.ledger.rows\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", _GRAPH, "probe"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(result.stdout) == {
        "probe": {
            "metering": [str(Path("svcd/probe/a.py")) + ":1"],
            "ledger": [str(Path("svcd/probe/a.py")) + ":5"],
        }
    }


def test_importingTheFloorLoadsNothingAboveIt() -> None:
    """
    In a fresh interpreter, importing every module of svcd.metering loads
    no module of svcd.providers, svcd.limits, svcd.ledger or
    svcd.metered.
    """
    assert _run(_FLOOR_ALONE, "providers", "limits", "ledger", ABOVE) == []
