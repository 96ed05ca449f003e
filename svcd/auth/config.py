"""
svc-auth's configuration, read once from the environment (spec section 8,
decisions D1).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
import psycopg

from svcd.auth.callers import BadSubjects, parseSubjects
from svcd.common import config
from svcd.common.grpcserver import ServerTLS, isLoopback


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
    The names of C{SVC_GRPC_INTERNAL_SUBJECTS}, required with mutual TLS
    and refused without it: unset with mutual TLS, every proxy would be
    denied its ledger, its budgets' spend and its change feed; set without
    it, there is no client certificate to check, and the list would only
    seem to protect the internal methods.
    """
    raw = config.text(environ, _SUBJECTS, "")
    mutual = tls is not None and tls.clientCA is not None
    if not raw:
        if mutual:
            raise config.ConfigError(
                _SUBJECTS,
                "is required with SVC_GRPC_TLS_CLIENT_CA: name the client certificates "
                "(common name or DNS name, comma-separated) that may call RecordUsage, "
                "GetSpend and WatchChanges, such as the proxies'",
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
