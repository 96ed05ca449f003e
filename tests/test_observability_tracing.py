"""
Tracing in process: the tracing settings, the proxy's server span (name,
attributes, status, X-Trace-ID, inbound traceparent, the unsampled path),
the trace context the auth client puts on its gRPC calls, svc-auth's
server interceptor, and the service that exports and flushes spans.

Every test builds its own TracerProvider with an in-memory exporter; none
touches OpenTelemetry's global provider.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from concurrent import futures
from typing import Any, cast

import grpc
import pytest
import pytest_twisted
from fakeauth import servingAuth
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased
from opentelemetry.trace import SpanKind, StatusCode
from proxydoubles import newToken
from tracinghelpers import Traced, chatHeaders, recordingProvider
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import ILogObserver, capturedLogs

from svcd.authclient.connection import AuthConnection
from svcd.common.config import ConfigError
from svcd.common.errors import ApiError, ErrorCode
from svcd.common.tracing import (
    ServerTracingInterceptor,
    TracingConfig,
    TracingService,
    activate,
    deactivate,
    parentFromMetadata,
    tracerProvider,
    unsampledParent,
)
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.validation.client import GrpcAuthClient

INBOUND_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
INBOUND_PARENT = "00f067aa0ba902b7"
CONTENT = "observability-tracing-secret-content-" + uuid.uuid4().hex
CHAT_BODY = json.dumps(
    {"model": "gpt-test", "messages": [{"role": "user", "content": CONTENT}]}
).encode()


def traceIDHeader(response: Any) -> str:
    [value] = response.headers.getRawHeaders("X-Trace-ID")
    return str(value.decode() if isinstance(value, bytes) else value)


# Settings


def test_settingsDefaults() -> None:
    """
    Without variables: ratio 0.01, no export, the daemon's own name, the
    development environment.
    """
    settings = TracingConfig.fromEnvironment({}, "svc-proxy")
    assert settings == TracingConfig("svc-proxy", "development", 0.01, None)


def test_settingsFallbacks() -> None:
    """
    OTEL_SERVICE_NAME wins over SVC_SERVICE_NAME, OTEL_DEPLOYMENT_ENVIRONMENT
    over SVC_ENV; each falls back to the other.
    """
    environ = {"SVC_SERVICE_NAME": "edge-7", "SVC_ENV": "staging"}
    assert TracingConfig.fromEnvironment(environ, "svc-proxy") == TracingConfig("edge-7", "staging")
    environ |= {
        "OTEL_SERVICE_NAME": "gateway-edge",
        "OTEL_DEPLOYMENT_ENVIRONMENT": "eu-prod",
        "OTEL_SAMPLE_RATIO": "0.25",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "collector.internal:4317",
    }
    assert TracingConfig.fromEnvironment(environ, "svc-proxy") == TracingConfig(
        "gateway-edge", "eu-prod", 0.25, "collector.internal:4317"
    )
    settings = TracingConfig.fromEnvironment(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317/"}, "svc-auth"
    )
    assert settings.endpoint == "127.0.0.1:4317"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_SAMPLE_RATIO", "1.5"),
        ("OTEL_SAMPLE_RATIO", "-0.1"),
        ("OTEL_SAMPLE_RATIO", "often"),
        ("OTEL_SAMPLE_RATIO", "nan"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4317"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:otlp"),
    ],
)
def test_settingsRefused(variable: str, value: str) -> None:
    """
    A ratio outside [0, 1] or an endpoint that is not host:port is a
    configuration error naming the variable.
    """
    with pytest.raises(ConfigError) as caught:
        TracingConfig.fromEnvironment({variable: value}, "svc-proxy")
    assert caught.value.variable == variable


def test_providerResourceAndSampler() -> None:
    """
    The provider names the service and its environment and samples
    ParentBased(TraceIdRatioBased(ratio)).
    """
    provider = tracerProvider(TracingConfig("svc-auth", "staging", 0.5))
    attributes = provider.resource.attributes
    assert attributes["service.name"] == "svc-auth"
    assert attributes["deployment.environment"] == "staging"
    sampler = provider.sampler
    assert isinstance(sampler, ParentBased)
    assert "TraceIdRatioBased{0.5}" in sampler.get_description()


# The proxy's server span


@pytest_twisted.ensureDeferred
async def test_chatSpan() -> None:
    """
    A chat request makes one server span "POST /v1/chat/completions" with
    the method, route and status attributes and the chat's metadata; its
    trace id is X-Trace-ID; no attribute holds the token or the content.
    Phase 1's answer, 501, is 500 or above: the span is ERROR (spec 8).
    """
    traced = Traced()
    token, orgID, agentID = traced.auth.addTenant()
    response = await traced.request(
        "POST", "/v1/chat/completions", chatHeaders(token, agentID), CHAT_BODY
    )
    assert response.code == 501
    [span] = traced.spans()
    assert span.name == "POST /v1/chat/completions"
    assert span.kind is SpanKind.SERVER
    assert span.parent is None
    attributes = dict(span.attributes or {})
    assert attributes["http.request.method"] == "POST"
    assert attributes["http.route"] == "/v1/chat/completions"
    assert attributes["http.response.status_code"] == 501
    assert attributes["svc.org_id"] == orgID
    assert attributes["gen_ai.request.model"] == "gpt-test"
    assert attributes["svc.chat.message_count"] == 1
    assert attributes["error.type"] == "501"
    assert span.status.status_code is StatusCode.ERROR
    assert traceIDHeader(response) == f"{span.context.trace_id:032x}"
    everything = repr(attributes)
    assert token not in everything and CONTENT not in everything


@pytest_twisted.ensureDeferred
async def test_routeTemplateNotPath() -> None:
    """
    The org-scoped probe is named by its template, never the path with the
    org id; an unknown path is "GET unmatched" without http.route.
    """
    traced = Traced()
    orgID = str(uuid.uuid4())
    await traced.request("GET", f"/v1/orgs/{orgID}/auth-probe")
    await traced.request("GET", "/v2/secret-looking/path")
    probe, unmatched = traced.spans()
    assert probe.name == "GET /v1/orgs/{org_id}/auth-probe"
    assert probe.attributes is not None
    assert probe.attributes["http.route"] == "/v1/orgs/{org_id}/auth-probe"
    assert orgID not in repr(dict(probe.attributes))
    assert unmatched.name == "GET unmatched"
    assert unmatched.attributes is not None
    assert "http.route" not in unmatched.attributes
    assert unmatched.attributes["http.response.status_code"] == 404
    assert "secret-looking" not in repr(dict(unmatched.attributes))


@pytest_twisted.ensureDeferred
async def test_inventedMethod() -> None:
    """
    A method outside HTTP's own is "_OTHER" on the span and "HTTP" in its
    name, so clients cannot mint span names.
    """
    traced = Traced()
    response = await traced.request("BREW", "/health")
    assert response.code == 405
    [span] = traced.spans()
    assert span.name == "HTTP /health"
    assert span.attributes is not None
    assert span.attributes["http.request.method"] == "_OTHER"


@pytest.mark.parametrize(
    ("failure", "status", "error"),
    [
        (ApiError(ErrorCode.SERVICE_DEGRADED), 503, True),
        (RuntimeError("boom"), 500, True),
        (ApiError(ErrorCode.INVALID_TOKEN), 401, False),
    ],
)
@pytest_twisted.ensureDeferred
async def test_errorStatus(failure: Exception, status: int, error: bool) -> None:
    """
    A span is ERROR for an answer of 500 and above (a 503 from auth, a 500
    from an unexpected fault), and not for a 4xx.
    """
    traced = Traced()
    token = newToken()
    traced.auth.tokens[token] = failure
    response = await traced.request(
        "GET", "/v1/internal/auth-probe", {"Authorization": "Bearer " + token}
    )
    assert response.code == status
    [span] = traced.spans()
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == status
    expected = StatusCode.ERROR if error else StatusCode.UNSET
    assert span.status.status_code is expected
    assert "boom" not in repr(span.to_json())


@pytest_twisted.ensureDeferred
async def test_inboundTraceparentContinued() -> None:
    """
    A valid inbound traceparent is the span's parent: same trace id (which
    is X-Trace-ID), the inbound span id as parent.
    """
    traced = Traced(ratio=0.0)
    traceparent = f"00-{INBOUND_TRACE}-{INBOUND_PARENT}-01"
    response = await traced.request("GET", "/health", {"traceparent": traceparent})
    assert traceIDHeader(response) == INBOUND_TRACE
    # Sampled by the caller: recorded although the ratio is 0 (parent-based).
    [span] = traced.spans()
    assert f"{span.context.trace_id:032x}" == INBOUND_TRACE
    assert span.parent is not None and span.parent.is_remote
    assert f"{span.parent.span_id:016x}" == INBOUND_PARENT


@pytest_twisted.ensureDeferred
async def test_unsampledStillHasTraceID() -> None:
    """
    With nothing sampled no span is exported, yet every answer carries a
    fresh 32-hex X-Trace-ID, and an unsampled inbound traceparent's trace
    id is continued all the same.
    """
    traced = Traced(ratio=0.0)
    seen = set()
    for _ in range(3):
        response = await traced.request("GET", "/health")
        traceID = traceIDHeader(response)
        assert re.fullmatch(r"[0-9a-f]{32}", traceID) and traceID != "0" * 32
        seen.add(traceID)
    assert len(seen) == 3
    response = await traced.request(
        "GET", "/health", {"traceparent": f"00-{INBOUND_TRACE}-{INBOUND_PARENT}-00"}
    )
    assert traceIDHeader(response) == INBOUND_TRACE
    assert traced.spans() == []


@pytest_twisted.ensureDeferred
async def test_unsampledBuildsNoAttributes(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    The unsampled path sets no attribute at all (the non-recording span
    would drop them; building them would be wasted work).
    """
    from opentelemetry.trace import NonRecordingSpan

    calls: list[str] = []
    monkeypatch.setattr(NonRecordingSpan, "set_attribute", lambda *a: calls.append("one"))
    monkeypatch.setattr(NonRecordingSpan, "set_attributes", lambda *a: calls.append("many"))
    monkeypatch.setattr(NonRecordingSpan, "set_status", lambda *a: calls.append("status"))
    traced = Traced(ratio=0.0)
    token, _, agentID = traced.auth.addTenant()
    response = await traced.request(
        "POST", "/v1/chat/completions", chatHeaders(token, agentID), CHAT_BODY
    )
    assert response.code == 501
    response = await traced.request("GET", "/v1/internal/auth-probe")
    assert response.code == 401
    assert calls == []


# The auth client's trace context


class RecordingAuthService(auth_pb2_grpc.AuthServiceServicer):
    """
    Answers OK and records each call's metadata.
    """

    def __init__(self) -> None:
        self.metadata: list[tuple[str, dict[str, str]]] = []

    def ValidateToken(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.metadata.append(("ValidateToken", dict(context.invocation_metadata())))
        return auth_pb2.ValidateTokenResponse(org_id=str(uuid.uuid4()), permissions=1)

    def ValidateAgent(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.metadata.append(("ValidateAgent", dict(context.invocation_metadata())))
        return auth_pb2.ValidateAgentResponse(
            agent_id=request.agent_id, org_id=request.org_id, status="active"
        )


@pytest.fixture
def recordingAuth() -> Iterator[tuple[RecordingAuthService, int]]:
    servicer = RecordingAuthService()
    with servingAuth(servicer) as port:
        yield servicer, port


def authClient(port: int, provider: TracerProvider | None) -> GrpcAuthClient:
    from twisted.internet import reactor

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=5)
    connection = AuthConnection(
        lambda: channel,
        IReactorFromThreads(reactor),
        reactor,
        tracer=provider.get_tracer("test") if provider is not None else None,
    )
    return GrpcAuthClient(connection, 2.0, ProxyMetrics())


@pytest.mark.parametrize("ratio", [1.0, 0.0])
@pytest_twisted.ensureDeferred
async def test_requestSpanReachesSvcAuth(
    recordingAuth: tuple[RecordingAuthService, int], ratio: float
) -> None:
    """
    Through the whole edge with the real gRPC client: both calls of a
    request carry its trace id, ValidateAgent too although it starts after
    ValidateToken's answer came back through callFromThread; sampled or
    not.
    """
    from opentelemetry import trace

    servicer, port = recordingAuth
    traced = Traced(ratio)
    client = authClient(port, traced.provider)
    traced.edge.caller._auth = client
    try:
        response = await traced.request(
            "GET", "/v1/internal/auth-probe", chatHeaders(newToken(), str(uuid.uuid4()))
        )
    finally:
        client.close()
    assert response.code == 200
    traceID = traceIDHeader(response)
    assert [method for method, _ in servicer.metadata] == ["ValidateToken", "ValidateAgent"]
    for _, metadata in servicer.metadata:
        version, callTrace, _, flags = metadata["traceparent"].split("-")
        assert (version, callTrace) == ("00", traceID)
        assert int(flags, 16) & 1 == (1 if ratio else 0)
    assert not trace.get_current_span().get_span_context().is_valid


@pytest_twisted.ensureDeferred
async def test_sampledCallsCarryClientSpans(
    recordingAuth: tuple[RecordingAuthService, int],
) -> None:
    """
    Inside a sampled span, ValidateToken and ValidateAgent each get a
    client span, child of the current span, whose context the call carries
    as traceparent (sampled flag set); the bearer still travels as
    authorization and nowhere in the spans.
    """
    servicer, port = recordingAuth
    provider, exporter = recordingProvider()
    client = authClient(port, provider)
    token = newToken()
    parent = provider.get_tracer("test").start_span("request", kind=SpanKind.SERVER)
    scope = activate(parent)
    try:
        info = await client.validateToken(token)
        await client.validateAgent(token, str(uuid.uuid4()), info.orgID)
    finally:
        deactivate(scope)
        parent.end()
        client.close()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    traceID = f"{parent.get_span_context().trace_id:032x}"
    for method, metadata in servicer.metadata:
        span = spans[f"svc.auth.v1.AuthService/{method}"]
        assert span.kind is SpanKind.CLIENT
        assert span.parent is not None
        assert span.parent.span_id == parent.get_span_context().span_id
        assert metadata["traceparent"] == (
            f"00-{traceID}-{span.context.span_id:016x}-{int(span.context.trace_flags):02x}"
        )
        assert span.context.trace_flags.sampled
        assert span.attributes is not None
        assert dict(span.attributes) == {
            "rpc.system": "grpc",
            "rpc.service": "svc.auth.v1.AuthService",
            "rpc.method": method,
            "rpc.grpc.status_code": 0,
        }
        assert token not in repr(span.to_json())
    assert servicer.metadata[1][1]["authorization"] == "Bearer " + token


@pytest_twisted.ensureDeferred
async def test_unsampledCallsCarryTheRequestsContext(
    recordingAuth: tuple[RecordingAuthService, int],
) -> None:
    """
    Inside an unsampled span no client span is made; the call carries the
    request span's own context with the unsampled flag, so svc-auth keeps
    the trace id and records nothing. Outside any span, no traceparent.
    """
    servicer, port = recordingAuth
    provider, exporter = recordingProvider(ratio=0.0)
    client = authClient(port, provider)
    parent = provider.get_tracer("test").start_span("request")
    assert not parent.is_recording()
    scope = activate(parent)
    try:
        await client.validateToken(newToken())
    finally:
        deactivate(scope)
    await client.validateToken(newToken())
    client.close()
    context = parent.get_span_context()
    assert servicer.metadata[0][1]["traceparent"] == (
        f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
    )
    assert not context.trace_flags.sampled
    assert "traceparent" not in servicer.metadata[1][1]
    assert exporter.get_finished_spans() == ()


# svc-auth's interceptor


class ScriptedService(auth_pb2_grpc.AuthServiceServicer):
    """
    ValidateToken answers OK for "ok", INTERNAL for "fail", UNAUTHENTICATED
    otherwise; logs a line so the test sees the call's trace_id.
    """

    def __init__(self) -> None:
        self.traceIDs: list[str] = []

    def ValidateToken(self, request: Any, context: grpc.ServicerContext) -> Any:
        from opentelemetry import trace

        self.traceIDs.append(f"{trace.get_current_span().get_span_context().trace_id:032x}")
        if request.access_token == "ok":
            return auth_pb2.ValidateTokenResponse(org_id=str(uuid.uuid4()))
        if request.access_token == "fail":
            context.abort(grpc.StatusCode.INTERNAL, "database down")
        if request.access_token == "raise":
            raise RuntimeError("unexpected")
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid token")


@pytest.fixture
def intercepted() -> Iterator[tuple[ScriptedService, Any, InMemorySpanExporter]]:
    provider, exporter = recordingProvider(ratio=1.0)
    servicer = ScriptedService()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=[ServerTracingInterceptor(provider.get_tracer("test"), logCalls=True)],
    )
    auth_pb2_grpc.add_AuthServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, auth_pb2_grpc.AuthServiceStub(channel), exporter
    finally:
        channel.close()
        server.stop(0)


def test_serverSpanPerCall(intercepted: tuple[ScriptedService, Any, InMemorySpanExporter]) -> None:
    """
    Each call gets a server span "svc.auth.v1.AuthService/ValidateToken"
    with rpc.system, rpc.service, rpc.method and the status code; ERROR
    only for the server's faults (INTERNAL, UNKNOWN), not for
    UNAUTHENTICATED. The span is current while the method runs.
    """
    servicer, stub, exporter = intercepted
    stub.ValidateToken(auth_pb2.ValidateTokenRequest(access_token="ok"))
    for token, code in (
        ("nope", grpc.StatusCode.UNAUTHENTICATED),
        ("fail", grpc.StatusCode.INTERNAL),
        ("raise", grpc.StatusCode.UNKNOWN),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            stub.ValidateToken(auth_pb2.ValidateTokenRequest(access_token=token))
        assert caught.value.code() == code
    spans = exporter.get_finished_spans()
    assert [span.name for span in spans] == ["svc.auth.v1.AuthService/ValidateToken"] * 4
    for span, code, status in zip(
        spans,
        (0, 16, 13, 2),
        (StatusCode.UNSET, StatusCode.UNSET, StatusCode.ERROR, StatusCode.ERROR),
        strict=True,
    ):
        assert span.kind is SpanKind.SERVER
        assert dict(span.attributes or {}) == {
            "rpc.system": "grpc",
            "rpc.service": "svc.auth.v1.AuthService",
            "rpc.method": "ValidateToken",
            "rpc.grpc.status_code": code,
        }
        assert span.status.status_code is status
        assert span.events == ()
    assert servicer.traceIDs == [f"{span.context.trace_id:032x}" for span in spans]


def test_serverSpanJoinsCallersTrace(
    intercepted: tuple[ScriptedService, Any, InMemorySpanExporter],
) -> None:
    """
    A traceparent in the call's metadata makes the server span its child;
    an unsampled one records nothing (parent-based sampling).
    """
    _, stub, exporter = intercepted
    request = auth_pb2.ValidateTokenRequest(access_token="ok")
    stub.ValidateToken(
        request, metadata=(("traceparent", f"00-{INBOUND_TRACE}-{INBOUND_PARENT}-01"),)
    )
    [span] = exporter.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == INBOUND_TRACE
    assert span.parent is not None and f"{span.parent.span_id:016x}" == INBOUND_PARENT
    stub.ValidateToken(
        request, metadata=(("traceparent", f"00-{INBOUND_TRACE}-{INBOUND_PARENT}-00"),)
    )
    assert len(exporter.get_finished_spans()) == 1


def test_unsampledCallerKeepsItsTraceCurrent(
    intercepted: tuple[ScriptedService, Any, InMemorySpanExporter],
) -> None:
    """
    Under an unsampled caller (the fast path that skips the SDK) the
    method runs with the caller's trace id current, and nothing is
    recorded; with a tracestate as well (the SDK's path) the same holds.
    """
    servicer, stub, exporter = intercepted
    request = auth_pb2.ValidateTokenRequest(access_token="ok")
    unsampled = ("traceparent", f"00-{INBOUND_TRACE}-{INBOUND_PARENT}-00")
    stub.ValidateToken(request, metadata=(unsampled,))
    stub.ValidateToken(request, metadata=(unsampled, ("tracestate", "vendor=1")))
    assert servicer.traceIDs == [INBOUND_TRACE, INBOUND_TRACE]
    assert exporter.get_finished_spans() == ()


_HEX = "0123456789abcdef"


@given(
    version=st.sampled_from(["00", "00", "00", "01", "ff"]),
    traceID=st.text(_HEX, min_size=32, max_size=32)
    | st.sampled_from(["0" * 32, "A" * 32, "a" * 31, "a" * 33]),
    spanID=st.text(_HEX, min_size=16, max_size=16)
    | st.sampled_from(["0" * 16, "B" * 16, "b" * 15]),
    flags=st.sampled_from(["00", "02", "01", "03", "0x"]),
    tracestate=st.booleans(),
)
def test_unsampledParentAgreesWithThePropagator(
    version: str, traceID: str, spanID: str, flags: str, tracestate: bool
) -> None:
    """
    Whenever L{unsampledParent} takes a traceparent, OpenTelemetry's W3C
    propagator reads the same trace, parent and flags from it, unsampled;
    and it takes every lower-case version 00 value without tracestate that
    the propagator reads as a valid unsampled parent.
    """
    from opentelemetry import trace

    value = f"{version}-{traceID}-{spanID}-{flags}"
    metadata = [("traceparent", value)] + ([("tracestate", "a=b")] if tracestate else [])
    fast = unsampledParent(metadata)
    reference = trace.get_current_span(parentFromMetadata(metadata)).get_span_context()
    if fast is None:
        assert (
            tracestate or version != "00" or not reference.is_valid or reference.trace_flags.sampled
        )
        return
    assert not tracestate
    assert reference.is_valid and not reference.trace_flags.sampled
    assert (fast.trace_id, fast.span_id, fast.trace_flags) == (
        reference.trace_id,
        reference.span_id,
        reference.trace_flags,
    )


def test_unsampledParentTakesTheCommonCase() -> None:
    """
    What svc-proxy sends for an unsampled request is taken; a sampled one
    is not.
    """
    taken = unsampledParent([("traceparent", f"00-{INBOUND_TRACE}-{INBOUND_PARENT}-00")])
    assert taken is not None and f"{taken.trace_id:032x}" == INBOUND_TRACE
    assert unsampledParent([("traceparent", f"00-{INBOUND_TRACE}-{INBOUND_PARENT}-01")]) is None
    assert unsampledParent([]) is None


def test_callLogLine(intercepted: tuple[ScriptedService, Any, InMemorySpanExporter]) -> None:
    """
    With logCalls, each call logs one DEBUG line naming the method and
    status, with the call's trace_id in context and nothing of the request.
    """
    from svcd.common.logs import eventFields

    _, stub, exporter = intercepted
    lines: list[dict[str, object]] = []
    done = threading.Event()

    def observe(event: Any) -> None:
        if event.get("grpc_method"):
            lines.append(eventFields(event))
            done.set()

    from twisted.logger import globalLogPublisher

    globalLogPublisher.addObserver(cast(ILogObserver, observe))
    try:
        with pytest.raises(grpc.RpcError):
            stub.ValidateToken(auth_pb2.ValidateTokenRequest(access_token="svc_pat_secret"))
        assert done.wait(5)
    finally:
        globalLogPublisher.removeObserver(cast(ILogObserver, observe))
    [line] = lines
    [span] = exporter.get_finished_spans()
    assert line["grpc_method"] == "svc.auth.v1.AuthService/ValidateToken"
    assert line["grpc_status"] == "UNAUTHENTICATED"
    assert line["trace_id"] == f"{span.context.trace_id:032x}"
    assert "svc_pat_secret" not in repr(line)


def test_interceptorQuietAtInfo() -> None:
    """
    Without logCalls (the level is above DEBUG), a call logs nothing.
    """
    provider, _ = recordingProvider(ratio=0.0)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        interceptors=[ServerTracingInterceptor(provider.get_tracer("test"))],
    )
    auth_pb2_grpc.add_AuthServiceServicer_to_server(ScriptedService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = auth_pb2_grpc.AuthServiceStub(channel)
            with capturedLogs() as events:
                stub.ValidateToken(auth_pb2.ValidateTokenRequest(access_token="ok"))
        assert [event for event in events if "grpc_method" in event] == []
    finally:
        server.stop(0)


# The exporting service


class RecordingProcessor(SpanProcessor):
    def __init__(self) -> None:
        self.ended: list[str] = []
        self.flushed = False
        self.shut = False

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.append(span.name)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.flushed = True
        return True

    def shutdown(self) -> None:
        self.shut = True


@pytest_twisted.ensureDeferred
async def test_serviceExportsOnlyWhenConfigured() -> None:
    """
    The processor is made at start (after twistd's fork), only with an
    endpoint; stopping flushes it and shuts the provider down.
    """
    from twisted.internet import reactor

    made: list[str] = []
    processor = RecordingProcessor()

    def factory(endpoint: str) -> SpanProcessor:
        made.append(endpoint)
        return processor

    settings = TracingConfig("svc-test", "development", 1.0, "127.0.0.1:4317")
    provider = tracerProvider(settings)
    service = TracingService(
        IReactorFromThreads(reactor), reactor, provider, settings, processorFactory=factory
    )
    assert made == []
    service.startService()
    assert made == ["127.0.0.1:4317"]
    provider.get_tracer("test").start_span("work").end()
    await service.stopService()
    assert (processor.ended, processor.flushed, processor.shut) == (["work"], True, True)

    quiet = TracingConfig("svc-test", "development")
    service = TracingService(
        IReactorFromThreads(reactor),
        reactor,
        tracerProvider(quiet),
        quiet,
        processorFactory=factory,
    )
    service.startService()
    await service.stopService()
    assert made == ["127.0.0.1:4317"]


def test_ratioSamplesRoughlyThatShare() -> None:
    """
    The default ratio records about 1 % of root spans.
    """
    provider = tracerProvider(TracingConfig("svc-test", "development"))
    tracer = provider.get_tracer("test")
    recorded = sum(tracer.start_span("x").is_recording() for _ in range(20_000))
    assert 100 <= recorded <= 320


class StuckProcessor(RecordingProcessor):
    """
    A processor whose flush blocks, as the OTLP exporter's does while its
    collector is unreachable.
    """

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.release.wait(30)
        return True


@pytest_twisted.ensureDeferred
async def test_stopDoesNotWaitForAStuckCollector() -> None:
    """
    A flush that does not finish within the flush timeout does not hold
    the stop: it gives up with a warning, and the reactor kept turning.
    """
    import time

    from twisted.internet import reactor

    processor = StuckProcessor()
    settings = TracingConfig("svc-test", "development", 1.0, "127.0.0.1:1")
    service = TracingService(
        IReactorFromThreads(reactor),
        reactor,
        tracerProvider(settings),
        settings,
        processorFactory=lambda endpoint: processor,
        flushTimeout=0.2,
    )
    service.startService()
    started = time.monotonic()
    try:
        with capturedLogs() as events:
            await service.stopService()
    finally:
        processor.release.set()
    assert time.monotonic() - started < 2
    assert any("not exported within" in str(event.get("log_format")) for event in events)


@pytest_twisted.ensureDeferred
async def test_disabledSDKStillGivesTraceIDs(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    With OTEL_SDK_DISABLED=true the SDK hands out invalid spans; X-Trace-ID
    is then still a fresh random id, or the inbound traceparent's.
    """
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    traced = Traced()
    first = traceIDHeader(await traced.request("GET", "/health"))
    second = traceIDHeader(await traced.request("GET", "/health"))
    assert re.fullmatch(r"[0-9a-f]{32}", first) and first != second and first != "0" * 32
    response = await traced.request(
        "GET", "/health", {"traceparent": f"00-{INBOUND_TRACE}-{INBOUND_PARENT}-01"}
    )
    assert traceIDHeader(response) == INBOUND_TRACE
    assert traced.spans() == []


def test_untracedDefaultKeepsIDsRecordsNothing() -> None:
    """
    The edge's default provider records nothing, even for a caller's
    sampled traceparent, yet continues its trace id.
    """
    from twisted.web.http_headers import Headers

    from svcd.common.tracing import parentFromHeaders, untracedProvider

    headers = Headers({b"traceparent": [f"00-{INBOUND_TRACE}-{INBOUND_PARENT}-01".encode()]})
    tracer = untracedProvider().get_tracer("test")
    span = tracer.start_span("x", parentFromHeaders(headers))
    assert not span.is_recording()
    assert f"{span.get_span_context().trace_id:032x}" == INBOUND_TRACE
    root = tracer.start_span("y")
    assert not root.is_recording() and root.get_span_context().is_valid
