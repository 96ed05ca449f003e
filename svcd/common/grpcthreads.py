"""
Unary gRPC calls made with grpcio's blocking stub on a few threads of
their own, each answer handed to the reactor with C{callFromThread}.

Why not grpcio's future API (L{svcd.common.grpcdefer}), as the calls to
svc-auth are made: a future is a "managed call" of its channel, whose
events are read by one thread per channel that grpcio starts when a call
begins with none in flight and lets end when the last one finishes. A
caller whose calls seldom overlap (svc-memory's Search, one per recall of
a chat completion: about a millisecond each) thus starts a thread for
nearly every call, on the thread that makes the call: the reactor's, which
waits in C{Thread.start} for the new thread to run (the GIL held
meanwhile by grpcio's other threads) and in the channel's lock. Measured
under the forward-recall row (bench/README.rst, thirteenth round): about a
quarter of the reactor thread's busy time in C{future()}, a new thread per
call. The blocking stub instead reads each call's own completion queue on
the thread that made the call: no thread started, no channel-wide lock;
here those threads are a few kept for the purpose, so the reactor thread
only puts the call on a queue (a few µs) and reads the answer that comes
back through C{callFromThread}.

What the calls keep:

  - **the deadline**, given to grpcio (C{timeout=}) as what is left of it
    when a thread takes the call, so that the time waited for a thread
    counts; a call whose deadline passed before a thread took it is never
    sent (L{CallNotSent});
  - **cancellable Deferreds**: cancelling one fails it with
    L{twisted.internet.defer.CancelledError} at once. A call not yet taken
    by a thread is then never sent; one already sent cannot be cancelled
    from another thread through grpcio's blocking stub, so it ends at its
    deadline (or when the channel is closed) and its answer is dropped.
    The callers' deadlines are short (svc-memory's calls: 2 s, a recall's
    C{SVC_MEMORY_TIMEOUT}), and the number of threads bounds the calls in
    flight, abandoned ones included, so the server never sees more than
    that from this process.

The threads start at the first call (after twistd forks) and are daemon
threads: one blocked in a call never holds the process at exit;
L{ThreadedUnaryCalls.stop} lets each end after its current call (closing
the channel ends the calls in flight at once).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.python.failure import Failure

# What grpcio's blocking unary stub is called with (it ships no hints).
UnaryStub = Callable[..., Any]
Metadata = Sequence[tuple[str, str]] | None


class CallNotSent(Exception):
    """
    A call was never sent: its deadline passed before a thread was free to
    send it, or the caller was stopped.
    """


class _Call:
    """
    One call on its way: what to send, by when, and the Deferred its
    answer fires.

    @ivar abandoned: set on the reactor thread when the Deferred is
        cancelled; read by the thread that takes the call, which then does
        not send it.
    """

    __slots__ = ("abandoned", "deadline", "metadata", "request", "result", "stub")

    def __init__(self, stub: UnaryStub, request: Any, deadline: float, metadata: Metadata) -> None:
        self.stub = stub
        self.request = request
        self.deadline = deadline
        self.metadata = metadata
        self.abandoned = False
        self.result: Deferred[Any] = Deferred(self._cancel)

    def _cancel(self, _: Deferred[Any]) -> None:
        # Deferred.cancel then fails the Deferred with CancelledError.
        self.abandoned = True


# What a thread hands back: the answer, or the exception the call raised.
_Outcome = tuple[bool, Any]


class ThreadedUnaryCalls:
    """
    Unary gRPC calls as Deferreds, made on C{threads} threads of their own
    (see the module docstring).

    @param reactor: where answers are handed, with C{callFromThread}.
    @param threads: how many calls may be in flight at once; the others
        wait, in order, for a free thread within their deadline.
    @param name: the threads' names start with it (seen in py-spy, gdb).
    @param monotonic: the threads' clock for deadlines.
    """

    def __init__(
        self,
        reactor: IReactorFromThreads,
        threads: int,
        name: str,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if threads < 1:
            raise ValueError("at least one thread")
        self._reactor = reactor
        self._threads = threads
        self._name = name
        self._monotonic = monotonic
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._started = False
        self._stopped = False

    def call(
        self, stub: UnaryStub, request: Any, timeout: float, metadata: Metadata = None
    ) -> Deferred[Any]:
        """
        Call C{stub(request, timeout=..., metadata=...)} on a thread of this
        caller: a Deferred of its answer, failing with the call's
        L{grpc.RpcError} (a L{grpc.Call} too), with L{CallNotSent}, or
        with whatever else the stub raised (a request that cannot be
        serialized).

        @param timeout: seconds from now the call has, the wait for a
            thread included.
        """
        pending = _Call(stub, request, self._monotonic() + timeout, metadata)
        if self._stopped:
            pending.result.errback(CallNotSent("the caller is stopped"))
            return pending.result
        if not self._started:
            self._start()
        self._calls.put(pending)
        return pending.result

    def stop(self) -> None:
        """
        Let every thread end after the call it is in; calls still waiting
        for a thread fail L{CallNotSent}. Calls made after this fail so too.
        """
        self._stopped = True
        if self._started:
            for _ in range(self._threads):
                self._calls.put(None)

    def _start(self) -> None:
        self._started = True
        for index in range(self._threads):
            threading.Thread(target=self._serve, name=f"{self._name}-{index}", daemon=True).start()

    def _serve(self) -> None:
        """
        A thread's loop: take the next call, send it, hand its outcome to
        the reactor. Touches nothing of Twisted's but C{callFromThread}.
        """
        calls = self._calls
        while True:
            pending = calls.get()
            if pending is None:
                return
            if pending.abandoned:
                continue
            outcome: _Outcome
            left = pending.deadline - self._monotonic()
            if self._stopped:
                outcome = (False, CallNotSent("the caller is stopped"))
            elif left <= 0:
                outcome = (False, CallNotSent("no thread free before the call's deadline"))
            else:
                try:
                    outcome = (
                        True,
                        pending.stub(pending.request, timeout=left, metadata=pending.metadata),
                    )
                except Exception as error:
                    outcome = (False, error)
            self._reactor.callFromThread(_deliver, pending.result, outcome)
            # Nothing of the call outlives its hand-off on this thread.
            del pending, outcome


def _deliver(result: Deferred[Any], outcome: _Outcome) -> None:
    """
    Fire C{result} with a thread's outcome, on the reactor thread; a
    cancelled call's Deferred has already failed.
    """
    if result.called:
        return
    answered, value = outcome
    if answered:
        result.callback(value)
    else:
        result.errback(Failure(value))
