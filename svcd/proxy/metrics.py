"""
The Prometheus series of svc-proxy (spec 4.2), on a registry of its own.

Labels hold route templates, method names from a fixed set and status
codes only: never an org id, an agent id or a raw path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from svcd.common.metrics import BUCKETS, Children, processUpGauge

if TYPE_CHECKING:
    from svcd.providers.records import Usage

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

# Methods outside this set share one label value, so that a client
# inventing methods cannot inflate the number of series.
_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def methodLabel(method: str) -> str:
    """
    The C{method} label value of a request method.
    """
    return method if method in _KNOWN_METHODS else "OTHER"


class ProxyMetrics:
    """
    Every series svc-proxy exports.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "svc_proxy_requests",
            "HTTP requests answered, by route template, method and status code",
            ["route", "method", "code"],
            registry=self.registry,
        )
        self.requestDuration = Histogram(
            "svc_proxy_request_duration_seconds",
            "Time from receiving a request to having its answer ready",
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.rateLimited = Counter(
            "svc_proxy_rate_limited",
            "Requests refused with 429 RATE_LIMITED",
            registry=self.registry,
        )
        self.authValidateDuration = Histogram(
            "svc_proxy_auth_validate_duration_seconds",
            "Duration of each ValidateToken and ValidateAgent call to svc-auth, by gRPC"
            " status (lowercase) or 'error' for a failure without one",
            ["result"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.authCacheHits = Counter(
            "svc_proxy_auth_cache_hits",
            "Validations answered from the proxy's memory, by call (token or agent)",
            ["call"],
            registry=self.registry,
        )
        self.authCacheMisses = Counter(
            "svc_proxy_auth_cache_misses",
            "Validations the cache could not answer (sent to svc-auth, or refused"
            " without a call), by call (token or agent)",
            ["call"],
            registry=self.registry,
        )
        self.authLocalRefusals = Counter(
            "svc_proxy_auth_local_refusals",
            "Bearers refused 401 by the proxy itself, by reason: unknown_token (an id"
            " svc-auth does not know) or failure_budget (too many refused secrets for"
            " one token id this second)",
            ["reason"],
            registry=self.registry,
        )
        self.authFeedUp = Gauge(
            "svc_proxy_auth_feed_up",
            "1 while svc-auth's change feed is live and the validation cache is trusted, else 0",
            registry=self.registry,
        )
        self.upstreamRequests = Counter(
            "svc_proxy_upstream_requests",
            "Requests forwarded to a provider, by provider, model (the gateway's name)"
            " and status (the provider's HTTP status, or timeout, connect_error, invalid,"
            " broken, stream_timeout, stream_broken, stream_invalid, cancelled)",
            ["provider", "model", "status"],
            registry=self.registry,
        )
        self.upstreamDuration = Histogram(
            "svc_proxy_upstream_duration_seconds",
            "Time of each request to a provider, to its whole answer or stream's end",
            ["provider"],
            buckets=UPSTREAM_BUCKETS,
            registry=self.registry,
        )
        self.upstreamTokens = Counter(
            "svc_proxy_upstream_tokens",
            "Tokens the providers counted, by provider, model and kind (prompt or completion)",
            ["provider", "model", "kind"],
            registry=self.registry,
        )
        self.limitRefusals = Counter(
            "svc_proxy_limit_refusals",
            "Requests refused 429 by a limits row (decisions D11), by limit (requests or"
            " tokens) and scope (org or agent)",
            ["limit", "scope"],
            registry=self.registry,
        )
        self.tokensReserved = Counter(
            "svc_proxy_tokens_reserved",
            "Tokens reserved at admission against token limits (decisions D11)",
            registry=self.registry,
        )
        self.tokensSettled = Counter(
            "svc_proxy_tokens_settled",
            "Tokens the reservations were settled to (decisions D11): the provider's"
            " usage, 0 for an answer that failed before its first byte, the reservation"
            " itself when no usage came",
            registry=self.registry,
        )
        self.reservationOverruns = Counter(
            "svc_proxy_reservation_overruns",
            "Settlements whose cost passed the budget reservation's worst case (decisions"
            " D12, amended): a provider answered more than the cap it was sent allows;"
            " billed as the provider reported it",
            registry=self.registry,
        )
        self.ratelimitCircuitOpen = Gauge(
            "svc_proxy_ratelimit_circuit_open",
            "1 while the rate limiter skips Redis after a failure (decisions D10), else 0",
            registry=self.registry,
        )
        self.protocolErrors = Counter(
            "svc_proxy_protocol_errors",
            "Requests refused by the HTTP parser before the application (decisions D10),"
            " by reason: request_line_too_long (414), headers_too_large and"
            " too_many_headers (431), bad_request_line, bad_header, bad_length and"
            " bad_chunk (400)",
            ["reason"],
            registry=self.registry,
        )
        self.usageOutboxRows = Gauge(
            "svc_proxy_usage_outbox_rows",
            "Usage rows waiting in the proxy until svc-auth has committed them (decisions"
            " D12); at SVC_USAGE_OUTBOX_MAX forwarded requests are refused 503",
            registry=self.registry,
        )
        self.usageRowsSent = Counter(
            "svc_proxy_usage_rows_sent",
            "Usage rows svc-auth acknowledged (committed) (decisions D12)",
            registry=self.registry,
        )
        self.usageRowsRejected = Counter(
            "svc_proxy_usage_rows_rejected",
            "Usage rows svc-auth refused for good (decisions D12, amended), set aside in"
            " the journal's rejects file (or the log without a journal), by reason:"
            " invalid (a value the ledger cannot hold, or a row an older svc-auth"
            " refused with INVALID_ARGUMENT), conflict (its ledger id recorded with"
            " other content), other",
            ["reason"],
            registry=self.registry,
        )
        self.uncheckedAdmissions = Counter(
            "svc_proxy_unchecked_admissions",
            "Requests let through without checking a limit or a budget (decisions D12,"
            " amended), by reason: redis_unavailable (not connected to Redis), breaker_open"
            " (Redis skipped after a failure), redis_failed (the call failed or missed its"
            " deadline), spend_unknown (a budget left out: the ledger could not say its"
            " spend)",
            ["reason"],
            registry=self.registry,
        )
        # Every reason exported from the start at 0, so that an alert on
        # its rate sees the first one.
        for reason in ("redis_unavailable", "breaker_open", "redis_failed", "spend_unknown"):
            self.uncheckedAdmissions.labels(reason)
        self.memoryRecalls = Counter(
            "svc_proxy_memory_recalls",
            "Recalls of chat completions (decisions D13), by outcome: ok (memories"
            " injected), empty (none found at or above min_score, or none fits"
            " max_context_tokens), timeout (SVC_MEMORY_TIMEOUT passed), error (the"
            " embedding or svc-memory failed); after a timeout or an error the request"
            " went on without memories",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("ok", "empty", "timeout", "error"):
            self.memoryRecalls.labels(outcome)
        self.processUp = processUpGauge(self.registry)
        # Route templates, known methods and status codes: a small, bounded
        # set of children, looked up once each.
        self._children = Children()

    def observeRequest(self, route: str, method: str, code: int, seconds: float) -> None:
        """
        Count one answered request and record its duration.
        """
        self._children.of(self.requests, route, methodLabel(method), str(code)).inc()
        self.requestDuration.observe(seconds)

    def observeAuthCall(self, result: str, seconds: float) -> None:
        """
        Record the duration of one call to svc-auth and how it ended.
        """
        self._children.of(self.authValidateDuration, result).observe(seconds)

    def authCacheHit(self, call: str) -> None:
        self._children.of(self.authCacheHits, call).inc()

    def authCacheMiss(self, call: str) -> None:
        self._children.of(self.authCacheMisses, call).inc()

    def authLocalRefusal(self, reason: str) -> None:
        self._children.of(self.authLocalRefusals, reason).inc()

    def usageRowRejected(self, reason: str) -> None:
        self._children.of(self.usageRowsRejected, reason).inc()

    def memoryRecall(self, outcome: str) -> None:
        self._children.of(self.memoryRecalls, outcome).inc()

    def limitRefusal(self, limit: str, scope: str) -> None:
        self._children.of(self.limitRefusals, limit, scope).inc()

    def watchFeed(self, live: Callable[[], bool]) -> None:
        """
        Make svc_proxy_auth_feed_up read C{live} at every scrape.
        """
        self.authFeedUp.set_function(lambda: 1.0 if live() else 0.0)

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
