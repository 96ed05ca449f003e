"""
twistd plugin body of svc-worker: C{twistd -n svc-worker} (decisions D13).

All configuration comes from the environment (docs/operations.rst,
"svc-worker"); the only command-line options are twistd's own. The worker
is wired in L{svcd.worker.assembly}; this module adds what only a real
process does: logging, tracing's export, the collector's metrics, the stop
signals, the heap settled at start and systemd's notification.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from twisted.application.service import IService
from twisted.internet.interfaces import IReactorFromThreads
from twisted.python import usage

from svcd.common.daemonstart import cannotStart, daemonAssembled, startDaemon
from svcd.common.gcmetrics import watchCollector
from svcd.common.meters import MeterService
from svcd.common.tracing import TracingService, tracerProvider
from svcd.ledger.journalfile import JournalError
from svcd.providers.genai import GenAIMetrics
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


def makeService(options: Options) -> IService:
    """
    Build svc-worker from the environment; a bad or missing variable stops
    here with one line on stderr naming it.
    """
    from twisted.internet import reactor

    start = startDaemon("svc-worker", options, reactor, WorkerConfig.fromEnvironment)
    root, tracing = start.root, start.tracing
    # Added first, stopped last: flushes the spans of what the worker did.
    provider = tracerProvider(tracing)
    reactorAny: Any = reactor
    TracingService(IReactorFromThreads(reactorAny), reactorAny, provider, tracing).setServiceParent(
        root
    )
    # Decisions D15: the GenAI histograms of its provider calls.
    genai = GenAIMetrics()
    MeterService(
        IReactorFromThreads(reactorAny), reactorAny, tracing, [genai], "svcd.worker"
    ).setServiceParent(root)
    registry = CollectorRegistry(auto_describe=True)
    # The collector's pauses are the process's: timed once per process.
    watchCollector(registry)
    try:
        daemon = assembleWorkerDaemon(
            reactor, start.config, registry, tracer=provider.get_tracer("svcd.worker"), genai=genai
        )
    except JournalError as error:
        cannotStart("svc-worker", f"cannot start: {error}")
    daemon.setServiceParent(root)
    daemonAssembled(reactor)
    return root
