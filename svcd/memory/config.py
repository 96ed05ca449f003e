"""
svc-memory's configuration, read once from the environment (decisions
D13; the variables it shares with svc-auth mean the same there, see
docs/operations.rst).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
import psycopg

from svcd.auth.callers import BadSubjects, parseSubjects
from svcd.common import config
from svcd.common.grpcserver import ServerTLS, isLoopback

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
# (svcd/memory/search.py); 0: never.
DEFAULT_PARALLEL_ROWS = 32_768
DEFAULT_DONE_RETENTION = 3600.0


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
    # How long a processed observation's request id is remembered, so that
    # a proxy's journal resending it is answered without a second
    # extraction (sql/0014_observations_done.sql).
    doneRetention: float = DEFAULT_DONE_RETENTION

    @classmethod
    def fromEnvironment(cls, environ: Mapping[str, str]) -> "MemoryConfig":
        dsn = config.required(environ, "POSTGRES_DSN")
        try:
            psycopg.conninfo.conninfo_to_dict(dsn)
        except psycopg.ProgrammingError:
            raise config.ConfigError(
                "POSTGRES_DSN", "is not a valid PostgreSQL connection string"
            ) from None
        environment = config.choice(
            environ, "SVC_ENV", "development", ("development", "staging", "production")
        )
        grpcHost = config.text(environ, "SVC_GRPC_HOST", "127.0.0.1")
        tls = _serverTLS(environ)
        internalSubjects = _internalSubjects(environ, tls)
        if environment == "production" and tls is None and not isLoopback(grpcHost):
            raise config.ConfigError(
                "SVC_GRPC_HOST",
                f"refusing plaintext gRPC on the non-loopback address {grpcHost} with "
                "SVC_ENV=production; set SVC_GRPC_TLS_CERT, SVC_GRPC_TLS_KEY and "
                "SVC_GRPC_TLS_CLIENT_CA",
            )
        minimum = config.positiveInteger(environ, "SVC_DB_POOL_MIN", 2)
        maximum = config.positiveInteger(environ, "SVC_DB_POOL_MAX", 10)
        if maximum < minimum:
            raise config.ConfigError("SVC_DB_POOL_MAX", "must not be below SVC_DB_POOL_MIN")
        return cls(
            postgresDSN=dsn,
            host=config.text(environ, "SVC_HOST", "0.0.0.0"),
            port=config.port(environ, "SVC_PORT", 8082),
            grpcHost=grpcHost,
            grpcPort=config.port(environ, "SVC_GRPC_PORT", 9092),
            grpcWorkers=config.positiveInteger(environ, "SVC_GRPC_WORKERS", 32),
            grpcMaxCallsPerPeer=config.positiveInteger(environ, "SVC_GRPC_MAX_CALLS_PER_PEER", 16),
            databasePoolMinimum=minimum,
            databasePoolMaximum=maximum,
            statementTimeout=config.duration(environ, "SVC_DB_STATEMENT_TIMEOUT", 5.0),
            shutdownTimeout=config.duration(environ, "SVC_SHUTDOWN_TIMEOUT", 10.0),
            environment=environment,
            serviceName=config.text(environ, "SVC_SERVICE_NAME", "svc-memory") or "svc-memory",
            errorDocsBase=config.text(environ, "SVC_ERROR_DOCS_BASE", "") or None,
            tls=tls,
            internalSubjects=internalSubjects,
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
        )


def _readPEM(environ: Mapping[str, str], name: str) -> bytes | None:
    path = config.text(environ, name, "")
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise config.ConfigError(name, f"cannot read {path}: {error.strerror}") from None


def _serverTLS(environ: Mapping[str, str]) -> ServerTLS | None:
    certificate = _readPEM(environ, "SVC_GRPC_TLS_CERT")
    key = _readPEM(environ, "SVC_GRPC_TLS_KEY")
    clientCA = _readPEM(environ, "SVC_GRPC_TLS_CLIENT_CA")
    if certificate is None and key is None:
        if clientCA is not None:
            raise config.ConfigError(
                "SVC_GRPC_TLS_CLIENT_CA", "needs SVC_GRPC_TLS_CERT and SVC_GRPC_TLS_KEY too"
            )
        return None
    if certificate is None:
        raise config.ConfigError("SVC_GRPC_TLS_CERT", "is required with SVC_GRPC_TLS_KEY")
    if key is None:
        raise config.ConfigError("SVC_GRPC_TLS_KEY", "is required with SVC_GRPC_TLS_CERT")
    return ServerTLS(certificate=certificate, privateKey=key, clientCA=clientCA)


_SUBJECTS = "SVC_GRPC_INTERNAL_SUBJECTS"


def _internalSubjects(environ: Mapping[str, str], tls: ServerTLS | None) -> frozenset[str] | None:
    """
    Every method of MemoryService is internal (only svc-proxy and
    svc-worker call it): with mutual TLS the list is required and checked
    on every call, as svc-auth's is on its internal methods.
    """
    raw = config.text(environ, _SUBJECTS, "")
    mutual = tls is not None and tls.clientCA is not None
    if not raw:
        if mutual:
            raise config.ConfigError(
                _SUBJECTS,
                "is required with SVC_GRPC_TLS_CLIENT_CA: name the client certificates "
                "(common name or DNS name, comma-separated) that may call MemoryService, "
                "such as the proxies' and the workers'",
            )
        return None
    if not mutual:
        raise config.ConfigError(
            _SUBJECTS,
            "needs mutual TLS (SVC_GRPC_TLS_CERT, SVC_GRPC_TLS_KEY and "
            "SVC_GRPC_TLS_CLIENT_CA): without client certificates there is no subject to check",
        )
    try:
        return parseSubjects(raw)
    except BadSubjects as error:
        raise config.ConfigError(_SUBJECTS, str(error)) from None
