"""
svcd/common/grpcthreads.py against a real grpcio server: answers on the
reactor thread, no thread started per call, the number of threads as the
bound on calls in flight, deadlines that count the wait for a thread, and
cancellation (a waiting call never sent, a sent one dropped at once).

The server's handlers block on events the tests set, never on sleeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import attrs
import grpc
import pytest
import pytest_twisted
from twisted.internet.defer import CancelledError, Deferred, gatherResults
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import deferLater

from svcd.common.grpcthreads import CallNotSent, ThreadedUnaryCalls

# A bound on every wait of these tests: far past what a loaded machine
# needs, far below a hung test.
PATIENCE = 10.0


@attrs.define
class EchoServer:
    """
    A grpcio server whose C{Echo} answers its request at once and whose
    C{Held} answers only when C{release} is set; it counts the calls it
    received and the most it held at once.
    """

    address: str
    release: threading.Event
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    received: list[bytes] = attrs.field(factory=list)
    holding: int = 0
    mostHeld: int = 0

    def echo(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.lock:
            self.received.append(request)
        return request

    def held(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.lock:
            self.received.append(request)
            self.holding += 1
            self.mostHeld = max(self.mostHeld, self.holding)
        try:
            self.release.wait(PATIENCE)
        finally:
            with self.lock:
                self.holding -= 1
        return request


@pytest.fixture
def server() -> Iterator[EchoServer]:
    made = EchoServer("", threading.Event())
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(made.echo),
        "Held": grpc.unary_unary_rpc_method_handler(made.held),
    }
    running = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    running.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    made.address = f"127.0.0.1:{running.add_insecure_port('127.0.0.1:0')}"
    running.start()
    try:
        yield made
    finally:
        made.release.set()
        running.stop(0).wait(PATIENCE)


@pytest.fixture
def channel(server: EchoServer) -> Iterator[Any]:
    made = grpc.insecure_channel(server.address)
    grpc.channel_ready_future(made).result(timeout=PATIENCE)
    try:
        yield made
    finally:
        made.close()


def reactorFromThreads() -> IReactorFromThreads:
    from twisted.internet import reactor

    return IReactorFromThreads(reactor)


async def waitUntil(condition: Any, what: str) -> None:
    """
    Let the reactor run until C{condition()} holds, within L{PATIENCE}.
    """
    from twisted.internet import reactor

    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, what
        await deferLater(reactor, 0.01, lambda: None)


@pytest_twisted.ensureDeferred
async def test_answersOnTheReactorThreadWithoutAThreadPerCall(
    channel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    Each answer fires its Deferred on the reactor thread; fifty calls one
    after the other start no thread but the caller's two (grpcio's future
    API would start one for nearly every such call).
    """
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    calls = ThreadedUnaryCalls(reactorFromThreads(), 2, "test-calls")
    echo = channel.unary_unary("/t.T/Echo")
    try:
        firedOn: list[threading.Thread] = []

        def fired(value: bytes) -> bytes:
            firedOn.append(threading.current_thread())
            return value

        for index in range(50):
            answer = await calls.call(echo, b"%d" % index, PATIENCE).addCallback(fired)
            assert answer == b"%d" % index
        assert firedOn == [threading.main_thread()] * 50
    finally:
        calls.stop()
    ours = [name for name in started if not name.startswith("ThreadPoolExecutor")]
    assert ours == ["test-calls-0", "test-calls-1"]


@pytest_twisted.ensureDeferred
async def test_theThreadsBoundTheCallsInFlight(server: EchoServer, channel: Any) -> None:
    """
    Six calls on two threads: the server holds two at a time, never more,
    and all six are answered once it lets them go.
    """
    calls = ThreadedUnaryCalls(reactorFromThreads(), 2, "test-calls")
    held = channel.unary_unary("/t.T/Held")
    try:
        answers = [calls.call(held, b"%d" % index, PATIENCE) for index in range(6)]
        await waitUntil(lambda: server.holding == 2, "two calls held")
        assert len(server.received) == 2
        server.release.set()
        assert sorted(await gatherResults(answers)) == [b"%d" % index for index in range(6)]
        assert server.mostHeld == 2
    finally:
        calls.stop()


@pytest_twisted.ensureDeferred
async def test_theDeadlineCountsTheWaitForAThread(server: EchoServer, channel: Any) -> None:
    """
    A call's deadline runs from when it is made: one sent goes to grpcio
    with what is left of it (DEADLINE_EXCEEDED on time); one whose deadline
    passed while it waited for a thread is never sent.
    """
    calls = ThreadedUnaryCalls(reactorFromThreads(), 1, "test-calls")
    held = channel.unary_unary("/t.T/Held")
    try:
        began = time.monotonic()
        first = calls.call(held, b"first", 0.5)
        waiting = calls.call(held, b"waiting", 0.2)
        with pytest.raises(grpc.RpcError) as raised:
            await first
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.45 < time.monotonic() - began < PATIENCE
        with pytest.raises(CallNotSent):
            await waiting
        assert server.received == [b"first"]
    finally:
        calls.stop()


@pytest_twisted.ensureDeferred
async def test_cancelling(server: EchoServer, channel: Any) -> None:
    """
    Cancelling fails the Deferred at once: a call still waiting for a
    thread is never sent; one in flight is dropped (its answer, when it
    comes, fires nothing) and the thread goes on to the next call.
    """
    calls = ThreadedUnaryCalls(reactorFromThreads(), 1, "test-calls")
    held = channel.unary_unary("/t.T/Held")
    echo = channel.unary_unary("/t.T/Echo")
    try:
        inFlight = calls.call(held, b"in flight", PATIENCE)
        waiting = calls.call(echo, b"waiting", PATIENCE)
        after = calls.call(echo, b"after", PATIENCE)
        await waitUntil(lambda: server.holding == 1, "the first call held")
        for cancelled in (waiting, inFlight):
            cancelled.cancel()
            with pytest.raises(CancelledError):
                await cancelled
        server.release.set()
        assert await after == b"after"
        assert server.received == [b"in flight", b"after"]
    finally:
        calls.stop()


@pytest_twisted.ensureDeferred
async def test_stopped(server: EchoServer, channel: Any) -> None:
    """
    Once stopped: a call waiting for a thread is never sent, nor any made
    after; the call in flight still ends with its answer.
    """
    calls = ThreadedUnaryCalls(reactorFromThreads(), 1, "test-calls")
    held = channel.unary_unary("/t.T/Held")
    inFlight = calls.call(held, b"in flight", PATIENCE)
    waiting = calls.call(held, b"waiting", PATIENCE)
    await waitUntil(lambda: server.holding == 1, "the first call held")
    calls.stop()
    later = calls.call(held, b"later", PATIENCE)
    server.release.set()
    assert await inFlight == b"in flight"
    for never in (waiting, later):
        with pytest.raises(CallNotSent):
            await never
    assert server.received == [b"in flight"]


def test_atLeastOneThread() -> None:
    with pytest.raises(ValueError):
        ThreadedUnaryCalls(reactorFromThreads(), 0, "none")


def test_nothingFiresTwice() -> None:
    """
    A thread's outcome for a Deferred already failed by its cancellation
    is dropped on the reactor thread.
    """
    from svcd.common.grpcthreads import _deliver

    cancelled: Deferred[Any] = Deferred()
    cancelled.cancel()
    _deliver(cancelled, (True, b"late"))
    failures: list[Any] = []
    cancelled.addErrback(failures.append)
    assert failures and failures[0].check(CancelledError)
