"""
Tests for L{svcd.common.grpcserver.ComposedInterceptors}: the daemons'
interceptors run as one, in the order grpcio would run them, their handler
made once per method; and a real server built by
L{svcd.common.grpcserver.buildGrpcServer} still runs them around each call,
admission first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc import _interceptor
from prometheus_client import CollectorRegistry

from svcd.common.grpcadmission import AdmissionInterceptor, Bounds, RefusalLog
from svcd.common.grpcserver import ComposedInterceptors, buildGrpcServer
from svcd.memory.metrics import MemoryMetrics

SERVICE = "test.v1.Echo"


class Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


class Labelling(grpc.ServerInterceptor):  # type: ignore[misc]
    """
    Wraps a unary handler so that its answer is C{label} + the inner
    answer; counts how often it was asked.
    """

    def __init__(self, label: bytes) -> None:
        self.label = label
        self.asked = 0

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        self.asked += 1
        handler = continuation(details)
        if handler is None:
            return None
        inner = handler.unary_unary

        def labelled(request: bytes, context: Any) -> bytes:
            answer: bytes = inner(request, context)
            return self.label + answer

        return grpc.unary_unary_rpc_method_handler(labelled)


def _echo() -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(lambda request, context: request)


def test_orderAsGrpcio() -> None:
    """
    The composed handler is the one grpcio's own pipeline makes of the
    same interceptors: the first outermost.
    """
    base = _echo()
    composed = _interceptor.service_pipeline(
        [ComposedInterceptors([Labelling(b"a"), Labelling(b"b")])]
    )
    plain = _interceptor.service_pipeline([Labelling(b"a"), Labelling(b"b")])
    assert composed is not None and plain is not None
    details = Details("/test.v1.Echo/Echo")
    ours = composed.execute(lambda _: base, details)
    theirs = plain.execute(lambda _: base, details)
    assert ours.unary_unary(b"x", None) == theirs.unary_unary(b"x", None) == b"abx"


def test_madeOncePerMethodAndHandler() -> None:
    """
    The interceptors are asked once per method; again when the method's
    handler is another object; a method without a handler stays without.
    """
    outer, inner = Labelling(b"o"), Labelling(b"i")
    composed = ComposedInterceptors([outer, inner])
    base = _echo()
    first = composed.intercept_service(lambda _: base, Details("/s/A"))
    for _ in range(3):
        assert composed.intercept_service(lambda _: base, Details("/s/A")) is first
    assert (outer.asked, inner.asked) == (1, 1)
    other = composed.intercept_service(lambda _: base, Details("/s/B"))
    assert other is not first
    assert (outer.asked, inner.asked) == (2, 2)
    replaced = _echo()
    again = composed.intercept_service(lambda _: replaced, Details("/s/A"))
    assert again is not first
    assert again.unary_unary(b"x", None) == b"oix"
    assert composed.intercept_service(lambda _: None, Details("/s/C")) is None


def test_serverRunsThemAroundEachCall() -> None:
    """
    A server of L{buildGrpcServer} answers through its admission and the
    interceptors given, in that order, call after call.
    """
    metrics = MemoryMetrics(CollectorRegistry())
    bounds = Bounds.standard(4, 2)
    admission = AdmissionInterceptor(
        bounds, RefusalLog(metrics.refused), answered=metrics.answered, countedService=SERVICE
    )
    labelling = Labelling(b"<")
    server, _, port = buildGrpcServer(
        SERVICE,
        {"Echo": _echo()},
        "127.0.0.1",
        0,
        threads=bounds.threads,
        streamsPerConnection=bounds.streamsPerConnection,
        admission=admission,
        threadNamePrefix="test-grpc",
        interceptors=[labelling],
    )
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary(f"/{SERVICE}/Echo")
            for number in range(5):
                assert echo(b"%d" % number, timeout=10) == b"<%d" % number
        assert labelling.asked == 1
        # Every admitted call left its slot.
        assert admission.laneState(f"/{SERVICE}/Echo")._running == 0
    finally:
        server.stop(None).wait(10)
