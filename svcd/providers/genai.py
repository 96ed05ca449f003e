"""
OpenTelemetry's GenAI semantic conventions for the forwarder's calls to
providers (decisions D15): the client span of each try, and the two
client histograms of its meter.

The conventions are those of the GenAI semantic conventions after 1.37
(now kept in open-telemetry/semantic-conventions-genai): the provider is
C{gen_ai.provider.name}, which replaced C{gen_ai.system}; only the new
name is set (the gateway never emitted the old one, so there is no
version to stay on, and the conventions' variable to opt into the new
one is not read).

A try's span (L{CallTelemetry.span}) is made only under a recording
(sampled) server span, as the forwarder's span always was; it is named
C{<gen_ai.operation.name> <gen_ai.request.model>} and carries the
operation (C{chat} for chat completions and Anthropic's messages,
C{embeddings}, and C{count_tokens}, a name of our own for Anthropic's
token counting, which the conventions leave open), the provider, the
model asked for and the one that answered, the server, the output cap
sent, the tokens, C{error.type}, and the gateway's own C{svc.provider},
C{svc.model} and C{svc.deployment}. Never a message's content, nor a key.

The histograms (L{GenAIMetrics}) are recorded for every try, sampled or
not, but only while a meter is bound: with no export configured nothing
is bound, and a try pays one attribute test
(L{svcd.common.meters.MeterService} binds them when the daemon runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs
from opentelemetry import trace
from opentelemetry.metrics import Histogram, Meter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from svcd.common.logbounds import loggedText
from svcd.metering.models import ANTHROPIC, Model, Provider
from svcd.metering.usage import Usage
from svcd.providers.operations import DEFAULT_ANTHROPIC_CAP, EMBEDDINGS_NAME, Leg
from svcd.providers.passages import Exchange

OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_STREAM = "gen_ai.request.stream"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
TOKEN_TYPE = "gen_ai.token.type"  # noqa: S105 (a name, not a secret)
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
DEPLOYMENT = "svc.deployment"

TOKEN_USAGE = "gen_ai.client.token.usage"  # noqa: S105 (a name, not a secret)
OPERATION_DURATION = "gen_ai.client.operation.duration"
# The conventions' ExplicitBucketBoundaries of each histogram.
TOKEN_BUCKETS: Sequence[float] = tuple(4**power for power in range(14))
DURATION_BUCKETS: Sequence[float] = tuple(round(0.01 * 2**power, 2) for power in range(14))

# gen_ai.provider.name by the host of a provider's base URL, for the
# services the conventions name; any other provider is named by its api
# ("openai" for every OpenAI-compatible server, "anthropic"), the flavour
# of telemetry it speaks, as the conventions allow.
_KNOWN_HOSTS = {
    "api.openai.com": "openai",
    "api.anthropic.com": "anthropic",
    "api.deepseek.com": "deepseek",
    "api.groq.com": "groq",
    "api.mistral.ai": "mistral_ai",
    "api.perplexity.ai": "perplexity",
    "api.x.ai": "x_ai",
    "api.cohere.ai": "cohere",
    "api.cohere.com": "cohere",
    "generativelanguage.googleapis.com": "gcp.gemini",
}
_KNOWN_SUFFIXES = (
    (".openai.azure.com", "azure.ai.openai"),
    (".services.ai.azure.com", "azure.ai.inference"),
    ("aiplatform.googleapis.com", "gcp.vertex_ai"),
)
_ERROR = Status(StatusCode.ERROR)


def providerNameOf(provider: Provider) -> str:
    """
    The C{gen_ai.provider.name} of C{provider}: the conventions' name of
    the service its base URL points at, else its api.
    """
    host = (urlsplit(provider.baseURL).hostname or "").lower()
    known = _KNOWN_HOSTS.get(host)
    if known is not None:
        return known
    for suffix, name in _KNOWN_SUFFIXES:
        if host.endswith(suffix):
            return name
    return provider.api


@attrs.frozen
class Peer:
    """
    What every call to one provider says of it: its
    C{gen_ai.provider.name}, C{server.address} and C{server.port}.
    """

    attributes: Mapping[str, str | int]

    @classmethod
    def of(cls, provider: Provider) -> Peer:
        parts = urlsplit(provider.baseURL)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(
            {
                PROVIDER_NAME: providerNameOf(provider),
                SERVER_ADDRESS: parts.hostname or "",
                SERVER_PORT: port,
            }
        )


class GenAIMetrics:
    """
    C{gen_ai.client.token.usage} and C{gen_ai.client.operation.duration}
    on the meter they are bound to; recording does nothing while unbound.
    """

    def __init__(self) -> None:
        self._tokens: Histogram | None = None
        self._duration: Histogram | None = None
        # A plain attribute: tested on every try.
        self.bound = False

    def bind(self, meter: Meter) -> None:
        self._tokens = meter.create_histogram(
            TOKEN_USAGE,
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self._duration = meter.create_histogram(
            OPERATION_DURATION,
            unit="s",
            description="GenAI operation duration.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.bound = True

    def unbind(self) -> None:
        self.bound = False
        self._tokens = self._duration = None

    def record(
        self, attributes: Mapping[str, str | int], seconds: float, usage: Usage | None, output: bool
    ) -> None:
        """
        One call: its duration, and its input (and, unless C{output} is
        false, as for embeddings, output) tokens when the provider counted
        them.
        """
        tokens, duration = self._tokens, self._duration
        if tokens is None or duration is None:
            return
        duration.record(seconds, attributes)
        if usage is not None:
            tokens.record(usage.promptTokens, {**attributes, TOKEN_TYPE: "input"})
            if output:
                tokens.record(usage.completionTokens, {**attributes, TOKEN_TYPE: "output"})


def maxTokensOf(
    document: Mapping[str, Any], model: Model, outputCap: int | None, translated: bool
) -> int | None:
    """
    The output cap a try sent, as best known without reading its body:
    the client's own, else the one a budget assumed (at most the model's
    ceiling), else, for a body translated for an Anthropic provider (which
    requires one), the model's default.
    """
    for key in ("max_completion_tokens", "max_tokens"):
        value = document.get(key)
        if type(value) is int:
            return value
    if outputCap is not None:
        return min(outputCap, model.outputCeiling)
    if translated and model.provider.api == ANTHROPIC:
        return model.maxOutputTokens or DEFAULT_ANTHROPIC_CAP
    return None


def responseModelOf(answer: object) -> str | None:
    """
    The C{model} a provider's whole answer names, if any.
    """
    if isinstance(answer, dict):
        model = answer.get("model")
        if isinstance(model, str):
            return model
    return None


class CallTelemetry:
    """
    The spans and GenAI metrics of the forwarder's calls to providers.

    @param tracer: makes the client span of a try under a sampled request;
        None for none.
    @param metrics: the histograms, recorded while bound; None for none.
    """

    def __init__(
        self,
        providers: Sequence[Provider],
        tracer: Tracer | None,
        metrics: GenAIMetrics | None,
    ) -> None:
        self._tracer = tracer
        self._metrics = metrics
        self._peers = {provider.name: Peer.of(provider) for provider in providers}

    def span(
        self, leg: Leg, model: Model, deployment: str | None, stream: bool, exchange: Exchange
    ) -> Span | None:
        """
        The client span of one try, when the request's span records.
        """
        if self._tracer is None or not trace.get_current_span().is_recording():
            return None
        operation = leg.genAIOperation
        maxTokens = maxTokensOf(exchange.document, model, exchange.outputCap, leg.translated)
        attributes: dict[str, Any] = {
            **self._peers[model.provider.name].attributes,
            OPERATION_NAME: operation,
            REQUEST_MODEL: model.upstreamModel,
            "http.request.method": "POST",
            "svc.provider": model.provider.name,
            "svc.model": model.name,
        }
        if deployment is not None:
            attributes[DEPLOYMENT] = deployment
        if stream:
            attributes[REQUEST_STREAM] = True
        if maxTokens is not None:
            attributes[REQUEST_MAX_TOKENS] = maxTokens
        return self._tracer.start_span(
            f"{operation} {model.upstreamModel}",
            kind=SpanKind.CLIENT,
            attributes=attributes,
            record_exception=False,
        )

    def ended(
        self,
        span: Span | None,
        operation: str,
        model: Model,
        label: str,
        seconds: float,
        usage: Usage | None,
        responseModel: str | None,
    ) -> None:
        """
        A try ended with C{label} (its HTTP status, or the fault's label,
        which is its C{error.type} when it is not a 2xx) after C{seconds}.
        """
        metrics = self._metrics
        recording = metrics is not None and metrics.bound
        if span is None and not recording:
            # Unsampled, and no meter: what most tries pay.
            return
        ok = label.isdigit() and label.startswith("2")
        output = operation != EMBEDDINGS_NAME
        if responseModel:
            # The upstream's text: bounded as a logged value.
            responseModel = loggedText(responseModel)
        if span is not None:
            if label.isdigit():
                span.set_attribute("http.response.status_code", int(label))
            if not ok:
                span.set_attribute(ERROR_TYPE, label)
                span.set_status(_ERROR)
            if responseModel:
                span.set_attribute(RESPONSE_MODEL, responseModel)
            if usage is not None:
                span.set_attribute(INPUT_TOKENS, usage.promptTokens)
                if output:
                    span.set_attribute(OUTPUT_TOKENS, usage.completionTokens)
            span.end()
        if metrics is None or not recording:
            return
        attributes: dict[str, str | int] = {
            **self._peers[model.provider.name].attributes,
            OPERATION_NAME: operation,
            REQUEST_MODEL: model.upstreamModel,
        }
        if responseModel:
            attributes[RESPONSE_MODEL] = responseModel
        if not ok:
            attributes[ERROR_TYPE] = label
        metrics.record(attributes, seconds, usage, output)
