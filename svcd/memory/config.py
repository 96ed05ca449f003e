"""
svc-memory's configuration, read once from the environment (decisions
D13; the variables it shares with svc-auth mean the same there, see
docs/operations.rst).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from svcd.auth.serving import ServerDefaults, readDatabaseServer
from svcd.common import config
from svcd.common.grpcserver import ServerTLS

# The memories one agent may keep about one subject.
DEFAULT_MAX_PER_SCOPE = 10_000
# The replica's cache of vectors, in MiB.
DEFAULT_CACHE_MB = 512
# Its cache of records (what searches answer of each memory), in MiB: a
# memory of short text takes about 440 bytes there against 3,291 for a
# vector of 768 dimensions, so this holds the records of what the default
# cache of vectors holds unless contents average over about 400 characters.
DEFAULT_RECORD_CACHE_MB = 128
# From how many memories a search's product is split over the cores
# (svcd/memory/search.py); 0: never. Between two gRPC calls the core's
# caches hold other work, so a search reads its matrix from memory: from
# about 6 MB (2,048 rows of 768 dimensions, beyond a core's L2 here) two
# cores read it faster than one even counting the hand-off (bench/README,
# eighteenth round: 3,000 rows 1.55 against 1.9 ms p50; 1,000 rows no
# faster split).
DEFAULT_PARALLEL_ROWS = 2_048
# SVC_MEMORY_PARALLEL_ROWS counts rows of this many dimensions: a scope of
# fewer needs as many more rows to be split (its bytes are what count;
# issue 44: 10,000 rows of 64 dimensions, 2.5 MB, were split).
PARALLEL_DIMENSIONS = 768
DEFAULT_DONE_RETENTION = 3600.0
# Seven days.
DEFAULT_FAILED_RETENTION = 7 * 24 * 3600.0


@attrs.frozen
class MemoryConfig:
    postgresDSN: str = attrs.field(repr=False)
    host: str = "0.0.0.0"
    port: int = 8082
    grpcHost: str = "127.0.0.1"
    grpcPort: int = 9092
    # Calls served at once (one thread each) in total and per client
    # connection: searches hold a thread for their product, and the
    # product releases the GIL, so a few per core.
    grpcWorkers: int = 32
    grpcMaxCallsPerPeer: int = 16
    databasePoolMinimum: int = 2
    databasePoolMaximum: int = 10
    statementTimeout: float = 5.0
    shutdownTimeout: float = 10.0
    environment: str = "development"
    serviceName: str = "svc-memory"
    errorDocsBase: str | None = None
    tls: ServerTLS | None = None
    # The client certificates (common name or DNS name) that may call
    # MemoryService at all; set exactly when mutual TLS is.
    internalSubjects: frozenset[str] | None = None
    maxPerScope: int = DEFAULT_MAX_PER_SCOPE
    cacheBytes: int = DEFAULT_CACHE_MB * 1024 * 1024
    recordCacheBytes: int = DEFAULT_RECORD_CACHE_MB * 1024 * 1024
    parallelRows: int = DEFAULT_PARALLEL_ROWS
    # How long a processed observation's key is remembered, so that a
    # proxy's journal resending it is answered without a second extraction
    # (sql/0014_observations_done.sql, sql/0015_observation_key.sql).
    doneRetention: float = DEFAULT_DONE_RETENTION
    # How long an observation failed for good keeps its messages for
    # svcctl memory jobs retry before it is deleted (decisions D13,
    # amended; sql/0017_forgetting.sql).
    failedRetention: float = DEFAULT_FAILED_RETENTION

    @classmethod
    def fromEnvironment(cls, environ: Mapping[str, str]) -> "MemoryConfig":
        return cls(
            **readDatabaseServer(
                environ,
                ServerDefaults(
                    serviceName="svc-memory",
                    port=8082,
                    grpcPort=9092,
                    grpcWorkers=32,
                    grpcMaxCallsPerPeer=16,
                    statementTimeout=5.0,
                    internalCallers="MemoryService, such as the proxies' and the workers'",
                ),
            ),
            maxPerScope=config.positiveInteger(
                environ, "SVC_MEMORY_MAX_PER_SCOPE", DEFAULT_MAX_PER_SCOPE
            ),
            cacheBytes=config.positiveInteger(environ, "SVC_MEMORY_CACHE_MB", DEFAULT_CACHE_MB)
            * 1024
            * 1024,
            recordCacheBytes=config.positiveInteger(
                environ, "SVC_MEMORY_RECORD_CACHE_MB", DEFAULT_RECORD_CACHE_MB
            )
            * 1024
            * 1024,
            parallelRows=config.nonNegativeInteger(
                environ, "SVC_MEMORY_PARALLEL_ROWS", DEFAULT_PARALLEL_ROWS
            ),
            doneRetention=config.duration(
                environ, "SVC_MEMORY_DONE_RETENTION", DEFAULT_DONE_RETENTION
            ),
            failedRetention=config.duration(
                environ, "SVC_MEMORY_FAILED_RETENTION", DEFAULT_FAILED_RETENTION
            ),
        )
