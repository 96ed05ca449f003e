"""
Helpers of the tracing tests: a tracer provider that keeps what it exports
(L{Traced}) and the headers of a traced chat request (L{chatHeaders}).

Moved here from test_observability_tracing so that test_edge_guards imports
a library rather than another test module.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from proxydoubles import FakeAuthClient, MemoryCounters
from treq.testing import StubTreq
from twisted.internet.task import Clock

from svcd.common.tracing import (
    TracingConfig,
    tracerProvider,
)
from svcd.limits.limiter import RedisRateLimiter
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.metrics import ProxyMetrics

NOW = 1_700_000_015.0


def recordingProvider(ratio: float = 1.0) -> tuple[TracerProvider, InMemorySpanExporter]:
    """
    A provider sampling C{ratio} of root spans, exporting synchronously
    into memory.
    """
    provider = tracerProvider(TracingConfig("svc-test", "development", sampleRatio=ratio))
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


class Traced:
    """
    A proxy edge (fake auth client, in-memory rate limiter) whose spans
    land in C{exporter}.
    """

    def __init__(self, ratio: float = 1.0) -> None:
        self.provider, self.exporter = recordingProvider(ratio)
        clock = Clock()
        clock.advance(NOW)
        self.auth = FakeAuthClient()
        config = ProxyConfig(authGrpcAddr="auth.test:9091")
        limiter = RedisRateLimiter(MemoryCounters(), clock, 60, {})
        self.edge = ProxyEdge(
            config, self.auth, limiter, ProxyMetrics(), clock, self.provider.get_tracer("test")
        )
        self.stub = StubTreq(self.edge.resource())

    async def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
    ) -> Any:
        from twisted.internet import reactor
        from twisted.internet.task import deferLater

        # StubTreq sets request() and the others in its __init__ (setattr
        # over treq.__all__); treq's types do not declare them.
        pending = self.stub.request(  # type: ignore[attr-defined]
            method, "http://proxy.test" + path, headers=headers or {}, data=body or None
        )
        outcome: list[Any] = []

        def keep(result: Any) -> Any:
            outcome.append(result)
            return result

        pending.addBoth(keep)
        # An answer completed later by the real reactor (a real gRPC call)
        # reaches StubTreq's in-memory client only when flushed.
        while not outcome:
            self.stub.flush()
            await deferLater(reactor, 0.005, lambda: None)
        response = await pending
        await response.content()
        return response

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


def chatHeaders(token: str, agentID: str, **extra: str) -> dict[str, str]:
    return {
        "Authorization": "Bearer " + token,
        "X-SVC-Agent-ID": agentID,
        "Content-Type": "application/json",
        **extra,
    }
