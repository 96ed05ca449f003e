"""
The settings every daemon that serves gRPC reads from its environment
(svc-auth, svc-memory; decisions D10): its TLS material, the client
certificates that may call its internal methods, and the rule that
refuses plaintext on a reachable address in production; and, for both
since both serve over PostgreSQL, the database, ports, thread bounds and
timeouts (L{readDatabaseServer}), so that a variable means the same in
either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import attrs
import psycopg

from svcd.common import config
from svcd.common.grpcserver import ServerTLS, isLoopback
from svcd.common.internalcallers import BadSubjects, parseSubjects

_SUBJECTS = "SVC_GRPC_INTERNAL_SUBJECTS"


def serverTLS(environ: Mapping[str, str]) -> ServerTLS | None:
    """
    The server's certificate and key (C{SVC_GRPC_TLS_CERT},
    C{SVC_GRPC_TLS_KEY}: both or neither) and, for mutual TLS, the CA of
    its clients (C{SVC_GRPC_TLS_CLIENT_CA}); None for plaintext.
    """
    certificate = config.readPEM(environ, "SVC_GRPC_TLS_CERT")
    key = config.readPEM(environ, "SVC_GRPC_TLS_KEY")
    clientCA = config.readPEM(environ, "SVC_GRPC_TLS_CLIENT_CA")
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


def readInternalSubjects(
    environ: Mapping[str, str], tls: ServerTLS | None, mayCall: str
) -> frozenset[str] | None:
    """
    The names of C{SVC_GRPC_INTERNAL_SUBJECTS}, required with mutual TLS
    and refused without it: unset with mutual TLS, every caller of the
    internal methods would be denied them; set without it, there is no
    client certificate to check, and the list would only seem to protect
    them.

    @param mayCall: what the listed certificates may call, as the
        refusal names it ("MemoryService, such as the proxies' and the
        workers'").
    """
    raw = config.text(environ, _SUBJECTS, "")
    mutual = tls is not None and tls.clientCA is not None
    if not raw:
        if mutual:
            raise config.ConfigError(
                _SUBJECTS,
                "is required with SVC_GRPC_TLS_CLIENT_CA: name the client certificates "
                f"(common name or DNS name, comma-separated) that may call {mayCall}",
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


def refusePlaintextInProduction(environment: str, grpcHost: str, tls: ServerTLS | None) -> None:
    """
    Plaintext gRPC on an address other hosts can reach stops the daemon at
    start in production (elsewhere it is a warning at start,
    L{svcd.common.grpcserver.HostedGrpcServer}).
    """
    if environment == "production" and tls is None and not isLoopback(grpcHost):
        raise config.ConfigError(
            "SVC_GRPC_HOST",
            f"refusing plaintext gRPC on the non-loopback address {grpcHost} with "
            "SVC_ENV=production; set SVC_GRPC_TLS_CERT, SVC_GRPC_TLS_KEY and "
            "SVC_GRPC_TLS_CLIENT_CA",
        )


class DatabaseServerSettings(TypedDict):
    """
    What a daemon serving gRPC over PostgreSQL reads the same way as the
    other (svc-auth, svc-memory): the fields of its configuration of the
    same names.
    """

    postgresDSN: str
    host: str
    port: int
    grpcHost: str
    grpcPort: int
    grpcWorkers: int
    grpcMaxCallsPerPeer: int
    databasePoolMinimum: int
    databasePoolMaximum: int
    statementTimeout: float
    shutdownTimeout: float
    environment: str
    serviceName: str
    errorDocsBase: str | None
    tls: ServerTLS | None
    internalSubjects: frozenset[str] | None


@attrs.frozen
class ServerDefaults:
    """
    One daemon's defaults of the settings L{readDatabaseServer} reads.

    @ivar internalCallers: who calls its internal methods, for the error of
        a missing C{SVC_GRPC_INTERNAL_SUBJECTS}.
    """

    serviceName: str
    port: int
    grpcPort: int
    grpcWorkers: int
    grpcMaxCallsPerPeer: int
    statementTimeout: float
    internalCallers: str


# The values of target_session_attrs a daemon that writes may be given
# (libpq's others, read-only, standby and prefer-standby, choose servers
# that refuse writes).
_WRITING_TARGETS = ("any", "read-write", "primary")
_READING_TARGETS = ("read-only", "standby", "prefer-standby")


def checkServers(dsn: str) -> None:
    """
    Refuse a C{POSTGRES_DSN} that libpq could never use to write: not a
    connection string at all, several hosts with a number of ports that
    matches neither one nor each, or a C{target_session_attrs} that
    chooses a standby (decisions D16: svc-auth and svc-memory write, and
    with several hosts they must be told to find the server that takes
    writes, C{read-write}). Said at the start, rather than as a daemon
    that never becomes ready.
    """
    try:
        parameters = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise config.ConfigError(
            "POSTGRES_DSN", "is not a valid PostgreSQL connection string"
        ) from None
    hosts = str(parameters.get("host") or parameters.get("hostaddr") or "").split(",")
    ports = str(parameters.get("port") or "").split(",")
    if len(ports) > 1 and len(ports) != len(hosts):
        raise config.ConfigError(
            "POSTGRES_DSN", f"names {len(hosts)} host(s) but {len(ports)} ports (one, or one each)"
        )
    target = str(parameters.get("target_session_attrs") or "any")
    if target in _READING_TARGETS:
        raise config.ConfigError(
            "POSTGRES_DSN",
            f"has target_session_attrs={target}, which chooses a server that takes no"
            " writes; use read-write",
        )
    if target not in _WRITING_TARGETS:
        # Not quoted: it is the operator's text, of a connection string.
        raise config.ConfigError(
            "POSTGRES_DSN", "has a target_session_attrs libpq does not know; use read-write"
        )


def readDatabaseServer(
    environ: Mapping[str, str], defaults: ServerDefaults
) -> DatabaseServerSettings:
    """
    Read C{POSTGRES_DSN} (checked as a connection string), the ports and
    thread bounds, the database pool (its maximum not below its minimum),
    the statement and shutdown timeouts, the gRPC TLS and internal
    subjects, refusing plaintext on a reachable address in production.
    """
    dsn = config.required(environ, "POSTGRES_DSN")
    checkServers(dsn)
    environment = config.choice(
        environ, "SVC_ENV", "development", ("development", "staging", "production")
    )
    grpcHost = config.text(environ, "SVC_GRPC_HOST", "127.0.0.1")
    tls = serverTLS(environ)
    internalSubjects = readInternalSubjects(environ, tls, defaults.internalCallers)
    refusePlaintextInProduction(environment, grpcHost, tls)
    minimum = config.positiveInteger(environ, "SVC_DB_POOL_MIN", 2)
    maximum = config.positiveInteger(environ, "SVC_DB_POOL_MAX", 10)
    if maximum < minimum:
        raise config.ConfigError("SVC_DB_POOL_MAX", "must not be below SVC_DB_POOL_MIN")
    return DatabaseServerSettings(
        postgresDSN=dsn,
        host=config.text(environ, "SVC_HOST", "0.0.0.0"),
        port=config.port(environ, "SVC_PORT", defaults.port),
        grpcHost=grpcHost,
        grpcPort=config.port(environ, "SVC_GRPC_PORT", defaults.grpcPort),
        grpcWorkers=config.positiveInteger(environ, "SVC_GRPC_WORKERS", defaults.grpcWorkers),
        grpcMaxCallsPerPeer=config.positiveInteger(
            environ, "SVC_GRPC_MAX_CALLS_PER_PEER", defaults.grpcMaxCallsPerPeer
        ),
        databasePoolMinimum=minimum,
        databasePoolMaximum=maximum,
        statementTimeout=config.duration(
            environ, "SVC_DB_STATEMENT_TIMEOUT", defaults.statementTimeout
        ),
        shutdownTimeout=config.duration(environ, "SVC_SHUTDOWN_TIMEOUT", 10.0),
        environment=environment,
        serviceName=config.text(environ, "SVC_SERVICE_NAME", defaults.serviceName)
        or defaults.serviceName,
        errorDocsBase=config.text(environ, "SVC_ERROR_DOCS_BASE", "") or None,
        tls=tls,
        internalSubjects=internalSubjects,
    )
