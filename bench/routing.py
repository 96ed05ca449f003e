"""
What routing costs a request (decisions D15), in process.

    python bench/routing.py [--requests 50000] [--repeat 5]

The forwarder's routing work for one request that its first try answers,
as svcd.providers.upstream.Forwarder.forward does it: the plan (the
router's order of the model's deployments, each try checked by the
caller's accepts), the try's flight started, svc-proxy's deployment
metrics told, the first byte timed, the flight and the metrics ended.
Nothing is sent. For a model of one deployment (every model of a file
without deployments: the forward row) and for a model of three under each
routing; for the three, also the request whose first try failed before
its first byte and was followed by the second (a retried request of the
failing row: two tries, the failure counted; cooldown_failures is set out
of reach, so that every request pays its retry rather than a cooled
deployment sparing it).

Prints, for each, the best of --repeat runs of --requests requests, in µs
of this process's CPU time per request (the cases take turns, run after
run, so that a loaded machine weighs on each alike; CPU time rather than
the clock's, which counts the other processes' turns on the core): compare
with the forward row's CPU per request in
bench/gateway.py (the proxy's column, 300 to 400 µs on the shared 2-core
machine) to see what share of a forwarded request routing is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from random import Random

from twisted.internet.interfaces import IDelayedCall

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from svcd.metering.models import (  # noqa: E402
    LATENCY,
    LEAST_BUSY,
    WEIGHTED,
    Deployment,
    Model,
    Provider,
)
from svcd.providers.routing import Router, Try, bodyKey  # noqa: E402
from svcd.providers.tries import FAILED, OK  # noqa: E402
from svcd.proxy.metrics import ProxyMetrics  # noqa: E402


class MonotonicClock:
    """
    The time of the router: what the reactor's seconds() costs aside, the
    real clock, so that latency means age as they would.
    """

    def seconds(self) -> float:
        return time.monotonic()

    def callLater(
        self, delay: float, callable: Callable[..., object], *args: object, **kw: object
    ) -> IDelayedCall:
        raise AssertionError("the router sets no timer")


def provider(name: str) -> Provider:
    return Provider(name, f"http://127.0.0.1/{name}/v1")


def model(name: str, count: int, routing: str, cooldownFailures: int = 3) -> Model:
    """
    A model of C{count} deployments weighted 1:1:2 (as the tests' split).
    """
    deployments = tuple(
        Deployment(provider(f"{name}-{index}"), name, 2.0 if index == 2 else 1.0)
        for index in range(count)
    )
    return Model(
        name,
        deployments[0].provider,
        name,
        deployments=deployments,
        routing=routing,
        cooldownFailures=cooldownFailures,
    )


def requests(chain: Model, failFirst: bool) -> Callable[[int], None]:
    """
    C{count} requests to C{chain} through one router and svc-proxy's
    metrics, each as the forwarder routes it.
    """
    router = Router(MonotonicClock(), Random(1))
    metrics = ProxyMetrics()
    attempts = [chain]
    prepared = {bodyKey(chain, index): None for index in range(len(chain.deployments))}

    def accepts(attempt: Try) -> bool:
        return bodyKey(attempt.model, attempt.index) in prepared

    def run(count: int) -> None:
        for _ in range(count):
            failing = failFirst
            for attempt in router.plan(attempts, accepts=accepts):
                attempt.target  # noqa: B018 (the forwarder reads it)
                name = attempt.deployment.name
                flight = router.start(attempt)
                metrics.deploymentStarted(chain.name, name)
                if failing:
                    failing = False
                    flight.failed()
                    flight.finished()
                    metrics.deploymentEnded(chain.name, name, FAILED)
                    continue
                flight.firstByte()
                flight.finished()
                metrics.deploymentEnded(chain.name, name, OK)
                break

    return run


def timed(run: Callable[[int], None], count: int) -> float:
    """
    One run of C{count} requests: this process's CPU time, in µs per
    request.
    """
    started = time.process_time()
    run(count)
    return (time.process_time() - started) / count * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=5)
    arguments = parser.parse_args()
    never = 10**12
    cases = [("one deployment", model("one", 1, WEIGHTED), False)]
    for routing in (WEIGHTED, LEAST_BUSY, LATENCY):
        cases.append((f"three, {routing}", model(routing, 3, routing), False))
    for routing in (WEIGHTED, LEAST_BUSY, LATENCY):
        cases.append(
            (
                f"three, {routing}, first try failed",
                model(f"{routing}-failing", 3, routing, cooldownFailures=never),
                True,
            )
        )
    runs = [requests(chain, failFirst) for _, chain, failFirst in cases]
    for run in runs:
        run(min(arguments.requests, 10_000))
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(arguments.repeat):
        for run, taken in zip(runs, times, strict=True):
            taken.append(timed(run, arguments.requests))
    width = max(len(name) for name, _, _ in cases)
    print(
        f"{'case':<{width}}  CPU µs/request: best, median"
        f" ({arguments.repeat} runs of {arguments.requests:,})"
    )
    for (name, _, _), taken in zip(cases, times, strict=True):
        print(f"{name:<{width}}  {min(taken):6.2f} {statistics.median(taken):6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
