"""
How grpcio's core moves bytes in every svc process, settled before grpcio
is first imported (it reads C{GRPC_EXPERIMENTS} once, when its extension
module loads: a value set later changes nothing).

grpcio 1.85 moves each connection's bytes on its EventEngine's own threads
by default: a message that arrives is read by one of those threads, handed
to another, then signalled through an eventfd to the thread that polls the
completion queue (svc-auth's and svc-memory's server poller), which only
then hands it to Python: three thread wake-ups before a handler runs, each
a futex and on a virtual machine an exit to the hypervisor. Turned off for
the servers' side (the three C{-event_engine_...} experiments below), the
thread that polls the queue reads the socket itself, as grpcio did before
EventEngine.

Measured on the shared 2-core machine (C{bench/search_cost.py --tree
.@GRPC_EXPERIMENTS= --tree .}, four rounds alternating, bench/README.rst,
"Twenty-seventh round"): svc-memory's CPU a recall's Search 758 -> 700 µs,
its context switches 17.7 -> 5.7 a Search; the p50 a client sees the same
(0.955 against 0.943 ms).

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

# The EventEngine's endpoints of accepted connections (the listener's)
# and of the rest, and its completion-queue callbacks, each turned off. Not
# its client (C{event_engine_client}): turned off too, it made one call at
# a time cheaper still (0.90 -> 0.71 ms p50 against the default's 0.95),
# but grpcio's older client then reconnected to a restarted svc-auth some
# 2 s after it was back instead of 0.03 s (test_faults_gateway's
# test_authKilledFrozenAndRestartedMidLoad, whose promise is 5 s: under
# load it broke it).
POLLING_THREAD_READS = ",".join(
    (
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
