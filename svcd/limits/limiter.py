"""
The organization rate limit of spec section 8 and decisions D5: a fixed
calendar-minute window per organization, counted in Redis under
C{ratelimit:{<org_id>}:<window_start_unix_seconds>} (the braces: D16).

At most one round trip per request, and under load far fewer: a Lua
script adds to the counter and gives a fresh key its TTL atomically
(txredisapi sends it with EVALSHA once the script is cached), and the hits
of one key that arrive while its call is in flight share the next call,
which adds their number at once (see L{RedisRateLimiter}). The limiter
fails open: with Redis unconfigured, down, or slower than its budget, the
request goes on without X-RateLimit-* headers and a warning is logged.
Failing open is also cheap (D10): after a counter call fails or misses its
deadline, a circuit breaker (L{svcd.limits.breaker}) skips Redis for one
second, then lets one request try it, so a hung Redis costs one deadline
per second instead of one per request.

The parts, each with its own state, composed by L{RedisRateLimiter}:
L{svcd.limits.check} checks each request, in a call shared with the
others of its key (L{svcd.limits.calls}), over the connection of
L{svcd.limits.link} running the scripts of L{svcd.limits.scripts} on the
counters of L{svcd.limits.keys}; L{svcd.limits.settlements} corrects
reservations, riding on those calls; L{svcd.limits.members} keeps the
leases of this proxy's budget members, and L{svcd.limits.reconciliation}
brings budget counters back to the ledger's spend.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTCP
from twisted.logger import Logger

from svcd.common.clocks import Clock
from svcd.common.config import RedisTarget, SentinelTarget
from svcd.common.logthrottle import ThrottledWarning
from svcd.common.readiness import CheckFailed
from svcd.limits.book import NO_LIMITS, Applicable, LimitBook
from svcd.limits.breaker import CircuitBreaker
from svcd.limits.calls import Gauge, SharedCalls
from svcd.limits.check import LabelledCounter, RateDecision, RequestCheck
from svcd.limits.link import RedisCounters, linkFor
from svcd.limits.members import BudgetMembers
from svcd.limits.reconciliation import Reconciliation, Spend
from svcd.limits.records import Reservation
from svcd.limits.sentinellink import SentinelLink
from svcd.limits.settlements import Settlements


class RateLimiter(Protocol):
    """
    What the proxy needs of a rate limiter.
    """

    async def hit(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int = 0,
        cost: int = 0,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        """
        Count one request of C{orgID} by C{agentID}, reserving C{tokens}
        where a token limit applies and C{cost} (nano-dollars) where a
        budget does, and decide on it; C{None} when the
        limiter could not decide and the request goes on (fail open).
        Without limits rows (D11) the agent is ignored: the limit is the
        organization's (D5). With C{ledgerID} (the request's ledger row
        key, decisions D12 amended) each budget holds the reservation as a
        member of its own until the ledger has the row.
        """

    async def hitTokens(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int,
        cost: int,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        """
        As L{hit}, for a call checked and counted against token limits and
        budgets only, never against a requests limit (svc-worker's provider
        calls, decisions D13: the organization's requests per minute are
        its clients' requests); C{None} at once, without Redis, when
        neither applies.
        """

    def applicable(self, orgID: str, agentID: str | None) -> Applicable:
        """
        The limits rows that apply to a request of C{orgID} by C{agentID}.
        """

    def settle(self, reservation: Reservation, tokens: int, cost: int = 0) -> None:
        """
        Correct a reservation to the C{tokens} the provider counted and
        their C{cost} (0 releases it), in the minute and period it was
        made.
        """

    def recorded(self, ledgerIDs: Sequence[str]) -> None:
        """
        The ledger committed the rows of C{ledgerIDs} (the outbox tells,
        after svc-auth's acknowledgement): their budget members may go at
        the next reconciliation, since the ledger's spend now holds them.
        """

    def checkReady(self) -> Deferred[None]:
        """
        The /ready check C{redis}: fires when Redis answers PING, fails with
        L{CheckFailed} otherwise.
        """

    def start(self) -> None:
        """
        Begin connecting.
        """

    def stop(self) -> Deferred[None]:
        """
        Close the connection.
        """


class RedisRateLimiter:
    """
    The fixed-window limiter over Redis.

    Hits of one key share calls: a hit sends its call at once when none of
    its key is in flight; the hits that come while one is wait for it to
    end and then go together in the next call, which adds their number to
    the counter. Each gets the count it would have had alone: the call's
    answer minus the hits that came after it. So a busy organization costs
    Redis (and this process's Redis client, the dearer part) one round trip
    per round-trip time instead of one per request, an idle one is counted
    at once, and no hit waits for more than the call before its own.

    With limits rows (decisions D11, L{LimitBook}) a request has up to four
    counters (its organization's requests and tokens, its agent's requests
    and tokens), all checked and counted in one script call
    (C{ADMIT_SCRIPT}) so that no replica can admit past any of them; the
    requests of one organization share calls the same way, one call
    checking each of them in the order they came. An organization and
    agent without rows are counted exactly as D5 says, above.

    Budgets converge to the ledger (decisions D12, amended). A budget's
    counter K stays one integer, so admission is one GET and one INCRBY;
    beside it each reservation made with a ledger id is a member (its
    amount in K:members, a lease in K:leases, in Redis's time). While its
    request is in flight this proxy renews the lease every C{lease}/3
    seconds; its settlement sets the member to the cost and leases it for
    C{recordGrace}; once the outbox says the ledger committed the row
    (L{recorded}) the member is marked in K:recorded. Every
    C{reconcileInterval} (with jitter) each budget counter used lately is
    set to the ledger's spend plus its members left, after dropping those
    whose lease passed (a proxy killed mid-request, a settlement older
    than the grace) and those recorded before the ledger was read. So
    spend admitted while Redis was away is added, a lost settlement is
    released within a lease and a round, and a stale restore is corrected,
    with at most a row counted twice for a round (the safe side).

    @param clock: the time source for windows, the timer of the Redis
        budget and the circuit breaker; tests pass a
        L{twisted.internet.task.Clock}.
    @param circuitOpen: the gauge C{svc_proxy_ratelimit_circuit_open}, set
        to 1 while the breaker skips Redis and to 0 once it closes.
    @param openSeconds: how long the breaker skips Redis after a failure.
    @param settleDelay: how long a settlement waits, when no admission
        call is in flight, for one to ride on before it is sent alone:
        under load the next comes within a millisecond, and a count that
        is corrected a few milliseconds later changes nothing that
        matters. 0: alone at once.
    @param unchecked: the counter C{svc_proxy_unchecked_admissions_total}
        (label C{reason}): every request let through without checking a
        limit or a budget.
    @param lease: seconds a member of a request in flight is kept without
        renewal (SVC_BUDGET_LEASE).
    @param recordGrace: seconds a settled member is kept without its row
        being recorded (SVC_BUDGET_RECORD_GRACE); also how long this proxy
        remembers a settled reservation's counters for L{recorded}.
    @param reconcileInterval: seconds between reconciliations
        (SVC_BUDGET_RECONCILE_INTERVAL); 0 turns them off.
    @param random: a number in [0, 1) for the jitter of reconciliations.
    """

    log = Logger()

    def __init__(
        self,
        counters: RedisCounters,
        clock: Clock,
        defaultRPM: int,
        orgRPM: Mapping[str, int] | None = None,
        timeout: float = 0.1,
        warnInterval: float = 10.0,
        circuitOpen: Gauge | None = None,
        openSeconds: float = 1.0,
        book: LimitBook | None = None,
        spend: Spend | None = None,
        settleDelay: float = 0.01,
        unchecked: LabelledCounter | None = None,
        lease: float = 30.0,
        recordGrace: float = 300.0,
        reconcileInterval: float = 30.0,
        random: Callable[[], float] = random.random,
    ) -> None:
        self._counters = counters
        self._book = book if book is not None else LimitBook()
        # One throttle for every warning of the limiter's, and its parts
        # log under its namespace: the log reads as one component's.
        log = self.log
        unavailable = ThrottledWarning(log, clock, warnInterval)
        breaker = CircuitBreaker(clock, openSeconds)
        if isinstance(counters, SentinelLink):
            # Decisions D16: limits and budgets checked again within a
            # second of a new master answering, not a breaker's second
            # after the failover's failures.
            counters.onMaster(breaker.retryNow)
        self._members = BudgetMembers(
            counters, clock, unavailable, timeout=timeout, lease=lease, recordGrace=recordGrace
        )
        self._reconciliation = Reconciliation(
            counters,
            clock,
            breaker,
            self._members,
            spend,
            unavailable,
            log,
            timeout=timeout,
            recordGrace=recordGrace,
            interval=reconcileInterval,
            random=random,
        )
        self._settlements = Settlements(
            counters,
            clock,
            self._members,
            self._reconciliation,
            unavailable,
            timeout=timeout,
            openSeconds=openSeconds,
            settleDelay=settleDelay,
        )
        self._calls = SharedCalls(
            counters,
            clock,
            breaker,
            self._settlements,
            log,
            timing=self._members.timing,
            timeout=timeout,
            openSeconds=openSeconds,
            circuitOpen=circuitOpen,
        )
        self._check = RequestCheck(
            counters,
            clock,
            self._book,
            self._calls,
            self._members,
            self._reconciliation,
            spend,
            unavailable,
            timeout=timeout,
            defaultRPM=defaultRPM,
            orgRPM=orgRPM,
            unchecked=unchecked,
        )

    @property
    def reconciled(self) -> int:
        """
        Budget counters set from the ledger (tests and operators'
        curiosity).
        """
        return self._reconciliation.reconciled

    @property
    def corrections(self) -> int:
        """
        Those among L{reconciled} whose correction was large.
        """
        return self._reconciliation.corrections

    def limitFor(self, orgID: str) -> int:
        """
        Requests per minute allowed to C{orgID} by the environment.
        """
        return self._check.limitFor(orgID)

    def applicable(self, orgID: str, agentID: str | None) -> Applicable:
        return self._book.applicable(orgID, agentID)

    async def hit(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int = 0,
        cost: int = 0,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        return await self._check.check(orgID, agentID, tokens, cost, ledgerID, True)

    async def hitTokens(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int,
        cost: int,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        return await self._check.check(orgID, agentID, tokens, cost, ledgerID, False)

    def settle(self, reservation: Reservation, tokens: int, cost: int = 0) -> None:
        self._settlements.settle(reservation, tokens, cost)

    def recorded(self, ledgerIDs: Sequence[str]) -> None:
        self._settlements.recorded(ledgerIDs)

    def reconcile(self) -> Deferred[None]:
        """
        One round: each budget counter this proxy used within the record
        grace and two intervals (or holds a reservation in flight in) set
        to the ledger's spend plus its members left. Fires when done;
        never fails.
        """
        return self._reconciliation.reconcile()

    def checkReady(self) -> Deferred[None]:
        # Straight to Redis, past the breaker: /ready reports the truth.
        if not self._counters.connected:
            return fail(CheckFailed("not connected to Redis"))

        def answered(reply: object) -> None:
            return None

        return self._counters.ping().addCallback(answered)

    def start(self) -> None:
        self._counters.start()
        self._members.start()
        self._reconciliation.start()

    def stop(self) -> Deferred[None]:
        self._members.stop()
        self._reconciliation.stop()
        # The settlements still waiting go first, so that a stop does not
        # leave reservations counted until their minute ends.
        adjusting = self._settlements.flush()
        if adjusting is None:
            return self._counters.stop()
        flushed: Deferred[None] = Deferred()
        adjusting.addBoth(lambda _: flushed.callback(None))
        return flushed.addCallback(lambda _: self._counters.stop())

    def connected(self) -> bool:
        """
        Is the connection to Redis up? (What a starting proxy waits for
        before it listens.)
        """
        return self._counters.connected


class DisabledRateLimiter:
    """
    The limiter when REDIS_URL is empty: every request goes on without
    X-RateLimit-* headers, and /ready reports redis as failed.
    """

    log = Logger()

    def __init__(self, clock: Clock, warnInterval: float = 60.0) -> None:
        self._notConfigured = ThrottledWarning(self.log, clock, warnInterval)

    async def hit(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int = 0,
        cost: int = 0,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        self._notConfigured.warn("REDIS_URL is not configured; rate limiting is off")
        return None

    async def hitTokens(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int,
        cost: int,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        return await self.hit(orgID, agentID, tokens, cost, ledgerID)

    def applicable(self, orgID: str, agentID: str | None) -> Applicable:
        return NO_LIMITS

    def settle(self, reservation: Reservation, tokens: int, cost: int = 0) -> None:
        pass

    def recorded(self, ledgerIDs: Sequence[str]) -> None:
        pass

    def checkReady(self) -> Deferred[None]:
        return fail(CheckFailed("REDIS_URL is not configured"))

    def start(self) -> None:
        self.log.warn("REDIS_URL is not configured; rate limiting is off")

    def stop(self) -> Deferred[None]:
        return succeed(None)


def makeRateLimiter(
    reactor: IReactorTCP,
    clock: Clock,
    target: RedisTarget | SentinelTarget | None,
    defaultRPM: int,
    orgRPM: Mapping[str, int],
    circuitOpen: Gauge | None = None,
    book: LimitBook | None = None,
    spend: Spend | None = None,
    timeout: float = 0.1,
    unchecked: LabelledCounter | None = None,
    lease: float = 30.0,
    recordGrace: float = 300.0,
    reconcileInterval: float = 30.0,
) -> RedisRateLimiter | DisabledRateLimiter:
    """
    The limiter for a configuration: over Redis when REDIS_URL is set (a
    master found through Sentinel when it names a group, decisions D16).
    """
    if target is None:
        return DisabledRateLimiter(clock)
    link: RedisCounters
    if isinstance(target, SentinelTarget):
        link = SentinelLink(reactor, clock, target)
    else:
        link = linkFor(reactor, target)
    return RedisRateLimiter(
        link,
        clock,
        defaultRPM,
        orgRPM,
        circuitOpen=circuitOpen,
        book=book,
        spend=spend,
        timeout=timeout,
        unchecked=unchecked,
        lease=lease,
        recordGrace=recordGrace,
        reconcileInterval=reconcileInterval,
    )
