"""
svc-auth and svc-memory stand on the same kit (svcd.common: transactions,
admission, internal callers, settings, checks, the tap), not on each
other (issue 45): no module of svcd.memory imports svcd.auth, none of
svcd.auth imports svcd.memory, the kit imports neither, and svcctl
(svcd.ctl), which operates both daemons' tables, is the one package that
reaches both.

Checked twice: in the source, every import statement of every module,
those inside functions too (which an import at start would not run); and
in a fresh interpreter per package, since this test process has long
imported everything, what importing every module of the package loads,
through whatever path.

The tests' harness that runs both daemons in one process
(tests/authservice.py, tests/memoryservice.py) is not part of svcd.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SVCD = ROOT / "svcd"

DAEMONS = ("auth", "memory")
# Reaches both daemons' tables: svcctl.
BOTH = "ctl"
# Generated code.
_SKIPPED = {"pb"}


def packages() -> list[str]:
    """
    The parts of svcd, by name: each package, and each module beside them.
    """
    names = []
    for path in sorted(SVCD.iterdir()):
        if path.name in _SKIPPED or path.name.startswith(("_", ".")):
            continue
        if path.is_dir() and (path / "__init__.py").exists():
            names.append(path.name)
        elif path.suffix == ".py":
            names.append(path.stem)
    return names


def modulePaths(name: str) -> list[Path]:
    single = SVCD / f"{name}.py"
    if single.exists():
        return [single]
    return sorted(
        path
        for path in (SVCD / name).rglob("*.py")
        # Running it runs svcctl.
        if path.name != "__main__.py"
    )


def moduleName(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def daemonsNamed(module: str) -> set[str]:
    """
    The daemon packages an imported module name belongs to (C{svcd.auth},
    C{svcd.auth.store.ledger} are svc-auth's; C{svcd.authclient} is not).
    """
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "svcd" and parts[1] in DAEMONS:
        return {parts[1]}
    return set()


def importedInSource(path: Path) -> set[str]:
    """
    The daemon packages C{path}'s import statements name, wherever they
    stand in the module.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found |= daemonsNamed(node.module)
            # "from svcd import auth"
            if node.module == "svcd":
                for alias in node.names:
                    found |= daemonsNamed(f"svcd.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found |= daemonsNamed(alias.name)
    return found


_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted({name.split(".")[1] for name in sys.modules
    if name.split(".")[:1] == ["svcd"] and name.split(".")[1:2] in (["auth"], ["memory"])})))
"""


# Interpreters probing at once: each imports most of the product.
_AT_ONCE = 3


def _probe(name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _PROBE, *(moduleName(path) for path in modulePaths(name))],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """
    For each part of svcd, the daemon packages that importing every one
    of its modules loads, each part in a fresh interpreter.
    """
    waiting = packages()
    running: dict[str, subprocess.Popen[str]] = {}
    found: dict[str, set[str]] = {}
    while waiting or running:
        while waiting and len(running) < _AT_ONCE:
            name = waiting.pop(0)
            running[name] = _probe(name)
        name, process = next(iter(running.items()))
        out, err = process.communicate(timeout=120)
        del running[name]
        assert process.returncode == 0, f"importing svcd.{name}: {err}"
        found[name] = set(json.loads(out))
    return found


def test_everyPartIsProbed() -> None:
    """
    The parts found on disk include the daemons, the kit and svcctl, each
    with its modules (so that a new module is checked without editing
    this test).
    """
    names = packages()
    assert {"auth", "memory", "common", "ctl"} <= set(names)
    assert SVCD / "auth" / "store" / "ledger.py" in modulePaths("auth")
    assert SVCD / "common" / "pgtransactions.py" in modulePaths("common")
    assert SVCD / "ctl" / "memory.py" in modulePaths("ctl")


def test_noDaemonImportsTheOtherInItsSource() -> None:
    """
    No import statement of svcd.memory names svcd.auth, none of svcd.auth
    names svcd.memory, and none of svcd.common names either.
    """
    offenders = []
    for name, others in (("memory", {"auth"}), ("auth", {"memory"}), ("common", set(DAEMONS))):
        for path in modulePaths(name):
            wrong = importedInSource(path) & others
            if wrong:
                offenders.append(f"{path.relative_to(ROOT)} imports svcd.{', svcd.'.join(wrong)}")
    assert offenders == []


def test_onlySvcctlImportsBothInItsSource() -> None:
    """
    Of every part of svcd, only svcd.ctl's import statements name both
    daemons.
    """
    both = []
    for name in packages():
        named: set[str] = set()
        for path in modulePaths(name):
            named |= importedInSource(path)
        if named == set(DAEMONS):
            both.append(name)
    assert both == [BOTH]


def test_importingMemoryLoadsNothingOfAuth(loaded: dict[str, set[str]]) -> None:
    """
    A fresh interpreter that imports every module of svcd.memory has loaded
    no module of svcd.auth.
    """
    assert loaded["memory"] == {"memory"}


def test_importingAuthLoadsNothingOfMemory(loaded: dict[str, set[str]]) -> None:
    """
    A fresh interpreter that imports every module of svcd.auth has loaded
    no module of svcd.memory.
    """
    assert loaded["auth"] == {"auth"}


def test_theKitLoadsNeitherDaemon(loaded: dict[str, set[str]]) -> None:
    """
    Importing every module of svcd.common loads neither daemon's package.
    """
    assert loaded["common"] == set()


def test_onlySvcctlLoadsBoth(loaded: dict[str, set[str]]) -> None:
    """
    svcd.ctl loads both daemons' packages (their stores), and no other part
    of svcd does.
    """
    assert loaded[BOTH] == set(DAEMONS)
    assert sorted(name for name, found in loaded.items() if found == set(DAEMONS)) == [BOTH]
