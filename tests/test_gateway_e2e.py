"""
The whole gateway end to end: real `twistd -n svc-auth` and
`twistd -n svc-proxy` processes, a real PostgreSQL and a real Redis, all on
loopback ports, driven over HTTP as a client would.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from gatewayfixtures import (
    CHAT_BODY,
    PATIENT_AUTH,
    Answer,
    Gateway,
    assertCommonHeaders,
    assertEnvelope,
    chat,
    request,
    runningGateway,
    tooLarge,
    waitFor,
    waitForReady,
)

from svcd.auth.authority import issueToken
from svcd.common.ids import parseUUID
from svcd.devkit.postgres import PostgresServer

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gateway(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    with runningGateway(
        postgresServer, tmp_path_factory.mktemp("gateway"), proxyEnvironment=PATIENT_AUTH
    ) as running:
        yield running


@pytest.fixture
def privateGateway(postgresServer: PostgresServer, tmp_path: Path) -> Iterator[Gateway]:
    """
    A gateway of this test's own, whose daemons and Redis it may stop.
    """
    with runningGateway(postgresServer, tmp_path, proxyEnvironment=PATIENT_AUTH) as running:
        yield running


@pytest.fixture
def privateGatewayWithDeadline(postgresServer: PostgresServer, tmp_path: Path) -> Iterator[Gateway]:
    """
    L{privateGateway} with svc-auth's default 50 ms deadline, for the
    tests of that deadline.
    """
    with runningGateway(postgresServer, tmp_path) as running:
        yield running


# The happy paths


def test_validChatRequestAnswers501WithEveryHeader(gateway: Gateway) -> None:
    """
    A valid token, an active agent and a valid body reach the Phase 1
    answer, 501 PROVIDER_NOT_CONFIGURED, with the request, trace, timing and
    rate-limit headers; the alias route answers the same.
    """
    for path in ("/v1/chat/completions", "/proxy/v1/chat/completions"):
        answer = chat(gateway.port, gateway.tenants["main"], path=path)
        assertEnvelope(answer, 501, "PROVIDER_NOT_CONFIGURED")
        assert int(answer.headers["x-ratelimit-limit"]) == 60
        assert 0 <= int(answer.headers["x-ratelimit-remaining"]) < 60
        reset = int(answer.headers["x-ratelimit-reset"])
        assert reset % 60 == 0 and 0 < reset - time.time() <= 61


def test_authProbesAnswerTheTokensOrganization(gateway: Gateway) -> None:
    """
    Both auth-probe routes answer 200 with org_id, permissions and agent_id
    for a token without any permission bit; the org-scoped one refuses
    another organization's id with 403 and a malformed one with 400.
    """
    tenant = gateway.tenants["probeOnly"]
    headers = {"Authorization": f"Bearer {tenant.token}", "X-SVC-Agent-ID": str(tenant.agentID)}
    for path in ("/v1/internal/auth-probe", f"/v1/orgs/{tenant.orgID}/auth-probe"):
        answer = request(gateway.port, "GET", path, headers)
        assert answer.status == 200, answer.body
        assert answer.json() == {
            "org_id": str(tenant.orgID),
            "permissions": 0,
            "agent_id": str(tenant.agentID),
        }
        assertCommonHeaders(answer)
    other = gateway.tenants["other"].orgID
    answer = request(gateway.port, "GET", f"/v1/orgs/{other}/auth-probe", headers)
    assertEnvelope(answer, 403, "INSUFFICIENT_PERMISSIONS")
    answer = request(gateway.port, "GET", "/v1/orgs/not-a-uuid/auth-probe", headers)
    assertEnvelope(answer, 400, "VALIDATION_ERROR")
    assert answer.json()["error"]["field_errors"][0]["field"] == "org_id"


def test_requestIDIsHonouredOrMade(gateway: Gateway) -> None:
    """
    A valid inbound v4 request id is echoed; anything else is replaced by a
    fresh UUID v7.
    """
    inbound = str(uuid.uuid4())
    answer = request(gateway.port, "GET", "/health", {"X-Request-ID": inbound})
    assert answer.headers["x-request-id"] == inbound
    answer = request(gateway.port, "GET", "/health", {"X-Request-ID": "not-an-id"})
    made = parseUUID(answer.headers["x-request-id"])
    assert made is not None and made.version == 7


def test_healthReadyAndMetrics(gateway: Gateway) -> None:
    """
    /health is 200 {"status": "ok", "checks": {}}; /ready is 200 with the
    auth_grpc and redis checks; /metrics carries the proxy series with
    route templates, never raw paths with ids.
    """
    answer = request(gateway.port, "GET", "/health")
    assert answer.status == 200 and answer.json() == {"status": "ok", "checks": {}}
    answer = request(gateway.port, "GET", "/ready")
    assert answer.status == 200, answer.body
    assert set(answer.json()["checks"]) == {"auth_grpc", "redis"}
    tenant = gateway.tenants["main"]
    # An authenticated probe, so that at least one validation has gone to
    # svc-auth, whichever tests ran before this one (or none).
    headers = {"Authorization": f"Bearer {tenant.token}", "X-SVC-Agent-ID": str(tenant.agentID)}
    answer = request(gateway.port, "GET", f"/v1/orgs/{tenant.orgID}/auth-probe", headers)
    assert answer.status == 200, answer.body
    metrics = request(gateway.port, "GET", "/metrics").body.decode()
    for name in (
        "svc_proxy_requests_total",
        "svc_proxy_request_duration_seconds_bucket",
        "svc_proxy_rate_limited_total",
        "svc_proxy_auth_validate_duration_seconds_bucket",
        "svc_process_up 1.0",
    ):
        assert name in metrics
    assert 'route="/v1/orgs/{org_id}/auth-probe"' in metrics
    for identifier in (tenant.orgID, tenant.agentID, tenant.tokenID):
        assert str(identifier) not in metrics


# Each reachable error row of spec section 7


def test_tokenErrors(gateway: Gateway) -> None:
    """
    No Authorization: 401 MISSING_TOKEN. Not a bearer, malformed, unknown
    or revoked: 401 INVALID_TOKEN. A token without ProxyChatCompletion on
    chat: 403 INSUFFICIENT_PERMISSIONS.
    """
    tenant = gateway.tenants["main"]
    answer = request(
        gateway.port,
        "POST",
        "/v1/chat/completions",
        {"Content-Type": "application/json", "X-SVC-Agent-ID": str(tenant.agentID)},
        CHAT_BODY,
    )
    assertEnvelope(answer, 401, "MISSING_TOKEN")
    revoked, record = issueToken(gateway.owner, orgID=tenant.orgID, permissions=1)
    gateway.owner.revokeToken(record.tokenID)
    for authorization in (
        "Basic dXNlcjpwYXNz",
        "Bearer ",
        "Bearer svc_pat_nonsense",
        f"Bearer svc_pat_{uuid.uuid4()}_{'a' * 43}",
        f"Bearer {revoked}",
    ):
        answer = chat(gateway.port, tenant, headers={"Authorization": authorization})
        assertEnvelope(answer, 401, "INVALID_TOKEN")
    answer = chat(gateway.port, gateway.tenants["probeOnly"])
    assertEnvelope(answer, 403, "INSUFFICIENT_PERMISSIONS")


def test_agentErrors(gateway: Gateway) -> None:
    """
    No agent header: 400 MISSING_AGENT_ID. A malformed one: 400
    VALIDATION_ERROR on X-SVC-Agent-ID. Another organization's or an unknown
    agent, or another agent than the token's own: 403 AGENT_NOT_AUTHORIZED.
    A paused agent: 403 AGENT_SUSPENDED.
    """
    tenant = gateway.tenants["main"]
    answer = chat(gateway.port, tenant, headers={"X-SVC-Agent-ID": ""})
    assert answer.status == 400 and answer.code in ("MISSING_AGENT_ID", "VALIDATION_ERROR")
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    connection.request(
        "POST",
        "/v1/chat/completions",
        body=CHAT_BODY,
        headers={"Authorization": f"Bearer {tenant.token}", "Content-Type": "application/json"},
    )
    response = connection.getresponse()
    missing = Answer(
        response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    )
    connection.close()
    assertEnvelope(missing, 400, "MISSING_AGENT_ID")
    answer = chat(gateway.port, tenant, headers={"X-SVC-Agent-ID": "agent-7"})
    assertEnvelope(answer, 400, "VALIDATION_ERROR")
    assert answer.json()["error"]["field_errors"] == [
        {
            "field": "X-SVC-Agent-ID",
            "code": "INVALID_FORMAT",
            "message": answer.json()["error"]["field_errors"][0]["message"],
        }
    ]
    for agentID in (gateway.tenants["other"].agentID, uuid.uuid4()):
        answer = chat(gateway.port, tenant, headers={"X-SVC-Agent-ID": str(agentID)})
        assertEnvelope(answer, 403, "AGENT_NOT_AUTHORIZED")
    bound = gateway.tenants["bound"]
    second = gateway.owner.createAgent(bound.orgID, "second", "active")
    answer = chat(gateway.port, bound, headers={"X-SVC-Agent-ID": str(second.agentID)})
    assertEnvelope(answer, 403, "AGENT_NOT_AUTHORIZED")
    assertEnvelope(chat(gateway.port, gateway.tenants["paused"]), 403, "AGENT_SUSPENDED")


def test_bodyErrors(gateway: Gateway) -> None:
    """
    Above the body limit: 413, before anything else (even without a
    token). Not JSON: 415. Malformed JSON: 400 INVALID_JSON. Invalid
    fields: 400 VALIDATION_ERROR listing them all.
    """
    tenant = gateway.tenants["main"]
    answer = tooLarge(gateway.port, 1024 * 1024 + 1)
    assertEnvelope(answer, 413, "PAYLOAD_TOO_LARGE")
    answer = chat(gateway.port, tenant, headers={"Content-Type": "text/plain"})
    assertEnvelope(answer, 415, "UNSUPPORTED_MEDIA_TYPE")
    answer = chat(gateway.port, tenant, headers={"Content-Type": "application/json; charset=utf-8"})
    assert answer.status == 501
    assertEnvelope(chat(gateway.port, tenant, body=b'{"model": '), 400, "INVALID_JSON")
    answer = chat(
        gateway.port,
        tenant,
        body=json.dumps(
            {"model": 7, "messages": [{"role": "robot", "content": 1}], "stream": "yes"}
        ).encode(),
    )
    assertEnvelope(answer, 400, "VALIDATION_ERROR")
    fields = {(each["field"], each["code"]) for each in answer.json()["error"]["field_errors"]}
    assert fields == {
        ("model", "INVALID_FORMAT"),
        ("messages[0].role", "INVALID_ENUM"),
        ("messages[0].content", "INVALID_FORMAT"),
        ("stream", "INVALID_FORMAT"),
    }


def test_unknownPathAndWrongMethod(gateway: Gateway) -> None:
    """
    An unknown path is 404 NOT_FOUND and a wrong method 405
    METHOD_NOT_ALLOWED, in the envelope with every header.
    """
    assertEnvelope(request(gateway.port, "GET", "/v2/nothing"), 404, "NOT_FOUND")
    assertEnvelope(request(gateway.port, "GET", "/v1/chat/completions"), 405, "METHOD_NOT_ALLOWED")
    assertEnvelope(request(gateway.port, "POST", "/health", body=b""), 405, "METHOD_NOT_ALLOWED")


def test_rateLimitTo429AndTheNextWindow(gateway: Gateway) -> None:
    """
    An organization limited to 3 requests a minute gets 429 RATE_LIMITED
    with Retry-After on its 4th, while another organization is unaffected;
    once Retry-After has passed (the next calendar minute), it is served
    again.
    """
    limited = gateway.tenants["limited"]
    secondsLeft = 60 - time.time() % 60
    if secondsLeft < 5:
        # Too close to a window's end for four requests in one window.
        time.sleep(secondsLeft + 0.1)
    assert [chat(gateway.port, limited).status for _ in range(3)] == [501, 501, 501]
    answer = chat(gateway.port, limited)
    assertEnvelope(answer, 429, "RATE_LIMITED")
    assert answer.headers["x-ratelimit-limit"] == "3"
    assert answer.headers["x-ratelimit-remaining"] == "0"
    retryAfter = int(answer.headers["retry-after"])
    assert 1 <= retryAfter <= 60
    assert chat(gateway.port, gateway.tenants["other"]).status == 501
    time.sleep(retryAfter + 0.2)
    answer = chat(gateway.port, limited)
    assert answer.status == 501, answer.body
    assert answer.headers["x-ratelimit-remaining"] == "2"


# Faults


def test_redisDownFailsOpenAndRecovers(privateGateway: Gateway) -> None:
    """
    With Redis stopped, requests still get their 501 (fail open) without
    X-RateLimit headers and /ready is 503; once Redis is back, the headers
    return without restarting the proxy.
    """
    port, tenant = privateGateway.port, privateGateway.tenants["main"]
    assert "x-ratelimit-limit" in chat(port, tenant).headers
    privateGateway.redis.stop()
    answer = chat(port, tenant)
    assert answer.status == 501, answer.body
    assert "x-ratelimit-limit" not in answer.headers
    waitForReady(port, 503, failed="redis")
    privateGateway.redis.start()
    waitFor(lambda: "x-ratelimit-limit" in chat(port, tenant).headers, limit=5)
    waitForReady(port, 200)


def test_authDownFrozenAndBack(privateGatewayWithDeadline: Gateway) -> None:
    """
    With svc-auth stopped or frozen, chat requests fail closed with 503
    SERVICE_DEGRADED within the 50 ms deadline (plus slack), and /ready
    answers 503 within its budget; once svc-auth runs again the proxy
    recovers by itself.
    """
    gateway = privateGatewayWithDeadline
    port, tenant = gateway.port, gateway.tenants["main"]
    # Served before the fault: on a loaded machine the token's first
    # validation (an argon2 verification) may miss the 50 ms deadline, a
    # 503 that is not what this test is about.
    waitFor(lambda: chat(port, tenant).status == 501, limit=5)
    auth = gateway.auth

    # Frozen before the request: a svc-auth still answering ValidateToken
    # while its threads stop, and then not ValidateAgent, makes a correct
    # 503 AUTH_UNAVAILABLE (spec 4.3), which is not this test's question.
    auth.freeze()
    try:
        started = time.monotonic()
        answer = chat(port, tenant)
        took = time.monotonic() - started
        assertEnvelope(answer, 503, "SERVICE_DEGRADED")
        assert took < 0.5
        waitForReady(port, 503, failed="auth_grpc")
    finally:
        auth.thaw()
    waitFor(lambda: chat(port, tenant).status == 501, limit=5)

    assert auth.terminate() == 0
    started = time.monotonic()
    answer = chat(port, tenant)
    assert time.monotonic() - started < 0.5
    assertEnvelope(answer, 503, "SERVICE_DEGRADED")
    waitForReady(port, 503, failed="auth_grpc")

    auth.start()
    auth.waitForReady()
    waitFor(lambda: chat(port, tenant).status == 501, limit=5)
    waitForReady(port, 200)
