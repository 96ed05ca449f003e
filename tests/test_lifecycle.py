"""
Process lifecycle helpers shared by both daemons.
"""

from __future__ import annotations

import gc
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from twisted.internet.testing import MemoryReactor

from svcd.common.lifecycle import (
    GC_THRESHOLD,
    notifySystemd,
    settleHeap,
    settleHeapWhenRunning,
    stopWithFailure,
)


@pytest.fixture
def restoredCollector() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_settleHeapFreezesStartupObjects(restoredCollector: None) -> None:
    """
    Everything alive when the daemon has started moves to the permanent
    generation, which the cycle collector no longer walks, and the
    collector's thresholds are L{GC_THRESHOLD}.
    """
    gc.unfreeze()
    survivor = [object() for _ in range(100)]
    settleHeap()
    assert gc.get_freeze_count() >= len(survivor)
    assert gc.get_threshold() == GC_THRESHOLD
    # Objects made afterwards are still collected as usual.
    assert len(gc.get_objects(generation=2)) < gc.get_freeze_count()


def test_settleHeapWhenRunning(restoredCollector: None) -> None:
    """
    The heap is settled once the reactor runs, not before.
    """
    reactor = MemoryReactor()
    settleHeapWhenRunning(reactor)
    assert [call[0] for call in reactor.whenRunningHooks] == [settleHeap]


def test_notifySystemd(tmp_path: Path) -> None:
    """
    sd_notify(3): the state goes as one datagram to NOTIFY_SOCKET, a path
    or an abstract name (@...); without the variable, or with a socket
    nobody listens on, nothing happens and nothing raises.
    """
    path = tmp_path / "notify"
    abstract = f"@svc-test-{uuid.uuid4().hex}"
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listening,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listeningAbstract,
    ):
        listening.bind(str(path))
        listeningAbstract.bind("\0" + abstract[1:])
        assert notifySystemd("READY=1", {"NOTIFY_SOCKET": str(path)})
        assert listening.recv(100) == b"READY=1"
        assert notifySystemd("READY=1", {"NOTIFY_SOCKET": abstract})
        assert listeningAbstract.recv(100) == b"READY=1"
    assert not notifySystemd("READY=1", {})
    assert not notifySystemd("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody")})


def test_stopWithFailureBeforeTheReactorRuns(capsys: pytest.CaptureFixture[str]) -> None:
    """
    A failure found while twistd starts the services (before the reactor
    runs) stops the reactor once it runs, instead of calling reactor.stop()
    at once (which raises ReactorNotRunning there); the exit with status 1
    follows the shutdown either way.
    """
    reactor = MemoryReactor()
    # Twisted 25.5's MemoryReactor starts with hasStopped set.
    reactor.hasStopped = False
    stopWithFailure(reactor, "svc-x: cannot start: the reason")
    assert not reactor.hasStopped
    assert reactor.whenRunningHooks == [(reactor.stop, (), {})]
    [(exit, args, _)] = reactor.triggers["after"]["shutdown"]
    assert args == (1,) and getattr(exit, "__name__", "") == "_exit"


def test_stopWithFailureWhileRunning() -> None:
    """
    Once the reactor runs, the stop is immediate.
    """
    reactor = MemoryReactor()
    reactor.running, reactor.hasStopped = True, False
    stopWithFailure(reactor, "svc-x: cannot go on")
    assert reactor.hasStopped
    assert reactor.whenRunningHooks == []
