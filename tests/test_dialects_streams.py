"""
Streamed answers between the dialects (svcd.dialects.streams): Anthropic's
events as OpenAI's chunks and OpenAI's chunks as Anthropic's events, one at
a time; a tool call streamed in pieces; usage with cache reads and writes;
the provider's errors. What is made is read by the official SDKs
themselves (Anthropic's C{messages.stream} accumulator, OpenAI's
C{chat.completions.stream}), over an in-memory transport; and as
properties, a streamed answer, translated, accumulates to what the
translation of the whole answer is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from anthropic.types import Message
from dialectstrategies import ANTHROPIC_EVENT, anthropicMessages, openAICompletions
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from svcd.common.errors import ErrorCode
from svcd.dialects.answers import anthropicMessageOf, chatCompletionOf
from svcd.dialects.errors import BadAnswer, UpstreamStreamError
from svcd.dialects.streams import (
    DONE,
    ChatChunkStream,
    MessageEventStream,
    chunkBytes,
    eventBytes,
)
from svcd.dialects.turns import INVALID_ARGUMENTS_KEY
from svcd.dialects.usage import TokenUsage

CREATED = 1_700_000_000


class Upstream:
    """
    The bytes an SDK client reads as its server's answer: an in-memory
    transport, no socket.
    """

    def __init__(self) -> None:
        self.body = b""

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(
            200, headers={"content-type": "text/event-stream"}, content=self.body
        )

    def anthropicClient(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            api_key="k",
            base_url="http://upstream.test",
            http_client=httpx2.Client(transport=httpx2.MockTransport(self.handle)),
            max_retries=0,
        )

    def openAIClient(self) -> openai.OpenAI:
        return openai.OpenAI(
            api_key="k",
            base_url="http://upstream.test/v1",
            http_client=httpx2.Client(transport=httpx2.MockTransport(self.handle)),
            max_retries=0,
        )


@pytest.fixture
def upstream() -> Upstream:
    return Upstream()


def toChunks(events: list[dict[str, Any]], includeUsage: bool = True) -> list[dict[str, Any]]:
    stream = ChatChunkStream(created=CREATED, includeUsage=includeUsage)
    chunks = [chunk for event in events for chunk in stream.feed(event)]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    return chunks


def toEvents(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stream = MessageEventStream(messageID="msg_fallback", model="fallback")
    events = [event for chunk in chunks for event in stream.feed(chunk)]
    events.extend(stream.end())
    for event in events:
        ANTHROPIC_EVENT.validate_python(event)
    return events


def readByAnthropic(upstream: Upstream, events: list[dict[str, Any]]) -> tuple[str, Any]:
    """
    The text and final message Anthropic's SDK makes of C{events}.
    """
    upstream.body = b"".join(eventBytes(event) for event in events)
    client = upstream.anthropicClient()
    with client.messages.stream(
        model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}]
    ) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def readByOpenAI(upstream: Upstream, chunks: list[dict[str, Any]]) -> Any:
    """
    The completion OpenAI's SDK puts together of C{chunks} (its stream's
    accumulator; its final completion would refuse a C{length} finish).
    """
    upstream.body = b"".join(chunkBytes(chunk) for chunk in chunks) + DONE
    client = upstream.openAIClient()
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=True
    ):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def pieces(text: str, cuts: list[int]) -> Iterator[str]:
    """
    C{text} cut where C{cuts} say, without empty pieces.
    """
    start = 0
    for cut in sorted(set(cuts)):
        if start < cut < len(text):
            yield text[start:cut]
            start = cut
    if start < len(text):
        yield text[start:]


# Anthropic's events, as Anthropic streams a message.


def anthropicEventsOf(
    message: dict[str, Any], cutsOf: Any = lambda text: []
) -> list[dict[str, Any]]:
    usage = message["usage"]
    start = dict(
        message,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=dict(usage, output_tokens=1),
    )
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}, {"type": "ping"}]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            first: dict[str, Any] = {"type": "text", "text": ""}
            kind, key, whole = "text_delta", "text", block["text"]
        else:
            first = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            kind, key, whole = "input_json_delta", "partial_json", json.dumps(block["input"])
        events.append({"type": "content_block_start", "index": index, "content_block": first})
        for piece in pieces(whole, cutsOf(whole)):
            events.append(
                {"type": "content_block_delta", "index": index, "delta": {"type": kind, key: piece}}
            )
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": message["stop_reason"],
                "stop_sequence": message["stop_sequence"],
            },
            "usage": {"output_tokens": usage["output_tokens"]},
        }
    )
    events.append({"type": "message_stop"})
    return events


def test_textStreamToChunks() -> None:
    """
    message_start is the role chunk, text deltas content deltas,
    message_delta the finish reason, message_stop the usage chunk; ping
    and block starts and stops send nothing.
    """
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [{"type": "text", "text": "Hello world"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 9,
            "cache_read_input_tokens": 100,
            "cache_creation_input_tokens": 0,
            "output_tokens": 4,
        },
    }
    chunks = toChunks(anthropicEventsOf(message, lambda text: [5]))

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": "msg_1",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": "claude-x",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    assert chunks == [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hello"}),
        chunk({"content": " world"}),
        chunk({}, "stop"),
        {
            "id": "msg_1",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": "claude-x",
            "choices": [],
            "usage": {
                "prompt_tokens": 109,
                "completion_tokens": 4,
                "total_tokens": 113,
                "prompt_tokens_details": {"cached_tokens": 100, "cache_write_tokens": 0},
            },
        },
    ]
    assert (
        toChunks(anthropicEventsOf(message), includeUsage=False)[-1]["choices"][0]["finish_reason"]
        == "stop"
    )


def test_toolCallStreamedInPiecesToChunks(upstream: Upstream) -> None:
    """
    A tool_use block is a tool call: its id and name first, then its
    arguments as Anthropic streams them, under the index of the tool call
    (not of the block); a tool without input gets {} as arguments.
    OpenAI's SDK puts it together.
    """
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": {
                "id": "msg_2",
                "type": "message",
                "role": "assistant",
                "model": "claude-x",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": 50,
                    "cache_creation_input_tokens": 2000,
                    "output_tokens": 1,
                },
            },
        },
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "Let me"},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "text_delta", "text": "Looking."},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": ""},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": '{"ci'},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": 'ty": "Oslo"}'},
        },
        {"type": "content_block_stop", "index": 2},
        {
            "type": "content_block_start",
            "index": 3,
            "content_block": {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}},
        },
        {"type": "content_block_stop", "index": 3},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 61},
        },
        {"type": "message_stop"},
    ]
    chunks = toChunks(events)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert deltas[2:] == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]},
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "now", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
        {},
    ]
    final = readByOpenAI(upstream, chunks)
    choice = final.choices[0]
    assert choice.message.content == "Looking."
    assert choice.finish_reason == "tool_calls"
    assert [
        (call.id, call.function.name, json.loads(call.function.arguments))
        for call in choice.message.tool_calls
    ] == [
        ("toolu_1", "weather", {"city": "Oslo"}),
        ("toolu_2", "now", {}),
    ]
    assert final.usage is not None and final.usage.prompt_tokens == 2050
    assert final.usage.completion_tokens == 61
    assert final.usage.prompt_tokens_details is not None
    assert final.usage.prompt_tokens_details.cache_write_tokens == 2000


def test_chunkStreamUsage() -> None:
    """
    The stream's usage, for the ledger: message_start's, then
    message_delta's totals (a late count of cache reads included).
    """
    stream = ChatChunkStream(created=CREATED, includeUsage=False)
    stream.feed(
        {
            "type": "message_start",
            "message": {
                "id": "m",
                "model": "x",
                "usage": {"input_tokens": 7, "cache_read_input_tokens": 3, "output_tokens": 1},
            },
        }
    )
    assert stream.usage == TokenUsage(inputTokens=7, cacheReadTokens=3, outputTokens=1)
    stream.feed(
        {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens"},
            "usage": {"output_tokens": 20, "cache_creation_input_tokens": 5},
        }
    )
    assert stream.usage == TokenUsage(
        inputTokens=7, cacheReadTokens=3, cacheWriteTokens=5, outputTokens=20
    )
    assert stream.feed({"type": "message_stop"}) == [] and stream.finished


def test_stopSequenceStreamToChunks() -> None:
    """
    A stop sequence is the finish chunk's stop_reason, as in answers.
    """
    stream = ChatChunkStream(created=CREATED, includeUsage=False)
    stream.feed({"type": "message_start", "message": {"id": "m", "model": "x", "usage": {}}})
    [chunk] = stream.feed(
        {
            "type": "message_delta",
            "delta": {"stop_reason": "stop_sequence", "stop_sequence": "END"},
            "usage": {"output_tokens": 2},
        }
    )
    assert chunk["choices"][0]["finish_reason"] == "stop"
    assert chunk["choices"][0]["stop_reason"] == "END"


@pytest.mark.parametrize(
    ("kind", "code", "overloaded"),
    [
        ("overloaded_error", ErrorCode.UPSTREAM_ERROR, True),
        ("api_error", ErrorCode.UPSTREAM_ERROR, False),
        ("rate_limit_error", ErrorCode.UPSTREAM_RATE_LIMITED, False),
        ("invalid_request_error", ErrorCode.UPSTREAM_REJECTED, False),
        ("timeout_error", ErrorCode.UPSTREAM_TIMEOUT, False),
    ],
)
def test_errorEventToChunks(kind: str, code: ErrorCode, overloaded: bool) -> None:
    """
    Anthropic's error event mid-stream is the gateway's error of the
    provider's (the route ends the stream with its fault event).
    """
    stream = ChatChunkStream(created=CREATED, includeUsage=True)
    stream.feed({"type": "message_start", "message": {"id": "m", "model": "x", "usage": {}}})
    with pytest.raises(UpstreamStreamError) as caught:
        stream.feed({"type": "error", "error": {"type": kind, "message": "Overloaded"}})
    assert caught.value.apiError.code is code
    assert caught.value.overloaded is overloaded


def test_eventsOutOfShapeOrOrder() -> None:
    """
    An event before message_start, or without its parts, is a BadAnswer;
    unknown events and ping send nothing.
    """
    stream = ChatChunkStream(created=CREATED, includeUsage=True)
    assert stream.feed({"type": "ping"}) == []
    assert stream.feed({"type": "something_new"}) == []
    with pytest.raises(BadAnswer):
        stream.feed(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "x"},
            }
        )
    with pytest.raises(BadAnswer):
        stream.feed({"type": "message_start"})
    stream.feed({"type": "message_start", "message": {"id": "m", "model": "x"}})
    with pytest.raises(BadAnswer):
        stream.feed(
            {"type": "content_block_start", "index": "0", "content_block": {"type": "text"}}
        )
    with pytest.raises(BadAnswer):
        stream.feed(
            {"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use"}}
        )


# OpenAI's chunks, as OpenAI streams a completion.


def openAIChunksOf(
    completion: dict[str, Any], cutsOf: Any = lambda text: []
) -> list[dict[str, Any]]:
    base = {key: completion[key] for key in ("id", "created", "model")} | {
        "object": "chat.completion.chunk"
    }
    choice = completion["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return base | {
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        }

    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks.extend(
        chunk({"content": piece})
        for piece in pieces(message.get("content") or "", cutsOf(message.get("content") or ""))
    )
    for index, call in enumerate(message.get("tool_calls") or ()):
        first = {
            "index": index,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""},
        }
        chunks.append(chunk({"tool_calls": [first]}))
        arguments = call["function"]["arguments"]
        chunks.extend(
            chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            for piece in pieces(arguments, cutsOf(arguments))
        )
    last = chunk({}, choice["finish_reason"])
    if "stop_reason" in choice:
        last["choices"][0]["stop_reason"] = choice["stop_reason"]
    chunks.append(last)
    if "usage" in completion:
        chunks.append(base | {"choices": [], "usage": completion["usage"]})
    return chunks


def test_textChunksToEvents(upstream: Upstream) -> None:
    """
    The first chunk is message_start; text is one text block streamed as
    it comes; the finish reason closes it; message_delta (stop reason and
    usage, which OpenAI sends last) and message_stop follow the usage.
    Anthropic's SDK streams the text and puts the message together.
    """
    completion = {
        "id": "chatcmpl-7",
        "created": CREATED,
        "model": "gpt-x",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi there"},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 30,
            "completion_tokens": 2,
            "total_tokens": 32,
            "prompt_tokens_details": {"cached_tokens": 20},
        },
    }
    events = toEvents(openAIChunksOf(completion, lambda text: [2]))
    assert [event["type"] for event in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["id"] == "chatcmpl-7" and events[0]["message"]["model"] == "gpt-x"
    assert events[5] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {
            "input_tokens": 10,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 20,
            "output_tokens": 2,
        },
    }
    text, final = readByAnthropic(upstream, events)
    assert text == "Hi there"
    assert final.content[0].text == "Hi there" and final.stop_reason == "end_turn"
    assert (
        final.usage.input_tokens,
        final.usage.cache_read_input_tokens,
        final.usage.output_tokens,
    ) == (10, 20, 2)


def test_toolCallChunksInPiecesToEvents(upstream: Upstream) -> None:
    """
    Tool calls streamed in pieces are gathered, and sent once the finish
    reason comes, each one block with its input in one input_json_delta
    (arguments that are not a JSON object kept under a key of their own);
    Anthropic's SDK puts them together.
    """
    chunk = {"id": "c", "created": CREATED, "model": "gpt-x", "object": "chat.completion.chunk"}

    def delta(**fields: Any) -> dict[str, Any]:
        finish = fields.pop("finish", None)
        return chunk | {"choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}

    chunks = [
        delta(role="assistant", content=None),
        delta(content="One moment."),
        delta(
            tool_calls=[
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": ""},
                }
            ]
        ),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
        delta(
            tool_calls=[
                {
                    "index": 1,
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "broken", "arguments": "{no"},
                }
            ]
        ),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]),
        delta(finish="tool_calls"),
        chunk
        | {
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
        },
    ]
    events = toEvents(chunks)
    assert [(event["type"], event.get("index")) for event in events] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert events[5]["delta"] == {"type": "input_json_delta", "partial_json": '{"city":"Oslo"}'}
    _, final = readByAnthropic(upstream, events)
    assert final.stop_reason == "tool_use"
    assert [(block.type, getattr(block, "input", None)) for block in final.content] == [
        ("text", None),
        ("tool_use", {"city": "Oslo"}),
        ("tool_use", {INVALID_ARGUMENTS_KEY: "{no"}),
    ]


def test_eventStreamEnds() -> None:
    """
    Without a usage chunk, the end of the provider's stream sends
    message_delta and message_stop (zero usage); an empty stream is a whole
    empty message; usage in the finish chunk ends at once.
    """
    stream = MessageEventStream(messageID="msg_x", model="m")
    events = stream.end()
    assert [event["type"] for event in events] == ["message_start", "message_delta", "message_stop"]
    assert events[0]["message"]["id"] == "msg_x"
    assert stream.end() == [] and stream.finished
    stream = MessageEventStream(messageID="msg_x", model="m")
    chunk = {
        "id": "c",
        "model": "g",
        "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "length"}],
    }
    events = stream.feed(chunk | {"usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    assert [event["type"] for event in events][-2:] == ["message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert stream.usage == TokenUsage(inputTokens=1, outputTokens=1)
    assert stream.feed(chunk) == [] and stream.end() == []
    # A provider counting in every chunk: the answer ends with the usage
    # that comes with or after the finish reason, not before it.
    stream = MessageEventStream(messageID="msg_x", model="m")
    early = {
        "choices": [{"index": 0, "delta": {"content": "a"}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1},
    }
    assert [event["type"] for event in stream.feed(early)][-1] == "content_block_delta"
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    assert [event["type"] for event in stream.feed(finish)] == ["content_block_stop"]
    events = stream.feed({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9}})
    assert events[0]["usage"]["output_tokens"] == 9 and events[1] == {"type": "message_stop"}


def test_refusalAndTextAfterTools() -> None:
    """
    A refusal delta is text and the stop reason refusal; a stop with tool
    calls is tool_use; text after tool calls is a block of its own.
    """
    stream = MessageEventStream(messageID="x", model="m")
    events = stream.feed(
        {"choices": [{"index": 0, "delta": {"refusal": "No."}, "finish_reason": "stop"}]}
    )
    events += stream.end()
    assert events[2]["delta"] == {"type": "text_delta", "text": "No."}
    assert events[-2]["delta"]["stop_reason"] == "refusal"
    stream = MessageEventStream(messageID="x", model="m")
    call = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}
    events = stream.feed({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    events += stream.feed(
        {"choices": [{"index": 0, "delta": {"content": "after"}, "finish_reason": "stop"}]}
    )
    events += stream.end()
    kinds = [
        (event["type"], event.get("index"), event.get("content_block", {}).get("type"))
        for event in events
    ]
    assert kinds == [
        ("message_start", None, None),
        ("content_block_start", 0, "text"),
        ("content_block_delta", 0, None),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "tool_use"),
        ("content_block_stop", 1, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_chunksOutOfShapeOrErrors() -> None:
    """
    An error chunk is the provider's error; a chunk without choices, or a
    tool call without its id or name, is a BadAnswer.
    """
    with pytest.raises(UpstreamStreamError) as caught:
        MessageEventStream(messageID="x", model="m").feed({"error": {"message": "boom"}})
    assert caught.value.apiError.code is ErrorCode.UPSTREAM_ERROR
    with pytest.raises(BadAnswer):
        MessageEventStream(messageID="x", model="m").feed({"id": "c"})
    stream = MessageEventStream(messageID="x", model="m")
    stream.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
                }
            ]
        }
    )
    with pytest.raises(BadAnswer):
        stream.end()


def test_serverSentEventBytes() -> None:
    """
    Anthropic's events are named by their type; OpenAI's chunks are data
    only, the stream ending with [DONE].
    """
    assert eventBytes({"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert chunkBytes({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"


def test_loneSurrogateEscaped() -> None:
    """
    A lone surrogate a provider sent (JSON's escape of one) goes to the
    client escaped as it came: UTF-8 cannot carry it, and the event is
    still written.
    """
    assert chunkBytes({"a": "é\ud800"}) == b'data: {"a":"\\u00e9\\ud800"}\n\n'
    written = eventBytes({"type": "x", "text": "\udfff"})
    assert json.loads(written.split(b"data: ")[1]) == {"type": "x", "text": "\udfff"}


# Streams agree with answers.


@settings(max_examples=60, deadline=None)
@given(anthropicMessages(), st.data())
def test_anthropicStreamAgreesWithAnswer(message: dict[str, Any], data: st.DataObject) -> None:
    """
    An Anthropic message streamed in any pieces, translated, and put
    together by OpenAI's SDK, is the translation of the whole message.
    """
    upstream = Upstream()
    cuts = st.lists(st.integers(0, 40), max_size=4)
    final = readByOpenAI(
        upstream, toChunks(anthropicEventsOf(message, lambda text: data.draw(cuts)))
    )
    expected = chatCompletionOf(message, created=CREATED)
    choice, wanted = final.choices[0], expected["choices"][0]
    assert final.id == expected["id"] and final.model == expected["model"]
    assert choice.finish_reason == wanted["finish_reason"]
    assert (choice.message.content or None) == (wanted["message"]["content"] or None)
    calls = [
        (call.id, call.function.name, json.loads(call.function.arguments))
        for call in choice.message.tool_calls or ()
    ]
    assert calls == [
        (call["id"], call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in wanted["message"].get("tool_calls", ())
    ]
    assert final.usage is not None
    assert final.usage.model_dump(exclude_none=True) == expected["usage"]


@settings(max_examples=60, deadline=None)
@given(openAICompletions(), st.data())
def test_openAIStreamAgreesWithAnswer(completion: dict[str, Any], data: st.DataObject) -> None:
    """
    A chat completion streamed in any pieces, translated, and put together
    by Anthropic's SDK, is the translation of the whole completion.
    """
    upstream = Upstream()
    cuts = st.lists(st.integers(0, 40), max_size=4)
    text, final = readByAnthropic(
        upstream, toEvents(openAIChunksOf(completion, lambda text: data.draw(cuts)))
    )
    expected = anthropicMessageOf(completion)
    Message.model_validate(expected)
    assert final.to_dict(exclude_none=True) == Message.model_validate(expected).to_dict(
        exclude_none=True
    )
    assert text == "".join(
        block["text"] for block in expected["content"] if block["type"] == "text"
    )
