"""
A client's searches of svc-memory coalesced by organization into
SearchMany calls (L{SearchBatches}), so that a busy proxy's recalls share
a call's cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import grpc
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from svcd.common.coalesce import Coalescer
from svcd.common.deferreds import fireUnlessCalled
from svcd.memoryclient.client import MemoryClient, searchRequest
from svcd.memoryclient.errors import MemoryCallFailed, MemoryUnavailable, refusalOf
from svcd.memoryclient.records import MAX_SEARCHES_PER_CALL, Embedding, Scope
from svcd.pb.memory.v1 import memory_pb2


@attrs.define(eq=False)
class _Waiting:
    """
    A search of L{SearchBatches}: its request, when its deadline passes
    (on the clock's time), its caller's Deferred, while it is held the
    timer that fails it at its deadline, and once sent, its call and the
    searches that share it.
    """

    # The query's text and vector: never in a repr.
    request: memory_pb2.SearchRequest = attrs.field(repr=False)
    deadline: float
    result: Deferred[memory_pb2.SearchResponse] = attrs.field(init=False)
    timer: IDelayedCall | None = None
    call: Deferred[Any] | None = None
    batch: Sequence[_Waiting] = ()

    def stopTimer(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None and timer.active():
            timer.cancel()


class SearchBatches:
    """
    A client's searches coalesced by organization (L{svcd.common.coalesce}):
    a search of an organization with fewer than C{maxInFlight} searches in
    flight is sent at once, alone, as L{MemoryClient.search} sends it;
    those that come while it has that many are sent together when one
    ends, up to C{maxBatch} in one SearchMany. A quiet proxy's recall waits
    for nothing; a busy one's share a call's cost (its creation and
    grpcio's hand-offs in this process, svc-memory's handling of a call),
    which is more CPU than the search itself. Organizations never share a
    call, so that one's slow search (a scope loaded from PostgreSQL) holds
    back no other's.

    What a search waits for its turn counts in its own deadline: one whose
    deadline passes while it waits fails L{MemoryUnavailable} then, unsent,
    and one sent has what is left (a SearchMany has its latest search's).
    Cancelling a search's Deferred fails it at once with
    L{twisted.internet.defer.CancelledError}; its call goes on for the
    others that share it, and is cancelled when none is left waiting.

    An svc-memory of an earlier release answers SearchMany UNIMPLEMENTED:
    that batch's searches are then sent again one call each, as is every
    later batch until C{retryBatchesAfter} seconds have passed (a rolling
    upgrade).

    @param client: what sends the calls.
    @param clock: the deadlines' time (the reactor).
    @param maxInFlight: an organization's calls in flight before its
        searches wait to share one (C{SVC_MEMORY_RECALL_CALLS}).
    @param maxBatch: the most searches of one call (svc-memory takes
        L{MAX_SEARCHES_PER_CALL}).
    """

    log = Logger()

    def __init__(
        self,
        client: MemoryClient,
        clock: IReactorTime,
        maxInFlight: int = 1,
        maxBatch: int = MAX_SEARCHES_PER_CALL,
        retryBatchesAfter: float = 60.0,
    ) -> None:
        if not 1 <= maxBatch <= MAX_SEARCHES_PER_CALL:
            raise ValueError(f"a batch holds 1 to {MAX_SEARCHES_PER_CALL} searches")
        self._client = client
        self._clock = clock
        self._retryBatchesAfter = retryBatchesAfter
        self._batchesRefusedAt: float | None = None
        self._coalescer: Coalescer[str, _Waiting] = Coalescer(self._send, maxBatch, maxInFlight)

    def search(
        self,
        scope: Scope,
        query: Embedding | None,
        k: int,
        minScore: float | None = None,
        timeout: float | None = None,
        mode: str = "vector",
        text: str = "",
    ) -> Deferred[memory_pb2.SearchResponse]:
        """
        As L{MemoryClient.search}.
        """
        seconds = self._client.timeout if timeout is None else timeout
        waiting = _Waiting(
            searchRequest(scope, query, k, minScore, mode, text), self._clock.seconds() + seconds
        )
        waiting.result = Deferred(lambda _: self._cancelled(waiting))
        self._coalescer.submit(waiting.request.scope.org_id, waiting)
        if waiting.call is None and not waiting.result.called:
            # Held: it fails at its deadline if its turn has not come.
            waiting.timer = self._clock.callLater(seconds, self._expired, waiting)
        return waiting.result

    def _expired(self, waiting: _Waiting) -> None:
        waiting.timer = None
        if self._coalescer.withdraw(waiting.request.scope.org_id, waiting):
            waiting.result.errback(_pastItsDeadline())

    def _cancelled(self, waiting: _Waiting) -> None:
        # Deferred.cancel fails the search's Deferred with CancelledError
        # after this. Still held: it is not sent. Sent: its call goes on
        # for the others, and ends when none is left.
        waiting.stopTimer()
        if waiting.call is None:
            self._coalescer.withdraw(waiting.request.scope.org_id, waiting)
        elif all(each is waiting or each.result.called for each in waiting.batch):
            waiting.call.cancel()

    def _send(self, _: str, batch: list[_Waiting]) -> Deferred[Any]:
        now = self._clock.seconds()
        due = []
        for waiting in batch:
            waiting.stopTimer()
            if waiting.deadline > now:
                due.append(waiting)
            else:
                waiting.result.errback(_pastItsDeadline())
        if not due:
            return succeed(None)
        return self._sendDue(due, now).addBoth(_forget, due)

    def _sendDue(self, due: list[_Waiting], now: float) -> Deferred[Any]:
        if len(due) == 1:
            return self._sendAlone(due[0], now)
        refused = self._batchesRefusedAt
        if refused is not None and now - refused < self._retryBatchesAfter:
            return self._eachAlone(due, now)
        called: Deferred[Any] = self._client.call(
            "SearchMany",
            memory_pb2.SearchManyRequest(searches=[each.request for each in due]),
            max(each.deadline for each in due) - now,
        )
        for waiting in due:
            waiting.call, waiting.batch = called, due
        return called.addCallbacks(
            self._answered, self._failed, callbackArgs=(due,), errbackArgs=(due,)
        )

    def _sendAlone(self, waiting: _Waiting, now: float) -> Deferred[Any]:
        called: Deferred[Any] = self._client.call(
            "Search", waiting.request, max(waiting.deadline - now, _LEAST_SECONDS)
        )
        waiting.call, waiting.batch = called, (waiting,)
        return called.addBoth(fireUnlessCalled, waiting.result)

    def _eachAlone(self, batch: Sequence[_Waiting], now: float) -> Deferred[Any]:
        sent = []
        for waiting in batch:
            if waiting.result.called:
                continue
            if waiting.deadline <= now:
                waiting.result.errback(_pastItsDeadline())
            else:
                sent.append(self._sendAlone(waiting, now))
        return DeferredList(sent)

    def _answered(self, answer: memory_pb2.SearchManyResponse, batch: list[_Waiting]) -> None:
        for index, waiting in enumerate(batch):
            if waiting.result.called:
                continue
            if index >= len(answer.outcomes):
                waiting.result.errback(MemoryUnavailable(None, "SearchMany answered too few"))
                continue
            outcome = answer.outcomes[index]
            if outcome.code == 0:
                waiting.result.callback(outcome.response)
            else:
                code = _CODES.get(outcome.code, grpc.StatusCode.UNKNOWN)
                waiting.result.errback(refusalOf(code, outcome.details))

    def _failed(self, failure: Failure, batch: list[_Waiting]) -> Deferred[Any] | None:
        error = failure.value
        if isinstance(error, MemoryCallFailed) and error.code is grpc.StatusCode.UNIMPLEMENTED:
            # An svc-memory of an earlier release: each alone, now and for
            # a while. The next batch waits for these.
            now = self._clock.seconds()
            self._batchesRefusedAt = now
            self.log.info("svc-memory answers no SearchMany: searches go one call each for now")
            return self._eachAlone(batch, now)
        for waiting in batch:
            if not waiting.result.called:
                waiting.result.errback(failure)
        return None


def _forget(result: object, batch: Sequence[_Waiting]) -> object:
    """
    Cut the references between a call's searches and the call, once it
    has ended: a search refers to its call and its batch (which holds it),
    and without this every recall would leave a cycle for the collector.
    """
    for waiting in batch:
        waiting.call, waiting.batch = None, ()
    return result


def _pastItsDeadline() -> MemoryUnavailable:
    """
    The failure of a search whose deadline passed while it waited for its
    turn: DEADLINE_EXCEEDED, as grpcio's own deadline would end it.
    """
    return MemoryUnavailable(
        grpc.StatusCode.DEADLINE_EXCEEDED, "the search's deadline passed before its turn"
    )


# The shortest deadline a search that waited its turn is sent with.
_LEAST_SECONDS = 0.001


_CODES = {code.value[0]: code for code in grpc.StatusCode}
