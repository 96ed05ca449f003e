"""
What svc-memory publishes (docs/operations.rst, "Metrics"), and the
callables its caches report through.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from svcd.common.metrics import BUCKETS, Children
from svcd.memory.vectorcache import CacheMetrics


class MemoryMetrics:
    """
    What svc-memory publishes (docs/operations.rst, "Metrics").
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "svc_memory_grpc_requests_total",
            "MemoryService calls answered, by method and status code",
            ["method", "code"],
            registry=registry,
        )
        self.refused = Counter(
            "svc_memory_grpc_refused_total",
            "gRPC calls refused before their work: past a bound on calls at once (peer,"
            " total; answered RESOURCE_EXHAUSTED) or past their deadline (deadline)",
            ["reason"],
            registry=registry,
        )
        self.searchSeconds = Histogram(
            "svc_memory_search_duration_seconds",
            "Time of one Search, by whether what it ranked by was cached (hit) or"
            " loaded from PostgreSQL first (miss), and by mode (vector, text, hybrid)",
            ["cache", "mode"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.cacheBytes = Gauge(
            "svc_memory_cache_bytes",
            "Bytes the replica's cache holds: vectors, ids and times, and text indexes",
            registry=registry,
        )
        self.cacheTextBytes = Gauge(
            "svc_memory_cache_text_bytes",
            "Of svc_memory_cache_bytes, the bytes of text indexes (scopes searched in text"
            " or hybrid mode)",
            registry=registry,
        )
        self.cacheScopes = Gauge(
            "svc_memory_cache_scopes", "Scopes the replica's cache holds", registry=registry
        )
        self.cacheHits = Counter(
            "svc_memory_cache_hits_total", "Searches of a cached scope", registry=registry
        )
        self.cacheMisses = Counter(
            "svc_memory_cache_misses_total",
            "Searches whose scope was loaded from PostgreSQL",
            registry=registry,
        )
        self.cacheEvictions = Counter(
            "svc_memory_cache_evictions_total",
            "Scopes dropped from the cache to stay within SVC_MEMORY_CACHE_MB",
            registry=registry,
        )
        self.recordCacheBytes = Gauge(
            "svc_memory_record_cache_bytes",
            "Bytes of memories' records (content, metadata, ...) the replica's cache of"
            " records holds",
            registry=registry,
        )
        self.recordCacheScopes = Gauge(
            "svc_memory_record_cache_scopes",
            "Scopes whose records the replica's cache of records holds",
            registry=registry,
        )
        self.recordCacheHits = Counter(
            "svc_memory_record_cache_hits_total",
            "Searches whose hits' records were in the cache of records",
            registry=registry,
        )
        self.recordCacheMisses = Counter(
            "svc_memory_record_cache_misses_total",
            "Searches whose scope's records were not in the cache of records (loaded from"
            " PostgreSQL, or the hits read by id)",
            registry=registry,
        )
        self.recordCacheEvictions = Counter(
            "svc_memory_record_cache_evictions_total",
            "Scopes' records dropped to stay within SVC_MEMORY_RECORD_CACHE_MB",
            registry=registry,
        )
        self.observationsWaiting = Gauge(
            "svc_memory_observations_waiting",
            "Observations waiting for svc-worker, over every organization",
            registry=registry,
        )
        self.internalDenied = Counter(
            "svc_memory_internal_calls_denied_total",
            "Calls answered PERMISSION_DENIED because the client certificate is not named"
            " in SVC_GRPC_INTERNAL_SUBJECTS (the worker's methods: SVC_GRPC_WORKER_SUBJECTS)",
            ["method"],
            registry=registry,
        )
        self.queryDuration = Histogram(
            "svc_db_query_duration_seconds",
            "Time of one database transaction, by operation",
            ["operation"],
            buckets=BUCKETS,
            registry=registry,
        )
        self._children = Children()

    def answered(self, method: str, code: str) -> None:
        self._children.of(self.requests, method, code).inc()

    def cacheMetrics(self) -> CacheMetrics:
        def size(total: int, scopes: int) -> None:
            self.cacheBytes.set(total)
            self.cacheScopes.set(scopes)

        return CacheMetrics(
            hit=self.cacheHits.inc,
            miss=self.cacheMisses.inc,
            evicted=self.cacheEvictions.inc,
            size=size,
            textSize=self.cacheTextBytes.set,
        )

    def recordCacheMetrics(self) -> CacheMetrics:
        def size(total: int, scopes: int) -> None:
            self.recordCacheBytes.set(total)
            self.recordCacheScopes.set(scopes)

        return CacheMetrics(
            hit=self.recordCacheHits.inc,
            miss=self.recordCacheMisses.inc,
            evicted=self.recordCacheEvictions.inc,
            size=size,
        )
