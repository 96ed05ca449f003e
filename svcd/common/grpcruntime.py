"""
How grpcio's core moves bytes in every svc process, settled before grpcio
is first imported (it reads C{GRPC_EXPERIMENTS} once, when its extension
module loads: a value set later changes nothing).

grpcio 1.85 moves each connection's bytes on its EventEngine's own threads
by default: a message that arrives is read by one of those threads, handed
to another, then signalled through an eventfd to the thread that polls the
completion queue (svc-auth's and svc-memory's server poller, a channel's
completion thread in svc-proxy), which only then hands it to Python: three
thread wake-ups before a handler or a done-callback runs, each a futex and
on a virtual machine an exit to the hypervisor. Turned off (the four
C{-event_engine_...} experiments below), the thread that polls the queue
reads the socket itself, as grpcio did before EventEngine.

Measured on the shared 2-core machine (bench/README.rst, "Twenty-seventh
round"): one unary call at a time against a local server, 0.89 -> 0.74 ms
p50 and 441 -> 372 µs of the client's CPU a call; a recall's Search
(C{bench/gateway.py}'s forward-recall row at one connection) 1,615 -> 1,092
µs of svc-memory's CPU, and the row's share of forward's requests a second
28.2% -> 40.5%.

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

GRPC_EXPERIMENTS = "GRPC_EXPERIMENTS"

# The EventEngine's endpoints (client, listener and the rest) and its
# completion-queue callbacks, each turned off.
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
