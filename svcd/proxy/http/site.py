"""
The Twisted Web site of svc-proxy: what a connection may cost the proxy.

Six rules, each against a kind of hostile or broken client:

  - A request body is never buffered past SVC_MAX_REQUEST_BODY_BYTES.
    Twisted's HTTP channel reads a whole body into C{request.content}
    before the resource sees the request; L{BodyLimitedRequest} hooks the
    two moments the channel tells the request about its body:

      - C{gotLength}, right after the headers: a declared Content-Length
        over the limit is answered at once, without reading the body. The
        request is marked, the channel is told the body is empty so it
        hands the request to the resource now, an C{Expect: 100-continue}
        is left unanswered (the client never sends the body), and the
        connection is closed after the answer, since the unread body would
        otherwise be taken for the next request.

      - C{handleContentChunk}, for each piece of body (chunked bodies have
        no length up front): once the total passes the limit, what was
        buffered is dropped, the request is marked and handed to the
        resource at once, and the rest of the body is discarded.

    The chat route's first step answers a marked request 413; the other
    routes read no body and are unaffected.

  - Strangers' bodies are never held (decisions D10). Only the chat
    route reads a body, and only for a bearer token; so a request whose
    Authorization is missing or not of the token's shape
    (C{bodyWanted}, from the edge) is handed to the resource as soon as
    its headers are read, the same way as a refused body above: its
    route answers from the headers alone (413 and 415 first, as the
    spec orders them, then today's 401), and what the client still
    sends is drained and thrown away.

  - The bytes of request bodies held across all connections are capped
    (C{maxBufferedBodyBytes}): a request's declared length is reserved
    when its headers arrive (a chunked body's bytes as they come) and
    given back when it is answered or its client goes away. A body that
    would take the total past the cap is not read, and the request is
    marked C{bodyRefusal}, which the edge answers 503 SERVICE_DEGRADED.

  - A connection that goes quiet is closed after C{timeout} seconds
    (Twisted's default is 12 hours), and a request must arrive whole,
    headers and body, within C{requestTimeout} seconds of the moment the
    connection is ready for it. The idle timeout alone would not do:
    every byte restarts it, so a client sending a byte a second would hold
    its connection (and its buffers) for ever.

  - Bytes that arrive after a complete request, before it is answered,
    are not read as the next request. A client whose Content-Length
    understates its body, or any pipelining client, has its connection
    closed after the first answer instead: a front proxy that framed the
    bytes differently could otherwise smuggle a second request past its
    own checks. No client library of today pipelines, and HTTP/1.1 lets a
    server close instead (RFC 9112, 9.3.2).

  - When the proxy answers before it has read what the client is still
    sending (a refused body, refused pipelined bytes), it closes only its
    sending side first and drains what arrives for up to
    L{LINGER_SECONDS} and at most the body limit's worth of bytes, as
    nginx's lingering close does: closing outright with unread bytes makes
    the kernel send a reset, which can destroy the answer before the
    client reads it.

  - A request refused by the HTTP parser itself gets an answer before
    its connection closes (decisions D10): 414 for a request line over
    16 KiB, 431 for a header line over 16 KiB, a header block over
    C{totalHeadersSize} or more than C{maxHeaders} headers, 400 for the
    rest (a malformed request line or header, control bytes in a header,
    conflicting or negative Content-Length, an unknown transfer coding, a
    malformed chunk). Twisted closes some of these without a word and
    answers the others a bare 400; L{ProtocolErrors} counts each by
    reason and logs each reason at most once a minute, never with the
    bytes received.

When the proxy stops, the site drains its connections
(L{ProxySite.drain}): from then on every answer carries C{Connection:
close} and its connection is closed after it (an answer already being
streamed finishes, then its connection closes); a keep-alive connection
that is idle is closed once its client has been quiet for
L{DRAIN_QUIET_SECONDS} since its last answer and nothing of a next request
has arrived, read or unread. A client that keeps sending requests thus
always gets one answered with C{Connection: close} and opens its next
connection elsewhere; only one that sends at the very instant its idle
connection closes can see it closed under its request, as with any HTTP/1.1
server (RFC 9112, 9.6).

Every status line carries its standard reason phrase (decisions D10):
Twisted's table lacks some (429 would be "Unknown Status"), so
L{BodyLimitedRequest.setResponseCode} takes them from L{http.HTTPStatus}.

Parts of this lean on private names of Twisted Web: every one of them is
reached through L{svcd.common.twistedprivate}, which checks them at
import so that a Twisted without one stops the daemon at start; the two
private methods overridden here (C{_respondToBadRequestAndDisconnect},
C{Request._cleanup}) are checked there too.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from http import HTTPStatus
from io import BytesIO
from typing import Any

from prometheus_client import Counter
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES, HTTPChannel
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from svcd.common.clocks import Clock
from svcd.common.errors import ApiError, ErrorCode
from svcd.common.twistedprivate import (
    answerAfterHeaders,
    bytesAfterRequest,
    dropBytesAfterRequest,
    handlingRequest,
    headerBytesSoFar,
    headerCountSoFar,
    readingRequestLine,
    stopChunkedBody,
)

DEFAULT_MAX_BODY_BYTES = 1024 * 1024

# Decisions D10: SVC_MAX_BUFFERED_BODY_BYTES, the bytes of request bodies
# held across all connections.
DEFAULT_MAX_BUFFERED_BODY_BYTES = 256 * 1024 * 1024

# A keep-alive connection with nothing to say for this long is closed.
DEFAULT_IDLE_TIMEOUT = 30.0

# A request must arrive whole within this many seconds of the moment its
# connection is ready for it: 1 MiB in 30 s is 35 KB/s, slower than any
# client we serve, while a slow-loris client is cut off.
DEFAULT_REQUEST_TIMEOUT = 30.0

# How long a refused upload is drained after the answer before the
# connection is closed outright.
LINGER_SECONDS = 2.0

# While the proxy stops, a keep-alive connection without a request is
# closed once its client has sent nothing for this long since the last
# answer (or since it connected). A client busy on it sends its next
# request well within it, which is answered with Connection: close; closing
# at once would race every such client's next request.
DRAIN_QUIET_SECONDS = 1.0

# Seconds between two log lines about refusals of one reason.
PROTOCOL_ERROR_LOG_INTERVAL = 60.0

# The reasons of svc_proxy_protocol_errors_total, a fixed set, with the
# status each is answered (decisions D10).
REFUSAL_STATUS: dict[str, int] = {
    "request_line_too_long": 414,
    "headers_too_large": 431,
    "too_many_headers": 431,
    "bad_request_line": 400,
    "bad_header": 400,
    "bad_length": 400,
    "bad_chunk": 400,
}

_CLOSED = Failure(ConnectionDone())

# Standard reason phrases: the standard library's table, which knows every
# registered status (Twisted's lacks 429, 431 and others), then Twisted's.
_REASON_PHRASES: dict[int, bytes] = {
    **RESPONSES,
    **{status.value: status.phrase.encode("ascii") for status in HTTPStatus},
}


def reasonPhrase(status: int) -> bytes:
    """
    The standard reason phrase of C{status}; empty (which HTTP/1.1 allows)
    for a status no registry names, such as a provider's own 4xx.
    """
    return _REASON_PHRASES.get(status, b"")


def _everyBody(request: Request) -> bool:
    return True


class ProtocolErrors:
    """
    Requests refused below the application, counted by reason in
    C{svc_proxy_protocol_errors_total} and logged at most once per
    C{interval} seconds per reason, with how many there were since the
    last line: a flood of malformed requests must not become a flood of
    log lines, and the bytes received are never logged.

    @param counter: the labelled counter (label C{reason}), or L{None}.
    """

    log = Logger()

    def __init__(
        self,
        counter: Counter | None,
        clock: Clock,
        interval: float = PROTOCOL_ERROR_LOG_INTERVAL,
    ) -> None:
        self._clock = clock
        self._interval = interval
        self._children = {}
        if counter is not None:
            # Every series exists from the start, at 0.
            self._children = {reason: counter.labels(reason) for reason in REFUSAL_STATUS}
        self._lastLogged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def refused(self, reason: str) -> None:
        child = self._children.get(reason)
        if child is not None:
            child.inc()
        count = self._unlogged.get(reason, 0) + 1
        now = self._clock.seconds()
        last = self._lastLogged.get(reason)
        if last is not None and now - last < self._interval:
            self._unlogged[reason] = count
            return
        self._lastLogged[reason] = now
        self._unlogged[reason] = 0
        self.log.info(
            "Refused {count} request(s) before the application: {reason} ({status})",
            reason=reason,
            status=REFUSAL_STATUS[reason],
            count=count,
        )


class ProxyChannel(HTTPChannel):
    """
    An L{HTTPChannel} with a deadline per request, no pipelining, a
    lingering close after a refused body, and an answer to every request
    its parser refuses.

    @ivar requestTimeout: seconds a request may take to arrive whole, or
        L{None} for no limit; set by L{ProxySite}.
    """

    requestTimeout: float | None = DEFAULT_REQUEST_TIMEOUT
    callLater: Any
    site: Any = None

    _readDeadline: IDelayedCall | None = None
    _lingerCall: IDelayedCall | None = None
    _quietCall: IDelayedCall | None = None
    # Bytes have arrived since the last answer (or the connection began):
    # a request may be on its way even before its request line is whole.
    _heard = False
    _lingerOnClose = False
    _lingering = False
    _drained = 0
    # Why the parser would refuse what it is reading now (REFUSAL_STATUS).
    _refusalReason: str | None = None
    _refused = False

    # The request deadline.

    def connectionMade(self) -> None:
        super().connectionMade()
        self._armReadDeadline()
        site = self.site
        if site is not None and site.draining:
            self.closeWhenDone()

    def _armReadDeadline(self) -> None:
        self._disarmReadDeadline()
        if self.requestTimeout is not None:
            self._readDeadline = self.callLater(self.requestTimeout, self._requestTooSlow)

    def _disarmReadDeadline(self) -> None:
        if self._readDeadline is not None:
            if self._readDeadline.active():
                self._readDeadline.cancel()
            self._readDeadline = None

    def _requestTooSlow(self) -> None:
        self._readDeadline = None
        if handlingRequest(self) or self._lingering:
            return
        # Twisted's own idle timeout: log, close, abort if that hangs.
        self.timeoutConnection()

    def allContentReceived(self) -> None:
        self._disarmReadDeadline()
        # Bytes after the body that came with it (Content-Length shorter
        # than what was sent, or a pipelined request).
        if any(piece.strip(b"\r\n") for piece in bytesAfterRequest(self)):
            dropBytesAfterRequest(self)
            self._closeAfterAnswer()
        super().allContentReceived()

    def requestDone(self, request: Any) -> None:
        # Bytes held back while the request was answered are replayed by
        # HTTPChannel.requestDone, through dataReceived.
        self._heard = False
        super().requestDone(request)
        if self.persistent and not handlingRequest(self) and self.transport is not None:
            self._armReadDeadline()

    # The drain, when the proxy stops.

    def writeHeaders(self, version: bytes, code: bytes, reason: bytes, headers: Any) -> None:
        site = self.site
        if site is not None and site.draining:
            headers.setRawHeaders(b"connection", [b"close"])
            self.persistent = False
        super().writeHeaders(version, code, reason, headers)

    def closeWhenDone(self) -> None:
        """
        The proxy is stopping: close this connection after the answer being
        written, or, idle, once its client is quiet (see the module
        docstring). Answers not begun yet say C{Connection: close}
        (L{writeHeaders}).
        """
        if self.transport is None or self._lingering or self._refused:
            return
        if self.requests:
            if self.requests[0].startedWriting:
                # Its headers went without Connection: close; the
                # connection closes once the answer is complete.
                self.persistent = False
            return
        self._closeWhenQuiet()

    def _closeWhenQuiet(self) -> None:
        self._quietCall = None
        transport: Any = self.transport
        if transport is None or self.requests or self._heard:
            # A request is arriving: it is answered with Connection: close.
            return
        quietFor = self._quietSeconds()
        if quietFor < DRAIN_QUIET_SECONDS:
            self._quietCall = self.callLater(DRAIN_QUIET_SECONDS - quietFor, self._closeWhenQuiet)
            return
        if _unreadBytes(transport):
            # The reactor reads them next, and they are answered as above.
            return
        self.persistent = False
        self.loseConnection()

    def _quietSeconds(self) -> float:
        """
        How long the connection has waited for a request: since its request
        deadline was armed (when it connected or its last answer was sent),
        read off that timer so that the hot path keeps no clock of its own.
        """
        deadline = self._readDeadline
        if deadline is None or not deadline.active() or self.requestTimeout is None:
            return 0.0
        now: float = self.site.reactor.seconds()
        return max(0.0, now - (deadline.getTime() - self.requestTimeout))

    def abort(self) -> bool:
        """
        Close the connection at once (the shutdown timeout has passed);
        True when a request was being read or answered on it.
        """
        busy = bool(self.requests)
        transport: Any = self.transport
        if transport is not None:
            transport.abortConnection()
        return busy

    # Refusals by the parser, answered and counted.

    def dataReceived(self, data: bytes) -> None:
        if self._lingering or self._refused:
            self._drain(data)
            return
        self._heard = True
        super().dataReceived(data)

    def lineReceived(self, line: bytes) -> None:
        if self._refused:
            return
        # What HTTPChannel.lineReceived would refuse this line for; a header
        # line is parsed when the next line arrives (it may continue), so
        # headerReceived narrows the reason down.
        if readingRequestLine(self):
            reason = "bad_request_line"
        elif headerBytesSoFar(self) + len(line) > self.totalHeadersSize:
            reason = "headers_too_large"
        else:
            reason = "bad_header"
        self._refusalReason = reason
        try:
            super().lineReceived(line)
        finally:
            self._refusalReason = None

    def headerReceived(self, line: bytes) -> bool:
        name = line.split(b":", 1)[0].strip().lower()
        if name in (b"content-length", b"transfer-encoding"):
            reason = "bad_length"
        elif headerCountSoFar(self) >= self.maxHeaders:
            reason = "too_many_headers"
        else:
            reason = "bad_header"
        outer, self._refusalReason = self._refusalReason, reason
        try:
            ok: bool = super().headerReceived(line)
            return ok
        finally:
            self._refusalReason = outer

    def lineLengthExceeded(self, line: bytes) -> None:
        # LineReceiver.MAX_LENGTH (16 KiB) without a line end.
        if readingRequestLine(self):
            self._refuse("request_line_too_long")
        else:
            self._refuse("headers_too_large")

    def _respondToBadRequestAndDisconnect(self) -> None:
        self._refuse(self._refusalReason or "bad_header")

    def _refuse(self, reason: str) -> None:
        """
        Answer a request the parser refused, then close after a lingering
        drain, and count it.
        """
        if self._refused:
            return
        self._refused = True
        status = REFUSAL_STATUS[reason]
        transport: Any = self.transport
        if transport is None:
            return
        transport.write(
            b"HTTP/1.1 %d %s\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
            % (status, reasonPhrase(status))
        )
        site = self.site
        if site is not None and site.protocolErrors is not None:
            site.protocolErrors.refused(reason)
        self.persistent = False
        self._lingerOnClose = True
        self.loseConnection()

    # No pipelining.

    def rawDataReceived(self, data: bytes) -> None:
        if self._lingering or self._refused:
            return
        if handlingRequest(self):
            # The next request, before this one is answered: refused (see
            # the module docstring). A bare CRLF after a body is tolerated.
            if data.strip(b"\r\n"):
                self._closeAfterAnswer()
            return
        self._refusalReason = "bad_chunk"
        try:
            super().rawDataReceived(data)
        finally:
            self._refusalReason = None

    def _closeAfterAnswer(self) -> None:
        self.persistent = False
        self._lingerOnClose = True
        if self.requests:
            current: Any = self.requests[-1]
            if not current.startedWriting:
                current.responseHeaders.setRawHeaders(b"connection", [b"close"])

    # A refused chunked body.

    def stopReadingBody(self, request: Request) -> None:
        """
        Hand C{request} to the resource now, with the body read so far,
        and discard the rest of its body (called from inside the chunked
        decoder, by L{BodyLimitedRequest}).
        """
        # The decoder is dropped by allContentReceived below and never fed
        # again.
        stopChunkedBody(self)
        self._closeAfterAnswer()
        request.requestHeaders.removeHeader(b"expect")
        self.allContentReceived()

    # Lingering close.

    def loseConnection(self) -> None:
        transport: Any = self.transport
        if not self._lingerOnClose or transport is None or self._lingering:
            super().loseConnection()
            return
        loseWriteConnection = getattr(transport, "loseWriteConnection", None)
        if loseWriteConnection is None:
            super().loseConnection()
            return
        self._lingering = True
        self._disarmReadDeadline()
        self.setTimeout(None)
        # As HTTPChannel.loseConnection: the channel stops being the
        # transport's producer.
        transport.unregisterProducer()
        loseWriteConnection()
        transport.resumeProducing()
        self._lingerCall = self.callLater(LINGER_SECONDS, self._endLinger)

    def _drain(self, data: bytes) -> None:
        # What a refused client still sends is thrown away, up to the body
        # limit's worth; past that, the connection is closed outright.
        self._drained += len(data)
        site = self.site
        limit = getattr(site, "maxRequestBodyBytes", DEFAULT_MAX_BODY_BYTES)
        if self._lingering and self._drained > limit:
            self._endLinger()

    def _endLinger(self) -> None:
        if self._lingerCall is not None and self._lingerCall.active():
            self._lingerCall.cancel()
        self._lingerCall = None
        if self.transport is not None:
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = _CLOSED) -> None:
        self._disarmReadDeadline()
        if self._lingerCall is not None and self._lingerCall.active():
            self._lingerCall.cancel()
        self._lingerCall = None
        if self._quietCall is not None and self._quietCall.active():
            self._quietCall.cancel()
        self._quietCall = None
        super().connectionLost(reason)
        site = self.site
        if site is not None:
            site.connectionClosed(self)


class BodyLimitedRequest(Request):
    """
    A request that holds its body only when its site wants it and has room
    for it, never past the body limit, and that answers with standard
    reason phrases.

    @ivar bodyTooLarge: the body passes the body limit (413).
    @ivar bodyRefusal: the error the edge answers without reading the
        body, or L{None}.
    """

    bodyTooLarge = False
    bodyRefusal: ApiError | None = None
    _bodyBytes = 0
    _heldBytes = 0
    _heldBy: ProxySite | None = None
    _chunked = False
    _body: BytesIO

    def _site(self) -> Any:
        return getattr(self.channel, "site", None)

    def _limit(self) -> int:
        return int(getattr(self._site(), "maxRequestBodyBytes", DEFAULT_MAX_BODY_BYTES))

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        super().setResponseCode(code, reasonPhrase(code) if message is None else message)

    def gotLength(self, length: int | None) -> None:
        self.content = self._body = BytesIO()
        if length == 0:
            return
        site = self._site()
        if length is not None and length > self._limit():
            self.bodyTooLarge = True
            self._leaveBodyUnread()
        elif not getattr(site, "bodyWanted", _everyBody)(self):
            # A stranger's body (see the module docstring).
            self._leaveBodyUnread()
        elif isinstance(site, ProxySite) and not site.reserveBody(self, length or 0):
            self.bodyRefusal = _heldBodiesFull()
            self._leaveBodyUnread()
        else:
            self._chunked = length is None

    def _leaveBodyUnread(self) -> None:
        """
        Have the channel hand this request to the resource right after its
        headers, and close the connection after the answer.
        """
        channel: Any = self.channel
        answerAfterHeaders(channel)
        channel.persistent = False
        if isinstance(channel, ProxyChannel):
            channel._lingerOnClose = True
        # An Expect: 100-continue is left unanswered: the body is never
        # asked for.
        self.requestHeaders.removeHeader(b"expect")
        self.responseHeaders.setRawHeaders(b"connection", [b"close"])

    def handleContentChunk(self, data: bytes) -> None:
        if self.bodyTooLarge or self.bodyRefusal is not None:
            return
        self._bodyBytes += len(data)
        if self._bodyBytes > self._limit():
            self.bodyTooLarge = True
            self._stopReading()
            return
        site = self._site()
        if self._chunked and isinstance(site, ProxySite):
            if not site.reserveBody(self, len(data)):
                self.bodyRefusal = _heldBodiesFull()
                self._stopReading()
                return
        self._body.write(data)

    def _stopReading(self) -> None:
        self.content = self._body = BytesIO()
        self.releaseBody()
        channel = self.channel
        if isinstance(channel, ProxyChannel):
            channel.stopReadingBody(self)

    def holdBody(self, site: ProxySite, size: int) -> None:
        self._heldBy = site
        self._heldBytes += size

    def releaseBody(self) -> None:
        """
        Give back what this request's body holds of its site's cap (at its
        answer, when its client goes away, or when its body is dropped).
        """
        held, self._heldBytes = self._heldBytes, 0
        if held and self._heldBy is not None:
            self._heldBy.bufferedBodyBytes -= held

    def _cleanup(self) -> None:
        self.releaseBody()
        super()._cleanup()

    def connectionLost(self, reason: Failure) -> None:
        super().connectionLost(reason)
        self.releaseBody()


def _unreadBytes(transport: Any) -> bool:
    """
    Has the client sent bytes that the reactor has not read yet? A peek
    at the socket, which leaves them for the reactor; a transport without
    a socket has none.
    """
    getHandle = getattr(transport, "getHandle", None)
    if getHandle is None:
        return False
    try:
        return bool(getHandle().recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        # Reset or otherwise broken: nothing to read, the close goes on.
        return False


def _heldBodiesFull() -> ApiError:
    return ApiError(
        ErrorCode.SERVICE_DEGRADED,
        "The gateway holds too many request bodies; try again shortly.",
    )


class ProxySite(Site):
    """
    The site of svc-proxy: body-limited requests on L{ProxyChannel}s, and
    no access log of its own (the proxy's logging layer writes one line
    per request).

    @param timeout: idle seconds after which a connection is closed.
    @param requestTimeout: seconds a request may take to arrive whole.
    @param maxBufferedBodyBytes: the bytes of request bodies held across
        all connections.
    @param bodyWanted: whether a request's body is worth reading, from its
        headers alone (the edge: a bearer of the token's shape); by
        default every body is.
    @param protocolErrors: counts and logs the parser's refusals.
    """

    requestFactory = BodyLimitedRequest
    protocol = ProxyChannel  # type: ignore[assignment]

    def __init__(
        self,
        resource: IResource,
        maxRequestBodyBytes: int,
        reactor: IReactorTime | None = None,
        *,
        timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        requestTimeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        maxBufferedBodyBytes: int = DEFAULT_MAX_BUFFERED_BODY_BYTES,
        bodyWanted: Callable[[Request], bool] = _everyBody,
        protocolErrors: ProtocolErrors | None = None,
    ) -> None:
        # parsePOSTFormSubmission=False (Twisted 25.5 and later): the proxy
        # reads JSON bodies only.
        # Twisted would otherwise parse every POST's Content-Type with the
        # email package to look for form uploads, which cost about a tenth
        # of the proxy's reactor thread in the chat benchmark.
        super().__init__(  # type: ignore[no-untyped-call, unused-ignore]
            resource, reactor=reactor, timeout=timeout, parsePOSTFormSubmission=False
        )
        self.maxRequestBodyBytes = maxRequestBodyBytes
        self.requestTimeout = requestTimeout
        self.maxBufferedBodyBytes = maxBufferedBodyBytes
        self.bufferedBodyBytes = 0
        self.bodyWanted = bodyWanted
        self.protocolErrors = protocolErrors
        self.noisy = False
        # Open connections, so that a stop can drain them.
        self.draining = False
        self._connections: set[ProxyChannel] = set()
        self._drained: list[Deferred[None]] = []

    def reserveBody(self, request: BodyLimitedRequest, size: int) -> bool:
        """
        Count C{size} more bytes held for C{request}'s body, unless that
        would take the total past the cap. A chunked body (no length yet)
        is admitted while the total is under the cap.
        """
        if size == 0:
            return self.bufferedBodyBytes < self.maxBufferedBodyBytes
        if self.bufferedBodyBytes + size > self.maxBufferedBodyBytes:
            return False
        self.bufferedBodyBytes += size
        request.holdBody(self, size)
        return True

    def buildProtocol(self, addr: Any) -> Any:
        channel = super().buildProtocol(addr)
        channel.requestTimeout = self.requestTimeout
        self._connections.add(channel)
        return channel

    # The drain (see the module docstring).

    @property
    def openConnections(self) -> int:
        return len(self._connections)

    def connectionClosed(self, channel: ProxyChannel) -> None:
        """
        C{channel}'s connection is closed.
        """
        self._connections.discard(channel)
        if not self._connections and self._drained:
            waiting, self._drained = self._drained, []
            for each in waiting:
                each.callback(None)

    def drain(self) -> None:
        """
        Begin closing every connection as its answers end: from now on each
        answer says C{Connection: close}, and idle connections close once
        their client is quiet.
        """
        self.draining = True
        for channel in list(self._connections):
            channel.closeWhenDone()

    def whenDrained(self) -> Deferred[None]:
        """
        A Deferred that fires once no connection is open; cancelling it
        withdraws it.
        """

        def withdraw(waiter: Deferred[None]) -> None:
            if waiter in self._drained:
                self._drained.remove(waiter)

        drained: Deferred[None] = Deferred(withdraw)
        if self._connections:
            self._drained.append(drained)
        else:
            drained.callback(None)
        return drained

    def closeConnections(self) -> tuple[int, int]:
        """
        Close every connection still open, at once: how many, and how many
        of them were reading or answering a request.
        """
        channels = list(self._connections)
        busy = sum(channel.abort() for channel in channels)
        return len(channels), busy

    def log(self, request: Any) -> None:
        pass
