"""
svc-auth's configuration, read once from the environment (spec section 8,
decisions D1).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from svcd.common import config
from svcd.common.grpcserver import ServerTLS
from svcd.common.serversettings import ServerDefaults, readDatabaseServer


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
        return cls(
            **readDatabaseServer(
                environ,
                ServerDefaults(
                    serviceName="svc-auth",
                    port=8081,
                    grpcPort=9091,
                    grpcWorkers=64,
                    grpcMaxCallsPerPeer=32,
                    statementTimeout=2.0,
                    internalCallers="RecordUsage, GetSpend and WatchChanges, such as the proxies'",
                ),
            ),
            feedStreams=config.positiveInteger(environ, "SVC_GRPC_MAX_FEED_STREAMS", 64),
            verifyConcurrency=config.positiveInteger(environ, "SVC_AUTH_VERIFY_CONCURRENCY", 4),
        )
