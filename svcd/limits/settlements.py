"""
Settlements (decisions D11, D12 amended): a reservation corrected to what
the provider counted and its cost, and the marks of rows the ledger
committed, sent to Redis off the request's path. They ride on the next
admission call when one is in flight or comes within a few milliseconds
(L{svcd.limits.calls.SharedCalls}), else go in a call of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.limits.link import RedisCounters
from svcd.limits.members import BudgetMembers
from svcd.limits.reconciliation import Reconciliation
from svcd.limits.records import Reservation
from svcd.limits.scripts import LedgerWork

# Members' settlements and marks of recorded rows, by (counter key, ledger
# id): what a call took of those waiting (L{Settlements.take}).
Sending = tuple[dict[tuple[str, str], int], dict[tuple[str, str], None]]


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
        # Settlements (D11) not yet sent, by key, and the call in flight.
        self._adjustments: dict[str, int] = {}
        self._adjusting: Deferred[object] | None = None
        # Admission calls in flight: while there is one, settlements wait
        # to ride on the next (see L{settle}).
        self._admitting = 0
        # Budget members (see L{svcd.limits.limiter.RedisRateLimiter}):
        # the settlements of members and the marks of recorded rows not
        # yet sent, by (key, ledger id).
        self._memberSettlements: dict[tuple[str, str], int] = {}
        self._marks: dict[tuple[str, str], None] = {}
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
        if delta:
            changed = True
            for key in reservation.keys:
                self._adjustments[key] = self._adjustments.get(key, 0) + delta
        ledgerID = reservation.ledgerID
        if ledgerID is not None and reservation.costKeys:
            # The member is set to the cost, even an unchanged one: its
            # lease becomes the record grace, so that it stays counted
            # until the ledger has the row.
            changed = True
            self._members.release(ledgerID)
            now = self._clock.seconds()
            for key in reservation.costKeys:
                self._memberSettlements[key, ledgerID] = cost
            # Reconciled for a while yet: the member goes once its row
            # is recorded, which only a reconciliation does.
            self._reconciliation.usedAgain(reservation.costKeys, now)
            self._members.rememberSettled(ledgerID, reservation.costKeys, now)
        elif cost - reservation.cost:
            changed = True
            for key in reservation.costKeys:
                self._adjustments[key] = self._adjustments.get(key, 0) + cost - reservation.cost
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
            if costKeys is None:
                continue
            for key in costKeys:
                self._marks[key, ledgerID] = None
            marked = True
        if marked:
            self._settleSoon()

    def _hasSettlements(self) -> bool:
        return bool(self._adjustments or self._memberSettlements or self._marks)

    def _settleSoon(self) -> None:
        """
        Have the settlements waiting sent: by the next admission call, in
        flight or coming within C{settleDelay}, else alone.
        """
        if self._adjusting is not None or self._admitting or self._settleTimer is not None:
            return
        delay = max(self._settleDelay, self._retryAt - self._clock.seconds())
        if delay <= 0:
            self._sendAdjustments()
            return
        self._settleTimer = asReactorTime(self._clock).callLater(delay, self._settleAlone)

    def _settleAlone(self) -> None:
        self._settleTimer = None
        if self._hasSettlements() and self._adjusting is None and not self._admitting:
            self._sendAdjustments()

    def admissionSent(self) -> None:
        """
        An admission call was sent: settlements wait for the next.
        """
        self._admitting += 1

    def admitted(self) -> None:
        """
        An admission call ended. Under load the next one follows at once
        and takes the settlements that came meanwhile; when none is sent
        (this was the last), they go on their own.
        """
        self._admitting -= 1
        if self._hasSettlements() and not self._admitting:
            self._settleSoon()

    def take(self, keys: list[str]) -> tuple[list[int], str, str]:
        """
        Every settlement waiting, as the admission script's arguments over
        C{keys} (extended with the keys they need): the per-key deltas,
        the members' settlements, the marks of recorded rows. The members'
        settlements and marks taken are kept in L{sending} until the
        call's outcome: both are idempotent (a member set to its cost, a
        row marked), so a call that failed, or missed its deadline and
        perhaps did run, has them sent again (L{sendAgain}).
        """
        where = {each: index for index, each in enumerate(keys, 1)}

        def indexOf(key: str) -> int:
            index = where.get(key)
            if index is None:
                keys.append(key)
                index = where[key] = len(keys)
            return index

        adjustments: list[int] = []
        if self._adjustments:
            waiting, self._adjustments = self._adjustments, {}
            for adjusted, delta in waiting.items():
                if delta:
                    adjustments += (indexOf(adjusted), delta)
        settlements = ""
        members: dict[tuple[str, str], int] = {}
        if self._memberSettlements:
            members, self._memberSettlements = self._memberSettlements, {}
            settlements = ",".join(
                f"{indexOf(key)},{ledgerID},{cost}" for (key, ledgerID), cost in members.items()
            )
        marks = ""
        marked: dict[tuple[str, str], None] = {}
        if self._marks:
            marked, self._marks = self._marks, {}
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
            self._memberSettlements.setdefault(member, cost)
        for mark in marked:
            self._marks.setdefault(mark, None)
        # Not at once: a Redis that answers errors must not be asked again
        # in a loop. They ride on the next admission meanwhile.
        self._retryAt = self._clock.seconds() + self._openSeconds
        return failure

    def _sendAdjustments(self) -> None:
        """
        Send every settlement waiting, in one call; those that come while
        it is in flight go in the next. Off the request's path: a failed
        call leaves its reservations counted as they were (the safe side;
        members are released by their leases and reconciliation).
        """
        if not self._hasSettlements():
            return
        if not self._counters.connected:
            self._adjustments, self._memberSettlements, self._marks = {}, {}, {}
            return
        keys: list[str] = []
        adjustments, settlements, marks = self.take(keys)
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
            return
        call = self._adjusting = timeoutDeferred(request, self._timeout, asReactorTime(self._clock))
        call.addErrback(self.sendAgain, self.sending)
        call.addErrback(self._adjustFailed, len(keys))
        call.addBoth(self._adjusted)

    def _adjustFailed(self, failure: Failure, keys: int) -> None:
        self._unavailable.warn(
            "Redis did not take the settlements of {keys} counters ({error_type}); token"
            " reservations stay counted, budget members are sent again",
            keys=keys,
            error_type=type(failure.value).__name__,
        )

    def _adjusted(self, result: object) -> None:
        self._adjusting = None
        if self._hasSettlements() and not self._admitting:
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
            self._sendAdjustments()
        return self._adjusting
