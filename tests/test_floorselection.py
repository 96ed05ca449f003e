"""
dev/floor's selection (tests/floorselection.py): what it leaves out of the
run on the oldest Twisted, and that each reason holds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import floorselection
import pytest

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("module", sorted(floorselection.TWISTED_FREE))
def test_whatATwistedFreeModuleRunsImportsNoTwisted(module: str) -> None:
    """
    Each module left out as testing a program that imports no Twisted
    runs only code that, imported in a new interpreter, imports no Twisted.
    """
    names = floorselection.TWISTED_FREE[module]
    probe = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'twisted'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, *names],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.strip() == "[]", (module, result.stdout)


@pytest.mark.parametrize("module", sorted(floorselection.TWISTED_FREE))
def test_aTwistedFreeModuleNamesEverySvcdModuleItImports(module: str) -> None:
    """
    Every module of svcd a module left out as testing a program that
    imports no Twisted imports (function bodies included) is among those
    the check above imports: one reaching Twisted cannot come in unnamed.
    """
    imported = {
        name
        for name in floorselection._imports(TESTS.parent / module)
        if name.split(".")[0] == "svcd" and floorselection._source(name) is not None
    }
    assert imported <= set(floorselection.TWISTED_FREE[module]), (
        module,
        sorted(imported - set(floorselection.TWISTED_FREE[module])),
    )


def test_reachingTwisted() -> None:
    """
    A module whose helpers import Twisted reaches it; one of pure parsing
    does not; one that imports by a computed name may, and counts as
    reaching it.
    """
    assert floorselection.reachesTwisted(TESTS / "test_auth_grpc.py")
    assert not floorselection.reachesTwisted(TESTS / "test_dialects_requests.py")
    assert floorselection.reachesTwisted(TESTS / "test_packages_standalone.py")


@pytest.mark.parametrize(
    "module, e2e, reason",
    [
        ("test_gateway_e2e.py", True, "drives a gateway from outside"),
        ("test_security_mtls.py", True, "drives a gateway from outside"),
        ("test_worker_e2e.py", True, "drives a gateway from outside"),
        ("test_worker_dedupe.py", True, "drives a gateway from outside"),
        ("test_svcctl.py", False, "tests a program that imports no Twisted"),
        ("test_auth_store.py", False, "tests a program that imports no Twisted"),
        ("test_hostile_parsers.py", False, "tests a program that imports no Twisted"),
        ("test_dialects_requests.py", False, "reaches no Twisted"),
        # Daemons under twistd, and Twisted in the test process: run.
        ("test_worker_daemon.py", True, None),
        ("test_auth_daemon.py", True, None),
        ("test_observability_shutdown.py", True, None),
        ("test_metered_embedder.py", True, None),
        ("test_auth_grpc.py", False, None),
    ],
)
def test_leftOut(module: str, e2e: bool, reason: str | None) -> None:
    assert floorselection.leftOut(TESTS / module, e2e) == reason


def test_aModuleStartingDaemonsIsRunWhateverItImports() -> None:
    """
    A module of pure parsing, were it marked e2e (it would start twistd or
    the upstream), is run.
    """
    assert floorselection.leftOut(TESTS / "test_dialects_requests.py", True) is None
