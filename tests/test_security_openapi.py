"""
docs/openapi.yaml, the OpenAPI 3.1 document of svc-proxy: valid
(openapi-spec-validator), true to the code (every route and method, every
error code, the standard headers on every response), and checked against
a live proxy with real daemons by schemathesis: generated requests, with a
valid token and agent and without, find no 500, no response outside the
document's statuses, schemas and headers, and no answer without
X-Request-ID, X-Trace-ID and X-Response-Time. The live proxy forwards to
the scripted OpenAI-compatible upstream (decisions D9), so its relayed
answers, streamed or not, and its upstream faults are checked against the
document too.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import yaml
from authfixtures import makeTenant
from gatewayfixtures import (
    Gateway,
    assertCommonHeaders,
    assertEnvelope,
    request,
    unlimitedGateway,
    waitFor,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate
from proxydoubles import FakeAuthClient, MemoryCounters
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    missing_required_header,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from svcd.common.errors import ErrorCode, FieldErrorCode
from svcd.common.permissions import Permission
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.limits.limiter import RedisRateLimiter
from svcd.metering.models import Model, Provider
from svcd.providers.table import ProviderTable
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.metrics import ProxyMetrics

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

DOCUMENT = Path(__file__).parent.parent / "docs" / "openapi.yaml"
# The cases test_schemathesisFindsNothing generates: enough to reach every
# operation past authentication and both media types of relayed answers
# (300 did not stream one: the derandomized sequence reaches its first
# relayed stream between 300 and 600). The 2,500 the test used to send
# took under a minute on a quiet 2-core machine and eight with the machine
# loaded; that long run, or a longer one, is bench/fuzz.py's, which sets
# this variable.
SCHEMATHESIS_EXAMPLES = int(os.environ.get("SVC_SCHEMATHESIS_EXAMPLES", "600"))
# A token that may chat and embed.
BOTH_PERMISSIONS = int(Permission.ProxyChatCompletion | Permission.ProxyEmbeddings)
STANDARD_HEADERS = ("X-Request-ID", "X-Trace-ID", "X-Response-Time")
RATE_LIMIT_HEADERS = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")
CHAT_PATHS = ("/v1/chat/completions", "/proxy/v1/chat/completions")
EMBEDDINGS_PATH = "/v1/embeddings"
# Decisions D14: Anthropic's Messages API, whose errors are in Anthropic's
# envelope.
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
ANTHROPIC_PATHS = (MESSAGES_PATH, COUNT_TOKENS_PATH)
# The routes forwarded to a provider (decisions D9, D13, D14); all but
# count_tokens (whose estimate no provider makes) name the model that
# answered.
FORWARDED_PATHS = (*CHAT_PATHS, EMBEDDINGS_PATH, *ANTHROPIC_PATHS)
# The memory routes that embed (decisions D13): a provider's fault is
# answered as on the forwarded routes, so their 429 may be
# UPSTREAM_RATE_LIMITED too.
MEMORY_EMBEDDING_OPERATIONS = (
    ("/v1/memories", "post"),
    ("/v1/memories/{id}", "patch"),
    ("/v1/memories/search", "post"),
)
EVENT_STREAM = "text/event-stream"

# The live gateway's models besides the document's example ones (which the
# scripted upstream answers normally, as "echo"): each makes the scripted
# upstream fail in one of the ways D9 maps, so that schemathesis's checks
# meet those answers too (test_forwardedAnswersConformToTheDocument).
# "stalled" is served by a provider with a 100 ms timeout, and 2 s between
# stream events: its first event comes in time even on a busy machine, and
# no other one comes.
FAULT_MODELS = {
    "refused": "status:400",
    "rejected": "status:422",
    "limited": "status:429",
    "limited-quietly": "status:429:0",
    "failing": "status:500",
    "cut": "close-mid-stream",
    "stalled": "stall-stream",
}
STALLING_MODEL = "stalled"

# The live gateway's embedding models besides the document's example ones
# (decisions D13), each a fault of the scripted upstream, with what the
# gateway answers.
EMBEDDING_FAULT_MODELS = {
    "embed-rejected": ("status:422", 422, "UPSTREAM_REJECTED"),
    "embed-limited": ("status:429", 429, "UPSTREAM_RATE_LIMITED"),
    "embed-failing": ("status:500", 502, "UPSTREAM_ERROR"),
}
# The length of the example embedding models' vectors in the providers file.
EMBEDDING_DIMENSIONS = 64

# What each model answers (D9), without and with "stream": true: the
# status and the error code, or for a 200 the media type, "(cut)" marking a
# stream ended by the gateway's error event.
ECHO_ANSWERS = ((200, "application/json"), (200, EVENT_STREAM))
FAULT_ANSWERS = {
    "refused": ((400, "UPSTREAM_REJECTED"), (400, "UPSTREAM_REJECTED")),
    "rejected": ((422, "UPSTREAM_REJECTED"), (422, "UPSTREAM_REJECTED")),
    "limited": ((429, "UPSTREAM_RATE_LIMITED"), (429, "UPSTREAM_RATE_LIMITED")),
    "limited-quietly": ((429, "UPSTREAM_RATE_LIMITED"), (429, "UPSTREAM_RATE_LIMITED")),
    "failing": ((502, "UPSTREAM_ERROR"), (502, "UPSTREAM_ERROR")),
    "cut": ((502, "UPSTREAM_ERROR"), (200, f"{EVENT_STREAM} (cut)")),
    "stalled": ((504, "UPSTREAM_TIMEOUT"), (200, f"{EVENT_STREAM} (cut)")),
}


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(DOCUMENT.read_text())
    return loaded


def resolve(document: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = document
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def responsesOf(document: dict[str, Any]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                yield path, method, status, resolve(document, response)


def test_documentIsValidOpenAPI31(document: dict[str, Any]) -> None:
    """
    openapi-spec-validator accepts the document as OpenAPI 3.1.
    """
    assert document["openapi"].startswith("3.1.")
    validate(document)


def test_everyRouteAndMethodIsDocumented(document: dict[str, Any]) -> None:
    """
    The document's paths and methods are exactly the routes of a proxy with
    a providers file (D9: GET /v1/models exists only then); without one,
    they are the same less /v1/models.
    """
    from twisted.internet.task import Clock

    def routesOf(providers: ProviderTable | None) -> dict[str, set[str]]:
        clock = Clock()
        edge = ProxyEdge(
            ProxyConfig(authGrpcAddr="auth.test:9091", providers=providers),
            FakeAuthClient(),
            RedisRateLimiter(MemoryCounters(), clock, 60),
            ProxyMetrics(),
            clock,
        )
        return {route.template: {m.lower() for m in route.methods} for route in edge.routes}

    provider = Provider("local", "http://127.0.0.1:8000/v1")
    table = ProviderTable(
        providers={provider.name: provider},
        models={"fast": Model("fast", provider, "llama-3.1-8b")},
        path="providers.toml",
        loadedAt=0,
    )
    documented = {path: set(item) for path, item in document["paths"].items()}
    assert documented == routesOf(table)
    assert routesOf(None) == {
        path: methods for path, methods in documented.items() if path != "/v1/models"
    }


def test_everyErrorCodeIsDocumented(document: dict[str, Any]) -> None:
    """
    The envelope's code enum is every ErrorCode, the field error enum every
    FieldErrorCode, and every status an error code answers with appears in
    the document (404 and 405, which any path or method may get, in the
    description). UPSTREAM_REJECTED answers with the provider's own 4xx
    (D9), so the forwarded routes (chat and embeddings) document it under
    the range "4XX", which is why status keys are not all integers.
    """
    schemas = document["components"]["schemas"]
    assert set(schemas["Error"]["properties"]["code"]["enum"]) == {code.value for code in ErrorCode}
    assert set(schemas["FieldError"]["properties"]["code"]["enum"]) == {
        code.value for code in FieldErrorCode
    }
    statuses = {int(status) for _, _, status, _ in responsesOf(document) if status.isdigit()}
    for code in ErrorCode:
        if code in (ErrorCode.NOT_FOUND, ErrorCode.METHOD_NOT_ALLOWED):
            assert f"{code.status} {code.value}" in document["info"]["description"]
        else:
            assert code.status in statuses, code
    for path in FORWARDED_PATHS:
        rejected = resolve(document, document["paths"][path]["post"]["responses"]["4XX"])
        assert ErrorCode.UPSTREAM_REJECTED.value in rejected["description"], path


def test_everyResponseHasTheStandardHeaders(document: dict[str, Any]) -> None:
    """
    Every documented response requires X-Request-ID, X-Trace-ID and
    X-Response-Time; protected routes' answers after the rate-limit step
    document X-RateLimit-*, and a 429 requires them and Retry-After, except
    on the forwarded routes (chat and embeddings) and the memory routes that
    embed (adding, changing, searching): there a 429 may also be
    UPSTREAM_RATE_LIMITED (D9), which carries the provider's Retry-After
    only when it sent one, and X-RateLimit-* only as any answer after the
    rate-limit step does, so they are documented there without being
    required. A forwarded route's 200 requires X-SVC-Upstream-Model.
    """
    for path, method, status, response in responsesOf(document):
        headers = response["headers"]
        for name in STANDARD_HEADERS:
            assert resolve(document, headers[name])["required"] is True, (path, method, status)
        protected = path.startswith(("/v1/", "/proxy/"))
        if protected and status in ("200", "400", "429", "4XX", "501", "502", "504"):
            assert set(RATE_LIMIT_HEADERS) <= set(headers), (path, status)
        if status == "429":
            required = (
                path not in FORWARDED_PATHS and (path, method) not in MEMORY_EMBEDDING_OPERATIONS
            )
            for name in (*RATE_LIMIT_HEADERS, "Retry-After"):
                assert resolve(document, headers[name]).get("required", False) is required
            if not required:
                for code in (ErrorCode.RATE_LIMITED, ErrorCode.UPSTREAM_RATE_LIMITED):
                    assert code.value in response["description"], (path, code)
        if path in FORWARDED_PATHS and path != COUNT_TOKENS_PATH and status == "200":
            assert resolve(document, headers["X-SVC-Upstream-Model"])["required"] is True


# Schemathesis against the real daemons.


def exampleModels(document: dict[str, Any]) -> set[str]:
    """
    The models the document's chat request examples name: those
    schemathesis sends in part of its positive cases.
    """
    chat = document["components"]["requestBodies"]["Chat"]["content"]["application/json"]
    named = set(resolve(document, chat["schema"])["properties"]["model"]["examples"])
    return named | {example["value"]["model"] for example in chat["examples"].values()}


def exampleEmbeddingModels(document: dict[str, Any]) -> set[str]:
    """
    The models the document's embeddings request examples name.
    """
    body = document["components"]["requestBodies"]["Embeddings"]["content"]["application/json"]
    named = set(resolve(document, body["schema"])["properties"]["model"]["examples"])
    return named | {example["value"]["model"] for example in body["examples"].values()}


@pytest.fixture(scope="module")
def liveUpstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedUpstream]:
    """
    The scripted OpenAI-compatible upstream the live gateway forwards to,
    for the whole module.
    """
    upstream = ScriptedUpstream(tmp_path_factory.mktemp("upstream")).start()
    yield upstream
    upstream.stop()


def providersFile(
    path: Path, upstream: ScriptedUpstream, echoModels: set[str], embeddingModels: set[str]
) -> Path:
    """
    A providers file offering C{echoModels} (answered normally) and
    L{FAULT_MODELS} on C{upstream}, and the embedding models
    C{embeddingModels} (answered normally) and L{EMBEDDING_FAULT_MODELS}.
    """
    lines = [
        "[[providers]]",
        'name = "scripted"',
        f'base_url = "{upstream.baseURL}"',
        'timeout = "10s"',
        'idle_timeout = "10s"',
        "[[providers]]",
        'name = "stalling"',
        f'base_url = "{upstream.baseURL}"',
        'timeout = "100ms"',
        'idle_timeout = "2s"',
    ]
    models = {name: "echo" for name in echoModels} | FAULT_MODELS
    for name, script in models.items():
        provider = "stalling" if name == STALLING_MODEL else "scripted"
        lines += [
            "[[models]]",
            f'name = "{name}"',
            f'provider = "{provider}"',
            f'upstream_model = "{script}"',
        ]
    embeddings = {name: "echo" for name in embeddingModels} | {
        name: script for name, (script, _, _) in EMBEDDING_FAULT_MODELS.items()
    }
    for name, script in embeddings.items():
        lines += [
            "[[models]]",
            f'name = "{name}"',
            'provider = "scripted"',
            f'upstream_model = "{script}"',
            'kind = "embedding"',
            f"dimensions = {EMBEDDING_DIMENSIONS}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def liveGateway(
    postgresServer: PostgresServer,
    tmp_path_factory: pytest.TempPathFactory,
    liveUpstream: ScriptedUpstream,
    document: dict[str, Any],
) -> Iterator[Gateway]:
    # No rate limit in the way of the generated traffic, and a deadline
    # that a busy 2-core machine meets: this run looks for contract
    # violations, not for timeouts.
    workdir = tmp_path_factory.mktemp("schemathesis")
    providers = providersFile(
        workdir / "providers.toml",
        liveUpstream,
        exampleModels(document),
        exampleEmbeddingModels(document),
    )
    with unlimitedGateway(
        postgresServer,
        workdir,
        SVC_AUTH_VALIDATE_TIMEOUT="2s",
        SVC_PROVIDERS_FILE=str(providers),
    ) as running:
        yield running


@schemathesis.check
def envelopeAndHeaders(ctx: Any, response: Any, case: Any) -> None:
    """
    No 500 (INTERNAL_ERROR is documented, but must never happen), the
    standard headers on every answer, and an envelope's request_id equal to
    X-Request-ID.
    """
    assert response.status_code != 500, response.text
    for name in STANDARD_HEADERS:
        assert response.headers.get(name.lower()), f"{name} missing"
    if response.status_code >= 400:
        requestID = response.headers[STANDARD_HEADERS[0].lower()]
        requestID = requestID[0] if isinstance(requestID, list) else requestID
        document = response.json()
        if case.path in ANTHROPIC_PATHS:
            # Decisions D14: Anthropic's envelope, its request id at the top.
            assert document["type"] == "error", document
            assert document["request_id"] == requestID
        else:
            assert document["error"]["request_id"] == requestID


def _header(response: Any, name: str) -> str | None:
    value = response.headers.get(name.lower())
    if isinstance(value, list):
        value = value[0]
    return None if value is None else str(value)


def _eventData(content: bytes) -> list[str]:
    """
    The data of each event of a server-sent event stream.
    """
    text = content.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    events = []
    for block in text.split("\n\n"):
        lines = [
            line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")
        ]
        if lines:
            events.append("\n".join(lines))
    return events


_ENVELOPE = Draft202012Validator(
    {
        "$ref": "#/components/schemas/ErrorEnvelope",
        "components": yaml.safe_load(DOCUMENT.read_text())["components"],
    }
)


@schemathesis.check
def forwardedAnswers(ctx: Any, response: Any, case: Any) -> None:
    """
    A relayed chat answer (D9) names the model that answered, the one asked
    for (the live gateway's models have no fallbacks); a stream ends either
    with data: [DONE] or, cut by a fault, with one event holding the
    gateway's envelope (the document's ErrorEnvelope, request_id equal to
    X-Request-ID) and no [DONE].
    """
    if case.path not in CHAT_PATHS or response.status_code != 200:
        return
    assert _header(response, "X-SVC-Upstream-Model") == case.body["model"]
    if not (_header(response, "Content-Type") or "").startswith(EVENT_STREAM):
        return
    events = _eventData(response.content)
    assert events, "an empty stream"
    if events[-1] == "[DONE]":
        assert not any('"error"' in data and '"request_id"' in data for data in events[:-1])
        return
    assert "[DONE]" not in events, events
    envelope = json.loads(events[-1])
    _ENVELOPE.validate(envelope)
    assert envelope["error"]["code"] in ("UPSTREAM_ERROR", "UPSTREAM_TIMEOUT"), envelope
    assert envelope["error"]["request_id"] == _header(response, "X-Request-ID")


CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    missing_required_header,
    envelopeAndHeaders,
    forwardedAnswers,
]


def forwardedCase(case: Any, model: str, stream: bool) -> Any:
    """
    C{case}, a positive chat request, asking for C{model}, and for a stream
    when C{stream} is set (else with the generated C{stream}, if any).
    """
    if isinstance(case.body, dict):
        case.body = {**case.body, "model": model} | ({"stream": True} if stream else {})
    return case


def test_schemathesisFindsNothing(liveGateway: Gateway, document: dict[str, Any]) -> None:
    """
    Schemathesis (L{SCHEMATHESIS_EXAMPLES} cases, derandomized so that a
    failure reproduces; bench/fuzz.py runs thousands) against the live
    proxy: positive and
    negative cases of every operation, with a valid token and agent (so
    that the protected routes are exercised past authentication, the path
    org being the token's own in part of them) and with generated
    credentials.

    The proxy forwards to the scripted upstream (D9). Schemathesis sends
    the document's request examples in part of the positive chat cases,
    and their models are answered normally; more positive chat cases (any
    body the document allows, unknown keys included, streamed in half of
    them) ask for those models, so that relayed answers of both media
    types and GET /v1/models are checked against the document.
    """
    schema = schemathesis.openapi.from_path(DOCUMENT)
    tenant = liveGateway.tenants["main"]
    credentials = {
        "Authorization": f"Bearer {tenant.token}",
        "X-SVC-Agent-ID": str(tenant.agentID),
    }
    ownOrg = {"org_id": str(tenant.orgID)}
    forwarded = st.builds(
        forwardedCase,
        st.one_of(
            *[
                schema[path]["POST"].as_strategy(GenerationMode.POSITIVE, headers=credentials)
                for path in CHAT_PATHS
            ]
        ),
        st.sampled_from(sorted(exampleModels(document))),
        st.booleans(),
    )
    # A third of the cases are forwarded chats, and GET /v1/models with our
    # credentials has a strategy of its own: spread over every operation
    # of a document that grew with the memory routes, they had become so
    # rare (two streamed answers in 600 calls) that a changed document
    # left none for the assertions below.
    generated = st.one_of(
        schema["/v1/models"]["GET"].as_strategy(GenerationMode.POSITIVE, headers=credentials),
        schema.as_strategy(GenerationMode.POSITIVE, headers=credentials),
        schema.as_strategy(GenerationMode.POSITIVE, headers=credentials, path_parameters=ownOrg),
        schema.as_strategy(GenerationMode.NEGATIVE, headers=credentials),
        schema.as_strategy(
            GenerationMode.NEGATIVE,
            headers={"Authorization": credentials["Authorization"]},
            path_parameters=ownOrg,
        ),
        schema.as_strategy(GenerationMode.POSITIVE),
        schema.as_strategy(GenerationMode.NEGATIVE),
    )
    # (Not st.one_of(generated, forwarded): one_of flattens its branches.)
    strategy = st.integers(0, 2).flatmap(lambda pick: forwarded if pick == 0 else generated)
    baseURL = f"http://127.0.0.1:{liveGateway.port}"
    seen: dict[int, int] = {}
    # (path, status, media type) of the answers of the D9 routes.
    relayed: Counter[tuple[str, int, str]] = Counter()

    @settings(
        max_examples=SCHEMATHESIS_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(strategy)
    def run(case: Any) -> None:
        # ignored_auth expects generated credentials to be refused; ours are
        # valid, so it applies only to cases with generated ones.
        ours = (case.headers or {}).get("Authorization") == credentials["Authorization"]
        checks = CHECKS if ours else [*CHECKS, ignored_auth]
        response = case.call_and_validate(base_url=baseURL, checks=checks, timeout=10)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if case.path in (*CHAT_PATHS, "/v1/models"):
            path = "chat" if case.path in CHAT_PATHS else case.path
            relayed[path, response.status_code, mediaTypeOf(response)] += 1

    began = time.monotonic()
    run()
    print(f"\nschemathesis: {sum(seen.values())} calls in {time.monotonic() - began:.0f} s: {seen}")
    print(f"D9 routes: {dict(sorted(relayed.items()))}")
    # The valid credentials reached past authentication: 200 probes and
    # 501 chat answers, as well as the refusals.
    assert {200, 400, 401, 403, 501} <= set(seen), seen
    # Forwarded: relayed chat answers of both media types, and the models
    # list. (Each upstream fault is checked by
    # test_forwardedAnswersConformToTheDocument.)
    for expected in (
        ("chat", 200, "application/json"),
        ("chat", 200, EVENT_STREAM),
        ("/v1/models", 200, "application/json"),
    ):
        assert relayed[expected], (expected, relayed)


def mediaTypeOf(response: Any) -> str:
    """
    The media type of C{response}, "(cut)" added to a stream that does not
    end with [DONE].
    """
    mediaType = (_header(response, "Content-Type") or "").split(";")[0]
    if mediaType == EVENT_STREAM and _eventData(response.content)[-1:] != ["[DONE]"]:
        mediaType += " (cut)"
    return mediaType


def test_forwardedAnswersConformToTheDocument(
    liveGateway: Gateway, document: dict[str, Any]
) -> None:
    """
    Every answer D9 gives to a forwarded request, streamed or not, on both
    chat routes, passes schemathesis's checks against the document: the
    relayed answer and the relayed stream, the provider's 400 and 422
    (UPSTREAM_REJECTED), its 429 with and without Retry-After
    (UPSTREAM_RATE_LIMITED), its 500 and a cut answer (UPSTREAM_ERROR), a
    stalled one (UPSTREAM_TIMEOUT), and streams ended by the gateway's error
    event. The generated run above meets them by chance; this meets each
    once for sure.
    """
    schema = schemathesis.openapi.from_path(DOCUMENT)
    tenant = liveGateway.tenants["main"]
    credentials = {
        "Authorization": f"Bearer {tenant.token}",
        "X-SVC-Agent-ID": str(tenant.agentID),
    }
    body = document["components"]["requestBodies"]["Chat"]["content"]["application/json"][
        "examples"
    ]["chat"]["value"]
    expectations = {model: ECHO_ANSWERS for model in exampleModels(document)} | FAULT_ANSWERS
    baseURL = f"http://127.0.0.1:{liveGateway.port}"
    for path in CHAT_PATHS:
        for model, answers in expectations.items():
            for stream, (status, expected) in zip((False, True), answers, strict=True):
                case = schema[path]["POST"].Case(
                    headers=credentials,
                    body={**body, "model": model, "stream": stream},
                    media_type="application/json",
                )
                response = case.call_and_validate(base_url=baseURL, checks=CHECKS, timeout=10)
                outcome = (path, model, stream)
                assert response.status_code == status, (outcome, response.text)
                if status == 200:
                    assert mediaTypeOf(response) == expected, outcome
                    continue
                assert response.json()["error"]["code"] == expected, outcome
                if model in ("limited", "limited-quietly"):
                    retryAfter = "7" if model == "limited" else None
                    assert _header(response, "Retry-After") == retryAfter, outcome


_ANTHROPIC_ENVELOPE = Draft202012Validator(
    {
        "$ref": "#/components/schemas/AnthropicErrorEnvelope",
        "components": yaml.safe_load(DOCUMENT.read_text())["components"],
    }
)


def _namedEvents(content: bytes) -> list[tuple[str | None, str]]:
    """
    The name and data of each event of a server-sent event stream.
    """
    text = content.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    events = []
    for block in text.split("\n\n"):
        name = None
        data = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            events.append((name, "\n".join(data)))
    return events


def messagesMediaType(response: Any) -> str:
    """
    The media type of a Messages answer, "(cut)" added to a stream that
    does not end with message_stop.
    """
    mediaType = (_header(response, "Content-Type") or "").split(";")[0]
    if mediaType == EVENT_STREAM and [name for name, _ in _namedEvents(response.content)[-1:]] != [
        "message_stop"
    ]:
        mediaType += " (cut)"
    return mediaType


@schemathesis.check
def messagesAnswers(ctx: Any, response: Any, case: Any) -> None:
    """
    Decisions D14: a Messages answer names the model that answered; a
    stream is Anthropic's events, ending with message_stop or, cut by a
    fault, with one error event holding the gateway's Anthropic envelope
    (request_id equal to X-Request-ID).
    """
    if case.path != MESSAGES_PATH or response.status_code != 200:
        return
    assert _header(response, "X-SVC-Upstream-Model") == case.body["model"]
    if not (_header(response, "Content-Type") or "").startswith(EVENT_STREAM):
        assert response.json()["type"] == "message"
        return
    events = _namedEvents(response.content)
    assert events and events[0][0] == "message_start", events[:1]
    for name, data in events:
        assert name == json.loads(data)["type"], (name, data)
    if events[-1][0] == "message_stop":
        assert all(name != "error" for name, _ in events)
        return
    name, data = events[-1]
    assert name == "error", events[-1]
    envelope = json.loads(data)
    _ANTHROPIC_ENVELOPE.validate(envelope)
    assert envelope["error"]["code"] in ("UPSTREAM_ERROR", "UPSTREAM_TIMEOUT"), envelope
    assert envelope["request_id"] == _header(response, "X-Request-ID")


def test_messagesAnswersConformToTheDocument(
    liveGateway: Gateway, document: dict[str, Any]
) -> None:
    """
    Decisions D14: every answer of POST /v1/messages (to the live
    gateway's OpenAI-compatible provider: translated both ways), streamed
    or not, and of count_tokens passes schemathesis's checks against the
    document: the translated answer and stream, each fault of the
    provider in Anthropic's envelope, streams ended by the error event,
    a field with no counterpart refused; then generated positive bodies
    (asking for the example models) meet the same checks, and some are
    answered.
    """
    schema = schemathesis.openapi.from_path(DOCUMENT)
    tenant = liveGateway.tenants["main"]
    credentials = {"x-api-key": tenant.token, "X-SVC-Agent-ID": str(tenant.agentID)}
    examples = document["components"]["requestBodies"]["Messages"]["content"]["application/json"][
        "examples"
    ]
    body = examples["message"]["value"]
    expectations = {model: ECHO_ANSWERS for model in exampleModels(document)} | FAULT_ANSWERS
    baseURL = f"http://127.0.0.1:{liveGateway.port}"
    checks = [*CHECKS, messagesAnswers]
    operation = schema[MESSAGES_PATH]["POST"]
    for model, answers in expectations.items():
        for stream, (status, expected) in zip((False, True), answers, strict=True):
            case = operation.Case(
                headers=credentials,
                body={**body, "model": model, "stream": stream},
                media_type="application/json",
            )
            response = case.call_and_validate(base_url=baseURL, checks=checks, timeout=10)
            outcome = (model, stream)
            assert response.status_code == status, (outcome, response.text)
            if status == 200:
                assert messagesMediaType(response) == expected, outcome
                continue
            assert response.json()["error"]["code"] == expected, outcome
            if model in ("limited", "limited-quietly"):
                retryAfter = "7" if model == "limited" else None
                assert _header(response, "Retry-After") == retryAfter, outcome
    model = sorted(exampleModels(document))[0]
    refused = operation.Case(
        headers=credentials,
        body={**body, "model": model, "top_k": 3},
        media_type="application/json",
    )
    response = refused.call_and_validate(base_url=baseURL, checks=checks, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["field_errors"][0]["field"] == "top_k"
    counting = schema[COUNT_TOKENS_PATH]["POST"]
    for example in document["components"]["requestBodies"]["CountTokens"]["content"][
        "application/json"
    ]["examples"].values():
        case = counting.Case(
            headers=credentials, body=example["value"], media_type="application/json"
        )
        response = case.call_and_validate(base_url=baseURL, checks=checks, timeout=10)
        assert response.status_code == 200 and response.json()["input_tokens"] > 0

    seen: Counter[int] = Counter()
    models = sorted(exampleModels(document))

    def withModel(case: Any, model: str, stream: bool) -> Any:
        if isinstance(case.body, dict):
            case.body = {**case.body, "model": model} | ({"stream": True} if stream else {})
        return case

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(
        st.builds(
            withModel,
            st.one_of(
                operation.as_strategy(GenerationMode.POSITIVE, headers=credentials),
                counting.as_strategy(GenerationMode.POSITIVE, headers=credentials),
                operation.as_strategy(GenerationMode.NEGATIVE, headers=credentials),
            ),
            st.sampled_from(models),
            st.booleans(),
        )
    )
    def run(case: Any) -> None:
        response = case.call_and_validate(base_url=baseURL, checks=checks, timeout=10)
        seen[response.status_code] += 1

    run()
    assert seen[200] and seen[400], seen


def test_undocumentedMethodsAre405(liveGateway: Gateway, document: dict[str, Any]) -> None:
    """
    Every method a documented path does not list, HEAD and OPTIONS
    included, is 405 METHOD_NOT_ALLOWED with an Allow header naming the
    documented methods; the envelope (Anthropic's on the Messages routes,
    decisions D14) and the standard headers come along (HEAD gets the
    headers only).
    """
    for path, item in document["paths"].items():
        concrete = path.replace("{org_id}", str(liveGateway.tenants["main"].orgID))
        allowed = {method.upper() for method in item}
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"):
            if method in allowed:
                continue
            answer = request(
                liveGateway.port, method, concrete, body=b"" if method != "GET" else None
            )
            assert answer.status == 405, (method, path)
            assert set(answer.headers["allow"].replace(" ", "").split(",")) == allowed
            if method == "HEAD":
                assertCommonHeaders(answer)
            elif path in ANTHROPIC_PATHS:
                assertCommonHeaders(answer)
                document = answer.json()
                assert document["type"] == "error"
                assert document["error"]["code"] == "METHOD_NOT_ALLOWED"
                assert document["request_id"] == answer.headers["x-request-id"]
            else:
                assertEnvelope(answer, 405, "METHOD_NOT_ALLOWED")


def test_embeddingsAnswersConformToTheDocument(
    liveGateway: Gateway, document: dict[str, Any]
) -> None:
    """
    Decisions D13: what POST /v1/embeddings answers passes schemathesis's
    checks against the document, for a token with ProxyEmbeddings: each
    request example relayed (floats and base64), each upstream fault
    mapped (UPSTREAM_REJECTED, UPSTREAM_RATE_LIMITED, UPSTREAM_ERROR), a
    refused body (a token array), a chat model (501), dimensions past the
    model's (400); then generated positive bodies (asking for the example
    models) meet the same checks, and some are relayed.
    """
    schema = schemathesis.openapi.from_path(DOCUMENT)
    tenant = makeTenant(liveGateway.owner, "embedder", permissions=BOTH_PERMISSIONS)
    credentials = {
        "Authorization": f"Bearer {tenant.token}",
        "X-SVC-Agent-ID": str(tenant.agentID),
    }

    def usable() -> bool:
        answer = request(liveGateway.port, "GET", "/v1/internal/auth-probe", credentials)
        return answer.status == 200

    # A token made anywhere works everywhere within a second (D8).
    waitFor(usable, 10)
    operation = schema[EMBEDDINGS_PATH]["POST"]
    baseURL = f"http://127.0.0.1:{liveGateway.port}"
    examples = document["components"]["requestBodies"]["Embeddings"]["content"]["application/json"][
        "examples"
    ]
    cases: list[tuple[dict[str, Any], int, str | None]] = [
        (example["value"], 200, None) for example in examples.values()
    ]
    cases += [
        ({"model": model, "input": "hello"}, status, code)
        for model, (_, status, code) in EMBEDDING_FAULT_MODELS.items()
    ]
    chatModel = sorted(exampleModels(document))[0]
    cases += [
        ({"model": "embed", "input": [1, 2, 3]}, 400, "VALIDATION_ERROR"),
        ({"model": chatModel, "input": "hello"}, 501, "PROVIDER_NOT_CONFIGURED"),
        (
            {"model": "embed", "input": "x", "dimensions": EMBEDDING_DIMENSIONS + 1},
            400,
            "VALIDATION_ERROR",
        ),
    ]
    for body, status, code in cases:
        case = operation.Case(headers=credentials, body=body, media_type="application/json")
        response = case.call_and_validate(base_url=baseURL, checks=CHECKS, timeout=10)
        assert response.status_code == status, (body, response.text)
        if code is not None:
            assert response.json()["error"]["code"] == code, body
        else:
            assert _header(response, "X-SVC-Upstream-Model") == body["model"]

    seen: Counter[int] = Counter()
    models = sorted(exampleEmbeddingModels(document))

    def withModel(case: Any, model: str) -> Any:
        if isinstance(case.body, dict):
            case.body = {**case.body, "model": model}
        return case

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(
        st.builds(
            withModel,
            operation.as_strategy(GenerationMode.POSITIVE, headers=credentials),
            st.sampled_from(models),
        )
    )
    def run(case: Any) -> None:
        response = case.call_and_validate(base_url=baseURL, checks=CHECKS, timeout=10)
        seen[response.status_code] += 1

    run()
    assert seen[200], seen
