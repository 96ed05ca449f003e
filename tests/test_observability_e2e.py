"""
Tracing and logging of the real gateway: `twistd -n svc-auth` and
`twistd -n svc-proxy` processes (with PostgreSQL and Redis) exporting every
span (OTEL_SAMPLE_RATIO=1.0) over OTLP gRPC to a collector running in this
test process, and logging at DEBUG.

One run drives the chat happy path (with and without an inbound
traceparent) and the refusals (malformed, unknown, revoked and wrong-secret
tokens, ValidateAgent refusals, a 400 with field errors), then stops both
daemons with SIGTERM. The spans arrive only through the flush at stop: the
batch processor's own schedule is set to a minute. The tests then read the
collected spans and both daemons' whole output.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import attrs
import grpc
import pytest
from authfixtures import secretOf
from gatewayfixtures import PATIENT_AUTH, Answer, chat, runningGateway
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from svcd.auth.authority import issueToken
from svcd.common.pat import formatToken, newSecret, parseToken
from svcd.devkit.postgres import PostgresServer

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

CONTENT = "distinctive-message-content-" + uuid.uuid4().hex
INBOUND_TRACE = uuid.uuid4().hex
INBOUND_PARENT = uuid.uuid4().hex[:16]


@attrs.frozen
class CollectedSpan:
    service: str
    environment: str
    traceID: str
    spanID: str
    parentID: str
    name: str
    kind: int
    attributes: dict[str, Any]
    statusCode: int


def _value(any: Any) -> Any:
    kind = any.WhichOneof("value")
    return getattr(any, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """
    An OTLP gRPC trace collector keeping every span it is sent.
    """

    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            for resourceSpans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resourceSpans.resource.attributes}
                for scopeSpans in resourceSpans.scope_spans:
                    for span in scopeSpans.spans:
                        self.spans.append(
                            CollectedSpan(
                                service=resource.get("service.name", ""),
                                environment=resource.get("deployment.environment", ""),
                                traceID=span.trace_id.hex(),
                                spanID=span.span_id.hex(),
                                parentID=span.parent_span_id.hex(),
                                name=span.name,
                                kind=span.kind,
                                attributes={a.key: _value(a.value) for a in span.attributes},
                                statusCode=span.status.code,
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()


@attrs.frozen
class ObservedRun:
    answers: dict[str, Answer]
    spans: list[CollectedSpan]
    proxyLog: str
    authLog: str
    exitCodes: tuple[int, int]
    secrets: list[str]


def _bodyWith(content: str, role: str = "user") -> bytes:
    return json.dumps({"model": "demo", "messages": [{"role": role, "content": content}]}).encode()


@pytest.fixture(scope="module")
def observed(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ObservedRun]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    workdir = tmp_path_factory.mktemp("observed")
    answers: dict[str, Answer] = {}
    secrets: list[str] = []
    try:
        with pytest.MonkeyPatch.context() as patch:
            # Daemon.start passes the test's environment on to both daemons.
            patch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"127.0.0.1:{port}")
            patch.setenv("OTEL_SAMPLE_RATIO", "1.0")
            patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
            patch.setenv("SVC_ENV", "staging")
            patch.setenv("SVC_LOG_LEVEL", "DEBUG")
            with runningGateway(postgresServer, workdir, proxyEnvironment=PATIENT_AUTH) as gateway:
                answers, secrets = _drive(gateway)
                exitCodes = (gateway.proxy.terminate(), gateway.auth.terminate())
                proxyLog, authLog = gateway.proxy.output(), gateway.auth.output()
        yield ObservedRun(answers, list(collector.spans), proxyLog, authLog, exitCodes, secrets)
    finally:
        server.stop(0)


def _drive(gateway: Any) -> tuple[dict[str, Answer], list[str]]:
    port, tenants = gateway.port, gateway.tenants
    main = tenants["main"]
    body = _bodyWith(CONTENT)
    answers = {
        "continued": chat(
            port,
            main,
            body=body,
            headers={"traceparent": f"00-{INBOUND_TRACE}-{INBOUND_PARENT}-01"},
        ),
        "root": chat(port, main, body=body),
        "fieldErrors": chat(port, main, body=_bodyWith(CONTENT, role="robot")),
    }
    parsed = parseToken(main.token)
    assert parsed is not None
    revoked, record = issueToken(gateway.owner, orgID=main.orgID, permissions=1)
    gateway.owner.revokeToken(record.tokenID)
    malformedSecret = newSecret()
    refused = {
        "malformed": "svc_pat_nonsense_" + malformedSecret,
        "unknown": formatToken(uuid.uuid4(), newSecret()),
        "revoked": revoked,
        "wrongSecret": formatToken(parsed.tokenID, newSecret()),
    }
    for name, token in refused.items():
        answers[name] = chat(port, main, body=body, headers={"Authorization": f"Bearer {token}"})
    answers["otherOrgAgent"] = chat(
        port, main, body=body, headers={"X-SVC-Agent-ID": str(tenants["other"].agentID)}
    )
    answers["unknownAgent"] = chat(
        port, main, body=body, headers={"X-SVC-Agent-ID": str(uuid.uuid4())}
    )
    answers["paused"] = chat(port, tenants["paused"], body=body)
    tokens = [main.token, tenants["other"].token, tenants["paused"].token, *refused.values()]
    wellFormed = [token for token in tokens if parseToken(token) is not None]
    secrets = [*tokens, *(secretOf(token) for token in wellFormed), malformedSecret, CONTENT]
    return answers, secrets


def _jsonLines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_answersAsExpected(observed: ObservedRun) -> None:
    """
    The scenario got the answers it was meant to, and both daemons exited 0
    on SIGTERM.
    """
    statuses = {name: answer.status for name, answer in observed.answers.items()}
    assert statuses == {
        "continued": 501,
        "root": 501,
        "fieldErrors": 400,
        "malformed": 401,
        "unknown": 401,
        "revoked": 401,
        "wrongSecret": 401,
        "otherOrgAgent": 403,
        "unknownAgent": 403,
        "paused": 403,
    }
    assert observed.answers["fieldErrors"].json()["error"]["field_errors"]
    assert observed.exitCodes == (0, 0)


def test_oneTraceAcrossBothDaemons(observed: ObservedRun) -> None:
    """
    A chat request's X-Trace-ID is the trace of a proxy server span "POST
    /v1/chat/completions" and of svc-auth's ValidateToken and ValidateAgent
    server spans, each the child of the proxy's client span for that call,
    itself a child of the request's span.
    """
    answer = observed.answers["root"]
    traceID = answer.headers["x-trace-id"]
    spans = [span for span in observed.spans if span.traceID == traceID]
    byName = {(span.service, span.name): span for span in spans}
    server = byName[("svc-proxy", "POST /v1/chat/completions")]
    assert server.parentID == ""
    assert server.kind == 2  # SPAN_KIND_SERVER
    assert server.environment == "staging"
    assert server.attributes["http.request.method"] == "POST"
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 501
    assert server.attributes["svc.request_id"] == answer.headers["x-request-id"]
    assert server.statusCode == 2  # ERROR: 501 is 500 or above
    for method in ("ValidateToken", "ValidateAgent"):
        name = f"svc.auth.v1.AuthService/{method}"
        client = byName[("svc-proxy", name)]
        auth = byName[("svc-auth", name)]
        assert client.kind == 3 and client.parentID == server.spanID
        assert auth.kind == 2 and auth.parentID == client.spanID
        assert auth.environment == "staging"
        assert auth.attributes == {
            "rpc.system": "grpc",
            "rpc.service": "svc.auth.v1.AuthService",
            "rpc.method": method,
            "rpc.grpc.status_code": 0,
        }
    assert len(spans) == 5


def test_inboundTraceparentContinued(observed: ObservedRun) -> None:
    """
    An inbound traceparent's trace id is X-Trace-ID and the trace of both
    daemons' spans; the proxy span's parent is the inbound span.
    """
    answer = observed.answers["continued"]
    assert answer.headers["x-trace-id"] == INBOUND_TRACE
    spans = [span for span in observed.spans if span.traceID == INBOUND_TRACE]
    [server] = [span for span in spans if span.name == "POST /v1/chat/completions"]
    assert server.parentID == INBOUND_PARENT
    assert {span.service for span in spans} == {"svc-proxy", "svc-auth"}


def test_refusalsAreTracedWithoutErrorStatus(observed: ObservedRun) -> None:
    """
    A refused token's request is traced too: the proxy span says 401 and
    is not an error, svc-auth's ValidateToken span says UNAUTHENTICATED.
    """
    answer = observed.answers["wrongSecret"]
    spans = {
        (span.service, span.name): span
        for span in observed.spans
        if span.traceID == answer.headers["x-trace-id"]
    }
    server = spans[("svc-proxy", "POST /v1/chat/completions")]
    assert server.attributes["http.response.status_code"] == 401
    assert server.statusCode == 0
    auth = spans[("svc-auth", "svc.auth.v1.AuthService/ValidateToken")]
    assert auth.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert auth.statusCode == 0


def test_noSecretInAnySpan(observed: ObservedRun) -> None:
    """
    No span name or attribute holds a token, a token's secret or message
    content.
    """
    assert observed.spans
    text = repr([(span.name, span.attributes) for span in observed.spans])
    for secret in observed.secrets:
        assert secret not in text


def test_noSecretInAnyLogLine(observed: ObservedRun) -> None:
    """
    Everything both daemons wrote (at DEBUG) holds no raw token, no secret
    and no message content.
    """
    assert observed.proxyLog and observed.authLog
    for secret in observed.secrets:
        assert secret not in observed.proxyLog
        assert secret not in observed.authLog


def test_requestLinesCarryTheirIDs(observed: ObservedRun) -> None:
    """
    The proxy's lines of a chat request (the chat metadata line and the
    access line) carry its request_id and trace_id; the access line has
    the method, route template, status, duration and org_id. svc-auth logs
    one DEBUG line per gRPC call with the caller's trace_id.
    """
    answer = observed.answers["root"]
    requestID, traceID = answer.headers["x-request-id"], answer.headers["x-trace-id"]
    lines = [line for line in _jsonLines(observed.proxyLog) if line.get("request_id") == requestID]
    assert {line["trace_id"] for line in lines} == {traceID}
    [access] = [line for line in lines if line["message"] == "POST /v1/chat/completions 501"]
    assert access["route"] == "/v1/chat/completions"
    assert access["status"] == 501
    assert access["duration_ms"] >= 0
    assert access["org_id"]
    [metadata] = [line for line in lines if "message_count" in line]
    assert metadata["model"] == "demo"
    authLines = [line for line in _jsonLines(observed.authLog) if line.get("trace_id") == traceID]
    assert sorted(line["grpc_method"] for line in authLines) == [
        "svc.auth.v1.AuthService/ValidateAgent",
        "svc.auth.v1.AuthService/ValidateToken",
    ]
    assert all(line["level"] == "debug" for line in authLines)


def test_logsAreJSONLines(observed: ObservedRun) -> None:
    """
    Every line either daemon wrote is one JSON object with timestamp,
    level, the service's name, namespace and message.
    """
    for text, service in ((observed.proxyLog, "svc-proxy"), (observed.authLog, "svc-auth")):
        lines = _jsonLines(text)
        assert lines
        for line in lines:
            assert {"timestamp", "level", "namespace", "message"} <= set(line)
            assert line["service"] == service
