"""
POST /v1/messages and /v1/messages/count_tokens at svc-proxy's edge
(decisions D14), in memory: the edge behind StubTreq with a fake auth
client, the real rate limiter over in-memory counters and a fake clock, as
tests/test_proxy_edge.py tests chat completions. What is checked here is
what the edge itself answers: the token in C{x-api-key} or a bearer, every
refusal of the shared steps in Anthropic's envelope (D4's statuses, codes
and headers), the body's rules, the model's ceiling, and count_tokens'
estimate. Forwarding, with real daemons and the official SDK, is in
tests/test_gateway_messages.py; the Messages body read as chat messages in
tests/test_proxy_messagesbody.py.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import attrs
import pytest
import pytest_twisted
from proxydoubles import FakeAuthClient, MemoryCounters, newToken
from treq.testing import StubTreq
from twisted.internet.task import Clock

from svcd.common.errors import ErrorCode
from svcd.common.permissions import Permission
from svcd.limits.limiter import RedisRateLimiter
from svcd.limits.reservation import promptEstimate
from svcd.metering.models import Model, Provider
from svcd.providers.table import ProviderTable
from svcd.providers.upstream import Forwarder
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.messagesbody import parseMessagesRequest
from svcd.proxy.metrics import ProxyMetrics

NOW = 1_700_000_000.0 + 15
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
CHAT = "/v1/chat/completions"

PROVIDER = Provider("local", "http://127.0.0.1:9/v1")
TABLE = ProviderTable(
    providers={PROVIDER.name: PROVIDER},
    models={"claude": Model("claude", PROVIDER, "echo", maxOutputTokens=1000)},
    path="providers.toml",
    loadedAt=0,
)


def messagesBody(**overrides: Any) -> bytes:
    body: dict[str, Any] = {
        "model": "claude",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    body.update(overrides)
    return json.dumps(body).encode()


@attrs.define
class Harness:
    clock: Clock
    auth: FakeAuthClient
    edge: ProxyEdge
    stub: StubTreq
    token: str
    agentID: str

    async def post(
        self, path: str, headers: dict[str, str], body: bytes | None = None
    ) -> tuple[Any, dict[str, Any]]:
        response = await self.stub.request(  # type: ignore[attr-defined]
            "POST", "http://proxy.test" + path, headers=headers, data=body
        )
        content = await response.content()
        return response, json.loads(content)

    def headers(self, **extra: str) -> dict[str, str]:
        headers = {
            "x-api-key": self.token,
            "X-SVC-Agent-ID": self.agentID,
            "Content-Type": "application/json",
            "anthropic-version": "2023-06-01",
        }
        headers.update(extra)
        return headers


def makeHarness(
    providers: ProviderTable | None = TABLE,
    permissions: int = Permission.ProxyChatCompletion,
    rpm: int = 1000,
    forwarding: bool = False,
) -> Harness:
    """
    @param forwarding: give the edge a forwarder (to a closed port: the
        tests that use it are refused before anything is sent).
    """
    clock = Clock()
    clock.advance(NOW)
    auth = FakeAuthClient()
    token, _, agentID = auth.addTenant(permissions=permissions)
    config = ProxyConfig(authGrpcAddr="auth.test:9091", providers=providers, defaultRPM=rpm)
    limiter = RedisRateLimiter(MemoryCounters(), clock, config.defaultRPM)
    metrics = ProxyMetrics()
    forwarder = None
    if forwarding:
        from twisted.internet import reactor

        forwarder = Forwarder(reactor, clock, [PROVIDER], metrics)
    edge = ProxyEdge(config, auth, limiter, metrics, clock, forwarder=forwarder)
    return Harness(clock, auth, edge, StubTreq(edge.resource()), token, agentID)


@pytest.fixture
def proxy() -> Harness:
    return makeHarness()


def header(response: Any, name: str) -> str | None:
    values = response.headers.getRawHeaders(name)
    return None if not values else str(values[0])


def anthropicError(
    response: Any, document: dict[str, Any], status: int, kind: str, code: str
) -> dict[str, Any]:
    """
    An error in Anthropic's envelope (decisions D14): the status, the type
    that follows it, D4's code, the request id, and the headers every
    answer carries; the inner error object.
    """
    assert response.code == status, document
    assert header(response, "Content-Type") == "application/json"
    assert set(document) == {"type", "error", "request_id"}
    assert document["type"] == "error"
    assert document["request_id"] == header(response, "X-Request-ID")
    assert header(response, "X-Trace-ID") is not None
    assert header(response, "X-Response-Time") is not None
    error: dict[str, Any] = document["error"]
    assert (error["type"], error["code"]) == (kind, code)
    assert error["message"]
    return error


# The token: x-api-key or a bearer.


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("path", [MESSAGES, COUNT_TOKENS])
async def test_tokenInApiKeyOrBearer(proxy: Harness, path: str) -> None:
    """
    The token is taken from x-api-key (Anthropic's SDKs) or from a bearer
    (their auth_token), or both when they hold the same token: each passes
    the token and agent steps (and gets the route's own answer: without a
    forwarder, 501 for messages, the estimate for count_tokens).
    """
    answered = 501 if path == MESSAGES else 200
    bearer = {"Authorization": "Bearer " + proxy.token}
    withoutKey = proxy.headers()
    del withoutKey["x-api-key"]
    for headers in (proxy.headers(), {**proxy.headers(), **bearer}, {**withoutKey, **bearer}):
        response, document = await proxy.post(path, headers, messagesBody())
        assert response.code == answered, document
    assert ("ValidateToken", proxy.token) in proxy.auth.calls


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "MISSING_TOKEN"),
        ({"x-api-key": "sk-ant-not-ours"}, "INVALID_TOKEN"),
        ({"Authorization": "Basic abc"}, "INVALID_TOKEN"),
        ({"x-api-key": "TOKEN", "Authorization": "Bearer OTHER"}, "INVALID_TOKEN"),
        ({"x-api-key": "OTHER", "Authorization": "Bearer TOKEN"}, "INVALID_TOKEN"),
        ({"x-api-key": "TOKEN", "Authorization": "Basic abc"}, "INVALID_TOKEN"),
        ({"x-api-key": "UNKNOWN"}, "INVALID_TOKEN"),
    ],
)
async def test_badTokenIsAuthenticationError(
    proxy: Harness, headers: dict[str, str], code: str
) -> None:
    """
    No token, one not of the PAT format, a token svc-auth does not know, or
    x-api-key and a bearer that differ (decisions D14): 401 in Anthropic's
    envelope, an authentication_error with D4's code; nothing reaches the
    agent step.
    """
    other, unknown = newToken(), newToken()
    spelled = {
        name: value.replace("TOKEN", proxy.token)
        .replace("OTHER", other)
        .replace("UNKNOWN", unknown)
        for name, value in headers.items()
    }
    base = proxy.headers()
    del base["x-api-key"]
    response, document = await proxy.post(MESSAGES, {**base, **spelled}, messagesBody())
    anthropicError(response, document, 401, "authentication_error", code)
    assert not [call for call in proxy.auth.calls if call[0] == "ValidateAgent"]


@pytest_twisted.ensureDeferred
async def test_chatRouteKeepsItsBearer(proxy: Harness) -> None:
    """
    x-api-key is the Messages routes' only: chat completions still want
    the bearer (401 MISSING_TOKEN in OpenAI's envelope without one).
    """
    headers = proxy.headers()
    body = json.dumps({"model": "claude", "messages": [{"role": "user", "content": "hi"}]})
    response, document = await proxy.post(CHAT, headers, body.encode())
    assert response.code == 401
    assert document["error"]["code"] == "MISSING_TOKEN"
    assert "type" not in document


# Every refusal of the shared steps, in Anthropic's envelope.


@pytest_twisted.ensureDeferred
async def test_permissionIsPermissionError() -> None:
    """
    A token without ProxyChatCompletion: 403 permission_error,
    INSUFFICIENT_PERMISSIONS.
    """
    proxy = makeHarness(permissions=Permission.ProxyEmbeddings)
    response, document = await proxy.post(MESSAGES, proxy.headers(), messagesBody())
    anthropicError(response, document, 403, "permission_error", "INSUFFICIENT_PERMISSIONS")


@pytest_twisted.ensureDeferred
async def test_agentRefusals(proxy: Harness) -> None:
    """
    No X-SVC-Agent-ID is 400 (invalid_request_error, MISSING_AGENT_ID); an
    agent of another organization 403 (permission_error).
    """
    headers = proxy.headers()
    del headers["X-SVC-Agent-ID"]
    response, document = await proxy.post(MESSAGES, headers, messagesBody())
    anthropicError(response, document, 400, "invalid_request_error", "MISSING_AGENT_ID")
    headers = proxy.headers(**{"X-SVC-Agent-ID": str(uuid.uuid4())})
    response, document = await proxy.post(MESSAGES, headers, messagesBody())
    anthropicError(response, document, 403, "permission_error", "AGENT_NOT_AUTHORIZED")


@pytest_twisted.ensureDeferred
async def test_rateLimitIsRateLimitErrorWithRetryAfter() -> None:
    """
    Past the organization's requests per minute: 429 rate_limit_error,
    RATE_LIMITED, with D4's Retry-After and X-RateLimit-*; count_tokens
    counts toward the same limit.
    """
    proxy = makeHarness(rpm=2)
    response, _ = await proxy.post(MESSAGES, proxy.headers(), messagesBody())
    assert response.code == 501
    response, _ = await proxy.post(COUNT_TOKENS, proxy.headers(), messagesBody())
    assert response.code == 200
    response, document = await proxy.post(COUNT_TOKENS, proxy.headers(), messagesBody())
    anthropicError(response, document, 429, "rate_limit_error", "RATE_LIMITED")
    retryAfter = header(response, "Retry-After")
    assert retryAfter is not None and 1 <= int(retryAfter) <= 60
    assert header(response, "X-RateLimit-Limit") == "2"
    assert header(response, "X-RateLimit-Remaining") == "0"


@pytest_twisted.ensureDeferred
async def test_bodyBoundsInAnthropicsEnvelope(proxy: Harness) -> None:
    """
    A body past the limit is 413 request_too_large (PAYLOAD_TOO_LARGE); a
    body that is not JSON 415 UNSUPPORTED_MEDIA_TYPE (an
    invalid_request_error, as any other 4xx).
    """
    proxy.edge.caller._maxBody = 64
    response, document = await proxy.post(MESSAGES, proxy.headers(), messagesBody())
    anthropicError(response, document, 413, "request_too_large", "PAYLOAD_TOO_LARGE")
    proxy.edge.caller._maxBody = 1 << 20
    headers = proxy.headers(**{"Content-Type": "text/plain"})
    response, document = await proxy.post(MESSAGES, headers, messagesBody())
    anthropicError(
        response, document, 415, "invalid_request_error", ErrorCode.UNSUPPORTED_MEDIA_TYPE.value
    )


@pytest_twisted.ensureDeferred
async def test_methodAndUnknownPath(proxy: Harness) -> None:
    """
    GET on a Messages route is 405 with Allow, in Anthropic's envelope; a
    path below it that is no route is 404 in the gateway's own.
    """
    response = await proxy.stub.request(  # type: ignore[attr-defined]
        "GET", "http://proxy.test" + MESSAGES, headers=proxy.headers()
    )
    document = json.loads(await response.content())
    anthropicError(response, document, 405, "invalid_request_error", "METHOD_NOT_ALLOWED")
    assert header(response, "Allow") == "POST"
    response, document = await proxy.post("/v1/messages/batches", proxy.headers(), b"{}")
    assert response.code == 404 and document["error"]["code"] == "NOT_FOUND"


@pytest_twisted.ensureDeferred
async def test_badBodyListsEveryRule(proxy: Harness) -> None:
    """
    A body that breaks the rules of D14's shape: 400 invalid_request_error,
    VALIDATION_ERROR, every field error at once (in field_errors and in
    the message an SDK shows); not JSON is INVALID_JSON.
    """
    body = json.dumps(
        {"model": 7, "messages": [{"role": "system", "content": "x"}], "top_k": -1}
    ).encode()
    response, document = await proxy.post(MESSAGES, proxy.headers(), body)
    error = anthropicError(response, document, 400, "invalid_request_error", "VALIDATION_ERROR")
    fields = [each["field"] for each in error["field_errors"]]
    assert fields == ["model", "max_tokens", "messages[0].role", "top_k"]
    for field in fields:
        assert field in error["message"]
    response, document = await proxy.post(MESSAGES, proxy.headers(), b"{not json")
    anthropicError(response, document, 400, "invalid_request_error", "INVALID_JSON")
    # count_tokens has no max_tokens.
    response, document = await proxy.post(COUNT_TOKENS, proxy.headers(), b'{"model": "claude"}')
    error = anthropicError(response, document, 400, "invalid_request_error", "VALIDATION_ERROR")
    assert [each["field"] for each in error["field_errors"]] == ["messages"]


@pytest_twisted.ensureDeferred
async def test_capAboveTheModelsCeiling() -> None:
    """
    Decisions D12 amended: max_tokens above the model's max_output_tokens
    is 400 VALIDATION_ERROR on max_tokens; nothing is forwarded.
    """
    proxy = makeHarness(forwarding=True)
    response, document = await proxy.post(MESSAGES, proxy.headers(), messagesBody(max_tokens=1001))
    error = anthropicError(response, document, 400, "invalid_request_error", "VALIDATION_ERROR")
    assert error["field_errors"][0]["field"] == "max_tokens"


@pytest_twisted.ensureDeferred
async def test_notConfigured() -> None:
    """
    Without a providers file, or for a model the file does not list: 501
    PROVIDER_NOT_CONFIGURED, an api_error; count_tokens too.
    """
    for proxy, model in ((makeHarness(None), "claude"), (makeHarness(), "unknown")):
        for path in (MESSAGES, COUNT_TOKENS):
            response, document = await proxy.post(path, proxy.headers(), messagesBody(model=model))
            anthropicError(response, document, 501, "api_error", "PROVIDER_NOT_CONFIGURED")


# count_tokens for a model of an OpenAI-compatible provider.


@pytest_twisted.ensureDeferred
async def test_countTokensIsTheEstimate(proxy: Harness) -> None:
    """
    For a model whose provider cannot count, count_tokens answers D11's
    estimate of the body: what /v1/messages reserves for its prompt.
    """
    body = messagesBody(
        system="Be brief.",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is 2+2? " * 30}]},
        ],
    )
    response, document = await proxy.post(COUNT_TOKENS, proxy.headers(), body)
    assert response.code == 200
    expected = promptEstimate(parseMessagesRequest(body).messages)
    assert document == {"input_tokens": expected}
    assert expected > 100
