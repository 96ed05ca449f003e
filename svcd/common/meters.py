"""
A daemon's OpenTelemetry meter, exported over OTLP gRPC beside its spans
(decisions D15: the proxy's GenAI histograms). The Prometheus metrics of
C{/metrics} are not these: they stay as they are.

Configured as tracing is (L{svcd.common.tracing.TracingConfig}): the
metrics go to OTEL_EXPORTER_OTLP_ENDPOINT every
OTEL_METRIC_EXPORT_INTERVAL milliseconds, under the same resource as the
spans, unless OTEL_METRICS_EXPORTER is C{none}. With no endpoint there is
no meter at all: the instruments stay unbound, and recording one is a
test of an attribute.

The meter's provider and its reader are made at start, as the span
exporter is (L{svcd.common.tracing.TracingService}): the periodic reader
runs a thread, which would not survive twistd's fork. At stop the
instruments are unbound, and the last measures flushed within a bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

from svcd.common.clocks import Clock
from svcd.common.tracing import FLUSH_TIMEOUT, TracingConfig, flushInThread, resourceOf


class Instruments(Protocol):
    """
    Instruments made on a meter while it exports (L{MeterService}), and
    recording nothing while unbound.
    """

    def bind(self, meter: Meter) -> None: ...

    def unbind(self) -> None: ...


def otlpReader(endpoint: str, interval: float) -> MetricReader:
    """
    Export to the OTLP gRPC collector at C{endpoint} every C{interval}
    seconds (cumulative temporality, the exporter's default).
    """
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=endpoint, insecure=True),
        export_interval_millis=interval * 1000,
    )


class MeterService(Service):
    """
    Owns a daemon's L{MeterProvider} while it runs, when metrics are
    exported; put it before the services whose calls it measures, so that
    it stops after them and flushes their last measures.

    @param scope: the instrumentation scope of the meter (the daemon's
        package).
    """

    log = Logger()

    def __init__(
        self,
        reactor: IReactorFromThreads,
        clock: Clock,
        settings: TracingConfig,
        instruments: Sequence[Instruments],
        scope: str,
        readerFactory: Callable[[str, float], MetricReader] = otlpReader,
        flushTimeout: float = FLUSH_TIMEOUT,
    ) -> None:
        self._reactor = reactor
        self._clock = clock
        self._settings = settings
        self._instruments = tuple(instruments)
        self._scope = scope
        self._readerFactory = readerFactory
        self._flushTimeout = flushTimeout
        self.provider: MeterProvider | None = None

    def startService(self) -> None:
        super().startService()
        settings = self._settings
        if settings.endpoint is None or not settings.exportMetrics:
            return
        self.provider = MeterProvider(
            metric_readers=[self._readerFactory(settings.endpoint, settings.metricInterval)],
            resource=resourceOf(settings),
            shutdown_on_exit=False,
        )
        meter = self.provider.get_meter(self._scope)
        for each in self._instruments:
            each.bind(meter)
        self.log.info(
            "Metrics exported to {otlp_endpoint} every {interval} s",
            otlp_endpoint=settings.endpoint,
            interval=settings.metricInterval,
        )

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        provider, self.provider = self.provider, None
        for each in self._instruments:
            each.unbind()
        if provider is None:
            return

        def shutdownProvider() -> None:
            provider.force_flush()
            provider.shutdown()

        flushed = await flushInThread(
            self._reactor, self._clock, shutdownProvider, self._flushTimeout, "svc-metric-flush"
        )
        if not flushed:
            self.log.warn(
                "Metrics not exported within {timeout} s of the stop; dropping them",
                timeout=self._flushTimeout,
            )
