"""
How svc-proxy stops and starts (issue 25), in one process over real
loopback sockets, and with a fake clock for the start:

  - on stop it listens no more, each answer from then on says
    C{Connection: close} and its connection closes after it; an idle
    keep-alive connection closes once its client has been quiet, never
    under a request that is arriving; what is left at the shutdown timeout
    is closed and logged; the auth client and the limiter close only after
    the last connection;
  - on start it listens only once its dependencies are ready, or after
    the start timeout, saying what it still waited for.
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

import attrs
import pytest
import pytest_twisted
from proxydoubles import FakeAuthClient, MemoryCounters, listeningProxy
from twisted.internet.defer import Deferred, fail
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock, deferLater
from twisted.logger import ILogObserver, LogEvent, formatEvent, globalLogPublisher
from twisted.python.failure import Failure

from svcd.common.errors import ApiError, ErrorCode
from svcd.limits.limiter import RedisRateLimiter
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http import site as sitemodule
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.site import ProxySite, _unreadBytes
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.records import TokenInfo
from svcd.proxy.service import Dependency, ProxyService

QUIET = 0.3


@pytest.fixture(autouse=True)
def shortQuiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A short quiet period, so that the tests of idle connections are quick.
    """
    monkeypatch.setattr(sitemodule, "DRAIN_QUIET_SECONDS", QUIET)


@pytest.fixture
def logged() -> Iterator[list[str]]:
    messages: list[str] = []

    def observe(event: LogEvent) -> None:
        text = formatEvent(event)
        if text:
            messages.append(text)

    globalLogPublisher.addObserver(cast(ILogObserver, observe))
    try:
        yield messages
    finally:
        globalLogPublisher.removeObserver(cast(ILogObserver, observe))


class Client(Protocol):
    """
    A keep-alive HTTP/1.1 client that sends what it is told and keeps what
    the server writes.
    """

    def __init__(self) -> None:
        self.received = b""
        self.closed: Deferred[None] = Deferred()
        self.closedAt: float | None = None

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        self.closedAt = time.monotonic()
        self.closed.callback(None)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def responses(self) -> list[tuple[int, dict[str, str]]]:
        """
        The complete responses so far, each framed by its Content-Length.
        """
        found = []
        rest = self.received
        while b"\r\n\r\n" in rest:
            head, _, rest = rest.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            if len(rest) < length:
                break
            rest = rest[length:]
            found.append((int(lines[0].split()[1]), headers))
        return found


async def eventually(condition: Callable[[], bool], limit: float = 30.0) -> None:
    """
    Wait for C{condition}, failing after C{limit} seconds.
    """
    from twisted.internet import reactor

    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < limit, "condition not met in time"
        await deferLater(reactor, 0.01, lambda: None)


class ClosableAuth(FakeAuthClient):
    """
    Fails closed once closed, as the gRPC client does: a request answered
    200 was validated before the auth client closed.
    """

    def validateToken(self, accessToken: str) -> Deferred[TokenInfo]:
        if self.closed:
            return fail(ApiError(ErrorCode.SERVICE_DEGRADED))
        return super().validateToken(accessToken)


class Running:
    def __init__(self, service: ProxyService, port: int, auth: FakeAuthClient) -> None:
        self.service = service
        self.port = port
        self.auth = auth
        self.token, self.orgID, self.agentID = auth.addTenant()

    async def connect(self) -> Client:
        from twisted.internet import reactor

        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        client = await endpoint.connect(Factory.forProtocol(Client))
        assert isinstance(client, Client)
        return client

    def probe(self, token: str | None = None) -> bytes:
        """
        A keep-alive request of the auth-probe, which needs the auth client
        and the limiter.
        """
        return (
            "GET /v1/internal/auth-probe HTTP/1.1\r\nHost: proxy.test\r\n"
            f"Authorization: Bearer {token or self.token}\r\n"
            f"X-SVC-Agent-ID: {self.agentID}\r\n\r\n"
        ).encode("ascii")

    async def answered(self, client: Client, count: int) -> tuple[int, dict[str, str]]:
        await eventually(lambda: len(client.responses()) >= count)
        return client.responses()[count - 1]


async def startRunning(shutdownTimeout: float = 5.0) -> tuple[Running, MemoryCounters]:
    from twisted.internet import reactor

    auth = ClosableAuth()
    counters = MemoryCounters()
    service, port = await listeningProxy(
        reactor, auth, counters, 1000, shutdownTimeout=shutdownTimeout
    )
    return Running(service, port, auth), counters


@pytest_twisted.async_yield_fixture
async def running() -> AsyncIterator[Running]:
    harness, _ = await startRunning()
    try:
        yield harness
    finally:
        if harness.service.running:
            await harness.service.stopService()


def refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


@pytest_twisted.ensureDeferred
async def test_nextRequestAnsweredWithConnectionClose(running: Running) -> None:
    """
    A keep-alive connection whose client sends its next request after the
    stop began gets it answered (by a proxy whose auth client is still
    open), with Connection: close, and the connection closes after it;
    only then do the auth client and the limiter close.
    """
    client = await running.connect()
    client.send(running.probe())
    status, headers = await running.answered(client, 1)
    assert status == 200 and "connection" not in headers

    stopped = running.service.stopService()
    await eventually(lambda: refused(running.port))
    client.send(running.probe())
    status, headers = await running.answered(client, 2)
    assert status == 200
    assert headers["connection"] == "close"
    await client.closed
    await stopped
    assert running.auth.closed


@pytest_twisted.ensureDeferred
async def test_answerInFlightSaysConnectionClose(running: Running) -> None:
    """
    A request being answered when the stop begins gets its answer with
    Connection: close, and its connection closes after it.
    """
    token = running.auth.addTenant()[0]
    held: Deferred[TokenInfo] = Deferred()
    info = running.auth.tokens[token]
    running.auth.tokens[token] = held
    client = await running.connect()
    client.send(running.probe(token))
    await eventually(lambda: ("ValidateToken", token) in running.auth.calls)

    stopped = running.service.stopService()
    assert not stopped.called
    assert isinstance(info, TokenInfo)
    held.callback(attrs.evolve(info, orgID=running.orgID))
    status, headers = await running.answered(client, 1)
    assert status == 200
    assert headers["connection"] == "close"
    await client.closed
    await stopped
    assert running.auth.closed


@pytest_twisted.ensureDeferred
async def test_idleConnectionClosedOnceQuiet(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    A keep-alive connection that has just been answered is left open for
    its client's next request for the quiet period, then closed; the stop
    completes once it is.
    """
    monkeypatch.setattr(sitemodule, "DRAIN_QUIET_SECONDS", 1.0)
    client = await running.connect()
    client.send(running.probe())
    await running.answered(client, 1)
    stopped = running.service.stopService()
    stopAt = time.monotonic()
    await client.closed
    assert client.closedAt is not None
    assert client.closedAt - stopAt >= 0.5
    await stopped
    assert running.auth.closed
    assert len(client.responses()) == 1


@pytest_twisted.ensureDeferred
async def test_longIdleConnectionClosedAtOnce(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    A connection that has already been quiet for longer than the quiet
    period is closed as soon as the stop begins.
    """
    from twisted.internet import reactor

    monkeypatch.setattr(sitemodule, "DRAIN_QUIET_SECONDS", 2.0)
    client = await running.connect()
    client.send(running.probe())
    await running.answered(client, 1)
    await deferLater(reactor, 2.2, lambda: None)
    stopAt = time.monotonic()
    await running.service.stopService()
    await client.closed
    assert client.closedAt is not None
    # Not the quiet period (2 s) from the stop: at once.
    assert client.closedAt - stopAt < 1.5


@pytest_twisted.ensureDeferred
async def test_requestArrivingIsNotCut(running: Running) -> None:
    """
    Part of a request received before the stop holds its connection open
    past the quiet period; once the rest arrives it is answered, with
    Connection: close.
    """
    from twisted.internet import reactor

    client = await running.connect()
    request = running.probe()
    client.send(request[:20])
    await deferLater(reactor, 0.05, lambda: None)
    stopped = running.service.stopService()
    await deferLater(reactor, QUIET * 2, lambda: None)
    assert not client.closed.called
    client.send(request[20:])
    status, headers = await running.answered(client, 1)
    assert (status, headers["connection"]) == (200, "close")
    await client.closed
    await stopped


@pytest_twisted.ensureDeferred
async def test_whatIsLeftAtTheTimeoutIsClosed(logged: list[str]) -> None:
    """
    A request still unanswered at the shutdown timeout has its connection
    closed, and the stop says so; the auth client closes after.
    """
    running, counters = await startRunning(shutdownTimeout=0.3)
    token = running.auth.addTenant()[0]
    running.auth.tokens[token] = Deferred()
    client = await running.connect()
    client.send(running.probe(token))
    await eventually(lambda: ("ValidateToken", token) in running.auth.calls)
    stopAt = time.monotonic()
    await running.service.stopService()
    await client.closed
    assert client.closedAt is not None and client.closedAt - stopAt >= 0.25
    assert client.responses() == []
    assert running.auth.closed and counters.stopped
    assert (
        "Requests still in flight after 0.3 s; closing anyway (1 connection(s) closed,"
        " 1 of them answering)"
    ) in logged


def test_unreadBytes() -> None:
    """
    The peek at a socket sees bytes the reactor has not read, leaves them
    there, and sees none at the end of the stream.
    """

    @attrs.frozen
    class Transport:
        handle: socket.socket

        def getHandle(self) -> socket.socket:
            return self.handle

    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        assert not _unreadBytes(Transport(ours))
        theirs.sendall(b"GET")
        deadline = time.monotonic() + 5
        while not _unreadBytes(Transport(ours)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ours.recv(10) == b"GET"
        theirs.shutdown(socket.SHUT_WR)
        assert not _unreadBytes(Transport(ours))
    assert not _unreadBytes(object())


# The start.


@attrs.define
class FakePort:
    bound: bool = False
    closed: bool = False
    listened: list[float] = attrs.field(factory=list)

    def bind(self) -> None:
        self.bound = True

    def listen(self, protocolFactory: Any, waited: float) -> Any:
        self.listened.append(waited)
        return FakeListening()

    def close(self) -> None:
        self.closed = True


class FakeListening:
    def stopListening(self) -> None:
        pass


@attrs.define
class Starting:
    service: ProxyService
    port: FakePort
    clock: Clock
    auth: FakeAuthClient
    ready: dict[str, bool]


def starting(names: tuple[str, ...], startTimeout: float = 5.0) -> Starting:
    clock = Clock()
    auth = FakeAuthClient()
    limiter = RedisRateLimiter(MemoryCounters(), clock, 60)
    config = ProxyConfig(authGrpcAddr="auth.test:9091")
    edge = ProxyEdge(config, auth, limiter, ProxyMetrics(), clock)
    ready = dict.fromkeys(names, False)
    port = FakePort()
    service = ProxyService(
        port,
        edge,
        ProxySite(edge.resource(), 1000, clock),
        auth,
        limiter,
        clock,
        shutdownTimeout=1.0,
        startTimeout=startTimeout,
        dependencies=[
            Dependency(name, functools.partial(ready.__getitem__, name)) for name in names
        ],
    )
    return Starting(service, port, clock, auth, ready)


def test_listensOnceReady(logged: list[str]) -> None:
    """
    The port is bound at start, and listens once every dependency is
    ready; the start log says how long it waited.
    """
    start = starting(("svc-auth", "Redis"))
    start.service.privilegedStartService()
    assert start.port.bound
    start.service.startService()
    assert start.auth.started
    start.clock.advance(0.5)
    start.ready["svc-auth"] = True
    start.clock.advance(0.5)
    assert start.port.listened == []
    start.ready["Redis"] = True
    start.clock.advance(0.02)
    assert start.port.listened == [pytest.approx(1.02)]
    listening = start.service.whenListening()
    assert listening.called
    assert not [line for line in logged if "still waits" in line]


def test_listensAnywayAfterTheStartTimeout(logged: list[str]) -> None:
    """
    A dependency still not ready after the start timeout does not keep the
    proxy from listening; what it waited for is logged once.
    """
    start = starting(("svc-auth", "Redis"), startTimeout=2.0)
    start.service.startService()
    start.ready["svc-auth"] = True
    for _ in range(150):
        start.clock.advance(0.02)
    assert start.port.listened == [pytest.approx(2.0)]
    waited = [line for line in logged if "still waits" in line]
    assert waited == [
        "svc-proxy still waits for Redis after 2.0 s; listening anyway: auth fails closed"
        " (503) until svc-auth answers, rate limits fail open until Redis does"
    ]


def test_stopWhileStarting() -> None:
    """
    A stop before the dependencies are ready ends the wait: the proxy never
    listens, gives its bound port back and closes its clients.
    """
    start = starting(("svc-auth",))
    start.service.startService()
    start.clock.advance(0.1)
    stopped = start.service.stopService()
    start.clock.advance(0.1)
    assert stopped.called
    start.ready["svc-auth"] = True
    start.clock.advance(1.0)
    assert start.port.listened == []
    assert start.port.closed
    assert start.auth.closed


def test_noDependencies() -> None:
    """
    With nothing to wait for, the proxy listens at once.
    """
    start = starting(())
    start.service.startService()
    assert start.port.listened == [0.0]
