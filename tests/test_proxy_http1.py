"""
svc-proxy's HTTP/1.1 client for providers (svcd.proxy.forwarding.http1)
against a real server on a loopback port that answers each request with
exactly the bytes a test scripts: framing (length, chunked, until close,
no body, interim answers), connection reuse and its limits, bad answers,
backpressure, and cancellation.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.error import ConnectionDone, ConnectionRefusedError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss

from svcd.proxy.forwarding.http1 import MAX_TRAILERS, BadAnswer, ConnectionPool, UpstreamAnswer
from svcd.testing.servers import freePort

Script = Callable[["ScriptedConnection", bytes], None]


class ScriptedConnection(Protocol):
    """
    Reads whole requests (head and Content-Length body) and lets the
    server's script answer each.
    """

    def __init__(self, server: ScriptedServer) -> None:
        self.server = server
        self.buffer = b""

    def connectionMade(self) -> None:
        self.server.connections.append(self)

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            request = head + b"\r\n\r\n" + rest[:length]
            self.buffer = rest[length:]
            self.server.requests.append(request)
            self.server.script(self, request)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        self.server.closed.append(self)


class ScriptedServer(Factory):
    def __init__(self) -> None:
        self.script: Script = lambda connection, request: None
        self.requests: list[bytes] = []
        self.connections: list[ScriptedConnection] = []
        self.closed: list[ScriptedConnection] = []

    def buildProtocol(self, addr: Any) -> ScriptedConnection:
        return ScriptedConnection(self)

    def answer(self, data: bytes) -> None:
        self.script = lambda connection, request: connection.transport.write(data)  # type: ignore[union-attr]


class Body(Protocol):
    """
    Collects a body; C{done} fires with (bytes, reason).
    """

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.done: Deferred[tuple[bytes, Failure]] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.parts.append(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        self.done.callback((b"".join(self.parts), reason))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def seconds(self) -> float:
        return self.now


@pytest.fixture
def served() -> Iterator[tuple[ScriptedServer, ConnectionPool, FakeClock]]:
    from twisted.internet import reactor

    server = ScriptedServer()
    port = reactor.listenTCP(0, server, interface="127.0.0.1")  # type: ignore[attr-defined]
    clock = FakeClock()
    pool = ConnectionPool(
        reactor,
        clock,
        f"http://127.0.0.1:{port.getHost().port}/v1/chat/completions",
        {b"Content-Type": b"application/json", b"Authorization": b"Bearer k\r\nX-Evil: 1"},
        idleSeconds=4.0,
    )
    yield server, pool, clock
    pool.close()
    port.stopListening()


async def body(answer: UpstreamAnswer) -> tuple[bytes, Failure]:
    reader = Body()
    answer.deliverBody(reader)
    return await reader.done


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    from twisted.internet import reactor

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not true in time"
        await deferLater(reactor, 0.01, lambda: None)


@pytest_twisted.ensureDeferred
async def test_requestAsWritten(served: Any) -> None:
    """
    The request goes out in one piece: the target path, Host, the fixed
    headers (a CR LF in a value cannot start a header of its own), the
    request's headers, its length and its body.
    """
    server, pool, _ = served
    server.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    answer = await pool.post(b'{"a":1}', {b"X-Request-ID": b"rid"})
    assert (answer.code, await body(answer))[0] == 200
    [request] = server.requests
    head, _, sent = request.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    assert lines[1].startswith(b"Host: 127.0.0.1:")
    assert lines[2:] == [
        b"Content-Type: application/json",
        b"Authorization: Bearer k X-Evil: 1",
        b"X-Request-ID: rid",
        b"Content-Length: 7",
    ]
    assert sent == b'{"a":1}'


@pytest.mark.parametrize(
    "answer, content, end",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello", ResponseDone),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\n",
            b"hello world",
            ResponseDone,
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b"", ResponseDone),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            b"ok",
            ResponseDone,
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b"", ResponseDone),
    ],
    ids=["length", "chunked", "no-content", "interim", "empty"],
)
@pytest_twisted.ensureDeferred
async def test_framing(served: Any, answer: bytes, content: bytes, end: type) -> None:
    """
    Each framing of RFC 9112 gives the body and a clean end, and the
    connection serves the next request.
    """
    server, pool, _ = served
    server.answer(answer)
    for _ in range(2):
        received = await pool.post(b"{}", {})
        data, reason = await body(received)
        assert (received.code, data) == (200 if content or b"200" in answer else 204, content)
        assert reason.check(end)
    assert len(server.connections) == 1


@pytest_twisted.ensureDeferred
async def test_bodyUntilClose(served: Any) -> None:
    """
    An answer without a length ends when the server closes: its body whole,
    with PotentialDataLoss as Twisted reports it; the connection is not
    used again.
    """
    server, pool, _ = served

    def answer(connection: ScriptedConnection, request: bytes) -> None:
        connection.transport.write(b"HTTP/1.1 200 OK\r\n\r\npart one, ")  # type: ignore[union-attr]
        connection.transport.write(b"part two")  # type: ignore[union-attr]
        connection.transport.loseConnection()  # type: ignore[union-attr]

    server.script = answer
    data, reason = await body(await pool.post(b"{}", {}))
    assert data == b"part one, part two"
    assert reason.check(PotentialDataLoss)
    assert (await body(await pool.post(b"{}", {})))[0] == b"part one, part two"
    assert len(server.connections) == 2


@pytest.mark.parametrize(
    "header",
    [b"Connection: close\r\n", b"Connection: keep-alive, Close\r\n"],
)
@pytest_twisted.ensureDeferred
async def test_connectionCloseIsNotReused(served: Any, header: bytes) -> None:
    """
    An answer saying Connection: close is read whole and its connection
    closed, not pooled.
    """
    server, pool, _ = served
    server.answer(b"HTTP/1.1 200 OK\r\n" + header + b"Content-Length: 2\r\n\r\nok")
    for _ in range(2):
        assert (await body(await pool.post(b"{}", {})))[0] == b"ok"
    assert len(server.connections) == 2
    await until(lambda: pool.connections == 0)


@pytest_twisted.ensureDeferred
async def test_idleConnectionsAgeOut(served: Any) -> None:
    """
    An idle connection is used again within idleSeconds of its last
    answer; past that it is closed and a new one made.
    """
    server, pool, clock = served
    server.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    await body(await pool.post(b"{}", {}))
    clock.now += 3.9
    await body(await pool.post(b"{}", {}))
    assert len(server.connections) == 1
    clock.now += 4.0
    await body(await pool.post(b"{}", {}))
    assert len(server.connections) == 2
    await until(lambda: len(server.closed) == 1)
    assert server.closed[0] is server.connections[0]


@pytest_twisted.ensureDeferred
async def test_serverClosingAnIdleConnection(served: Any) -> None:
    """
    A pooled connection the server closes leaves the pool; the next request
    gets a new one.
    """
    server, pool, _ = served
    server.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    await body(await pool.post(b"{}", {}))
    server.connections[0].transport.loseConnection()  # type: ignore[union-attr]
    await until(lambda: pool.idleConnections == 0)
    assert (await body(await pool.post(b"{}", {})))[0] == b"ok"
    assert len(server.connections) == 2


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * (70 * 1024) + b"\r\n\r\n",
    ],
    ids=["version", "status", "lengths", "negative", "header-name", "huge-head"],
)
@pytest_twisted.ensureDeferred
async def test_badAnswerFailsAndCloses(served: Any, answer: bytes) -> None:
    """
    An answer we cannot read fails the request with BadAnswer and closes
    its connection.
    """
    server, pool, _ = served
    server.answer(answer)
    with pytest.raises(BadAnswer):
        await pool.post(b"{}", {})
    await until(lambda: len(server.closed) == 1)
    assert pool.connections == 0


@pytest_twisted.ensureDeferred
async def test_badChunkFailsTheBody(served: Any) -> None:
    """
    A malformed chunk after the head ends the body with a failure (not a
    clean end) and closes the connection.
    """
    server, pool, _ = served
    server.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX")
    data, reason = await body(await pool.post(b"{}", {}))
    assert data == b"ok"
    assert reason.check(BadAnswer)
    await until(lambda: len(server.closed) == 1)


@pytest_twisted.ensureDeferred
async def test_cutShortMidBody(served: Any) -> None:
    """
    A server that closes in the middle of a known-length body ends it with
    a failure, not a clean end.
    """
    server, pool, _ = served

    def answer(connection: ScriptedConnection, request: bytes) -> None:
        connection.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")  # type: ignore[union-attr]
        connection.transport.loseConnection()  # type: ignore[union-attr]

    server.script = answer
    data, reason = await body(await pool.post(b"{}", {}))
    assert data == b"half"
    assert not reason.check(ResponseDone, PotentialDataLoss)


@pytest_twisted.ensureDeferred
async def test_closedBeforeAnswering(served: Any) -> None:
    """
    A server that closes without answering fails the request.
    """
    server, pool, _ = served
    server.script = lambda connection, request: connection.transport.loseConnection()  # type: ignore[union-attr]
    with pytest.raises(Exception) as raised:
        await pool.post(b"{}", {})
    assert not isinstance(raised.value, CancelledError)


@pytest_twisted.ensureDeferred
async def test_refused() -> None:
    """
    Nothing listening: the request fails with the connection's error.
    """
    from twisted.internet import reactor

    pool = ConnectionPool(reactor, FakeClock(), f"http://127.0.0.1:{freePort()}/v1", {}, 4.0)
    with pytest.raises(ConnectionRefusedError):
        await pool.post(b"{}", {})


@pytest_twisted.ensureDeferred
async def test_cancelBeforeTheHeadCloses(served: Any) -> None:
    """
    Cancelling a request whose answer has not come closes its connection
    at once and fails with CancelledError.
    """
    server, pool, _ = served
    pending = pool.post(b"{}", {})
    await until(lambda: len(server.requests) == 1)
    pending.cancel()
    with pytest.raises(CancelledError):
        await pending
    await until(lambda: len(server.closed) == 1)
    assert pool.connections == 0


@pytest_twisted.ensureDeferred
async def test_pauseStopsReadingAndStopCloses(served: Any) -> None:
    """
    The body's transport pauses the socket (the server's writes then stay
    unread: what the proxy holds is bounded) and resumes it; stopping
    closes the connection.
    """
    from twisted.internet import reactor

    server, pool, _ = served
    server.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    answer = await pool.post(b"{}", {})
    reader = Body()
    answer.deliverBody(reader)
    producer: Any = reader.transport
    serverSide = server.connections[0].transport
    producer.pauseProducing()
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"e" * (64 * 1024))
    for _ in range(64):
        serverSide.write(chunk)
    await deferLater(reactor, 0.3, lambda: None)
    held = sum(len(part) for part in reader.parts)
    assert held < 1024 * 1024, held
    producer.resumeProducing()
    await until(lambda: sum(len(part) for part in reader.parts) > held)
    producer.stopProducing()
    _, reason = await reader.done
    assert not reason.check(ResponseDone)
    await until(lambda: len(server.closed) == 1)


@pytest_twisted.ensureDeferred
async def test_hostHeaderOmitsTheDefaultPort() -> None:
    """
    Host names the port only when it is not the scheme's default; the
    query string stays on the target.
    """
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ClientEndpoint

    server = ScriptedServer()
    port = freePort()
    listening = await TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(server)
    server.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    try:
        pool = ConnectionPool(
            reactor,
            FakeClock(),
            "http://provider.example/openai/chat/completions?api-version=1",
            {},
            4.0,
            endpoint=TCP4ClientEndpoint(reactor, "127.0.0.1", port),
        )
        await body(await pool.post(b"{}", {}))
        lines = server.requests[0].split(b"\r\n")
        assert lines[:2] == [
            b"POST /openai/chat/completions?api-version=1 HTTP/1.1",
            b"Host: provider.example",
        ]
        pool.close()
    finally:
        await listening.stopListening()


@pytest_twisted.ensureDeferred
async def test_httpsChecksTheCertificate() -> None:
    """
    An https URL goes over TLS to the URL's host, whose certificate must
    chain to the trusted CAs: a provider with a certificate of its CA
    answers; one whose CA is not trusted fails the request before anything
    is sent.
    """
    import trustme
    from twisted.internet import reactor, ssl

    authority, stranger = trustme.CA(), trustme.CA()
    server = ScriptedServer()
    server.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    certificate = authority.issue_cert("localhost")
    serverOptions = ssl.PrivateCertificate.loadPEM(
        certificate.private_key_and_cert_chain_pem.bytes()
    ).options()
    port = reactor.listenSSL(0, server, serverOptions, interface="127.0.0.1")  # type: ignore[attr-defined]
    url = f"https://localhost:{port.getHost().port}/v1/chat/completions"
    try:
        trusted = ConnectionPool(
            reactor,
            FakeClock(),
            url,
            {},
            4.0,
            trustRoot=ssl.Certificate.loadPEM(authority.cert_pem.bytes()),
        )
        answer = await trusted.post(b"{}", {})
        assert (answer.code, (await body(answer))[0]) == (200, b"ok")
        assert (
            server.requests[0].split(b"\r\n")[1]
            == f"Host: localhost:{port.getHost().port}".encode()
        )
        trusted.close()
        untrusted = ConnectionPool(
            reactor,
            FakeClock(),
            url,
            {},
            4.0,
            trustRoot=ssl.Certificate.loadPEM(stranger.cert_pem.bytes()),
        )
        with pytest.raises(Exception) as raised:
            await untrusted.post(b"{}", {})
        assert not isinstance(raised.value, CancelledError)
        assert len(server.requests) == 1
        untrusted.close()
    finally:
        await port.stopListening()


# The malformed answers of issue 24's review, each as a provider sends it
# over a real connection.


def chunked(*pieces: bytes, trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + (
        b"0\r\n" + trailers + b"\r\n"
    )


async def within(waiting: Deferred[Any], seconds: float = 10.0) -> Any:
    """
    What C{waiting} fires with, failing the test if it takes longer than
    C{seconds}: the answers below must be refused as they arrive, not at a
    deadline (the bound only keeps a regression from hanging the run).
    """
    from twisted.internet import reactor

    return await waiting.addTimeout(seconds, reactor)


REFUSED_AT_THE_HEAD = {
    # Decoded as chunked, then gzip bytes relayed as if plain: we asked
    # for no coding, and only chunked is read.
    "gzip-chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    + chunked(gzip.compress(b'{"a": 1}')),
    "gzip-then-chunked-fields": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + chunked(gzip.compress(b'{"a": 1}')),
    "chunked-twice": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n"
    + chunked(b"ok"),
    "gzip-until-close": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"
    + gzip.compress(b"{}"),
    # RFC 9112 section 2.2: a bare CR in a field, a tab or NUL in a name.
    "bare-cr-in-value": b"HTTP/1.1 200 OK\r\nX: a\rb\r\nContent-Length: 2\r\n\r\nok",
    "tab-in-name": b"HTTP/1.1 200 OK\r\nX\tY: a\r\nContent-Length: 2\r\n\r\nok",
    "nul-in-name": b"HTTP/1.1 200 OK\r\nX\x00Y: a\r\nContent-Length: 2\r\n\r\nok",
    # Read as one header, the bare LF hid the length (a smuggling shape).
    "bare-lf": b"HTTP/1.1 200 OK\r\nX: a\nContent-Length: 5\r\n\r\nhello",
    # Never asked for: not an interim answer.
    "101-then-bytes": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\n\r\n\x81\x05hello",
    "101-alone": b"HTTP/1.1 101 Switching Protocols\r\n\r\nbytes",
    # What llhttp takes and we do not.
    "http-2.0": b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "status-099": b"HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\nok",
    "nul-in-reason": b"HTTP/1.1 200 O\x00K\r\nContent-Length: 2\r\n\r\nok",
    "empty-line-first": b"\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
}


@pytest.mark.parametrize("answer", REFUSED_AT_THE_HEAD.values(), ids=REFUSED_AT_THE_HEAD.keys())
@pytest_twisted.ensureDeferred
async def test_refusedAtTheHead(served: Any, answer: bytes) -> None:
    """
    An answer whose head we cannot trust fails the request with BadAnswer
    as soon as the head is read (forwarding answers 502) and closes its
    connection; nothing of its body reaches anyone.
    """
    server, pool, _ = served
    server.answer(answer)
    with pytest.raises(BadAnswer):
        await within(pool.post(b"{}", {}))
    await until(lambda: len(server.closed) == 1)
    assert pool.connections == 0


REFUSED_IN_THE_BODY = {
    # Twisted's lenient chunk-size rule was CVE-2022-24801.
    "space-before-size": b" 2\r\nok\r\n0\r\n\r\n",
    "vt-after-size": b"2\x0b\r\nok\r\n0\r\n\r\n",
    # Once waited for until the deadline (504).
    "28-hex-digits": b"f" * 28 + b"\r\nok",
    "too-many-trailers": chunked(
        b"ok", trailers=b"".join(b"T%d: x\r\n" % each for each in range(MAX_TRAILERS + 1))
    ),
    "endless-extension": b"2;" + b"e" * (4 * 64 * 1024),
}


@pytest.mark.parametrize("body", REFUSED_IN_THE_BODY.values(), ids=REFUSED_IN_THE_BODY.keys())
@pytest_twisted.ensureDeferred
async def test_refusedInTheBody(served: Any, body: bytes) -> None:
    """
    A chunked body with a malformed chunk or trailers past their bound
    ends with BadAnswer the moment it arrives, although the server keeps
    the connection open, and the connection is closed.
    """
    server, pool, _ = served
    server.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    answer = await within(pool.post(b"{}", {}))
    _, reason = await within(Deferred.fromCoroutine(_body(answer)))
    assert reason.check(BadAnswer)
    await until(lambda: len(server.closed) == 1)
    assert pool.connections == 0


async def _body(answer: UpstreamAnswer) -> tuple[bytes, Failure]:
    return await body(answer)


READ_THEN_CLOSED = {
    # RFC 9112 section 6.1: Transfer-Encoding in HTTP/1.0 is faulty
    # framing, whatever Connection says.
    "http1.0-chunked-keep-alive": b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: keep-alive\r\n\r\n" + chunked(b"hel", b"lo"),
    # RFC 9112 section 6.3: the transfer coding wins, and the connection
    # may not be trusted after.
    "chunked-with-length": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 5\r\n\r\n" + chunked(b"hel", b"lo"),
    "length-with-chunked": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b"hello"),
    # An interim answer that says close: the answer follows, then close.
    "interim-says-close": b"HTTP/1.1 103 Early Hints\r\nConnection: close\r\n"
    b"Link: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    # Bytes after the answer: no request asked for them.
    "bytes-after-the-answer": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    b"HTTP/1.1 200 OK\r\n",
    "junk-after-the-answer": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello!",
}


@pytest.mark.parametrize("answer", READ_THEN_CLOSED.values(), ids=READ_THEN_CLOSED.keys())
@pytest_twisted.ensureDeferred
async def test_faultyFramingIsReadThenClosed(served: Any, answer: bytes) -> None:
    """
    An answer that can be read but leaves its connection in doubt is
    read whole, then its connection closed, never used for another
    request.
    """
    server, pool, _ = served
    server.answer(answer)
    for _ in range(2):
        data, reason = await within(Deferred.fromCoroutine(_body(await pool.post(b"{}", {}))))
        assert (data, reason.check(ResponseDone)) == (b"hello", ResponseDone)
    assert len(server.connections) == 2
    await until(lambda: len(server.closed) == 2)
    assert pool.connections == 0


@pytest_twisted.ensureDeferred
async def test_trailersUpToTheBound(served: Any) -> None:
    """
    MAX_TRAILERS trailers are read and dropped, and the connection kept.
    """
    server, pool, _ = served
    trailers = b"".join(b"T%d: x\r\n" % each for each in range(MAX_TRAILERS))
    server.answer(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"ok", trailers=trailers)
    )
    for _ in range(2):
        data, reason = await body(await pool.post(b"{}", {}))
        assert (data, reason.check(ResponseDone)) == (b"ok", ResponseDone)
    assert len(server.connections) == 1


@pytest.mark.parametrize(
    "answer",
    [*REFUSED_AT_THE_HEAD.values()]
    + [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + each
        for each in REFUSED_IN_THE_BODY.values()
    ],
    ids=[*REFUSED_AT_THE_HEAD.keys(), *REFUSED_IN_THE_BODY.keys()],
)
@pytest_twisted.ensureDeferred
async def test_refusalsAreUpstreamErrors(answer: bytes) -> None:
    """
    Through the forwarder, each refused answer is 502 UPSTREAM_ERROR (a
    fault that tries the fallbacks), counted as invalid, at once.
    """
    from prometheus_client import CollectorRegistry
    from twisted.internet import reactor

    from svcd.common.errors import ApiError, ErrorCode
    from svcd.proxy.forwarding.providers import Model, Provider
    from svcd.proxy.forwarding.upstream import Forwarder
    from svcd.proxy.metrics import ProxyMetrics
    from svcd.proxy.records import UpstreamRecord

    server = ScriptedServer()
    server.answer(answer)
    port = freePort()
    listening = await TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(server)
    provider = Provider("scripted", f"http://127.0.0.1:{port}/v1", timeout=30.0)
    registry = CollectorRegistry()
    forwarder = Forwarder(reactor, reactor, [provider], ProxyMetrics(registry))
    try:
        with pytest.raises(ApiError) as raised:
            await within(
                Deferred.fromCoroutine(
                    forwarder.forward(
                        {"model": "m", "messages": []},
                        [Model("m", provider)],
                        "rid",
                        None,  # type: ignore[arg-type]
                        lambda error: b"",
                        UpstreamRecord(),
                    )
                )
            )
        assert (raised.value.code, raised.value.status) == (ErrorCode.UPSTREAM_ERROR, 502)
        labels = {"provider": "scripted", "model": "m", "status": "invalid"}
        assert registry.get_sample_value("svc_proxy_upstream_requests_total", labels) == 1
    finally:
        await forwarder.close()
        await listening.stopListening()
