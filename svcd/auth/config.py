"""
svc-auth's configuration, read once from the environment (spec section 8,
decisions D1).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import psycopg

from svcd.auth.serving import readInternalSubjects, refusePlaintextInProduction, serverTLS
from svcd.common import config
from svcd.common.grpcserver import ServerTLS


@attrs.frozen
class AuthConfig:
    postgresDSN: str = attrs.field(repr=False)
    host: str = "0.0.0.0"
    port: int = 8081
    grpcHost: str = "127.0.0.1"
    grpcPort: int = 9091
    # Calls served at once in total, one thread each (plus spare threads
    # for refusals): room for SVC_GRPC_MAX_CALLS_PER_PEER of one greedy
    # client and as much again for the proxies.
    grpcWorkers: int = 64
    grpcMaxCallsPerPeer: int = 32
    feedStreams: int = 64
    databasePoolMinimum: int = 2
    databasePoolMaximum: int = 10
    statementTimeout: float = 2.0
    verifyConcurrency: int = 4
    shutdownTimeout: float = 10.0
    environment: str = "development"
    serviceName: str = "svc-auth"
    errorDocsBase: str | None = None
    tls: ServerTLS | None = None
    # The client certificates (common name or DNS name) that may call
    # RecordUsage, GetSpend and WatchChanges; set exactly when mutual TLS
    # is (see svcd.auth.callers).
    internalSubjects: frozenset[str] | None = None

    @classmethod
    def fromEnvironment(cls, environ: Mapping[str, str]) -> "AuthConfig":
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
        tls = serverTLS(environ)
        internalSubjects = readInternalSubjects(
            environ, tls, "RecordUsage, GetSpend and WatchChanges, such as the proxies'"
        )
        refusePlaintextInProduction(environment, grpcHost, tls)
        minimum = config.positiveInteger(environ, "SVC_DB_POOL_MIN", 2)
        maximum = config.positiveInteger(environ, "SVC_DB_POOL_MAX", 10)
        if maximum < minimum:
            raise config.ConfigError("SVC_DB_POOL_MAX", "must not be below SVC_DB_POOL_MIN")
        return cls(
            postgresDSN=dsn,
            host=config.text(environ, "SVC_HOST", "0.0.0.0"),
            port=config.port(environ, "SVC_PORT", 8081),
            grpcHost=grpcHost,
            grpcPort=config.port(environ, "SVC_GRPC_PORT", 9091),
            grpcWorkers=config.positiveInteger(environ, "SVC_GRPC_WORKERS", 64),
            grpcMaxCallsPerPeer=config.positiveInteger(environ, "SVC_GRPC_MAX_CALLS_PER_PEER", 32),
            feedStreams=config.positiveInteger(environ, "SVC_GRPC_MAX_FEED_STREAMS", 64),
            databasePoolMinimum=minimum,
            databasePoolMaximum=maximum,
            statementTimeout=config.duration(environ, "SVC_DB_STATEMENT_TIMEOUT", 2.0),
            verifyConcurrency=config.positiveInteger(environ, "SVC_AUTH_VERIFY_CONCURRENCY", 4),
            shutdownTimeout=config.duration(environ, "SVC_SHUTDOWN_TIMEOUT", 10.0),
            environment=environment,
            serviceName=config.text(environ, "SVC_SERVICE_NAME", "svc-auth") or "svc-auth",
            errorDocsBase=config.text(environ, "SVC_ERROR_DOCS_BASE", "") or None,
            tls=tls,
            internalSubjects=internalSubjects,
        )
