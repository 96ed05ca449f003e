"""
Small helpers for Deferreds.
"""

from __future__ import annotations

from typing import Any, TypeVar

from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

T = TypeVar("T")


def timeoutDeferred(work: Deferred[T], seconds: float, clock: IReactorTime) -> Deferred[T]:
    """
    Return a Deferred that fires with C{work}'s result, or fails with
    L{TimeoutError} once C{seconds} have passed, whatever C{work}'s
    canceller does.

    C{Deferred.addTimeout} waits for the canceller to errback C{work}; a
    canceller that does not (a thread that cannot be interrupted, a library
    that ignores cancellation) would then stall the caller past its budget.
    Here the timer fires the result itself, and C{work} is cancelled as a
    courtesy. Cancelling the returned Deferred cancels C{work}.

    When the timer is due, the reactor first gets one more pass over its
    I/O: Twisted runs due timers before it reads sockets, so after a busy
    stretch of the reactor (hundreds of requests arriving at once) a reply
    that arrived in time, but was not read yet, would otherwise count as
    late. Measured: under 256 connections the proxy's 100 ms Redis timeout
    fired for replies already waiting in the socket, and those requests
    went through without their rate limit.
    """
    result: Deferred[T] = Deferred(lambda _: work.cancel())

    def onTimeout() -> None:
        if not result.called:
            result.errback(Failure(TimeoutError(f"no result within {seconds}s")))
        work.cancel()

    def afterOneMorePoll() -> None:
        # A call made now runs at the reactor's next timer pass, which
        # comes after its next poll of the sockets.
        timers[0] = clock.callLater(0, onTimeout)

    timers = [clock.callLater(seconds, afterOneMorePoll)]

    def finished(outcome: T | Failure) -> T | Failure | None:
        timer = timers[0]
        if timer.active():
            timer.cancel()
        if not result.called:
            if isinstance(outcome, Failure):
                result.errback(outcome)
            else:
                result.callback(outcome)
            return None
        if isinstance(outcome, Failure):
            # We timed out first; swallow the late failure of work (usually
            # our own CancelledError) so it is not logged as unhandled.
            outcome.trap(CancelledError, Exception)
        return None

    work.addBoth(finished)
    return result


def fireUnlessCalled(result: object, target: Deferred[Any]) -> None:
    """
    Fire C{target} with C{result} (a value, or a L{Failure} to errback
    with), unless it has fired already: a caller's Deferred cancelled while
    the call it waited for went on for others (L{svcd.common.coalesce}).
    Used as a callback, it consumes C{result}.
    """
    if not target.called:
        if isinstance(result, Failure):
            target.errback(result)
        else:
            target.callback(result)
