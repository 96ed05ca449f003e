"""
How grpcio's core moves bytes in every svc process, settled before grpcio
is first imported (it reads C{GRPC_EXPERIMENTS} once, when its extension
module loads: a value set later changes nothing).

grpcio 1.85 moves each connection's bytes on its EventEngine's own threads
by default: a message that arrives is read by one of those threads, handed
to another, then signalled through an eventfd to the thread that polls the
completion queue (a server's poller in svc-auth and svc-memory, a
channel's completion thread in svc-proxy and svc-worker), which only then
hands it to Python: three thread wake-ups before a handler or a
done-callback runs, each a futex and on a virtual machine an exit to the
hypervisor. Turned off (the four C{-event_engine_...} experiments below),
the thread that polls the queue reads the socket itself, as grpcio did
before EventEngine.

That older client notices a connection attempt's end only while a thread
polls the channel, and calls that fail at once while it is down poll
nothing: it found a restarted server one to four seconds after it was back
(each attempt "timed out" after a second). L{keepConnecting} watches every
channel svc makes, as grpcio's own C{channel_ready_future} does while it
waits, so that it finds it within a third of a second, as EventEngine's
client does.

Measured on the shared 2-core machine (bench/README.rst, "Twenty-seventh
round"): one unary call at a time against a local server, 0.95 -> 0.71 ms
p50 and 480 -> 370 µs of the client's CPU a call; svc-memory's CPU a
recall's Search 990 -> 888 µs, its context switches 17.8 -> 12.5.

C{GRPC_EXPERIMENTS} is gRPC's documented variable for this
(doc/environment_variables.md in grpc/grpc); an operator's own value is
kept as it is. A grpcio that no longer knows one of these experiments logs
"Unknown experiment" once at import and goes on with its default:
tests/test_grpcruntime.py fails first then, so that an upgrade revisits
this.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any, TypeVar

_Channel = TypeVar("_Channel")

GRPC_EXPERIMENTS = "GRPC_EXPERIMENTS"

# The EventEngine's endpoints (a channel's, a listener's, the rest) and
# its completion-queue callbacks, each turned off.
POLLING_THREAD_READS = ",".join(
    (
        "-event_engine_client",
        "-event_engine_listener",
        "-event_engine_for_all_other_endpoints",
        "-event_engine_callback_cq",
    )
)


def settleGrpcTransport(environ: MutableMapping[str, str] = os.environ) -> None:
    """
    Set C{GRPC_EXPERIMENTS} to L{POLLING_THREAD_READS} unless the
    environment already names experiments. Called by C{svcd}'s own
    C{__init__}, so that it runs before any svc module imports grpcio.
    """
    environ.setdefault(GRPC_EXPERIMENTS, POLLING_THREAD_READS)


def _connectivityChanged(state: Any) -> None:
    # Nothing to do: the watch itself is what keeps the channel polled.
    pass


def keepConnecting(channel: _Channel) -> _Channel:
    """
    C{channel}, watched for as long as it lives (grpcio's C{subscribe}
    with C{try_to_connect}: a thread of grpcio's that waits on the
    channel's state a fifth of a second at a time, polling it meanwhile,
    and ends when the channel closes), so that a connection attempt is
    noticed as soon as it ends, and a restarted server found within a
    third of a second, with or without EventEngine's client.
    """
    channel.subscribe(_connectivityChanged, try_to_connect=True)  # type: ignore[attr-defined]
    return channel
