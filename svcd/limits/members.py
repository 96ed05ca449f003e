"""
Budget members (decisions D12, amended): each reservation made with a
ledger id is a member of each budget counter it counts in, leased in
Redis's time (see L{svcd.limits.limiter.RedisRateLimiter}). This proxy
keeps its own: those in flight, whose leases it renews every third of a
lease, and those settled lately, whose rows the outbox will say are
recorded.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.limits.link import RedisCounters, keySlots

# A reservation whose settlement has not come after this many seconds is
# no longer renewed (its request cannot still run: the edge settles every
# reservation, and upstream timeouts are minutes): its lease releases it.
_MAX_HOLD_SECONDS = 3600.0
# Members renewed by one call at most (a few ms of Redis).
_RENEWALS_PER_CALL = 2000
# Deadline of the calls off the request's path (renewals, reconciliation).
BACKGROUND_TIMEOUT = 2.0


class BudgetMembers:
    """
    This proxy's budget members: its reservations in flight (ledger id ->
    cost keys, amount, when admitted), whose leases it renews; the settled
    ones it remembers for L{forgetSettled} (ledger id -> cost keys, when
    settled; oldest first).

    @param lease: seconds a member of a request in flight is kept without
        renewal (SVC_BUDGET_LEASE).
    @param recordGrace: seconds a settled member is kept without its row
        being recorded (SVC_BUDGET_RECORD_GRACE); also how long this proxy
        remembers a settled reservation's counters.
    """

    def __init__(
        self,
        counters: RedisCounters,
        clock: Clock,
        unavailable: ThrottledWarning,
        timeout: float,
        lease: float,
        recordGrace: float,
    ) -> None:
        self._counters = counters
        # A Redis Cluster's hash slot of a key (decisions D16): each
        # renewal call keeps to one.
        self._slotOf = keySlots(counters)
        self._clock = clock
        self._unavailable = unavailable
        self._timeout = timeout
        self._lease = lease
        self._recordGrace = recordGrace
        # The lease and the record grace in ms, as the admission script
        # takes them (L{svcd.limits.scripts.LedgerWork}).
        self.timing = f"{round(lease * 1000)},{round(recordGrace * 1000)}"
        self._inFlight: dict[str, tuple[tuple[str, ...], int, float]] = {}
        self._settled: dict[str, tuple[tuple[str, ...], float]] = {}
        self._renewals: LoopingCall | None = None
        self._renewing: Deferred[object] | None = None

    def hold(self, ledgerID: str, costKeys: tuple[str, ...], cost: int, now: float) -> None:
        """
        A reservation was admitted with C{ledgerID}: its members are renewed
        until it is settled.
        """
        self._inFlight[ledgerID] = (costKeys, cost, now)

    def release(self, ledgerID: str) -> None:
        """
        The reservation of C{ledgerID} was settled: no more renewals.
        """
        self._inFlight.pop(ledgerID, None)

    def holding(self) -> set[str]:
        """
        The budget counters holding a member of a reservation in flight.
        """
        return {key for costKeys, _, _ in self._inFlight.values() for key in costKeys}

    def rememberSettled(self, ledgerID: str, costKeys: tuple[str, ...], now: float) -> None:
        """
        Keep a settled reservation's counters for L{forgetSettled}, for the
        record grace at most (oldest forgotten first): its member is
        dropped by then anyway.
        """
        self._settled[ledgerID] = (costKeys, now)
        settled = self._settled
        while settled:
            oldest = next(iter(settled))
            if now - settled[oldest][1] <= self._recordGrace:
                break
            del settled[oldest]

    def forgetSettled(self, ledgerID: str) -> tuple[str, ...] | None:
        """
        The counters of a settled reservation whose row is recorded, or
        None when this proxy does not remember it.
        """
        settled = self._settled.pop(ledgerID, None)
        return None if settled is None else settled[0]

    def start(self) -> None:
        """
        Renew the leases every third of a lease.
        """
        if self._lease > 0:
            self._renewals = LoopingCall(self._renew)
            self._renewals.clock = asReactorTime(self._clock)
            self._renewals.start(self._lease / 3, now=False)

    def stop(self) -> None:
        if self._renewals is not None and self._renewals.running:
            self._renewals.stop()
        self._renewals = None

    def _renew(self) -> None:
        """
        Push the leases of this proxy's reservations in flight: one call
        per round, or one per L{_RENEWALS_PER_CALL} members for a proxy
        holding more (so that no call keeps Redis from the admissions of
        every proxy for long), and against a Redis Cluster one per hash
        slot (an organization's members are one slot's); a reservation
        held past L{_MAX_HOLD_SECONDS} (one whose settlement never came)
        is left to its lease.
        """
        if not self._inFlight or self._renewing is not None or not self._counters.connected:
            return
        now = self._clock.seconds()
        members: list[tuple[str, str, int]] = []
        for ledgerID, (costKeys, amount, since) in list(self._inFlight.items()):
            if now - since > _MAX_HOLD_SECONDS:
                del self._inFlight[ledgerID]
                continue
            members += ((key, ledgerID, amount) for key in costKeys)
        if not members:
            return
        renewing = self._renewing = Deferred.fromCoroutine(self._renewAll(members))
        renewing.addErrback(self._backgroundFailed, "renew the leases of requests in flight")
        renewing.addBoth(self._renewed)

    async def _renewAll(self, members: list[tuple[str, str, int]]) -> None:
        leaseMs = round(self._lease * 1000)
        for batch in self._batches(members):
            keys: list[str] = []
            where: dict[str, int] = {}
            triples: list[str] = []
            for key, ledgerID, amount in batch:
                index = where.get(key)
                if index is None:
                    keys.append(key)
                    index = where[key] = len(keys)
                triples.append(f"{index},{ledgerID},{amount}")
            await timeoutDeferred(
                self._counters.renew(keys, leaseMs, ",".join(triples)),
                max(self._timeout, BACKGROUND_TIMEOUT),
                asReactorTime(self._clock),
            )

    def _batches(self, members: list[tuple[str, str, int]]) -> list[list[tuple[str, str, int]]]:
        """
        C{members} in calls of L{_RENEWALS_PER_CALL} at most, each of one
        hash slot against a Redis Cluster.
        """
        if self._slotOf is None:
            groups = [members]
        else:
            bySlot: dict[int, list[tuple[str, str, int]]] = {}
            for member in members:
                bySlot.setdefault(self._slotOf(member[0]), []).append(member)
            groups = list(bySlot.values())
        return [
            group[start : start + _RENEWALS_PER_CALL]
            for group in groups
            for start in range(0, len(group), _RENEWALS_PER_CALL)
        ]

    def _renewed(self, result: object) -> object:
        self._renewing = None
        return result

    def _backgroundFailed(self, failure: Failure, what: str) -> None:
        self._unavailable.warn(
            "Redis could not {what} ({error_type}); tried again at the next round",
            what=what,
            error_type=type(failure.value).__name__,
        )
