"""
The twistd plugin body of a gRPC daemon over PostgreSQL (svc-auth,
svc-memory), written once: options that are twistd's own and nothing else
(all configuration comes from the environment), and the service tree
under the logging root of L{svcd.common.daemonstart}, tracing first and
then the daemon its assembly wires, so that a stop (one child at a time,
in reverse order) first closes the HTTP port, then drains gRPC calls,
then closes the pool, and last flushes the spans of the drained calls.

What each daemon says itself: its name and help text, how it reads its
configuration, and how it is assembled (C{svcd.auth.tap},
C{svcd.memory.tap}).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry
from twisted.application.service import IService
from twisted.logger import LogLevel
from twisted.python import usage

from svcd.common.daemonstart import daemonAssembled, startDaemon
from svcd.common.gcmetrics import watchCollector
from svcd.common.logs import LoggingRootService
from svcd.common.metrics import processUpGauge
from svcd.common.tracing import TracingConfig, TracingService, tracerProvider


class DaemonSettings(Protocol):
    """
    What the tree reads of a daemon's configuration: the names its spans
    carry unless tracing's own variables say otherwise.
    """

    @property
    def serviceName(self) -> str: ...

    @property
    def environment(self) -> str: ...


Settings = TypeVar("Settings", bound=DaemonSettings)
Settings_contra = TypeVar("Settings_contra", bound=DaemonSettings, contravariant=True)


class Parentable(Protocol):
    """
    An assembled daemon: its services, added to a parent in their order.
    """

    def setServiceParent(self, parent: Any) -> None: ...


class Assemble(Protocol[Settings_contra]):
    """
    A daemon's assembly as a service tree (L{svcd.auth.assembly},
    L{svcd.memory.assembly}).
    """

    def __call__(
        self,
        reactor: Any,
        settings: Settings_contra,
        registry: CollectorRegistry,
        *,
        tracer: Tracer | None = None,
        logCalls: bool = False,
    ) -> Parentable: ...


class EnvironmentOptions(usage.Options):
    """
    A daemon that takes its configuration from the environment, not from
    options: only twistd's own options. A daemon's subclass gives its
    C{synopsis} and C{longdesc}.
    """


def buildDaemonTree(
    reactor: Any,
    settings: Settings,
    rootService: LoggingRootService,
    assemble: Assemble[Settings],
    tracerName: str,
    tracing: TracingConfig | None = None,
    logCalls: bool = False,
) -> None:
    """
    A daemon's service tree under C{rootService}: tracing first, then what
    C{assemble} wires, its metrics on a registry of its own with
    svc_process_up and the collector's series.

    @param tracerName: the instrumentation scope of its spans (its
        package).
    @param logCalls: log one DEBUG line per gRPC call.
    """
    tracing = tracing or TracingConfig(settings.serviceName, settings.environment)
    provider = tracerProvider(tracing)
    TracingService(reactor, reactor, provider, tracing).setServiceParent(rootService)
    registry = CollectorRegistry(auto_describe=True)
    processUpGauge(registry)
    # The collector's pauses are the process's: timed once per process.
    watchCollector(registry)
    assemble(
        reactor,
        settings,
        registry,
        tracer=provider.get_tracer(tracerName),
        logCalls=logCalls,
    ).setServiceParent(rootService)


class BuildTree(Protocol[Settings_contra]):
    """
    A tap's C{buildService}: L{buildDaemonTree} with the daemon's own
    arguments.
    """

    def __call__(
        self,
        reactor: Any,
        settings: Settings_contra,
        rootService: LoggingRootService,
        tracing: TracingConfig | None = None,
        logCalls: bool = False,
    ) -> None: ...


def makeDaemonService(
    reactor: Any,
    daemonName: str,
    options: usage.Options,
    readConfig: Callable[[Mapping[str, str]], Settings],
    buildService: BuildTree[Settings],
) -> IService:
    """
    Build the daemon C{daemonName} from the environment, read with
    C{readConfig}; a bad or missing variable stops here with one line on
    stderr naming it. DEBUG logging turns on one line per gRPC call.
    """
    start = startDaemon(daemonName, options, reactor, readConfig)
    buildService(
        reactor, start.config, start.root, start.tracing, logCalls=start.level <= LogLevel.debug
    )
    daemonAssembled(reactor)
    return start.root
