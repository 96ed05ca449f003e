"""
What the GenAI telemetry of a provider call costs the forwarder
(decisions D15, L{svcd.providers.genai}): one try's span and end
(L{CallTelemetry.span} and L{CallTelemetry.ended}), unsampled and
sampled, with the histograms unbound (no OTLP endpoint: the default) and
bound to a meter whose reader exports nothing during the run (as between
two exports); and, as the base, what a try paid for its span before
(the current span's test).

    python bench/genai_recording.py [--rounds 15] [--number 20000]

Each figure is the best of C{--rounds} timings of C{--number} calls, the
cases timed in turns, in microseconds of this process's CPU per try (CPU
time, not wall time: on a shared machine the wait for a core is not the
code's cost). No network, no reactor.
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.trace import Span  # noqa: E402

from svcd.common.tracing import activate, deactivate  # noqa: E402
from svcd.metering.models import Model, Provider  # noqa: E402
from svcd.metering.usage import Usage  # noqa: E402
from svcd.providers.genai import CallTelemetry, GenAIMetrics  # noqa: E402
from svcd.providers.operations import CHAT_COMPLETIONS  # noqa: E402
from svcd.providers.passages import Exchange  # noqa: E402

PROVIDER = Provider("openai", "https://api.openai.com/v1")
MODEL = Model("gpt", PROVIDER, upstreamModel="gpt-4o-mini")
USAGE = Usage(1200, 300)
LEG = CHAT_COMPLETIONS.legs["openai"]
EXCHANGE = Exchange({"max_tokens": 256}, "request", 0)
ANSWERED = "gpt-4o-mini-2024-07-18"


def _before() -> None:
    """
    What the forwarder paid for a try's span before the GenAI telemetry,
    unsampled: the current span's test, and the end's test of no span.
    """
    span = None
    if trace.get_current_span().is_recording():
        span = object()
    if span is not None:
        raise AssertionError


Case = tuple[Callable[[], None], Span | None]


def cases() -> dict[str, Case]:
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("bench")
    unbound = CallTelemetry([PROVIDER], tracer, GenAIMetrics())
    metrics = GenAIMetrics()
    metrics.bind(MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("bench"))
    bound = CallTelemetry([PROVIDER], tracer, metrics)

    def unboundTry() -> None:
        span = unbound.span(LEG, MODEL, "openai", False, EXCHANGE)
        unbound.ended(span, "chat", MODEL, "200", 0.5, USAGE, ANSWERED)

    def boundTry() -> None:
        span = bound.span(LEG, MODEL, "openai", False, EXCHANGE)
        bound.ended(span, "chat", MODEL, "200", 0.5, USAGE, ANSWERED)

    sampled = tracer.start_span("POST /v1/chat/completions")
    return {
        "before (unsampled)": (_before, None),
        "unsampled, no export": (unboundTry, None),
        "unsampled, exporting": (boundTry, None),
        "sampled, no export": (unboundTry, sampled),
        "sampled, exporting": (boundTry, sampled),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=20_000)
    arguments = parser.parse_args()
    timed = cases()
    best = dict.fromkeys(timed, float("inf"))
    for _ in range(arguments.rounds):
        for name, (call, parent) in timed.items():
            token = activate(parent) if parent is not None else None
            try:
                seconds = timeit.timeit(call, timer=time.process_time, number=arguments.number)
            finally:
                if token is not None:
                    deactivate(token)
            best[name] = min(best[name], seconds / arguments.number)
    for name, seconds in best.items():
        print(f"{name:24} {seconds * 1e6:8.2f} µs per try")


if __name__ == "__main__":
    main()
