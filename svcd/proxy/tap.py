"""
C{twistd -n svc-proxy}: the options and service maker of the proxy.

All configuration comes from the environment (spec section 8, decisions
D1). A missing or bad variable stops the daemon before anything starts,
with one line on stderr naming the variable and exit status 1; so does a
port that cannot be bound (L{LoggingRootService}). A stop by SIGTERM or
SIGINT that completes its graceful shutdown exits 0.

The proxy is wired in L{svcd.proxy.assembly}, which the tests use too;
this module adds what only a real process does: logging, tracing's
export, the collector's metrics, the stop signals and the heap settled at
start. The only module of svc-proxy that imports the global reactor;
everything else is handed its reactor or clock.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import NoReturn

from prometheus_client import CollectorRegistry
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import LogLevel
from twisted.python import usage

from svcd.common.config import ConfigError
from svcd.common.gcmetrics import watchCollector
from svcd.common.lifecycle import exitZeroOnStopSignals, settleHeapWhenRunning
from svcd.common.logs import LoggingRootService, daemonLogWriter, logSettings, makeObserver
from svcd.common.meters import MeterService
from svcd.common.tracing import TracingConfig, TracingService, tracerProvider
from svcd.common.twistedprivate import TwistedIncompatible, requireTwistedInternals
from svcd.ledger.journalfile import JournalError
from svcd.providers.genai import GenAIMetrics
from svcd.proxy.assembly import assembleProxy
from svcd.proxy.config import ProxyConfig
from svcd.proxy.metrics import ProxyMetrics


class Options(usage.Options):
    """
    svc-proxy takes no command-line options: see the SVC_* variables.
    """

    synopsis = "[options]  (configured by SVC_* environment variables)"
    longdesc = (
        "The public HTTP edge of the svc gateway. Required: SVC_AUTH_GRPC_ADDR. "
        "See the README for every variable."
    )

    config: ProxyConfig
    tracing: TracingConfig
    logFormat: str
    logLevel: LogLevel

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call, unused-ignore]
        self._environ = os.environ if environ is None else environ

    def postOptions(self) -> None:
        """
        Read the environment; on a bad value print one line and exit 1
        (a UsageError would make twistd print its whole help first).
        """
        try:
            requireTwistedInternals()
        except TwistedIncompatible as error:
            sys.stderr.write(f"svc-proxy: {error}\n")
            sys.stderr.flush()
            raise SystemExit(1) from None
        try:
            self.config = ProxyConfig.fromEnvironment(self._environ)
            self.tracing = TracingConfig.fromEnvironment(self._environ, "svc-proxy")
            self.logFormat, self.logLevel = logSettings(self._environ)
        except ConfigError as error:
            sys.stderr.write(f"svc-proxy: configuration error: {error}\n")
            sys.stderr.flush()
            raise SystemExit(1) from None


def makeService(options: Options) -> LoggingRootService:
    """
    Build the service tree of svc-proxy.
    """
    from twisted.internet import reactor

    config = options.config
    twistdOptions = getattr(options, "parent", None)
    writer = daemonLogWriter(twistdOptions)
    observer = makeObserver(
        options.logFormat, options.logLevel, writer, service=options.tracing.serviceName
    )
    root = LoggingRootService(
        observer, daemonName="svc-proxy", level=options.logLevel, writer=writer, clock=reactor
    )

    # The root stops its children last first: the tracing service, added
    # first, flushes the spans of the requests the proxy service drained.
    provider = tracerProvider(options.tracing)
    tracing = TracingService(IReactorFromThreads(reactor), reactor, provider, options.tracing)
    tracing.setServiceParent(root)  # type: ignore[no-untyped-call, unused-ignore]
    tracer = provider.get_tracer("svcd.proxy")
    # Decisions D15: the GenAI histograms of provider calls, exported with
    # the spans; stopped after the proxy service, which records them.
    genai = GenAIMetrics()
    MeterService(
        IReactorFromThreads(reactor), reactor, options.tracing, [genai], "svcd.proxy"
    ).setServiceParent(root)  # type: ignore[no-untyped-call, unused-ignore]

    metrics = ProxyMetrics(CollectorRegistry())
    # The collector's pauses are the process's: timed once per process.
    watchCollector(metrics.registry)
    try:
        daemon = assembleProxy(config, reactor, metrics=metrics, tracer=tracer, genai=genai)
    except JournalError as error:
        _cannotStart(str(error))
    daemon.service.setServiceParent(root)  # type: ignore[no-untyped-call, unused-ignore]
    exitZeroOnStopSignals(reactor)
    settleHeapWhenRunning(reactor)
    return root


def _cannotStart(reason: str) -> NoReturn:
    """
    Stop a daemon being built: one line on stderr, exit status 1 (as
    L{Options.postOptions} does for a bad variable).
    """
    stderr = sys.__stderr__ or sys.stderr
    stderr.write(f"svc-proxy: cannot start: {reason}\n")
    stderr.flush()
    raise SystemExit(1)
