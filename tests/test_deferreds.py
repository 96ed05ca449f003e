"""
svcd.common.deferreds.timeoutDeferred: a budget that holds even when the
work ignores cancellation, and that does not call late a result that
arrived in time while the reactor was busy.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import pytest_twisted
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from svcd.common.deferreds import timeoutDeferred


def test_timesOutAfterTheBudget() -> None:
    """
    The result fails with TimeoutError once the budget has passed, and the
    work is cancelled. (task.Clock runs the extra zero-delay pass within the
    same advance; the real-reactor test below shows what it is for.)
    """
    clock = Clock()
    cancelled: list[object] = []
    work: Deferred[str] = Deferred(cancelled.append)
    result = timeoutDeferred(work, 0.1, clock)
    failures: list[Failure] = []
    result.addErrback(failures.append)
    clock.advance(0.099)
    assert not failures
    clock.advance(0.001)
    assert len(failures) == 1 and failures[0].check(TimeoutError)
    assert cancelled
    assert not clock.getDelayedCalls()


def test_resultBeforeTheBudget() -> None:
    clock = Clock()
    work: Deferred[str] = Deferred()
    result = timeoutDeferred(work, 0.1, clock)
    clock.advance(0.05)
    work.callback("reply")
    assert result.result == "reply"
    assert not clock.getDelayedCalls()


class _Notify(Protocol):
    def dataReceived(self, data: bytes) -> None:
        self.factory.received(self, data)


@pytest.fixture
def twoClients() -> Iterator[tuple[socket.socket, socket.socket, dict[str, object]]]:
    """
    A listening port on the real reactor and two connected plain sockets;
    the dict maps "handlers" to what runs when data arrives.
    """
    from twisted.internet import reactor

    state: dict[str, object] = {"connections": []}

    class _Factory(Factory):
        protocol = _Notify

        def received(self, protocol: Protocol, data: bytes) -> None:
            handler = state.get("handler")
            if callable(handler):
                handler(protocol, data)

    # Twisted's stubs want a ServerFactory of their own protocol type; any
    # IProtocolFactory does.
    port = reactor.listenTCP(0, _Factory(), interface="127.0.0.1")  # type: ignore[arg-type]
    address = port.getHost()
    assert isinstance(address, IPv4Address)
    first = socket.create_connection((address.host, address.port))
    second = socket.create_connection((address.host, address.port))
    try:
        yield first, second, state
    finally:
        first.close()
        second.close()
        port.stopListening()


@pytest_twisted.ensureDeferred
async def test_replyWaitingAfterABusyStretchIsInTime(
    twoClients: tuple[socket.socket, socket.socket, dict[str, object]],
) -> None:
    """
    With a real reactor: while the reactor is busy in another connection's
    handler past the budget, the awaited reply arrives on its socket. Twisted
    runs due timers before it reads sockets, so a plain timer would call it
    late; timeoutDeferred reads it first.
    """
    from twisted.internet import reactor

    trigger, replier, state = twoClients
    work: Deferred[bytes] = Deferred()

    def handler(protocol: Protocol, data: bytes) -> None:
        if data == b"busy":
            # The reply arrives now, while this handler keeps the reactor
            # busy past the 50 ms budget.
            replier.sendall(b"reply")
            time.sleep(0.15)
        elif not work.called:
            work.callback(data)

    state["handler"] = handler
    result = timeoutDeferred(work, 0.05, reactor)
    trigger.sendall(b"busy")
    assert await result == b"reply"
