"""
The official C{openai} SDK against a model of an Anthropic provider
(decisions D14), end to end: real C{twistd} daemons (svc-auth, svc-proxy)
on a real PostgreSQL and Redis, the scripted upstream speaking Anthropic's
Messages API. The chat completion is translated both ways, streamed or
not: system prompts, tools (a call and its result), stop sequences, images,
usage with cached tokens; a 429 of the provider is the client's, with its
Retry-After; a field with no counterpart is 400 naming it, with nothing
sent upstream.

tests/test_providers_dialects.py has the forwarder alone.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import openai
import pytest
from gatewayfixtures import UNLIMITED, Gateway, runningGateway
from ledgerfixtures import ledgerRows, waitUntil

from svcd.devkit.postgres import PostgresServer
from svcd.devkit.upstream.client import ScriptedUpstream

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

KEY = "sk-ant-scripted-" + uuid.uuid4().hex

# name -> upstream model (a script of the scripted upstream's grammar).
MODELS = {
    "claude": "echo",
    "claude-cached": "echo+cache:3:2",
    "claude-tools": "tool-call",
    "claude-limited": "status:429:9",
}

# A PNG of one pixel, as a data: URL.
PIXEL = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


@attrs.frozen
class Stack:
    gateway: Gateway
    upstream: ScriptedUpstream

    def client(self) -> openai.OpenAI:
        tenant = self.gateway.tenants["main"]
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.gateway.port}/v1",
            api_key=tenant.token,
            default_headers={"X-SVC-Agent-ID": str(tenant.agentID)},
            max_retries=0,
            timeout=30,
        )

    def sent(self, requestID: str) -> Any:
        """
        The body the upstream received for the request C{requestID}.
        """
        found = [
            each for each in self.upstream.requests() if each.header("x-request-id") == requestID
        ]
        assert len(found) == 1, found
        return found[0]

    def row(self, requestID: str) -> dict[str, Any]:
        """
        The ledger's row of the request C{requestID}, once it is written.
        """
        rows: dict[str, dict[str, Any]] = {}

        def written() -> bool:
            nonlocal rows
            rows = ledgerRows(self.gateway.dsn, "request_id = %s", (requestID,))
            return bool(rows)

        waitUntil(written, "the ledger's row")
        return rows[requestID]


def providersFile(path: Path, upstream: ScriptedUpstream) -> Path:
    lines = [
        "[[providers]]",
        'name = "anthropic"',
        'api = "anthropic"',
        f'base_url = "{upstream.baseURL}"',
        'api_key_env = "SVC_TEST_ANTHROPIC_KEY"',
    ]
    for name, upstreamModel in MODELS.items():
        lines += [
            "",
            "[[models]]",
            f'name = "{name}"',
            'provider = "anthropic"',
            f'upstream_model = "{upstreamModel}"',
            "max_output_tokens = 1000",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def stack(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("anthropic-chat")
    upstream = ScriptedUpstream(workdir / "upstream", apiKey=KEY).start()
    try:
        path = providersFile(workdir / "providers.toml", upstream)
        with runningGateway(
            postgresServer,
            workdir,
            proxyEnvironment={**UNLIMITED, "SVC_AUTH_VALIDATE_TIMEOUT": "1s"},
            prepare=lambda _: {
                "SVC_PROVIDERS_FILE": str(path),
                "SVC_TEST_ANTHROPIC_KEY": KEY,
            },
        ) as gateway:
            yield Stack(gateway, upstream)
    finally:
        upstream.stop()


def test_chatCompletion(stack: Stack) -> None:
    """
    A chat completion to an Anthropic model: the provider is sent
    Anthropic's body at /v1/messages with its key as x-api-key, the system
    prompt in system; the client reads a chat completion, its usage with
    the cache's reads in prompt_tokens_details.
    """
    requestID = str(uuid.uuid4())
    raw = stack.client().chat.completions.with_raw_response.create(
        model="claude-cached",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello to the world"},
        ],
        temperature=0.5,
        extra_headers={"X-Request-ID": requestID},
    )
    completion = raw.parse()
    # OpenAI's dialect: its own header alone, not Anthropic's request-id.
    assert raw.headers["x-request-id"] == requestID and "request-id" not in raw.headers
    sent = stack.sent(requestID)
    assert sent.path == "/v1/messages"
    assert sent.header("x-api-key") == KEY and sent.header("authorization") is None
    assert sent.header("anthropic-version") == "2023-06-01"
    assert sent.body == {
        "model": "echo+cache:3:2",
        "max_tokens": 1000,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "Say hello to the world"}],
        "temperature": 0.5,
    }
    assert completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None
    assert choice.message.content.startswith("Scripted answer to 2 messages")
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 3
    assert usage.prompt_tokens_details.model_dump()["cache_write_tokens"] == 2
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The ledger's prompt is every input, its cached tokens the reads.
    row = stack.row(requestID)
    assert (row["provider"], row["upstream_model"], row["outcome"]) == (
        "anthropic",
        "echo+cache:3:2",
        "ok",
    )
    assert (row["prompt_tokens"], row["cached_tokens"]) == (usage.prompt_tokens, 3)


def test_stream(stack: Stack) -> None:
    """
    Streamed: chunks the SDK reads (text deltas, the finish reason, the
    usage chunk it asked for, cached tokens included).
    """
    requestID = str(uuid.uuid4())
    stream = stack.client().chat.completions.create(
        model="claude-cached",
        messages=[{"role": "user", "content": "Say hello to the world"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-ID": requestID},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text.startswith("Scripted answer to 1 messages")
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 3
    assert usage.completion_tokens == len(text.split())
    row = stack.row(requestID)
    assert row["stream"] and row["outcome"] == "ok"
    assert (row["prompt_tokens"], row["cached_tokens"]) == (usage.prompt_tokens, 3)


def test_toolRoundTrip(stack: Stack) -> None:
    """
    A tool call and its result: the SDK's own message of the call sent back
    (content null) with the tool's result; the provider is sent tool_use
    and tool_result blocks, and answers.
    """
    client = stack.client()
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
            },
        }
    ]
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris"}]
    first = client.chat.completions.create(model="claude-tools", messages=messages, tools=tools)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"text": "Weather in Paris"}
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "Sunny."}]
    requestID = str(uuid.uuid4())
    second = client.chat.completions.create(
        model="claude-tools",
        messages=messages,
        tools=tools,
        extra_headers={"X-Request-ID": requestID},
    )
    assert second.choices[0].finish_reason == "stop"
    turns = stack.sent(requestID).body["messages"]
    assert turns[1]["content"] == [
        {
            "type": "tool_use",
            "id": call.id,
            "name": "weather",
            "input": {"text": "Weather in Paris"},
        }
    ]
    assert turns[2] == {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny."}],
    }
    # Streamed, the call arrives in deltas the SDK joins.
    stream = client.chat.completions.create(
        model="claude-tools", messages=messages[:1], tools=tools, stream=True
    )
    arguments = "".join(
        toolCall.function.arguments or ""
        for chunk in stream
        if chunk.choices
        for toolCall in chunk.choices[0].delta.tool_calls or []
        if toolCall.function is not None
    )
    assert json.loads(arguments) == {"text": "Weather in Paris"}


def test_stopSequences(stack: Stack) -> None:
    """
    stop is sent as stop_sequences; the answer ends before the one found,
    finish_reason stop.
    """
    requestID = str(uuid.uuid4())
    completion = stack.client().chat.completions.create(
        model="claude",
        messages=[{"role": "user", "content": "hello"}],
        stop=["messages;"],
        extra_headers={"X-Request-ID": requestID},
    )
    assert stack.sent(requestID).body["stop_sequences"] == ["messages;"]
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == "Scripted answer to 1 "


def test_image(stack: Stack) -> None:
    """
    An image part of a base64 data: URL goes as Anthropic's base64 image
    block.
    """
    requestID = str(uuid.uuid4())
    stack.client().chat.completions.create(
        model="claude",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PIXEL}},
                ],
            }
        ],
        extra_headers={"X-Request-ID": requestID},
    )
    assert stack.sent(requestID).body["messages"][0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PIXEL}},
    ]


def test_rateLimitedByTheProvider(stack: Stack) -> None:
    """
    The provider's 429 is the client's 429 UPSTREAM_RATE_LIMITED, with the
    provider's Retry-After.
    """
    with pytest.raises(openai.RateLimitError) as raised:
        stack.client().chat.completions.create(
            model="claude-limited", messages=[{"role": "user", "content": "hi"}]
        )
    assert raised.value.status_code == 429
    assert raised.value.response.headers["retry-after"] == "9"
    body = raised.value.body
    assert isinstance(body, dict) and body["code"] == "UPSTREAM_RATE_LIMITED"


@pytest.mark.parametrize(("field", "value"), [("n", 2), ("logprobs", True)])
def test_untranslatableIsRefused(stack: Stack, field: str, value: Any) -> None:
    """
    A field with no counterpart in Anthropic's API is 400 VALIDATION_ERROR
    naming it, and nothing is sent upstream.
    """
    requestID = str(uuid.uuid4())
    with pytest.raises(openai.BadRequestError) as raised:
        stack.client().chat.completions.create(
            model="claude",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={field: value},
            extra_headers={"X-Request-ID": requestID},
        )
    assert raised.value.status_code == 400
    body = raised.value.body
    assert isinstance(body, dict) and body["code"] == "VALIDATION_ERROR"
    assert [error["field"] for error in body["field_errors"]] == [field]
    assert not [
        each for each in stack.upstream.requests() if each.header("x-request-id") == requestID
    ]
