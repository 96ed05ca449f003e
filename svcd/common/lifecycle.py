"""
Process lifecycle details shared by both daemons.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any

from svcd.common.twistedprivate import exitSignal, forgetExitSignal


def exitZeroOnStopSignals(reactor: Any) -> None:
    """
    Make a stop by SIGTERM or SIGINT end the process with status 0.

    twistd re-raises the signal that stopped the reactor once it has shut
    down, so the process dies "killed by SIGTERM". For these daemons a
    SIGTERM is the ordinary way to stop (systemd, container runtimes, the
    operator), and a completed graceful shutdown is a success, so the
    recorded signal is cleared after shutdown. twistd exposes no public
    hook for this: the reactor's private record of the signal is reached
    through L{svcd.common.twistedprivate}, which checks it at import.
    """

    def clear() -> None:
        if exitSignal(reactor) in (signal.SIGTERM, signal.SIGINT):
            forgetExitSignal(reactor)

    reactor.addSystemEventTrigger("after", "shutdown", clear)


# The collector's thresholds: Python's own, chosen by measurement
# (bench/README.rst, sixth round). A young collection walks every object
# allocated since the last one that is still alive, so its pause grows with
# the first threshold (0.2 to 0.4 µs of CPU per object on the bench
# machine). Requests leave nothing to the collector (tests/test_gc_cycles.py):
# at 32 connections a young collection finds the requests in flight. The
# p99 of young pauses in CPU time, chat and forward rows at 32 connections:
# 0.5 to 0.7 ms at 700, 1.3 to 1.5 ms at 2,000, 2.2 ms at 3,000, 2.9 ms at
# 5,000, and 5 to 8 ms for the rare one at 10,000. The 20,000 of before was
# set when every request waited in a cycle for the collector, which at 700
# then cost the proxy a tenth of its reactor thread; now 700 costs it about
# 1% of one core, the older generations' pauses included (under 2 ms).
GC_THRESHOLD = (700, 10, 10)


def settleHeap() -> None:
    """
    Move everything allocated while starting (modules, the service tree,
    gRPC and OpenTelemetry machinery) out of the cycle collector's sight
    with C{gc.freeze}, and set the collector's thresholds (L{GC_THRESHOLD}).

    Call once the daemon has started. Without it every full collection
    walks those long-lived objects again, which showed up both as CPU and
    as latency spikes of tens of milliseconds under load.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def settleHeapWhenRunning(reactor: Any) -> None:
    """
    L{settleHeap} as soon as the reactor runs, after every service started.
    """
    reactor.callWhenRunning(settleHeap)


def stopWithFailure(reactor: Any, line: str) -> None:
    """
    End a daemon that cannot go on once its reactor runs: write C{line} on
    stderr, stop the reactor (the graceful stop, which flushes the logs) and
    exit with status 1 once it has stopped.

    Failures found before the reactor runs are L{StartupError}s, reported
    by the root service; twistd offers no exit status for one found later,
    hence C{os._exit} after the shutdown (a daemonised twistd then leaves
    its pidfile behind, which its next start recognises as stale).
    """
    if sys.__stderr__ is not None:
        sys.__stderr__.write(line + "\n")
        sys.__stderr__.flush()
    reactor.addSystemEventTrigger("after", "shutdown", os._exit, 1)
    if reactor.running:
        reactor.stop()
    else:
        # Found while twistd starts the services, before the reactor runs
        # (an unusable journal): reactor.stop() would raise
        # ReactorNotRunning there. Stop as soon as it runs instead.
        reactor.callWhenRunning(reactor.stop)


def notifySystemd(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """
    Tell systemd about the daemon (sd_notify(3)), such as C{"READY=1"} once
    it serves: a unit of C{Type=notify} is started only then, so that
    C{systemctl restart} returns once the new process serves, and a rolling
    restart that waits for it never stops the last worker serving.

    A no-op, returning False, outside such a unit (C{NOTIFY_SOCKET} unset)
    or when the socket cannot be reached.
    """
    address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not address.startswith(("/", "@")):
        return False
    if address.startswith("@"):
        # An abstract socket.
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.connect(address)
            notify.sendall(state.encode("utf-8"))
    except OSError:
        return False
    return True


class StartupError(Exception):
    """
    A daemon cannot start for a reason an operator can fix (a port in use,
    an address the host does not have); reported as one line, not a
    traceback.
    """
