"""
The Twisted Web site of svc-proxy: what a connection may cost the proxy.

Four rules, each against a kind of hostile or broken client:

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
    L{LINGER_SECONDS}: closing outright with unread bytes makes the kernel
    send a reset, which can destroy the answer before the client reads it.

Parts of this lean on private attributes of L{HTTPChannel}
(C{_handlingRequest}, C{_dataBuffer}, C{_transferDecoder},
C{_networkProducer}, C{length}); tests/test_hostile_http.py and
tests/test_proxy_site.py exercise each of them over real sockets.
"""

from __future__ import annotations

from io import BytesIO
from typing import Any

from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

DEFAULT_MAX_BODY_BYTES = 1024 * 1024

# A keep-alive connection with nothing to say for this long is closed.
DEFAULT_IDLE_TIMEOUT = 30.0

# A request must arrive whole within this many seconds of the moment its
# connection is ready for it: 1 MiB in 30 s is 35 KB/s, slower than any
# client we serve, while a slow-loris client is cut off.
DEFAULT_REQUEST_TIMEOUT = 30.0

# How long a refused upload is drained after the answer before the
# connection is closed outright.
LINGER_SECONDS = 2.0


_CLOSED = Failure(ConnectionDone())


def _ignore(data: bytes) -> None:
    pass


class ProxyChannel(HTTPChannel):
    """
    An L{HTTPChannel} with a deadline per request, no pipelining, and a
    lingering close after a refused body.

    @ivar requestTimeout: seconds a request may take to arrive whole, or
        L{None} for no limit; set by L{ProxySite}.
    """

    requestTimeout: float | None = DEFAULT_REQUEST_TIMEOUT
    callLater: Any

    _readDeadline: IDelayedCall | None = None
    _lingerCall: IDelayedCall | None = None
    _lingerOnClose = False
    _lingering = False

    # The request deadline.

    def connectionMade(self) -> None:
        super().connectionMade()
        self._armReadDeadline()

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
        if self._handlingRequest or self._lingering:
            return
        # Twisted's own idle timeout: log, close, abort if that hangs.
        self.timeoutConnection()

    def allContentReceived(self) -> None:
        self._disarmReadDeadline()
        # Bytes after the body that came with it (Content-Length shorter
        # than what was sent, or a pipelined request).
        if any(piece.strip(b"\r\n") for piece in self._dataBuffer):
            self._dataBuffer = []
            self._closeAfterAnswer()
        super().allContentReceived()

    def requestDone(self, request: Any) -> None:
        super().requestDone(request)
        if self.persistent and not self._handlingRequest and self.transport is not None:
            self._armReadDeadline()

    # No pipelining.

    def rawDataReceived(self, data: bytes) -> None:
        if self._lingering:
            return
        if self._handlingRequest:
            # The next request, before this one is answered: refused (see
            # the module docstring). A bare CRLF after a body is tolerated.
            if data.strip(b"\r\n"):
                self._closeAfterAnswer()
            return
        super().rawDataReceived(data)

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
        decoder: Any = self._transferDecoder
        if decoder is not None:
            # Ends the decoder's loop over what it holds; it is dropped by
            # allContentReceived below and never fed again.
            decoder.dataCallback = decoder.finishCallback = _ignore
            del decoder._buffer[:]
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

    def _endLinger(self) -> None:
        self._lingerCall = None
        if self.transport is not None:
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = _CLOSED) -> None:
        self._disarmReadDeadline()
        if self._lingerCall is not None and self._lingerCall.active():
            self._lingerCall.cancel()
        self._lingerCall = None
        super().connectionLost(reason)


class BodyLimitedRequest(Request):
    """
    A request that stops buffering its body past the site's limit and
    marks itself C{bodyTooLarge}.
    """

    bodyTooLarge = False
    _bodyBytes = 0
    _body: BytesIO

    def _limit(self) -> int:
        site = getattr(self.channel, "site", None)
        return int(getattr(site, "maxRequestBodyBytes", DEFAULT_MAX_BODY_BYTES))

    def gotLength(self, length: int | None) -> None:
        self.content = self._body = BytesIO()
        if length is not None and length > self._limit():
            self.bodyTooLarge = True
            channel: Any = self.channel
            # Private to HTTPChannel, but the only way to answer before the
            # body: right after gotLength, a length of 0 makes the channel
            # call allContentReceived and so process this request.
            channel.length = 0
            channel.persistent = False
            if isinstance(channel, ProxyChannel):
                channel._lingerOnClose = True
            self.requestHeaders.removeHeader(b"expect")
            self.responseHeaders.setRawHeaders(b"connection", [b"close"])

    def handleContentChunk(self, data: bytes) -> None:
        if self.bodyTooLarge:
            return
        self._bodyBytes += len(data)
        if self._bodyBytes > self._limit():
            self.bodyTooLarge = True
            self.content = self._body = BytesIO()
            channel = self.channel
            if isinstance(channel, ProxyChannel):
                channel.stopReadingBody(self)
            return
        self._body.write(data)


class ProxySite(Site):
    """
    The site of svc-proxy: body-limited requests on L{ProxyChannel}s, and
    no access log of its own (the proxy's logging layer writes one line
    per request).

    @param timeout: idle seconds after which a connection is closed.
    @param requestTimeout: seconds a request may take to arrive whole.
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
        self.noisy = False

    def buildProtocol(self, addr: Any) -> Any:
        channel = super().buildProtocol(addr)
        channel.requestTimeout = self.requestTimeout
        return channel

    def log(self, request: Any) -> None:
        pass
