"""
The cycle collector's series (L{svcd.common.gcmetrics}): pauses by
generation from C{gc.callbacks}, collections and collected objects from
C{gc.get_stats()}.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from svcd.common.gcmetrics import PAUSE_BUCKETS, CollectorMetrics, watchCollector
from svcd.common.metrics import exposition


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """
    Every sample of the registry's text format, by name and labels.
    """
    found = {}
    for family in text_string_to_metric_families(exposition(registry).decode()):
        for sample in family.samples:
            found[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return found


def pauseCount(registry: CollectorRegistry, generation: int) -> float:
    key = ("svc_python_gc_pause_seconds_count", (("generation", str(generation)),))
    return samples(registry)[key]


@pytest.fixture
def watched() -> Iterator[tuple[CollectorRegistry, CollectorMetrics]]:
    registry = CollectorRegistry()
    metrics = watchCollector(registry)
    try:
        yield registry, metrics
    finally:
        metrics.uninstall()


def test_pausesByBucket() -> None:
    """
    Each pause is counted in the first bucket whose bound it does not
    pass, cumulatively, with the sum and count of its generation; the
    other generations are there at 0.
    """
    metrics = CollectorMetrics(stats=lambda: [])
    registry = CollectorRegistry()
    registry.register(metrics)
    metrics.observe(0, 0.00005)
    metrics.observe(0, 0.0001)
    metrics.observe(0, 0.0015)
    metrics.observe(2, 3.0)
    found = samples(registry)

    def bucket(generation: int, bound: str) -> float:
        labels = (("generation", str(generation)), ("le", bound))
        return found["svc_python_gc_pause_seconds_bucket", labels]

    assert bucket(0, "0.0001") == 2
    assert bucket(0, "0.001") == 2
    assert bucket(0, "0.002") == 3
    assert bucket(0, "+Inf") == 3
    assert found["svc_python_gc_pause_seconds_sum", (("generation", "0"),)] == pytest.approx(
        0.00165
    )
    assert bucket(1, "+Inf") == 0
    assert bucket(2, "1.0") == 0
    assert bucket(2, "+Inf") == 1
    assert len([key for key in found if key[0] == "svc_python_gc_pause_seconds_bucket"]) == 3 * (
        len(PAUSE_BUCKETS) + 1
    )


def test_pauseTimedAroundCollection() -> None:
    """
    The callback times a collection from its start to its stop with the
    given clock.
    """
    now = [10.0]
    metrics = CollectorMetrics(clock=lambda: now[0], stats=lambda: [])
    registry = CollectorRegistry()
    registry.register(metrics)
    metrics._callback("start", {"generation": 1})
    now[0] += 0.003
    metrics._callback("stop", {"generation": 1, "collected": 0, "uncollectable": 0})
    found = samples(registry)
    assert found["svc_python_gc_pause_seconds_sum", (("generation", "1"),)] == pytest.approx(0.003)
    assert found["svc_python_gc_pause_seconds_bucket", (("generation", "1"), ("le", "0.005"))] == 1
    assert found["svc_python_gc_pause_seconds_bucket", (("generation", "1"), ("le", "0.002"))] == 0


def test_realCollectionsCounted(watched: tuple[CollectorRegistry, CollectorMetrics]) -> None:
    """
    Installed, every real collection is timed under its generation; the
    collections and collected objects are the interpreter's own counts.
    """
    registry, _ = watched
    before = pauseCount(registry, 2)
    gc.collect()
    gc.collect()
    assert pauseCount(registry, 2) == before + 2
    earlier = gc.get_stats()
    found = samples(registry)
    later = gc.get_stats()
    for generation in range(3):
        labels = (("generation", str(generation)),)
        for series, stat in (
            ("svc_python_gc_collections_total", "collections"),
            ("svc_python_gc_collected_objects_total", "collected"),
        ):
            value = found[series, labels]
            assert earlier[generation][stat] <= value <= later[generation][stat]


def test_uninstall(watched: tuple[CollectorRegistry, CollectorMetrics]) -> None:
    """
    Uninstalled, collections are no longer timed; installing twice adds
    one callback.
    """
    registry, metrics = watched
    metrics.install()
    assert gc.callbacks.count(metrics._callback) == 1
    metrics.uninstall()
    before = pauseCount(registry, 2)
    gc.collect()
    assert pauseCount(registry, 2) == before
