"""
Anthropic's Messages API end to end (decisions D14, issue 46): real
svc-auth, svc-memory and svc-proxy daemons over PostgreSQL and Redis,
driven with the official C{anthropic} SDK, forwarding to the scripted
model server (svcd/devkit/upstream), which speaks both dialects: a model
of an Anthropic provider (C{api = "anthropic"}: the body and the answer
relayed as given) and a model of an OpenAI-compatible one (translated both
ways), each answered plainly, streamed, with a tool call and its result,
counted, refused; the gateway's own refusals as the SDK's exceptions; the
ledger row of every request; recall's block in the upstream's system
prompt and the answer observed.

The upstream is keyed: both providers reach it with the same key, which
an Anthropic provider sends as C{x-api-key} and an OpenAI-compatible one
as a bearer, so that a forwarded request with the wrong header would be
refused there. Tests find what the upstream received by the request id
the gateway sent it.
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import json
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import attrs
import grpc
import psycopg
import pytest
from authfixtures import Tenant, makeTenant
from gatewayfixtures import request, waitFor

from svcd.auth.store import Store
from svcd.common.permissions import Permission
from svcd.devkit.daemons import Daemon, authEnvironment, memoryEnvironment
from svcd.devkit.pgtemplate import migratedDatabase
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import RecordedRequest, ScriptedUpstream
from svcd.devkit.upstream.content import DEFAULT_EMBEDDING_DIMENSIONS, embeddingOf
from svcd.pb.memory.v1 import memory_pb2, memory_pb2_grpc
from svcd.proxy.recall import HEADING

# Starts real daemons (conftest.py, pytest.ini): left out of a quick run.
pytestmark = pytest.mark.e2e

UPSTREAM_KEY = "sk-scripted-" + uuid.uuid4().hex
# The requests per minute of the limited tenant's organization.
LIMITED_RPM = 2
# The output ceiling of every chat model here (decisions D12 amended).
CEILING = 4000

# Each model of an Anthropic provider has its twin of an OpenAI-compatible
# one, named with "gpt" for "claude": the same script either way.
SCRIPTS = {
    "claude": "echo",
    "claude-tools": "tool-call",
    "claude-limited": "status:429",
    "claude-overloaded": "status:529",
    "claude-rejected": "status:422",
    "claude-cache": "cache:2:3",
    "claude-broken": "error-mid-stream",
    # The most each request allows, every prompt token a cache write (the
    # dearest input): what a budget must survive (decisions D12 amended).
    "claude-written": "usage-at-cap+cache:0:999999999",
}

PROVIDERS = """
[[providers]]
name = "anthropic-side"
api = "anthropic"
base_url = "{base}"
api_key_env = "SCRIPTED_KEY"

[[providers]]
name = "openai-side"
base_url = "{base}"
api_key_env = "SCRIPTED_KEY"

[[models]]
name = "embed"
provider = "openai-side"
upstream_model = "echo"
kind = "embedding"
price = {{ input = "0.5" }}

[memory]
embedding_model = "embed"
recall_k = 3
max_context_tokens = 200
"""

MODEL = """
[[models]]
name = "{name}"
provider = "{provider}"
upstream_model = "{script}"
max_output_tokens = {ceiling}
price = {{ input = "3", output = "15", cached_input = "0.3", cache_write = "3.75" }}
"""


def providersFile(base: str) -> str:
    text = PROVIDERS.format(base=base)
    for name, script in SCRIPTS.items():
        for model, provider in ((name, "anthropic-side"), (twin(name), "openai-side")):
            text += MODEL.format(name=model, provider=provider, script=script, ceiling=CEILING)
    return text


def twin(model: str) -> str:
    """
    The model of the OpenAI-compatible provider with the same script.
    """
    return model.replace("claude", "gpt")


BOTH = ["claude", "gpt"]


@attrs.frozen
class Stack:
    dsn: str
    owner: Store
    memory: Daemon
    proxy: Daemon
    upstream: ScriptedUpstream
    tenants: dict[str, Tenant]

    @property
    def port(self) -> int:
        return self.proxy.httpPort

    def client(self, tenant: str = "main", **options: Any) -> anthropic.Anthropic:
        """
        Anthropic's SDK as its users point it at the gateway: the token as
        its API key (x-api-key), the agent in a default header; no retries,
        so that each refusal is seen once.
        """
        chosen = self.tenants[tenant]
        headers = {"X-SVC-Agent-ID": str(chosen.agentID), **options.pop("headers", {})}
        return anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{self.port}",
            api_key=options.pop("api_key", chosen.token),
            default_headers=headers,
            max_retries=0,
            timeout=60,
            **options,
        )

    def received(self, requestID: str, count: int = 1) -> list[RecordedRequest]:
        """
        What the upstream received for C{requestID} (but a recall's
        embedding), once C{count} such requests have ended.
        """
        found: list[RecordedRequest] = []

        def arrived() -> bool:
            found[:] = [
                each
                for each in self.upstream.requests()
                if each.header("x-request-id") == requestID
                and each.ended is not None
                and not each.path.endswith("/embeddings")
            ]
            return len(found) >= count

        waitFor(arrived, 15)
        assert len(found) == count, found
        return found

    def receivedNothing(self, requestID: str) -> bool:
        time.sleep(0.2)
        return not [
            each for each in self.upstream.requests() if each.header("x-request-id") == requestID
        ]

    def rows(self, requestID: str, count: int = 1) -> list[dict[str, Any]]:
        """
        The ledger rows of C{requestID}, once there are C{count}.
        """
        found: list[dict[str, Any]] = []

        def recorded() -> bool:
            with psycopg.connect(self.dsn, autocommit=True) as connection:
                cursor = connection.execute(
                    "SELECT kind, model_requested, model, provider, upstream_model, stream,"
                    " outcome, prompt_tokens, cached_tokens, cache_write_tokens,"
                    " completion_tokens, tokens_from,"
                    " cost_nano_usd, memories FROM usage_ledger WHERE request_id = %s"
                    " ORDER BY kind",
                    (requestID,),
                )
                names = [column.name for column in cursor.description or ()]
                found[:] = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
            return len(found) >= count

        waitFor(recorded, 30)
        assert len(found) == count, found
        return found

    def noRow(self, requestID: str) -> bool:
        time.sleep(0.5)
        with psycopg.connect(self.dsn, autocommit=True) as connection:
            cursor = connection.execute(
                "SELECT count(*) FROM usage_ledger WHERE request_id = %s", (requestID,)
            )
            row = cursor.fetchone()
        return row is not None and row[0] == 0


@pytest.fixture(scope="module")
def stack(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("messages")
    name = f"messages_{uuid.uuid4().hex[:12]}"
    dsn = migratedDatabase(postgresServer, name)
    redis = RedisServer.create(workdir / "redis")
    redis.start()
    upstream = ScriptedUpstream(workdir / "upstream", apiKey=UPSTREAM_KEY).start()
    connection = psycopg.connect(dsn, autocommit=True)
    owner = Store(lambda: contextlib.nullcontext(connection))
    tenants = {
        "main": makeTenant(owner, "main"),
        "limited": makeTenant(owner, "limited"),
        "embedder": makeTenant(owner, "embedder", permissions=int(Permission.ProxyEmbeddings)),
        "memory": makeTenant(owner, "memory"),
    }
    providers = workdir / "providers.toml"
    providers.write_text(providersFile(upstream.baseURL))
    daemons: list[Daemon] = []
    try:
        auth = Daemon("svc-auth", authEnvironment(dsn), workdir / "auth.log").start()
        daemons.append(auth)
        memory = Daemon("svc-memory", memoryEnvironment(dsn), workdir / "memory.log").start()
        daemons.append(memory)
        proxy = Daemon(
            "svc-proxy",
            {
                "SVC_HOST": "127.0.0.1",
                "SVC_PORT": str(freePort()),
                "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}",
                "SVC_MEMORY_GRPC_ADDR": f"127.0.0.1:{memory.environment['SVC_GRPC_PORT']}",
                "SVC_MEMORY_TIMEOUT": "30s",
                "REDIS_URL": redis.url,
                "SVC_PROVIDERS_FILE": str(providers),
                "SCRIPTED_KEY": UPSTREAM_KEY,
                "SVC_AUTH_VALIDATE_TIMEOUT": "5s",
                "SVC_RATE_LIMIT_DEFAULT_RPM": "1000000",
                "SVC_RATE_LIMIT_ORG_OVERRIDES": f"{tenants['limited'].orgID}={LIMITED_RPM}",
                "SVC_SHUTDOWN_TIMEOUT": "5s",
                "SVC_MEMORY_JOURNAL": str(workdir / "memory.journal"),
            },
            workdir / "proxy.log",
        ).start()
        daemons.append(proxy)
        for daemon in daemons:
            daemon.waitForReady()
        yield Stack(dsn, owner, memory, proxy, upstream, tenants)
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
        upstream.stop()
        redis.destroy()
        connection.close()
        postgresServer.dropDatabase(name)
    for daemon in daemons:
        assert "Traceback" not in daemon.output(), daemon.output()


def question(text: str = "What is the capital of France?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def echoOf(messages: int, characters: int) -> str:
    # The scripted upstream's echo (svcd/devkit/upstream, "echo").
    return f"Scripted answer to {messages} messages; the last has {characters} characters."


WEATHER_TOOL = {
    "name": "weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


# Answers, to either kind of provider.


def test_createToAnthropicProviderRelayedAsGiven(stack: Stack) -> None:
    """
    messages.create to a model of an Anthropic provider: the upstream gets
    the body as the client sent it (the model replaced by upstream_model,
    every other key kept), at <base>/messages, with the provider's key as
    x-api-key, the client's anthropic-version and anthropic-beta, and
    nothing else of the client's (not its token, not its agent); the
    answer is relayed as given, with the gateway's headers.
    """
    extra = {
        "top_k": 5,
        "temperature": 0.5,
        "metadata": {"user_id": "u-1"},
        "x_unknown": {"k": [1, "é"]},
    }
    raw = stack.client().messages.with_raw_response.create(
        model="claude",
        max_tokens=200,
        system="Be brief.",
        messages=question(),  # type: ignore[arg-type]
        stop_sequences=["never-there"],
        extra_body=extra,
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"},
    )
    assert raw.status_code == 200
    assert raw.headers["x-svc-upstream-model"] == "claude"
    requestID = raw.headers["x-request-id"]
    message = raw.parse()
    # The id where Anthropic's API puts it, once, as the SDK reads it.
    assert raw.headers.get_list("request-id") == [requestID]
    assert message._request_id == requestID
    (received,) = stack.received(requestID)
    assert (received.method, received.path) == ("POST", "/v1/messages")
    assert received.body == {
        "model": "echo",
        "max_tokens": 200,
        "system": "Be brief.",
        "messages": question(),
        "stop_sequences": ["never-there"],
        **extra,
    }
    assert received.header("x-api-key") == UPSTREAM_KEY
    assert received.header("authorization") is None
    # The client's own version (its SDK's), passed on.
    assert received.header("anthropic-version") == raw.http_request.headers["anthropic-version"]
    assert received.header("anthropic-beta") == "prompt-caching-2024-07-31"
    everything = json.dumps(received.headers)
    tenant = stack.tenants["main"]
    assert tenant.token not in everything and str(tenant.agentID) not in everything
    # Relayed as given: the upstream's own id and text.
    assert message.id == f"msg_scripted_{received.number}"
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text"
    assert message.content[0].text == echoOf(2, len("What is the capital of France?"))
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens > 0
    (row,) = stack.rows(requestID)
    assert row["model_requested"] == "claude" and row["provider"] == "anthropic-side"
    assert (row["kind"], row["outcome"], row["stream"]) == ("chat", "ok", False)
    assert row["prompt_tokens"] == message.usage.input_tokens
    assert row["completion_tokens"] == message.usage.output_tokens
    assert row["tokens_from"] == "provider" and row["cost_nano_usd"] > 0


def test_createToOpenAIProviderTranslated(stack: Stack) -> None:
    """
    messages.create to a model of an OpenAI-compatible provider: the
    upstream gets a chat completion (the system prompt a system message,
    stop_sequences as stop, max_tokens under the model's cap field, the
    key as a bearer, no Anthropic header), and the client an Anthropic
    message with the answer's text, stop reason and usage.
    """
    raw = stack.client().messages.with_raw_response.create(
        model="gpt",
        max_tokens=200,
        system="Be brief.",
        messages=question(),  # type: ignore[arg-type]
        stop_sequences=["never-there"],
    )
    assert raw.headers["x-svc-upstream-model"] == "gpt"
    requestID = raw.headers["x-request-id"]
    message = raw.parse()
    (received,) = stack.received(requestID)
    assert received.path == "/v1/chat/completions"
    assert received.body["model"] == "echo"
    assert received.body["messages"] == [{"role": "system", "content": "Be brief."}, *question()]
    assert received.body["stop"] == ["never-there"]
    assert received.body["max_completion_tokens"] == 200
    assert received.header("authorization") == f"Bearer {UPSTREAM_KEY}"
    assert received.header("x-api-key") is None and received.header("anthropic-version") is None
    assert message.type == "message"
    assert message.content[0].type == "text"
    assert message.content[0].text == echoOf(2, len("What is the capital of France?"))
    assert message.stop_reason == "end_turn"
    (row,) = stack.rows(requestID)
    assert (row["provider"], row["outcome"]) == ("openai-side", "ok")
    assert row["prompt_tokens"] == message.usage.input_tokens > 0
    assert row["completion_tokens"] == message.usage.output_tokens > 0


@pytest.mark.parametrize("model", BOTH)
def test_streamTextDeltasAndFinalMessage(stack: Stack, model: str) -> None:
    """
    messages.stream, to either provider: the text arrives in deltas whose
    concatenation is the final message's text; the final message has its
    stop reason and usage (from message_start and message_delta), which the
    ledger row counts (stream true).
    """
    with stack.client().messages.stream(
        model=model,
        max_tokens=200,
        messages=question(),  # type: ignore[arg-type]
    ) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
        requestID = stream.response.headers["x-request-id"]
        assert stream.response.headers.get_list("request-id") == [requestID]
        assert stream.response.headers["content-type"].startswith("text/event-stream")
    assert len(deltas) > 3
    assert "".join(deltas) == final.content[0].text  # type: ignore[union-attr]
    assert final.content[0].text == echoOf(1, len("What is the capital of France?"))  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    (received,) = stack.received(requestID)
    assert received.body["stream"] is True
    (row,) = stack.rows(requestID)
    assert (row["stream"], row["outcome"]) == (True, "ok")
    assert row["prompt_tokens"] == final.usage.input_tokens > 0
    assert row["completion_tokens"] == final.usage.output_tokens > 0


@pytest.mark.parametrize("model", BOTH)
@pytest.mark.parametrize("stream", [False, True])
def test_toolUseRoundTrip(stack: Stack, model: str, stream: bool) -> None:
    """
    A tool call and its result, to either provider, streamed or not: the
    answer is a tool_use block (its id, name and input object) with stop
    reason tool_use; sent back as a tool_result, the conversation ends
    with the model's text. The upstream of an OpenAI-compatible provider
    got the tool as a function, and the result as a tool message.
    """
    client = stack.client()
    messages: list[dict[str, Any]] = question("Weather in Lyon?")
    kwargs: dict[str, Any] = {
        "model": f"{model}-tools",
        "max_tokens": 200,
        "tools": [WEATHER_TOOL],
    }
    called: Any
    if stream:
        with client.messages.stream(messages=messages, **kwargs) as streamed:  # type: ignore[arg-type]
            called = streamed.get_final_message()
    else:
        called = client.messages.create(messages=messages, **kwargs)  # type: ignore[arg-type]
    assert called.stop_reason == "tool_use"
    (use,) = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "weather"
    assert use.input == {"text": "Weather in Lyon?"}
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in called.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    raw = client.messages.with_raw_response.create(messages=messages, **kwargs)  # type: ignore[arg-type]
    answer = raw.parse()
    assert answer.stop_reason == "end_turn"
    assert answer.content[0].type == "text"
    (received,) = stack.received(raw.headers["x-request-id"])
    if model == "gpt":
        assert received.body["tools"][0]["function"]["name"] == "weather"
        assert received.body["messages"][-1] == {
            "role": "tool",
            "tool_call_id": use.id,
            "content": "sunny",
        }
    else:
        assert received.body["messages"] == messages


# count_tokens.


def test_countTokensForwardedToAnthropic(stack: Stack) -> None:
    """
    count_tokens of a model of an Anthropic provider: forwarded to
    <base>/messages/count_tokens (the body as sent, the model replaced),
    its answer relayed; no ledger row.
    """
    raw = stack.client().messages.with_raw_response.count_tokens(
        model="claude",
        system="Be brief.",
        messages=question(),  # type: ignore[arg-type]
    )
    counted = raw.parse()
    requestID = raw.headers["x-request-id"]
    (received,) = stack.received(requestID)
    assert received.path == "/v1/messages/count_tokens"
    assert received.body == {"model": "echo", "system": "Be brief.", "messages": question()}
    assert received.header("x-api-key") == UPSTREAM_KEY
    # The scripted count: the words of the system prompt and the turns.
    assert counted.input_tokens == 2 + 6
    assert stack.noRow(requestID)


def test_countTokensEstimatedForOthers(stack: Stack) -> None:
    """
    count_tokens of a model of an OpenAI-compatible provider: D11's
    estimate, nothing forwarded, no ledger row.
    """
    raw = stack.client().messages.with_raw_response.count_tokens(
        model="gpt",
        messages=question("x" * 300),  # type: ignore[arg-type]
    )
    counted = raw.parse()
    # 300 bytes / 3, and 4 for the message.
    assert counted.input_tokens == 104
    requestID = raw.headers["x-request-id"]
    assert stack.receivedNothing(requestID)
    assert stack.noRow(requestID)


# The gateway's own refusals, as the SDK's exceptions.


def errorBody(error: anthropic.APIStatusError) -> dict[str, Any]:
    """
    The body of an error in Anthropic's envelope (decisions D14), after
    the checks every one must pass.
    """
    body = error.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["request_id"] == error.response.headers["x-request-id"]
    inner: dict[str, Any] = body["error"]
    assert inner["message"]
    return inner


def test_authenticationError(stack: Stack) -> None:
    """
    A token the gateway does not know: AuthenticationError (401,
    authentication_error, INVALID_TOKEN); x-api-key and a bearer that
    differ: the same; nothing forwarded.
    """
    bogus = f"svc_pat_{uuid.uuid4()}_{'a' * 43}"
    with pytest.raises(anthropic.AuthenticationError) as raised:
        stack.client(api_key=bogus).messages.create(
            model="claude",
            max_tokens=10,
            messages=question(),  # type: ignore[arg-type]
        )
    inner = errorBody(raised.value)
    assert (inner["type"], inner["code"]) == ("authentication_error", "INVALID_TOKEN")
    assert stack.receivedNothing(raised.value.response.headers["x-request-id"])
    assert raised.value.request_id == raised.value.response.headers["x-request-id"]
    tenant = stack.tenants["main"]
    headers = {"Authorization": f"Bearer {bogus}"}
    with pytest.raises(anthropic.AuthenticationError) as raised:
        stack.client(headers=headers).messages.create(
            model="claude",
            max_tokens=10,
            messages=question(),  # type: ignore[arg-type]
        )
    assert errorBody(raised.value)["code"] == "INVALID_TOKEN"
    # The bearer alone (the SDK's auth_token) is a token as good.
    message = stack.client(api_key=None, auth_token=tenant.token).messages.create(
        model="claude",
        max_tokens=10,
        messages=question(),  # type: ignore[arg-type]
    )
    assert message.type == "message"


def test_permissionDeniedError(stack: Stack) -> None:
    """
    A token without ProxyChatCompletion: PermissionDeniedError (403,
    permission_error, INSUFFICIENT_PERMISSIONS).
    """
    with pytest.raises(anthropic.PermissionDeniedError) as raised:
        stack.client("embedder").messages.create(
            model="claude",
            max_tokens=10,
            messages=question(),  # type: ignore[arg-type]
        )
    inner = errorBody(raised.value)
    assert (inner["type"], inner["code"]) == ("permission_error", "INSUFFICIENT_PERMISSIONS")


def test_rateLimitErrorWithRetryAfter(stack: Stack) -> None:
    """
    Past the organization's requests per minute (count_tokens counts
    toward them): RateLimitError (429, rate_limit_error, RATE_LIMITED),
    with Retry-After and X-RateLimit-*. A provider's 429 is
    UPSTREAM_RATE_LIMITED with its Retry-After, to either provider.
    """
    client = stack.client("limited")
    refused: anthropic.RateLimitError | None = None
    for _ in range(LIMITED_RPM + 1):
        try:
            client.messages.count_tokens(model="claude", messages=question())  # type: ignore[arg-type]
        except anthropic.RateLimitError as error:
            refused = error
            break
    assert refused is not None
    inner = errorBody(refused)
    assert (inner["type"], inner["code"]) == ("rate_limit_error", "RATE_LIMITED")
    headers = refused.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-limit"] == str(LIMITED_RPM)
    for model in ("claude-limited", "gpt-limited"):
        with pytest.raises(anthropic.RateLimitError) as raised:
            stack.client().messages.create(
                model=model,
                max_tokens=10,
                messages=question(),  # type: ignore[arg-type]
            )
        assert errorBody(raised.value)["code"] == "UPSTREAM_RATE_LIMITED"
        assert raised.value.response.headers["retry-after"] == "7"


def test_badRequestError(stack: Stack) -> None:
    """
    BadRequestError (400, invalid_request_error, VALIDATION_ERROR naming
    the field) for a body out of D14's shape, for max_tokens above the
    model's max_output_tokens, and for a field the provider's dialect
    cannot carry (top_k to an OpenAI-compatible provider); nothing is
    forwarded, and no row recorded.
    """
    client = stack.client()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"model": "claude", "max_tokens": CEILING + 1, "messages": question()}, "max_tokens"),
        (
            {
                "model": "gpt",
                "max_tokens": 10,
                "messages": question(),
                "extra_body": {"top_k": 3},
            },
            "top_k",
        ),
        (
            {
                "model": "claude",
                "max_tokens": 10,
                "messages": [{"role": "system", "content": "x"}],
            },
            "messages[0].role",
        ),
    ]
    for arguments, field in cases:
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(**arguments)
        inner = errorBody(raised.value)
        assert (inner["type"], inner["code"]) == ("invalid_request_error", "VALIDATION_ERROR")
        assert [each["field"] for each in inner["field_errors"]] == [field]
        assert field in inner["message"]
        requestID = raised.value.response.headers["x-request-id"]
        assert stack.receivedNothing(requestID)
        assert stack.noRow(requestID)


@pytest.mark.parametrize("model", BOTH)
def test_providersRefusalsInAnthropicsShape(stack: Stack, model: str) -> None:
    """
    A provider's refusal before any byte: its 4xx is UPSTREAM_REJECTED at
    its status (the SDK's class for it), its message in detail; an
    overloaded Anthropic provider (529) is the gateway's 502 UPSTREAM_ERROR
    of type overloaded_error (which Anthropic's SDKs retry), any other
    provider's 5xx an api_error.
    """
    client = stack.client()
    with pytest.raises(anthropic.UnprocessableEntityError) as rejected:
        client.messages.create(
            model=f"{model}-rejected",
            max_tokens=10,
            messages=question(),  # type: ignore[arg-type]
        )
    inner = errorBody(rejected.value)
    assert (inner["type"], inner["code"]) == ("invalid_request_error", "UPSTREAM_REJECTED")
    assert "Scripted error 422" in inner["detail"]
    with pytest.raises(anthropic.InternalServerError) as failed:
        client.messages.create(
            model=f"{model}-overloaded",
            max_tokens=10,
            messages=question(),  # type: ignore[arg-type]
        )
    assert failed.value.status_code == 502
    inner = errorBody(failed.value)
    expected = "overloaded_error" if model == "claude" else "api_error"
    assert (inner["type"], inner["code"]) == (expected, "UPSTREAM_ERROR")


@pytest.mark.parametrize("model", BOTH)
def test_errorMidStreamIsAnErrorEvent(stack: Stack, model: str) -> None:
    """
    A provider's fault after the stream began ends it with Anthropic's
    error event, which the SDK raises: an Anthropic provider's own,
    relayed as given (here its overloaded_error), or the gateway's
    UPSTREAM_ERROR for a translated stream; the row is an upstream_error.
    """
    with pytest.raises(anthropic.APIStatusError) as raised:
        with stack.client().messages.stream(
            model=f"{model}-broken",
            max_tokens=200,
            messages=question(),  # type: ignore[arg-type]
        ) as stream:
            requestID = stream.response.headers["x-request-id"]
            for _ in stream.text_stream:
                pass
    body = raised.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    if model == "claude":
        assert body["error"]["type"] == "overloaded_error"
    else:
        assert (body["error"]["type"], body["error"]["code"]) == ("api_error", "UPSTREAM_ERROR")
    (row,) = stack.rows(requestID)
    assert row["outcome"] == "upstream_error"


# Money: cache reads and writes.


@pytest.mark.parametrize("stream", [False, True])
def test_cacheReadsAndWritesInTheRow(stack: Stack, stream: bool) -> None:
    """
    An Anthropic provider's usage with cache reads and writes (decisions
    D14), whole or streamed (message_start, then message_delta): the row's
    prompt tokens are all three inputs, its cached tokens the reads, its
    cache writes the writes, each priced apart to the nano-dollar (input
    $3, cache reads $0.30, writes $3.75, output $15 a million).
    """
    client = stack.client()
    arguments: dict[str, Any] = {
        "model": "claude-cache",
        "max_tokens": 200,
        "messages": question("one two three four five six seven eight nine ten"),
    }
    if stream:
        with client.messages.stream(**arguments) as streamed:
            message = streamed.get_final_message()
            requestID = streamed.response.headers["x-request-id"]
    else:
        raw = client.messages.with_raw_response.create(**arguments)
        message, requestID = raw.parse(), raw.headers["x-request-id"]
    usage = message.usage
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (2, 3)
    (row,) = stack.rows(requestID)
    assert row["prompt_tokens"] == usage.input_tokens + 2 + 3
    assert row["cached_tokens"] == 2
    assert row["cache_write_tokens"] == 3
    assert row["completion_tokens"] == usage.output_tokens
    assert row["cost_nano_usd"] == (
        usage.input_tokens * 3000 + 2 * 300 + 3 * 3750 + usage.output_tokens * 15000
    )


# Budgets.


@pytest.mark.parametrize("model", BOTH)
def test_aBudgetHoldsOnTheMessagesRoute(stack: Stack, model: str) -> None:
    """
    Decisions D12 amended on /v1/messages: the provider answers the most
    each request allows (every byte of the body it was sent a prompt
    token, each a cache write, the dearest input; max_tokens of output):
    each row costs exactly the worst case reserved on the body actually
    sent (as given, or translated), and of 10 concurrent requests under a
    budget of three such answers and a nano-dollar, three are answered and
    the others refused with RateLimitError BUDGET_EXCEEDED.
    """
    name = f"{model}-written"
    arguments: dict[str, Any] = {"model": name, "max_tokens": 50, "messages": question()}
    raw = stack.client().messages.with_raw_response.create(**arguments)
    (probe,) = stack.rows(raw.headers["x-request-id"])
    (received,) = stack.received(raw.headers["x-request-id"])
    each = received.bodyLength * 3750 + 50 * 15_000
    assert probe["cost_nano_usd"] == each
    assert probe["prompt_tokens"] == received.bodyLength
    tenant = makeTenant(stack.owner, f"budget-{model}")
    stack.tenants[f"budget-{model}"] = tenant
    budget = 3 * each + 1
    stack.owner.setBudget(tenant.orgID, None, budget, "day")
    client = stack.client(f"budget-{model}")

    def budgeted() -> bool:
        # Refused for its worst case alone once the budget is known; until
        # then forwarded, to a model that refuses it (and costs nothing).
        try:
            client.messages.create(
                **{**arguments, "model": f"{model}-rejected", "max_tokens": CEILING}
            )
        except anthropic.RateLimitError as error:
            return bool(errorBody(error)["code"] == "BUDGET_EXCEEDED")
        except anthropic.UnprocessableEntityError:
            return False
        raise AssertionError("a request the provider refuses was answered")

    waitFor(budgeted, 15)

    def one(_: int) -> str:
        try:
            client.messages.create(**arguments)
        except anthropic.RateLimitError as error:
            return str(errorBody(error)["code"])
        return "ok"

    with ThreadPoolExecutor(10) as pool:
        outcomes = list(pool.map(one, range(10)))
    assert sorted(outcomes) == ["BUDGET_EXCEEDED"] * 7 + ["ok"] * 3, outcomes
    costs: list[int] = []
    waitFor(lambda: _costs(stack, tenant, name, costs), 15)
    assert costs == [each] * 3
    assert sum(costs) <= budget


def _costs(stack: Stack, tenant: Tenant, model: str, costs: list[int]) -> bool:
    """
    Whether C{tenant}'s organization has its three rows of C{model}, their
    costs in C{costs}.
    """
    with psycopg.connect(stack.dsn, autocommit=True) as connection:
        costs[:] = [
            row[0]
            for row in connection.execute(
                "SELECT cost_nano_usd FROM usage_ledger WHERE org_id = %s AND model_requested = %s",
                (tenant.orgID, model),
            )
        ]
    return len(costs) == 3


# Memory.


def remember(stack: Stack, tenant: Tenant, content: str) -> None:
    """
    Store C{content} as a memory of C{tenant}'s agent, embedded as the
    [memory] model would.
    """
    address = f"127.0.0.1:{stack.memory.environment['SVC_GRPC_PORT']}"
    with grpc.insecure_channel(address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        _, vector = embeddingOf(content, DEFAULT_EMBEDDING_DIMENSIONS)
        stub.AddMemory(
            memory_pb2.AddMemoryRequest(
                scope=memory_pb2.Scope(
                    org_id=str(tenant.orgID), agent_id=str(tenant.agentID), subject=""
                ),
                content=content,
                source="api",
                embedding=memory_pb2.Embedding(model="embed", vector=vector),
            ),
            timeout=30,
        )


def test_recallInSystemAndObservation(stack: Stack) -> None:
    """
    Decisions D14, "Memory": with recall on, the D13 block is a text block
    of system after the client's own, in the body an Anthropic provider
    gets (a string system prompt made a block), and in the system message
    an OpenAI-compatible one gets; the answer says X-SVC-Memories, the
    row counts the memories. With observe all, the answer is observed:
    the user's turn and the answer's text (a stream's gathered from its
    text deltas) are queued in svc-memory.
    """
    tenant = stack.tenants["memory"]
    fact = "my favourite city is Lyon " + uuid.uuid4().hex
    remember(stack, tenant, fact)
    stack.owner.setMemorySettings(tenant.orgID, None, {"recall": True, "observe": "all"})
    client = stack.client("memory")
    ask = "what is my favourite city"

    def recalled() -> bool:
        raw = client.messages.with_raw_response.create(
            model="claude",
            max_tokens=100,
            system="Be brief.",
            messages=question(ask),  # type: ignore[arg-type]
        )
        return raw.headers.get("x-svc-memories") == "1"

    waitFor(recalled, 15)
    raw = client.messages.with_raw_response.create(
        model="claude",
        max_tokens=100,
        system="Be brief.",
        messages=question(ask),  # type: ignore[arg-type]
    )
    assert raw.headers["x-svc-memories"] == "1"
    (received,) = stack.received(raw.headers["x-request-id"])
    first, block = received.body["system"]
    assert first == {"type": "text", "text": "Be brief."}
    assert block["type"] == "text"
    lines = block["text"].split("\n")
    assert lines[:2] == [HEADING, "<memories>"] and lines[-1] == "</memories>"
    assert json.loads(lines[2])["memory"] == fact
    assert json.loads(lines[2])["date"] == datetime.datetime.now(datetime.UTC).date().isoformat()
    assert received.body["messages"] == question(ask)
    (row,) = [each for each in stack.rows(raw.headers["x-request-id"], 2) if each["kind"] == "chat"]
    assert row["memories"] == 1

    with client.messages.stream(
        model="gpt",
        max_tokens=100,
        messages=question(ask),  # type: ignore[arg-type]
    ) as stream:
        text = "".join(stream.text_stream)
        requestID = stream.response.headers["x-request-id"]
        assert stream.response.headers["x-svc-memories"] == "1"
    (received,) = stack.received(requestID)
    system = received.body["messages"][0]
    assert system["role"] == "system"
    assert fact in json.dumps(system)

    observed: list[Any] = []

    def queued() -> bool:
        with psycopg.connect(stack.dsn, autocommit=True) as connection:
            cursor = connection.execute(
                "SELECT messages FROM memory_observations WHERE org_id = %s AND request_id = %s",
                (tenant.orgID, requestID),
            )
            observed[:] = [row[0] for row in cursor.fetchall()]
        return bool(observed)

    waitFor(queued, 15)
    assert observed[0] == [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": text},
    ]


def test_rawApiKeyAndBearerTogether(stack: Stack) -> None:
    """
    On the wire: both headers holding the same token pass (and a client
    that names no anthropic-version gets the default passed on);
    different ones are 401 in Anthropic's envelope.
    """
    tenant = stack.tenants["main"]
    body = json.dumps({"model": "claude", "max_tokens": 5, "messages": question()}).encode()
    headers = {
        "Content-Type": "application/json",
        "X-SVC-Agent-ID": str(tenant.agentID),
        "x-api-key": tenant.token,
        "Authorization": f"Bearer {tenant.token}",
    }
    answer = request(stack.port, "POST", "/v1/messages", headers, body)
    assert answer.status == 200, answer.body
    (received,) = stack.received(answer.headers["x-request-id"])
    assert received.header("anthropic-version") == "2023-06-01"
    assert received.header("anthropic-beta") is None
    other = makeTenant(stack.owner, "other")
    answer = request(
        stack.port,
        "POST",
        "/v1/messages",
        {**headers, "Authorization": f"Bearer {other.token}"},
        body,
    )
    assert answer.status == 401
    document = answer.json()
    assert document["type"] == "error"
    assert (document["error"]["type"], document["error"]["code"]) == (
        "authentication_error",
        "INVALID_TOKEN",
    )


def test_bodyReadWithTheApiKeyAlone(stack: Stack) -> None:
    """
    A request whose token is in x-api-key alone has its body read even
    when the body comes after the headers, in a write of its own (the site
    decides from the headers whether a body is worth reading: a token of
    the token's shape in either header is, decisions D10 and D14).
    """
    tenant = stack.tenants["main"]
    body = json.dumps({"model": "claude", "max_tokens": 5, "messages": question()}).encode()
    head = (
        "POST /v1/messages HTTP/1.1\r\nHost: gateway\r\n"
        "Content-Type: application/json\r\n"
        f"x-api-key: {tenant.token}\r\nX-SVC-Agent-ID: {tenant.agentID}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as connection:
        connection.sendall(head)
        time.sleep(0.3)
        connection.sendall(body)
        response = http.client.HTTPResponse(connection)
        response.begin()
        answer = json.loads(response.read())
    assert response.status == 200, answer
    assert answer["type"] == "message"
