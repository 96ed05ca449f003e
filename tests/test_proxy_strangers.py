"""
What a stranger's connection may cost svc-proxy (decisions D10), over real
loopback sockets with the real edge and site (in-memory auth and
counters):

  - a request without an Authorization of the token's shape is answered
    401 as soon as its headers are read, its body never held (413 and 415
    still first), and what the client still sends is drained;
  - the bytes of request bodies held across connections are capped, past
    which a request with a body gets 503 SERVICE_DEGRADED unread;
  - requests the HTTP parser refuses get 414, 431 or 400, counted by
    reason and logged at most once a minute per reason;
  - every status line carries its standard reason phrase.

The same against the real daemon, with a thousand strangers and the
proxy's RSS, is in test_gateway_strangers.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import pytest_twisted
from prometheus_client import CollectorRegistry, Counter
from proxydoubles import FakeAuthClient, MemoryCounters, listeningProxy
from rawhttp import CHAT, Harness, RawClient, head, sleep
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import ITCPTransport
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogEvent, globalLogPublisher

from svcd.proxy.http.site import (
    LINGER_SECONDS,
    REFUSAL_STATUS,
    ProtocolErrors,
    ProxySite,
    reasonPhrase,
)
from svcd.proxy.records import TokenInfo

LIMIT = 64 * 1024
CAP = 100 * 1024


class StrangerHarness(Harness):
    @property
    def site(self) -> ProxySite:
        site: ProxySite = self.service.site
        return site

    def protocolErrors(self, reason: str) -> float:
        registry = self.service._edge._metrics.registry
        value = registry.get_sample_value("svc_proxy_protocol_errors_total", {"reason": reason})
        return float(value or 0.0)


async def eventually(condition: Callable[[], bool], limit: float = 5.0) -> None:
    """
    Wait for C{condition}, failing after C{limit} seconds.
    """
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < limit, "condition not met in time"
        await sleep(0.01)


async def answerArrived(client: RawClient) -> None:
    """
    Wait for the head of an answer on C{client}.
    """
    await eventually(lambda: b"\r\n\r\n" in client.received)


@pytest_twisted.async_yield_fixture
async def proxy() -> AsyncIterator[StrangerHarness]:
    from twisted.internet import reactor

    auth = FakeAuthClient()
    service, port = await listeningProxy(
        reactor, auth, MemoryCounters(), LIMIT, maxBufferedBodyBytes=CAP
    )
    try:
        yield StrangerHarness(service, port, auth)
    finally:
        await service.stopService()


def strangerHead(length: int | None, authorization: str | None, **extra: str) -> bytes:
    headers = {"Content-Type": "application/json", **extra}
    if authorization is not None:
        headers["Authorization"] = authorization
    if length is not None:
        headers["Content-Length"] = str(length)
    return head("POST", "/v1/chat/completions", headers)


def onlyAnswer(client: RawClient) -> tuple[int, dict[str, str], Any]:
    [(status, headers, body)] = client.responses()
    return status, headers, json.loads(body)


# Strangers' bodies


@pytest_twisted.ensureDeferred
async def test_strangerIsAnsweredBeforeItsBody(proxy: StrangerHarness) -> None:
    """
    Without a bearer of the token's shape, the 401 comes as soon as the
    headers are read (nothing of the body sent yet, nothing held); the
    client then sends its whole body, reads the whole answer (no reset),
    and the connection is closed.
    """
    for authorization, code in (
        (None, "MISSING_TOKEN"),
        ("Bearer not-a-token", "INVALID_TOKEN"),
        ("Basic dXNlcjpwYXNz", "INVALID_TOKEN"),
    ):
        client = await proxy.connect()
        assert client.transport is not None
        client.transport.write(strangerHead(LIMIT - 1, authorization))
        await answerArrived(client)
        assert proxy.site.bufferedBodyBytes == 0
        sent = 0
        while sent < LIMIT - 1 and not client.closed.called:
            piece = min(16384, LIMIT - 1 - sent)
            client.transport.write(b"x" * piece)
            sent += piece
            await sleep(0.001)
        await client.closed
        status, headers, document = onlyAnswer(client)
        assert status == 401 and document["error"]["code"] == code
        assert headers["connection"] == "close"
        assert document["error"]["request_id"] == headers["x-request-id"]
    assert proxy.auth.calls == []
    assert proxy.site.bufferedBodyBytes == 0


@pytest_twisted.ensureDeferred
async def test_strangerStillGets413And415First(proxy: StrangerHarness) -> None:
    """
    The spec's order holds without a token: a declared length over the
    limit is 413, a wrong Content-Type 415, both before the body.
    """
    for headers, status, code in (
        (strangerHead(LIMIT + 1, None), 413, "PAYLOAD_TOO_LARGE"),
        (strangerHead(100, None, **{"Content-Type": "text/plain"}), 415, "UNSUPPORTED_MEDIA_TYPE"),
    ):
        client = await proxy.connect()
        assert client.transport is not None
        client.transport.write(headers)
        await answerArrived(client)
        client.transport.loseConnection()
        await client.closed
        answered, _, document = onlyAnswer(client)
        assert (answered, document["error"]["code"]) == (status, code)
    assert proxy.site.bufferedBodyBytes == 0


@pytest_twisted.ensureDeferred
async def test_strangerWithExpectContinueIsNeverAskedForItsBody(proxy: StrangerHarness) -> None:
    """
    With C{Expect: 100-continue}, a stranger gets its 401 and no 100
    Continue: the body is never asked for.
    """
    client = await proxy.connect()
    assert client.transport is not None
    client.transport.write(strangerHead(LIMIT - 1, None, Expect="100-continue"))
    await eventually(lambda: b"\r\n\r\n" in client.received)
    assert client.received.startswith(b"HTTP/1.1 401 Unauthorized\r\n")
    assert b"100 Continue" not in client.received
    client.transport.loseConnection()
    await client.closed


@pytest_twisted.ensureDeferred
async def test_bearerBodiesAreStillReadOnKeepAlive(proxy: StrangerHarness) -> None:
    """
    A request with a bearer token is read and answered as before, on a
    connection that stays open, and its body is no longer held after it.
    """
    client = await proxy.connect()
    assert client.transport is not None
    for expected in (1, 2):
        client.transport.write(proxy.chatHead(len(CHAT)) + CHAT)

        def answered(count: int = expected) -> bool:
            return client.received.count(b"PROVIDER_NOT_CONFIGURED") == count

        await eventually(answered)
    assert not client.closed.called
    assert proxy.site.bufferedBodyBytes == 0
    client.transport.loseConnection()
    await client.closed


# The cap on bodies held


@pytest_twisted.ensureDeferred
async def test_heldBodiesAreCapped(proxy: StrangerHarness) -> None:
    """
    A body held in part counts its whole declared length; a second body
    that would pass the cap gets 503 SERVICE_DEGRADED before it is sent;
    once the first is answered its bytes are given back and the next body
    is read again.
    """
    size = 60 * 1024
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (size - 60)}]})
    payload = body.encode()
    first = await proxy.connect()
    assert first.transport is not None
    first.transport.write(proxy.chatHead(len(payload)) + payload[:1000])
    await eventually(lambda: proxy.site.bufferedBodyBytes == len(payload))

    second = await proxy.connect()
    assert second.transport is not None
    second.transport.write(proxy.chatHead(len(payload)))
    await eventually(lambda: b"\r\n\r\n" in second.received)
    second.transport.loseConnection()
    await second.closed
    status, headers, document = onlyAnswer(second)
    assert (status, document["error"]["code"]) == (503, "SERVICE_DEGRADED")
    assert headers["connection"] == "close"
    assert proxy.site.bufferedBodyBytes == len(payload)

    first.transport.write(payload[1000:])
    await eventually(lambda: b"PROVIDER_NOT_CONFIGURED" in first.received)
    await eventually(lambda: proxy.site.bufferedBodyBytes == 0)

    third = await proxy.connect()
    assert third.transport is not None
    third.transport.write(proxy.chatHead(len(payload)) + payload)
    await eventually(lambda: b"PROVIDER_NOT_CONFIGURED" in third.received)
    for client in (first, third):
        assert client.transport is not None
        client.transport.loseConnection()
        await client.closed
    assert proxy.site.bufferedBodyBytes == 0


@pytest_twisted.ensureDeferred
async def test_bodyOfAClientThatLeavesIsGivenBack(proxy: StrangerHarness) -> None:
    """
    A client that goes away in the middle of its body, or while its
    request is being answered, holds nothing afterwards.
    """
    client = await proxy.connect()
    assert client.transport is not None
    client.transport.write(proxy.chatHead(LIMIT) + b"{" * 1000)
    await eventually(lambda: proxy.site.bufferedBodyBytes == LIMIT)
    # A TCP connection's transport: Protocol.transport is typed ITransport.
    cast(ITCPTransport, client.transport).abortConnection()
    await client.closed
    await eventually(lambda: proxy.site.bufferedBodyBytes == 0)

    held: Deferred[TokenInfo] = Deferred()
    proxy.auth.tokens[proxy.token] = held
    client = await proxy.connect()
    assert client.transport is not None
    client.transport.write(proxy.chatHead(len(CHAT)) + CHAT)
    await eventually(lambda: proxy.site.bufferedBodyBytes == len(CHAT))
    # A TCP connection's transport: Protocol.transport is typed ITransport.
    cast(ITCPTransport, client.transport).abortConnection()
    await client.closed
    await eventually(lambda: proxy.site.bufferedBodyBytes == 0)
    held.callback(TokenInfo(orgID=proxy.orgID, permissions=1))


@pytest_twisted.ensureDeferred
async def test_chunkedBodiesCountAsTheyCome(proxy: StrangerHarness) -> None:
    """
    A chunked body has no length up front: its bytes count as they arrive,
    and the chunk that would pass the cap gets the 503 at once.
    """
    holder = await proxy.connect()
    assert holder.transport is not None
    holder.transport.write(proxy.chatHead(60 * 1024) + b"{")
    await eventually(lambda: proxy.site.bufferedBodyBytes == 60 * 1024)

    client = await proxy.connect()
    assert client.transport is not None
    client.transport.write(proxy.chatHead(None, **{"Transfer-Encoding": "chunked"}))
    chunk = b"x" * 10_000
    for _ in range(10):
        if client.received:
            break
        client.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await sleep(0.02)
    await eventually(lambda: b"\r\n\r\n" in client.received)
    client.transport.loseConnection()
    await client.closed
    status, _, document = onlyAnswer(client)
    assert (status, document["error"]["code"]) == (503, "SERVICE_DEGRADED")
    await eventually(lambda: proxy.site.bufferedBodyBytes == 60 * 1024)
    holder.transport.loseConnection()
    await holder.closed
    await eventually(lambda: proxy.site.bufferedBodyBytes == 0)


@pytest_twisted.ensureDeferred
async def test_drainingStopsAtTheBodyLimit(proxy: StrangerHarness) -> None:
    """
    A stranger that keeps sending after its 401 is drained for at most the
    body limit's worth of bytes, then cut off, well before the linger time.
    """
    client = await proxy.connect()
    assert client.transport is not None
    began = time.monotonic()
    client.transport.write(strangerHead(LIMIT - 1, None))
    await eventually(lambda: b"\r\n\r\n" in client.received)
    while not client.closed.called and time.monotonic() - began < LINGER_SECONDS + 3:
        client.transport.write(b"x" * 16384)
        await sleep(0.001)
    assert client.closedAt is not None and client.closedAt - began < LINGER_SECONDS
    status, _, _ = onlyAnswer(client)
    assert status == 401


# Refusals by the parser


@pytest_twisted.ensureDeferred
async def test_parserRefusalsAreAnsweredAndCounted(proxy: StrangerHarness) -> None:
    """
    Each request the HTTP parser refuses gets its status with its reason
    phrase before the connection closes, counted under its reason.
    """
    attacks = {
        "request_line_too_long": b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n",
        "headers_too_large": head("GET", "/health", {"X-Big": "a" * 20_000}),
        "too_many_headers": head("GET", "/health", {f"X-{n}": "a" for n in range(600)}),
        "bad_request_line": b"GET /health HTTP/9.9 extra\r\n\r\n",
        "bad_header": b"GET /health HTTP/1.1\r\nX-Nul: a\x00b\r\n\r\n",
        "bad_length": strangerHead(None, None, **{"Content-Length": "5, 5"}),
        "bad_chunk": proxy.chatHead(None, **{"Transfer-Encoding": "chunked"}) + b"zz\r\nxx\r\n",
    }
    headersTooLarge = head("GET", "/health", {f"X-Many-{n}": "a" * 100 for n in range(200)})
    cases = [*attacks.items(), ("headers_too_large", headersTooLarge)]
    before = {reason: proxy.protocolErrors(reason) for reason in REFUSAL_STATUS}
    for reason, attack in cases:
        client = await proxy.connect()
        assert client.transport is not None
        client.transport.write(attack)
        await client.closed
        status = REFUSAL_STATUS[reason]
        expected = b"HTTP/1.1 %d %s\r\n" % (status, reasonPhrase(status))
        assert client.received.startswith(expected), (reason, client.received[:100])
        assert b"connection: close" in client.received.lower()
    counted = {reason: proxy.protocolErrors(reason) - before[reason] for reason in REFUSAL_STATUS}
    assert counted == {reason: 2 if reason == "headers_too_large" else 1 for reason in attacks}


def test_refusalsAreLoggedOncePerMinutePerReason() -> None:
    """
    A flood of one refusal is one log line a minute with the count since
    the previous line; another reason has its own line; the counter counts
    every one.
    """
    clock = Clock()
    counter = Counter("svc_proxy_protocol_errors", "test", ["reason"], registry=CollectorRegistry())
    errors = ProtocolErrors(counter, clock)
    events: list[LogEvent] = []
    # Twisted takes any callable as an observer; its annotations ask for
    # the interface.
    observer = cast(ILogObserver, events.append)
    globalLogPublisher.addObserver(observer)
    try:
        for _ in range(100):
            errors.refused("bad_header")
            clock.advance(0.1)
        errors.refused("too_many_headers")
        clock.advance(60)
        errors.refused("bad_header")
    finally:
        globalLogPublisher.removeObserver(observer)
    lines = [
        (event["reason"], event["count"])
        for event in events
        if event.get("log_namespace") == "svcd.proxy.http.site.ProtocolErrors"
    ]
    # 100 refusals over 10 s: the first is logged, the other 99 wait for
    # the next line a minute after it.
    assert lines == [("bad_header", 1), ("too_many_headers", 1), ("bad_header", 100)]
    assert counter.labels("bad_header")._value.get() == 101


def test_reasonPhrases() -> None:
    """
    Statuses Twisted's table lacks get their standard phrase; an
    unregistered one an empty phrase rather than "Unknown Status".
    """
    assert reasonPhrase(429) == b"Too Many Requests"
    assert reasonPhrase(431) == b"Request Header Fields Too Large"
    assert reasonPhrase(422) == b"Unprocessable Entity"
    assert reasonPhrase(200) == b"OK"
    assert reasonPhrase(599) == b""


@pytest_twisted.ensureDeferred
async def test_rateLimitedStatusLineHasItsPhrase() -> None:
    """
    Past the organization's limit, the status line reads 429 Too Many
    Requests on the wire.
    """
    from twisted.internet import reactor

    auth = FakeAuthClient()
    counters = MemoryCounters()
    service, port = await listeningProxy(reactor, auth, counters, LIMIT)
    harness = StrangerHarness(service, port, auth)
    try:
        # The next hit is past the default limit of 60 a minute, whatever
        # the window.
        counters.counts = _Always(61)
        client = await harness.connect()
        assert client.transport is not None
        client.transport.write(harness.chatHead(len(CHAT)) + CHAT)
        await eventually(lambda: b"RATE_LIMITED" in client.received)
        assert client.received.startswith(b"HTTP/1.1 429 Too Many Requests\r\n")
        client.transport.loseConnection()
        await client.closed
    finally:
        await service.stopService()


class _Always(dict[str, int]):
    """
    A counter store in which every key already holds C{value} - 1.
    """

    def __init__(self, value: int) -> None:
        super().__init__()
        self._value = value

    def get(self, key: str, default: Any = None) -> int:
        return self._value - 1
