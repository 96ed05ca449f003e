"""
OpenTelemetry tracing for both daemons: settings from the environment, a
TracerProvider per daemon, a twistd service that exports spans over OTLP
gRPC and flushes them at stop, W3C trace-context helpers, and the gRPC
server interceptor that gives svc-auth a span per call.

Each daemon builds its own L{TracerProvider} and hands it (or its tracer)
to what needs it; nothing here touches OpenTelemetry's global provider, so
tests can run several daemons' worth of tracing in one process. The
I{context} (which span is current) is OpenTelemetry's usual contextvars
context: the proxy attaches its server span inside the request's coroutine,
which Twisted runs in a context of its own, and the auth client reads it
there to put a C{traceparent} on its gRPC calls.

Sampling is decided once, at the root: C{ParentBased(TraceIdRatioBased(r))}
with r from OTEL_SAMPLE_RATIO (default 0.01). An unsampled span is a
non-recording span that still has a trace id (the SDK makes one, or keeps
the inbound one), which is what X-Trace-ID shows; callers check
C{span.is_recording()} before building attributes, so the 99 % of requests
that are not sampled pay for ids and no more.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import grpc
from opentelemetry import context as otelcontext
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import (
    INVALID_SPAN_ID,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from twisted.application.service import Service
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

from svcd.common import config
from svcd.common.clocks import Clock, asReactorTime
from svcd.common.config import ConfigError
from svcd.common.deferreds import timeoutDeferred

DEFAULT_SAMPLE_RATIO = 0.01
# Seconds between two exports of the meter's metrics (OpenTelemetry's
# default for OTEL_METRIC_EXPORT_INTERVAL, 60000 ms).
DEFAULT_METRIC_INTERVAL = 60.0
# How long a stop waits for the last spans to reach the collector.
FLUSH_TIMEOUT = 3.0

# Resource attribute of the deployment environment (as the issue and most
# backends still spell it).
DEPLOYMENT_ENVIRONMENT = "deployment.environment"

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_PROPAGATOR = TraceContextTextMapPropagator()
# The parent of a span that must be a root: an empty context, passed
# explicitly so the SDK does not look up (or pick up) a current span.
ROOT_CONTEXT = Context()

# gRPC status codes that are the server's fault (OpenTelemetry's gRPC
# conventions); the rest (UNAUTHENTICATED, PERMISSION_DENIED, ...) are
# answers, not errors, on a server span.
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
_ERROR = Status(StatusCode.ERROR)


@attrs.frozen
class TracingConfig:
    """
    The tracing settings of one daemon.

    @ivar endpoint: C{host:port} of an OTLP gRPC collector (plaintext), or
        None to export nothing.
    @ivar metricInterval: seconds between two exports of the meter's
        metrics (L{svcd.common.meters}).
    @ivar exportMetrics: whether the meter's metrics go to C{endpoint} too
        (they never go anywhere without one).
    """

    serviceName: str
    environment: str
    sampleRatio: float = DEFAULT_SAMPLE_RATIO
    endpoint: str | None = None
    metricInterval: float = DEFAULT_METRIC_INTERVAL
    exportMetrics: bool = True

    @classmethod
    def fromEnvironment(cls, environ: Mapping[str, str], defaultServiceName: str) -> TracingConfig:
        """
        OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SAMPLE_RATIO, OTEL_SERVICE_NAME
        (else SVC_SERVICE_NAME, else C{defaultServiceName}) and
        OTEL_DEPLOYMENT_ENVIRONMENT (else SVC_ENV, else development);
        for the meter, OTEL_METRIC_EXPORT_INTERVAL (milliseconds, default
        60000) and OTEL_METRICS_EXPORTER (C{otlp}, the default, or
        C{none}).

        @raise ConfigError: for a ratio outside [0, 1], an endpoint that
            is not C{host:port}, an interval that is not a whole number of
            milliseconds from 1 to 86400000, or another exporter.
        """
        return cls(
            serviceName=(
                config.text(environ, "OTEL_SERVICE_NAME", "")
                or config.text(environ, "SVC_SERVICE_NAME", "")
                or defaultServiceName
            ),
            environment=(
                config.text(environ, "OTEL_DEPLOYMENT_ENVIRONMENT", "")
                or config.text(environ, "SVC_ENV", "")
                or "development"
            ),
            sampleRatio=_ratio(environ, "OTEL_SAMPLE_RATIO", DEFAULT_SAMPLE_RATIO),
            endpoint=_endpoint(environ, "OTEL_EXPORTER_OTLP_ENDPOINT"),
            metricInterval=_milliseconds(
                environ, "OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_METRIC_INTERVAL
            ),
            exportMetrics=_metricsExporter(environ, "OTEL_METRICS_EXPORTER"),
        )


def _milliseconds(environ: Mapping[str, str], name: str, default: float) -> float:
    """
    A whole number of milliseconds (as OpenTelemetry's variables give
    them), in seconds.
    """
    raw = config.text(environ, name, "")
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= 86_400_000):
        raise ConfigError(name, f"must be milliseconds from 1 to 86400000, got {raw!r}")
    return int(raw) / 1000


def _metricsExporter(environ: Mapping[str, str], name: str) -> bool:
    raw = config.text(environ, name, "").lower()
    if raw in ("", "otlp"):
        return True
    if raw == "none":
        return False
    raise ConfigError(name, f"must be otlp or none, got {raw!r}")


def _ratio(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        ratio = float(raw)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(name, f"must be a number from 0 to 1, got {raw!r}")
    return ratio


def _endpoint(environ: Mapping[str, str], name: str) -> str | None:
    """
    C{host:port}; an C{http://} prefix (as other OpenTelemetry tools write
    it) is accepted and dropped. The link is plaintext: the collector is
    expected on the host or the private network.
    """
    raw = config.text(environ, name, "")
    if not raw:
        return None
    address = raw.removeprefix("http://").rstrip("/")
    host, colon, port = address.rpartition(":")
    if not colon or not host or "/" in address or not (port.isascii() and port.isdigit()):
        raise ConfigError(name, f"must be host:port of an OTLP gRPC collector, got {raw!r}")
    return address


def tracerProvider(settings: TracingConfig) -> TracerProvider:
    """
    A daemon's provider: parent-based ratio sampling, and the resource
    naming the service and its environment. Span processors (the exporter)
    are added by L{TracingService} once the daemon runs.
    """
    return TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(settings.sampleRatio)),
        resource=resourceOf(settings),
        # TracingService shuts it down in order; an atexit hook per
        # provider would also pile up in a test process.
        shutdown_on_exit=False,
    )


def resourceOf(settings: TracingConfig) -> Resource:
    """
    The resource of a daemon's spans and metrics: its service and
    environment.
    """
    return Resource.create(
        {"service.name": settings.serviceName, DEPLOYMENT_ENVIRONMENT: settings.environment}
    )


def untracedProvider() -> TracerProvider:
    """
    A provider that records nothing, whatever the caller's sampled flag,
    and exports nothing, but still makes (or continues) trace ids: the
    default where no tracing is configured, as in unit tests.
    """
    return TracerProvider(sampler=ALWAYS_OFF, shutdown_on_exit=False)


def otlpProcessor(endpoint: str) -> SpanProcessor:
    """
    Batch export to the OTLP gRPC collector at C{endpoint}.
    """
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    exporter: SpanExporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    return BatchSpanProcessor(exporter)


class TracingService(Service):
    """
    Owns a daemon's L{TracerProvider} while it runs.

    The exporter is made at start, not when the service tree is built:
    twistd builds the tree before it forks to daemonise, and neither the
    batch processor's thread nor the exporter's gRPC channel survives a
    fork. Stopping flushes what is queued and shuts the provider down; put
    this service where it stops last, after the requests whose spans it
    exports.

    The flush blocks on the exporter (whose own timeout is 10 s, and whose
    force_flush ignores any timeout), so it runs in a daemon thread of its
    own, not the reactor's pool (which twistd joins at exit), and the stop
    waits for it at most C{flushTimeout} seconds: a collector that is down
    costs spans, not a stuck shutdown.
    """

    log = Logger()

    def __init__(
        self,
        reactor: IReactorFromThreads,
        clock: Clock,
        provider: TracerProvider,
        settings: TracingConfig,
        processorFactory: Callable[[str], SpanProcessor] = otlpProcessor,
        flushTimeout: float = FLUSH_TIMEOUT,
    ) -> None:
        self._reactor = reactor
        self._clock = clock
        self.provider = provider
        self._settings = settings
        self._processorFactory = processorFactory
        self._flushTimeout = flushTimeout

    def startService(self) -> None:
        super().startService()
        endpoint = self._settings.endpoint
        if endpoint is not None:
            self.provider.add_span_processor(self._processorFactory(endpoint))
        self.log.info(
            "Tracing as {service_name}: sample ratio {sample_ratio}, export to {otlp_endpoint}",
            service_name=self._settings.serviceName,
            sample_ratio=self._settings.sampleRatio,
            otlp_endpoint=endpoint or "nowhere",
        )

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        def shutdownProvider() -> None:
            self.provider.force_flush()
            self.provider.shutdown()

        flushed = await flushInThread(
            self._reactor, self._clock, shutdownProvider, self._flushTimeout, "svc-span-flush"
        )
        if not flushed:
            self.log.warn(
                "Spans not exported within {timeout} s of the stop; dropping them",
                timeout=self._flushTimeout,
            )


async def flushInThread(
    reactor: IReactorFromThreads,
    clock: Clock,
    flush: Callable[[], None],
    limit: float,
    threadName: str,
) -> bool:
    """
    Run C{flush} (an exporter's blocking flush and shutdown) in a daemon
    thread of its own and wait for it at most C{limit} seconds; False
    when it did not end in time (it is left to end, or not, by itself).
    """
    done: Deferred[None] = Deferred()

    def run() -> None:
        try:
            flush()
        finally:
            reactor.callFromThread(done.callback, None)

    threading.Thread(target=run, name=threadName, daemon=True).start()
    try:
        await timeoutDeferred(done, limit, asReactorTime(clock))
    except TimeoutError:
        return False
    return True


def traceIDOf(span: Span) -> str | None:
    """
    The 32-hex trace id of C{span}, or None when it has no valid context
    (a disabled SDK hands out such spans).
    """
    spanContext = span.get_span_context()
    if not spanContext.is_valid:
        return None
    return format(spanContext.trace_id, "032x")


def traceparentOf(spanContext: SpanContext) -> str:
    """
    The W3C C{traceparent} value naming C{spanContext} as the parent.
    """
    return (
        f"00-{spanContext.trace_id:032x}-{spanContext.span_id:016x}-"
        f"{int(spanContext.trace_flags) & 0xFF:02x}"
    )


def traceMetadata(spanContext: SpanContext) -> tuple[tuple[str, str], ...]:
    """
    The gRPC metadata entries that carry C{spanContext} to the callee:
    C{traceparent}, and C{tracestate} when there is one.
    """
    entries: tuple[tuple[str, str], ...] = ((TRACEPARENT, traceparentOf(spanContext)),)
    if spanContext.trace_state:
        entries += ((TRACESTATE, spanContext.trace_state.to_header()),)
    return entries


class _HeadersGetter(Getter[Any]):
    """
    Reads trace-context headers from Twisted's L{Headers}.
    """

    def get(self, carrier: Any, key: str) -> list[str] | None:
        values = carrier.getRawHeaders(key.encode("ascii"))
        if not values:
            return None
        return [value.decode("latin-1") for value in values]

    def keys(self, carrier: Any) -> list[str]:
        return [name.decode("latin-1") for name, _ in carrier.getAllRawHeaders()]


class _MetadataGetter(Getter[Sequence[tuple[str, str]]]):
    """
    Reads trace-context entries from gRPC invocation metadata.
    """

    def get(self, carrier: Sequence[tuple[str, str]], key: str) -> list[str] | None:
        values = [str(value) for name, value in carrier if name == key]
        return values or None

    def keys(self, carrier: Sequence[tuple[str, str]]) -> list[str]:
        return [name for name, _ in carrier]


_HEADERS_GETTER = _HeadersGetter()
_METADATA_GETTER = _MetadataGetter()


def parentFromHeaders(headers: Any) -> Context:
    """
    The parent context a W3C C{traceparent} (and C{tracestate}) request
    header names, or L{ROOT_CONTEXT} when there is none or it is invalid.

    @param headers: a L{twisted.web.http_headers.Headers}.
    """
    if not headers.hasHeader(b"traceparent"):
        return ROOT_CONTEXT
    return _PROPAGATOR.extract(headers, ROOT_CONTEXT, _HEADERS_GETTER)


def parentFromMetadata(metadata: Sequence[tuple[str, str]]) -> Context:
    """
    The parent context of a gRPC call's C{traceparent} metadata entry, or
    L{ROOT_CONTEXT}.
    """
    for name, _ in metadata:
        if name == TRACEPARENT:
            return _PROPAGATOR.extract(metadata, ROOT_CONTEXT, _METADATA_GETTER)
    return ROOT_CONTEXT


# A version 00 traceparent exactly as W3C Trace Context writes it; anything
# else (other versions, upper case) is left to OpenTelemetry's propagator.
_TRACEPARENT_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def unsampledParent(metadata: Sequence[tuple[str, str]]) -> SpanContext | None:
    """
    The caller's span context when the call's C{traceparent} metadata is a
    valid version 00 value whose sampled flag is off and no C{tracestate}
    comes with it; else None.

    Such a parent is what 99 % of calls carry at the default sample ratio,
    and every sampler of this module follows it: the span is non-recording
    whatever else happens. L{ServerTracingInterceptor} then makes that span
    itself, for a few microseconds instead of the propagator's and the
    SDK's tens (measured: a tenth to a fifth of svc-auth's CPU per call
    under load went to tracing calls nobody records, depending on the run).
    """
    traceparent = None
    for name, value in metadata:
        if name == TRACEPARENT:
            if traceparent is not None:
                return None  # two of them: the propagator's problem
            traceparent = value
        elif name == TRACESTATE:
            return None
    if traceparent is None:
        return None
    match = _TRACEPARENT_00.fullmatch(traceparent)
    if match is None:
        return None
    flags = TraceFlags(int(match[3], 16))
    if flags.sampled:
        return None
    traceID, spanID = int(match[1], 16), int(match[2], 16)
    if not traceID or not spanID:
        return None
    return SpanContext(traceID, spanID, is_remote=True, trace_flags=flags)


def _childOfUnsampled(parent: SpanContext) -> NonRecordingSpan:
    """
    The span OpenTelemetry's SDK makes under an unsampled parent with a
    parent-based (or always-off) sampler: same trace, a new span id, not
    recording.
    """
    spanID = random.getrandbits(64)
    while spanID == INVALID_SPAN_ID:
        spanID = random.getrandbits(64)
    return NonRecordingSpan(
        SpanContext(parent.trace_id, spanID, is_remote=False, trace_flags=parent.trace_flags)
    )


def activate(span: Span, parent: Context = ROOT_CONTEXT) -> object:
    """
    Make C{span} the current span; returns the token for L{deactivate}.
    """
    return otelcontext.attach(trace.set_span_in_context(span, parent))


def deactivate(token: object) -> None:
    """
    Undo L{activate}, in the same contextvars context.
    """
    otelcontext.detach(token)  # type: ignore[arg-type]


def currentSpanContext() -> SpanContext:
    """
    The context of the current span (invalid when none is active).
    """
    return trace.get_current_span().get_span_context()


@attrs.frozen
class _TracedMethod:
    """
    A unary-unary gRPC behaviour wrapped in a server span; made once per
    method and reused.
    """

    interceptor: ServerTracingInterceptor
    inner: Callable[[Any, grpc.ServicerContext], Any]
    name: str
    service: str
    method: str

    def __call__(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.interceptor.runTraced(self, request, context)


class ServerTracingInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """
    A server span per unary gRPC call, continuing the caller's trace from
    its C{traceparent} metadata: named C{<service>/<method>}, with
    C{rpc.system}, C{rpc.service}, C{rpc.method} and
    C{rpc.grpc.status_code}; ERROR for the status codes that are the
    server's fault. The span is current while the method runs, so log lines
    of the call carry its trace_id.

    Streaming methods (server reflection, health Watch) pass through
    untraced. A call whose parent is not sampled gets its non-recording
    span without the SDK (L{unsampledParent}): the tracer's sampler must
    follow such a parent, as the parent-based and always-off samplers of
    this module's providers do.

    @param logCalls: also log one DEBUG line per call (method, status,
        duration, trace_id). Decided once, from the configured level, so
        that at INFO a call pays nothing for it.
    """

    log = Logger()

    def __init__(self, tracer: Tracer, logCalls: bool = False) -> None:
        self._tracer = tracer
        self._logCalls = logCalls
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        method: str = details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        service, _, name = method.lstrip("/").rpartition("/")
        traced = _TracedMethod(self, handler.unary_unary, method.lstrip("/"), service, name)
        wrapped = grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def runTraced(self, traced: _TracedMethod, request: Any, context: grpc.ServicerContext) -> Any:
        metadata = context.invocation_metadata()
        unsampled = unsampledParent(metadata)
        span: Span
        if unsampled is not None:
            parent = ROOT_CONTEXT
            span = _childOfUnsampled(unsampled)
        else:
            parent = parentFromMetadata(metadata)
            span = self._tracer.start_span(
                traced.name, parent, kind=SpanKind.SERVER, record_exception=False
            )
        if span.is_recording():
            span.set_attributes(
                {"rpc.system": "grpc", "rpc.service": traced.service, "rpc.method": traced.method}
            )
        token = activate(span, parent)
        started = time.perf_counter() if self._logCalls else 0.0
        raised = False
        try:
            return traced.inner(request, context)
        except BaseException:
            raised = True
            raise
        finally:
            code = _codeOf(context, raised)
            if span.is_recording():
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code in _SERVER_ERROR_CODES:
                    span.set_status(_ERROR)
            if self._logCalls:
                self.log.debug(
                    "gRPC {grpc_method} {grpc_status}",
                    grpc_method=traced.name,
                    grpc_status=code.name,
                    duration_ms=round((time.perf_counter() - started) * 1000, 3),
                )
            deactivate(token)
            span.end()


def _codeOf(context: grpc.ServicerContext, raised: bool) -> grpc.StatusCode:
    """
    The status a call ends with: what the method set (C{abort} sets it
    before raising), else OK, or UNKNOWN for an exception grpcio will turn
    into UNKNOWN.
    """
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return grpc.StatusCode.UNKNOWN if raised else grpc.StatusCode.OK
