"""
twistd plugin body of svc-auth: C{twistd -n svc-auth}.

All configuration comes from the environment (see README.rst); the only
command-line options are twistd's own. The daemon is wired in
L{svcd.auth.assembly}, which the tests use too; this module adds what only
a real process does (L{svcd.common.daemontap}): logging, tracing's export,
the collector's metrics, the stop signals, the heap settled at start and
systemd's notification.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import IService

from svcd.auth.assembly import assembleAuthDaemon
from svcd.auth.config import AuthConfig
from svcd.common.daemontap import EnvironmentOptions, buildDaemonTree, makeDaemonService
from svcd.common.logs import LoggingRootService
from svcd.common.tracing import TracingConfig


class Options(EnvironmentOptions):
    """
    svc-auth takes its configuration from the environment, not from
    options; see README.rst for the variables.
    """

    synopsis = "[twistd options] svc-auth"
    longdesc = (
        "Runs the svc auth service: gRPC svc.auth.v1.AuthService on "
        "SVC_GRPC_HOST:SVC_GRPC_PORT (default 127.0.0.1:9091) and /health, "
        "/ready, /metrics on SVC_HOST:SVC_PORT (default 0.0.0.0:8081). "
        "Configuration comes from the environment; POSTGRES_DSN is required."
    )


def buildService(
    reactor: Any,
    settings: AuthConfig,
    rootService: LoggingRootService,
    tracing: TracingConfig | None = None,
    logCalls: bool = False,
) -> None:
    """
    svc-auth's service tree under C{rootService}: tracing first, then the
    daemon of L{assembleAuthDaemon} (L{buildDaemonTree}).

    @param logCalls: log one DEBUG line per gRPC call.
    """
    buildDaemonTree(
        reactor, settings, rootService, assembleAuthDaemon, "svcd.auth", tracing, logCalls
    )


def makeService(options: Options) -> IService:
    """
    Build svc-auth from the environment; a bad or missing variable stops
    here with one line on stderr naming it.
    """
    from twisted.internet import reactor

    return makeDaemonService(reactor, "svc-auth", options, AuthConfig.fromEnvironment, buildService)
