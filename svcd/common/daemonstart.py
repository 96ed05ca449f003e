"""
What every twistd plugin of svc does before and after it assembles its
daemon, written once: check Twisted's private names, read the
configuration (a bad or missing variable stops the start with one line on
stderr naming it, never a traceback), make the logging root service, and,
once assembled, exit 0 on SIGTERM and SIGINT, settle the heap and tell
systemd the daemon is ready when the reactor runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, Generic, NoReturn, TypeVar

import attrs
from twisted.internet.interfaces import IReactorCore, IReactorTime
from twisted.logger import LogLevel

from svcd.common.config import ConfigError
from svcd.common.lifecycle import exitZeroOnStopSignals, notifySystemd, settleHeapWhenRunning
from svcd.common.logs import LoggingRootService, daemonLogWriter, logSettings, makeObserver
from svcd.common.tracing import TracingConfig
from svcd.common.twistedprivate import TwistedIncompatible, requireTwistedInternals

Config = TypeVar("Config")


@attrs.frozen
class DaemonStart(Generic[Config]):
    """
    What a plugin's C{makeService} assembles its daemon from.

    @ivar config: the daemon's own configuration.
    @ivar tracing: its OpenTelemetry configuration.
    @ivar root: the root service, which logs; the daemon's services go
        under it.
    @ivar level: the log level (DEBUG turns on per-call logging where a
        daemon has it).
    """

    config: Config
    tracing: TracingConfig
    root: LoggingRootService
    level: LogLevel


def cannotStart(daemonName: str, reason: str) -> NoReturn:
    """
    Stop a start that cannot go on with one line on stderr.
    """
    sys.stderr.write(f"{daemonName}: {reason}\n")
    sys.stderr.flush()
    raise SystemExit(1)


def startDaemon(
    daemonName: str,
    options: Any,
    reactor: Any,
    readConfig: Callable[[Mapping[str, str]], Config],
) -> DaemonStart[Config]:
    """
    Check Twisted, read the environment with C{readConfig} and make the
    logging root service of the daemon C{daemonName}, for the twistd
    C{options} (the plugin's, whose C{parent} is twistd's own).
    """
    try:
        requireTwistedInternals()
    except TwistedIncompatible as error:
        cannotStart(daemonName, str(error))
    try:
        config = readConfig(os.environ)
        tracing = TracingConfig.fromEnvironment(os.environ, daemonName)
        logFormat, level = logSettings(os.environ)
    except ConfigError as error:
        cannotStart(daemonName, f"configuration error: {error}")
    assert IReactorCore.providedBy(reactor) and IReactorTime.providedBy(reactor)
    writer = daemonLogWriter(getattr(options, "parent", None))
    root = LoggingRootService(
        makeObserver(logFormat, level, writer, service=tracing.serviceName),
        daemonName=daemonName,
        level=level,
        writer=writer,
        clock=reactor,
    )
    return DaemonStart(config, tracing, root, level)


def daemonAssembled(reactor: Any) -> None:
    """
    Once the daemon's services are under its root: SIGTERM and SIGINT end
    it with status 0, the heap is settled when the reactor runs, and a unit
    of Type=notify (etc/systemd) is told the daemon serves then.
    """
    exitZeroOnStopSignals(reactor)
    settleHeapWhenRunning(reactor)
    reactor.callWhenRunning(notifySystemd, "READY=1")
