"""
twistd plugin body of svc-memory: C{twistd -n svc-memory}.

All configuration comes from the environment (see docs/operations.rst); the only
command-line options are twistd's own. The daemon is wired in
L{svcd.memory.assembly}, which the tests use too; this module adds what only
a real process does (L{svcd.common.daemontap}): logging, tracing's export,
the collector's metrics, the stop signals, the heap settled at start and
systemd's notification; and one BLAS thread per search.
"""

from __future__ import annotations

from typing import Any

from threadpoolctl import threadpool_limits
from twisted.application.service import IService

from svcd.common.daemontap import EnvironmentOptions, buildDaemonTree, makeDaemonService
from svcd.common.logs import LoggingRootService
from svcd.common.tracing import TracingConfig
from svcd.memory.assembly import assembleMemoryDaemon
from svcd.memory.config import MemoryConfig


class Options(EnvironmentOptions):
    """
    svc-memory takes its configuration from the environment, not from
    options; see README.rst for the variables.
    """

    synopsis = "[twistd options] svc-memory"
    longdesc = (
        "Runs the svc memory service: gRPC svc.memory.v1.MemoryService on "
        "SVC_GRPC_HOST:SVC_GRPC_PORT (default 127.0.0.1:9092) and /health, "
        "/ready, /metrics on SVC_HOST:SVC_PORT (default 0.0.0.0:8082). "
        "Configuration comes from the environment; POSTGRES_DSN is required."
    )


def buildService(
    reactor: Any,
    settings: MemoryConfig,
    rootService: LoggingRootService,
    tracing: TracingConfig | None = None,
    logCalls: bool = False,
) -> None:
    """
    svc-memory's service tree under C{rootService}: tracing first, then the
    daemon of L{assembleMemoryDaemon} (L{buildDaemonTree}).

    @param logCalls: log one DEBUG line per gRPC call.
    """
    # One BLAS thread per search: grpcio's threads are the parallelism
    # (and a large scope's blocks, svcd/memory/search.py); OpenBLAS's own
    # threads beside them only spin (setup.py says what that cost).
    threadpool_limits(limits=1, user_api="blas")
    buildDaemonTree(
        reactor, settings, rootService, assembleMemoryDaemon, "svcd.memory", tracing, logCalls
    )


def makeService(options: Options) -> IService:
    """
    Build svc-memory from the environment; a bad or missing variable stops
    here with one line on stderr naming it.
    """
    from twisted.internet import reactor

    return makeDaemonService(
        reactor, "svc-memory", options, MemoryConfig.fromEnvironment, buildService
    )
