"""
Tests for L{svcd.common.stackedpool}: the gRPC servers' thread pool hands
each item to the most recently idle thread, starts threads only when all
are busy, queues past its bound, and reports results and failures
through its futures as C{concurrent.futures} does.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from svcd.common.stackedpool import StackedThreadPool

WAIT = 10.0


def _waitFor(condition: object, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def _idleCount(pool: StackedThreadPool) -> int:
    with pool._lock:
        return len(pool._idle)


def test_resultAndException() -> None:
    pool = StackedThreadPool(2, "test")
    try:
        assert pool.submit(lambda a, b=0: a + b, 1, b=2).result(WAIT) == 3
        failed = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result(WAIT)
        # The thread that raised serves the next item.
        assert pool.submit(lambda: "again").result(WAIT) == "again"
    finally:
        pool.shutdown()


def test_oneAtATimeRunsOnOneThread() -> None:
    """
    Items submitted one after another, each once the last has finished and
    its thread is idle again, all run on the same thread: the one that
    finished last, whose caches are warm.
    """
    pool = StackedThreadPool(8, "test")
    try:
        names = []
        for _ in range(20):
            names.append(pool.submit(lambda: threading.current_thread().name).result(WAIT))
            _waitFor(lambda: _idleCount(pool) == 1)
        assert set(names) == {"test_0"}
        assert len(pool._threads) == 1
    finally:
        pool.shutdown()


def test_mostRecentlyIdleFirst() -> None:
    """
    With three idle threads, the next item goes to the one that became
    idle last, whichever that is.
    """
    pool = StackedThreadPool(3, "test")
    try:
        gates = [threading.Event() for _ in range(3)]
        running = [pool.submit(lambda gate=gate: gate.wait(WAIT)) for gate in gates]
        _waitFor(lambda: len(pool._threads) == 3)
        # Finished in the order 1, 0, 2 (thread names follow the starts).
        for count, index in enumerate((1, 0, 2), start=1):
            gates[index].set()
            running[index].result(WAIT)
            _waitFor(lambda count=count: _idleCount(pool) == count)
        ran = pool.submit(lambda: threading.current_thread().name).result(WAIT)
        assert ran == "test_2"
        _waitFor(lambda: _idleCount(pool) == 3)
        gates = [threading.Event() for _ in range(2)]
        first = pool.submit(lambda: (gates[0].wait(WAIT), threading.current_thread().name)[1])
        second = pool.submit(lambda: (gates[1].wait(WAIT), threading.current_thread().name)[1])
        for gate in gates:
            gate.set()
        # Then the one idle before it, and so on down the stack.
        assert (first.result(WAIT), second.result(WAIT)) == ("test_2", "test_0")
    finally:
        pool.shutdown()


def test_boundedAndQueuedInOrder() -> None:
    """
    At most C{maxWorkers} threads; past them, items wait and run in the
    order submitted.
    """
    pool = StackedThreadPool(2, "test")
    try:
        gate = threading.Event()
        blockers = [pool.submit(gate.wait, WAIT) for _ in range(2)]
        order: list[int] = []
        queued = [pool.submit(order.append, number) for number in range(5)]
        assert len(pool._threads) == 2
        assert not any(future.done() for future in queued)
        gate.set()
        for future in blockers + queued:
            future.result(WAIT)
        assert order == [0, 1, 2, 3, 4]
        assert len(pool._threads) == 2
    finally:
        pool.shutdown()


def test_cancelledBeforeRunningIsSkipped() -> None:
    pool = StackedThreadPool(1, "test")
    try:
        gate = threading.Event()
        blocker = pool.submit(gate.wait, WAIT)
        ran: list[int] = []
        queued = pool.submit(ran.append, 1)
        assert queued.cancel()
        gate.set()
        blocker.result(WAIT)
        assert pool.submit(lambda: None).result(WAIT) is None
        assert ran == []
    finally:
        pool.shutdown()


def test_shutdown() -> None:
    """
    Shut down: idle threads end, queued items still run (unless
    cancel_futures), and nothing new is taken.
    """
    pool = StackedThreadPool(1, "test")
    gate = threading.Event()
    blocker = pool.submit(gate.wait, WAIT)
    queued = pool.submit(lambda: "queued")
    threading.Timer(0.05, gate.set).start()
    pool.shutdown(wait=True)
    assert blocker.result(0) is True
    assert queued.result(0) == "queued"
    assert not any(thread.is_alive() for thread in pool._threads)
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)

    cancelling = StackedThreadPool(1, "test")
    gate = threading.Event()
    blocker = cancelling.submit(gate.wait, WAIT)
    dropped = cancelling.submit(lambda: "dropped")
    threading.Timer(0.05, gate.set).start()
    cancelling.shutdown(wait=True, cancel_futures=True)
    assert dropped.cancelled()
    assert not any(thread.is_alive() for thread in cancelling._threads)


def test_idleShutdownWithoutWait() -> None:
    pool = StackedThreadPool(4, "test")
    for _ in range(3):
        pool.submit(lambda: None).result(WAIT)
    pool.shutdown(wait=False)
    for thread in pool._threads:
        thread.join(WAIT)
        assert not thread.is_alive()


def test_atLeastOneWorker() -> None:
    with pytest.raises(ValueError):
        StackedThreadPool(0, "test")


def test_noReferenceKeptToAnItem() -> None:
    """
    Once an item has run, the pool holds nothing of it: grpcio's call
    object (and with it the call's HTTP/2 stream, counted against the
    connection's limit) must be freed when its handler returns, on the
    thread the item started as on one that was idle.
    """
    pool = StackedThreadPool(2, "test")
    try:

        class Argument:
            pass

        for _ in range(3):
            argument = Argument()
            reference = weakref.ref(argument)
            pool.submit(lambda argument: None, argument).result(WAIT)
            del argument
            _waitFor(lambda: _idleCount(pool) >= 1)
            gc.collect()
            assert reference() is None
    finally:
        pool.shutdown()


def test_threadThatCannotStart(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    When no thread can be started, submit raises (as ThreadPoolExecutor
    does) and the pool's count of threads is as before: a later submit
    starts one.
    """
    pool = StackedThreadPool(2, "test")
    try:
        started = threading.Thread.start

        def refuse(self: threading.Thread) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError):
            pool.submit(lambda: None)
        assert pool._threads == []
        monkeypatch.setattr(threading.Thread, "start", started)
        assert pool.submit(lambda: "ran").result(WAIT) == "ran"
        assert len(pool._threads) == 1
    finally:
        pool.shutdown()
