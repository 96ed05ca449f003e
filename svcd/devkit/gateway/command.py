"""
The command line of C{dev/gateway} (C{python -m svcd.devkit.gateway}):
L{main} starts the stack, waits, and stops it on a signal or when a part
of it dies, with the exit status that says which.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from svcd.devkit.gateway.children import CHECKOUT, DevStackError, say
from svcd.devkit.gateway.settings import ENVIRONMENT_HELP, Settings
from svcd.devkit.gateway.stack import DevStack
from svcd.devkit.servers import ServerError


class ShutdownRequested(BaseException):
    """
    SIGINT, SIGTERM or SIGHUP arrived. A BaseException, like
    KeyboardInterrupt, so that no C{except Exception} on the way swallows
    it before the stack is stopped.
    """


def _requestShutdown(signum: int, frame: FrameType | None) -> None:
    raise ShutdownRequested(signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dev/gateway",
        description="Run svc-auth and svc-proxy locally with private PostgreSQL and Redis.",
        epilog=ENVIRONMENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--data-directory",
        type=Path,
        default=CHECKOUT / ".data",
        help="where the private servers and demo.json live (default: .data of the checkout)",
    )
    options = parser.parse_args(argv)
    try:
        settings = Settings.fromEnvironment(os.environ, options.data_directory.absolute())
    except DevStackError as error:
        say(str(error))
        return 2

    stack = DevStack(settings, os.environ)
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for signum in signals:
        signal.signal(signum, _requestShutdown)
    status = 0
    try:
        stack.up()
        stack.watch()
    except ShutdownRequested:
        say("stopping")
    except (DevStackError, ServerError) as error:
        say(str(error))
        status = 1
    finally:
        # The stop is bounded; a second Ctrl-C must not cut it short and
        # leave servers running.
        for signum in signals:
            signal.signal(signum, signal.SIG_IGN)
        stack.down()
    return status
