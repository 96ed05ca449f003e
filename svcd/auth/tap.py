"""
twistd plugin body of svc-auth: C{twistd -n svc-auth}.

All configuration comes from the environment (see README.rst); the only
command-line options are twistd's own. The daemon is wired in
L{svcd.auth.assembly}, which the tests use too; this module adds what only
a real process does: logging, tracing's export, the collector's metrics,
the stop signals, the heap settled at start and systemd's notification.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from twisted.application.service import IService
from twisted.logger import LogLevel
from twisted.python import usage

from svcd.auth.assembly import assembleAuthDaemon
from svcd.auth.config import AuthConfig
from svcd.common.daemonstart import daemonAssembled, startDaemon
from svcd.common.gcmetrics import watchCollector
from svcd.common.logs import LoggingRootService
from svcd.common.metrics import processUpGauge
from svcd.common.tracing import TracingConfig, TracingService, tracerProvider


class Options(usage.Options):
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
    daemon of L{assembleAuthDaemon}, so that a stop (one child at a time,
    in reverse order) first closes the HTTP port, then drains gRPC calls,
    then closes the pool, and last flushes the spans of the drained calls.

    @param logCalls: log one DEBUG line per gRPC call.
    """
    tracing = tracing or TracingConfig(settings.serviceName, settings.environment)
    provider = tracerProvider(tracing)
    TracingService(reactor, reactor, provider, tracing).setServiceParent(rootService)
    registry = CollectorRegistry(auto_describe=True)
    processUpGauge(registry)
    # The collector's pauses are the process's: timed once per process.
    watchCollector(registry)
    assembleAuthDaemon(
        reactor,
        settings,
        registry,
        tracer=provider.get_tracer("svcd.auth"),
        logCalls=logCalls,
    ).setServiceParent(rootService)


def makeService(options: Options) -> IService:
    """
    Build svc-auth from the environment; a bad or missing variable stops
    here with one line on stderr naming it.
    """
    from twisted.internet import reactor

    start = startDaemon("svc-auth", options, reactor, AuthConfig.fromEnvironment)
    buildService(
        reactor, start.config, start.root, start.tracing, logCalls=start.level <= LogLevel.debug
    )
    daemonAssembled(reactor)
    return start.root
