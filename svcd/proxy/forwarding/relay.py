"""
Reading an upstream's answer: a bounded whole body (non-streaming), or a
stream of server-sent events relayed to the client one event at a time
(decisions D9).

Both read through Twisted's C{IResponse.deliverBody}, on the reactor: no
thread, no buffering of a whole stream. Backpressure runs end to end: the
relay registers itself as the producer of the client's response, so a
client that reads slowly pauses the upstream connection (its transport
stops reading, TCP's window closes, the provider waits), and the proxy
holds at most one event plus a socket buffer per stream, never the answer.

Events are relayed as the upstream wrote them, byte for byte, with two
exceptions: the usage event the gateway asked for on the client's behalf
(C{stream_options.include_usage}) is not relayed when the client did not
ask for it, and a fault after the first byte ends the stream with one
error event and no C{[DONE]}.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from zope.interface import implementer

from svcd.common.clocks import Clock
from svcd.proxy.records import Usage

# A non-streaming answer larger than this is refused (502): chat answers
# are kilobytes; this bounds what one request can make the proxy hold.
MAX_ANSWER_BYTES = 16 * 1024 * 1024

# One event larger than this ends the stream as a fault.
MAX_EVENT_BYTES = 1024 * 1024

DONE = b"[DONE]"


def usageOf(document: object) -> Usage | None:
    """
    The C{usage} of an OpenAI-shaped answer or chunk, when it has one.
    """
    if not isinstance(document, dict):
        return None
    usage = document.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(prompt, completion)


def _forgetTransport(protocol: Protocol) -> None:
    """
    Drop a body protocol's transport once its body has ended: the answer
    that delivered it (L{svcd.proxy.forwarding.http1.UpstreamAnswer})
    keeps the protocol, and the transport keeps the answer, so the three
    would wait in a reference cycle for the cycle collector (with a
    stream's relay, the client's whole request with them).
    """
    protocol.transport = None


class StreamFault(Exception):
    """
    The stream failed: C{kind} is C{timeout}, C{broken} (the connection
    ended without the stream's end) or C{invalid} (an event past the size
    bound).
    """

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class BodyReader(Protocol):
    """
    Collects a whole body of at most C{limit} bytes; C{finished} fires with
    it. Cancelling C{finished} closes the upstream connection.
    """

    def __init__(self, limit: int = MAX_ANSWER_BYTES) -> None:
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0
        self.finished: Deferred[bytes] = Deferred(lambda _: self._stop())

    def _stop(self) -> None:
        transport: Any = self.transport
        if transport is not None:
            transport.stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.finished.called:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._stop()
            self.finished.errback(StreamFault("invalid", f"answer over {self._limit} bytes"))
            return
        self._parts.append(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        _forgetTransport(self)
        if self.finished.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self.finished.callback(b"".join(self._parts))
        else:
            self.finished.errback(StreamFault("broken", "the answer was cut short"))


@implementer(IPushProducer)
class StreamRelay(Protocol):
    """
    Relays an upstream's event stream to the client.

    Until its first event, nothing has reached the client: a fault then is
    reported through C{started} (and the gateway may try a fallback). On
    the first event, C{begin} is called (the client's status line and
    headers) and C{started} fires; from then on each event is written to
    the client as it completes, and C{finished} fires when the stream ends,
    with the upstream's usage if it sent one. A fault after the first event
    writes C{errorEvent(fault)} and ends the stream without C{[DONE]};
    C{finished} then fails with that fault.

    @param write: writes bytes to the client.
    @param begin: commits the client's response (status and headers) and
        registers this relay as its producer.
    @param firstEventTimeout: the longest wait for the first event,
        counted from the relay's creation.
    @param idleTimeout: the longest wait for each later event; time during
        which the client itself paused the stream does not count.
    @param relayUsage: whether the client asked for the usage event.
    """

    def __init__(
        self,
        clock: Clock,
        firstEventTimeout: float,
        idleTimeout: float,
        begin: Callable[[], None],
        write: Callable[[bytes], None],
        errorEvent: Callable[[StreamFault], bytes],
        relayUsage: bool,
    ) -> None:
        self._clock = clock
        self._idleTimeout = idleTimeout
        self._begin = begin
        self._write = write
        self._errorEvent = errorEvent
        self._relayUsage = relayUsage
        self._buffer = b""
        self._began = False
        self._ended = False
        self._pausedByClient = False
        self.usage: Usage | None = None
        self.started: Deferred[None] = Deferred(lambda _: self._stop())
        self.finished: Deferred[Usage | None] = Deferred(lambda _: self._stop())
        self._idle: IDelayedCall | None = clock.callLater(
            firstEventTimeout, self._idleTooLong, firstEventTimeout
        )

    # Timers.

    def _rearm(self) -> None:
        if self._idle is not None and self._idle.active():
            self._idle.cancel()
        self._idle = None
        if not self._ended and not self._pausedByClient:
            self._idle = self._clock.callLater(
                self._idleTimeout, self._idleTooLong, self._idleTimeout
            )

    def _disarm(self) -> None:
        if self._idle is not None and self._idle.active():
            self._idle.cancel()
        self._idle = None

    def _idleTooLong(self, seconds: float) -> None:
        self._idle = None
        self._fail(StreamFault("timeout", f"no event within {seconds} s"))

    # The client's side: IPushProducer.

    def pauseProducing(self) -> None:
        self._pausedByClient = True
        self._disarm()
        transport: Any = self.transport
        if transport is not None:
            transport.pauseProducing()

    def resumeProducing(self) -> None:
        self._pausedByClient = False
        self._rearm()
        transport: Any = self.transport
        if transport is not None:
            transport.resumeProducing()

    def stopProducing(self) -> None:
        """
        The client's connection is going away: close the upstream request
        now. The relay then waits, silent, for the gateway to cancel it
        (the request's end cancels the request's work): failing here, before
        the request itself knows it is over, would be taken for a fault of
        the request.
        """
        if self._ended:
            return
        self._ended = True
        self._disarm()
        self._stopTransport()

    # The upstream's side: IProtocol.

    def dataReceived(self, data: bytes) -> None:
        """
        Relay every event C{data} completes, in one write to the client
        (they arrived together); what is left of an event waits for more.
        """
        if self._ended:
            return
        buffer = self._buffer + data if self._buffer else data
        # One scan for a carriage return tells whether events may end with
        # anything but a bare blank line; most streams never send one.
        anyCR = b"\r" in buffer
        start = 0
        out: list[bytes] = []
        done = False
        while not done:
            end, separator = _eventEnd(buffer, start, anyCR)
            if end < 0:
                break
            event = buffer[start : end + separator]
            start = end + separator
            done = self._event(event, out)
        if out:
            self._write(b"".join(out))
        if done:
            # Written first: the end lets the request finish.
            self._end()
            return
        self._buffer = buffer[start:]
        if len(self._buffer) > MAX_EVENT_BYTES:
            self._fail(StreamFault("invalid", f"an event over {MAX_EVENT_BYTES} bytes"))

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        _forgetTransport(self)
        if self._ended:
            return
        if reason.check(ResponseDone) and not self._buffer.strip():
            # The upstream ended its answer cleanly (with or without
            # [DONE], which would have ended the relay already).
            self._end()
            return
        self._fail(StreamFault("broken", "the upstream's stream was cut short"))

    # Events.

    def _event(self, event: bytes, out: list[bytes]) -> bool:
        """
        Take one complete event: note its usage, and add it to C{out} unless
        it is the usage event the client did not ask for. True for the
        stream's end, C{[DONE]}.
        """
        self._rearm()
        data = _data(event)
        if data is not None and data != DONE and b'"usage"' in data:
            if not self._noteUsage(data):
                return False
        if not self._began:
            self._began = True
            self._begin()
            self.started.callback(None)
        out.append(event)
        return data == DONE

    def _noteUsage(self, data: bytes) -> bool:
        """
        Remember the usage an event carries; False when the event is the
        usage event alone and the client did not ask for it (not relayed).
        """
        if b'"usage":null' in data or b'"usage": null' in data:
            return True
        try:
            document = json.loads(data)
        except ValueError:
            return True
        usage = usageOf(document)
        if usage is None:
            return True
        self.usage = usage
        choices = document.get("choices") if isinstance(document, dict) else None
        return self._relayUsage or bool(choices)

    def _end(self) -> None:
        self._ended = True
        self._disarm()
        if not self._began:
            # A stream that ended before any event: nothing to relay.
            self._began = True
            self._begin()
            self.started.callback(None)
        if not self.finished.called:
            self.finished.callback(self.usage)

    def _fail(self, fault: StreamFault) -> None:
        if self._ended:
            return
        self._ended = True
        self._disarm()
        self._stopTransport()
        if not self._began:
            if not self.started.called:
                self.started.errback(fault)
            return
        self._write(self._errorEvent(fault))
        if not self.finished.called:
            self.finished.errback(fault)

    def _stop(self) -> None:
        """
        Cancelled (the client went away, or the gateway gave up): close the
        upstream request at once.
        """
        if self._ended:
            return
        self._ended = True
        self._disarm()
        self._stopTransport()
        for waiting in (self.started, self.finished):
            if not waiting.called:
                waiting.errback(CancelledError())

    def _stopTransport(self) -> None:
        transport: Any = self.transport
        if transport is not None:
            transport.stopProducing()


def _eventEnd(buffer: bytes, start: int, anyCR: bool) -> tuple[int, int]:
    """
    Where the first complete event of C{buffer} from C{start} ends (the
    blank line that ends it starts there) and the length of that blank
    line; (-1, 0) when no event is complete. Without C{anyCR}, only a bare
    blank line can end an event, and only it is looked for: a search for a
    separator that is not there would scan to the buffer's end for every
    event.
    """
    if not anyCR:
        index = buffer.find(b"\n\n", start)
        return (index, 2) if index >= 0 else (-1, 0)
    candidates = [
        (index, len(separator))
        for separator in (b"\n\n", b"\r\n\r\n", b"\r\r")
        if (index := buffer.find(separator, start)) >= 0
    ]
    if not candidates:
        return -1, 0
    return min(candidates)


def _data(event: bytes) -> bytes | None:
    """
    The data of an event (its C{data:} lines joined), or None for an event
    without data (a comment, a keep-alive).
    """
    lines = [
        line[5:].removeprefix(b" ")
        for line in event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        if line.startswith(b"data:")
    ]
    if not lines:
        return None
    return b"\n".join(lines)
