"""
Process lifecycle details shared by both daemons.
"""

from __future__ import annotations

import signal
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


class StartupError(Exception):
    """
    A daemon cannot start for a reason an operator can fix (a port in use,
    an address the host does not have); reported as one line, not a
    traceback.
    """
