"""
The scripted upstream of L{svcd.devkit.upstream} speaks Anthropic's
Messages API (decisions D14) as Anthropic does, so that the gateway's
Anthropic providers and C{/v1/messages} are tested against something that
behaves like the real thing. The official C{anthropic} SDK, pointed
straight at it, is the judge of compatibility; raw connections check the
events' exact order and what the SDK hides.

Also here: the directives both dialects share that came with it
(C{tool-call}, C{error-mid-stream}, C{cache}), on OpenAI's side with the
C{openai} SDK, and the two dialects of one script meeting in
L{svcd.dialects}.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import MessageParam, ToolParam
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.devkit.upstream.script import (
    DEFAULT_STREAM_ERROR,
    Script,
    ScriptError,
    cacheParts,
    parseScript,
)
from svcd.dialects.answers import chatCompletionOf
from svcd.dialects.streams import ChatChunkStream
from svcd.dialects.usage import StreamUsage, TokenUsage, usageOfAnthropic, usageOfOpenAI

# Starts real processes (conftest.py, pytest.ini): left out of a quick run.
pytestmark = pytest.mark.e2e

SYSTEM = "You are terse."
MESSAGES: list[MessageParam] = [{"role": "user", "content": "Say hello to the test suite"}]
CHAT_MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Say hello to the test suite"},
]

# What echo answers to SYSTEM and MESSAGES: the system prompt counts as a
# message, so the answer is the chat echo's to the same conversation;
# input tokens are the words of both (3 + 6), output tokens the 10 words
# of the answer.
ECHO_CONTENT = "Scripted answer to 2 messages; the last has 27 characters."
# Its stream deltas: a word each, with the space after it.
ECHO_DELTAS = re.findall(r"\S+\s*", ECHO_CONTENT)

TOOLS: list[ToolParam] = [
    {
        "name": "get_weather",
        "description": "The weather of a city.",
        "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}},
    },
    {"name": "get_time", "input_schema": {"type": "object"}},
]
CHAT_TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
]
QUESTION = "What is the weather in Paris?"

EVENT_ORDER_OPENING = ["message_start", "content_block_start", "ping"]
EVENT_ORDER_CLOSING = ["content_block_stop", "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedUpstream]:
    server = ScriptedUpstream(tmp_path_factory.mktemp("upstream")).start()
    yield server
    server.stop()


@pytest.fixture
def client(upstream: ScriptedUpstream) -> Iterator[anthropic.Anthropic]:
    """
    The official SDK pointed straight at the shared upstream, with no
    retries (it retries 429, 529 and 5xx by default, which would hide what
    the upstream answered).
    """
    with anthropic.Anthropic(
        base_url=upstream.anthropicBaseURL, api_key="sk-ant-test", max_retries=0, timeout=10.0
    ) as sdk:
        yield sdk


@pytest.fixture
def chat(upstream: ScriptedUpstream) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=upstream.baseURL, api_key="sk-test", max_retries=0, timeout=10.0
    ) as sdk:
        yield sdk


def _post(
    upstream: ScriptedUpstream,
    body: object,
    path: str = "/v1/messages",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """
    One raw request: the status, the headers (lower-cased names) and the
    whole body.
    """
    connection = http.client.HTTPConnection(upstream.host, upstream.port, timeout=10)
    try:
        sent = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
        sent.update(headers or {})
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request("POST", path, payload, {k: v for k, v in sent.items() if v})
        answer = connection.getresponse()
        received = {name.lower(): value for name, value in answer.getheaders()}
        return answer.status, received, answer.read()
    finally:
        connection.close()


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """
    A stream's events as (the C{event:} line's name, the parsed data),
    checking that each is the two lines Anthropic sends.
    """
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        eventLine, dataLine = block.split("\n")
        name = eventLine.removeprefix("event: ")
        data = json.loads(dataLine.removeprefix("data: "))
        assert eventLine.startswith("event: ") and dataLine.startswith("data: ")
        assert data["type"] == name
        events.append((name, data))
    assert raw.endswith(b"\n\n")
    return events


def _body(model: str, **fields: object) -> dict[str, object]:
    return {"model": model, "max_tokens": 100, "system": SYSTEM, "messages": MESSAGES} | fields


def waitFor(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.02)


# The grammar of the new directives, without a server.


def test_newDirectives() -> None:
    """
    C{tool-call}, C{error-mid-stream} and C{cache} parse into the script,
    and combine with delivery directives.
    """
    assert parseScript("tool-call") == Script(kind="tool-call")
    assert parseScript("tool-call:get_time+gap:5") == Script(
        kind="tool-call", tool="get_time", gap=0.005
    )
    assert parseScript("error-mid-stream") == Script(
        kind="error-mid-stream", count=DEFAULT_STREAM_ERROR
    )
    assert DEFAULT_STREAM_ERROR == 529
    assert parseScript("error-mid-stream:500").count == 500
    assert parseScript("usage:100:5+cache:60:30") == Script(counts=(100, 5), cache=(60, 30))
    assert parseScript("usage-at-cap+cache:0:999999999").cache == (0, 999_999_999)


@pytest.mark.parametrize(
    "model",
    [
        "tool-call:a:b",
        "tool-call:no.dots",
        "tool-call+events:3",
        "error-mid-stream:42",
        "error-mid-stream:500:1",
        "error-mid-stream+close-mid-stream",
        "cache",
        "cache:1",
        "cache:1:2:3",
        "cache:x:2",
        "cache:1:2+no-usage",
        "cache:1:2+usage:10:5:1:0",
    ],
)
def test_misusedNewDirectivesAreErrors(model: str) -> None:
    with pytest.raises(ScriptError):
        parseScript(model)


def test_cachePartsAreParts() -> None:
    """
    The cache reads and writes are parts of the prompt: each at most what
    is left of it, reads first; usage's own cached count is reads.
    """
    assert cacheParts(Script(), 100) == (0, 0)
    assert cacheParts(Script(cache=(60, 30)), 100) == (60, 30)
    assert cacheParts(Script(cache=(60, 60)), 100) == (60, 40)
    assert cacheParts(Script(cache=(500, 1)), 100) == (100, 0)
    assert cacheParts(Script(cache=(0, 10**9)), 100) == (0, 100)
    assert cacheParts(Script(counts=(100, 5, 70, 0)), 100) == (70, 0)


# messages.create and messages.stream


def test_create(client: anthropic.Anthropic) -> None:
    """
    A message parses into the SDK's Message: the echo in one text block,
    the request's model, end_turn, and usage with its cache fields.
    """
    raw = client.messages.with_raw_response.create(
        model="claude-sonnet-4-5", max_tokens=100, system=SYSTEM, messages=MESSAGES
    )
    assert raw.status_code == 200
    assert raw.headers["content-type"] == "application/json"
    assert raw.headers["request-id"].startswith("req_scripted_")
    message = raw.parse()
    assert message.id.startswith("msg_scripted_")
    assert (message.type, message.role, message.model) == (
        "message",
        "assistant",
        "claude-sonnet-4-5",
    )
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].type == "text" and message.content[0].text == ECHO_CONTENT
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    usage = message.usage
    assert (usage.input_tokens, usage.output_tokens) == (9, 10)
    assert (usage.cache_creation_input_tokens, usage.cache_read_input_tokens) == (0, 0)
    assert usage.service_tier == "standard"


def test_streamTextAndFinalMessage(client: anthropic.Anthropic) -> None:
    """
    messages.stream gives one text delta per word, adding up to the
    echo, and a final message equal to what create answers (but its id).
    """
    with client.messages.stream(
        model="echo", max_tokens=100, system=SYSTEM, messages=MESSAGES
    ) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(deltas) == len(ECHO_DELTAS)
    assert "".join(deltas) == ECHO_CONTENT
    whole = client.messages.create(model="echo", max_tokens=100, system=SYSTEM, messages=MESSAGES)
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


def test_rawEventOrder(upstream: ScriptedUpstream) -> None:
    """
    A stream is Anthropic's events in Anthropic's order, each an C{event:}
    line and a C{data:} line: message_start (input usage, one output
    token), content_block_start, ping, a delta per word, content_block_stop,
    message_delta (the stop reason and the output tokens, a total),
    message_stop.
    """
    status, headers, raw = _post(upstream, _body("echo+cache:2:3", stream=True))
    assert status == 200
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert headers["cache-control"] == "no-cache"
    assert headers["transfer-encoding"] == "chunked"
    events = _events(raw)
    names = [name for name, _ in events]
    assert names == EVENT_ORDER_OPENING + ["content_block_delta"] * 10 + EVENT_ORDER_CLOSING
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {
        "input_tokens": 4,
        "cache_creation_input_tokens": 3,
        "cache_read_input_tokens": 2,
        "cache_creation": {"ephemeral_5m_input_tokens": 3, "ephemeral_1h_input_tokens": 0},
        "output_tokens": 1,
        "service_tier": "standard",
    }
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert events[3][1] == {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "Scripted "},
    }
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 10},
    }
    assert events[-1][1] == {"type": "message_stop"}


def test_stopSequence(client: anthropic.Anthropic) -> None:
    """
    An answer holding one of the request's stop sequences ends before the
    first of them, saying which, streamed or not.
    """
    message = client.messages.create(
        model="echo",
        max_tokens=100,
        system=SYSTEM,
        messages=MESSAGES,
        stop_sequences=["characters", "messages", "unseen"],
    )
    assert message.content[0].type == "text"
    assert message.content[0].text == "Scripted answer to 2 "
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "messages")
    assert message.usage.output_tokens == 4
    with client.messages.stream(
        model="echo",
        max_tokens=100,
        system=SYSTEM,
        messages=MESSAGES,
        stop_sequences=["messages"],
    ) as stream:
        assert "".join(stream.text_stream) == "Scripted answer to 2 "
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "messages")


def test_maxTokens(client: anthropic.Anthropic) -> None:
    """
    An answer longer than max_tokens (a word a token) is cut there; a stop
    sequence after the cut is never reached.
    """
    message = client.messages.create(
        model="echo", max_tokens=3, messages=MESSAGES, stop_sequences=["messages"]
    )
    assert message.content[0].type == "text" and message.content[0].text == "Scripted answer to "
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 3)
    with client.messages.stream(model="echo", max_tokens=3, messages=MESSAGES) as stream:
        assert list(stream.text_stream) == ["Scripted ", "answer ", "to "]
        final = stream.get_final_message()
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 3)


def test_scriptedUsageWithCache(client: anthropic.Anthropic) -> None:
    """
    usage:<prompt>:<completion> with cache:<reads>:<writes>: the prompt in
    Anthropic's three parts, in a message and at the end of a stream.
    """
    model = "usage:1000:50+cache:600:300"
    message = client.messages.create(model=model, max_tokens=100, messages=MESSAGES)
    assert message.content[0].type == "text" and message.content[0].text.startswith("Scripted")
    counts = message.usage.model_dump(
        include={
            "input_tokens",
            "cache_read_input_tokens",
            "cache_creation_input_tokens",
            "output_tokens",
        }
    )
    assert counts == {
        "input_tokens": 100,
        "cache_read_input_tokens": 600,
        "cache_creation_input_tokens": 300,
        "output_tokens": 50,
    }
    assert message.usage.cache_creation is not None
    assert message.usage.cache_creation.ephemeral_5m_input_tokens == 300
    with client.messages.stream(model=model, max_tokens=100, messages=MESSAGES) as stream:
        final = stream.get_final_message()
    assert final.usage.model_dump(include=set(counts)) == counts


def test_usageAtCap(upstream: ScriptedUpstream) -> None:
    """
    usage-at-cap: the body's bytes are the input, max_tokens the output;
    with cache:0:999999999 the whole input is cache writes (the dearest
    worst case a budget must survive), in a message and in a stream.
    """
    upstream.clearRequests()
    status, _, raw = _post(upstream, _body("usage-at-cap", max_tokens=77))
    assert status == 200
    length = upstream.requests()[0].bodyLength
    usage = json.loads(raw)["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (length, 77)
    upstream.clearRequests()
    status, _, raw = _post(
        upstream, _body("usage-at-cap+cache:0:999999999", max_tokens=77, stream=True)
    )
    length = upstream.requests()[0].bodyLength
    events = _events(raw)
    usage = events[0][1]["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_creation_input_tokens"]) == (0, length)
    assert usage["cache_read_input_tokens"] == 0
    assert events[-2][1]["usage"] == {"output_tokens": 77}


def test_noUsage(upstream: ScriptedUpstream) -> None:
    """
    no-usage leaves usage out of the message and of the events, as a
    gateway's test of a provider that says nothing wants.
    """
    status, _, raw = _post(upstream, _body("no-usage"))
    assert status == 200 and "usage" not in json.loads(raw)
    status, _, raw = _post(upstream, _body("no-usage", stream=True))
    events = _events(raw)
    assert "usage" not in events[0][1]["message"]
    assert "usage" not in events[-2][1]


# Tool use


def test_toolUse(client: anthropic.Anthropic, upstream: ScriptedUpstream) -> None:
    """
    tool-call calls the request's first tool with the last message's text
    as its input; sending the result back with the same model is answered
    with the echo, so an agent's loop ends.
    """
    upstream.clearRequests()
    question: list[MessageParam] = [{"role": "user", "content": QUESTION}]
    message = client.messages.create(
        model="tool-call", max_tokens=100, tools=TOOLS, messages=question
    )
    (block,) = message.content
    assert block.type == "tool_use"
    assert (block.name, block.input) == ("get_weather", {"text": QUESTION})
    number = upstream.requests()[0].number
    assert block.id == f"toolu_scripted_{number}"
    assert message.stop_reason == "tool_use"
    assert message.usage.output_tokens == len(json.dumps({"text": QUESTION}).split())
    turns: list[MessageParam] = [
        *question,
        {"role": "assistant", "content": message.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny, 21"}],
        },
    ]
    answer = client.messages.create(model="tool-call", max_tokens=100, tools=TOOLS, messages=turns)
    assert answer.content[0].type == "text"
    assert answer.content[0].text == "Scripted answer to 3 messages; the last has 9 characters."
    assert answer.stop_reason == "end_turn"
    # The tool result's text counts: 6 + 0 + 2 words.
    assert answer.usage.input_tokens == 8


def test_toolUseStreamed(client: anthropic.Anthropic, upstream: ScriptedUpstream) -> None:
    """
    Streamed, the tool call is a tool_use block whose input comes as
    input_json_delta events (an empty one first, as Anthropic sends), which
    the SDK assembles into the same input.
    """
    question: list[MessageParam] = [{"role": "user", "content": QUESTION}]
    with client.messages.stream(
        model="tool-call", max_tokens=100, tools=TOOLS, messages=question
    ) as stream:
        final = stream.get_final_message()
    (block,) = final.content
    assert block.type == "tool_use"
    assert (block.name, block.input) == ("get_weather", {"text": QUESTION})
    assert final.stop_reason == "tool_use"
    _, _, raw = _post(
        upstream,
        {
            "model": "tool-call",
            "max_tokens": 9,
            "tools": TOOLS,
            "messages": question,
            "stream": True,
        },
    )
    events = _events(raw)
    names = [name for name, _ in events]
    assert names == EVENT_ORDER_OPENING + ["content_block_delta"] * 4 + EVENT_ORDER_CLOSING
    started = events[1][1]["content_block"]
    assert (started["type"], started["name"], started["input"]) == ("tool_use", "get_weather", {})
    pieces = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(piece["type"] == "input_json_delta" for piece in pieces)
    assert pieces[0]["partial_json"] == ""
    assert json.loads("".join(piece["partial_json"] for piece in pieces)) == {"text": QUESTION}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_toolChoice(client: anthropic.Anthropic) -> None:
    """
    The tool called is the one tool-call:<name> names, else the one
    tool_choice names, else the first; a request offering none is a 400.
    """
    question: list[MessageParam] = [{"role": "user", "content": QUESTION}]
    named = client.messages.create(
        model="tool-call:lookup", max_tokens=100, tools=TOOLS, messages=question
    )
    assert named.content[0].type == "tool_use" and named.content[0].name == "lookup"
    chosen = client.messages.create(
        model="tool-call",
        max_tokens=100,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_time"},
        messages=question,
    )
    assert chosen.content[0].type == "tool_use" and chosen.content[0].name == "get_time"
    with pytest.raises(anthropic.BadRequestError, match="tool-call needs a tool"):
        client.messages.create(model="tool-call", max_tokens=100, messages=question)


# count_tokens


def test_countTokens(client: anthropic.Anthropic) -> None:
    """
    count_tokens answers the input tokens the echo to the same body would
    count (the words of the system prompt and the turns), or usage's
    prompt; its faults are a message's.
    """
    counted = client.messages.count_tokens(model="claude-x", system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == 9
    whole = client.messages.create(model="claude-x", max_tokens=9, system=SYSTEM, messages=MESSAGES)
    assert whole.usage.input_tokens == counted.input_tokens
    assert (
        client.messages.count_tokens(model="usage:1234:0", messages=MESSAGES).input_tokens == 1234
    )
    with pytest.raises(anthropic.RateLimitError):
        client.messages.count_tokens(model="status:429", messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError, match="events is for messages"):
        client.messages.count_tokens(model="events:3", messages=MESSAGES)


def test_countTokensRoute(upstream: ScriptedUpstream) -> None:
    """
    count_tokens needs no max_tokens, and never streams.
    """
    status, headers, raw = _post(
        upstream,
        {"model": "echo", "messages": MESSAGES, "stream": True},
        path="/v1/messages/count_tokens",
    )
    assert (status, headers["content-type"], json.loads(raw)) == (
        200,
        "application/json",
        {"input_tokens": 6},
    )


# Errors, as the SDK sees them


@pytest.mark.parametrize(
    ("model", "retryAfter"), [("status:429", "7"), ("status:429:3", "3"), ("status:429:0", None)]
)
def test_rateLimited(client: anthropic.Anthropic, model: str, retryAfter: str | None) -> None:
    """
    status:429 raises RateLimitError with Anthropic's body and the script's
    Retry-After.
    """
    with pytest.raises(anthropic.RateLimitError) as raised:
        client.messages.create(model=model, max_tokens=10, messages=MESSAGES)
    assert raised.value.status_code == 429
    assert raised.value.response.headers.get("retry-after") == retryAfter
    assert raised.value.body == {
        "type": "error",
        "error": {
            "type": "rate_limit_error",
            "message": f"Scripted error 429 for model {model!r}.",
        },
        "request_id": raised.value.response.headers["request-id"],
    }


@pytest.mark.parametrize(
    ("status", "errorClass", "errorType"),
    [
        (400, anthropic.BadRequestError, "invalid_request_error"),
        (401, anthropic.AuthenticationError, "authentication_error"),
        (403, anthropic.PermissionDeniedError, "permission_error"),
        (404, anthropic.NotFoundError, "not_found_error"),
        (413, anthropic.APIStatusError, "request_too_large"),
        (500, anthropic.InternalServerError, "api_error"),
        (502, anthropic.InternalServerError, "api_error"),
        (504, anthropic.InternalServerError, "timeout_error"),
        (529, anthropic.InternalServerError, "overloaded_error"),
    ],
)
def test_errorsByStatus(
    client: anthropic.Anthropic, status: int, errorClass: type[Exception], errorType: str
) -> None:
    """
    status:<code> answers Anthropic's error of that status, which the SDK
    raises as its class for it (529: overloaded, which it retries).
    """
    with pytest.raises(errorClass) as raised:
        client.messages.create(model=f"status:{status}", max_tokens=10, messages=MESSAGES)
    error = raised.value
    assert isinstance(error, anthropic.APIStatusError)
    assert error.status_code == status
    assert isinstance(error.body, dict) and error.body["error"]["type"] == errorType
    if status == 529:
        assert type(error).__name__ == "OverloadedError"


def test_errorMidStream(client: anthropic.Anthropic, upstream: ScriptedUpstream) -> None:
    """
    error-mid-stream: the opening events and two deltas, then Anthropic's
    error event (overloaded_error by default), which the SDK raises after
    the text it had; the answer itself ends normally. Not streaming, it is
    the status's error.
    """
    upstream.clearRequests()
    received: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as raised:
        with client.messages.stream(
            model="error-mid-stream", max_tokens=100, messages=MESSAGES
        ) as stream:
            for text in stream.text_stream:
                received.append(text)
    assert received == ["Scripted ", "answer "]
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["error"]["type"] == "overloaded_error"
    (record,) = upstream.waitUntilEnded()
    assert (record.status, record.outcome, record.eventsSent) == (200, "finished", 6)
    _, _, raw = _post(upstream, _body("error-mid-stream:500", stream=True))
    events = _events(raw)
    assert [name for name, _ in events] == [
        *EVENT_ORDER_OPENING,
        *["content_block_delta"] * 2,
        "error",
    ]
    assert events[-1][1]["error"]["type"] == "api_error"
    with pytest.raises(anthropic.InternalServerError) as whole:
        client.messages.create(model="error-mid-stream", max_tokens=10, messages=MESSAGES)
    assert whole.value.status_code == 529


# The key, the version header, the body, the request log


def test_apiKeyAndHeaders(startScriptedUpstream: Callable[..., ScriptedUpstream]) -> None:
    """
    With a key, Anthropic's routes want it as x-api-key, or as a bearer
    token (which the SDK sends); anthropic-version is required; the log
    keeps the anthropic-version and anthropic-beta a gateway forwarded.
    """
    upstream = startScriptedUpstream(apiKey="sk-ant-upstream")
    with anthropic.Anthropic(
        base_url=upstream.anthropicBaseURL, api_key="sk-wrong", max_retries=0
    ) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            wrong.messages.create(model="echo", max_tokens=10, messages=MESSAGES)
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["error"] == {
        "type": "authentication_error",
        "message": "invalid x-api-key",
    }
    status, _, raw = _post(upstream, _body("echo"))
    assert status == 401 and json.loads(raw)["error"]["message"] == "x-api-key header is required"
    status, _, raw = _post(upstream, _body("echo"), headers={"x-api-key": "sk-wrong"})
    assert status == 401 and json.loads(raw)["error"]["message"] == "invalid x-api-key"
    status, _, raw = _post(
        upstream, _body("echo"), headers={"x-api-key": "sk-ant-upstream", "anthropic-version": ""}
    )
    assert status == 400
    assert json.loads(raw)["error"] == {
        "type": "invalid_request_error",
        "message": "anthropic-version: header is required",
    }
    # What a gateway's forwarder sends.
    status, _, raw = _post(
        upstream,
        _body("echo"),
        headers={"x-api-key": "sk-ant-upstream", "anthropic-beta": "prompt-caching-2024-07-31"},
    )
    assert status == 200 and json.loads(raw)["content"][0]["text"] == ECHO_CONTENT
    # What the SDK sends: a bearer token.
    with anthropic.Anthropic(
        base_url=upstream.anthropicBaseURL, api_key="sk-ant-upstream", max_retries=0
    ) as right:
        message = right.messages.create(model="echo", max_tokens=10, messages=MESSAGES)
    assert message.content[0].type == "text"
    records = upstream.requests()
    assert [record.status for record in records] == [401, 401, 401, 400, 200, 200]
    forwarded, sdk = records[-2:]
    assert forwarded.path == "/v1/messages"
    assert forwarded.header("x-api-key") == "sk-ant-upstream"
    assert forwarded.header("anthropic-version") == "2023-06-01"
    assert forwarded.header("anthropic-beta") == "prompt-caching-2024-07-31"
    assert sdk.header("authorization") == "Bearer sk-ant-upstream"
    assert sdk.header("anthropic-version") is not None
    assert sdk.body["max_tokens"] == 10


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "There was an error parsing the body of your request."),
        ({"max_tokens": 5, "messages": []}, "model: Field required"),
        ({"model": "echo", "max_tokens": 5}, "messages: Field required"),
        ({"model": "echo", "messages": []}, "max_tokens: Field required"),
        (
            {"model": "echo", "messages": [], "max_tokens": 0},
            "max_tokens: Input should be a whole number of at least 1",
        ),
        ({"model": "status:42", "messages": [], "max_tokens": 5}, "Bad script 'status:42'"),
        ({"model": "vectors:nan", "messages": [], "max_tokens": 5}, "vectors is for embeddings"),
    ],
    ids=["not JSON", "no model", "no messages", "no max_tokens", "zero", "bad script", "vectors"],
)
def test_badBodies(upstream: ScriptedUpstream, body: object, message: str) -> None:
    """
    What Anthropic refuses is a 400 invalid_request_error naming it.
    """
    status, headers, raw = _post(upstream, body)
    assert status == 400
    assert headers["request-id"].startswith("req_scripted_")
    error = json.loads(raw)
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]


def test_onlyPost(upstream: ScriptedUpstream) -> None:
    connection = http.client.HTTPConnection(upstream.host, upstream.port, timeout=10)
    connection.request("GET", "/v1/messages")
    answer = connection.getresponse()
    assert (answer.status, answer.getheader("allow")) == (405, "POST")
    assert json.loads(answer.read())["type"] == "error"
    connection.close()


def test_otherPrefix(upstream: ScriptedUpstream) -> None:
    """
    Any prefix: a provider's base_url with /v1 (C{<base>/messages}).
    """
    status, _, raw = _post(upstream, _body("echo"), path="/other/v1/messages")
    assert status == 200 and json.loads(raw)["content"][0]["text"] == ECHO_CONTENT


# Delivery and faults


def test_closeMidStream(client: anthropic.Anthropic, upstream: ScriptedUpstream) -> None:
    """
    close-mid-stream closes after the opening events and two deltas, no
    message_stop: a connection error for the SDK.
    """
    upstream.clearRequests()
    received: list[str] = []
    with pytest.raises(anthropic.APIConnectionError):
        with client.messages.stream(
            model="close-mid-stream", max_tokens=100, messages=MESSAGES
        ) as stream:
            for text in stream.text_stream:
                received.append(text)
    assert received == ["Scripted ", "answer "]
    (record,) = upstream.waitUntilEnded()
    assert (record.outcome, record.eventsSent) == ("aborted", 5)
    with pytest.raises(anthropic.APIConnectionError):
        client.messages.create(model="close-mid-stream", max_tokens=100, messages=MESSAGES)


def test_resetAndTimeouts(client: anthropic.Anthropic) -> None:
    """
    reset is a connection error; slow and stall-stream time the SDK out
    (stall-stream after the opening events: no text).
    """
    with pytest.raises(anthropic.APIConnectionError):
        client.messages.create(model="reset", max_tokens=10, messages=MESSAGES)
    with pytest.raises(anthropic.APITimeoutError):
        client.with_options(timeout=0.3).messages.create(
            model="slow:5000", max_tokens=10, messages=MESSAGES
        )
    received: list[str] = []
    with pytest.raises(anthropic.APITimeoutError):
        with client.with_options(timeout=0.5).messages.stream(
            model="stall-stream", max_tokens=10, messages=MESSAGES
        ) as stream:
            for text in stream.text_stream:
                received.append(text)
    assert received == []


def test_gapEventsAndBytes(client: anthropic.Anthropic, upstream: ScriptedUpstream) -> None:
    """
    gap spaces every event (nine for three deltas: at least eight gaps);
    events and bytes answer their content as for chat.
    """
    upstream.clearRequests()
    started = time.monotonic()
    with client.messages.stream(
        model="gap:30+events:3", max_tokens=10, messages=MESSAGES
    ) as stream:
        deltas = list(stream.text_stream)
    assert time.monotonic() - started >= 8 * 0.03
    assert len(deltas) == 3 and all(delta.startswith("event 00000") for delta in deltas)
    (record,) = upstream.waitUntilEnded()
    assert record.eventsSent == 3 + 6
    message = client.messages.create(model="bytes:5000", max_tokens=1, messages=MESSAGES)
    assert message.content[0].type == "text" and len(message.content[0].text) == 5000
    assert message.stop_reason == "end_turn", "only the echo is cut by max_tokens"


def test_notJSON(upstream: ScriptedUpstream) -> None:
    status, headers, raw = _post(upstream, _body("not-json"))
    assert (status, headers["content-type"], raw) == (200, "application/json", b"this is not JSON")
    status, _, raw = _post(upstream, _body("not-json", stream=True))
    assert raw == b"event: message_start\ndata: this is not JSON\n\n"


def test_neverEnding(client: anthropic.Anthropic, upstream: ScriptedUpstream) -> None:
    """
    never-ending keeps sending text deltas until the client goes away.
    """
    upstream.clearRequests()
    with client.messages.stream(model="gap:10+never-ending", max_tokens=10, messages=MESSAGES) as s:
        for count, text in enumerate(s.text_stream, start=1):
            assert text.startswith("tick")
            if count == 5:
                break
    (record,) = upstream.waitUntilEnded()
    assert record.outcome == "clientGone" and record.eventsSent >= 3 + 5


# OpenAI's side of the new directives


def test_openAIToolCall(chat: openai.OpenAI) -> None:
    """
    tool-call on a chat completion: one tool call, finish_reason
    tool_calls, whole or streamed (the SDK's stream helper assembles the
    same call); a tool message back is answered with the echo.
    """
    question: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
    completion = chat.chat.completions.create(
        model="tool-call", messages=question, tools=CHAT_TOOLS
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_scripted_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"text": QUESTION}
    with chat.chat.completions.stream(
        model="tool-call", messages=question, tools=CHAT_TOOLS
    ) as stream:
        streamed = stream.get_final_completion()
    (streamedCall,) = streamed.choices[0].message.tool_calls or []
    assert streamedCall.function.arguments == call.function.arguments
    assert streamed.choices[0].finish_reason == "tool_calls"
    answer = chat.chat.completions.create(
        model="tool-call",
        tools=CHAT_TOOLS,
        messages=[
            *question,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call.model_dump()],  # type: ignore[list-item]
            },
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21"},
        ],
    )
    assert answer.choices[0].message.content == (
        "Scripted answer to 3 messages; the last has 9 characters."
    )


def test_openAIErrorMidStream(chat: openai.OpenAI) -> None:
    """
    error-mid-stream on a chat stream: the role and two content chunks,
    then OpenAI's error chunk, which the SDK raises.
    """
    received = []
    with pytest.raises(openai.APIError, match="mid-stream"):
        for chunk in chat.chat.completions.create(
            model="error-mid-stream:500", messages=CHAT_MESSAGES, stream=True
        ):
            received.append(chunk.choices[0].delta.content)
    assert received == ["", "Scripted ", "answer "]


def test_openAICache(chat: openai.OpenAI) -> None:
    """
    cache on a chat completion: the whole prompt in prompt_tokens, the
    reads and writes among its details.
    """
    completion = chat.chat.completions.create(
        model="usage:1000:50+cache:600:300", messages=CHAT_MESSAGES
    )
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 1000
    assert completion.usage.model_dump(exclude_none=True)["prompt_tokens_details"] == {
        "cached_tokens": 600,
        "cache_write_tokens": 300,
        "audio_tokens": 0,
    }


@pytest.mark.parametrize(
    "model",
    ["echo", "usage:1000:50+cache:600:300", "tool-call", "usage:30:5:20:0"],
)
def test_bothDialectsAgree(
    upstream: ScriptedUpstream, client: anthropic.Anthropic, chat: openai.OpenAI, model: str
) -> None:
    """
    One script says the same in both dialects: the OpenAI answer translated
    by L{svcd.dialects} is the Anthropic answer (but ids), the usages are
    one L{TokenUsage}, and the Anthropic stream translated to chunks says
    the echo and that usage.
    """
    message = client.messages.create(
        model=model, max_tokens=100, system=SYSTEM, messages=MESSAGES, tools=TOOLS
    )
    completion = chat.chat.completions.create(
        model=model,
        messages=CHAT_MESSAGES,
        tools=CHAT_TOOLS,
        stream=False,
    )
    anthropicUsage = usageOfAnthropic(message.model_dump()["usage"])
    openAIUsage = usageOfOpenAI(completion.model_dump()["usage"])
    assert anthropicUsage == openAIUsage != TokenUsage()
    translated = chatCompletionOf(message.model_dump(), created=completion.created)
    choice = completion.model_dump()["choices"][0]
    assert translated["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert translated["choices"][0]["message"]["content"] == choice["message"]["content"]
    calls = translated["choices"][0]["message"].get("tool_calls", [])
    assert [
        (each["function"]["name"], json.loads(each["function"]["arguments"])) for each in calls
    ] == [
        (each["function"]["name"], json.loads(each["function"]["arguments"]))
        for each in choice["message"]["tool_calls"] or []
    ]
    _, _, raw = _post(upstream, _body(model, stream=True, tools=TOOLS))
    chunks = ChatChunkStream(created=0, includeUsage=True)
    usage = StreamUsage()
    content = []
    for _, event in _events(raw):
        usage.observe(event)
        for chunk in chunks.feed(event):
            if chunk["choices"]:
                content.append(chunk["choices"][0]["delta"].get("content") or "")
    assert chunks.finished and usage.usage == chunks.usage == anthropicUsage
    assert "".join(content) == (choice["message"]["content"] or "")
