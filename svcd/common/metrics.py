"""
Prometheus conventions shared by both daemons.

Each daemon builds its metrics on its own CollectorRegistry rather than the
process-global one, so several instances can live in one test process.
No metric is ever labelled with an org id, agent id or raw URL path.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

# Spec 4.2: histogram buckets run from 1 ms to 5 s.
BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def processUpGauge(registry: CollectorRegistry) -> Gauge:
    """
    svc_process_up: 1 while the process serves.
    """
    gauge = Gauge("svc_process_up", "1 while the process is up and serving", registry=registry)
    gauge.set(1)
    return gauge


def exposition(registry: CollectorRegistry) -> bytes:
    """
    The Prometheus text format of everything in C{registry}.
    """
    return generate_latest(registry)


class Children:
    """
    The labelled children of metrics, kept at hand.

    C{metric.labels(...)} takes a lock and builds a key on every call; on
    a hot path whose label values come from a small fixed set, look the
    child up once and reuse it. Two threads racing on a new key only make
    C{labels()} hand back the same child twice.
    """

    def __init__(self) -> None:
        self._children: dict[tuple[object, ...], Any] = {}

    def of(self, metric: MetricWrapperBase, *values: str) -> Any:
        """
        The child of C{metric} for these label values, in label order.
        """
        key = (metric, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child
