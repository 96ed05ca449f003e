"""
Budget counters converge to the ledger (decisions D12, amended), through
the real scripts on a real Redis, with a GetSpend fake that answers what
each test says the ledger holds, and a task.Clock for the proxy's side
(renewals, reconciliation rounds). Leases are Redis's own time, so the
tests keep them at seconds and wait for conditions, bounded.

Each drift is made, healed, and then the budget admits and refuses
exactly again: a request at exactly the room left admitted, one
nano-dollar more refused. Also: fail-open counted by reason
(C{svc_proxy_unchecked_admissions_total}).
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from typing import Any

import pytest
import pytest_twisted
from limitshelpers import (
    AGENT_ID,
    ORG_DAY,
    ORG_ID,
    WINDOW,
    Ledger,
    budgetBook,
    counter,
    fakeClock,
    redisCall,
    waitFor,
)
from proxydoubles import MemoryCounters
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from svcd.common.config import parseRedisURL
from svcd.devkit.redis import RedisServer
from svcd.limits.book import LimitBook
from svcd.limits.check import RateDecision
from svcd.limits.keys import BUDGET, ORG
from svcd.limits.limiter import RedisRateLimiter
from svcd.limits.link import linkFor
from svcd.limits.records import Budget, Reservation
from svcd.proxy.config import ProxyConfig
from svcd.proxy.metrics import ProxyMetrics

LEASE = 2.0
GRACE = 4.0
ROUND = 1.0
BUDGET_USD = 1000


class Proxy:
    """
    One proxy's limiter on the real Redis, with its own clock.
    """

    def __init__(self, redisURL: str, book: LimitBook, ledger: Ledger) -> None:
        from twisted.internet import reactor

        target = parseRedisURL(redisURL)
        assert target is not None
        self.link = linkFor(reactor, target)
        self.clock = fakeClock(WINDOW + 30)
        self.metrics = ProxyMetrics()
        self.limiter = RedisRateLimiter(
            self.link,
            self.clock,
            60,
            book=book,
            spend=ledger,
            settleDelay=0,
            unchecked=self.metrics.uncheckedAdmissions,
            lease=LEASE,
            recordGrace=GRACE,
            reconcileInterval=ROUND,
            random=lambda: 0.5,
        )

    async def start(self) -> Proxy:
        self.limiter.start()
        await waitFor(lambda: self.link.connected)
        return self

    async def admit(self, cost: int, ledgerID: str) -> Reservation:
        decision = await self.limiter.hit(ORG_ID, AGENT_ID, cost=cost, ledgerID=ledgerID)
        assert decision is not None and decision.allowed, decision
        assert decision.reservation is not None
        assert decision.reservation.ledgerID == ledgerID
        return decision.reservation

    async def round(self) -> None:
        """
        Let one reconciliation round (and the renewals due) run, as the
        proxy's timers would, and wait for it to end.
        """
        done = self.limiter.reconciled
        self.clock.advance(ROUND / 3)
        self.clock.advance(ROUND / 3)
        self.clock.advance(ROUND / 3)
        self.clock.advance(ROUND / 3)
        await waitFor(lambda: self.limiter.reconciled > done)

    async def converge(self, server: RedisServer, expected: int, seconds: float = 15.0) -> None:
        """
        Rounds until the counter holds C{expected}, within C{seconds}.
        """
        deadline = time.monotonic() + seconds
        while True:
            await self.round()
            if counter(server, ORG_DAY) == expected:
                return
            assert time.monotonic() < deadline, (counter(server, ORG_DAY), expected)

    async def exact(self, server: RedisServer, spent: int) -> None:
        """
        The budget admits a request at exactly its room, and refuses one
        nano-dollar more.
        """
        room = BUDGET_USD - spent
        over = await self.limiter.hit(ORG_ID, AGENT_ID, cost=room + 1, ledgerID="probe-over")
        assert over is not None and over.refusedBy == (BUDGET, ORG)
        exactly = await self.limiter.hit(ORG_ID, AGENT_ID, cost=room, ledgerID="probe-room")
        assert exactly is not None and exactly.allowed
        assert counter(server, ORG_DAY) == BUDGET_USD

    async def stop(self) -> None:
        await self.limiter.stop()

    def unchecked(self, reason: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "svc_proxy_unchecked_admissions_total", {"reason": reason}
        )
        assert value is not None
        return value


def members(server: RedisServer) -> dict[str, int]:
    reply = redisCall(server, "HGETALL", ORG_DAY + ":members")
    return {reply[i].decode(): int(reply[i + 1]) for i in range(0, len(reply), 2)}


def leasePassed(server: RedisServer, ledgerID: str) -> bool:
    """
    Has Redis's clock passed the lease of C{ledgerID}'s member?
    """
    seconds, micros = redisCall(server, "TIME")
    score = redisCall(server, "ZSCORE", ORG_DAY + ":leases", ledgerID)
    return score is not None and int(seconds) * 1000 + int(micros) // 1000 > float(score)


async def proxyOn(redisURL: str, ledger: Ledger) -> Proxy:
    return await Proxy(redisURL, budgetBook(org=Budget(BUDGET_USD, "day")), ledger).start()


@pytest_twisted.ensureDeferred
async def test_admissionsWhileRedisWasAwayAreAdded(redisURL: str, redisServer: RedisServer) -> None:
    """
    (a) Requests admitted while Redis was disconnected are counted as
    unchecked; their rows reach the ledger, and the next reconciliation
    adds them to the counter.
    """
    ledger = Ledger(spent=0)
    proxy = await proxyOn(redisURL, ledger)
    try:
        first = await proxy.admit(300, "a-1")
        proxy.limiter.settle(first, 0, 200)
        proxy.limiter.recorded(["a-1"])
        ledger.spent = 200
        await waitFor(lambda: redisCall(redisServer, "ZSCORE", ORG_DAY + ":recorded", "a-1"))
        await proxy.link.stop()
        for _ in range(2):
            assert await proxy.limiter.hit(ORG_ID, AGENT_ID, cost=300, ledgerID="x") is None
        assert proxy.unchecked("redis_unavailable") == 2
        # Their rows (150 each) are committed meanwhile.
        ledger.spent += 300
        proxy.link.start()
        await waitFor(lambda: proxy.link.connected)
        assert counter(redisServer, ORG_DAY) == 200
        await proxy.converge(redisServer, 500)
        assert members(redisServer) == {}
        await proxy.exact(redisServer, 500)
    finally:
        await proxy.stop()


@pytest_twisted.ensureDeferred
async def test_aLostSettlementIsReleased(redisURL: str, redisServer: RedisServer) -> None:
    """
    (b) A proxy killed mid-request (its limiter thrown away: no settlement,
    no renewal) leaves its worst case counted only until its lease passes
    and a reconciliation runs; its row, committed from the journal, is
    then what counts. Another proxy's request in flight all along stays
    counted, its lease renewed.
    """
    ledger = Ledger(spent=0)
    killed = await proxyOn(redisURL, ledger)
    await killed.admit(600, "b-killed")
    await killed.link.stop()
    ledger.spent = 120
    survivor = await proxyOn(redisURL, ledger)
    try:
        await survivor.admit(100, "b-alive")
        assert counter(redisServer, ORG_DAY) == 700
        await survivor.converge(redisServer, 220)
        assert members(redisServer) == {"b-alive": 100}
        await survivor.exact(redisServer, 220)
    finally:
        await survivor.stop()


@pytest_twisted.ensureDeferred
async def test_aStaleRestoreIsCorrected(redisURL: str, redisServer: RedisServer) -> None:
    """
    (c) An old snapshot restored over the budget's keys (the counter and
    its members as they were) is corrected to the ledger plus what is in
    flight: the member lost with the restore is made again by its
    proxy's renewal.
    """
    ledger = Ledger(spent=0)
    proxy = await proxyOn(redisURL, ledger)
    try:
        first = await proxy.admit(300, "c-1")
        proxy.limiter.settle(first, 0, 200)
        proxy.limiter.recorded(["c-1"])
        ledger.spent = 200
        await waitFor(lambda: redisCall(redisServer, "ZSCORE", ORG_DAY + ":recorded", "c-1"))
        await proxy.converge(redisServer, 200)
        keys = [ORG_DAY + suffix for suffix in ("", ":members", ":leases", ":recorded")]
        snapshot = {key: redisCall(redisServer, "DUMP", key) for key in keys}
        second = await proxy.admit(300, "c-2")
        proxy.limiter.settle(second, 0, 250)
        proxy.limiter.recorded(["c-2"])
        ledger.spent = 450
        await proxy.admit(100, "c-3")
        await waitFor(lambda: counter(redisServer, ORG_DAY) == 550)
        for key, dumped in snapshot.items():
            redisCall(redisServer, "DEL", key)
            if dumped is not None:
                redisCall(redisServer, "RESTORE", key, "0", dumped, "REPLACE")
        assert counter(redisServer, ORG_DAY) == 200
        await proxy.converge(redisServer, 550)
        assert members(redisServer) == {"c-3": 100}
        await proxy.exact(redisServer, 550)
    finally:
        await proxy.stop()


@pytest_twisted.ensureDeferred
async def test_aLongRequestIsNotSweptWhileRenewed(redisURL: str, redisServer: RedisServer) -> None:
    """
    (d) A request in flight for several leases stays counted at its worst
    case through every reconciliation, its proxy renewing the lease; its
    settlement and row then count instead.
    """
    ledger = Ledger(spent=0)
    proxy = await proxyOn(redisURL, ledger)
    try:
        reservation = await proxy.admit(300, "d-long")
        held = time.monotonic()
        while time.monotonic() - held < 3 * LEASE:
            await proxy.round()
            assert counter(redisServer, ORG_DAY) == 300
            assert members(redisServer) == {"d-long": 300}
        proxy.limiter.settle(reservation, 0, 250)
        proxy.limiter.recorded(["d-long"])
        ledger.spent = 250
        await waitFor(lambda: redisCall(redisServer, "ZSCORE", ORG_DAY + ":recorded", "d-long"))
        await proxy.converge(redisServer, 250)
        await proxy.exact(redisServer, 250)
    finally:
        await proxy.stop()


@pytest_twisted.ensureDeferred
async def test_aRecordedRowIsNotCountedTwice(redisURL: str, redisServer: RedisServer) -> None:
    """
    (e) A settled reservation whose row the ledger committed counts once:
    its member goes at the reconciliation after the outbox says so. Until
    then (the proxy not told yet) it counts twice, the safe side, and a
    settled member never marked goes after the record grace.
    """
    ledger = Ledger(spent=0)
    proxy = await proxyOn(redisURL, ledger)
    try:
        first = await proxy.admit(300, "e-1")
        proxy.limiter.settle(first, 0, 200)
        await waitFor(lambda: members(redisServer) == {"e-1": 200})
        ledger.spent = 200
        await proxy.round()
        assert counter(redisServer, ORG_DAY) == 400
        proxy.limiter.recorded(["e-1"])
        await waitFor(lambda: redisCall(redisServer, "ZSCORE", ORG_DAY + ":recorded", "e-1"))
        await proxy.round()
        assert counter(redisServer, ORG_DAY) == 200
        assert members(redisServer) == {}
        # Never marked (the proxy killed before the acknowledgement):
        # counted twice until the record grace passes.
        second = await proxy.admit(100, "e-2")
        proxy.limiter.settle(second, 0, 100)
        ledger.spent = 300
        await waitFor(lambda: members(redisServer) == {"e-2": 100})
        await proxy.round()
        assert counter(redisServer, ORG_DAY) == 400
        await waitFor(lambda: leasePassed(redisServer, "e-2"), seconds=GRACE + 10)
        await proxy.round()
        assert counter(redisServer, ORG_DAY) == 300
        assert members(redisServer) == {}
        await proxy.exact(redisServer, 300)
    finally:
        await proxy.stop()


@pytest_twisted.ensureDeferred
async def test_aSettlementOutlivesALostCounter(redisURL: str, redisServer: RedisServer) -> None:
    """
    Redis loses everything mid-request: the counter is seeded from the
    ledger again, and the request's settlement makes its member again, so
    its spend is counted before the ledger has its row; once recorded, it
    counts once.
    """
    ledger = Ledger(spent=0)
    proxy = await proxyOn(redisURL, ledger)
    try:
        first = await proxy.admit(300, "f-1")
        redisServer.flushAll()
        await proxy.admit(100, "f-2")
        assert counter(redisServer, ORG_DAY) == 100
        proxy.limiter.settle(first, 0, 250)
        await waitFor(lambda: counter(redisServer, ORG_DAY) == 350)
        assert members(redisServer) == {"f-1": 250, "f-2": 100}
        assert int(redisCall(redisServer, "PTTL", ORG_DAY + ":members")) > 0
        proxy.limiter.recorded(["f-1"])
        ledger.spent = 250
        await waitFor(lambda: redisCall(redisServer, "ZSCORE", ORG_DAY + ":recorded", "f-1"))
        await proxy.round()
        assert counter(redisServer, ORG_DAY) == 350
        assert members(redisServer) == {"f-2": 100}
        await proxy.exact(redisServer, 350)
    finally:
        await proxy.stop()


@pytest_twisted.ensureDeferred
async def test_aLedgerThatCannotAnswerChangesNothing(
    redisURL: str, redisServer: RedisServer
) -> None:
    """
    A reconciliation whose GetSpend fails leaves the counter as it is.
    """
    ledger = Ledger(spent=0)
    proxy = await proxyOn(redisURL, ledger)
    try:
        await proxy.admit(300, "g-1")
        ledger.failing = True
        asked = len(ledger.asked)
        proxy.clock.advance(ROUND * 2)
        await waitFor(lambda: len(ledger.asked) > asked)
        assert counter(redisServer, ORG_DAY) == 300
        assert proxy.limiter.reconciled == 0
    finally:
        await proxy.stop()


# Fail-open counted (decisions D12, amended)


def decided(hit: Coroutine[Any, Any, RateDecision | None]) -> RateDecision | None:
    """
    The decision of a hit that needs no I/O (in-memory counters).
    """
    outcome: list[RateDecision | None] = []
    Deferred.fromCoroutine(hit).addCallback(outcome.append)
    assert len(outcome) == 1
    return outcome[0]


def uncheckedOf(metrics: ProxyMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "svc_proxy_unchecked_admissions_total", {"reason": reason}
    )
    assert value is not None
    return value


def memoryLimiter(
    counters: MemoryCounters, ledger: Ledger | None = None
) -> tuple[RedisRateLimiter, ProxyMetrics, Clock]:
    metrics = ProxyMetrics()
    clock = fakeClock(WINDOW + 30)
    limiter = RedisRateLimiter(
        counters,
        clock,
        60,
        book=budgetBook(org=Budget(BUDGET_USD, "day")),
        spend=ledger,
        unchecked=metrics.uncheckedAdmissions,
        settleDelay=0,
    )
    return limiter, metrics, clock


def test_everyReasonIsExportedFromTheStart() -> None:
    """
    Each reason's series exists at 0 before anything happens, so that an
    alert on its rate sees the first one.
    """
    metrics = ProxyMetrics()
    for reason in ("redis_unavailable", "breaker_open", "redis_failed", "spend_unknown"):
        assert uncheckedOf(metrics, reason) == 0


def test_uncheckedWhileRedisIsUnavailable() -> None:
    """
    Not connected: every request goes on unchecked, counted as
    redis_unavailable, with and without limits rows.
    """
    counters = MemoryCounters(connected=False)
    limiter, metrics, _ = memoryLimiter(counters)
    assert decided(limiter.hit(ORG_ID, AGENT_ID, cost=5)) is None
    assert decided(limiter.hit("other-org", None)) is None
    assert uncheckedOf(metrics, "redis_unavailable") == 2


def test_uncheckedWhenRedisFailsThenWhileTheBreakerIsOpen() -> None:
    """
    A call that fails lets its requests through as redis_failed; while the
    breaker then skips Redis, requests go through as breaker_open; once
    Redis answers again, nothing more is counted.
    """
    counters = MemoryCounters()
    counters.counts[ORG_DAY] = 0
    limiter, metrics, clock = memoryLimiter(counters)
    counters.failure = ConnectionError("Redis went away")
    assert decided(limiter.hit(ORG_ID, AGENT_ID, cost=5)) is None
    assert uncheckedOf(metrics, "redis_failed") == 1
    for _ in range(3):
        assert decided(limiter.hit(ORG_ID, AGENT_ID, cost=5)) is None
    assert uncheckedOf(metrics, "breaker_open") == 3
    counters.failure = None
    clock.advance(1.5)
    decision = decided(limiter.hit(ORG_ID, AGENT_ID, cost=5))
    assert decision is not None and decision.allowed
    assert (uncheckedOf(metrics, "redis_failed"), uncheckedOf(metrics, "breaker_open")) == (1, 3)


def test_uncheckedWhenTheSpendIsUnknown() -> None:
    """
    A budget the ledger cannot seed is left out: the request, admitted by
    its other limits, counts as spend_unknown; one refused by them counts
    nothing.
    """
    counters = MemoryCounters()
    limiter, metrics, _ = memoryLimiter(counters, Ledger(failing=True))
    decision = decided(limiter.hit(ORG_ID, AGENT_ID, cost=5))
    assert decision is not None and decision.allowed and decision.reservation is None
    assert uncheckedOf(metrics, "spend_unknown") == 1
    assert uncheckedOf(metrics, "redis_unavailable") == 0


def test_budgetTimingFromTheEnvironment() -> None:
    """
    SVC_BUDGET_LEASE, SVC_BUDGET_RECORD_GRACE and
    SVC_BUDGET_RECONCILE_INTERVAL: 30 s, 300 s and 30 s unless set; a lease
    of 0 or a record grace shorter than the lease stops the daemon.
    """

    from svcd.common.config import ConfigError

    base = {"SVC_AUTH_GRPC_ADDR": "auth:9091"}
    default = ProxyConfig.fromEnvironment(base)
    assert (
        default.budgetLease,
        default.budgetRecordGrace,
        default.budgetReconcileInterval,
    ) == (30.0, 300.0, 30.0)
    tuned = ProxyConfig.fromEnvironment(
        base
        | {
            "SVC_BUDGET_LEASE": "10s",
            "SVC_BUDGET_RECORD_GRACE": "2m",
            "SVC_BUDGET_RECONCILE_INTERVAL": "45s",
        }
    )
    assert (tuned.budgetLease, tuned.budgetRecordGrace, tuned.budgetReconcileInterval) == (
        10.0,
        120.0,
        45.0,
    )
    with pytest.raises(ConfigError, match="SVC_BUDGET_LEASE"):
        ProxyConfig.fromEnvironment(base | {"SVC_BUDGET_LEASE": "0"})
    with pytest.raises(ConfigError, match="SVC_BUDGET_RECORD_GRACE"):
        ProxyConfig.fromEnvironment(
            base | {"SVC_BUDGET_LEASE": "60s", "SVC_BUDGET_RECORD_GRACE": "30s"}
        )


def test_aFailedMemberSettlementIsSentAgain() -> None:
    """
    A settlement of a member whose call failed (or missed its deadline)
    is sent again a second later, harmlessly even if it did run: it sets
    the member to its cost. (A per-key delta could not be.)
    """
    counters = MemoryCounters()
    counters.counts[ORG_DAY] = 0
    limiter, _, clock = memoryLimiter(counters)
    decision = decided(limiter.hit(ORG_ID, AGENT_ID, cost=300, ledgerID="r-1"))
    assert decision is not None and decision.reservation is not None
    assert counters.members[ORG_DAY] == {"r-1": 300}
    counters.failure = ConnectionError("Redis went away")
    limiter.settle(decision.reservation, 0, 120)
    assert counters.counts[ORG_DAY] == 300
    counters.failure = None
    clock.advance(0.5)
    assert counters.counts[ORG_DAY] == 300
    clock.advance(0.6)
    assert counters.counts[ORG_DAY] == 120
    assert counters.members[ORG_DAY] == {"r-1": 120}


class CountedRenewals(MemoryCounters):
    def __init__(self) -> None:
        super().__init__()
        self.renewals: list[int] = []

    def renew(self, keys: list[str], leaseMs: int, triples: str) -> Deferred[object]:
        self.renewals.append(len(triples.split(",")) // 3)
        return super().renew(keys, leaseMs, triples)


def test_renewalsEveryThirdOfALeaseInBoundedCalls(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    Every third of a lease the proxy renews its reservations in flight (not
    the settled ones), in calls of a bounded number of members; a lost
    member is made again; nothing is renewed once all are settled.
    """
    from svcd.limits import members as module

    monkeypatch.setattr(module, "_RENEWALS_PER_CALL", 2)
    counters = CountedRenewals()
    counters.counts[ORG_DAY] = 0
    clock = fakeClock(WINDOW + 30)
    limiter = RedisRateLimiter(
        counters,
        clock,
        60,
        book=budgetBook(org=Budget(BUDGET_USD, "day")),
        settleDelay=0,
        lease=30.0,
    )
    limiter.start()
    decisions = [
        decided(limiter.hit(ORG_ID, AGENT_ID, cost=10, ledgerID=f"n-{n}")) for n in range(6)
    ]
    reservations = [d.reservation for d in decisions if d is not None and d.reservation]
    limiter.settle(reservations[0], 0, 10)
    del counters.members[ORG_DAY]["n-5"]
    clock.advance(9.9)
    assert counters.renewals == []
    clock.advance(0.2)
    assert counters.renewals == [2, 2, 1]
    assert counters.members[ORG_DAY]["n-5"] == 10
    assert counters.counts[ORG_DAY] == 70
    for reservation in reservations[1:]:
        limiter.settle(reservation, 0, 10)
    clock.advance(10)
    assert counters.renewals == [2, 2, 1]
    limiter.stop()
