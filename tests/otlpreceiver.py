"""
An OTLP gRPC receiver in the test process: a real grpcio server
implementing OpenTelemetry's collector services, TraceService and
MetricsService Export, keeping the spans and the histogram points it is
sent, for tests of daemons that export to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any, TypeVar

import attrs
import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

T = TypeVar("T")


def _value(any: Any) -> Any:
    kind = any.WhichOneof("value")
    return getattr(any, kind) if kind else None


def _attributes(keyValues: Any) -> dict[str, Any]:
    return {each.key: _value(each.value) for each in keyValues}


@attrs.frozen
class ReceivedSpan:
    service: str
    scope: str
    traceID: str
    spanID: str
    parentID: str
    name: str
    kind: int
    attributes: dict[str, Any]
    statusCode: int


@attrs.frozen
class HistogramPoint:
    """
    One point of a histogram as last exported (cumulative: its totals
    since the daemon started).
    """

    service: str
    name: str
    unit: str
    attributes: dict[str, Any]
    count: int
    sum: float
    bounds: tuple[float, ...]
    temporality: int


class Receiver(
    trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    """
    Keeps every span, and the latest point of each histogram series (by
    service, name and attributes).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._points: dict[tuple[str, str, frozenset[tuple[str, Any]]], HistogramPoint] = {}
        self.metricExports = 0

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        # Both services' method is called Export: told apart by the request.
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            self._metrics(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()
        self._traces(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def _traces(self, request: Any) -> None:
        received = []
        for resourceSpans in request.resource_spans:
            resource = _attributes(resourceSpans.resource.attributes)
            for scopeSpans in resourceSpans.scope_spans:
                for span in scopeSpans.spans:
                    received.append(
                        ReceivedSpan(
                            service=resource.get("service.name", ""),
                            scope=scopeSpans.scope.name,
                            traceID=span.trace_id.hex(),
                            spanID=span.span_id.hex(),
                            parentID=span.parent_span_id.hex(),
                            name=span.name,
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            statusCode=span.status.code,
                        )
                    )
        with self._lock:
            self._spans.extend(received)

    def _metrics(self, request: Any) -> None:
        points = []
        for resourceMetrics in request.resource_metrics:
            service = _attributes(resourceMetrics.resource.attributes).get("service.name", "")
            for scopeMetrics in resourceMetrics.scope_metrics:
                for metric in scopeMetrics.metrics:
                    if metric.WhichOneof("data") != "histogram":
                        continue
                    for point in metric.histogram.data_points:
                        points.append(
                            HistogramPoint(
                                service=service,
                                name=metric.name,
                                unit=metric.unit,
                                attributes=_attributes(point.attributes),
                                count=point.count,
                                sum=point.sum,
                                bounds=tuple(point.explicit_bounds),
                                temporality=metric.histogram.aggregation_temporality,
                            )
                        )
        with self._lock:
            self.metricExports += 1
            for point in points:
                key = (point.service, point.name, frozenset(point.attributes.items()))
                self._points[key] = point

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def points(self, name: str) -> list[HistogramPoint]:
        with self._lock:
            return [each for each in self._points.values() if each.name == name]


def waitUntil(find: Callable[[], T | None], limit: float, what: str) -> T:
    """
    What C{find} returns once it is not None (or an empty list), tried
    every 20 ms for at most C{limit} seconds.
    """
    deadline = time.monotonic() + limit
    while True:
        found = find()
        if found:
            return found
        assert time.monotonic() < deadline, f"no {what} within {limit} s"
        time.sleep(0.02)


@contextmanager
def runningReceiver() -> Iterator[tuple[Receiver, str]]:
    """
    A receiver listening on a free port of 127.0.0.1, and its C{host:port}.
    """
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, f"127.0.0.1:{port}"
    finally:
        server.stop(0)
