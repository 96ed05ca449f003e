"""
The test suite's own layout: what a newcomer relies on when finding their
way in it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import cast

import conftest
import e2eguard
import pytest
import xdistprivate

import svcd.devkit.daemons
from svcd.devkit.daemons import Daemon
from svcd.devkit.upstream.client import ScriptedUpstream

_TESTS = Path(__file__).resolve().parent


def test_noTestModuleImportsAnother() -> None:
    """
    Shared harness lives in the fixtures and helper modules
    (gatewayfixtures.py, ledgerfixtures.py, authhelpers.py ...), never in a
    test module that others import: a module imported as a library drags
    its tests' module-level setup along, and under the name C{tests.test_x}
    it is even imported twice.
    """
    offenders: list[str] = []
    for path in sorted(_TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.removeprefix("tests.").startswith("test_"):
                    offenders.append(f"{path.name}:{node.lineno} imports {name}")
    assert offenders == []


# The e2e marker's check (e2eguard.py).


def test_anUnmarkedTestThatStartsADaemonFails(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """
    A test not marked e2e that starts a twistd (here, through
    L{Daemon.start}) fails before anything starts, naming itself and the
    fix.
    """
    daemon = Daemon("svc-proxy", {"SVC_PORT": "1"}, tmp_path / "proxy.log")
    with pytest.raises(e2eguard.NotMarkedE2E) as raised:
        daemon.start()
    assert daemon.process is None
    message = str(raised.value)
    assert "\n" not in message
    assert request.node.nodeid in message
    assert "svc-proxy" in message and "pytest.mark.e2e" in message
    with pytest.raises(e2eguard.NotMarkedE2E, match="twistdCommand"):
        svcd.devkit.daemons.twistdCommand("svc-auth")
    with pytest.raises(e2eguard.NotMarkedE2E, match="scripted upstream"):
        ScriptedUpstream(tmp_path / "upstream").start()


@pytest.mark.e2e
def test_aMarkedTestMayStartOne() -> None:
    """
    A test marked e2e passes the check (nothing is started here).
    """
    e2eguard.check("a real svc-proxy")
    assert "twistd" in " ".join(svcd.devkit.daemons.twistdCommand("svc-proxy"))


# The fence around pytest-xdist's private names (xdistprivate.py).


def test_installedXdistHasEveryName() -> None:
    """
    The pytest-xdist and pytest this suite runs with have every private
    name conftest.py relies on.
    """
    assert xdistprivate.missingNames() == []


def _fakeModule(name: str, **attributes: object) -> ModuleType:
    module = ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def test_aModuleLackingANameIsNamed() -> None:
    """
    Each private name missing from a stand-in for xdist's or pytest's
    modules is listed, by where conftest.py reaches it.
    """

    class Scheduling:
        def __init__(self) -> None:
            self.workqueue: dict[str, object] = {}

        def _assign_work_unit(self) -> None:
            pass

        def mark_test_complete(self) -> None:
            pass

        def remove_node(self) -> None:
            pass

    class Controller:
        def shutdown(self) -> None:
            pass

    class Info:
        pass

    missing = xdistprivate.missingNames(
        scheduler=_fakeModule("scheduler", LoadGroupScheduling=Scheduling),
        workermanage=_fakeModule("workermanage", WorkerController=Controller),
        remote=_fakeModule("remote"),
        newhooks=_fakeModule("newhooks", pytest_xdist_make_scheduler=None),
        fixtures=_fakeModule("fixtures", FuncFixtureInfo=Info),
        function=Controller,
    )
    assert missing == [
        "LoadGroupScheduling._pending_of",
        "LoadGroupScheduling.assigned_work",
        "WorkerController.shutting_down",
        "xdist.remote's config.option.loadgroup",
        "xdist.newhooks.pytest_configure_node",
        "xdist.newhooks.pytest_xdist_auto_num_workers",
        "_pytest.fixtures.FuncFixtureInfo.name2fixturedefs",
        "pytest.Function._fixtureinfo",
    ]


def test_aMissingNameStopsTheRunWithOneLine(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    conftest.py's pytest_configure stops the run, before anything is
    scheduled, with one line naming what is missing, the fence and the
    tested versions.
    """
    monkeypatch.setattr(xdistprivate, "missingNames", lambda: ["LoadGroupScheduling._pending_of"])
    config = SimpleNamespace(option=SimpleNamespace(dist="load"))
    with pytest.raises(pytest.UsageError) as raised:
        conftest.pytest_configure(cast(pytest.Config, config))
    message = str(raised.value)
    assert "\n" not in message
    assert "LoadGroupScheduling._pending_of" in message
    assert "tests/xdistprivate.py" in message
    assert xdistprivate.TESTED in message
    assert config.option.dist == "load"


def test_withoutWorkersNothingIsChecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A run without workers (C{-n 0}, C{-p no:xdist}) schedules nothing, so
    a pytest-xdist that lacks a name does not stop it (as the line advises).
    """
    monkeypatch.setattr(xdistprivate, "missingNames", lambda: ["LoadGroupScheduling._pending_of"])
    config = SimpleNamespace(
        option=SimpleNamespace(dist="no"), addinivalue_line=lambda name, line: None
    )
    conftest.pytest_configure(cast(pytest.Config, config))
