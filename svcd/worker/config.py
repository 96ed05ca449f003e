"""
svc-worker's configuration, read once from the environment (decisions
D13; the variables it shares with svc-proxy mean the same there, see
docs/operations.rst, "svc-worker").

A missing or bad value raises L{ConfigError} naming the variable; the tap
turns it into one line on stderr and a non-zero exit. The worker has
nothing to do without memory: SVC_MEMORY_GRPC_ADDR, SVC_AUTH_GRPC_ADDR
and a providers file with a C{[memory]} table are required.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import attrs

from svcd.common import config
from svcd.common.config import (
    ConfigError,
    GrpcTLS,
    RedisTarget,
    SentinelTarget,
    budgetTiming,
    grpcAddress,
    grpcTLS,
    parseRedisTarget,
)
from svcd.ledger.journalfile import journalFromEnvironment
from svcd.providers.providersfile import VARIABLE, providersFromEnvironment
from svcd.providers.table import MemoryConfig, ProviderTable

# The most observations one claim may take (svc-memory's bound).
MAX_CLAIM = 100


@attrs.frozen
class WorkerConfig:
    """
    Everything svc-worker reads from its environment.

    @ivar lease: seconds a claimed observation is the worker's
        (SVC_WORKER_LEASE); its processing is cut before the lease ends.
    @ivar maxAttempts: failed attempts before an observation is kept as
        failed (SVC_WORKER_MAX_ATTEMPTS).
    @ivar concurrency: observations processed at once
        (SVC_WORKER_CONCURRENCY).
    @ivar pollInterval: how long the worker waits before claiming again
        after a claim found nothing due (SVC_WORKER_POLL_INTERVAL).
    """

    memoryGrpcAddr: str
    authGrpcAddr: str
    providers: ProviderTable
    memoryTLS: GrpcTLS | None = None
    authTLS: GrpcTLS | None = None
    redis: RedisTarget | SentinelTarget | None = None
    host: str = "0.0.0.0"
    port: int = 8083
    lease: float = 60.0
    maxAttempts: int = 8
    concurrency: int = 16
    pollInterval: float = 1.0
    memoryTimeout: float = 5.0
    # As the proxy's (svcd/proxy/config.py): svc-memory refuses a
    # connection's calls past its SVC_GRPC_MAX_CALLS_PER_PEER (16), and a
    # worker with SVC_WORKER_CONCURRENCY observations in hand makes several
    # calls for each; unbounded, a backlog's drain was refused by the
    # thousand (bench/worker_drain.py).
    memoryMaxInFlight: int = 8
    redisTimeout: float = 0.1
    usageOutboxMax: int = 100_000
    usageJournal: str | None = None
    budgetLease: float = 30.0
    budgetRecordGrace: float = 300.0
    budgetReconcileInterval: float = 30.0
    shutdownTimeout: float = 10.0
    environment: str = "development"
    serviceName: str = "svc-worker"
    errorDocsBase: str | None = None

    @property
    def memory(self) -> MemoryConfig:
        """
        The providers file's C{[memory]} table (checked present at start).
        """
        memory = self.providers.memory
        assert memory is not None
        return memory

    @classmethod
    def fromEnvironment(
        cls, environ: Mapping[str, str], clock: Callable[[], float] = time.time
    ) -> WorkerConfig:
        """
        Read and check every variable, and the providers file.

        @raise ConfigError: naming the first variable that is missing or has
            a value the worker cannot use.
        """
        providers = providersFromEnvironment(environ, clock)
        if providers is None:
            raise ConfigError(
                VARIABLE, "is required: svc-worker calls the models of its [memory] table"
            )
        if providers.memory is None:
            raise ConfigError(
                VARIABLE,
                f"{providers.path}: has no [memory] table; svc-worker needs its"
                " embedding_model (and extraction_model, if any)",
            )
        lease = config.duration(environ, "SVC_WORKER_LEASE", 60.0)
        if not 5.0 <= lease <= 3600.0:
            raise ConfigError("SVC_WORKER_LEASE", "must be from 5s to 3600s")
        concurrency = config.positiveInteger(environ, "SVC_WORKER_CONCURRENCY", 16)
        if concurrency > 1000:
            raise ConfigError("SVC_WORKER_CONCURRENCY", "must be at most 1000")
        return cls(
            memoryGrpcAddr=grpcAddress(environ, "SVC_MEMORY_GRPC_ADDR"),
            authGrpcAddr=grpcAddress(environ, "SVC_AUTH_GRPC_ADDR"),
            providers=providers,
            memoryTLS=grpcTLS(
                environ,
                ("SVC_MEMORY_GRPC_TLS_CA", "SVC_MEMORY_GRPC_TLS_CERT", "SVC_MEMORY_GRPC_TLS_KEY"),
            ),
            authTLS=grpcTLS(environ),
            redis=parseRedisTarget(config.text(environ, "REDIS_URL", "")),
            host=config.text(environ, "SVC_HOST", "0.0.0.0") or "0.0.0.0",
            port=config.port(environ, "SVC_PORT", 8083),
            lease=lease,
            maxAttempts=config.positiveInteger(environ, "SVC_WORKER_MAX_ATTEMPTS", 8),
            concurrency=concurrency,
            pollInterval=config.duration(environ, "SVC_WORKER_POLL_INTERVAL", 1.0),
            memoryTimeout=config.duration(environ, "SVC_WORKER_MEMORY_TIMEOUT", 5.0),
            memoryMaxInFlight=config.positiveInteger(environ, "SVC_MEMORY_MAX_IN_FLIGHT", 8),
            redisTimeout=config.duration(environ, "SVC_REDIS_TIMEOUT", 0.1),
            usageOutboxMax=config.positiveInteger(environ, "SVC_USAGE_OUTBOX_MAX", 100_000),
            usageJournal=journalFromEnvironment(environ, "SVC_USAGE_JOURNAL"),
            shutdownTimeout=config.duration(environ, "SVC_SHUTDOWN_TIMEOUT", 10.0),
            environment=config.choice(
                environ, "SVC_ENV", "development", ("development", "staging", "production")
            ),
            serviceName=config.text(environ, "SVC_SERVICE_NAME", "svc-worker") or "svc-worker",
            errorDocsBase=config.text(environ, "SVC_ERROR_DOCS_BASE", "") or None,
            **budgetTiming(environ),
        )
