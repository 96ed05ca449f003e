"""
The cycle collector's pauses and collections as Prometheus series, on a
daemon's own registry (both daemons; L{watchCollector} from their taps).

A collection stops every thread of the process, and with it the reactor:
each request waiting for the reactor waits for the collection too. Where
the collector runs depends on allocations, not on the request, so its
pauses show up only in a latency histogram's tail. These series make them
visible on their own (Synapse's C{python_gc_time}, from
C{synapse/metrics/_gc.py}, is the model):

  - C{svc_python_gc_pause_seconds{generation}}: how long each collection
    of a generation took, measured by C{gc.callbacks} around it;
  - C{svc_python_gc_collections_total{generation}} and
    C{svc_python_gc_collected_objects_total{generation}}: how many
    collections of each generation ran and how many unreachable objects
    they freed, from C{gc.get_stats()} (so they count from the start of
    the process, explicit C{gc.collect()} calls included).

The youngest generation (0) is collected often and should pause for well
under the latency budget (see L{svcd.common.lifecycle.GC_THRESHOLD}); the
oldest (2) rarely, and for longer.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

# Finer than the request buckets (1 ms to 5 s): a young collection takes
# tenths of a millisecond to a few milliseconds, a full one tens.
PAUSE_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)

GENERATIONS = 3


class CollectorMetrics(Collector):
    """
    The collector's series (see the module docstring). L{install} adds its
    callback to C{gc.callbacks}; L{uninstall} removes it.

    The callback runs inside every collection, in whichever thread
    triggered it, so it does the least it can: it reads the clock and adds
    to plain integers, taking no lock (collections never overlap, so
    neither do its updates; a scrape at the same moment may see a pause
    counted in its bucket and not yet in the sum). Nothing is formatted
    until a scrape calls L{collect}.

    @param clock: the time source of pauses (C{time.perf_counter}).
    @param stats: the per-generation statistics (C{gc.get_stats}).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        stats: Callable[[], Sequence[dict[str, int]]] = gc.get_stats,
        buckets: Sequence[float] = PAUSE_BUCKETS,
    ) -> None:
        self._clock = clock
        self._stats = stats
        self._bounds = tuple(buckets)
        # Per generation: the count of pauses in each bucket (the last for
        # pauses past every bound) and their sum.
        self._counts = [[0] * (len(self._bounds) + 1) for _ in range(GENERATIONS)]
        self._sums = [0.0] * GENERATIONS
        self._started = 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        while self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        self.observe(info["generation"], self._clock() - self._started)

    def observe(self, generation: int, seconds: float) -> None:
        """
        Record one collection of C{generation} that took C{seconds}.
        """
        if not 0 <= generation < GENERATIONS:
            return
        bounds = self._bounds
        index = 0
        while index < len(bounds) and seconds > bounds[index]:
            index += 1
        self._counts[generation][index] += 1
        self._sums[generation] += seconds

    def collect(self) -> Iterable[Metric]:
        pauses = HistogramMetricFamily(
            "svc_python_gc_pause_seconds",
            "Time each collection of the cycle collector stopped the process, by generation",
            labels=["generation"],
        )
        for generation in range(GENERATIONS):
            counts = list(self._counts[generation])
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip((*self._bounds, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            pauses.add_metric([str(generation)], buckets, self._sums[generation])
        collections = CounterMetricFamily(
            "svc_python_gc_collections",
            "Collections of the cycle collector, by generation",
            labels=["generation"],
        )
        collected = CounterMetricFamily(
            "svc_python_gc_collected_objects",
            "Unreachable objects the cycle collector freed (objects reference counting"
            " alone would have leaked), by generation",
            labels=["generation"],
        )
        for generation, stat in enumerate(self._stats()[:GENERATIONS]):
            collections.add_metric([str(generation)], stat["collections"])
            collected.add_metric([str(generation)], stat["collected"])
        return [pauses, collections, collected]


def watchCollector(registry: CollectorRegistry) -> CollectorMetrics:
    """
    Publish the collector's series on C{registry} and start timing its
    pauses (once per process: a daemon's tap calls this).
    """
    metrics = CollectorMetrics()
    registry.register(metrics)
    metrics.install()
    return metrics
