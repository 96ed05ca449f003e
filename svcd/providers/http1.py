"""
The proxy's HTTP/1.1 client for its providers: persistent connections per
provider, one request at a time on each, the answer's status and headers
as soon as they arrive and its body as it comes (decisions D9).

Why not Twisted's C{Agent} (or treq, which wraps it): forwarding asks for
much less than a general client does, and paid for all of it. Per request
C{Agent} parses the URL, makes an endpoint, copies the headers into a
request object, writes them one by one, and parses the answer with a line
protocol that is set up and torn down around each response; measured
against nginx on loopback with 16 requests in flight, that was 156 µs of
client CPU per request, against 27 for a protocol that writes the
request in one piece and reads the answer with a few C{find}s. Forwarding
then cost the proxy as much again as the request's whole pipeline.

Why the answer is read by httptools (llhttp) and not by code of ours: an
HTTP/1.1 parser is where request smuggling and response splitting live,
and a hand-written one was lenient where it must not be (C{Transfer-Encoding:
gzip, chunked} relayed as if plain, a chunk size of C{" 2"} accepted, a
bare LF hiding a header; Twisted's own lenient chunk-size rule was
CVE-2022-24801). llhttp is the parser of Node.js and, through httptools,
of uvicorn: written in C from a grammar, fuzzed, strict by default
(bare CR or LF, control bytes in a header, whitespace or an overflow in a
chunk size, C{Content-Length} twice are errors), and it reads a 64 KiB
read of small chunks in one pass (the hand-written parser re-sliced what
was left of it per chunk: about 20 MiB copied, 68 ms, for one such read;
now 1.8 ms).

What this client does, and no more:

  - One request per connection at a time (no pipelining), the request
    written in one write: a head made once per provider plus the
    request's own headers and body.
  - Answers framed as RFC 9112 section 6 says, by llhttp: no body for 1xx,
    204 and 304, chunked (extensions and trailers read and dropped), a
    C{Content-Length}, or everything until the server closes. Interim
    answers (100 Continue, 103 Early Hints) are skipped; a 101 was never
    asked for and is refused. A malformed answer fails the request and
    closes the connection.
  - What llhttp allows and we do not, checked here (llhttp leaves each to
    its user; the rules are RFC 9112's):
    a C{Transfer-Encoding} other than one field saying C{chunked} (we ask
    for no coding, and llhttp takes any list that ends in C{chunked}, so
    C{gzip, chunked} would be relayed as compressed bytes); an HTTP
    version other than 1.0 and 1.1; a status below 100; a control byte in
    the reason phrase (llhttp takes a NUL there); an empty line before
    the status line (llhttp skips them, as a server may before a request
    line). And the bounds llhttp has none of: a head over
    L{MAX_HEAD_BYTES}, more than L{MAX_TRAILERS} trailers, a chunk or
    trailer line that keeps the parser reading past L{MAX_LINE_BYTES}.
  - What llhttp refuses and we allow, through its two leniencies that do
    only this: C{Transfer-Encoding: chunked} with C{Content-Length}
    (C{lenient_chunked_length}; RFC 9112 section 6.3: the transfer coding
    wins, and the connection is closed after), and an interim answer
    saying C{Connection: close} followed by the final one
    (C{lenient_keep_alive}; closed after the final one).
  - Where llhttp and h11 still differ (tests/test_proxy_http1.py lists
    each class), llhttp is the stricter but in two: a chunk size padded
    with zeros past 20 digits, and empty lines between an interim answer
    and the next.
  - A connection is used again when its answer was complete, nothing came
    after it, and both sides meant to keep it (llhttp's
    C{should_keep_alive}: HTTP/1.1 without C{Connection: close}, or HTTP/1.0
    with C{keep-alive}), and never after an answer whose framing RFC 9112
    section 6.1 calls faulty (C{Transfer-Encoding} in HTTP/1.0, or with
    C{Content-Length}). An idle connection is used again only within
    C{idleSeconds} of its last answer, below the keep-alive timeout of
    common servers, so that a request is seldom written into a connection
    the server is closing. Older ones are closed when found.
  - The body goes to an C{IProtocol} (C{deliverBody}, as Twisted's
    C{IResponse}), whose transport pauses, resumes and stops the
    connection: a slow client pauses the upstream's socket, and stopping
    closes it at once. Each read's body bytes go to the protocol in one
    C{dataReceived}; what a read brought while the protocol is paused (and
    the answer's end) waits for it to resume.
  - Cancelling a request before its answer's head closes its connection.

Redirects are not followed (one would carry the provider's key
elsewhere), cookies are not kept, compression is not asked for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.error import (
    ConnectingCancelledError,
    ConnectionAborted,
    ConnectionDone,
    ConnectionLost,
)
from twisted.internet.interfaces import IProtocol, IPushProducer, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import optionsForClientTLS
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from zope.interface import implementer

from svcd.common.clocks import Clock

# The longest answer head (status line and headers, interim heads
# included) read.
MAX_HEAD_BYTES = 64 * 1024
# The longest chunk-size line (with its extensions) or trailer line; one
# that is longer is refused by the read that takes it past this bound.
MAX_LINE_BYTES = 4096
# The most trailers an answer may have (they are read and dropped).
MAX_TRAILERS = 64

_NO_BODY = frozenset({204, 304})
_VERSIONS = frozenset({"1.0", "1.1"})
# A request target of ours: an absolute path of visible ASCII, which no
# byte of can end the request line early.
_TARGET = re.compile(rb"/[\x21-\x7e]*")
# Bytes no reason phrase may hold (RFC 9112 section 4).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class BadAnswer(Exception):
    """
    The upstream's answer is not HTTP/1.1 we can read.
    """


class AnswerHeaders:
    """
    An answer's headers by lower-case name, with the one method of
    Twisted's C{Headers} forwarding uses.
    """

    __slots__ = ("_values",)

    def __init__(self, values: dict[bytes, list[bytes]]) -> None:
        self._values = values

    def getRawHeaders(self, name: bytes) -> list[bytes] | None:
        return self._values.get(name.lower())


class UpstreamAnswer:
    """
    An upstream's answer: its status and headers, and its body for
    L{deliverBody}. Body bytes that come before a protocol is given, or
    while it is paused, are kept for it (a list of the reads' bytes, joined
    once when delivered), and so is the body's end.
    """

    def __init__(self, connection: _Connection, code: int, headers: AnswerHeaders) -> None:
        self.code = code
        self.headers = headers
        self._connection = connection
        self._protocol: IProtocol | None = None
        self._held: list[bytes] = []
        self._end: Failure | None = None
        self._paused = False
        self._stopped = False

    def deliverBody(self, protocol: IProtocol) -> None:
        """
        Give the body to C{protocol}: C{dataReceived} for each piece, then
        C{connectionLost} with L{ResponseDone} (complete), L{PotentialDataLoss}
        (the server closed an answer of unknown length) or another failure
        (cut short). Its transport is an C{IPushProducer} of the body.
        """
        self._protocol = protocol
        protocol.makeConnection(_BodyProducer(self._connection, self))  # type: ignore[arg-type]
        self._flush()

    def _data(self, data: bytes) -> None:
        protocol = self._protocol
        if self._stopped:
            return
        if protocol is None or self._paused or self._held:
            self._held.append(data)
        else:
            protocol.dataReceived(data)

    def _finished(self, reason: Failure) -> None:
        self._end = reason
        self._flush()

    def _flush(self) -> None:
        """
        Deliver what is held, then the end, for as long as the protocol is
        not paused (it may pause again as it takes them).
        """
        protocol = self._protocol
        if protocol is None:
            return
        while self._held and not self._paused:
            held, self._held = self._held, []
            protocol.dataReceived(held[0] if len(held) == 1 else b"".join(held))
        if self._end is not None and not self._paused and not self._held:
            end, self._end = self._end, None
            protocol.connectionLost(end)

    def _pause(self) -> None:
        self._paused = True

    def _resume(self) -> None:
        self._paused = False
        self._flush()

    def _stop(self) -> None:
        """
        The protocol wants no more: what is held is dropped, and an end
        that was waiting for it says the body was not all delivered.
        """
        self._stopped = True
        self._paused = False
        self._held = []
        if self._end is not None:
            self._end = Failure(ConnectionAborted())
            self._flush()


@implementer(IPushProducer)
class _BodyProducer:
    """
    The transport of a body's protocol: pauses and resumes the answer (what
    was read already waits in it) and, while the connection still carries
    this answer, the connection's reading too.
    """

    def __init__(self, connection: _Connection, answer: UpstreamAnswer) -> None:
        self._connection = connection
        self._answer = answer

    def _current(self) -> bool:
        return self._connection.answer is self._answer

    def pauseProducing(self) -> None:
        self._answer._pause()
        if self._current():
            self._connection.pauseReading()

    def resumeProducing(self) -> None:
        self._answer._resume()
        if self._current() and not self._answer._paused:
            self._connection.resumeReading()

    def stopProducing(self) -> None:
        self._answer._stop()
        if self._current():
            self._connection.abort()


class _Stop(Exception):
    """
    Raised from a parser callback to stop reading: bytes after the answer.
    """


class _AnswerReader:
    """
    The callbacks of one connection's llhttp parser (httptools calls them
    by these names), noting what the bytes fed to it said: the final
    answer's head, its body pieces, its end, or why it is refused. The
    connection acts on them once C{feed_data} returns, so that nothing of
    ours (the body's protocol, the pool) runs inside the parser.
    """

    def __init__(self) -> None:
        self.parser = HttpResponseParser(self)
        self.parser.set_dangerous_leniencies(
            # Both Transfer-Encoding and Content-Length: read as chunked
            # (and the connection closed after); llhttp refuses it without
            # this, which changes nothing else.
            lenient_chunked_length=True,
            # An interim answer saying Connection: close is still followed
            # by the final one (read, then the connection closed); without
            # this llhttp refuses any byte after a message that does not
            # keep the connection. It changes nothing else: should_keep_alive
            # still says so, and nothing after the final answer is read
            # (on_message_begin stops it).
            lenient_keep_alive=True,
        )
        self.events = 0
        self.expect()

    def expect(self) -> None:
        """
        A request was written: its answer is read from here.
        """
        self.headers: dict[bytes, list[bytes]] = {}
        self.headBytes = 0
        self.interim = False
        self.interimClose = False
        self.headDone = False
        self.code = 0
        self.chunked = False
        self.chunkSeen = False
        self.untilClose = False
        self.keep = False
        self.complete = False
        self.after = False
        self.fault: BadAnswer | None = None
        self.pieces: list[bytes] = []
        self.trailers = 0

    def refuse(self, why: str) -> BadAnswer:
        self.fault = BadAnswer(why)
        return self.fault

    # httptools' callbacks.

    def on_message_begin(self) -> None:
        self.events += 1
        if self.complete:
            # Bytes after the answer (no request asked for them).
            self.after = True
            raise _Stop()
        self.headers = {}
        self.headBytes = 0

    def on_status(self, reason: bytes) -> None:
        # RFC 9112 section 4: HTAB, SP, VCHAR and obs-text only; llhttp
        # takes any byte but CR and LF (a NUL too). Unused, but a NUL there
        # says the rest cannot be trusted either.
        if _CONTROL.search(reason) is not None:
            raise self.refuse("a control byte in the reason phrase")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.events += 1
        self.headBytes += len(name) + len(value) + 4
        if self.headDone:
            # A trailer: read and dropped.
            self.trailers += 1
            if self.trailers > MAX_TRAILERS or self.headBytes > MAX_HEAD_BYTES:
                raise self.refuse("too many trailers")
            return
        # llhttp leaves the value's trailing whitespace in.
        self.headers.setdefault(name.lower(), []).append(value.rstrip(b" \t"))

    def on_headers_complete(self) -> None:
        self.events += 1
        parser = self.parser
        if self.headBytes > MAX_HEAD_BYTES:
            raise self.refuse("answer head too large")
        if parser.get_http_version() not in _VERSIONS:
            raise self.refuse("not an HTTP/1.1 or HTTP/1.0 answer")
        headers = self.headers
        codings = headers.get(b"transfer-encoding")
        if codings is not None and (len(codings) != 1 or codings[0].lower() != b"chunked"):
            # We ask for no coding: C{gzip, chunked} would be relayed as
            # compressed bytes (llhttp takes any list that ends in chunked).
            raise self.refuse("a transfer coding other than chunked")
        code = parser.get_status_code()
        keep = parser.should_keep_alive()
        if code < 200:
            if code < 100 or code == 101:
                raise self.refuse(f"status {code}")
            # Interim (100 Continue, 103 Early Hints): the answer follows.
            self.interim = True
            self.interimClose = self.interimClose or not keep
            return
        if code not in _NO_BODY:
            if codings is not None:
                self.chunked = True
                if b"content-length" in headers or parser.get_http_version() == "1.0":
                    # RFC 9112 sections 6.1 and 6.3: faulty framing, read
                    # as chunked and closed after.
                    keep = False
            elif b"content-length" not in headers:
                self.untilClose = True
        self.code = code
        self.keep = keep and not self.interimClose
        self.headDone = True

    def on_chunk_header(self) -> None:
        self.events += 1
        self.chunkSeen = True

    def on_body(self, body: bytes) -> None:
        self.events += 1
        if self.chunked and not self.chunkSeen:
            # We read chunked framing where llhttp did not: never relay
            # the chunks' framing as the body.
            raise self.refuse("framing unclear")
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.events += 1
        if self.interim:
            self.interim = False
            return
        self.complete = True


class _Connection(Protocol):
    """
    One connection to a provider: writes a request, reads its answer.
    """

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._reader = _AnswerReader()
        self._asked = False
        self._first = False
        self._headFed = 0
        self._quiet = 0
        self._waiting: Deferred[UpstreamAnswer] | None = None
        self.answer: UpstreamAnswer | None = None
        self._readingPaused = False
        self.idleSince = 0.0
        self.lost = False
        self.closing = False

    def request(self, data: bytes) -> Deferred[UpstreamAnswer]:
        self._asked = True
        self._first = True
        self._reader.expect()
        self._headFed = 0
        self._quiet = 0
        waiting: Deferred[UpstreamAnswer] = Deferred(lambda _: self.abort())
        self._waiting = waiting
        assert self.transport is not None
        self.transport.write(data)
        return waiting

    def abort(self) -> None:
        self.closing = True
        if self.transport is not None and not self.lost:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def pauseReading(self) -> None:
        if not self._readingPaused and self.transport is not None:
            self._readingPaused = True
            self.transport.pauseProducing()  # type: ignore[attr-defined]

    def resumeReading(self) -> None:
        if self._readingPaused and self.transport is not None:
            self._readingPaused = False
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    # Reading the answer.

    def dataReceived(self, data: bytes) -> None:
        if not self._asked:
            # Nothing was asked: a server that talks out of turn.
            self.abort()
            return
        reader = self._reader
        events = reader.events
        if self._first and data[:1] in (b"\r", b"\n"):
            # llhttp skips empty lines before a status line, as a server
            # may before a request line (RFC 9112 section 2.2); an answer
            # has no such leave, and they would hide where it starts.
            reader.refuse("an empty line before the status line")
        else:
            try:
                reader.parser.feed_data(data)
            except (HttpParserError, HttpParserUpgrade) as error:
                if reader.complete:
                    reader.after = True
                elif reader.fault is None:
                    reader.refuse(f"unreadable answer: {error}")
        self._first = False
        if reader.fault is None and not reader.complete:
            self._bound(reader, len(data), events)
        self._act(reader)

    def _bound(self, reader: _AnswerReader, size: int, events: int) -> None:
        """
        What llhttp does not bound: the bytes of an unfinished head, and a
        line after it (a chunk's extensions, a trailer) that goes on for
        read after read without the parser calling back.
        """
        if not reader.headDone:
            self._headFed += size
            if self._headFed > MAX_HEAD_BYTES:
                reader.refuse("answer head too large")
        elif reader.events != events:
            self._quiet = 0
        else:
            self._quiet += size
            if self._quiet > MAX_LINE_BYTES:
                reader.refuse("line too long")

    def _act(self, reader: _AnswerReader) -> None:
        """
        Act on what one read said, in order: the head (the request's
        Deferred fires), the body's bytes, then its end or its fault.
        """
        if self.answer is None and reader.headDone:
            answer = self.answer = UpstreamAnswer(self, reader.code, AnswerHeaders(reader.headers))
            waiting, self._waiting = self._waiting, None
            if waiting is not None and not waiting.called:
                waiting.callback(answer)
        pieces = reader.pieces
        if pieces:
            reader.pieces = []
            if self.answer is not None:
                self.answer._data(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if reader.fault is not None:
            self._fail(Failure(reader.fault))
        elif reader.complete and self._asked:
            self._done(reader)

    def _done(self, reader: _AnswerReader) -> None:
        """
        The answer is whole: the connection goes back to the pool (or is
        closed) before the body's protocol hears of the end, so that the
        request its end lets run can use it.
        """
        self._asked = False
        answer, self.answer = self.answer, None
        if reader.keep and not reader.after and not self.closing and self.transport is not None:
            # Its bytes are all read: whatever paused it paused this answer.
            self.resumeReading()
            self._pool._release(self)
        elif self.transport is not None:
            self.closing = True
            self.transport.loseConnection()
        if answer is not None:
            answer._finished(Failure(ResponseDone()))

    def _fail(self, reason: Failure) -> None:
        self._asked = False
        self.abort()
        waiting, self._waiting = self._waiting, None
        answer, self.answer = self.answer, None
        if waiting is not None and not waiting.called:
            waiting.errback(reason)
        if answer is not None:
            answer._finished(reason)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        self.lost = True
        self._pool._lost(self)
        if not self._asked:
            return
        if self._reader.untilClose and self.answer is not None and reason.check(ConnectionDone):
            # The answer without a length ends when the server closes.
            self._asked = False
            answer, self.answer = self.answer, None
            answer._finished(Failure(PotentialDataLoss()))
            return
        self._fail(reason if not reason.check(ConnectionDone) else Failure(ConnectionLost()))


def _sanitized(value: bytes) -> bytes:
    # As Twisted's Headers does: no header value may end the line early.
    return value.replace(b"\r\n", b" ").replace(b"\r", b" ").replace(b"\n", b" ")


class ConnectionPool:
    """
    The connections to one provider's base URL, and the requests sent over
    them.

    @param url: the full URL requests are sent to (C{https://host/v1/chat/completions})
        unless L{post} names another path on the same server.
    @param fixedHeaders: headers every request carries (C{Content-Type},
        C{Authorization}), written once into the request head.
    @param idleSeconds: how long an idle connection may be used again.
    @param endpoint: where to connect; by default a C{HostnameEndpoint} to
        the URL's host and port (with TLS for C{https}).
    @param trustRoot: the CAs an C{https} provider's certificate must chain
        to (an C{IOpenSSLTrustRoot}, such as a C{twisted.internet.ssl.Certificate});
        by default the platform's.
    """

    def __init__(
        self,
        reactor: Any,
        clock: Clock,
        url: str,
        fixedHeaders: Mapping[bytes, bytes],
        idleSeconds: float,
        connectTimeout: float = 5.0,
        endpoint: IStreamClientEndpoint | None = None,
        trustRoot: Any = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        secure = parts.scheme == "https"
        port = parts.port or (443 if secure else 80)
        host = parts.hostname
        hostHeader = f"[{host}]" if ":" in host else host
        if port != (443 if secure else 80):
            hostHeader += f":{port}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if endpoint is None:
            endpoint = HostnameEndpoint(reactor, host, port, timeout=connectTimeout)
            if secure:
                # The host's certificate checked against the platform's
                # trusted CAs (or C{trustRoot}), as Agent's default policy
                # does.
                endpoint = wrapClientTLS(optionsForClientTLS(host, trustRoot=trustRoot), endpoint)
        self._endpoint = endpoint
        self._clock = clock
        self._idleSeconds = idleSeconds
        # The head after the request line: the same for every path.
        self._fixed = b"Host: %s\r\n%s" % (
            hostHeader.encode("idna"),
            b"".join(
                name + b": " + _sanitized(value) + b"\r\n" for name, value in fixedHeaders.items()
            ),
        )
        self._target = target.encode("ascii")
        # The whole head of each path requests were sent to, made once.
        self._heads: dict[bytes, bytes] = {}
        self._head = self._headOf(self._target)
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self._factory = Factory.forProtocol(lambda: _Connection(self))
        self._closing = False

    def _headOf(self, target: bytes) -> bytes:
        head = self._heads.get(target)
        if head is None:
            if not _TARGET.fullmatch(target):
                raise ValueError(f"not a request target: {target!r}")
            head = self._heads[target] = b"POST %s HTTP/1.1\r\n%s" % (target, self._fixed)
        return head

    def post(
        self, body: bytes, headers: Mapping[bytes, bytes], target: bytes | None = None
    ) -> Deferred[UpstreamAnswer]:
        """
        POST C{body} with C{headers} (besides the fixed ones); fires with
        the answer once its head is read, or fails (the connection could
        not be made, or broke, or the answer is unreadable).

        @param target: the path to post to (C{/v1/embeddings}), when not
            the URL's: the connections are the server's, whatever the path
            (decisions D13: a provider's chat completions and embeddings
            share its pool).
        """
        data = b"".join(
            (
                self._head if target is None else self._headOf(target),
                *(name + b": " + _sanitized(value) + b"\r\n" for name, value in headers.items()),
                b"Content-Length: %d\r\n\r\n" % len(body),
                body,
            )
        )
        connection = self._take()
        if connection is not None:
            return connection.request(data)
        connecting = self._endpoint.connect(self._factory)
        cancelled = False

        def connected(protocol: _Connection) -> Deferred[UpstreamAnswer]:
            self._all.add(protocol)
            return protocol.request(data)

        def notConnected(failure: Failure) -> Failure:
            if cancelled or failure.check(ConnectingCancelledError):
                # Cancelled while connecting (its client went away, or its
                # deadline passed): a cancellation, not a provider's fault,
                # whatever the endpoint failed with (cancelled while it
                # resolves the name, HostnameEndpoint fails with
                # DNSLookupError, which would be taken for the provider's).
                return Failure(CancelledError())
            return failure

        inner: Deferred[UpstreamAnswer] = connecting.addCallbacks(connected, notConnected)

        def cancel(_: Deferred[UpstreamAnswer]) -> None:
            nonlocal cancelled
            cancelled = True
            inner.cancel()

        answer: Deferred[UpstreamAnswer] = Deferred(cancel)
        inner.chainDeferred(answer)
        return answer

    def _take(self) -> _Connection | None:
        now = self._clock.seconds()
        idle = self._idle
        while idle:
            connection = idle.pop()
            if (
                not connection.lost
                and not connection.closing
                and now - connection.idleSince < self._idleSeconds
            ):
                return connection
            connection.abort()
        return None

    def _release(self, connection: _Connection) -> None:
        if self._closing:
            connection.abort()
            return
        connection.idleSince = self._clock.seconds()
        self._idle.append(connection)

    def _lost(self, connection: _Connection) -> None:
        self._all.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)

    def close(self) -> None:
        """
        Close every connection (at shutdown); later answers close theirs.
        """
        self._closing = True
        for connection in list(self._all):
            connection.abort()
        self._idle.clear()

    @property
    def connections(self) -> int:
        """
        How many connections are open, idle or carrying a request.
        """
        return len(self._all)

    @property
    def idleConnections(self) -> int:
        return len(self._idle)
