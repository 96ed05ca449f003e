"""
Process lifecycle helpers shared by both daemons.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from twisted.internet.testing import MemoryReactor

from svcd.common.lifecycle import GC_THRESHOLD, settleHeap, settleHeapWhenRunning


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
