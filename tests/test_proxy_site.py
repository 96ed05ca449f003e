"""
svc-proxy's HTTP site over a real loopback socket: the body limit is
enforced while the request arrives (a declared Content-Length over the
limit is answered before the body is sent; a chunked body stops being
buffered at the limit), and the service stops listening, waits for
requests in flight and closes its clients on stop.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_twisted
import treq
from proxydoubles import FakeAuthClient, MemoryCounters, listeningProxy, newToken
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.python.failure import Failure

from svcd.proxy.http.site import BodyLimitedRequest
from svcd.proxy.records import TokenInfo
from svcd.proxy.service import ProxyService

LIMIT = 1000


class RawClient(Protocol):
    """
    Sends bytes as told and collects everything the server writes until it
    closes the connection.
    """

    def __init__(self) -> None:
        self.received = b""
        self.closed: Deferred[bytes] = Deferred()
        self.gotData: Deferred[None] | None = None

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if self.gotData is not None:
            waiting, self.gotData = self.gotData, None
            waiting.callback(None)

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self.closed.callback(self.received)


class Running:
    def __init__(self, service: ProxyService, port: int, auth: FakeAuthClient) -> None:
        self.service = service
        self.port = port
        self.auth = auth
        self.counters = MemoryCounters()

    async def connect(self) -> RawClient:
        from twisted.internet import reactor

        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        client = await endpoint.connect(Factory.forProtocol(RawClient))
        assert isinstance(client, RawClient)
        return client


@pytest_twisted.async_yield_fixture
async def running() -> AsyncIterator[Running]:
    from twisted.internet import reactor

    auth = FakeAuthClient()
    counters = MemoryCounters()
    service, port = await listeningProxy(reactor, auth, counters, LIMIT)
    harness = Running(service, port, auth)
    harness.counters = counters
    try:
        yield harness
    finally:
        if service.running:
            await service.stopService()


def closed(auth: FakeAuthClient) -> bool:
    """
    Whether C{auth} is closed, read afresh (mypy keeps what an earlier
    C{assert not auth.closed} narrowed C{.closed} to).
    """
    return auth.closed


def parseResponse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def requestHead(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: proxy.test"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chatHead(token: str, agentID: str, **framing: str) -> bytes:
    """
    The head of a chat request by C{token} as C{agentID}, on a connection
    closed after the answer; C{framing} gives Content-Type and the body's
    length or transfer encoding (as C{Content_Type=...}).
    """
    headers = {name.replace("_", "-"): value for name, value in framing.items()}
    headers.update(
        {"Authorization": "Bearer " + token, "X-SVC-Agent-ID": agentID, "Connection": "close"}
    )
    return requestHead("POST", "/v1/chat/completions", headers)


@pytest_twisted.ensureDeferred
async def test_declaredLengthAnsweredBeforeBody(running: Running) -> None:
    """
    A Content-Length over the limit is answered 413 right after the
    headers, without waiting for (or reading) the body, and the connection
    is closed; an Expect: 100-continue gets no 100 Continue.
    """
    client = await running.connect()
    assert client.transport is not None
    client.transport.write(
        requestHead(
            "POST",
            "/v1/chat/completions",
            {
                "Content-Type": "application/json",
                "Content-Length": str(50 * 1024 * 1024),
                "Expect": "100-continue",
            },
        )
    )
    began = time.monotonic()
    raw = await client.closed
    assert time.monotonic() - began < 1
    assert b"100 Continue" not in raw
    status, headers, body = parseResponse(raw)
    assert status == 413
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert headers["x-request-id"] == json.loads(body)["error"]["request_id"]


@pytest_twisted.ensureDeferred
async def test_declaredLengthOnOtherRoutes(running: Running) -> None:
    """
    Other routes ignore the oversized body: GET /health answers 200 (and
    closes the connection, since the body was never read).
    """
    client = await running.connect()
    assert client.transport is not None
    client.transport.write(requestHead("GET", "/health", {"Content-Length": str(LIMIT + 1)}))
    status, _, body = parseResponse(await client.closed)
    assert status == 200
    assert json.loads(body) == {"status": "ok", "checks": {}}


@pytest_twisted.ensureDeferred
async def test_chunkedBodyCapped(running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A chunked body is buffered only up to the limit: past it, what was
    buffered is dropped and the rest discarded, and the chat route
    answers 413.
    """
    largest: list[int] = []
    original = BodyLimitedRequest.handleContentChunk

    def recording(self: BodyLimitedRequest, data: bytes) -> None:
        original(self, data)
        # The request may be answered, and its body closed, from inside
        # the call that crosses the limit.
        largest.append(0 if self._body.closed else len(self._body.getvalue()))

    monkeypatch.setattr(BodyLimitedRequest, "handleContentChunk", recording)
    token, _, agentID = running.auth.addTenant()
    client = await running.connect()
    assert client.transport is not None
    client.transport.write(
        chatHead(token, agentID, Content_Type="application/json", Transfer_Encoding="chunked")
    )
    chunk = b"x" * 300
    for _ in range(20):
        client.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    client.transport.write(b"0\r\n\r\n")
    client.gotData = Deferred()
    await client.gotData
    status, _, body = parseResponse(client.received)
    assert status == 413
    assert json.loads(body)["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert max(largest) <= LIMIT
    client.transport.loseConnection()


@pytest_twisted.ensureDeferred
async def test_chunkedBodyWithinLimit(running: Running) -> None:
    """
    A chunked body within the limit reaches the handler whole.
    """
    token, _, agentID = running.auth.addTenant()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    client = await running.connect()
    assert client.transport is not None
    client.transport.write(
        chatHead(token, agentID, Content_Type="application/json", Transfer_Encoding="chunked")
    )
    for start in range(0, len(body), 10):
        piece = body[start : start + 10]
        client.transport.write(b"%x\r\n%s\r\n" % (len(piece), piece))
    client.transport.write(b"0\r\n\r\n")
    status, _, content = parseResponse(await client.closed)
    assert (status, json.loads(content)["error"]["code"]) == (501, "PROVIDER_NOT_CONFIGURED")


@pytest_twisted.ensureDeferred
async def test_keepAliveAfterSmallBody(running: Running) -> None:
    """
    An ordinary request leaves the connection open for the next one, with
    a Content-Length on the answer.
    """
    client = await running.connect()
    assert client.transport is not None
    client.gotData = Deferred()
    client.transport.write(requestHead("GET", "/health", {}))
    await client.gotData
    status, headers, _ = parseResponse(client.received)
    assert status == 200
    assert headers["content-length"] == str(len(b'{"status":"ok","checks":{}}'))
    client.received = b""
    client.gotData = Deferred()
    client.transport.write(requestHead("GET", "/nope", {}))
    await client.gotData
    assert parseResponse(client.received)[0] == 404
    client.transport.loseConnection()


@pytest.mark.parametrize(
    ("path", "host"),
    [(b"/%ff", b"proxy.test"), (b"/v1/chat/%c3%28", b"proxy.test"), (b"/health", b"\xff.test")],
)
@pytest_twisted.ensureDeferred
async def test_notUTF8(running: Running, path: bytes, host: bytes) -> None:
    """
    A path or host that is not UTF-8 is an unknown path: 404 in the
    envelope, with the standard headers, not a plain-text 400 (what a
    Klein router answers, and the edge's once did).
    """
    client = await running.connect()
    assert client.transport is not None
    client.transport.write(
        b"GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (path, host)
    )
    status, headers, body = parseResponse(await client.closed)
    assert status == 404
    error = json.loads(body)["error"]
    assert error["code"] == "NOT_FOUND"
    assert error["request_id"] == headers["x-request-id"]
    assert "x-trace-id" in headers and "x-response-time" in headers
    assert "server" not in headers


@pytest_twisted.ensureDeferred
async def test_gracefulStop(running: Running) -> None:
    """
    Stopping the service stops listening at once, lets the request in
    flight finish, then closes the auth client and the limiter.
    """
    from twisted.internet import reactor

    token = newToken()
    held: Deferred[TokenInfo] = Deferred()
    running.auth.tokens[token] = held
    url = f"http://127.0.0.1:{running.port}/v1/internal/auth-probe"
    headers: dict[bytes | str, bytes | str] = {
        "Authorization": "Bearer " + token,
        "X-SVC-Agent-ID": str(uuid.uuid4()),
    }
    inFlight = treq.get(url, headers=headers)
    while not running.auth.calls:
        await deferLater(reactor, 0.01, lambda: None)

    stopped = running.service.stopService()
    await deferLater(reactor, 0.05, lambda: None)
    assert not stopped.called
    assert not running.auth.closed
    with pytest.raises(Exception):  # noqa: B017 - refused: nobody listens any more
        await treq.get(f"http://127.0.0.1:{running.port}/health")

    orgID = str(uuid.uuid4())
    running.auth.agents.clear()
    held.callback(TokenInfo(orgID=orgID, permissions=0))
    response: Any = await inFlight
    assert response.code == 403
    await response.content()
    await stopped
    assert closed(running.auth)
    assert running.counters.stopped


@pytest_twisted.ensureDeferred
async def test_formUploadIsNotParsed(running: Running) -> None:
    """
    A POST that claims to be a multipart form upload is not parsed as one
    (the proxy reads JSON only): a body that is not valid multipart gets
    the proxy's own 415 envelope, not Twisted's bare 400 and a closed
    connection.
    """
    token, _, agentID = running.auth.addTenant()
    body = b"--not-a-boundary\r\nnot multipart at all"
    client = await running.connect()
    assert client.transport is not None
    client.transport.write(
        chatHead(
            token,
            agentID,
            Content_Type="multipart/form-data; boundary=xyz",
            Content_Length=str(len(body)),
        )
        + body
    )
    status, headers, content = parseResponse(await client.closed)
    assert status == 415
    assert json.loads(content)["error"]["code"] == "UNSUPPORTED_MEDIA_TYPE"
    assert "x-request-id" in headers
