"""
The series every daemon that calls providers exports, under its own
prefix (C{svc_proxy_*}, C{svc_worker_*}): the calls to providers, the
admission against limits and budgets in front of them, and the ledger
rows behind them.

svc-proxy and svc-worker share the code that does these things (the
forwarder, admission, the ledger's outbox), which counts through
Protocols (L{svcd.providers.upstream.UpstreamMetrics},
L{svcd.limits.admission.AdmissionMetrics},
L{svcd.ledger.outbox.OutboxMetrics}); L{ProviderCallMetrics} meets all
three once, so that a dashboard finds the same series under either prefix
and a series added for one daemon is there for the other.

Labels are fixed words and provider and model names from the providers
file: never an org id, an agent id or content.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from svcd.common.metrics import Children

if TYPE_CHECKING:
    from svcd.metering.usage import Usage

# A provider's answer takes seconds to minutes, not milliseconds.
UPSTREAM_BUCKETS = (
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
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)

# Why a call went without checking a limit or a budget (decisions D12,
# amended); each exported from the start at 0, so that an alert on its rate
# sees the first one.
UNCHECKED_REASONS = ("redis_unavailable", "breaker_open", "redis_failed", "spend_unknown")


class ProviderCallMetrics:
    """
    The provider calls', admission's and ledger rows' series of one daemon.

    @param prefix: the daemon's (C{svc_proxy}, C{svc_worker}).
    @param calls: what the daemon admits, as the help texts name it
        (C{"Requests"}, C{"Provider calls"}).
    @param whenOutboxFull: what the daemon does while its outbox of usage
        rows is full.
    """

    def __init__(
        self, prefix: str, registry: CollectorRegistry, calls: str, whenOutboxFull: str
    ) -> None:
        self.upstreamRequests = Counter(
            f"{prefix}_upstream_requests",
            "Requests sent to a provider, by provider, model (the gateway's name) and"
            " status (the provider's HTTP status, or timeout, connect_error, invalid,"
            " broken, stream_timeout, stream_broken, stream_invalid, cancelled)",
            ["provider", "model", "status"],
            registry=registry,
        )
        self.upstreamDuration = Histogram(
            f"{prefix}_upstream_duration_seconds",
            "Time of each request to a provider, to its whole answer or stream's end",
            ["provider"],
            buckets=UPSTREAM_BUCKETS,
            registry=registry,
        )
        self.upstreamTokens = Counter(
            f"{prefix}_upstream_tokens",
            "Tokens the providers counted, by provider, model and kind (prompt or completion)",
            ["provider", "model", "kind"],
            registry=registry,
        )
        self.rateLimited = Counter(
            f"{prefix}_rate_limited",
            f"{calls} refused by a limit or a budget (429 RATE_LIMITED or BUDGET_EXCEEDED)",
            registry=registry,
        )
        self.limitRefusals = Counter(
            f"{prefix}_limit_refusals",
            f"{calls} refused by a limits row or a budget (decisions D11, D12), by limit"
            " (requests, tokens or budget) and scope (org or agent)",
            ["limit", "scope"],
            registry=registry,
        )
        self.tokensReserved = Counter(
            f"{prefix}_tokens_reserved",
            "Tokens reserved at admission against token limits (decisions D11)",
            registry=registry,
        )
        self.tokensSettled = Counter(
            f"{prefix}_tokens_settled",
            "Tokens the reservations were settled to (decisions D11): the provider's"
            " usage, 0 for an answer that failed before its first byte, the reservation"
            " itself when no usage came",
            registry=registry,
        )
        self.reservationOverruns = Counter(
            f"{prefix}_reservation_overruns",
            "Settlements whose cost passed the budget reservation's worst case (decisions"
            " D12, amended): a provider answered more than the cap it was sent allows;"
            " billed as the provider reported it",
            registry=registry,
        )
        self.ratelimitCircuitOpen = Gauge(
            f"{prefix}_ratelimit_circuit_open",
            "1 while the rate limiter skips Redis after a failure (decisions D10), else 0",
            registry=registry,
        )
        self.uncheckedAdmissions = Counter(
            f"{prefix}_unchecked_admissions",
            f"{calls} let through without checking a limit or a budget (decisions D12,"
            " amended), by reason: redis_unavailable (not connected to Redis), breaker_open"
            " (Redis skipped after a failure), redis_failed (the call failed or missed its"
            " deadline), spend_unknown (a budget left out: the ledger could not say its"
            " spend)",
            ["reason"],
            registry=registry,
        )
        for reason in UNCHECKED_REASONS:
            self.uncheckedAdmissions.labels(reason)
        self.usageOutboxRows = Gauge(
            f"{prefix}_usage_outbox_rows",
            "Usage rows waiting until svc-auth has committed them (decisions D12); at"
            f" SVC_USAGE_OUTBOX_MAX {whenOutboxFull}",
            registry=registry,
        )
        self.usageRowsSent = Counter(
            f"{prefix}_usage_rows_sent",
            "Usage rows svc-auth acknowledged (committed) (decisions D12)",
            registry=registry,
        )
        self.usageRowsRejected = Counter(
            f"{prefix}_usage_rows_rejected",
            "Usage rows svc-auth refused for good (decisions D12, amended), set aside in"
            " the journal's rejects file (or the log without a journal), by reason:"
            " invalid (a value the ledger cannot hold, or a row an older svc-auth"
            " refused with INVALID_ARGUMENT), conflict (its ledger id recorded with"
            " other content), other",
            ["reason"],
            registry=registry,
        )
        # Provider and model names, limits, reasons, and the daemon's own
        # labels (route templates, methods, codes): a small, bounded set of
        # children, looked up once each.
        self._children = Children()

    def observeUpstream(
        self, provider: str, model: str, status: str, seconds: float, usage: Usage | None
    ) -> None:
        """
        One request to a provider: its outcome, its duration, its tokens.
        """
        children = self._children
        children.of(self.upstreamRequests, provider, model, status).inc()
        children.of(self.upstreamDuration, provider).observe(seconds)
        if usage is not None:
            children.of(self.upstreamTokens, provider, model, "prompt").inc(usage.promptTokens)
            children.of(self.upstreamTokens, provider, model, "completion").inc(
                usage.completionTokens
            )

    def limitRefusal(self, limit: str, scope: str) -> None:
        self._children.of(self.limitRefusals, limit, scope).inc()

    def usageRowRejected(self, reason: str) -> None:
        self._children.of(self.usageRowsRejected, reason).inc()
