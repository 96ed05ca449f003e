"""
The stream relay through a passage (decisions D14: an Anthropic stream
relayed as given, or either dialect translated into the other), with a
fake transport and task.Clock: what the client is written, and the relay's
backpressure, idle timeout and client-gone handling kept as they are for a
stream relayed as given (tests/test_proxy_forwarding.py).
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone

from svcd.common.errors import ErrorCode
from svcd.metering.models import ANTHROPIC, Model, Provider
from svcd.metering.usage import Usage
from svcd.providers.passages import (
    Exchange,
    anthropicAsGiven,
    chatOfAnthropic,
    messagesOfOpenAI,
)
from svcd.providers.relay import Passage, StreamFault, StreamRelay

FIRST = 5.0
IDLE = 2.0
MODEL = Model("claude", Provider("claude", "http://127.0.0.1:1/v1", api=ANTHROPIC), "claude-x")


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
class Harness:
    clock: Clock
    transport: FakeTransport
    relay: StreamRelay
    written: list[bytes]
    begun: list[bool]
    gathered: list[bytes]

    def feed(self, *events: dict[str, Any]) -> None:
        self.relay.dataReceived(b"".join(anthropicEvent(event) for event in events))

    def outcome(self, deferred: Any) -> Any:
        found: list[Any] = []
        deferred.addBoth(found.append)
        return found[0] if found else None

    def chunks(self) -> list[Any]:
        out = []
        for block in b"".join(self.written).split(b"\n\n"):
            if block.startswith(b"data: "):
                data = block[6:]
                out.append(data.decode() if data == b"[DONE]" else json.loads(data))
        return out


def anthropicEvent(event: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (event["type"].encode(), json.dumps(event).encode())


def errorName(fault: StreamFault) -> str:
    return fault.error.code.value if fault.error is not None else fault.kind


def harnessFor(passage: Passage) -> Harness:
    clock = Clock()
    transport = FakeTransport()
    written: list[bytes] = []
    begun: list[bool] = []
    gathered: list[bytes] = []
    relay = StreamRelay(
        clock,
        FIRST,
        IDLE,
        lambda: begun.append(True),
        written.append,
        lambda fault: b'data: {"error": "%s"}\n\n' % errorName(fault).encode(),
        False,
        gathered.append,
        passage,
    )
    relay.makeConnection(transport)
    return Harness(clock, transport, relay, written, begun, gathered)


def chatHarness(includeUsage: bool = True) -> Harness:
    document = {"stream_options": {"include_usage": includeUsage}}
    return harnessFor(chatOfAnthropic(Exchange(document, "rid", 1700000000), MODEL))


START: dict[str, Any] = {
    "type": "message_start",
    "message": {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 5,
            "cache_read_input_tokens": 7,
            "cache_creation_input_tokens": 3,
            "output_tokens": 1,
        },
    },
}
BLOCK: dict[str, Any] = {
    "type": "content_block_start",
    "index": 0,
    "content_block": {"type": "text", "text": ""},
}
PING: dict[str, Any] = {"type": "ping"}


def delta(text: str) -> dict[str, Any]:
    return {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": text},
    }


END: list[dict[str, Any]] = [
    {"type": "content_block_stop", "index": 0},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 4},
    },
    {"type": "message_stop"},
]
OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}


def test_translatedStream() -> None:
    """
    Anthropic's events become chunks, the usage chunk and [DONE] at
    message_stop, where the relay ends with the usage of message_start and
    message_delta; what is gathered is the chunks' data.
    """
    harness = chatHarness()
    harness.feed(START, BLOCK, PING, delta("Hello "), delta("world"), *END)
    chunks = harness.chunks()
    assert chunks[-1] == "[DONE]"
    assert (
        "".join(
            chunk["choices"][0]["delta"].get("content") or ""
            for chunk in chunks[:-1]
            if chunk["choices"]
        )
        == "Hello world"
    )
    assert chunks[-2]["usage"]["prompt_tokens"] == 15
    usage = Usage(15, 4, cachedTokens=7, cacheWriteTokens=3)
    assert harness.outcome(harness.relay.finished) == usage
    assert harness.begun == [True]
    assert [json.loads(each) for each in harness.gathered] == chunks[:-1]


def test_pingAloneCommitsNothing() -> None:
    """
    An event that becomes nothing (a ping, a comment) does not commit the
    client's response: a fault after it still allows a fallback.
    """
    harness = chatHarness()
    harness.relay.dataReceived(b": keep-alive\n\n")
    harness.feed(PING)
    assert not harness.begun and not harness.relay.started.called
    harness.feed(OVERLOADED)
    failure = harness.outcome(harness.relay.started)
    assert isinstance(failure, Failure) and isinstance(failure.value, StreamFault)
    assert failure.value.kind == "error_event" and failure.value.overloaded
    assert failure.value.error is not None
    assert failure.value.error.code is ErrorCode.UPSTREAM_ERROR
    assert harness.written == [] and harness.transport.stopped


def test_errorEventAfterTheFirstByte() -> None:
    """
    The provider's error event mid-stream ends the client's stream with
    the client's error event (the provider's mapped error), once the
    events before it are written.
    """
    harness = chatHarness()
    harness.feed(START, BLOCK, delta("Hi"), {"type": "error", "error": {"type": "api_error"}})
    assert harness.chunks()[-1] == {"error": "UPSTREAM_ERROR"}
    assert harness.chunks()[-2]["choices"][0]["delta"] == {"content": "Hi"}
    failure = harness.outcome(harness.relay.finished)
    assert isinstance(failure.value, StreamFault) and failure.value.kind == "error_event"
    assert harness.relay.usage == Usage(15, 1, cachedTokens=7, cacheWriteTokens=3)


def test_backpressureAndIdleTimeout() -> None:
    """
    A client that pauses the stream pauses the upstream, and its pause
    does not count toward the idle timeout; after it, an event that does
    not come within idle_timeout ends the stream as a fault.
    """
    harness = chatHarness()
    harness.feed(START)
    harness.relay.pauseProducing()
    assert harness.transport.paused == 1
    harness.clock.advance(IDLE * 10)
    assert not harness.relay.finished.called
    harness.relay.resumeProducing()
    assert harness.transport.resumed == 1
    harness.clock.advance(IDLE + 0.1)
    failure = harness.outcome(harness.relay.finished)
    assert isinstance(failure.value, StreamFault) and failure.value.kind == "timeout"
    assert harness.written[-1] == b'data: {"error": "timeout"}\n\n'


def test_clientGone() -> None:
    """
    The client going away closes the upstream request at once.
    """
    harness = chatHarness()
    harness.feed(START)
    harness.relay.stopProducing()
    assert harness.transport.stopped
    harness.feed(delta("late"))
    assert len(harness.written) == 1


def test_streamEndedBeforeMessageStop() -> None:
    """
    An Anthropic stream that ends cleanly before message_stop is broken.
    """
    harness = chatHarness()
    harness.feed(START, BLOCK, delta("Hi"))
    harness.relay.connectionLost(Failure(ResponseDone()))
    failure = harness.outcome(harness.relay.finished)
    assert isinstance(failure.value, StreamFault) and failure.value.kind == "broken"


def test_notJSON() -> None:
    """
    An event that is not JSON cannot be translated: invalid.
    """
    harness = chatHarness()
    harness.relay.dataReceived(b"event: message_start\ndata: this is not JSON\n\n")
    failure = harness.outcome(harness.relay.started)
    assert isinstance(failure.value, StreamFault) and failure.value.kind == "invalid"


def test_eventsReadAsJSONReadsBytes() -> None:
    """
    An event's data is read as C{json.loads} reads bytes (the passage skips
    its guess at the encoding for data that can only be UTF-8): text
    beyond ASCII, a lone surrogate (its bytes, or JSON's escape), a BOM
    before the object; bytes that are not UTF-8 are invalid.
    """
    texts = []
    for data in (
        '{"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"é 🙂"}}'.encode(),
        b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"\xed\xa0\x80"}}',
        b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"\\udfff"}}',
        b'\xef\xbb\xbf{"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"bom"}}',
    ):
        harness = chatHarness()
        harness.feed(START, BLOCK)
        harness.relay.dataReceived(b"event: content_block_delta\ndata: " + data + b"\n\n")
        texts.append(harness.chunks()[-1]["choices"][0]["delta"]["content"])
        assert texts[-1] == json.loads(data)["delta"]["text"]
    assert texts == ["é 🙂", "\ud800", "\udfff", "bom"]
    harness = chatHarness()
    harness.relay.dataReceived(b'event: message_start\ndata: {"type":"\xff"}\n\n')
    failure = harness.outcome(harness.relay.started)
    assert isinstance(failure.value, StreamFault) and failure.value.kind == "invalid"


def test_asGiven() -> None:
    """
    An Anthropic stream to a client of its dialect is relayed byte for
    byte, its usage read; the provider's error event is relayed as it came
    and no error event of the gateway's follows it.
    """
    harness = harnessFor(anthropicAsGiven(Exchange({}, "rid", 0), MODEL))
    raw = b"".join(anthropicEvent(event) for event in (START, BLOCK, PING, delta("Hi"), *END))
    for piece in (raw[:10], raw[10:200], raw[200:]):
        harness.relay.dataReceived(piece)
    assert b"".join(harness.written) == raw
    assert harness.outcome(harness.relay.finished) == Usage(15, 4, 7, cacheWriteTokens=3)
    harness = harnessFor(anthropicAsGiven(Exchange({}, "rid", 0), MODEL))
    harness.feed(START, OVERLOADED)
    assert b"".join(harness.written) == anthropicEvent(START) + anthropicEvent(OVERLOADED)
    failure = harness.outcome(harness.relay.finished)
    assert failure.value.relayed and failure.value.overloaded


def test_openAIToMessages() -> None:
    """
    OpenAI's chunks become Anthropic's events, ended by [DONE] (or the
    stream's clean end), the usage the provider's.
    """
    harness = harnessFor(messagesOfOpenAI(Exchange({}, "rid-1", 0), MODEL))
    chunk = {
        "id": "c1",
        "model": "gpt-x",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}],
    }
    final = {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    usage = {"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    harness.relay.dataReceived(
        b"".join(b"data: " + json.dumps(each).encode() + b"\n\n" for each in (chunk, final, usage))
    )
    names = [block.split(b"\n")[0] for block in b"".join(harness.written).split(b"\n\n") if block]
    assert names[0] == b"event: message_start"
    assert names[-2:] == [b"event: message_delta", b"event: message_stop"]
    assert harness.outcome(harness.relay.finished) == Usage(3, 1)
