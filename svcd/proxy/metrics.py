"""
The Prometheus series of svc-proxy (spec 4.2), on a registry of its own.

Labels hold route templates, method names from a fixed set and status
codes only: never an org id, an agent id or a raw path.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from svcd.common.metrics import BUCKETS, processUpGauge
from svcd.metered.metrics import ProviderCallMetrics

# Methods outside this set share one label value, so that a client
# inventing methods cannot inflate the number of series.
_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def methodLabel(method: str) -> str:
    """
    The C{method} label value of a request method.
    """
    return method if method in _KNOWN_METHODS else "OTHER"


class ProxyMetrics(ProviderCallMetrics):
    """
    Every series svc-proxy exports: its own, and the provider calls',
    admission's and ledger rows' under C{svc_proxy_}.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        super().__init__(
            "svc_proxy", self.registry, "Requests", "forwarded requests are refused 503"
        )
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
        self.protocolErrors = Counter(
            "svc_proxy_protocol_errors",
            "Requests refused by the HTTP parser before the application (decisions D10),"
            " by reason: request_line_too_long (414), headers_too_large and"
            " too_many_headers (431), bad_request_line, bad_header, bad_length and"
            " bad_chunk (400)",
            ["reason"],
            registry=self.registry,
        )
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
        self.deploymentRequests = Counter(
            "svc_proxy_deployment_requests",
            "Tries of requests on the deployments of models (decisions D15), by model,"
            " deployment and outcome: ok, failed (before the client's first byte; the"
            " next try followed), rate_limited (a 429), rejected (the provider refused"
            " the request, 4xx), broken (after the client's first byte) or cancelled",
            ["model", "deployment", "outcome"],
            registry=self.registry,
        )
        self.deploymentInFlight = Gauge(
            "svc_proxy_deployment_in_flight",
            "Tries in flight on each deployment of a model, on this proxy",
            ["model", "deployment"],
            registry=self.registry,
        )
        self.deploymentCooldowns = Counter(
            "svc_proxy_deployment_cooldowns",
            "Cooldowns begun by deployments of models (decisions D15), by reason:"
            " rate_limited (a 429) or failures (cooldown_failures failures within 10 s)",
            ["model", "deployment", "reason"],
            registry=self.registry,
        )
        self.processUp = processUpGauge(self.registry)

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

    def memoryRecall(self, outcome: str) -> None:
        self._children.of(self.memoryRecalls, outcome).inc()

    def deploymentStarted(self, model: str, deployment: str) -> None:
        self._children.of(self.deploymentInFlight, model, deployment).inc()

    def deploymentEnded(self, model: str, deployment: str, outcome: str) -> None:
        children = self._children
        children.of(self.deploymentInFlight, model, deployment).dec()
        children.of(self.deploymentRequests, model, deployment, outcome).inc()

    def deploymentCooled(self, model: str, deployment: str, reason: str) -> None:
        self._children.of(self.deploymentCooldowns, model, deployment, reason).inc()

    def watchFeed(self, live: Callable[[], bool]) -> None:
        """
        Make svc_proxy_auth_feed_up read C{live} at every scrape.
        """
        self.authFeedUp.set_function(lambda: 1.0 if live() else 0.0)
