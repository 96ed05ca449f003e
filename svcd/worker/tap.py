"""
twistd plugin body of svc-worker: C{twistd -n svc-worker} (decisions D13).

All configuration comes from the environment (docs/operations.rst,
"svc-worker"); the only command-line options are twistd's own. The worker
is wired in L{svcd.worker.assembly}; this module adds what only a real
process does: logging, tracing's export, the collector's metrics, the stop
signals, the heap settled at start and systemd's notification.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from prometheus_client import CollectorRegistry
from twisted.application.service import IService
from twisted.internet.interfaces import IReactorCore, IReactorFromThreads, IReactorTime
from twisted.python import usage

from svcd.common.config import ConfigError
from svcd.common.gcmetrics import watchCollector
from svcd.common.lifecycle import exitZeroOnStopSignals, notifySystemd, settleHeapWhenRunning
from svcd.common.logs import LoggingRootService, daemonLogWriter, logSettings, makeObserver
from svcd.common.tracing import TracingConfig, TracingService, tracerProvider
from svcd.common.twistedprivate import TwistedIncompatible, requireTwistedInternals
from svcd.ledger.journalfile import JournalError
from svcd.worker.assembly import assembleWorkerDaemon
from svcd.worker.config import WorkerConfig


class Options(usage.Options):
    """
    svc-worker takes its configuration from the environment, not from
    options; see docs/operations.rst for the variables.
    """

    synopsis = "[twistd options] svc-worker"
    longdesc = (
        "Runs the svc worker: claims observations from svc-memory and turns them into"
        " memories, with the organization's provider calls; /health, /ready, /metrics on"
        " SVC_HOST:SVC_PORT (default 0.0.0.0:8083). Configuration comes from the"
        " environment: SVC_MEMORY_GRPC_ADDR, SVC_AUTH_GRPC_ADDR and SVC_PROVIDERS_FILE"
        " (with a [memory] table) are required."
    )


def _cannotStart(reason: str) -> NoReturn:
    stderr = sys.__stderr__ or sys.stderr
    stderr.write(f"svc-worker: {reason}\n")
    stderr.flush()
    raise SystemExit(1)


def makeService(options: Options) -> IService:
    """
    Build svc-worker from the environment; a bad or missing variable stops
    here with one line on stderr naming it.
    """
    from twisted.internet import reactor

    try:
        requireTwistedInternals()
    except TwistedIncompatible as error:
        _cannotStart(str(error))
    try:
        config = WorkerConfig.fromEnvironment(os.environ)
        tracing = TracingConfig.fromEnvironment(os.environ, "svc-worker")
        logFormat, level = logSettings(os.environ)
    except ConfigError as error:
        _cannotStart(f"configuration error: {error}")
    twistdOptions = getattr(options, "parent", None)
    assert IReactorCore.providedBy(reactor) and IReactorTime.providedBy(reactor)
    writer = daemonLogWriter(twistdOptions)
    root = LoggingRootService(
        makeObserver(logFormat, level, writer, service=tracing.serviceName),
        daemonName="svc-worker",
        level=level,
        writer=writer,
        clock=reactor,
    )
    # Added first, stopped last: flushes the spans of what the worker did.
    provider = tracerProvider(tracing)
    reactorAny: Any = reactor
    TracingService(IReactorFromThreads(reactorAny), reactorAny, provider, tracing).setServiceParent(
        root
    )
    registry = CollectorRegistry(auto_describe=True)
    # The collector's pauses are the process's: timed once per process.
    watchCollector(registry)
    try:
        daemon = assembleWorkerDaemon(
            reactor, config, registry, tracer=provider.get_tracer("svcd.worker")
        )
    except JournalError as error:
        _cannotStart(f"cannot start: {error}")
    daemon.setServiceParent(root)
    exitZeroOnStopSignals(reactor)
    settleHeapWhenRunning(reactor)
    reactor.callWhenRunning(notifySystemd, "READY=1")
    return root
