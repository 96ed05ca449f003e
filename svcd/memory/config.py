"""
svc-memory's configuration, read once from the environment (decisions
D13; the variables it shares with svc-auth mean the same there, see
docs/operations.rst).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from svcd.common import config
from svcd.common.grpcserver import ServerTLS
from svcd.common.internalcallers import BadSubjects, parseSubjects
from svcd.common.serversettings import ServerDefaults, readDatabaseServer
from svcd.memory.callers import WORKER_VARIABLE

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
# The observations one organization may have waiting for the worker
# (decisions D13, amended): at one svc-worker's 200 a second (bench/README)
# over eight minutes of its time.
DEFAULT_MAX_WAITING_PER_ORG = 100_000


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
    # MemoryService's methods other than the worker's (the proxies'), and
    # those that may call the worker's (svcd.memory.callers.WORKER_METHODS);
    # both set exactly when mutual TLS is.
    internalSubjects: frozenset[str] | None = None
    workerSubjects: frozenset[str] | None = None
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
    # Past it an organization's new observations are refused "queue_full"
    # (a POST of a conversation is 429 MEMORY_QUEUE_FULL), so that one
    # organization's flood cannot fill the database or the workers' day.
    maxWaitingPerOrg: int = DEFAULT_MAX_WAITING_PER_ORG

    @classmethod
    def fromEnvironment(cls, environ: Mapping[str, str]) -> "MemoryConfig":
        server = readDatabaseServer(
            environ,
            ServerDefaults(
                serviceName="svc-memory",
                port=8082,
                grpcPort=9092,
                grpcWorkers=32,
                grpcMaxCallsPerPeer=16,
                statementTimeout=5.0,
                internalCallers="MemoryService's methods other than the worker's, such as"
                " the proxies'",
            ),
        )
        return cls(
            **server,
            workerSubjects=readWorkerSubjects(environ, server["internalSubjects"] is not None),
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
            maxWaitingPerOrg=config.positiveInteger(
                environ, "SVC_MEMORY_MAX_WAITING_PER_ORG", DEFAULT_MAX_WAITING_PER_ORG
            ),
        )


def readWorkerSubjects(environ: Mapping[str, str], mutual: bool) -> frozenset[str] | None:
    """
    The names of C{SVC_GRPC_WORKER_SUBJECTS}, by the rules of
    C{SVC_GRPC_INTERNAL_SUBJECTS} (L{svcd.common.serversettings.readInternalSubjects}):
    required with mutual TLS, refused without it.

    Required rather than defaulted: defaulting to the internal subjects
    would keep a deployment that upgrades without reading the notes
    exactly as exposed as before (every proxy's certificate able to claim
    every organization's conversations) and say nothing; defaulting to
    none would deny the workers and let the queue grow with nothing but a
    metric to show it. A replica that refuses to start stops a rolling
    upgrade at its first host while the others serve on, with one line
    naming the variable.

    @param mutual: whether the server asks client certificates (the
        internal subjects were read, as they are exactly then).
    """
    raw = config.text(environ, WORKER_VARIABLE, "")
    if not raw:
        if mutual:
            raise config.ConfigError(
                WORKER_VARIABLE,
                "is required with SVC_GRPC_TLS_CLIENT_CA: name the client certificates "
                "(common name or DNS name, comma-separated) of the workers, which alone may "
                "claim, renew, store and release observations",
            )
        return None
    if not mutual:
        raise config.ConfigError(
            WORKER_VARIABLE,
            "needs mutual TLS (SVC_GRPC_TLS_CERT, SVC_GRPC_TLS_KEY and "
            "SVC_GRPC_TLS_CLIENT_CA): without client certificates there is no subject to check",
        )
    try:
        return parseSubjects(raw)
    except BadSubjects as error:
        raise config.ConfigError(WORKER_VARIABLE, str(error)) from None
