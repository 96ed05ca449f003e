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


def exitZeroOnStopSignals(reactor: Any) -> None:
    """
    Make a stop by SIGTERM or SIGINT end the process with status 0.

    twistd re-raises the signal that stopped the reactor once it has shut
    down, so the process dies "killed by SIGTERM". For these daemons a
    SIGTERM is the ordinary way to stop (systemd, container runtimes, the
    operator), and a completed graceful shutdown is a success, so the
    recorded signal is cleared after shutdown. twistd exposes no public
    hook for this; the attribute is documented in
    twisted.internet.base._ISupportsExitSignalCapturing.
    """

    def clear() -> None:
        if getattr(reactor, "_exitSignal", None) in (signal.SIGTERM, signal.SIGINT):
            reactor._exitSignal = None

    reactor.addSystemEventTrigger("after", "shutdown", clear)


# Collect the youngest generation every this many net allocations instead
# of 700: a request allocates a few thousand objects, most of them freed by
# reference counting, and the cycle collector at the default pace cost the
# proxy about a tenth of its reactor thread (py-spy, chat benchmark).
GC_THRESHOLD = (20_000, 20, 20)


def settleHeap() -> None:
    """
    Move everything allocated while starting (modules, the service tree,
    gRPC and OpenTelemetry machinery) out of the cycle collector's sight
    with C{gc.freeze}, and make young-generation collections rarer.

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
    reactor.stop()


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
