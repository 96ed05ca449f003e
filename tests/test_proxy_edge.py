"""
The HTTP contract of svc-proxy (spec 4.1, 4.2, 5, 7; decisions D4, D5),
tested in memory: the Klein resource behind StubTreq, a fake auth client,
the real rate limiter over in-memory counters, and a fake clock.
"""

from __future__ import annotations

import datetime
import json
import re
import uuid
from typing import Any

import attrs
import pytest
import pytest_twisted
from proxydoubles import FakeAuthClient, MemoryCounters, newToken
from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from svcd.common.errors import ApiError, ErrorCode
from svcd.common.ids import uuid7
from svcd.common.permissions import Permission
from svcd.common.readiness import CheckFailed
from svcd.limits.limiter import DisabledRateLimiter, RedisRateLimiter
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.records import TokenInfo

# 2023-11-14T22:13:20Z plus 15 s: 45 s before the next calendar minute.
NOW = 1_700_000_000.0 + 15
NEXT_MINUTE = 1_700_000_040

CHAT = "/v1/chat/completions"
PROBE = "/v1/internal/auth-probe"
JSON_TYPE = "application/json"

VALID_BODY = json.dumps(
    {"model": "gpt-test", "messages": [{"role": "user", "content": "hello there"}]}
).encode()


@attrs.define
class Harness:
    """
    One proxy edge with its doubles.
    """

    clock: Clock
    auth: FakeAuthClient
    counters: MemoryCounters
    metrics: ProxyMetrics
    edge: ProxyEdge
    stub: StubTreq

    async def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> tuple[Any, bytes]:
        # StubTreq sets request() and the others in its __init__ (setattr
        # over treq.__all__); treq's types do not declare them.
        response = await self.stub.request(  # type: ignore[attr-defined]
            method, "http://proxy.test" + path, headers=headers or {}, data=body
        )
        content = await response.content()
        return response, content

    async def chat(
        self,
        token: str | None,
        agentID: str | None,
        body: bytes = VALID_BODY,
        contentType: str | None = JSON_TYPE,
        path: str = CHAT,
        extra: dict[str, str] | None = None,
    ) -> tuple[Any, bytes]:
        return await self.request(
            "POST", path, protectedHeaders(token, agentID, contentType, extra), body
        )

    async def probe(
        self, token: str | None, agentID: str | None, path: str = PROBE
    ) -> tuple[Any, bytes]:
        return await self.request("GET", path, protectedHeaders(token, agentID, None, None))


def protectedHeaders(
    token: str | None,
    agentID: str | None,
    contentType: str | None,
    extra: dict[str, str] | None,
) -> dict[str, str]:
    headers: dict[str, str] = {}
    if token is not None:
        headers["Authorization"] = "Bearer " + token
    if agentID is not None:
        headers["X-SVC-Agent-ID"] = agentID
    if contentType is not None:
        headers["Content-Type"] = contentType
    headers.update(extra or {})
    return headers


def makeHarness(
    limiter: str = "memory",
    orgRPM: dict[str, int] | None = None,
    **configValues: Any,
) -> Harness:
    clock = Clock()
    clock.advance(NOW)
    auth = FakeAuthClient()
    counters = MemoryCounters()
    metrics = ProxyMetrics()
    config = ProxyConfig(authGrpcAddr="auth.test:9091", **configValues)
    rateLimiter: RedisRateLimiter | DisabledRateLimiter
    if limiter == "memory":
        rateLimiter = RedisRateLimiter(counters, clock, config.defaultRPM, orgRPM or {})
    else:
        rateLimiter = DisabledRateLimiter(clock)
    edge = ProxyEdge(config, auth, rateLimiter, metrics, clock)
    return Harness(clock, auth, counters, metrics, edge, StubTreq(edge.resource()))


@pytest.fixture
def proxy() -> Harness:
    return makeHarness()


def header(response: Any, name: str) -> str | None:
    values = response.headers.getRawHeaders(name)
    if not values:
        return None
    value = values[0]
    return value.decode() if isinstance(value, bytes) else str(value)


def errorOf(response: Any, content: bytes) -> dict[str, Any]:
    """
    The error object of an envelope, after the checks every error answer
    must pass: JSON content type, request_id equal to X-Request-ID, an RFC
    3339 UTC timestamp, and the three standard headers.
    """
    assert header(response, "Content-Type") == JSON_TYPE
    document = json.loads(content)
    assert set(document) == {"error"}
    error: dict[str, Any] = document["error"]
    assert error["request_id"] == header(response, "X-Request-ID")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", error["timestamp"])
    assert header(response, "X-Trace-ID") is not None
    assert header(response, "X-Response-Time") is not None
    assert "Traceback" not in content.decode()
    return error


def assertError(response: Any, content: bytes, status: int, code: str) -> dict[str, Any]:
    assert (response.code, json.loads(content)["error"]["code"]) == (status, code)
    return errorOf(response, content)


def metricValue(harness: Harness, name: str, labels: dict[str, str] | None = None) -> float:
    value = harness.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


# Health, readiness, metrics


@pytest_twisted.ensureDeferred
async def test_healthAlwaysOK(proxy: Harness) -> None:
    """
    GET /health answers 200 {"status": "ok", "checks": {}} without asking
    any dependency, with the three standard headers.
    """
    proxy.auth.reachable = CheckFailed("down")
    response, content = await proxy.request("GET", "/health")
    assert response.code == 200
    assert json.loads(content) == {"status": "ok", "checks": {}}
    assert proxy.auth.calls == []
    requestID = uuid.UUID(header(response, "X-Request-ID"))
    assert requestID.version == 7
    assert re.fullmatch(r"[0-9a-f]{32}", header(response, "X-Trace-ID") or "")
    assert float(header(response, "X-Response-Time") or "x") >= 0
    assert header(response, "Server") is None


@pytest_twisted.ensureDeferred
async def test_readyOK(proxy: Harness) -> None:
    """
    GET /ready is 200 ok when svc-auth answers and Redis answers PING.
    """
    response, content = await proxy.request("GET", "/ready")
    body = json.loads(content)
    assert response.code == 200
    assert body["status"] == "ok"
    assert set(body["checks"]) == {"auth_grpc", "redis"}
    for check in body["checks"].values():
        assert check["status"] == "ok"
        assert "message" not in check
        assert isinstance(check["latency_ms"], float | int)
    assert ("checkReachable",) in proxy.auth.calls


@pytest_twisted.ensureDeferred
async def test_readyAuthUnreachable(proxy: Harness) -> None:
    """
    An auth_grpc check failure makes /ready 503 unhealthy, with the
    check's message.
    """
    proxy.auth.reachable = CheckFailed("ValidateToken answered UNAVAILABLE")
    response, content = await proxy.request("GET", "/ready")
    body = json.loads(content)
    assert response.code == 503
    assert body["status"] == "unhealthy"
    assert body["checks"]["auth_grpc"] == {
        "status": "failed",
        "latency_ms": 0,
        "message": "ValidateToken answered UNAVAILABLE",
    }
    assert body["checks"]["redis"]["status"] == "ok"


@pytest_twisted.ensureDeferred
async def test_readyCheckTimesOut(proxy: Harness) -> None:
    """
    A checker that does not answer fails after 500 ms; /ready answers
    within its budget.
    """
    proxy.auth.reachable = Deferred()
    pending = Deferred.fromCoroutine(proxy.request("GET", "/ready"))
    proxy.clock.advance(0.5)
    proxy.stub.flush()
    response, content = await pending
    body = json.loads(content)
    assert response.code == 503
    assert body["checks"]["auth_grpc"]["message"] == "timed out after 500 ms"
    assert body["checks"]["auth_grpc"]["latency_ms"] == 500.0


@pytest_twisted.ensureDeferred
async def test_readyRedisDown(proxy: Harness) -> None:
    """
    With Redis disconnected the redis check fails and /ready is 503.
    """
    proxy.counters.connected = False
    response, content = await proxy.request("GET", "/ready")
    assert response.code == 503
    assert json.loads(content)["checks"]["redis"]["message"] == "not connected to Redis"


@pytest_twisted.ensureDeferred
async def test_readyRedisNotConfigured() -> None:
    """
    With REDIS_URL empty the redis check fails, saying so, and /ready is
    503 (spec 4.2).
    """
    harness = makeHarness(limiter="disabled")
    response, content = await harness.request("GET", "/ready")
    body = json.loads(content)
    assert response.code == 503
    assert body["status"] == "unhealthy"
    assert body["checks"]["redis"]["message"] == "REDIS_URL is not configured"
    assert body["checks"]["auth_grpc"]["status"] == "ok"


@pytest_twisted.ensureDeferred
async def test_metricsExposition(proxy: Harness) -> None:
    """
    GET /metrics is Prometheus text with every series of spec 4.2.
    """
    response, content = await proxy.request("GET", "/metrics")
    assert response.code == 200
    contentType = header(response, "Content-Type")
    assert contentType is not None
    assert contentType.startswith("text/plain")
    text = content.decode()
    for name in (
        "svc_proxy_requests_total",
        "svc_proxy_request_duration_seconds_bucket",
        "svc_proxy_rate_limited_total",
        "svc_proxy_auth_validate_duration_seconds",
        "svc_process_up 1.0",
    ):
        assert name in text
    assert 'le="0.001"' in text and 'le="5.0"' in text


@pytest_twisted.ensureDeferred
async def test_metricsLabels(proxy: Harness) -> None:
    """
    svc_proxy_requests_total is labelled with the route template, never a
    raw path; unknown paths share "unmatched"; made-up methods share
    "OTHER".
    """
    token, orgID, agentID = proxy.auth.addTenant()
    await proxy.probe(token, agentID, f"/v1/orgs/{orgID}/auth-probe")
    await proxy.probe(token, agentID, f"/v1/orgs/{uuid.uuid4()}/auth-probe")
    await proxy.request("GET", "/no/such/" + orgID)
    await proxy.request("BREW", "/health")
    await proxy.chat(token, agentID, path="/proxy/v1/chat/completions")
    assert (
        metricValue(
            proxy,
            "svc_proxy_requests_total",
            {"route": "/v1/orgs/{org_id}/auth-probe", "method": "GET", "code": "200"},
        )
        == 1
    )
    assert (
        metricValue(
            proxy,
            "svc_proxy_requests_total",
            {"route": "/v1/orgs/{org_id}/auth-probe", "method": "GET", "code": "403"},
        )
        == 1
    )
    assert (
        metricValue(
            proxy,
            "svc_proxy_requests_total",
            {"route": "unmatched", "method": "GET", "code": "404"},
        )
        == 1
    )
    assert (
        metricValue(
            proxy,
            "svc_proxy_requests_total",
            {"route": "/health", "method": "OTHER", "code": "405"},
        )
        == 1
    )
    assert (
        metricValue(
            proxy,
            "svc_proxy_requests_total",
            {"route": "/proxy/v1/chat/completions", "method": "POST", "code": "501"},
        )
        == 1
    )
    exposition = (await proxy.request("GET", "/metrics"))[1].decode()
    assert orgID not in exposition
    assert agentID not in exposition
    assert metricValue(proxy, "svc_proxy_request_duration_seconds_count") >= 5


# Routing errors


@pytest.mark.parametrize("path", ["/", "/nope", "/v1/chat/completions/x", "/health/", "/v2/orgs"])
@pytest_twisted.ensureDeferred
async def test_unknownPath(proxy: Harness, path: str) -> None:
    """
    An unknown path is 404 NOT_FOUND in the envelope, answered by the
    edge's own chain (the C{unmatched} route), not a router's HTML page.
    """
    response, content = await proxy.request("GET", path)
    assertError(response, content, 404, "NOT_FOUND")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("POST", "/health", "GET"),
        ("DELETE", "/ready", "GET"),
        ("PUT", "/metrics", "GET"),
        ("GET", CHAT, "POST"),
        ("GET", "/proxy/v1/chat/completions", "POST"),
        ("POST", PROBE, "GET"),
        ("POST", "/v1/orgs/not-a-uuid/auth-probe", "GET"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_wrongMethod(proxy: Harness, method: str, path: str, allowed: str) -> None:
    """
    A wrong method on a known route is 405 METHOD_NOT_ALLOWED with Allow,
    before any other check of the route.
    """
    response, content = await proxy.request(method, path, {"Content-Type": "text/plain"})
    assertError(response, content, 405, "METHOD_NOT_ALLOWED")
    assert header(response, "Allow") == allowed
    assert proxy.auth.calls == []


# Request ids, trace ids, envelope


@pytest.mark.parametrize("version", [4, 7])
@pytest_twisted.ensureDeferred
async def test_inboundRequestIDHonoured(proxy: Harness, version: int) -> None:
    """
    A valid inbound UUID v4 or v7 request id is echoed in the header and
    the envelope.
    """
    inbound = str(uuid.uuid4() if version == 4 else uuid7())
    response, content = await proxy.request("GET", "/nope", {"X-Request-ID": inbound})
    assert header(response, "X-Request-ID") == inbound
    assert errorOf(response, content)["request_id"] == inbound


@pytest.mark.parametrize(
    "inbound",
    [
        "not-a-uuid",
        str(uuid.uuid1()),
        "{" + str(uuid.uuid4()) + "}",
        uuid.uuid4().hex,
        "",
        "00000000-0000-0000-0000-000000000000",
    ],
)
@pytest_twisted.ensureDeferred
async def test_inboundRequestIDIgnored(proxy: Harness, inbound: str) -> None:
    """
    Anything but a canonical v4 or v7 UUID is ignored and a fresh UUID v7
    used.
    """
    response, _ = await proxy.request("GET", "/health", {"X-Request-ID": inbound})
    requestID = header(response, "X-Request-ID") or ""
    assert requestID != inbound
    assert uuid.UUID(requestID).version == 7


@pytest_twisted.ensureDeferred
async def test_configuredHeaderNames() -> None:
    """
    SVC_REQUEST_ID_HEADER and SVC_TRACE_ID_HEADER rename both headers, for
    what is read and what is written.
    """
    harness = makeHarness(requestIDHeader="X-Correlation-ID", traceIDHeader="X-B3-TraceId")
    inbound = str(uuid.uuid4())
    response, content = await harness.request("GET", "/nope", {"X-Correlation-ID": inbound})
    assert header(response, "X-Correlation-ID") == inbound
    assert json.loads(content)["error"]["request_id"] == inbound
    assert re.fullmatch(r"[0-9a-f]{32}", header(response, "X-B3-TraceId") or "")
    assert response.headers.getRawHeaders("X-Request-ID") is None
    assert response.headers.getRawHeaders("X-Trace-ID") is None


@pytest_twisted.ensureDeferred
async def test_traceparentContinued(proxy: Harness) -> None:
    """
    A valid W3C traceparent's trace id becomes X-Trace-ID.
    """
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    response, _ = await proxy.request("GET", "/health", {"traceparent": traceparent})
    assert header(response, "X-Trace-ID") == "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(
    "traceparent",
    [
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "garbage",
    ],
)
@pytest_twisted.ensureDeferred
async def test_traceparentInvalid(proxy: Harness, traceparent: str) -> None:
    """
    An invalid traceparent is ignored: a fresh trace id is made.
    """
    response, _ = await proxy.request("GET", "/health", {"traceparent": traceparent})
    traceID = header(response, "X-Trace-ID") or ""
    assert re.fullmatch(r"[0-9a-f]{32}", traceID)
    assert traceID != "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest_twisted.ensureDeferred
async def test_traceparentLaterVersion(proxy: Harness) -> None:
    """
    A later traceparent version may carry more fields; its trace id is
    used.
    """
    traceparent = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-next"
    response, _ = await proxy.request("GET", "/health", {"traceparent": traceparent})
    assert header(response, "X-Trace-ID") == "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest_twisted.ensureDeferred
async def test_envelopeShape(proxy: Harness) -> None:
    """
    The envelope holds code, message, request_id and timestamp (the
    clock's time in RFC 3339 UTC), and no docs_url unless configured.
    """
    response, content = await proxy.request("GET", "/nope")
    error = errorOf(response, content)
    assert set(error) == {"code", "message", "request_id", "timestamp"}
    moment = datetime.datetime.fromtimestamp(NOW, datetime.UTC)
    assert error["timestamp"] == moment.strftime("%Y-%m-%dT%H:%M:%S.000Z")


@pytest_twisted.ensureDeferred
async def test_envelopeDocsURL() -> None:
    """
    With SVC_ERROR_DOCS_BASE set every error carries a docs_url.
    """
    harness = makeHarness(errorDocsBase="https://docs.example/errors/")
    response, content = await harness.chat(None, None)
    error = assertError(response, content, 401, "MISSING_TOKEN")
    assert error["docs_url"] == "https://docs.example/errors/missing_token"


# Token auth


@pytest_twisted.ensureDeferred
async def test_missingToken(proxy: Harness) -> None:
    """
    No Authorization header: 401 MISSING_TOKEN, without asking svc-auth.
    """
    response, content = await proxy.probe(None, str(uuid.uuid4()))
    assertError(response, content, 401, "MISSING_TOKEN")
    assert proxy.auth.calls == []


@pytest.mark.parametrize(
    "authorization",
    [
        "",
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "Token svc_pat_x",
        "Bearer svc_pat_not-a-token",
        "Bearer " + newToken()[:-1],
    ],
)
@pytest_twisted.ensureDeferred
async def test_malformedAuthorization(proxy: Harness, authorization: str) -> None:
    """
    An Authorization header that is not "Bearer <PAT>" is 401
    INVALID_TOKEN, decided without a call to svc-auth.
    """
    response, content = await proxy.request(
        "GET", PROBE, {"Authorization": authorization, "X-SVC-Agent-ID": str(uuid.uuid4())}
    )
    assertError(response, content, 401, "INVALID_TOKEN")
    assert proxy.auth.calls == []


@pytest_twisted.ensureDeferred
async def test_bearerSchemeCaseInsensitive(proxy: Harness) -> None:
    """
    The auth scheme is case-insensitive (RFC 9110).
    """
    token, _, agentID = proxy.auth.addTenant()
    response, _ = await proxy.request(
        "GET", PROBE, {"Authorization": "bearer " + token, "X-SVC-Agent-ID": agentID}
    )
    assert response.code == 200


@pytest_twisted.ensureDeferred
async def test_tokenRejectedByAuth(proxy: Harness) -> None:
    """
    A well-formed token svc-auth does not know (expired, revoked) is 401
    INVALID_TOKEN.
    """
    token = newToken()
    response, content = await proxy.probe(token, str(uuid.uuid4()))
    assertError(response, content, 401, "INVALID_TOKEN")
    assert proxy.auth.calls == [("ValidateToken", token)]


@pytest_twisted.ensureDeferred
async def test_tokenValidationDegraded(proxy: Harness) -> None:
    """
    ValidateToken failing unexpectedly is 503 SERVICE_DEGRADED, and agent
    verification is not attempted.
    """
    token = newToken()
    proxy.auth.tokens[token] = ApiError(ErrorCode.SERVICE_DEGRADED)
    response, content = await proxy.probe(token, str(uuid.uuid4()))
    assertError(response, content, 503, "SERVICE_DEGRADED")
    assert [call[0] for call in proxy.auth.calls] == ["ValidateToken"]


@pytest_twisted.ensureDeferred
async def test_chatNeedsPermission(proxy: Harness) -> None:
    """
    A token without ProxyChatCompletion gets 403 INSUFFICIENT_PERMISSIONS
    on chat; the probe needs no permission bit.
    """
    token, _, agentID = proxy.auth.addTenant(permissions=Permission.TokenList)
    response, content = await proxy.chat(token, agentID)
    assertError(response, content, 403, "INSUFFICIENT_PERMISSIONS")
    response, content = await proxy.probe(token, agentID)
    assert response.code == 200
    assert json.loads(content)["permissions"] == int(Permission.TokenList)


@pytest_twisted.ensureDeferred
async def test_probeWithNoPermissionBits(proxy: Harness) -> None:
    """
    A token with an empty bitmap may still use both probes.
    """
    token, orgID, agentID = proxy.auth.addTenant(permissions=0)
    assert (await proxy.probe(token, agentID))[0].code == 200
    assert (await proxy.probe(token, agentID, f"/v1/orgs/{orgID}/auth-probe"))[0].code == 200


# Agent verify


@pytest_twisted.ensureDeferred
async def test_missingAgentID(proxy: Harness) -> None:
    """
    A valid token without X-SVC-Agent-ID: 400 MISSING_AGENT_ID; the token
    was checked first.
    """
    token, _, _ = proxy.auth.addTenant()
    response, content = await proxy.probe(token, None)
    assertError(response, content, 400, "MISSING_AGENT_ID")
    assert [call[0] for call in proxy.auth.calls] == ["ValidateToken"]


@pytest_twisted.ensureDeferred
async def test_emptyAgentIDIsMissing(proxy: Harness) -> None:
    """
    An empty X-SVC-Agent-ID counts as missing.
    """
    token, _, _ = proxy.auth.addTenant()
    response, content = await proxy.probe(token, "")
    assertError(response, content, 400, "MISSING_AGENT_ID")


@pytest.mark.parametrize(
    "agentID", ["agent-7", "1234", str(uuid.uuid4()).replace("-", ""), str(uuid.uuid4()) + "x"]
)
@pytest_twisted.ensureDeferred
async def test_malformedAgentID(proxy: Harness, agentID: str) -> None:
    """
    An X-SVC-Agent-ID that is not a UUID: 400 VALIDATION_ERROR, field
    X-SVC-Agent-ID, INVALID_FORMAT, without a ValidateAgent call.
    """
    token, _, _ = proxy.auth.addTenant()
    response, content = await proxy.probe(token, agentID)
    error = assertError(response, content, 400, "VALIDATION_ERROR")
    assert [(e["field"], e["code"]) for e in error["field_errors"]] == [
        ("X-SVC-Agent-ID", "INVALID_FORMAT")
    ]
    assert [call[0] for call in proxy.auth.calls] == ["ValidateToken"]


@pytest_twisted.ensureDeferred
async def test_agentVerifiedWithCallerToken(proxy: Harness) -> None:
    """
    ValidateAgent gets the caller's token, the canonical agent id (an
    uppercase header is accepted) and the token's org.
    """
    token, orgID, agentID = proxy.auth.addTenant()
    response, content = await proxy.probe(token, agentID.upper())
    assert response.code == 200
    assert json.loads(content) == {
        "org_id": orgID,
        "permissions": int(Permission.ProxyChatCompletion),
        "agent_id": agentID,
    }
    assert proxy.auth.calls == [
        ("ValidateToken", token),
        ("ValidateAgent", token, agentID, orgID),
    ]


@pytest_twisted.ensureDeferred
async def test_agentOfAnotherOrg(proxy: Harness) -> None:
    """
    An agent of another organization: 403 AGENT_NOT_AUTHORIZED (never
    404).
    """
    token, _, _ = proxy.auth.addTenant()
    _, _, otherAgent = proxy.auth.addTenant()
    response, content = await proxy.probe(token, otherAgent)
    assertError(response, content, 403, "AGENT_NOT_AUTHORIZED")


@pytest_twisted.ensureDeferred
async def test_agentSuspended(proxy: Harness) -> None:
    """
    An inactive agent: 403 AGENT_SUSPENDED.
    """
    token, _, agentID = proxy.auth.addTenant(status="paused")
    response, content = await proxy.chat(token, agentID)
    assertError(response, content, 403, "AGENT_SUSPENDED")


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (ErrorCode.AUTH_UNAVAILABLE, 503, "AUTH_UNAVAILABLE"),
        (ErrorCode.INVALID_TOKEN, 401, "INVALID_TOKEN"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_agentVerificationFailures(
    proxy: Harness, error: ErrorCode, status: int, code: str
) -> None:
    """
    ValidateAgent's own failures reach the client as the client maps them.
    """
    token, _, agentID = proxy.auth.addTenant()
    proxy.auth.agents[agentID] = ApiError(error)
    response, content = await proxy.probe(token, agentID)
    assertError(response, content, status, code)


@pytest_twisted.ensureDeferred
async def test_tokenBoundToAnotherAgent(proxy: Harness) -> None:
    """
    A token bound to an agent may act only as that agent: another
    X-SVC-Agent-ID is 403 AGENT_NOT_AUTHORIZED without a ValidateAgent
    call; its own agent is fine.
    """
    token, _, agentID = proxy.auth.addTenant(tokenAgent=True)
    otherAgent = str(uuid.uuid4())
    response, content = await proxy.probe(token, otherAgent)
    assertError(response, content, 403, "AGENT_NOT_AUTHORIZED")
    assert [call[0] for call in proxy.auth.calls] == ["ValidateToken"]
    response, _ = await proxy.probe(token, agentID)
    assert response.code == 200


# Org-scoped probe


@pytest_twisted.ensureDeferred
async def test_orgProbe(proxy: Harness) -> None:
    """
    The org-scoped probe answers 200 for the token's own org, in any case
    of hex digits.
    """
    token, orgID, agentID = proxy.auth.addTenant()
    for pathOrg in (orgID, orgID.upper()):
        response, content = await proxy.probe(token, agentID, f"/v1/orgs/{pathOrg}/auth-probe")
        assert response.code == 200
        assert json.loads(content)["org_id"] == orgID


@pytest_twisted.ensureDeferred
async def test_orgProbeOtherOrg(proxy: Harness) -> None:
    """
    Another org in the path: 403 INSUFFICIENT_PERMISSIONS (never 404),
    decided after the token and before the agent header.
    """
    token, _, _ = proxy.auth.addTenant()
    response, content = await proxy.probe(token, None, f"/v1/orgs/{uuid.uuid4()}/auth-probe")
    assertError(response, content, 403, "INSUFFICIENT_PERMISSIONS")
    assert [call[0] for call in proxy.auth.calls] == ["ValidateToken"]


@pytest.mark.parametrize("pathOrg", ["not-a-uuid", "1234", uuid.uuid4().hex])
@pytest_twisted.ensureDeferred
async def test_orgProbeMalformedOrgBeatsMissingToken(proxy: Harness, pathOrg: str) -> None:
    """
    A path org id that is not a UUID: 400 VALIDATION_ERROR on field org_id,
    before any token check (even with no token at all).
    """
    response, content = await proxy.probe(None, None, f"/v1/orgs/{pathOrg}/auth-probe")
    error = assertError(response, content, 400, "VALIDATION_ERROR")
    assert [(e["field"], e["code"]) for e in error["field_errors"]] == [
        ("org_id", "INVALID_FORMAT")
    ]
    assert proxy.auth.calls == []


# Chat: the order body size, content type, token, agent, rate limit, body


@pytest_twisted.ensureDeferred
async def test_chatAnswers501(proxy: Harness) -> None:
    """
    A valid chat request passes every step and gets 501
    PROVIDER_NOT_CONFIGURED with X-RateLimit-* headers; the alias path
    behaves the same.
    """
    token, _, agentID = proxy.auth.addTenant()
    for path in (CHAT, "/proxy/v1/chat/completions"):
        response, content = await proxy.chat(token, agentID, path=path)
        error = assertError(response, content, 501, "PROVIDER_NOT_CONFIGURED")
        assert set(error) == {"code", "message", "request_id", "timestamp"}
        assert header(response, "X-RateLimit-Limit") == "60"
        assert header(response, "X-RateLimit-Reset") == str(NEXT_MINUTE)
    assert header(response, "X-RateLimit-Remaining") == "58"


@pytest_twisted.ensureDeferred
async def test_tooLargeBeatsContentType(proxy: Harness) -> None:
    """
    413 PAYLOAD_TOO_LARGE comes before the content type and the token.
    """
    body = b"x" * (1024 * 1024 + 1)
    response, content = await proxy.chat(None, None, body=body, contentType="text/plain")
    error = assertError(response, content, 413, "PAYLOAD_TOO_LARGE")
    assert error["detail"] == "The limit is 1048576 bytes."


@pytest_twisted.ensureDeferred
async def test_bodyAtTheLimit(proxy: Harness) -> None:
    """
    A body of exactly SVC_MAX_REQUEST_BODY_BYTES is not too large.
    """
    harness = makeHarness(maxRequestBodyBytes=len(VALID_BODY))
    token, _, agentID = harness.auth.addTenant()
    response, content = await harness.chat(token, agentID)
    assertError(response, content, 501, "PROVIDER_NOT_CONFIGURED")
    harness = makeHarness(maxRequestBodyBytes=len(VALID_BODY) - 1)
    token, _, agentID = harness.auth.addTenant()
    response, content = await harness.chat(token, agentID)
    assertError(response, content, 413, "PAYLOAD_TOO_LARGE")


@pytest.mark.parametrize(
    "contentType", [None, "text/plain", "application/jsonx", "application/x-www-form-urlencoded"]
)
@pytest_twisted.ensureDeferred
async def test_contentTypeBeatsToken(proxy: Harness, contentType: str | None) -> None:
    """
    415 UNSUPPORTED_MEDIA_TYPE comes before the token check.
    """
    response, content = await proxy.chat(None, None, contentType=contentType)
    assertError(response, content, 415, "UNSUPPORTED_MEDIA_TYPE")
    assert proxy.auth.calls == []


@pytest.mark.parametrize(
    "contentType",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "APPLICATION/JSON;charset=UTF-8",
    ],
)
@pytest_twisted.ensureDeferred
async def test_contentTypeAccepted(proxy: Harness, contentType: str) -> None:
    """
    application/json is accepted in any case, with parameters.
    """
    token, _, agentID = proxy.auth.addTenant()
    response, content = await proxy.chat(token, agentID, contentType=contentType)
    assertError(response, content, 501, "PROVIDER_NOT_CONFIGURED")


@pytest_twisted.ensureDeferred
async def test_missingTokenBeatsMissingAgent(proxy: Harness) -> None:
    """
    With neither token nor agent header, the token is reported.
    """
    response, content = await proxy.chat(None, None)
    assertError(response, content, 401, "MISSING_TOKEN")


@pytest_twisted.ensureDeferred
async def test_permissionBeatsMissingAgent(proxy: Harness) -> None:
    """
    The permission check belongs to token auth, so it comes before the
    agent header.
    """
    token, _, _ = proxy.auth.addTenant(permissions=0)
    response, content = await proxy.chat(token, None)
    assertError(response, content, 403, "INSUFFICIENT_PERMISSIONS")


@pytest_twisted.ensureDeferred
async def test_agentBeatsRateLimit(proxy: Harness) -> None:
    """
    A refused agent is not counted by the rate limiter.
    """
    token, _, agentID = proxy.auth.addTenant(status="suspended")
    response, content = await proxy.chat(token, agentID)
    assertError(response, content, 403, "AGENT_SUSPENDED")
    assert proxy.counters.counts == {}
    assert header(response, "X-RateLimit-Limit") is None


@pytest_twisted.ensureDeferred
async def test_invalidJSONAfterEverything(proxy: Harness) -> None:
    """
    The body is parsed last: malformed JSON is 400 INVALID_JSON only once
    the request passed the other steps (and was counted).
    """
    token, orgID, agentID = proxy.auth.addTenant()
    response, content = await proxy.chat(token, agentID, body=b"{nope")
    assertError(response, content, 400, "INVALID_JSON")
    assert header(response, "X-RateLimit-Remaining") == "59"
    assert proxy.counters.counts == {f"ratelimit:{{{orgID}}}:{NEXT_MINUTE - 60}": 1}


@pytest_twisted.ensureDeferred
async def test_validationErrorsAllAtOnce(proxy: Harness) -> None:
    """
    Every failed body rule is reported in one VALIDATION_ERROR.
    """
    token, _, agentID = proxy.auth.addTenant()
    body = json.dumps(
        {
            "model": 7,
            "messages": [
                {"role": "user", "content": "ok"},
                {"role": "robot", "content": 1},
                "text",
                {"content": "x" * (100 * 1024 + 1)},
            ],
            "stream": "yes",
            "temperature": True,
            "max_tokens": 1.5,
        }
    ).encode()
    response, content = await proxy.chat(token, agentID, body=body)
    error = assertError(response, content, 400, "VALIDATION_ERROR")
    assert [(e["field"], e["code"]) for e in error["field_errors"]] == [
        ("model", "INVALID_FORMAT"),
        ("messages[1].role", "INVALID_ENUM"),
        ("messages[1].content", "INVALID_FORMAT"),
        ("messages[2]", "INVALID_FORMAT"),
        ("messages[3].role", "REQUIRED"),
        ("messages[3].content", "TOO_LONG"),
        ("stream", "INVALID_FORMAT"),
        ("temperature", "INVALID_FORMAT"),
        ("max_tokens", "INVALID_FORMAT"),
    ]
    for fieldError in error["field_errors"]:
        assert set(fieldError) == {"field", "code", "message"}


@pytest_twisted.ensureDeferred
async def test_chatLogsMetadataOnly(proxy: Harness) -> None:
    """
    A parsed chat request logs one line with org_id, request_id, model,
    message_count and stream; no log event holds the message content or
    the token.
    """
    token, orgID, agentID = proxy.auth.addTenant()
    secretContent = "my-very-private-prompt-" + uuid.uuid4().hex
    body = json.dumps(
        {
            "model": "gpt-test",
            "stream": True,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": secretContent},
            ],
        }
    ).encode()
    with capturedLogs() as events:
        response, _ = await proxy.chat(token, agentID, body=body)
    assert response.code == 501
    chatLines = [event for event in events if "message_count" in event]
    assert len(chatLines) == 1
    line = chatLines[0]
    assert (line["org_id"], line["model"], line["message_count"], line["stream"]) == (
        orgID,
        "gpt-test",
        2,
        True,
    )
    assert line["request_id"] == header(response, "X-Request-ID")
    everything = repr(list(events))
    assert secretContent not in everything
    assert token not in everything


# Rate limiting


@pytest_twisted.ensureDeferred
async def test_rateLimitCountsAndRefuses(proxy: Harness) -> None:
    """
    Within a minute the org gets its 60 requests with decreasing
    X-RateLimit-Remaining; the 61st is 429 RATE_LIMITED with Retry-After
    until the next minute, and is counted in svc_proxy_rate_limited_total.
    """
    token, _, agentID = proxy.auth.addTenant()
    for expected in range(59, -1, -1):
        response, _ = await proxy.probe(token, agentID)
        assert response.code == 200
        assert header(response, "X-RateLimit-Remaining") == str(expected)
    response, content = await proxy.probe(token, agentID)
    assertError(response, content, 429, "RATE_LIMITED")
    assert header(response, "Retry-After") == str(int(NEXT_MINUTE - NOW))
    assert header(response, "X-RateLimit-Limit") == "60"
    assert header(response, "X-RateLimit-Remaining") == "0"
    assert header(response, "X-RateLimit-Reset") == str(NEXT_MINUTE)
    assert metricValue(proxy, "svc_proxy_rate_limited_total") == 1


@pytest_twisted.ensureDeferred
async def test_rateLimitBeatsBodyValidation() -> None:
    """
    A limited org is refused before its body is read.
    """
    harness = makeHarness(defaultRPM=1)
    token, _, agentID = harness.auth.addTenant()
    await harness.chat(token, agentID)
    response, content = await harness.chat(token, agentID, body=b"{nope")
    assertError(response, content, 429, "RATE_LIMITED")


@pytest_twisted.ensureDeferred
async def test_rateLimitPerOrganization() -> None:
    """
    The limit is per organization: agents of one org share it, another org
    has its own; an override raises one org's limit.
    """
    bigOrg = str(uuid.uuid4())
    harness = makeHarness(defaultRPM=2, orgRPM={bigOrg: 3})
    token, _, agentID = harness.auth.addTenant(orgID=bigOrg)
    sameOrgToken, _, sameOrgAgent = harness.auth.addTenant(orgID=bigOrg)
    otherToken, _, otherAgent = harness.auth.addTenant()
    codes = [(await harness.probe(token, agentID))[0].code for _ in range(2)]
    codes += [(await harness.probe(sameOrgToken, sameOrgAgent))[0].code for _ in range(2)]
    assert codes == [200, 200, 200, 429]
    codes = [(await harness.probe(otherToken, otherAgent))[0].code for _ in range(3)]
    assert codes == [200, 200, 429]


@pytest_twisted.ensureDeferred
async def test_rateLimitWindowRollsOver(proxy: Harness) -> None:
    """
    A new calendar minute starts a new counter.
    """
    harness = makeHarness(defaultRPM=1)
    token, orgID, agentID = harness.auth.addTenant()
    assert (await harness.probe(token, agentID))[0].code == 200
    assert (await harness.probe(token, agentID))[0].code == 429
    harness.clock.advance(NEXT_MINUTE - NOW)
    response, _ = await harness.probe(token, agentID)
    assert response.code == 200
    assert header(response, "X-RateLimit-Reset") == str(NEXT_MINUTE + 60)
    assert harness.counters.counts == {
        f"ratelimit:{{{orgID}}}:{NEXT_MINUTE - 60}": 2,
        f"ratelimit:{{{orgID}}}:{NEXT_MINUTE}": 1,
    }
    assert set(harness.counters.ttls.values()) == {120}


@pytest_twisted.ensureDeferred
async def test_retryAfterAtLeastOne() -> None:
    """
    Retry-After is at least 1 even in the last instant of a minute.
    """
    harness = makeHarness(defaultRPM=1)
    harness.clock.advance(NEXT_MINUTE - NOW - 0.01)
    token, _, agentID = harness.auth.addTenant()
    await harness.probe(token, agentID)
    response, _ = await harness.probe(token, agentID)
    assert response.code == 429
    assert header(response, "Retry-After") == "1"


@pytest_twisted.ensureDeferred
async def test_rateLimitFailsOpen(proxy: Harness) -> None:
    """
    With Redis unavailable (disconnected or failing) the request goes on,
    without X-RateLimit-* headers, and one warning is logged, not one per
    request.
    """
    token, _, agentID = proxy.auth.addTenant()
    proxy.counters.connected = False
    with capturedLogs() as events:
        for _ in range(3):
            response, _ = await proxy.probe(token, agentID)
            assert response.code == 200
            assert header(response, "X-RateLimit-Limit") is None
    warnings = [e for e in events if e["log_level"].name == "warn"]
    assert len(warnings) == 1
    proxy.counters.connected = True
    proxy.counters.failure = ConnectionError("boom")
    proxy.clock.advance(10)
    with capturedLogs() as events:
        response, _ = await proxy.probe(token, agentID)
    assert response.code == 200
    assert header(response, "X-RateLimit-Limit") is None
    assert [e["error_type"] for e in events if e["log_level"].name == "warn"] == ["ConnectionError"]


@pytest_twisted.ensureDeferred
async def test_rateLimitRedisTooSlow(proxy: Harness) -> None:
    """
    A Redis answer slower than 100 ms is not waited for: the request goes
    on without X-RateLimit-* headers.
    """
    token, _, agentID = proxy.auth.addTenant()
    proxy.counters.reply = Deferred()
    pending = Deferred.fromCoroutine(proxy.probe(token, agentID))
    proxy.clock.advance(0.1)
    proxy.stub.flush()
    response, _ = await pending
    assert response.code == 200
    assert header(response, "X-RateLimit-Limit") is None


@pytest_twisted.ensureDeferred
async def test_rateLimitNotConfigured() -> None:
    """
    With REDIS_URL empty, requests go on without X-RateLimit-* headers.
    """
    harness = makeHarness(limiter="disabled")
    token, _, agentID = harness.auth.addTenant()
    for _ in range(70):
        response, _ = await harness.probe(token, agentID)
        assert response.code == 200
    assert header(response, "X-RateLimit-Limit") is None


# Faults


@pytest_twisted.ensureDeferred
async def test_unhandledFault(proxy: Harness) -> None:
    """
    An unexpected exception is 500 INTERNAL_ERROR with no traceback or
    exception text in the body, logged with its traceback.
    """
    token = newToken()
    proxy.auth.tokens[token] = RuntimeError("secret detail 0xdeadbeef")
    with capturedLogs() as events:
        response, content = await proxy.probe(token, str(uuid.uuid4()))
    error = assertError(response, content, 500, "INTERNAL_ERROR")
    assert "0xdeadbeef" not in content.decode()
    assert "RuntimeError" not in content.decode()
    assert set(error) == {"code", "message", "request_id", "timestamp"}
    failures = [e for e in events if "log_failure" in e]
    assert len(failures) == 1
    assert failures[0]["request_id"] == error["request_id"]


@pytest_twisted.ensureDeferred
async def test_faultInALayer(proxy: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A fault in a global layer (here metrics) still gets a 500 envelope
    with the standard headers.
    """

    def broken(*args: object) -> None:
        raise ValueError("metrics broke")

    monkeypatch.setattr(proxy.metrics, "observeRequest", broken)
    with capturedLogs() as events:
        response, content = await proxy.request("GET", "/health")
    assertError(response, content, 500, "INTERNAL_ERROR")
    assert len([e for e in events if "log_failure" in e]) == 1


@pytest_twisted.ensureDeferred
async def test_cancelledRequestCancelsAuthCall(proxy: Harness) -> None:
    """
    A client that goes away cancels the auth call in flight.
    """
    token = newToken()
    cancelled: list[bool] = []
    pending: Deferred[TokenInfo] = Deferred(lambda _: cancelled.append(True))
    proxy.auth.tokens[token] = pending
    # StubTreq's get(), like request(), is set in its __init__ (see above).
    request = proxy.stub.get(  # type: ignore[attr-defined]
        "http://proxy.test" + PROBE,
        headers={"Authorization": "Bearer " + token, "X-SVC-Agent-ID": str(uuid.uuid4())},
    )
    request.cancel()
    proxy.stub.flush()
    assert cancelled == [True]
    with pytest.raises(Exception):  # noqa: B017 - treq's own cancellation error
        await request


def test_middlewareOrder() -> None:
    """
    The global layers run in the order of spec 4.1, outermost first.
    """
    edge = makeHarness().edge
    assert [layer.__name__ for layer in edge.layers] == [
        "requestContext",
        "tracingSpan",
        "recordMetrics",
        "responseHeaders",
        "accessLog",
    ]
    steps = {
        route.template: {
            method: [step.__name__ for step in pipeline.steps]
            for method, pipeline in route.methods.items()
        }
        for route in edge.routes
    }
    chat = ["bodySizeLimit", "contentType", "tokenAuth", "agentVerify", "rateLimit"]
    plain = ["tokenAuth", "agentVerify", "rateLimit"]
    assert steps == {
        "/health": {"GET": []},
        "/ready": {"GET": []},
        "/metrics": {"GET": []},
        "/v1/internal/auth-probe": {"GET": ["tokenAuth", "agentVerify", "rateLimit"]},
        "/v1/orgs/{org_id}/auth-probe": {
            "GET": ["pathOrgID", "tokenAuth", "agentVerify", "rateLimit"]
        },
        "/v1/chat/completions": {"POST": chat},
        "/proxy/v1/chat/completions": {"POST": chat},
        # Decisions D13: the same steps, in the same order.
        "/v1/embeddings": {"POST": chat},
        # Decisions D13: the memory routes, a body's bounds first where
        # they have one.
        "/v1/memories": {"POST": chat, "GET": plain, "DELETE": plain},
        "/v1/memories/search": {"POST": chat},
        "/v1/memories/{id}": {"GET": plain, "PATCH": chat, "DELETE": plain},
        # Decisions D14: Anthropic's Messages API, as chat completions.
        "/v1/messages": {"POST": chat},
        "/v1/messages/count_tokens": {"POST": chat},
    }


# Decisions D13: POST /v1/embeddings without a providers file


@pytest_twisted.ensureDeferred
async def test_embeddingsWithoutProvidersAnswer501(proxy: Harness) -> None:
    """
    Without a providers file the embeddings route behaves as chat does in
    Phase 1: a valid body passes every step (with ProxyEmbeddings) and
    gets 501 PROVIDER_NOT_CONFIGURED with X-RateLimit-*; a bad body is
    still its 400; a token without ProxyEmbeddings is 403 before the body.
    """
    token, _, agentID = proxy.auth.addTenant(permissions=Permission.ProxyEmbeddings)
    body = json.dumps({"model": "embed", "input": ["hello"]}).encode()
    response, content = await proxy.chat(token, agentID, body=body, path="/v1/embeddings")
    assertError(response, content, 501, "PROVIDER_NOT_CONFIGURED")
    assert header(response, "X-RateLimit-Limit") == "60"
    bad = json.dumps({"model": "embed", "input": [1, 2]}).encode()
    response, content = await proxy.chat(token, agentID, body=bad, path="/v1/embeddings")
    error = assertError(response, content, 400, "VALIDATION_ERROR")
    assert [each["field"] for each in error["field_errors"]] == ["input"]
    chatOnly, _, chatAgent = proxy.auth.addTenant()
    response, content = await proxy.chat(chatOnly, chatAgent, body=b"{", path="/v1/embeddings")
    assertError(response, content, 403, "INSUFFICIENT_PERMISSIONS")
    labels = {"route": "/v1/embeddings", "method": "POST", "code": "501"}
    assert metricValue(proxy, "svc_proxy_requests_total", labels) == 1
