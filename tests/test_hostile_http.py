"""
Hostile HTTP clients against svc-proxy's site on a real loopback socket,
with the real edge, site and rate limiter (in-memory auth and counters)
and short timeouts: slow clients, idle connections, bodies that lie about
their length, pipelined bytes that could smuggle a request, oversized
headers and bodies. Each gets a 4xx envelope or a closed connection,
never a 500 and never a connection left hanging.

The same attacks against the real daemons are in test_hostile_gateway.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import cast

import pytest_twisted
from proxydoubles import FakeAuthClient, MemoryCounters, listeningProxy
from rawhttp import CHAT, Harness, head, sleep
from twisted.internet.defer import Deferred
from twisted.web.resource import IResource

from svcd.proxy.http.site import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT,
    LINGER_SECONDS,
    ProxySite,
    reasonPhrase,
)
from svcd.proxy.records import TokenInfo

LIMIT = 4096
IDLE = 0.6
REQUEST_TIMEOUT = 1.0


@pytest_twisted.async_yield_fixture
async def proxy() -> AsyncIterator[Harness]:
    from twisted.internet import reactor

    auth = FakeAuthClient()
    service, port = await listeningProxy(
        reactor, auth, MemoryCounters(), LIMIT, timeout=IDLE, requestTimeout=REQUEST_TIMEOUT
    )
    try:
        yield Harness(service, port, auth)
    finally:
        await service.stopService()


def test_defaults() -> None:
    """
    The daemon's site closes idle connections after 30 s (Twisted's default
    is 12 hours) and wants each request whole within 30 s.
    """
    site = ProxySite(cast(IResource, FakeResource()), LIMIT)
    assert site.timeOut == DEFAULT_IDLE_TIMEOUT == 30.0
    assert site.requestTimeout == DEFAULT_REQUEST_TIMEOUT == 30.0


class FakeResource:
    isLeaf = True


# Slow and idle clients


@pytest_twisted.ensureDeferred
async def test_byteAtATimeIsCutOff(proxy: Harness) -> None:
    """
    A client that trickles its headers one byte at a time, often enough to
    keep the idle timeout from firing, is cut off by the request deadline
    without an answer.
    """
    client = await proxy.connect()
    assert client.transport is not None
    began = time.monotonic()
    trickle = b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000
    for byte in trickle:
        if client.closed.called:
            break
        client.transport.write(bytes([byte]))
        await sleep(IDLE / 4)
    assert client.closed.called, "the slow client was never cut off"
    assert client.closedAt is not None
    took = client.closedAt - began
    assert REQUEST_TIMEOUT * 0.9 <= took < REQUEST_TIMEOUT + 1.0, took
    assert client.received == b""


@pytest_twisted.ensureDeferred
async def test_slowBodyIsCutOff(proxy: Harness) -> None:
    """
    The deadline covers the body too: a chat body sent a byte at a time is
    cut off before it is complete.
    """
    client = await proxy.connect()
    assert client.transport is not None
    client.transport.write(proxy.chatHead(len(CHAT)))
    began = time.monotonic()
    for byte in CHAT:
        if client.closed.called:
            break
        client.transport.write(bytes([byte]))
        await sleep(IDLE / 4)
    assert client.closed.called
    assert client.closedAt is not None and client.closedAt - began < REQUEST_TIMEOUT + 1.0
    assert client.received == b""


@pytest_twisted.ensureDeferred
async def test_idleConnectionsAreClosed(proxy: Harness) -> None:
    """
    A connection that never sends anything, or goes quiet after an answer
    (keep-alive), is closed after the idle timeout.
    """
    silent = await proxy.connect()
    answered = await proxy.connect()
    assert answered.transport is not None
    began = time.monotonic()
    answered.transport.write(head("GET", "/health"))
    await silent.closed
    await answered.closed
    for client in (silent, answered):
        assert client.closedAt is not None and client.closedAt - began < IDLE + 1.0
    assert [status for status, _, _ in answered.responses()] == [200]
    assert silent.received == b""


@pytest_twisted.ensureDeferred
async def test_deadlineRestartsForEachRequest(proxy: Harness) -> None:
    """
    A keep-alive client that sends a request now and then, each whole, is
    served for longer than one request deadline.
    """
    client = await proxy.connect()
    assert client.transport is not None
    began = time.monotonic()
    for _ in range(5):
        client.transport.write(head("GET", "/health"))
        await sleep(IDLE / 2)
    assert not client.closed.called
    assert time.monotonic() - began > REQUEST_TIMEOUT
    assert [status for status, _, _ in client.responses()] == [200] * 5
    client.transport.loseConnection()
    await client.closed


# Bodies that lie about their length


@pytest_twisted.ensureDeferred
async def test_shorterBodyThanDeclaredTimesOut(proxy: Harness) -> None:
    """
    A body shorter than its Content-Length leaves the proxy waiting for the
    rest only until the request deadline; then the connection is closed,
    with no answer and no call to svc-auth.
    """
    client = await proxy.connect()
    assert client.transport is not None
    began = time.monotonic()
    client.transport.write(proxy.chatHead(len(CHAT) + 50) + CHAT)
    await client.closed
    assert client.closedAt is not None
    assert client.closedAt - began < REQUEST_TIMEOUT + 1.0
    assert client.received == b""
    assert proxy.auth.calls == []


@pytest_twisted.ensureDeferred
async def test_longerBodyDoesNotSmuggleARequest(proxy: Harness) -> None:
    """
    Bytes past the declared Content-Length, here a whole second request,
    are not served: the first request is answered with Connection: close
    and the connection ends there. svc-auth sees the first request only.
    """
    smuggled = head(
        "GET",
        "/v1/internal/auth-probe",
        {"Authorization": f"Bearer {proxy.token}", "X-SVC-Agent-ID": proxy.agentID},
    )
    client = await proxy.connect()
    assert client.transport is not None
    client.transport.write(proxy.chatHead(len(CHAT)) + CHAT + smuggled)
    await client.closed
    responses = client.responses()
    assert [status for status, _, _ in responses] == [501]
    assert responses[0][1]["connection"] == "close"
    assert [call[0] for call in proxy.auth.calls] == ["ValidateToken", "ValidateAgent"]


@pytest_twisted.ensureDeferred
async def test_bytesArrivingDuringAnswerAreRefused(proxy: Harness) -> None:
    """
    The next request sent before the current one is answered (here while
    svc-auth is slow to validate the token) is not read either: one
    answer, then the connection is closed.
    """
    held: Deferred[TokenInfo] = Deferred()
    proxy.auth.tokens[proxy.token] = held
    client = await proxy.connect()
    assert client.transport is not None
    client.transport.write(proxy.chatHead(len(CHAT)) + CHAT)
    await sleep(0.1)
    client.transport.write(head("GET", "/health"))
    await sleep(0.1)
    held.callback(TokenInfo(orgID=proxy.orgID, permissions=1))
    await client.closed
    responses = client.responses()
    assert [status for status, _, _ in responses] == [501]
    assert responses[0][1]["connection"] == "close"


@pytest_twisted.ensureDeferred
async def test_conflictingLengthsAreRefused(proxy: Harness) -> None:
    """
    Two Content-Lengths, a Content-Length with Transfer-Encoding, an
    unknown transfer coding or a signed length: 400 and the connection is
    closed before any route runs.
    """
    for headers in (
        {"Content-Length": f"{len(CHAT)}, {len(CHAT)}"},
        {"Content-Length": str(len(CHAT)), "Transfer-Encoding": "chunked"},
        {"Transfer-Encoding": "gzip, chunked"},
        {"Content-Length": f"+{len(CHAT)}"},
    ):
        client = await proxy.connect()
        assert client.transport is not None
        client.transport.write(proxy.chatHead(None, **headers) + CHAT)
        await client.closed
        assert client.received.startswith(b"HTTP/1.1 400 "), (headers, client.received)
    assert proxy.auth.calls == []


# Oversized headers and bodies


@pytest_twisted.ensureDeferred
async def test_oversizedHeadersAreRefused(proxy: Harness) -> None:
    """
    A header line over 16 KiB, headers over 16 KiB in all, or more than
    500 headers: 431 (a request line over 16 KiB: 414), with its reason
    phrase, and the connection is closed, before any route runs
    (decisions D10; Twisted closed some without a word).
    """
    attacks = [
        (head("GET", "/health", {"X-Big": "a" * 20_000}), 431),
        (head("GET", "/health", {f"X-Many-{n}": "a" * 100 for n in range(200)}), 431),
        (head("GET", "/health", {f"X-{n}": "" for n in range(600)}), 431),
        (b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n", 414),
    ]
    for attack, status in attacks:
        client = await proxy.connect()
        assert client.transport is not None
        client.transport.write(attack)
        await client.closed
        line = b"HTTP/1.1 %d %s\r\n" % (status, reasonPhrase(status))
        assert client.received.startswith(line), client.received[:100]
        assert client.responses()[0][1]["connection"] == "close"
    assert proxy.auth.calls == []


@pytest_twisted.ensureDeferred
async def test_chunkedBodyOverLimitAnsweredAtOnce(proxy: Harness) -> None:
    """
    A chunked body that passes the limit is answered 413 as soon as it
    does, while the client is still sending; the proxy then drains what
    the client sends and closes within the linger time, so the client
    reads the whole answer (no reset).
    """
    client = await proxy.connect()
    assert client.transport is not None
    client.transport.write(proxy.chatHead(None, **{"Transfer-Encoding": "chunked"}))
    chunk = b"x" * 1000
    began = time.monotonic()
    sent = 0
    while not client.received and time.monotonic() - began < 3:
        client.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sent += len(chunk)
        await sleep(0.01)
    answeredAfter = sent
    # Keep sending a little, as a client that has not looked yet would.
    for _ in range(20):
        if client.closed.called:
            break
        client.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await sleep(0.01)
    client.transport.loseConnection()
    await client.closed
    assert answeredAfter <= LIMIT + 2 * len(chunk)
    [(status, headers, body)] = client.responses()
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert proxy.auth.calls == []


@pytest_twisted.ensureDeferred
async def test_refusedUploadIsDrainedThenClosed(proxy: Harness) -> None:
    """
    A client that announces a large body and keeps sending it after the
    early 413 gets the whole answer, and the proxy closes the connection
    after the linger time even though the client never stops.
    """
    client = await proxy.connect()
    assert client.transport is not None
    began = time.monotonic()
    client.transport.write(proxy.chatHead(50 * 1024 * 1024))
    while not client.closed.called and time.monotonic() - began < LINGER_SECONDS + 3:
        client.transport.write(b"{" * 16384)
        await sleep(0.01)
    assert client.closed.called
    assert client.closedAt is not None
    assert client.closedAt - began < LINGER_SECONDS + 1.5
    [(status, headers, body)] = client.responses()
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["request_id"] == headers["x-request-id"]


@pytest_twisted.ensureDeferred
async def test_keepAliveStillWorks(proxy: Harness) -> None:
    """
    None of this gets in the way of an ordinary keep-alive client: three
    requests, each sent after the previous answer, on one connection.
    """
    client = await proxy.connect()
    assert client.transport is not None
    for expected in range(1, 4):
        client.transport.write(proxy.chatHead(len(CHAT)) + CHAT)
        while client.received.count(b"PROVIDER_NOT_CONFIGURED") < expected:
            await sleep(0.01)
    assert [status for status, _, _ in client.responses()] == [501, 501, 501]
    assert not client.closed.called
    client.transport.loseConnection()
    await client.closed
