"""
OpenTelemetry's GenAI conventions in process (decisions D15,
L{svcd.providers.genai}, L{svcd.common.meters}): the provider's name, the
cap a try sent, a try's span and its histograms on an in-memory reader,
the meter's settings, and the service that binds the instruments only
when metrics are exported. The real exporter against a real OTLP
receiver is tests/test_gateway_genai.py's.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytest_twisted
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader
from opentelemetry.trace import SpanKind, StatusCode
from tracinghelpers import recordingProvider
from twisted.internet.interfaces import IReactorFromThreads

from svcd.common.config import ConfigError
from svcd.common.meters import MeterService
from svcd.common.tracing import TracingConfig, activate, deactivate
from svcd.metering.models import ANTHROPIC, Model, Provider
from svcd.metering.usage import Usage
from svcd.providers.genai import (
    DURATION_BUCKETS,
    TOKEN_BUCKETS,
    CallTelemetry,
    GenAIMetrics,
    Peer,
    maxTokensOf,
    providerNameOf,
)
from svcd.providers.operations import CHAT_COMPLETIONS
from svcd.providers.passages import Exchange

OPENAI = Provider("vllm", "http://10.0.0.7:8000/v1")
MODEL = Model("fast", OPENAI, upstreamModel="llama-3-8b", maxOutputTokens=500)
LEG = CHAT_COMPLETIONS.legs["openai"]


@pytest.mark.parametrize(
    ("baseURL", "api", "name"),
    [
        ("https://api.openai.com/v1", "openai", "openai"),
        ("https://api.anthropic.com/v1", "anthropic", "anthropic"),
        ("https://eu-west.openai.azure.com/openai/v1", "openai", "azure.ai.openai"),
        ("https://api.groq.com/openai/v1", "openai", "groq"),
        ("https://API.Mistral.AI/v1", "openai", "mistral_ai"),
        ("http://10.0.0.7:8000/v1", "openai", "openai"),
        ("http://gateway.internal/v1", "anthropic", "anthropic"),
    ],
)
def test_providerName(baseURL: str, api: str, name: str) -> None:
    """
    gen_ai.provider.name: the conventions' name of a known service, else
    the provider's api (the flavour it speaks).
    """
    assert providerNameOf(Provider("p", baseURL, api=api)) == name


def test_peerPorts() -> None:
    """
    server.port is the URL's, else its scheme's default.
    """
    assert Peer.of(Provider("p", "https://api.openai.com/v1")).attributes == {
        "gen_ai.provider.name": "openai",
        "server.address": "api.openai.com",
        "server.port": 443,
    }
    assert Peer.of(Provider("p", "http://h/v1")).attributes["server.port"] == 80
    assert Peer.of(OPENAI).attributes["server.port"] == 8000


def test_maxTokens() -> None:
    """
    The cap a try sent: the client's, else a budget's (at most the
    model's ceiling), else an Anthropic provider's default for a
    translated body; else none.
    """
    assert maxTokensOf({"max_tokens": 40}, MODEL, 900, False) == 40
    assert maxTokensOf({"max_completion_tokens": 30, "max_tokens": 40}, MODEL, None, False) == 30
    assert maxTokensOf({"max_tokens": True}, MODEL, None, False) is None
    assert maxTokensOf({}, MODEL, 900, False) == 500
    assert maxTokensOf({}, MODEL, 100, False) == 100
    assert maxTokensOf({}, MODEL, None, True) is None
    claude = Model("c", Provider("a", "https://api.anthropic.com/v1", api=ANTHROPIC))
    assert maxTokensOf({}, claude, None, True) == 4096
    assert maxTokensOf({}, claude, None, False) is None


def _points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    found: dict[str, list[Any]] = {}
    if data is None:
        return found
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def test_tryWithSpanAndMetrics() -> None:
    """
    Under a recording span a try is a client span named C{<operation>
    <model>} with the GenAI attributes; its end adds the answer's model,
    tokens and (for a failure) error.type and ERROR; the histograms get
    the duration and each kind of token, with the conventions' buckets.
    """
    provider, exporter = recordingProvider()
    tracer = provider.get_tracer("test")
    reader = InMemoryMetricReader()
    metrics = GenAIMetrics()
    metrics.bind(MeterProvider(metric_readers=[reader]).get_meter("test"))
    telemetry = CallTelemetry([OPENAI], tracer, metrics)
    parent = tracer.start_span("POST /v1/chat/completions")
    token = activate(parent)
    try:
        span = telemetry.span(LEG, MODEL, "vllm", True, Exchange({"max_tokens": 64}, "r", 0))
        telemetry.ended(span, "chat", MODEL, "200", 0.25, Usage(12, 34), "llama-3-8b-0613")
        failed = telemetry.span(LEG, MODEL, "vllm", False, Exchange({}, "r", 0))
        telemetry.ended(failed, "chat", MODEL, "timeout", 1.5, None, None)
    finally:
        deactivate(token)
        parent.end()
    answered, timedOut = [each for each in exporter.get_finished_spans() if each.parent]
    assert answered.name == "chat llama-3-8b"
    assert answered.kind is SpanKind.CLIENT
    assert dict(answered.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "llama-3-8b",
        "gen_ai.request.stream": True,
        "gen_ai.request.max_tokens": 64,
        "gen_ai.response.model": "llama-3-8b-0613",
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 34,
        "server.address": "10.0.0.7",
        "server.port": 8000,
        "http.request.method": "POST",
        "http.response.status_code": 200,
        "svc.provider": "vllm",
        "svc.model": "fast",
        "svc.deployment": "vllm",
    }
    assert answered.status.status_code is StatusCode.UNSET
    assert dict(timedOut.attributes or {})["error.type"] == "timeout"
    assert timedOut.status.status_code is StatusCode.ERROR

    points = _points(reader)
    durations = {
        point.attributes.get("error.type"): point
        for point in points["gen_ai.client.operation.duration"]
    }
    assert set(durations) == {None, "timeout"}
    assert durations[None].sum == 0.25 and durations["timeout"].sum == 1.5
    assert tuple(durations[None].explicit_bounds) == tuple(DURATION_BUCKETS)
    assert dict(durations[None].attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "llama-3-8b",
        "gen_ai.response.model": "llama-3-8b-0613",
        "server.address": "10.0.0.7",
        "server.port": 8000,
    }
    tokens = {
        point.attributes["gen_ai.token.type"]: point
        for point in points["gen_ai.client.token.usage"]
    }
    assert {kind: point.sum for kind, point in tokens.items()} == {"input": 12, "output": 34}
    assert tuple(tokens["input"].explicit_bounds) == tuple(TOKEN_BUCKETS)


def test_embeddingsHaveNoOutputTokens() -> None:
    """
    An embeddings try records its input tokens only.
    """
    reader = InMemoryMetricReader()
    metrics = GenAIMetrics()
    metrics.bind(MeterProvider(metric_readers=[reader]).get_meter("test"))
    CallTelemetry([OPENAI], None, metrics).ended(
        None, "embeddings", MODEL, "200", 0.1, Usage(8, 0), None
    )
    [point] = _points(reader)["gen_ai.client.token.usage"]
    assert point.attributes["gen_ai.token.type"] == "input" and point.sum == 8


def test_unsampledAndUnboundCostNothing() -> None:
    """
    Outside a recording span no span is made; unbound histograms record
    nothing, and bound ones again nothing once unbound.
    """
    provider, exporter = recordingProvider(ratio=0.0)
    metrics = GenAIMetrics()
    telemetry = CallTelemetry([OPENAI], provider.get_tracer("test"), metrics)
    assert telemetry.span(LEG, MODEL, None, False, Exchange({}, "r", 0)) is None
    telemetry.ended(None, "chat", MODEL, "200", 0.1, Usage(1, 1), None)
    reader = InMemoryMetricReader()
    metrics.bind(MeterProvider(metric_readers=[reader]).get_meter("test"))
    metrics.unbind()
    telemetry.ended(None, "chat", MODEL, "200", 0.1, Usage(1, 1), None)
    assert _points(reader) == {} and exporter.get_finished_spans() == ()


def test_meterSettings() -> None:
    """
    OTEL_METRIC_EXPORT_INTERVAL (milliseconds, default a minute) and
    OTEL_METRICS_EXPORTER (otlp or none); anything else stops the start.
    """
    assert TracingConfig.fromEnvironment({}, "svc-proxy").metricInterval == 60.0
    settings = TracingConfig.fromEnvironment(
        {"OTEL_METRIC_EXPORT_INTERVAL": "250", "OTEL_METRICS_EXPORTER": "None"}, "svc-proxy"
    )
    assert (settings.metricInterval, settings.exportMetrics) == (0.25, False)
    assert TracingConfig.fromEnvironment({"OTEL_METRICS_EXPORTER": "otlp"}, "x").exportMetrics
    for variable, value in [
        ("OTEL_METRIC_EXPORT_INTERVAL", "0"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "1.5"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "-3"),
        ("OTEL_METRICS_EXPORTER", "prometheus"),
    ]:
        with pytest.raises(ConfigError) as caught:
            TracingConfig.fromEnvironment({variable: value}, "svc-proxy")
        assert caught.value.variable == variable


@pytest_twisted.ensureDeferred
async def test_meterServiceBindsOnlyWhenExporting() -> None:
    """
    The reader is made at start (after twistd's fork), only with an
    endpoint and unless OTEL_METRICS_EXPORTER is none; the instruments are
    bound while it runs, and the stop unbinds them and flushes the last
    measures.
    """
    from twisted.internet import reactor

    made: list[tuple[str, float]] = []
    readers: list[InMemoryMetricReader] = []

    def factory(endpoint: str, interval: float) -> MetricReader:
        made.append((endpoint, interval))
        readers.append(InMemoryMetricReader())
        return readers[-1]

    for settings in (
        TracingConfig("svc-test", "development"),
        TracingConfig("svc-test", "development", endpoint="127.0.0.1:4317", exportMetrics=False),
    ):
        metrics = GenAIMetrics()
        service = MeterService(
            IReactorFromThreads(reactor), reactor, settings, [metrics], "test", factory
        )
        service.startService()
        assert not metrics.bound and service.provider is None
        await service.stopService()
    assert made == []

    settings = TracingConfig("svc-test", "development", endpoint="127.0.0.1:4317")
    metrics = GenAIMetrics()
    service = MeterService(
        IReactorFromThreads(reactor), reactor, settings, [metrics], "svcd.test", factory
    )
    service.startService()
    assert (made, metrics.bound) == ([("127.0.0.1:4317", 60.0)], True)
    CallTelemetry([OPENAI], None, metrics).ended(None, "chat", MODEL, "200", 0.1, None, None)
    provider = service.provider
    assert provider is not None
    [reader] = readers
    data = reader.get_metrics_data()
    assert data is not None
    [resource] = data.resource_metrics
    assert resource.resource.attributes["service.name"] == "svc-test"
    assert resource.scope_metrics[0].scope.name == "svcd.test"
    await service.stopService()
    assert (metrics.bound, service.provider) == (False, None)
