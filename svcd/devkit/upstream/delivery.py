"""
How a scripted answer is played out, whatever its dialect: L{Answer}
waits, holds, streams at the script's pace (a push producer, so a reader
that stops reading stops it) and misbehaves as the script says, keeping
the request's L{RequestRecord} up to date. The package's manual says what
each directive does.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus

import attrs
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime, ITCPTransport
from twisted.python.failure import Failure
from twisted.web.server import Request
from zope.interface import implementer

from svcd.devkit.upstream.content import ToolCall, echoContent, extractionContent, toolCallOf
from svcd.devkit.upstream.script import Script

# The event interval of never-ending when no gap is given.
NEVER_ENDING_INTERVAL = 0.1

# Without a gap, a stream writes this many events per turn of the reactor,
# so that a fast stream does not keep the reactor from everything else
# (such as noticing that the reader went away).
EVENTS_PER_TURN = 64

# The size of one events:<n> content delta, and of a bytes:<n> stream delta.
EVENT_CONTENT_SIZE = 300
BYTES_DELTA_SIZE = 256

_NOT_JSON = b"this is not JSON"


def setStatus(request: Request, status: int) -> None:
    """
    Set the status with its standard phrase: Twisted knows none for some
    codes (429 would go out as "Unknown Status").
    """
    try:
        phrase = HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        phrase = b"Scripted Status"
    request.setResponseCode(status, phrase)


@attrs.define
class RequestRecord:
    """
    One request of the log, updated while its answer goes on.
    """

    number: int
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: object
    bodyText: str | None
    bodyLength: int
    clientPort: int | None
    arrived: float
    ended: float | None = None
    outcome: str | None = None
    status: int | None = None
    eventsSent: int = 0

    def asJSON(self) -> dict[str, object]:
        return attrs.asdict(self, recurse=False) | {
            "headers": [list(header) for header in self.headers]
        }


@implementer(IPushProducer)
class _StreamPlayer:
    """
    Writes a sequence of events to a request, C{gap} seconds apart or (gap
    0) as fast as the connection takes them, then calls C{onEnd}.

    Registered as the request's push producer: while the transport's buffer
    is full it is paused and writes nothing, which is what lets a test see
    the gateway's backpressure in C{eventsSent}.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        write: Callable[[bytes], None],
        events: Iterator[bytes],
        gap: float,
        onEnd: Callable[[], None],
    ) -> None:
        self._reactor = reactor
        self._write = write
        self._events = events
        self._gap = gap
        self._onEnd = onEnd
        self._paused = False
        self._stopped = False
        self._next: IDelayedCall | None = None

    def start(self) -> None:
        self._writeSome()

    def _writeSome(self) -> None:
        self._next = None
        budget = 1 if self._gap > 0 else EVENTS_PER_TURN
        while budget > 0 and not self._paused and not self._stopped:
            event = next(self._events, None)
            if event is None:
                self._stopped = True
                self._onEnd()
                return
            self._write(event)
            budget -= 1
        self._scheduleNext(self._gap)

    def _scheduleNext(self, delay: float) -> None:
        if self._next is None and not self._paused and not self._stopped:
            self._next = self._reactor.callLater(delay, self._writeSome)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._scheduleNext(0)

    def stopProducing(self) -> None:
        self._stopped = True
        if self._next is not None and self._next.active():
            self._next.cancel()
        self._next = None


class Answer:
    """
    The answer to one request, played out as its script says (its delay,
    hold, gap and faults, whole or streamed), and the bookkeeping of its
    record. A dialect's subclass (L{svcd.devkit.upstream.openai},
    L{svcd.devkit.upstream.anthropic}) gives the shapes: its error, its
    whole answer and its stream's events.
    """

    # The stream events before the first content delta (C{close-mid-stream},
    # C{stall-stream} and C{error-mid-stream} count them): OpenAI's role
    # chunk.
    OPENING_EVENTS = 1
    REQUEST_ID_HEADER = b"x-request-id"
    STREAM_CONTENT_TYPE = b"text/event-stream"
    TOOL_ID_PREFIX = "call_scripted_"

    def __init__(
        self,
        reactor: IReactorTime,
        clock: Callable[[], float],
        request: Request,
        record: RequestRecord,
        script: Script,
    ) -> None:
        self._reactor = reactor
        self._clock = clock
        self._request = request
        self._record = record
        self._script = script
        body = record.body if isinstance(record.body, dict) else {}
        self._body = body
        self._model = str(body.get("model", ""))
        self._stream = body.get("stream") is True
        self._pending: IDelayedCall | None = None
        self._player: _StreamPlayer | None = None
        self._closing = False
        self._gone = False
        request.notifyFinish().addErrback(self._lost)

    # Bookkeeping

    def _lost(self, reason: Failure) -> None:
        """
        The connection went away before the answer finished: stop playing
        the script, and correct the record's outcome when the script itself
        closed the connection. (The record's time and outcome were set by
        L{svcd.devkit.upstream.resource.UpstreamResource}, whose
        notification comes first.)
        """
        self._gone = True
        if self._closing:
            self._record.outcome = "aborted"
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        if self._player is not None:
            self._player.stopProducing()

    def _reset(self) -> None:
        """
        Abort the connection: a TCP reset, whatever is still unsent lost.
        """
        self._closing = True
        ITCPTransport(self._request.transport).abortConnection()

    def _close(self) -> None:
        """
        Close the connection once everything written so far is sent, with
        the answer unfinished (no terminating chunk).
        """
        self._closing = True
        if self._player is not None:
            self._request.unregisterProducer()
        self._request.loseConnection()

    # Playing the script

    def start(self) -> None:
        if self._script.delay > 0:
            self._pending = self._reactor.callLater(self._script.delay, self._answer)
        else:
            self._answer()

    def _answer(self) -> None:
        self._pending = None
        if self._gone:
            return
        kind = self._script.kind
        if kind == "reset":
            self._reset()
        elif kind == "status" or (kind == "error-mid-stream" and not self._stream):
            self._answerError()
        elif kind == "not-json":
            self._answerNotJSON()
        elif self._stream:
            self._answerStream()
        else:
            self._answerWhole()

    def _startAnswer(self, status: int, contentType: bytes) -> None:
        setStatus(self._request, status)
        self._request.setHeader(b"content-type", contentType)
        self._request.setHeader(self.REQUEST_ID_HEADER, b"req_scripted_%d" % self._record.number)
        self._record.status = status

    def _answerNotJSON(self) -> None:
        if self._stream:
            self._startAnswer(200, self.STREAM_CONTENT_TYPE)
            for event in self._notJSONEvents():
                self._writeEvent(event)
        else:
            self._startAnswer(200, b"application/json")
            self._request.write(_NOT_JSON)
        self._request.finish()

    def _content(self) -> tuple[list[str], int]:
        """
        The answer's content as its stream deltas, and the prompt tokens.
        """
        content, promptTokens = self._echo()
        kind, count = self._script.kind, self._script.count
        if kind == "events":
            filler = "x" * (EVENT_CONTENT_SIZE - 14)
            return [f"event {index:06d} {filler} " for index in range(count)], promptTokens
        if kind == "bytes":
            text = "y" * count
            size = BYTES_DELTA_SIZE
            return [text[start : start + size] for start in range(0, count, size)], promptTokens
        extracted = extractionContent(self._body)
        if extracted is not None:
            return [extracted], promptTokens
        return re.findall(r"\S+\s*", content), promptTokens

    def _echo(self) -> tuple[str, int]:
        """
        The echo's content and prompt tokens, as the dialect counts them.
        """
        return echoContent(self._body)

    def _toolCall(self) -> ToolCall | None:
        """
        The tool call of a C{tool-call} answer (L{None} for any other, and
        for one whose conversation ends with a tool's result: an echo).
        """
        if self._script.kind != "tool-call" or self._script.tool is None:
            return None
        callID = f"{self.TOOL_ID_PREFIX}{self._record.number}"
        return toolCallOf(self._body, self._script.tool, callID)

    def _writeWhole(self, answer: bytes) -> None:
        kind = self._script.kind
        if kind == "never-ending":
            # JSON allows any amount of leading whitespace: bytes keep
            # coming and the document never completes.
            self._play(itertools.repeat(b" "), self._script.gap or NEVER_ENDING_INTERVAL, None)
            return
        if kind in ("close-mid-stream", "stall-stream"):
            self._request.write(answer[: len(answer) // 2])
            if kind == "close-mid-stream":
                self._close()
            return
        self._request.write(answer)
        self._request.finish()

    def _answerStream(self) -> None:
        self._startAnswer(200, self.STREAM_CONTENT_TYPE)
        self._request.setHeader(b"cache-control", b"no-cache")
        self._afterHold(self._writeStream)

    def _afterHold(self, writeBody: Callable[[], None]) -> None:
        """
        Write the body now, or with C{hold}, send the headers now and the
        body once the hold is over.
        """
        if self._script.hold <= 0:
            writeBody()
            return
        self._request.write(b"")

        def afterHold() -> None:
            self._pending = None
            if not self._gone:
                writeBody()

        self._pending = self._reactor.callLater(self._script.hold, afterHold)

    def _writeStream(self) -> None:
        deltas, promptTokens = self._content()
        kind = self._script.kind
        gap = self._script.gap or 0.0
        events: Iterator[bytes]
        if kind == "never-ending":
            ticks = (f"tick{index} " for index in itertools.count())
            events = self._streamEvents(ticks, promptTokens)
            self._play(events, self._script.gap or NEVER_ENDING_INTERVAL, None)
        elif kind == "close-mid-stream":
            opening = self.OPENING_EVENTS + 2
            events = itertools.islice(self._streamEvents(deltas, promptTokens), opening)
            self._play(events, gap, self._close)
        elif kind == "stall-stream":
            opening = self.OPENING_EVENTS
            events = itertools.islice(self._streamEvents(deltas, promptTokens), opening)
            self._play(events, gap, lambda: None)
        elif kind == "error-mid-stream":
            opening = self.OPENING_EVENTS + 2
            events = itertools.chain(
                itertools.islice(self._streamEvents(deltas, promptTokens), opening),
                [self._streamError()],
            )
            self._play(events, gap, self._finishStream)
        else:
            self._play(self._streamEvents(deltas, promptTokens), gap, self._finishStream)

    def _finishStream(self) -> None:
        self._request.unregisterProducer()
        self._request.finish()

    def _writeEvent(self, event: bytes) -> None:
        self._record.eventsSent += 1
        self._request.write(event)

    def _play(self, events: Iterator[bytes], gap: float, onEnd: Callable[[], None] | None) -> None:
        """
        Write C{events} through a L{_StreamPlayer}, then C{onEnd} (never,
        when L{None}: the events do not end).
        """
        write = self._writeEvent if self._stream else self._request.write
        self._player = _StreamPlayer(self._reactor, write, events, gap, onEnd or (lambda: None))
        self._request.registerProducer(self._player, True)
        self._player.start()

    # What a dialect gives (L{svcd.devkit.upstream.openai}).

    def _answerError(self) -> None:
        """
        Answer the script's C{status:<code>} with the dialect's error.
        """
        raise NotImplementedError

    def _answerWhole(self) -> None:
        """
        Answer with the dialect's whole (non-streaming) answer, through
        L{_afterHold} and L{_writeWhole}.
        """
        raise NotImplementedError

    def _streamEvents(self, deltas: Iterable[str], promptTokens: int) -> Iterator[bytes]:
        """
        The dialect's stream events carrying C{deltas} (or the tool call of
        L{_toolCall}), in order, the first L{OPENING_EVENTS} of them those
        that open the answer (as C{close-mid-stream}, C{stall-stream} and
        C{error-mid-stream} count them).
        """
        raise NotImplementedError

    def _streamError(self) -> bytes:
        """
        The dialect's error event that ends an C{error-mid-stream} stream.
        """
        raise NotImplementedError

    def _notJSONEvents(self) -> list[bytes]:
        """
        The stream of C{not-json}: an event whose data is no JSON.
        """
        return [b"data: " + _NOT_JSON + b"\n\n", b"data: [DONE]\n\n"]
