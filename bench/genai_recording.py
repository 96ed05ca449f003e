"""
What the GenAI telemetry of a provider call costs the forwarder
(decisions D15, L{svcd.providers.genai}): the end of one try
(L{CallTelemetry.ended}) as an unsampled request pays it, with the
histograms unbound (no OTLP endpoint: the default) and bound to a meter
whose reader exports nothing during the run (as between two exports);
and the span's start and end of a sampled one for comparison.

    python bench/genai_recording.py [--rounds 15] [--number 20000]

Each figure is the best of C{--rounds} timings of C{--number} calls, the
cases timed in turns, in microseconds per call. No network, no reactor.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402

from svcd.common.tracing import activate  # noqa: E402
from svcd.metering.models import Model, Provider  # noqa: E402
from svcd.metering.usage import Usage  # noqa: E402
from svcd.providers.genai import CallTelemetry, GenAIMetrics  # noqa: E402

PROVIDER = Provider("openai", "https://api.openai.com/v1")
MODEL = Model("gpt", PROVIDER, upstreamModel="gpt-4o-mini")
USAGE = Usage(1200, 300)


def cases() -> dict[str, Callable[[], None]]:
    unbound = CallTelemetry([PROVIDER], None, GenAIMetrics())
    metrics = GenAIMetrics()
    metrics.bind(MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("bench"))
    bound = CallTelemetry([PROVIDER], None, metrics)
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("bench")
    traced = CallTelemetry([PROVIDER], tracer, metrics)
    parent = tracer.start_span("POST /v1/chat/completions")
    activate(parent)

    def unboundEnd() -> None:
        unbound.ended(None, "chat", MODEL, "200", 0.5, USAGE, "gpt-4o-mini-2024-07-18")

    def boundEnd() -> None:
        bound.ended(None, "chat", MODEL, "200", 0.5, USAGE, "gpt-4o-mini-2024-07-18")

    def sampledSpan() -> None:
        span = traced.span("chat", MODEL, "openai", False, 256)
        traced.ended(span, "chat", MODEL, "200", 0.5, USAGE, "gpt-4o-mini-2024-07-18")

    return {
        "no export (unbound)": unboundEnd,
        "exporting (bound)": boundEnd,
        "sampled: span + bound": sampledSpan,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=20_000)
    arguments = parser.parse_args()
    timed = cases()
    best = dict.fromkeys(timed, float("inf"))
    for _ in range(arguments.rounds):
        for name, call in timed.items():
            seconds = timeit.timeit(call, number=arguments.number)
            best[name] = min(best[name], seconds / arguments.number)
    for name, seconds in best.items():
        print(f"{name:24} {seconds * 1e6:8.2f} µs per call")


if __name__ == "__main__":
    main()
