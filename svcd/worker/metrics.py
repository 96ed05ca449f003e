"""
The Prometheus series of svc-worker (decisions D13), on a registry of its
own: what happened to each observation, how long it took, and the
provider calls, limits and ledger rows behind it (the same series as
svc-proxy's, under svc_worker_*: L{svcd.metered.metrics}).

Labels are fixed words, provider and model names from the providers file:
never an org id, an agent id or content.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from svcd.common.metrics import processUpGauge
from svcd.metered.metrics import ProviderCallMetrics

# What became of a claimed observation: its memories stored (DONE), nothing
# worth remembering in it (EMPTY), refused by a limit or a budget and
# waiting for it (DEFERRED), a failed attempt to be tried again (RETRY),
# kept as failed after its last attempt or a fault no attempt can mend
# (FAILED), handed back unfinished at a stop (RELEASED), or abandoned
# because its lease had passed to another claim (LOST: it had run out and
# another claim took it, or it was dropped meanwhile), or because a deletion
# of its scope or agent took it while it was processed (FORGOTTEN: nothing
# stored; decisions D13, amended).
DONE = "done"
EMPTY = "empty"
DEFERRED = "deferred"
RETRY = "retry"
FAILED = "failed"
RELEASED = "released"
LOST = "lost"
FORGOTTEN = "forgotten"
OUTCOMES = (DONE, EMPTY, DEFERRED, RETRY, FAILED, RELEASED, LOST, FORGOTTEN)

# An observation takes a provider call or two and a few calls to
# svc-memory: tens of milliseconds to a minute.
OBSERVATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class WorkerMetrics(ProviderCallMetrics):
    """
    Every series svc-worker exports: its own, and the provider calls',
    admission's and ledger rows' under C{svc_worker_}.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        super().__init__("svc_worker", self.registry, "Provider calls", "the worker claims nothing")
        self.observations = Counter(
            "svc_worker_observations",
            "Claimed observations by what became of them: done, empty (nothing to"
            " remember), deferred (a limit or budget refused; waits, no attempt counted),"
            " retry (a failed attempt), failed (kept as failed), released (handed back at"
            " a stop), lost (its lease had passed to another claim: abandoned, nothing"
            " stored), forgotten (a deletion of its scope or agent took it: nothing stored)",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in OUTCOMES:
            self.observations.labels(outcome)
        self.observationSeconds = Histogram(
            "svc_worker_observation_seconds",
            "Time from an observation's claim to its end (completed, released or failed)",
            buckets=OBSERVATION_BUCKETS,
            registry=self.registry,
        )
        self.inFlight = Gauge(
            "svc_worker_observations_in_flight",
            "Observations claimed and being processed now",
            registry=self.registry,
        )
        self.leaseRenewals = Counter(
            "svc_worker_lease_renewals",
            "Leases of observations renewed while they were processed (each a third of"
            " SVC_WORKER_LEASE); a steady rate means extractions slower than that",
            registry=self.registry,
        )
        self.memoriesWritten = Counter(
            "svc_worker_memories",
            "Memories written by action: added (new), updated (the scope's nearest one"
            " at or above dedupe_score took the new content)",
            ["action"],
            registry=self.registry,
        )
        for action in ("added", "updated"):
            self.memoriesWritten.labels(action)
        self.feedUp = Gauge(
            "svc_worker_auth_feed_up",
            "1 while svc-auth's change feed is live (limits and budgets are known), else 0;"
            " the worker claims nothing while it is 0",
            registry=self.registry,
        )
        self.processUp = processUpGauge(self.registry)

    def observed(self, outcome: str, seconds: float) -> None:
        """
        One claimed observation ended with C{outcome} after C{seconds}.
        """
        self._children.of(self.observations, outcome).inc()
        self.observationSeconds.observe(seconds)

    def renewed(self) -> None:
        """
        The lease of an observation in hand was renewed.
        """
        self.leaseRenewals.inc()

    def wrote(self, action: str) -> None:
        self._children.of(self.memoriesWritten, action).inc()

    def watchFeed(self, live: Callable[[], bool]) -> None:
        self.feedUp.set_function(lambda: 1.0 if live() else 0.0)
