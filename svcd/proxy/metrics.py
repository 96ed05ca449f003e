"""
The Prometheus series of svc-proxy (spec 4.2), on a registry of its own.

Labels hold route templates, method names from a fixed set and status
codes only: never an org id, an agent id or a raw path.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from svcd.common.metrics import BUCKETS, Children, processUpGauge

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
        self.ratelimitCircuitOpen = Gauge(
            "svc_proxy_ratelimit_circuit_open",
            "1 while the rate limiter skips Redis after a failure (decisions D10), else 0",
            registry=self.registry,
        )
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
