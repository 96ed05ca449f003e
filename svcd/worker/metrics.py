"""
The Prometheus series of svc-worker (decisions D13), on a registry of its
own: what happened to each observation, how long it took, and the
provider calls, limits and ledger rows behind it (the svc_proxy_* series'
counterparts, under svc_worker_*: L{svcd.providers.upstream.UpstreamMetrics},
L{svcd.limits.admission.AdmissionMetrics} and
L{svcd.ledger.outbox.OutboxMetrics} are Protocols this class meets).

Labels are fixed words, provider and model names from the providers file:
never an org id, an agent id or content.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from svcd.common.metrics import Children, processUpGauge
from svcd.providers.records import Usage

# What became of a claimed observation: its memories stored (DONE), nothing
# worth remembering in it (EMPTY), refused by a limit or a budget and
# waiting for it (DEFERRED), a failed attempt to be tried again (RETRY),
# kept as failed after its last attempt or a fault no attempt can mend
# (FAILED), handed back unfinished at a stop (RELEASED), or abandoned
# because its lease had passed to another claim (LOST: it had run out and
# another claim took it, or it was dropped or forgotten meanwhile).
DONE = "done"
EMPTY = "empty"
DEFERRED = "deferred"
RETRY = "retry"
FAILED = "failed"
RELEASED = "released"
LOST = "lost"
OUTCOMES = (DONE, EMPTY, DEFERRED, RETRY, FAILED, RELEASED, LOST)

# An observation takes a provider call or two and a few calls to
# svc-memory: tens of milliseconds to a minute.
OBSERVATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    """
    Every series svc-worker exports.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.observations = Counter(
            "svc_worker_observations",
            "Claimed observations by what became of them: done, empty (nothing to"
            " remember), deferred (a limit or budget refused; waits, no attempt counted),"
            " retry (a failed attempt), failed (kept as failed), released (handed back at"
            " a stop), lost (its lease had passed to another claim: abandoned, nothing"
            " stored)",
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
        self.upstreamRequests = Counter(
            "svc_worker_upstream_requests",
            "Requests sent to a provider, by provider, model and status (as"
            " svc_proxy_upstream_requests_total)",
            ["provider", "model", "status"],
            registry=self.registry,
        )
        self.upstreamDuration = Histogram(
            "svc_worker_upstream_duration_seconds",
            "Time of each request to a provider, to its whole answer",
            ["provider"],
            buckets=UPSTREAM_BUCKETS,
            registry=self.registry,
        )
        self.upstreamTokens = Counter(
            "svc_worker_upstream_tokens",
            "Tokens the providers counted, by provider, model and kind (prompt or completion)",
            ["provider", "model", "kind"],
            registry=self.registry,
        )
        self.rateLimited = Counter(
            "svc_worker_rate_limited",
            "Provider calls refused by a token limit or a budget (the observation waits)",
            registry=self.registry,
        )
        self.limitRefusals = Counter(
            "svc_worker_limit_refusals",
            "Provider calls refused by a limits row or budget, by limit (tokens or budget)"
            " and scope (org or agent)",
            ["limit", "scope"],
            registry=self.registry,
        )
        self.tokensReserved = Counter(
            "svc_worker_tokens_reserved",
            "Tokens reserved at admission against token limits (decisions D11)",
            registry=self.registry,
        )
        self.tokensSettled = Counter(
            "svc_worker_tokens_settled",
            "Tokens the reservations were settled to (decisions D11)",
            registry=self.registry,
        )
        self.reservationOverruns = Counter(
            "svc_worker_reservation_overruns",
            "Settlements whose cost passed the budget reservation's worst case",
            registry=self.registry,
        )
        self.ratelimitCircuitOpen = Gauge(
            "svc_worker_ratelimit_circuit_open",
            "1 while the limiter skips Redis after a failure (decisions D10), else 0",
            registry=self.registry,
        )
        self.uncheckedAdmissions = Counter(
            "svc_worker_unchecked_admissions",
            "Provider calls made without checking a limit or a budget (decisions D12,"
            " amended), by reason (as svc_proxy_unchecked_admissions_total)",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("redis_unavailable", "breaker_open", "redis_failed", "spend_unknown"):
            self.uncheckedAdmissions.labels(reason)
        self.usageOutboxRows = Gauge(
            "svc_worker_usage_outbox_rows",
            "Usage rows waiting until svc-auth has committed them (decisions D12); at"
            " SVC_USAGE_OUTBOX_MAX the worker claims nothing",
            registry=self.registry,
        )
        self.usageRowsSent = Counter(
            "svc_worker_usage_rows_sent",
            "Usage rows svc-auth acknowledged (committed)",
            registry=self.registry,
        )
        self.usageRowsRejected = Counter(
            "svc_worker_usage_rows_rejected",
            "Usage rows svc-auth refused for good, set aside in the journal's rejects file,"
            " by reason (invalid, conflict, other)",
            ["reason"],
            registry=self.registry,
        )
        self.processUp = processUpGauge(self.registry)
        self._children = Children()

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

    def usageRowRejected(self, reason: str) -> None:
        self._children.of(self.usageRowsRejected, reason).inc()

    def limitRefusal(self, limit: str, scope: str) -> None:
        self._children.of(self.limitRefusals, limit, scope).inc()

    def observeUpstream(
        self, provider: str, model: str, status: str, seconds: float, usage: Usage | None
    ) -> None:
        children = self._children
        children.of(self.upstreamRequests, provider, model, status).inc()
        children.of(self.upstreamDuration, provider).observe(seconds)
        if usage is not None:
            children.of(self.upstreamTokens, provider, model, "prompt").inc(usage.promptTokens)
            children.of(self.upstreamTokens, provider, model, "completion").inc(
                usage.completionTokens
            )
