"""
A bound on the calls to svc-auth in flight, with the later stage of a
request served first.
"""

from __future__ import annotations

from collections import deque

from twisted.internet.defer import Deferred, succeed

# The stages of L{CallSlots}. A request's first call to svc-auth
# (ValidateToken), and work that no client waits for (the ledger's
# RecordUsage batches), wait at the first stage; the calls a request makes
# once it is under way (ValidateAgent, GetSpend) at the later one, and are
# served first.
FIRST_STAGE = 0
LATER_STAGE = 1


class QueueTimeout(Exception):
    """
    A call waited longer than the queue timeout for a free slot; it was
    never sent, and the request fails closed as for a timeout.
    """


class CallSlots:
    """
    At most C{size} calls to svc-auth in flight; the others wait here, the
    later stage of a request first.

    A chat request makes two calls, ValidateToken (stage 0) and then
    ValidateAgent (stage 1). Under overload a plain FIFO would make a
    request that has already been through ValidateToken queue again behind
    every newer request, and perhaps time out there, wasting the work done
    for it and turning it into a 503. Serving the higher stage first
    finishes requests already begun before starting new ones; within a
    stage, waiting is first come, first served.

    A waiter whose Deferred is cancelled (its queue timeout) is skipped
    when its turn comes.
    """

    def __init__(self, size: int, stages: int = 2) -> None:
        self._free = size
        self._waiting: tuple[deque[Deferred[None]], ...] = tuple(deque() for _ in range(stages))

    def acquire(self, stage: int) -> Deferred[None]:
        """
        A Deferred that fires when the caller may send its call; it must
        then call L{release} once the call has ended.
        """
        if self._free:
            self._free -= 1
            return succeed(None)
        turn: Deferred[None] = Deferred()
        self._waiting[stage].append(turn)
        return turn

    def release(self) -> None:
        for waiting in reversed(self._waiting):
            while waiting:
                turn = waiting.popleft()
                if not turn.called:
                    turn.callback(None)
                    return
        self._free += 1
