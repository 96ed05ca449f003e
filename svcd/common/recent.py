"""
The outcome of an asynchronous call, shared by every caller for a short
while (decisions D10).

svc-proxy's C{GET /ready} costs a ValidateToken call to svc-auth and a
Redis PING, and anyone may ask for it (spec 4.2: no authentication). Run
once per probe, a flood of anonymous probes became a flood of gRPC calls:
16,000 probes were 16,000 ValidateToken calls, and valid traffic got eight
times slower. L{RecentResult} makes at most one call at a time: a caller
that arrives while a call is in flight shares it, and a caller that
arrives less than C{maxAge} seconds after the start of the last call gets
that call's outcome. A flood then costs one call per C{maxAge} at most,
and what it reads is never older than that.

The age of an outcome is counted from the start of its call, the moment
from which it can describe the world; a caller that joins a call in
flight gets an outcome that ends after it asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

from svcd.common.clocks import Clock

T = TypeVar("T")


class RecentResult(Generic[T]):
    """
    The outcome of C{call()}, made at most once at a time and reused by
    callers for C{maxAge} seconds of C{clock} after the call began.

    A failure is shared and reused as a result is. Cancelling a caller's
    Deferred withdraws that caller only: the call goes on for the others
    (and for the callers after them).

    @param call: starts the call; run in the context of the caller that
        finds no recent outcome, so the call carries that caller's trace.
    @param clock: what C{maxAge} is measured on.
    @param maxAge: seconds, from its start, that a call's outcome answers
        later callers.
    @ivar calls: how many calls were made.
    """

    def __init__(self, call: Callable[[], Deferred[T]], clock: Clock, maxAge: float) -> None:
        self._call = call
        self._clock = clock
        self._maxAge = maxAge
        self._inFlight: Deferred[T] | None = None
        self._waiting: list[Deferred[T]] = []
        self._outcome: T | Failure | None = None
        self._hasOutcome = False
        self._startedAt = 0.0
        self.calls = 0

    def get(self) -> Deferred[T]:
        """
        The outcome of the call in flight, else of the last call if it
        began less than C{maxAge} ago, else of a new call.
        """
        if self._inFlight is None and not self._fresh():
            self._start()
        if self._inFlight is None:
            # Recent, possibly from a call that has just ended at once.
            outcome = self._outcome
            if isinstance(outcome, Failure):
                return fail(outcome)
            return succeed(outcome)  # type: ignore[arg-type]
        waiter: Deferred[T] = Deferred()
        self._waiting.append(waiter)
        return waiter

    def _fresh(self) -> bool:
        return self._hasOutcome and self._clock.seconds() - self._startedAt < self._maxAge

    def _start(self) -> None:
        self._startedAt = self._clock.seconds()
        self.calls += 1
        try:
            call = self._call()
        except Exception:
            call = fail()
        self._inFlight = call
        call.addBoth(self._ended)

    def _ended(self, outcome: T | Failure) -> None:
        self._inFlight = None
        self._outcome = outcome
        self._hasOutcome = True
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if waiter.called:
                # Withdrawn (cancelled) while the call ran.
                continue
            if isinstance(outcome, Failure):
                waiter.errback(outcome)
            else:
                waiter.callback(outcome)
