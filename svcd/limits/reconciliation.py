"""
Reconciliation (decisions D12, amended): every C{reconcileInterval} (with
jitter) each budget counter this proxy used lately is set to the ledger's
spend plus its members left (L{svcd.limits.scripts.RECONCILE_SCRIPT}), so
that spend admitted while Redis was away is added, a lost settlement is
released and a stale restore is corrected (see
L{svcd.limits.limiter.RedisRateLimiter}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.limits.breaker import CircuitBreaker
from svcd.limits.keys import BUDGET_KEY_SLACK, Counter, periodOfKey
from svcd.limits.link import RedisCounters
from svcd.limits.members import BACKGROUND_TIMEOUT, BudgetMembers

# Decisions D12, amended: a budget counter is reconciled until the record
# grace and this many rounds have passed since this proxy last used it (or
# while it holds a reservation of it in flight).
_RECENT_ROUNDS = 2
# A correction larger than 1/this of the budget is logged.
_LARGE_CORRECTION = 100


class Spend(Protocol):
    """
    What a budget's period has cost so far, from the ledger (decisions
    D12): svc-auth's GetSpend.
    """

    def __call__(
        self, orgID: str, agentID: str | None, since: int, until: int
    ) -> Deferred[int]: ...


@attrs.define(eq=False)
class _BudgetUse:
    """
    A budget counter this proxy used lately (decisions D12, amended): whose
    it is, its limit, and when it was last used, so that reconciliation
    visits it while it matters.
    """

    orgID: str
    agentID: str | None
    limit: int
    lastUsed: float


class Reconciliation:
    """
    The budget counters this proxy used, and the rounds that set them to
    the ledger's spend plus their members left.

    @param log: the limiter's logger: large corrections are logged under
        its namespace.
    @param interval: seconds between reconciliations
        (SVC_BUDGET_RECONCILE_INTERVAL); 0 turns them off.
    @param random: a number in [0, 1) for the jitter of reconciliations.
    """

    def __init__(
        self,
        counters: RedisCounters,
        clock: Clock,
        breaker: CircuitBreaker,
        members: BudgetMembers,
        spend: Spend | None,
        unavailable: ThrottledWarning,
        log: Logger,
        timeout: float,
        recordGrace: float,
        interval: float,
        random: Callable[[], float],
    ) -> None:
        self._counters = counters
        self._clock = clock
        self._breaker = breaker
        self._members = members
        self._spend = spend
        self._unavailable = unavailable
        self._log = log
        self._timeout = timeout
        self._recordGrace = recordGrace
        self._reconcileInterval = interval
        self._random = random
        self._budgets: dict[str, _BudgetUse] = {}
        self._reconcileTimer: IDelayedCall | None = None
        self._reconciling: Deferred[None] | None = None
        self._lastCorrectionLog: float | None = None
        self._correctionsUnlogged = 0
        # Budget counters set from the ledger, and those among them whose
        # correction was large (tests and operators' curiosity).
        self.reconciled = 0
        self.corrections = 0

    def used(self, budget: Counter, orgID: str, agentID: str | None, now: float) -> None:
        """
        A request was checked against C{budget}: reconciled while it
        matters.
        """
        if self._reconcileInterval <= 0:
            # Nothing would visit (or forget) it.
            return
        use = self._budgets.get(budget.key)
        if use is None:
            self._budgets[budget.key] = _BudgetUse(orgID, agentID, budget.limit, now)
        else:
            use.limit = budget.limit
            use.lastUsed = now

    def usedAgain(self, keys: tuple[str, ...], now: float) -> None:
        """
        A reservation of the budget counters C{keys} was settled: they are
        used as of C{now}.
        """
        for key in keys:
            use = self._budgets.get(key)
            if use is not None:
                use.lastUsed = now

    def start(self) -> None:
        self._scheduleReconciliation()

    def stop(self) -> None:
        if self._reconcileTimer is not None and self._reconcileTimer.active():
            self._reconcileTimer.cancel()
        self._reconcileTimer = None

    def _scheduleReconciliation(self) -> None:
        if self._reconcileInterval <= 0:
            return
        # Between 3/4 of the interval and the whole: proxies spread out, and
        # no two rounds are ever further apart than the interval (the bound
        # the operator set, and the one the release of a lost settlement
        # is promised within).
        delay = self._reconcileInterval * (0.75 + 0.25 * self._random())
        self._reconcileTimer = asReactorTime(self._clock).callLater(delay, self._reconcileDue)

    def _reconcileDue(self) -> None:
        self._reconcileTimer = None
        if self._reconciling is None:
            self._reconciling = self.reconcile()
            self._reconciling.addBoth(self._reconcileEnded)
        self._scheduleReconciliation()

    def _reconcileEnded(self, result: None) -> None:
        self._reconciling = None
        return result

    def reconcile(self) -> Deferred[None]:
        """
        One round: each budget counter this proxy used within the record
        grace and two intervals (or holds a reservation in flight in) set
        to the ledger's spend plus its members left. Fires when done;
        never fails.
        """
        return Deferred.fromCoroutine(self._reconcileAll())

    async def _reconcileAll(self) -> None:
        now = self._clock.seconds()
        # A counter is visited while a member of this proxy's making may be
        # in it: in flight (holding), or settled within the record grace.
        horizon = now - self._recordGrace - _RECENT_ROUNDS * self._reconcileInterval
        holding = self._members.holding()
        for key, use in list(self._budgets.items()):
            start, end = periodOfKey(key)
            if end + BUDGET_KEY_SLACK < now or (use.lastUsed < horizon and key not in holding):
                del self._budgets[key]
                continue
            if self._spend is None or not self._counters.connected or self._breaker.isOpen:
                return
            try:
                await self._reconcileOne(key, use, start, end, now)
            except CancelledError:
                raise
            except Exception as error:
                self._unavailable.warn(
                    "A budget's counter could not be reconciled with the ledger ({error_type});"
                    " it stays as it is until the next round",
                    error_type=type(error).__name__,
                )

    async def _reconcileOne(
        self, key: str, use: _BudgetUse, start: int, end: int, now: float
    ) -> None:
        assert self._spend is not None
        reactorTime = asReactorTime(self._clock)
        deadline = max(self._timeout, BACKGROUND_TIMEOUT)
        # t0 before the ledger is read: a row recorded before t0 is in L;
        # in the time of the server holding the counter, whose time the
        # marks of recorded rows are in.
        t0 = await timeoutDeferred(self._counters.redisTime(key), deadline, reactorTime)
        spent = await self._spend(use.orgID, use.agentID, start, end)
        ttl = max(1, end - int(now) + BUDGET_KEY_SLACK)
        before, after, members = await timeoutDeferred(
            self._counters.reconcile(key, int(t0), spent, ttl), deadline, reactorTime
        )
        self.reconciled += 1
        correction = after - before if before >= 0 else after
        if before >= 0 and abs(correction) * _LARGE_CORRECTION < max(use.limit, 1):
            return
        self.corrections += 1
        now = self._clock.seconds()
        if self._lastCorrectionLog is not None and now - self._lastCorrectionLog < 10.0:
            self._correctionsUnlogged += 1
            return
        self._lastCorrectionLog = now
        unlogged, self._correctionsUnlogged = self._correctionsUnlogged, 0
        self._log.info(
            "A budget's counter was set to the ledger's spend plus {members} reservations"
            " still counted: {before} -> {after} nano-dollars (-1: it was gone); {unlogged}"
            " more large corrections since the last line",
            members=members,
            before=before,
            after=after,
            spent=spent,
            unlogged=unlogged,
        )
