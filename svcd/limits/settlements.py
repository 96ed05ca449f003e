"""
Settlements (decisions D11, D12 amended): a reservation corrected to what
the provider counted and its cost, and the marks of rows the ledger
committed, sent to Redis off the request's path. They ride on the next
admission call when one is in flight or comes within a few milliseconds
(L{svcd.limits.calls.SharedCalls}), else go in a call of their own.

Against a Redis Cluster (decisions D16) every call keeps to one hash slot:
settlements wait by slot, ride only on an admission of their own slot, and
those sent alone go in one call per slot. A single server is one slot (0),
so that nothing changes there: one call takes every settlement waiting.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.limits.link import RedisCounters, keySlots
from svcd.limits.members import BudgetMembers
from svcd.limits.reconciliation import Reconciliation
from svcd.limits.records import Reservation
from svcd.limits.scripts import LedgerWork

# Members' settlements and marks of recorded rows, by (counter key, ledger
# id): what a call took of those waiting (L{Settlements.take}).
Sending = tuple[dict[tuple[str, str], int], dict[tuple[str, str], None]]


@attrs.define
class _Waiting:
    """
    The settlements of one hash slot not yet sent: the deltas (D11) by
    key, the members' settlements and the marks of recorded rows by
    (key, ledger id).
    """

    adjustments: dict[str, int] = attrs.Factory(dict)
    members: dict[tuple[str, str], int] = attrs.Factory(dict)
    marks: dict[tuple[str, str], None] = attrs.Factory(dict)


class Settlements:
    """
    The settlements waiting to be sent, and the call that sends them.

    @param settleDelay: how long a settlement waits, when no admission
        call is in flight, for one to ride on before it is sent alone
        (see L{svcd.limits.limiter.RedisRateLimiter}). 0: alone at once.
    @param openSeconds: how long a failed call's settlements wait before
        they may go alone again (the breaker's open time).
    """

    def __init__(
        self,
        counters: RedisCounters,
        clock: Clock,
        members: BudgetMembers,
        reconciliation: Reconciliation,
        unavailable: ThrottledWarning,
        timeout: float,
        openSeconds: float,
        settleDelay: float,
    ) -> None:
        self._counters = counters
        self._clock = clock
        self._members = members
        self._reconciliation = reconciliation
        self._unavailable = unavailable
        self._timeout = timeout
        self._openSeconds = openSeconds
        self._settleDelay = settleDelay
        self._settleTimer: IDelayedCall | None = None
        # A Redis Cluster's hash slot of a key; None for a single server,
        # which is one slot, 0 (decisions D16).
        self._slotOf = keySlots(counters)
        # Settlements (D11) and, for budget members (see
        # L{svcd.limits.limiter.RedisRateLimiter}), the settlements of
        # members and the marks of recorded rows not yet sent, by slot;
        # the call sending them alone in flight.
        self._waiting: dict[int, _Waiting] = {}
        self._adjusting: Deferred[object] | None = None
        # Admission calls in flight, by slot: while there is one,
        # settlements of its slot wait to ride on the next (see L{settle}).
        self._admitting: dict[int, int] = {}
        # When a failed call's settlements may go alone again.
        self._retryAt = 0.0
        # What the last call made took of those (L{take}).
        self.sending: Sending = ({}, {})

    def settle(self, reservation: Reservation, tokens: int, cost: int = 0) -> None:
        """
        Correct a reservation to the C{tokens} the provider counted and
        their C{cost}: its counters' deltas, or its budget members set to
        the cost.
        """
        changed = False
        delta = tokens - reservation.tokens
        # Every key of a reservation is of one organization: one slot.
        first = (reservation.keys or reservation.costKeys or ("",))[0]
        if delta:
            changed = True
            adjustments = self._waitingOf(first).adjustments
            for key in reservation.keys:
                adjustments[key] = adjustments.get(key, 0) + delta
        ledgerID = reservation.ledgerID
        if ledgerID is not None and reservation.costKeys:
            # The member is set to the cost, even an unchanged one: its
            # lease becomes the record grace, so that it stays counted
            # until the ledger has the row.
            changed = True
            self._members.release(ledgerID)
            now = self._clock.seconds()
            members = self._waitingOf(first).members
            for key in reservation.costKeys:
                members[key, ledgerID] = cost
            # Reconciled for a while yet: the member goes once its row
            # is recorded, which only a reconciliation does.
            self._reconciliation.usedAgain(reservation.costKeys, now)
            self._members.rememberSettled(ledgerID, reservation.costKeys, now)
        elif cost - reservation.cost:
            changed = True
            adjustments = self._waitingOf(first).adjustments
            for key in reservation.costKeys:
                adjustments[key] = adjustments.get(key, 0) + cost - reservation.cost
        if changed:
            self._settleSoon()

    def recorded(self, ledgerIDs: Sequence[str]) -> None:
        """
        Mark the members of the rows of C{ledgerIDs}, which the ledger
        committed, in the counters this proxy settled them in.
        """
        marked = False
        for ledgerID in ledgerIDs:
            costKeys = self._members.forgetSettled(ledgerID)
            if not costKeys:
                continue
            marks = self._waitingOf(costKeys[0]).marks
            for key in costKeys:
                marks[key, ledgerID] = None
            marked = True
        if marked:
            self._settleSoon()

    def _slot(self, key: str) -> int:
        return 0 if self._slotOf is None else self._slotOf(key)

    def _waitingOf(self, key: str) -> _Waiting:
        slot = self._slot(key)
        waiting = self._waiting.get(slot)
        if waiting is None:
            waiting = self._waiting[slot] = _Waiting()
        return waiting

    def _hasSettlements(self) -> bool:
        return bool(self._waiting)

    def _loose(self) -> list[int]:
        """
        The slots whose settlements wait with no admission call of their
        slot in flight to ride on: they go alone.
        """
        admitting = self._admitting
        return [slot for slot in self._waiting if slot not in admitting]

    def _settleSoon(self) -> None:
        """
        Have the settlements waiting sent: by the next admission call of
        their slot, in flight or coming within C{settleDelay}, else alone.
        """
        if self._adjusting is not None or self._settleTimer is not None or not self._loose():
            return
        delay = max(self._settleDelay, self._retryAt - self._clock.seconds())
        if delay <= 0:
            self._sendAdjustments()
            return
        self._settleTimer = asReactorTime(self._clock).callLater(delay, self._settleAlone)

    def _settleAlone(self) -> None:
        self._settleTimer = None
        if self._adjusting is None and self._loose():
            self._sendAdjustments()

    def admissionSent(self, keys: list[str]) -> int:
        """
        An admission call over C{keys} was sent: settlements of its slot
        wait for the next. Its slot, for L{admitted}.
        """
        slot = self._slot(keys[0]) if keys else 0
        self._admitting[slot] = self._admitting.get(slot, 0) + 1
        return slot

    def admitted(self, slot: int) -> None:
        """
        An admission call of C{slot} ended. Under load the next one
        follows at once and takes the settlements that came meanwhile;
        when none is sent (this was the last), they go on their own.
        """
        left = self._admitting[slot] - 1
        if left:
            self._admitting[slot] = left
            return
        del self._admitting[slot]
        if slot in self._waiting:
            self._settleSoon()

    def take(self, keys: list[str], slot: int | None = None) -> tuple[list[int], str, str]:
        """
        Every settlement waiting of the slot of C{keys} (or C{slot}), as
        the admission script's arguments over C{keys} (extended with the
        keys they need): the per-key deltas, the members' settlements, the
        marks of recorded rows. The members' settlements and marks taken
        are kept in L{sending} until the call's outcome: both are
        idempotent (a member set to its cost, a row marked), so a call
        that failed, or missed its deadline and perhaps did run, has them
        sent again (L{sendAgain}).
        """
        if slot is None:
            slot = self._slot(keys[0]) if keys else 0
        waiting = self._waiting.pop(slot, None)
        if waiting is None:
            self.sending = ({}, {})
            return [], "", ""
        where = {each: index for index, each in enumerate(keys, 1)}

        def indexOf(key: str) -> int:
            index = where.get(key)
            if index is None:
                keys.append(key)
                index = where[key] = len(keys)
            return index

        adjustments: list[int] = []
        for adjusted, delta in waiting.adjustments.items():
            if delta:
                adjustments += (indexOf(adjusted), delta)
        members = waiting.members
        settlements = ",".join(
            f"{indexOf(key)},{ledgerID},{cost}" for (key, ledgerID), cost in members.items()
        )
        marked = waiting.marks
        marks = ",".join(f"{indexOf(key)},{ledgerID}" for key, ledgerID in marked)
        self.sending = (members, marked)
        return adjustments, settlements, marks

    def sendAgain(self, failure: Failure, sent: Sending) -> Failure:
        """
        A call carrying members' settlements or marks failed: they wait
        for the next call (a newer settlement of the same member wins).
        While Redis is not connected they are dropped instead (L{
        _sendAdjustments}): the leases and reconciliation heal that.
        """
        members, marked = sent
        for member, cost in members.items():
            self._waitingOf(member[0]).members.setdefault(member, cost)
        for mark in marked:
            self._waitingOf(mark[0]).marks.setdefault(mark, None)
        # Not at once: a Redis that answers errors must not be asked again
        # in a loop. They ride on the next admission meanwhile.
        self._retryAt = self._clock.seconds() + self._openSeconds
        return failure

    def _sendAdjustments(self, everySlot: bool = False) -> None:
        """
        Send the settlements waiting with no admission of their slot in
        flight (or, C{everySlot}, all), in one call per slot; those that
        come while it is in flight go in the next. Off the request's path:
        a failed call leaves its reservations counted as they were (the
        safe side; members are released by their leases and
        reconciliation).
        """
        if not self._hasSettlements():
            return
        if not self._counters.connected:
            self._waiting = {}
            return
        slots = list(self._waiting) if everySlot else self._loose()
        calls = [call for call in map(self._sendSlot, slots) if call is not None]
        if not calls:
            return
        # A single server's settlements are one slot's: one call.
        adjusting: Deferred[object] = calls[0]
        if len(calls) > 1:
            adjusting = Deferred()
            gatherResults(calls).addBoth(adjusting.callback)
        self._adjusting = adjusting
        adjusting.addBoth(self._adjusted)

    def _sendSlot(self, slot: int) -> Deferred[object] | None:
        """
        The call that sends the settlements of C{slot}; it never fails.
        """
        keys: list[str] = []
        adjustments, settlements, marks = self.take(keys, slot)
        request: Deferred[object]
        if settlements or marks:
            request = self._counters.admit(
                keys,
                [0],
                adjustments,
                LedgerWork("", settlements, marks, self._members.timing),
            ).addCallback(lambda _: None)
        elif adjustments:
            request = self._counters.adjust(keys, adjustments[1::2])
        else:
            return None
        call = timeoutDeferred(request, self._timeout, asReactorTime(self._clock))
        call.addErrback(self.sendAgain, self.sending)
        call.addErrback(self._adjustFailed, len(keys))
        return call

    def _adjustFailed(self, failure: Failure, keys: int) -> None:
        self._unavailable.warn(
            "Redis did not take the settlements of {keys} counters ({error_type}); token"
            " reservations stay counted, budget members are sent again",
            keys=keys,
            error_type=type(failure.value).__name__,
        )

    def _adjusted(self, result: object) -> None:
        self._adjusting = None
        if self._hasSettlements():
            self._settleSoon()

    def flush(self) -> Deferred[object] | None:
        """
        Send the settlements still waiting now (the limiter stops, and must
        not leave reservations counted until their minute ends); the call
        in flight, if any.
        """
        if self._settleTimer is not None and self._settleTimer.active():
            self._settleTimer.cancel()
        self._settleTimer = None
        if self._hasSettlements() and self._adjusting is None:
            self._sendAdjustments(everySlot=True)
        return self._adjusting
