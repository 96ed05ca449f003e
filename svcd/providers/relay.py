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

Each read costs in proportion to its size, whatever the events' sizes: the
events of a read are found from offsets into it (each kind of blank line
searched for once per stretch), each sliced out once, and an event that
spans reads is kept as the list of its pieces, joined once when it ends.
The body's reads come from the HTTP/1.1 client whole (one C{dataReceived}
per socket read, however many chunks it held), so that a backlog of small
events after a pause is one write to the client.

Events are relayed as the upstream wrote them, byte for byte, with two
exceptions: the usage event the gateway asked for on the client's behalf
(C{stream_options.include_usage}) is not relayed when the client did not
ask for it, and a fault after the first byte ends the stream with one
error event and no C{[DONE]}. That is an OpenAI-shaped stream relayed as
given; any other (decisions D14: an Anthropic provider's, or one
translated to the client's dialect) goes through a L{Passage}, which says
what each event becomes, with the same backpressure, timeouts and
faults.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from typing import Any, TypeGuard

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from zope.interface import implementer

from svcd.common.clocks import Clock
from svcd.common.errors import ApiError
from svcd.metering.usage import Usage
from svcd.providers.http1 import BadAnswer

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
    if not _count(prompt) or not _count(completion):
        return None
    # Decisions D12: parts of those, when the provider tells them (OpenAI's
    # shape); never more than the whole.
    cached = _detail(usage, "prompt_tokens_details", "cached_tokens", prompt)
    reasoning = _detail(usage, "completion_tokens_details", "reasoning_tokens", completion)
    # Decisions D14: the part written to the provider's cache, which a
    # translated answer carries and some OpenAI-compatible providers send;
    # never more than the prompt's tokens that are not reads.
    written = _detail(usage, "prompt_tokens_details", "cache_write_tokens", prompt - cached)
    return Usage(prompt, completion, cached, reasoning, written)


def embeddingUsageOf(document: object) -> Usage | None:
    """
    The C{usage} of an OpenAI-shaped embeddings answer (decisions D13):
    C{prompt_tokens} (and C{total_tokens}, the same), no completion.
    """
    if not isinstance(document, dict):
        return None
    usage = document.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    if not _count(prompt):
        return None
    return Usage(prompt, 0)


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _detail(usage: dict[str, object], details: str, name: str, whole: int) -> int:
    found = usage.get(details)
    value = found.get(name) if isinstance(found, dict) else None
    return min(value, whole) if _count(value) else 0


def _forgetTransport(protocol: Protocol) -> None:
    """
    Drop a body protocol's transport once its body has ended: the answer
    that delivered it (L{svcd.providers.http1.UpstreamAnswer})
    keeps the protocol, and the transport keeps the answer, so the three
    would wait in a reference cycle for the cycle collector (with a
    stream's relay, the client's whole request with them).
    """
    protocol.transport = None


class StreamFault(Exception):
    """
    The stream failed: C{kind} is C{timeout}, C{broken} (the connection
    ended without the stream's end), C{invalid} (an event past the size
    bound, or bytes that are not readable HTTP/1.1, or an event a
    L{Passage} could not read) or C{error_event} (the provider's own
    error event, decisions D14).

    @ivar error: the gateway's error for the provider's own
        (C{error_event}),
        which the client's error event says; None for the others.
    @ivar overloaded: the provider said it was overloaded (Anthropic's
        C{overloaded_error}).
    @ivar relayed: the provider's error event itself reached the client
        (a stream relayed as given): no error event of the gateway's
        follows it.
    """

    def __init__(
        self,
        kind: str,
        detail: str,
        *,
        error: ApiError | None = None,
        overloaded: bool = False,
        relayed: bool = False,
    ) -> None:
        super().__init__(detail)
        self.kind = kind
        self.error = error
        self.overloaded = overloaded
        self.relayed = relayed


class Passage(typing.Protocol):
    """
    What a relay does with a stream that is not OpenAI's relayed as given
    (decisions D14): each complete event, in order, becomes the events
    written to the client (none, itself, or its translation), and the
    stream's usage is kept as it passes.
    """

    @property
    def usage(self) -> Usage | None:
        """
        The stream's usage so far, for the ledger.
        """

    @property
    def done(self) -> bool:
        """
        Whether the stream has ended (its last event taken).
        """

    def take(self, event: bytes, data: bytes | None) -> list[bytes]:
        """
        The events to write for C{event} (whose C{data:} lines joined are
        C{data}, or None for an event without data), each a whole event.

        @raise StreamFault: the event cannot be read (C{invalid}), or is
            the provider's error (C{error_event}).
        """

    def end(self) -> list[bytes]:
        """
        The events to write when the provider's stream ended cleanly
        before L{done}.

        @raise StreamFault: the stream ended before its answer did.
        """


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
            self.finished.errback(_cutShort(reason, "the answer"))


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
    @param onData: given the data of each event relayed (but C{[DONE]}),
        as it is relayed: how a chat completion that observes gathers its
        answer's text (decisions D13). None for the others, which pay
        nothing for it. Its faults are its own: the first one stops the
        calls, never the stream. Through a L{Passage}, it is given the
        data of each event written to the client (in the client's
        dialect).
    @param passage: what each event becomes, for a stream that is not
        OpenAI's relayed as given (decisions D14); C{relayUsage} then
        means nothing.
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
        onData: Callable[[bytes], None] | None = None,
        passage: Passage | None = None,
    ) -> None:
        self._clock = clock
        self._passage = passage
        # A fault of the passage's, met while taking the events of a read:
        # the stream fails once the events before it are written.
        self._failing: StreamFault | None = None
        self._onData = onData
        self._idleTimeout = idleTimeout
        self._begin = begin
        self._write = write
        self._errorEvent = errorEvent
        self._relayUsage = relayUsage
        # The unfinished event: the pieces of it read so far, their size,
        # their last three bytes (an event's end may start in them) and
        # whether any has a carriage return.
        self._partial: list[bytes] = []
        self._partialSize = 0
        self._tail = b""
        self._partialCR = False
        self._began = False
        self._ended = False
        self._pausedByClient = False
        self.usage: Usage | None = None
        # The model the usage event names (OpenAI's streams relayed as
        # given), for the try's span and metrics.
        self.responseModel: str | None = None
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

        Each byte is copied a bounded number of times whatever the reads'
        sizes: C{data} is scanned from offsets (each separator searched for
        once per stretch, never again over bytes already passed), each event
        sliced out once, and an unfinished event kept as a list of pieces,
        joined once when its end comes. Re-slicing what is left of a buffer
        per event, or adding each read to an unfinished event, copies a read
        of many small events (or an event of many small reads) quadratically.
        """
        if self._ended:
            return
        # One scan for a carriage return tells whether events may end with
        # anything but a bare blank line; most streams never send one.
        anyCR = self._partialCR or b"\r" in data
        ends = _EventEnds(data, anyCR)
        start = 0
        out: list[bytes] = []
        done = False
        if self._partial:
            start = self._partialEnd(data, anyCR, ends)
            if start < 0:
                self._hold(data, anyCR)
                return
            event = b"".join([*self._partial, data[:start]])
            self._partial, self._partialSize, self._tail = [], 0, b""
            self._partialCR = False
            done = self._event(event, out)
        while not done:
            end = ends.after(start)
            if end < 0:
                break
            event = data[start:end]
            start = end
            done = self._event(event, out)
        if out or start:
            self._rearm()
        if out:
            self._write(b"".join(out))
        if done:
            # Written first: the end lets the request finish.
            failing, self._failing = self._failing, None
            if failing is not None:
                self._fail(failing)
            else:
                self._end()
            return
        if start < len(data):
            self._hold(data[start:] if start else data, anyCR)

    def _partialEnd(self, data: bytes, anyCR: bool, ends: _EventEnds) -> int:
        """
        Where in C{data} the unfinished event ends (just past its blank
        line), or -1. Its blank line may start in the event's last three
        bytes (the pieces held have none whole): those are searched with
        C{data}'s first three.
        """
        tail = self._tail
        joint = _EventEnds(tail + data[:3], anyCR)
        end = joint.after(0)
        if 0 <= joint.start < len(tail):
            return end - len(tail)
        return ends.after(0)

    def _hold(self, piece: bytes, anyCR: bool) -> None:
        """
        Keep C{piece} of an unfinished event, within L{MAX_EVENT_BYTES}.
        """
        self._partial.append(piece)
        self._partialSize += len(piece)
        self._tail = (self._tail + piece[-3:])[-3:]
        self._partialCR = anyCR
        if self._partialSize > MAX_EVENT_BYTES:
            self._fail(StreamFault("invalid", f"an event over {MAX_EVENT_BYTES} bytes"))

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        _forgetTransport(self)
        if self._ended:
            return
        if reason.check(ResponseDone) and not b"".join(self._partial).strip():
            # The upstream ended its answer cleanly (with or without
            # [DONE], which would have ended the relay already).
            if self._passage is not None and not self._passage.done:
                self._endPassage(self._passage)
                return
            self._end()
            return
        self._fail(_cutShort(reason, "the upstream's stream"))

    # Events.

    def _event(self, event: bytes, out: list[bytes]) -> bool:
        """
        Take one complete event: note its usage, and add it to C{out} unless
        it is the usage event the client did not ask for. True for the
        stream's end, C{[DONE]}.
        """
        data = _data(event)
        if self._passage is not None:
            return self._pass(self._passage, event, data, out)
        if data is not None and data != DONE and b'"usage"' in data:
            if not self._noteUsage(data):
                return False
        if not self._began:
            self._began = True
            self._begin()
            self.started.callback(None)
        out.append(event)
        if self._onData is not None and data is not None and data != DONE:
            self._feed(data)
        return data == DONE

    def _pass(self, passage: Passage, event: bytes, data: bytes | None, out: list[bytes]) -> bool:
        """
        Take one complete event through the passage: add what it becomes to
        C{out}. True for the stream's end, or for a fault of the passage's
        (kept for L{dataReceived} to fail the stream with, once the events
        before it are written).
        """
        try:
            events = passage.take(event, data)
        except StreamFault as fault:
            self.usage = passage.usage
            if fault.relayed and self._began:
                # The provider's error event, for a client of its dialect.
                out.append(event)
            self._failing = fault
            return True
        self.usage = passage.usage
        self._passed(events, out)
        return passage.done

    def _passed(self, events: list[bytes], out: list[bytes]) -> None:
        """
        Add a passage's C{events} to C{out}: the first commits the client's
        response.
        """
        if not events:
            return
        if not self._began:
            self._began = True
            self._begin()
            self.started.callback(None)
        out.extend(events)
        for each in events:
            if self._onData is None:
                break
            data = _data(each)
            if data is not None and data != DONE:
                self._feed(data)

    def _endPassage(self, passage: Passage) -> None:
        """
        The provider's stream ended cleanly before the passage's end: what
        the passage still has to say, or its fault.
        """
        try:
            events = passage.end()
        except StreamFault as fault:
            self.usage = passage.usage
            self._fail(fault)
            return
        self.usage = passage.usage
        out: list[bytes] = []
        self._passed(events, out)
        if out:
            self._write(b"".join(out))
        self._end()

    def _feed(self, data: bytes) -> None:
        assert self._onData is not None
        try:
            self._onData(data)
        except Exception:
            # A fault of what gathers the text (an event nested past the
            # JSON parser's recursion bound): the answer is relayed all the
            # same, and the rest of it is not gathered.
            self._onData = None

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
        if isinstance(document, dict):
            model = document.get("model")
            if isinstance(model, str):
                self.responseModel = model
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
        if not fault.relayed:
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


def _cutShort(reason: Failure, what: str) -> StreamFault:
    """
    The fault of a body that did not end cleanly: C{invalid} when its
    bytes were not readable HTTP/1.1 (a malformed chunk), else C{broken}.
    """
    if reason.check(BadAnswer):
        return StreamFault("invalid", f"{what} is not readable HTTP/1.1")
    return StreamFault("broken", f"{what} was cut short")


_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")


class _EventEnds:
    """
    The ends of the events of one piece of a stream, found left to right.
    Without C{anyCR} only a bare blank line can end an event, and only it
    is looked for. Each kind of blank line is searched for again only once
    the events taken have passed where it was last found: a search for one
    that is not there (CR LF blank lines in a stream of bare ones) would
    otherwise scan to the piece's end for every event.
    """

    __slots__ = ("_data", "_found", "_separators", "start")

    def __init__(self, data: bytes, anyCR: bool) -> None:
        self._data = data
        self._separators = _SEPARATORS if anyCR else _SEPARATORS[:1]
        # Not searched yet; -1 once a search found none.
        self._found = [-2] * len(self._separators)
        # Where the blank line of the last end found starts.
        self.start = -1

    def after(self, start: int) -> int:
        """
        Just past the first blank line at or after C{start}, or -1 when no
        event completes.
        """
        data, found = self._data, self._found
        best = length = -1
        for kind, separator in enumerate(self._separators):
            index = found[kind]
            if index == -2 or 0 <= index < start:
                index = found[kind] = data.find(separator, start)
            if index >= 0 and (best < 0 or index < best):
                best, length = index, len(separator)
        self.start = best
        return best + length if best >= 0 else -1


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
