"""
The forwarder speaking to Anthropic providers (decisions D14), against the
scripted upstream process: per attempt, the client's dialect (chat
completions or messages) and the provider's api decide the path, the
headers, the body, the answer, the stream, the usage and the faults. The
whole path with the daemons and the SDKs is in
test_gateway_anthropic_chat.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_twisted
from prometheus_client import CollectorRegistry

from svcd.common.errors import ApiError, ErrorCode
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.metering.models import ANTHROPIC, OPENAI, Model, Provider
from svcd.metering.usage import Usage
from svcd.providers.operations import CHAT_COMPLETIONS, COUNT_TOKENS, MESSAGES, Operation
from svcd.providers.records import UpstreamRecord
from svcd.providers.upstream import Answer, Forwarder
from svcd.proxy.metrics import ProxyMetrics

# Starts the scripted upstream process (conftest.py, pytest.ini).
pytestmark = pytest.mark.e2e

KEY = "sk-ant-" + uuid.uuid4().hex


@attrs.define
class Client:
    """
    The client's side of a stream: what the forwarder wrote.
    """

    status: int | None = None
    contentType: bytes | None = None
    headers: list[tuple[bytes, bytes]] = attrs.field(factory=list)
    written: list[bytes] = attrs.field(factory=list)
    producer: Any = None

    def begin(
        self, status: int, contentType: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> None:
        self.status, self.contentType, self.headers = status, contentType, list(headers)

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def registerProducer(self, producer: Any) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    @property
    def text(self) -> bytes:
        return b"".join(self.written)

    def events(self) -> list[tuple[str | None, Any]]:
        """
        The events written: (the event's name or None, its parsed data, or
        the raw data when it is not JSON).
        """
        found: list[tuple[str | None, Any]] = []
        for block in self.text.split(b"\n\n"):
            if not block.strip():
                continue
            name = None
            data = []
            for line in block.split(b"\n"):
                if line.startswith(b"event: "):
                    name = line[7:].decode()
                elif line.startswith(b"data: "):
                    data.append(line[6:])
            raw = b"\n".join(data)
            try:
                found.append((name, json.loads(raw)))
            except ValueError:
                found.append((name, raw.decode()))
        return found


def overloadedIn(record: UpstreamRecord) -> bool:
    """
    Whether the record says the provider was overloaded: a call, so that
    mypy does not narrow the attribute for the rest of a test.
    """
    return record.overloaded


@attrs.define
class Harness:
    upstream: ScriptedUpstream
    anthropic: Provider
    openai: Provider
    forwarder: Forwarder
    registry: CollectorRegistry

    def model(self, upstream: str, api: str = ANTHROPIC, **values: Any) -> Model:
        provider = self.anthropic if api == ANTHROPIC else self.openai
        return Model(f"{api}-{upstream}", provider, upstream, **values)

    async def forward(
        self,
        document: Mapping[str, Any],
        attempts: Sequence[Model],
        operation: Operation = CHAT_COMPLETIONS,
        client: Client | None = None,
        record: UpstreamRecord | None = None,
        **options: Any,
    ) -> Answer:
        return await self.forwarder.forward(
            document,
            attempts,
            str(uuid.uuid4()),
            client if client is not None else Client(),
            lambda error: b'data: {"error": "' + error.code.value.encode() + b'"}\n\n',
            record if record is not None else UpstreamRecord(),
            operation=operation,
            **options,
        )


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedUpstream]:
    started = ScriptedUpstream(Path(tmp_path_factory.mktemp("anthropic")), apiKey=KEY).start()
    yield started
    started.stop()


@pytest.fixture
def harness(upstream: ScriptedUpstream) -> Iterator[Harness]:
    from twisted.internet import reactor

    upstream.clearRequests()
    anthropic = Provider("claude", upstream.baseURL, apiKey=KEY, api=ANTHROPIC, timeout=10.0)
    openai = Provider("gpt", upstream.baseURLUnder("oai"), apiKey=KEY, timeout=10.0)
    registry = CollectorRegistry()
    forwarder = Forwarder(reactor, reactor, [anthropic, openai], ProxyMetrics(registry))
    yield Harness(upstream, anthropic, openai, forwarder, registry)
    forwarder.close()


CHAT: dict[str, Any] = {
    "model": "claude",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello to the world"},
    ],
}
MESSAGE: dict[str, Any] = {
    "model": "claude",
    "max_tokens": 100,
    "system": "Be brief.",
    "messages": [{"role": "user", "content": "Say hello to the world"}],
}


@pytest_twisted.ensureDeferred
async def test_chatToAnthropic(harness: Harness) -> None:
    """
    A chat completion to an Anthropic provider goes to <base_url>/messages
    with the key as x-api-key, anthropic-version 2023-06-01 and no
    Authorization, translated (system, the model's cap as max_tokens);
    its answer comes back as a chat completion, its usage with the cache's
    reads and writes.
    """
    record = UpstreamRecord()
    model = harness.model("echo+cache:2:1", maxOutputTokens=321)
    answer = await harness.forward(CHAT, [model], record=record)
    sent = harness.upstream.requests()[-1]
    assert sent.path == "/v1/messages"
    assert sent.header("x-api-key") == KEY
    assert sent.header("authorization") is None
    assert sent.header("anthropic-version") == "2023-06-01"
    assert sent.header("anthropic-beta") is None
    assert sent.body == {
        "model": "echo+cache:2:1",
        "max_tokens": 321,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Say hello to the world"}],
    }
    completion = json.loads(answer.body)
    assert answer.document == completion
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["content"].startswith("Scripted answer to 2")
    assert completion["choices"][0]["finish_reason"] == "stop"
    usage = completion["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2, "cache_write_tokens": 1}
    assert record.usage == Usage(
        usage["prompt_tokens"], usage["completion_tokens"], cachedTokens=2, cacheWriteTokens=1
    )
    assert (record.provider, record.upstreamModel) == ("claude", "echo+cache:2:1")


@pytest_twisted.ensureDeferred
async def test_chatToAnthropicCaps(harness: Harness) -> None:
    """
    Anthropic requires max_tokens: the client's cap (either name), else
    the one a budget assumed (bounded by the model's ceiling), else the
    model's max_output_tokens, else D11's 4096.
    """
    model = harness.model("echo")
    capped = harness.model("echo", maxOutputTokens=50)
    for document, attempts, cap, expected in [
        ({**CHAT, "max_completion_tokens": 7}, [model], None, 7),
        ({**CHAT, "max_tokens": 9}, [model], None, 9),
        (CHAT, [model], 77, 77),
        (CHAT, [capped], 77, 50),
        (CHAT, [model], None, 4096),
    ]:
        await harness.forward(document, attempts, outputCap=cap)
        assert harness.upstream.requests()[-1].body["max_tokens"] == expected


@pytest_twisted.ensureDeferred
async def test_chatToAnthropicStream(harness: Harness) -> None:
    """
    A streamed chat completion to an Anthropic provider is translated
    event by event into chunks, ended with [DONE], with the usage chunk
    the client asked for; the ledger's usage comes from message_start and
    message_delta. What is gathered for observation is the chunks' data.
    """
    record = UpstreamRecord()
    client = Client()
    gathered: list[bytes] = []
    document = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    answer = await harness.forward(
        document,
        [harness.model("echo+cache:3:0")],
        client=client,
        record=record,
        onEventData=gathered.append,
    )
    assert answer.streamed and client.status == 200
    assert client.contentType == b"text/event-stream"
    assert harness.upstream.requests()[-1].body["stream"] is True
    events = [data for _, data in client.events()]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(
        chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"]
    )
    assert text.startswith("Scripted answer to 2 messages")
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3
    assert record.usage == Usage(usage["prompt_tokens"], usage["completion_tokens"], 3)
    assert record.usage.completionTokens == len(text.split())
    assert [json.loads(each) for each in gathered] == chunks
    assert not record.brokenMidStream


@pytest_twisted.ensureDeferred
async def test_chatToAnthropicStreamWithoutUsage(harness: Harness) -> None:
    """
    Without include_usage, no usage chunk is written, and the ledger has
    the usage all the same.
    """
    record = UpstreamRecord()
    client = Client()
    await harness.forward(
        {**CHAT, "stream": True}, [harness.model("echo")], client=client, record=record
    )
    events = [data for _, data in client.events()]
    assert events[-1] == "[DONE]"
    assert all(chunk["choices"] for chunk in events[:-1])
    assert record.usage is not None and record.usage.completionTokens > 0


@pytest_twisted.ensureDeferred
async def test_chatToolRoundTrip(harness: Harness) -> None:
    """
    A tool call of an Anthropic model reaches a chat client as tool_calls;
    its result sent back goes to the provider as a tool_result block.
    """
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look it up.",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
            },
        }
    ]
    model = harness.model("tool-call")
    answer = await harness.forward({**CHAT, "tools": tools}, [model])
    message = json.loads(answer.body)["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    call = message["message"]["tool_calls"][0]
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"text": "Say hello to the world"}
    sent = harness.upstream.requests()[-1].body
    assert sent["tools"] == [
        {
            "name": "lookup",
            "description": "Look it up.",
            "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}},
        }
    ]
    followUp = {
        **CHAT,
        "tools": tools,
        "messages": [
            *CHAT["messages"],
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "Hello, world."},
        ],
    }
    answer = await harness.forward(followUp, [model])
    assert json.loads(answer.body)["choices"][0]["finish_reason"] == "stop"
    turns = harness.upstream.requests()[-1].body["messages"]
    assert turns[1] == {
        "role": "assistant",
        "content": [
            {
                "type": "tool_use",
                "id": call["id"],
                "name": "lookup",
                "input": {"text": "Say hello to the world"},
            }
        ],
    }
    assert turns[2]["content"][0] == {
        "type": "tool_result",
        "tool_use_id": call["id"],
        "content": "Hello, world.",
    }


@pytest_twisted.ensureDeferred
async def test_chatToolCallStreamed(harness: Harness) -> None:
    """
    A streamed tool call arrives as OpenAI's tool call deltas.
    """
    client = Client()
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    await harness.forward(
        {**CHAT, "tools": tools, "stream": True}, [harness.model("tool-call")], client=client
    )
    chunks = [data for _, data in client.events()][:-1]
    calls = [
        call for chunk in chunks for call in chunk["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert calls[0]["function"]["name"] == "lookup"
    arguments = "".join(call["function"].get("arguments") or "" for call in calls)
    assert json.loads(arguments) == {"text": "Say hello to the world"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest_twisted.ensureDeferred
async def test_stopSequences(harness: Harness) -> None:
    """
    stop goes as stop_sequences; the answer cut at one says finish_reason
    stop (and vLLM's stop_reason, the sequence).
    """
    answer = await harness.forward({**CHAT, "stop": ["messages;"]}, [harness.model("echo")])
    assert harness.upstream.requests()[-1].body["stop_sequences"] == ["messages;"]
    choice = json.loads(answer.body)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "messages;"
    assert choice["message"]["content"] == "Scripted answer to 2 "


@pytest_twisted.ensureDeferred
async def test_untranslatableIsRefusedWithNothingSent(harness: Harness) -> None:
    """
    A field with no counterpart is 400 VALIDATION_ERROR naming it, and
    nothing is sent; a fallback that cannot take the request is skipped
    (the OpenAI model it falls back to takes it as it is).
    """
    for field, value in [("n", 2), ("logprobs", True)]:
        with pytest.raises(ApiError) as refused:
            await harness.forward({**CHAT, field: value}, [harness.model("echo")])
        assert refused.value.code is ErrorCode.VALIDATION_ERROR
        assert [error.field for error in refused.value.fieldErrors] == [field]
        assert CHAT_COMPLETIONS.refusal({**CHAT, field: value}, harness.model("echo")) is not None
    assert harness.upstream.requests() == []
    # An OpenAI model first, an Anthropic fallback that cannot take n = 2:
    # only the first is tried.
    with pytest.raises(ApiError) as failed:
        await harness.forward(
            {**CHAT, "n": 2}, [harness.model("status:503", OPENAI), harness.model("echo")]
        )
    assert failed.value.code is ErrorCode.UPSTREAM_ERROR
    assert [each.path for each in harness.upstream.requests()] == ["/oai/v1/chat/completions"]
    assert CHAT_COMPLETIONS.refusal({**CHAT, "n": 2}, harness.model("echo", OPENAI)) is None


@pytest_twisted.ensureDeferred
async def test_mixedFallbacks(harness: Harness) -> None:
    """
    Fallbacks may mix provider kinds: each attempt is carried in its
    provider's dialect, the client's answer in its own.
    """
    record = UpstreamRecord()
    answer = await harness.forward(
        CHAT, [harness.model("status:529"), harness.model("echo", OPENAI)], record=record
    )
    assert json.loads(answer.body)["object"] == "chat.completion"
    assert [each.path for each in harness.upstream.requests()] == [
        "/v1/messages",
        "/oai/v1/chat/completions",
    ]
    assert harness.upstream.requests()[-1].body["model"] == "echo"
    assert record.provider == "gpt" and not record.overloaded
    answer = await harness.forward(
        MESSAGE,
        [harness.model("status:503", OPENAI), harness.model("echo")],
        operation=MESSAGES,
    )
    assert json.loads(answer.body)["type"] == "message"


@pytest_twisted.ensureDeferred
async def test_anthropicFaults(harness: Harness) -> None:
    """
    An Anthropic provider's refusals map as D9 says: 429 with its
    Retry-After, 529 (overloaded, remembered in the record) 502, 400 the
    provider's message in detail, 401 (the operator's key) 502.
    """
    record = UpstreamRecord()
    with pytest.raises(ApiError) as limited:
        await harness.forward(CHAT, [harness.model("status:429:11")], record=record)
    assert limited.value.code is ErrorCode.UPSTREAM_RATE_LIMITED
    assert limited.value.headers == (("Retry-After", "11"),)
    with pytest.raises(ApiError) as overloaded:
        await harness.forward(CHAT, [harness.model("status:529")], record=record)
    assert (overloaded.value.code, overloaded.value.status) == (ErrorCode.UPSTREAM_ERROR, 502)
    assert record.overloaded
    with pytest.raises(ApiError) as rejected:
        await harness.forward(CHAT, [harness.model("status:400")], record=record)
    assert (rejected.value.code, rejected.value.status) == (ErrorCode.UPSTREAM_REJECTED, 400)
    assert rejected.value.detail == "Scripted error 400 for model 'status:400'."
    assert not overloadedIn(record)
    with pytest.raises(ApiError) as broken:
        await harness.forward(CHAT, [harness.model("not-json")], record=record)
    assert broken.value.code is ErrorCode.UPSTREAM_ERROR
    labels = {"provider": "claude", "model": "anthropic-status:529", "status": "529"}
    assert harness.registry.get_sample_value("svc_proxy_upstream_requests_total", labels) == 1


@pytest_twisted.ensureDeferred
async def test_errorMidStream(harness: Harness) -> None:
    """
    The provider's error event after the first byte ends the client's
    stream with the client's error event (overloaded remembered); the
    usage so far is kept.
    """
    record = UpstreamRecord()
    client = Client()
    await harness.forward(
        {**CHAT, "stream": True}, [harness.model("error-mid-stream")], client=client, record=record
    )
    assert record.brokenMidStream and record.overloaded
    assert client.events()[-1] == (None, {"error": "UPSTREAM_ERROR"})
    assert record.usage is not None
    labels = {
        "provider": "claude",
        "model": "anthropic-error-mid-stream",
        "status": "stream_error_event",
    }
    assert harness.registry.get_sample_value("svc_proxy_upstream_requests_total", labels) == 1


@pytest_twisted.ensureDeferred
async def test_streamCutShort(harness: Harness) -> None:
    """
    An Anthropic stream that ends before message_stop is broken mid-stream.
    """
    record = UpstreamRecord()
    client = Client()
    await harness.forward(
        {**CHAT, "stream": True}, [harness.model("close-mid-stream")], client=client, record=record
    )
    assert record.brokenMidStream
    assert client.events()[-1] == (None, {"error": "UPSTREAM_ERROR"})


@pytest_twisted.ensureDeferred
async def test_messagesToAnthropicAsGiven(harness: Harness) -> None:
    """
    A Messages request to an Anthropic provider is sent as the client sent
    it (the model replaced), with the client's anthropic-version and
    anthropic-beta; the answer is relayed as given, its usage read.
    """
    record = UpstreamRecord()
    document = {**MESSAGE, "top_k": 5, "unknown_field": {"kept": True}}
    answer = await harness.forward(
        document,
        [harness.model("echo+cache:1:2")],
        operation=MESSAGES,
        record=record,
        clientHeaders={b"anthropic-version": b"2023-01-01", b"anthropic-beta": b"beta-1,beta-2"},
    )
    sent = harness.upstream.requests()[-1]
    assert sent.body == {**document, "model": "echo+cache:1:2"}
    assert sent.header("anthropic-version") == "2023-01-01"
    assert sent.header("anthropic-beta") == "beta-1,beta-2"
    message = json.loads(answer.body)
    assert message["type"] == "message" and message["model"] == "echo+cache:1:2"
    usage = message["usage"]
    assert record.usage == Usage(
        usage["input_tokens"] + 3, usage["output_tokens"], cachedTokens=1, cacheWriteTokens=2
    )


@pytest_twisted.ensureDeferred
async def test_messagesToAnthropicStreamAsGiven(harness: Harness) -> None:
    """
    Its stream is relayed event for event (ping included), the usage from
    message_start and message_delta; the provider's error event reaches
    the client as the provider sent it, and no other follows.
    """
    record = UpstreamRecord()
    client = Client()
    gathered: list[bytes] = []
    await harness.forward(
        {**MESSAGE, "stream": True},
        [harness.model("echo+cache:2:0")],
        operation=MESSAGES,
        client=client,
        record=record,
        onEventData=gathered.append,
    )
    names = [name for name, _ in client.events()]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert record.usage is not None and record.usage.cachedTokens == 2
    final = client.events()[-2][1]
    assert record.usage.completionTokens == final["usage"]["output_tokens"]
    assert len(gathered) == len(names)
    client = Client()
    record = UpstreamRecord()
    await harness.forward(
        {**MESSAGE, "stream": True},
        [harness.model("error-mid-stream")],
        operation=MESSAGES,
        client=client,
        record=record,
    )
    assert client.events()[-1][0] == "error"
    assert client.events()[-1][1]["error"]["type"] == "overloaded_error"
    assert record.brokenMidStream and record.overloaded


@pytest_twisted.ensureDeferred
async def test_messagesToOpenAI(harness: Harness) -> None:
    """
    A Messages request to an OpenAI-compatible provider is translated both
    ways (the cap under the model's cap_field), streams included.
    """
    model = harness.model("echo+cache:1:0", OPENAI, capField="max_tokens")
    record = UpstreamRecord()
    answer = await harness.forward(MESSAGE, [model], operation=MESSAGES, record=record)
    sent = harness.upstream.requests()[-1]
    assert sent.path == "/oai/v1/chat/completions"
    assert sent.header("authorization") == "Bearer " + KEY
    assert sent.header("x-api-key") is None and sent.header("anthropic-version") is None
    assert sent.body == {
        "model": "echo+cache:1:0",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello to the world"},
        ],
        "max_tokens": 100,
    }
    message = json.loads(answer.body)
    assert message["type"] == "message" and message["stop_reason"] == "end_turn"
    assert message["usage"]["cache_read_input_tokens"] == 1
    assert record.usage is not None and record.usage.cachedTokens == 1
    client = Client()
    await harness.forward(
        {**MESSAGE, "stream": True}, [model], operation=MESSAGES, client=client, record=record
    )
    assert harness.upstream.requests()[-1].body["stream_options"] == {"include_usage": True}
    names = [name for name, _ in client.events()]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    text = "".join(
        data["delta"]["text"]
        for name, data in client.events()
        if name == "content_block_delta" and data["delta"]["type"] == "text_delta"
    )
    assert text.startswith("Scripted answer to 2 messages")
    assert client.events()[-2][1]["usage"]["output_tokens"] == record.usage.completionTokens


@pytest_twisted.ensureDeferred
async def test_messagesUntranslatable(harness: Harness) -> None:
    """
    A Messages field with no counterpart in chat completions is refused
    for an OpenAI-compatible provider, nothing sent.
    """
    with pytest.raises(ApiError) as refused:
        await harness.forward(
            {**MESSAGE, "top_k": 3}, [harness.model("echo", OPENAI)], operation=MESSAGES
        )
    assert [error.field for error in refused.value.fieldErrors] == ["top_k"]
    assert harness.upstream.requests() == []


@pytest_twisted.ensureDeferred
async def test_countTokens(harness: Harness) -> None:
    """
    count_tokens goes to an Anthropic provider's /messages/count_tokens,
    its answer as given, no usage.
    """
    record = UpstreamRecord()
    document = {"model": "claude", "messages": MESSAGE["messages"]}
    answer = await harness.forward(
        document, [harness.model("echo")], operation=COUNT_TOKENS, record=record
    )
    assert harness.upstream.requests()[-1].path == "/v1/messages/count_tokens"
    assert json.loads(answer.body)["input_tokens"] > 0
    assert record.usage is None


def test_bodiesForTheReservation() -> None:
    """
    What a budget measures is the body sent: translated for an Anthropic
    provider; None for a model that cannot be sent the request.
    """
    anthropic = Provider("claude", "http://127.0.0.1:1/v1", api=ANTHROPIC)
    model = Model("claude", anthropic, "claude-x")
    body = CHAT_COMPLETIONS.sendable(CHAT, model, 10)
    assert body is not None
    assert json.loads(body) == {
        "model": "claude-x",
        "max_tokens": 10,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Say hello to the world"}],
    }
    assert CHAT_COMPLETIONS.sendable({**CHAT, "n": 3}, model) is None
    assert COUNT_TOKENS.sendable(CHAT, Model("gpt", Provider("gpt", "http://x/v1"))) is None


def test_worstCaseMeasuresTheTranslatedBody() -> None:
    """
    Decisions D12 amended, D14: a budget's worst case measures each
    attempt's body as it is sent (translated for an Anthropic provider),
    and the forwarder is handed those bodies; a fallback that cannot be
    sent the request is never tried, and counts nothing.
    """
    from svcd.limits.reservation import worstCaseCost
    from svcd.metering.prices import Price
    from svcd.proxy.http.chatbody import parseChatBody

    price = Price(input=1000, output=2000, cachedInput=500)
    anthropic = Provider("claude", "http://127.0.0.1:1/v1", api=ANTHROPIC)
    openai = Provider("gpt", "http://127.0.0.1:1/v1")
    claude = Model("claude", anthropic, "claude-x", price=price, fallbacks=("gpt",))
    gpt = Model("gpt", openai, "gpt-x", price=Price(input=10, output=20, cachedInput=5))
    chat = parseChatBody(json.dumps({**CHAT, "model": "claude"}).encode())
    bodies: dict[str, bytes] = {}
    cost = worstCaseCost(chat, [claude, gpt], 50, 50, 0, bodies, CHAT_COMPLETIONS.sendable)
    assert json.loads(bodies["claude"])["system"] == "Be brief."
    assert bodies["claude"] == CHAT_COMPLETIONS.body(chat.document, claude, 50)
    assert json.loads(bodies["gpt"])["max_completion_tokens"] == 50
    assert cost == price.worstCase(len(bodies["claude"]), 50)
    # n = 2 cannot go to Anthropic: only the OpenAI fallback counts.
    chat = parseChatBody(json.dumps({**CHAT, "model": "claude", "n": 2}).encode())
    bodies = {}
    cost = worstCaseCost(chat, [claude, gpt], 50, 50, 0, bodies, CHAT_COMPLETIONS.sendable)
    assert list(bodies) == ["gpt"]
    assert cost == gpt.price.worstCase(len(bodies["gpt"]), 100)  # type: ignore[union-attr]


def test_aLoneSurrogateIsWrittenEscaped() -> None:
    """
    A body or a translated answer holding a lone surrogate (JSON's escape
    of one, which a client or a provider may send) is written as the same
    JSON with its non-ASCII characters escaped, not an UnicodeEncodeError
    on the request's path; any other document stays UTF-8 as it was.
    """
    from svcd.providers import operations, upstream

    lone = {"content": "caf\u00e9 \ud800 end"}
    plain = {"content": "caf\u00e9"}
    for dumps in (operations._dumps, upstream._dumps):
        written = dumps(lone)
        assert written.isascii()
        assert json.loads(written) == lone
        assert dumps(plain) == '{"content":"café"}'.encode()
