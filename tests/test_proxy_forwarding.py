"""
The pieces of forwarding alone (svcd/providers/): the stream relay
with a fake transport and task.Clock, the bounded body reader, and the
mapping of upstream answers to the gateway's errors. The whole path with
real processes and the openai SDK is in test_gateway_forwarding.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers

from svcd.common.errors import ErrorCode
from svcd.metering.bodies import attemptBody
from svcd.metering.models import Model, Provider
from svcd.metering.usage import Usage
from svcd.providers.faults import refusalFault
from svcd.providers.relay import (
    MAX_EVENT_BYTES,
    BodyReader,
    StreamFault,
    StreamRelay,
)

FIRST = 5.0
IDLE = 2.0


@attrs.define
class FakeTransport:
    paused: int = 0
    resumed: int = 0
    stopped: bool = False

    def pauseProducing(self) -> None:
        self.paused += 1

    def resumeProducing(self) -> None:
        self.resumed += 1

    def stopProducing(self) -> None:
        self.stopped = True


@attrs.define
class Client:
    written: list[bytes] = attrs.field(factory=list)
    begun: int = 0

    def begin(self) -> None:
        self.begun += 1

    def write(self, data: bytes) -> None:
        self.written.append(data)


@attrs.define
class Harness:
    clock: Clock
    client: Client
    transport: FakeTransport
    relay: StreamRelay

    def outcome(self, deferred: Any) -> Any:
        found: list[Any] = []
        deferred.addBoth(found.append)
        return found[0] if found else None


def fired(deferred: Deferred[Any]) -> bool:
    """
    Whether C{deferred} has fired: a call, so that mypy does not narrow an
    assertion that it has not to every later look at it.
    """
    return deferred.called


def kindOf(failure: Failure) -> str:
    """
    The kind of the L{StreamFault} that C{failure} holds.
    """
    assert isinstance(failure.value, StreamFault)
    return failure.value.kind


def harnessFor(relayUsage: bool = False) -> Harness:
    clock = Clock()
    client = Client()
    transport = FakeTransport()
    relay = StreamRelay(
        clock,
        FIRST,
        IDLE,
        client.begin,
        client.write,
        lambda fault: b'data: {"error": "' + fault.kind.encode() + b'"}\n\n',
        relayUsage,
    )
    relay.makeConnection(transport)
    return Harness(clock, client, transport, relay)


def chunk(content: str, usage: dict[str, int] | None = None, choices: bool = True) -> bytes:
    document: dict[str, Any] = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}}] if choices else [],
        "usage": usage,
    }
    return b"data: " + json.dumps(document).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
USAGE = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}


def test_eventsAreRelayedOneByOneAsTheyComplete() -> None:
    """
    Nothing is written before an event is complete; each complete event is
    written as it was received; the first one commits the client's answer;
    [DONE] ends the stream.
    """
    h = harnessFor()
    first = chunk("Hel")
    h.relay.dataReceived(first[:10])
    assert h.client.written == [] and h.client.begun == 0
    h.relay.dataReceived(first[10:] + chunk("lo")[:5])
    assert h.client.begun == 1 and h.client.written == [first]
    assert h.relay.started.called and h.outcome(h.relay.started) is None
    assert not fired(h.relay.finished)
    h.relay.dataReceived(chunk("lo")[5:] + DONE)
    # Events that complete in one read go out in one write.
    assert h.client.written == [first, chunk("lo") + DONE]
    assert h.relay.finished.called and h.outcome(h.relay.finished) is None


def test_crlfAndCommentEventsPassThrough() -> None:
    """
    Events separated by CRLF blank lines, and comment events (keep-alives),
    are relayed as received.
    """
    h = harnessFor()
    keepAlive = b": keep-alive\r\n\r\n"
    crlf = b'data: {"choices":[]}\r\n\r\n'
    h.relay.dataReceived(keepAlive + crlf + DONE)
    assert b"".join(h.client.written) == keepAlive + crlf + DONE


def test_theUsageEventIsRelayedOnlyWhenTheClientAskedForIt() -> None:
    """
    The usage the gateway asked for is always recorded; its event alone
    (no choices) reaches the client only when the client asked for it.
    """
    for asked in (False, True):
        h = harnessFor(relayUsage=asked)
        content = chunk("x", None)
        usage = chunk("", USAGE, choices=False)
        h.relay.dataReceived(content + usage + DONE)
        expected = [content, usage, DONE] if asked else [content, DONE]
        assert b"".join(h.client.written) == b"".join(expected)
        assert h.outcome(h.relay.finished) == Usage(3, 7)


def test_usageOnAContentChunkIsRecordedAndRelayed() -> None:
    """
    A provider that puts usage on its last content chunk: the chunk is
    relayed (it carries content) and the usage recorded.
    """
    h = harnessFor()
    last = chunk("end", USAGE)
    h.relay.dataReceived(last + DONE)
    assert b"".join(h.client.written) == last + DONE
    assert h.relay.usage == Usage(3, 7)


def test_noFirstEventInTimeIsAFaultBeforeAnyByte() -> None:
    """
    Without a first event within its deadline the relay gives up before
    anything reached the client: `started` fails with a timeout (the
    gateway may try a fallback), the upstream is closed, nothing written.
    """
    h = harnessFor()
    h.clock.advance(FIRST)
    failure = h.outcome(h.relay.started)
    assert isinstance(failure, Failure) and failure.check(StreamFault)
    assert kindOf(failure) == "timeout"
    assert h.transport.stopped
    assert h.client.written == [] and h.client.begun == 0


def test_aGapPastTheIdleTimeoutEndsTheStreamWithOneErrorEvent() -> None:
    """
    After the first event, a gap longer than idle_timeout ends the stream
    with one error event and no [DONE], and closes the upstream.
    """
    h = harnessFor()
    h.relay.dataReceived(chunk("a"))
    h.clock.advance(IDLE - 0.1)
    h.relay.dataReceived(chunk("b"))
    h.clock.advance(IDLE)
    assert h.client.written[-1] == b'data: {"error": "timeout"}\n\n'
    assert DONE not in h.client.written
    assert h.transport.stopped
    failure = h.outcome(h.relay.finished)
    assert isinstance(failure, Failure) and kindOf(failure) == "timeout"


def test_timeThePausedClientTakesDoesNotCount() -> None:
    """
    While the client itself holds the stream back (backpressure), the
    upstream transport is paused and the idle timer does not run.
    """
    h = harnessFor()
    h.relay.dataReceived(chunk("a"))
    h.relay.pauseProducing()
    assert h.transport.paused == 1
    h.clock.advance(IDLE * 10)
    assert not fired(h.relay.finished)
    h.relay.resumeProducing()
    assert h.transport.resumed == 1
    h.clock.advance(IDLE - 0.1)
    h.relay.dataReceived(DONE)
    assert h.relay.finished.called and not isinstance(h.outcome(h.relay.finished), Failure)


def test_aConnectionCutMidStreamEndsWithOneErrorEvent() -> None:
    """
    The upstream connection lost after the first event (not its clean
    end): one error event, no [DONE]; lost before any event: `started`
    fails and nothing is written.
    """
    h = harnessFor()
    h.relay.dataReceived(chunk("a") + b'data: {"partial')
    h.relay.connectionLost(Failure(ConnectionLost()))
    assert h.client.written[-1] == b'data: {"error": "broken"}\n\n'
    assert h.outcome(h.relay.finished).value.kind == "broken"

    early = harnessFor()
    early.relay.connectionLost(Failure(ConnectionLost()))
    assert early.outcome(early.relay.started).value.kind == "broken"
    assert early.client.written == []


def test_aCleanEndWithoutDoneEndsTheStream() -> None:
    """
    An upstream that ends its answer cleanly without [DONE] ends the
    stream the same way: no error event.
    """
    h = harnessFor()
    h.relay.dataReceived(chunk("a"))
    h.relay.connectionLost(Failure(ResponseDone()))
    assert h.client.written == [chunk("a")]
    assert h.relay.finished.called and h.outcome(h.relay.finished) is None


def test_anOversizedEventIsAFault() -> None:
    """
    An event that never ends within MAX_EVENT_BYTES is a fault, so the
    proxy never holds more than that of a stream.
    """
    h = harnessFor()
    h.relay.dataReceived(b"data: " + b"x" * (MAX_EVENT_BYTES + 1))
    assert h.outcome(h.relay.started).value.kind == "invalid"
    assert h.transport.stopped


def test_manyEventsInOneReadGoOutInOneWrite() -> None:
    """
    A large read holding many events is relayed whole, in one write to the
    client, not an event at a time (the relay scans it once; its speed is
    the benchmark's business).
    """
    h = harnessFor()
    events = b"".join(chunk(f"word {each}") for each in range(10_000))
    h.relay.dataReceived(events + DONE)
    assert h.client.written == [events + DONE]
    assert h.relay.finished.called


def test_aClientThatGoesAwayEndsNothingByItself() -> None:
    """
    The client's connection stopping the relay (its producer) closes the
    upstream request at once but fails nothing: the request's own end
    cancels the relay, which then fails with CancelledError, and later
    upstream news writes nothing.
    """
    h = harnessFor()
    h.relay.dataReceived(chunk("a"))
    h.relay.stopProducing()
    assert h.transport.stopped
    assert not h.relay.finished.called
    h.relay.dataReceived(chunk("b"))
    h.relay.connectionLost(Failure(ConnectionLost()))
    assert h.client.written == [chunk("a")]
    assert not h.relay.finished.called
    h.relay.finished.cancel()
    assert h.outcome(h.relay.finished).check(CancelledError)


def test_cancellingClosesTheUpstreamAtOnce() -> None:
    """
    The client went away: cancelling the relay (or the client's stop)
    closes the upstream request at once.
    """
    h = harnessFor()
    h.relay.dataReceived(chunk("a"))
    h.relay.finished.cancel()
    assert h.transport.stopped
    assert h.outcome(h.relay.finished).check(CancelledError)


def test_bodyReaderBoundsTheAnswer() -> None:
    """
    A whole body is collected up to its limit; past it the reader closes
    the upstream and fails; a close without a length (PotentialDataLoss)
    is a normal end; a cut connection is a fault; cancelling closes.
    """
    reader = BodyReader(limit=10)
    transport = FakeTransport()
    reader.makeConnection(transport)
    reader.dataReceived(b"12345")
    reader.dataReceived(b"678901")
    assert transport.stopped
    failures: list[Failure] = []
    reader.finished.addErrback(failures.append)
    assert kindOf(failures[0]) == "invalid"

    whole = BodyReader(limit=10)
    whole.makeConnection(FakeTransport())
    whole.dataReceived(b"abc")
    whole.connectionLost(Failure(PotentialDataLoss()))
    assert whole.finished.result == b"abc"

    cut = BodyReader()
    cut.makeConnection(FakeTransport())
    cut.connectionLost(Failure(ConnectionLost()))
    cut.finished.addErrback(failures.append)
    assert kindOf(failures[-1]) == "broken"

    cancelled = BodyReader()
    closing = FakeTransport()
    cancelled.makeConnection(closing)
    cancelled.finished.cancel()
    cancelled.finished.addErrback(lambda _: None)
    assert closing.stopped


@attrs.define
class FakeResponse:
    code: int
    headers: Headers = attrs.field(factory=Headers)


PROVIDER = Provider(name="p", baseURL="http://127.0.0.1:1/v1", apiKey="sk-secret-key")


@pytest.mark.parametrize(
    ("status", "code", "answered"),
    [
        (500, ErrorCode.UPSTREAM_ERROR, 502),
        (503, ErrorCode.UPSTREAM_ERROR, 502),
        (401, ErrorCode.UPSTREAM_ERROR, 502),
        (403, ErrorCode.UPSTREAM_ERROR, 502),
        (404, ErrorCode.UPSTREAM_ERROR, 502),
        (429, ErrorCode.UPSTREAM_RATE_LIMITED, 429),
        (400, ErrorCode.UPSTREAM_REJECTED, 400),
        (422, ErrorCode.UPSTREAM_REJECTED, 422),
        (409, ErrorCode.UPSTREAM_REJECTED, 409),
        (302, ErrorCode.UPSTREAM_ERROR, 502),
    ],
)
def test_upstreamStatusesMapAsD9Says(status: int, code: ErrorCode, answered: int) -> None:
    """
    Each upstream status becomes D9's code and HTTP status; only
    UPSTREAM_REJECTED keeps the upstream's own 4xx and forbids fallbacks.
    """
    fault = refusalFault(FakeResponse(status), b"{}", PROVIDER)  # type: ignore[arg-type]
    assert fault.error.code is code
    assert fault.error.status == answered
    assert fault.fallback is (code is not ErrorCode.UPSTREAM_REJECTED)
    assert fault.label == str(status)


def test_rejectedCarriesTheUpstreamsMessageWithoutTheKey() -> None:
    """
    UPSTREAM_REJECTED's detail is the upstream's own error message, cut to
    a bounded length, and never the provider's key even if the upstream
    echoes it.
    """
    body = json.dumps(
        {"error": {"message": "bad key sk-secret-key in " + "x" * 5000, "type": "invalid"}}
    ).encode()
    fault = refusalFault(FakeResponse(400), body, PROVIDER)  # type: ignore[arg-type]
    detail = fault.error.detail
    assert isinstance(detail, str) and detail.startswith("bad key [redacted] in")
    assert "sk-secret-key" not in detail
    assert len(detail) <= 1000
    plain = refusalFault(FakeResponse(400), b"plain text refusal", PROVIDER)  # type: ignore[arg-type]
    assert plain.error.detail == "plain text refusal"


def test_retryAfterIsRelayedOnlyWhenSane() -> None:
    """
    A 429's Retry-After is passed on when it is short printable text, and
    left out otherwise (or when absent).
    """
    given = FakeResponse(429, Headers({b"retry-after": [b"7"]}))
    assert refusalFault(given, b"", PROVIDER).error.headers == (("Retry-After", "7"),)  # type: ignore[arg-type]
    absent = refusalFault(FakeResponse(429), b"", PROVIDER)  # type: ignore[arg-type]
    assert absent.error.headers == ()
    hostile = FakeResponse(429, Headers({b"retry-after": [b"7\x00" + b"9" * 100]}))
    assert refusalFault(hostile, b"", PROVIDER).error.headers == ()  # type: ignore[arg-type]


def bestCPUSeconds(run: Callable[[], object], times: int = 3) -> float:
    """
    The least CPU time C{run} took in C{times} runs: the least disturbed by
    other work on the machine.
    """
    best = float("inf")
    for _ in range(times):
        began = time.process_time()
        run()
        best = min(best, time.process_time() - began)
    return best


def test_aReadOfManyCRLFEventsCostsItsSize() -> None:
    """
    One read of many small events ending in CR LF blank lines costs in
    proportion to its size: 16 times the bytes about 16 times the CPU. (A
    search for each kind of blank line from every event's start scanned
    to the read's end for the kinds that were not there: 64 KiB took half
    a second, 256 KiB seven.)
    """

    def relayOnce(size: int) -> Callable[[], object]:
        event = b"data: 1\r\n\r\n"
        data = event * (size // len(event))

        def run() -> None:
            h = harnessFor()
            h.relay.dataReceived(data)
            assert h.client.written == [data]

        return run

    small = bestCPUSeconds(relayOnce(64 * 1024))
    large = bestCPUSeconds(relayOnce(1024 * 1024))
    assert large / max(small, 1e-6) < 48, (small, large)


def test_anEventOfManyReadsCostsItsSize() -> None:
    """
    An event that arrives in many small reads costs in proportion to its
    size, not to its size times its reads: its pieces are kept in a list
    and joined once, not added to what came before at every read.
    """

    def relayOnce(size: int) -> Callable[[], object]:
        event = b"data: " + b"x" * (size - 8) + b"\n\n"
        reads = [event[start : start + 64] for start in range(0, len(event), 64)]

        def run() -> None:
            h = harnessFor()
            for each in reads:
                h.relay.dataReceived(each)
            assert h.client.written == [event]

        return run

    small = bestCPUSeconds(relayOnce(64 * 1024))
    large = bestCPUSeconds(relayOnce(MAX_EVENT_BYTES - 64))
    assert large / max(small, 1e-6) < 48, (small, large)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([b"data: x", b"\n", b"\r", b"\r\n", b": c", DONE, b"data: [DONE]"]),
        max_size=30,
    ),
    st.lists(st.integers(0, 200), max_size=8),
    st.booleans(),
)
def test_howAStreamIsSplitIntoReadsChangesNothing(
    parts: list[bytes], cuts: list[int], relayUsage: bool
) -> None:
    """
    Whatever reads a stream arrives in, the relay writes the same bytes as
    for the stream in one read: the events' ends are found across reads
    (a CR LF CR LF split anywhere) as within one.
    """
    stream = b"".join(parts)
    whole = harnessFor(relayUsage)
    whole.relay.dataReceived(stream)
    points = sorted({cut % (len(stream) + 1) for cut in cuts})
    split = harnessFor(relayUsage)
    for start, end in zip([0, *points], [*points, len(stream)], strict=True):
        if end > start:
            split.relay.dataReceived(stream[start:end])
    assert b"".join(split.client.written) == b"".join(whole.client.written)


# The body of each attempt (decisions D12, amended).


def test_attemptBodyAddsTheCapUnderTheModelsField() -> None:
    """
    With a cap, each model is sent it under its own cap_field, never more
    than its own ceiling; without one, the client's object goes as it was
    (model replaced, include_usage asked for a stream), keys in order.
    """
    provider = Provider(name="p", baseURL="http://127.0.0.1:1/v1")
    newer = Model("new", provider, "up-new", maxOutputTokens=200)
    older = Model("old", provider, "up-old", capField="max_tokens")
    document = {"model": "new", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert attemptBody(document, newer) == (
        b'{"model":"up-new","messages":[{"role":"user","content":"hi"}],"stream":true,'
        b'"stream_options":{"include_usage":true}}'
    )
    assert json.loads(attemptBody(document, newer, 300))["max_completion_tokens"] == 200
    sent = json.loads(attemptBody(document, older, 300))
    assert (sent["max_tokens"], "max_completion_tokens" in sent) == (300, False)
    # Past the default ceiling (no max_output_tokens), the ceiling.
    assert json.loads(attemptBody(document, older, 10**9))["max_tokens"] == 1_048_576
    # The client's object is never changed in place.
    assert document == {
        "model": "new",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
