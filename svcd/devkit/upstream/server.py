"""
The scripted model server's process: C{python -m svcd.devkit.upstream}
(L{main}) listens on loopback and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.interfaces import IListeningPort, IReactorTCP, IReactorTime
from twisted.internet.task import react
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)

from svcd.devkit.upstream import LOOPBACK
from svcd.devkit.upstream.content import DEFAULT_EMBEDDING_DIMENSIONS, MAX_EMBEDDING_DIMENSIONS
from svcd.devkit.upstream.resource import (
    ControlResource,
    CountingFactory,
    QuietSite,
    UpstreamResource,
)


def _portOf(listening: IListeningPort) -> int:
    address = listening.getHost()
    assert isinstance(address, IPv4Address)
    return address.port


async def serve(
    reactor: IReactorTCP,
    clock: Callable[[], float],
    port: int,
    controlPort: int,
    portFile: Path,
    apiKey: str | None,
    embeddingDimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
) -> None:
    """
    Listen on 127.0.0.1 (API and control ports), write the ports to
    C{portFile} (atomically: a reader never sees half of it), and run until
    the reactor stops.
    """
    upstream = UpstreamResource(IReactorTime(reactor), clock, apiKey, embeddingDimensions)
    apiFactory = CountingFactory(QuietSite(upstream))
    control = QuietSite(ControlResource(upstream, apiFactory))
    # listenTCP rather than an endpoint: endpoints import TLS, which would
    # double the time this process takes to start. (Twisted's annotation of
    # listenTCP wants a factory generic in its protocol, which neither
    # WrappingFactory nor Site is.)
    listening = reactor.listenTCP(port, apiFactory, interface=LOOPBACK)  # type: ignore[arg-type]
    controlListening = reactor.listenTCP(
        controlPort,
        control,  # type: ignore[arg-type]
        interface=LOOPBACK,
    )
    ports = {"port": _portOf(listening), "controlPort": _portOf(controlListening)}
    temporary = portFile.with_name(portFile.name + ".tmp")
    temporary.write_text(json.dumps(ports))
    os.replace(temporary, portFile)
    await Deferred()


def main(argv: Sequence[str] | None = None) -> None:
    """
    The command line: C{python -m svcd.devkit.upstream --port 0
    --port-file PATH [--control-port 0] [--api-key KEY]
    [--embedding-dimensions N]}.
    """
    parser = argparse.ArgumentParser(
        prog="python -m svcd.devkit.upstream",
        description="A scripted upstream for the tests, in OpenAI's and Anthropic's dialects.",
    )
    parser.add_argument("--port", type=int, default=0, help="API port (0: any free one)")
    parser.add_argument("--control-port", type=int, default=0, help="control port (0: any)")
    parser.add_argument("--port-file", type=Path, required=True, help="where to write the ports")
    parser.add_argument(
        "--api-key",
        default=None,
        help="the key expected as Bearer token (x-api-key on Anthropic's routes)",
    )
    parser.add_argument(
        "--embedding-dimensions",
        type=int,
        choices=range(1, MAX_EMBEDDING_DIMENSIONS + 1),
        default=DEFAULT_EMBEDDING_DIMENSIONS,
        metavar="N",
        help="the length of embeddings when a request names none"
        f" (default {DEFAULT_EMBEDDING_DIMENSIONS})",
    )
    arguments = parser.parse_args(argv)
    errorsOnly = LogLevelFilterPredicate(defaultLogLevel=LogLevel.error)
    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(textFileLogObserver(sys.stderr), [errorsOnly])],
        redirectStandardIO=False,
    )

    # react imports the global reactor, when called: this is the process's
    # entry point, the one place that may (as svcd/*/tap.py do for twistd).
    react(
        lambda reactor: ensureDeferred(
            serve(
                reactor,
                time.monotonic,
                arguments.port,
                arguments.control_port,
                arguments.port_file,
                arguments.api_key,
                arguments.embedding_dimensions,
            )
        )
    )
