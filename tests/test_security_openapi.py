"""
docs/openapi.yaml, the OpenAPI 3.1 document of svc-proxy: valid
(openapi-spec-validator), true to the code (every route and method, every
error code, the standard headers on every response), and checked against
a live proxy with real daemons by schemathesis: generated requests, with a
valid token and agent and without, find no 500, no response outside the
document's statuses, schemas and headers, and no answer without
X-Request-ID, X-Trace-ID and X-Response-Time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate
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
from test_gateway_e2e import (
    Gateway,
    assertCommonHeaders,
    assertEnvelope,
    request,
    unlimitedGateway,
)

from svcd.common.errors import ErrorCode, FieldErrorCode
from svcd.proxy.config import ProxyConfig
from svcd.proxy.edge import ProxyEdge
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.ratelimit import RedisRateLimiter
from svcd.proxy.testing import FakeAuthClient, MemoryCounters
from svcd.testing.servers import PostgresServer

DOCUMENT = Path(__file__).parent.parent / "docs" / "openapi.yaml"
STANDARD_HEADERS = ("X-Request-ID", "X-Trace-ID", "X-Response-Time")
RATE_LIMIT_HEADERS = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")


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
    The document's paths and methods are exactly the proxy's routes.
    """
    from twisted.internet.task import Clock

    clock = Clock()
    edge = ProxyEdge(
        ProxyConfig(authGrpcAddr="auth.test:9091"),
        FakeAuthClient(),
        RedisRateLimiter(MemoryCounters(), clock, 60),
        ProxyMetrics(),
        clock,
    )
    routes = {route.template: {m.lower() for m in route.methods} for route in edge.routes}
    documented = {path: set(item) for path, item in document["paths"].items()}
    assert documented == routes


def test_everyErrorCodeIsDocumented(document: dict[str, Any]) -> None:
    """
    The envelope's code enum is every ErrorCode, the field error enum every
    FieldErrorCode, and every status an error code answers with appears in
    the document (404 and 405, which any path or method may get, in the
    description).
    """
    schemas = document["components"]["schemas"]
    assert set(schemas["Error"]["properties"]["code"]["enum"]) == {code.value for code in ErrorCode}
    assert set(schemas["FieldError"]["properties"]["code"]["enum"]) == {
        code.value for code in FieldErrorCode
    }
    statuses = {int(status) for _, _, status, _ in responsesOf(document)}
    for code in ErrorCode:
        if code in (ErrorCode.NOT_FOUND, ErrorCode.METHOD_NOT_ALLOWED):
            assert f"{code.status} {code.value}" in document["info"]["description"]
        else:
            assert code.status in statuses, code


def test_everyResponseHasTheStandardHeaders(document: dict[str, Any]) -> None:
    """
    Every documented response requires X-Request-ID, X-Trace-ID and
    X-Response-Time; protected routes' answers after the rate-limit step
    document X-RateLimit-*, and a 429 requires them and Retry-After.
    """
    for path, method, status, response in responsesOf(document):
        headers = response["headers"]
        for name in STANDARD_HEADERS:
            assert resolve(document, headers[name])["required"] is True, (path, method, status)
        protected = path.startswith(("/v1/", "/proxy/"))
        if protected and status in ("200", "400", "429", "501"):
            assert set(RATE_LIMIT_HEADERS) <= set(headers), (path, status)
        if status == "429":
            for name in (*RATE_LIMIT_HEADERS, "Retry-After"):
                assert resolve(document, headers[name])["required"] is True


# Schemathesis against the real daemons.


@pytest.fixture(scope="module")
def liveGateway(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    # No rate limit in the way of the generated traffic, and a deadline
    # that a busy 2-core machine meets: this run looks for contract
    # violations, not for timeouts.
    with unlimitedGateway(
        postgresServer, tmp_path_factory.mktemp("schemathesis"), SVC_AUTH_VALIDATE_TIMEOUT="2s"
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
        assert response.json()["error"]["request_id"] == requestID


CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    missing_required_header,
    envelopeAndHeaders,
]


def test_schemathesisFindsNothing(liveGateway: Gateway) -> None:
    """
    Under a minute of schemathesis (2,500 cases, derandomized so that a
    failure reproduces) against the live proxy: positive and
    negative cases of every operation, with a valid token and agent (so
    that the protected routes are exercised past authentication, the path
    org being the token's own in part of them) and with generated
    credentials.
    """
    schema = schemathesis.openapi.from_path(DOCUMENT)
    tenant = liveGateway.tenants["main"]
    credentials = {
        "Authorization": f"Bearer {tenant.token}",
        "X-SVC-Agent-ID": str(tenant.agentID),
    }
    ownOrg = {"org_id": str(tenant.orgID)}
    strategy = st.one_of(
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
    baseURL = f"http://127.0.0.1:{liveGateway.port}"
    seen: dict[int, int] = {}

    @settings(
        max_examples=2500,
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

    began = time.monotonic()
    run()
    print(f"\nschemathesis: {sum(seen.values())} calls in {time.monotonic() - began:.0f} s: {seen}")
    # The valid credentials reached past authentication: 200 probes and
    # 501 chat answers, as well as the refusals.
    assert {200, 400, 401, 403, 501} <= set(seen), seen


def test_undocumentedMethodsAre405(liveGateway: Gateway, document: dict[str, Any]) -> None:
    """
    Every method a documented path does not list, HEAD and OPTIONS
    included, is 405 METHOD_NOT_ALLOWED with an Allow header naming the
    documented methods; the envelope and the standard headers come along
    (HEAD gets the headers only).
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
            else:
                assertEnvelope(answer, 405, "METHOD_NOT_ALLOWED")
