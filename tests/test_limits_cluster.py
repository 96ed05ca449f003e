"""
The limiter over a Redis Cluster (decisions D16): the hash slot of every
key (an organization's keys and their companions in one slot, the
organization in braces), the calls that could mix organizations split
into one per slot (settlements, renewals) against counters that refuse a
call across slots as a Cluster does, the redis+cluster:// URL, and
L{ClusterLink} against a real Cluster of three masters: ASK and MOVED
followed, a master down failing only its own slots' calls.

The limiter's and budgets' tests of a real Redis run against a Cluster
too, unchanged: tests/conftest.py's C{redisTopology} runs them twice.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

import pytest
import pytest_twisted
from limitshelpers import (
    AGENT_ID,
    DAY_START,
    ORG_DAY,
    ORG_ID,
    WINDOW,
    Ledger,
    counter,
    fakeClock,
    waitFor,
)
from proxydoubles import ClusterCounters
from twisted.internet.defer import Deferred

from svcd.common.config import ConfigError, RedisTarget, parseRedisURL
from svcd.devkit.redis import RedisServer
from svcd.devkit.rediscluster import RedisCluster, call
from svcd.limits.book import BudgetRow, LimitBook, LimitsRow
from svcd.limits.check import RateDecision
from svcd.limits.clusterlink import ClusterLink, crc16, keySlot
from svcd.limits.keys import budgetCounter, minuteKey
from svcd.limits.limiter import RedisRateLimiter, makeRateLimiter
from svcd.limits.link import keySlots, linkFor
from svcd.limits.records import Budget, Limits

# An organization whose keys are in another slot than ORG_ID's.
OTHER_ORG = "9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d"


def test_keySlotsAreRedisClusters() -> None:
    """
    CRC-16/XMODEM modulo 16384 of the hash tag, as Redis Cluster's
    specification gives them: the check value of "123456789", a tag
    between the first braces, empty braces not a tag.
    """
    assert crc16(b"123456789") == 0x31C3
    assert keySlot("123456789") == 12739
    assert keySlot("{user1000}.following") == keySlot("{user1000}.followers")
    assert keySlot("foo{}{bar}") == crc16(b"foo{}{bar}") % 16384
    assert keySlot("foo{{bar}}zap") == crc16(b"{bar") % 16384
    assert keySlot("foo{bar}{zap}") == keySlot("bar")


def test_anOrganizationsKeysShareItsSlot() -> None:
    """
    Every key a request of one organization counts in, and every
    companion the scripts derive from a budget's counter, is in the
    organization's slot; another organization's are (here) in another.
    """
    key = minuteKey(ORG_ID, WINDOW)
    assert key == f"ratelimit:{{{ORG_ID}}}:{WINDOW}"
    budget = budgetCounter(ORG_ID, AGENT_ID, Budget(100, "month"), 1, "agent", WINDOW).key
    assert budget.startswith(f"budget:{{{ORG_ID}}}:month:")
    keys = [
        key,
        key + ":tokens",
        f"{key}:agent:{AGENT_ID}",
        f"{key}:agent:{AGENT_ID}:tokens",
        budget,
        *(budget + suffix for suffix in (":members", ":leases", ":recorded")),
    ]
    assert {keySlot(each) for each in keys} == {keySlot(ORG_ID)}
    assert keySlot(minuteKey(OTHER_ORG, WINDOW)) != keySlot(key)


def test_clusterURL() -> None:
    """
    redis+cluster://[user:password@]host:port[,host:port...] names a
    Cluster's nodes; database 0 only.
    """
    target = parseRedisURL("redis+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2,[::1]:7002")
    assert target == RedisTarget(
        "10.0.0.1",
        7000,
        0,
        "p@ss",
        "u",
        clusterNodes=(("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002)),
    )
    assert parseRedisURL("redis+cluster://h:7000/0") is not None
    for bad in (
        "redis+cluster://h:7000/1",
        "redis+cluster://",
        "redis+cluster://h:7000,,h:7001",
        "redis+cluster://h:port",
        "redis+cluster://h:7000?db=1",
    ):
        with pytest.raises(ConfigError):
            parseRedisURL(bad)
    assert parseRedisURL("redis://h:1/0") == RedisTarget("h", 1, 0)
    from twisted.internet import reactor

    single = parseRedisURL("redis://h:1/0")
    assert single is not None and keySlots(linkFor(reactor, single)) is None
    cluster = parseRedisURL("redis+cluster://h:1")
    assert cluster is not None and isinstance(linkFor(reactor, cluster), ClusterLink)


def _done(coroutine: Coroutine[Any, Any, RateDecision | None]) -> RateDecision:
    result = Deferred.fromCoroutine(coroutine)
    assert result.called
    decision = cast("RateDecision | None", result.result)
    assert decision is not None
    return decision


def _book(budgets: bool = True) -> LimitBook:
    book = LimitBook()
    orgs = (ORG_ID, OTHER_ORG)
    rows: list[LimitsRow | BudgetRow] = [
        LimitsRow(org, None, Limits(tpm=1000, rpm=100)) for org in orgs
    ]
    if budgets:
        rows += [BudgetRow(org, None, Budget(10_000, "day")) for org in orgs]
    book.replace(rows)
    return book


class HeldCounters(ClusterCounters):
    """
    Admission calls (not settlements sent alone) answered only when the
    test says.
    """

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.held: list[Deferred[None]] = []

    def admit(
        self,
        keys: list[str],
        arguments: list[int],
        adjustments: list[int] | None = None,
        ledger: Any = None,
    ) -> Deferred[list[list[int]]]:
        answer = super().admit(keys, arguments, adjustments, ledger)
        if not self.holding or arguments == [0]:
            return answer
        held: Deferred[None] = Deferred()
        self.held.append(held)
        return held.addCallback(lambda _: answer)


def test_settlementsRideOnlyOnAnAdmissionOfTheirSlot() -> None:
    """
    Against a Cluster a settlement waits for an admission call of its own
    slot only: one of another organization's slot in flight does not
    hold it, and it goes alone, in a call of its slot; one of its own
    slot does, and it rides on the next. No call crosses slots, and the
    counts are what they would be on one server.
    """
    counters = HeldCounters()
    clock = fakeClock(WINDOW + 30)
    limiter = RedisRateLimiter(counters, clock, 60, book=_book(budgets=False), settleDelay=0.01)
    ours = _done(limiter.hit(ORG_ID, None, tokens=300))
    theirs = _done(limiter.hit(OTHER_ORG, None, tokens=200))
    assert ours.reservation is not None and theirs.reservation is not None
    counters.holding = True
    inFlight = Deferred.fromCoroutine(limiter.hit(ORG_ID, None, tokens=100))
    limiter.settle(theirs.reservation, 50)
    limiter.settle(ours.reservation, 120)
    counters.slotCalls.clear()
    clock.advance(0.02)
    # Theirs alone, in its slot's call; ours waits for our next admission.
    assert counters.slotCalls == [("adjust", keySlot(OTHER_ORG))]
    otherTokens = minuteKey(OTHER_ORG, WINDOW) + ":tokens"
    ourTokens = minuteKey(ORG_ID, WINDOW) + ":tokens"
    assert counters.counts[otherTokens] == 50
    assert counters.counts[ourTokens] == 400
    following = Deferred.fromCoroutine(limiter.hit(ORG_ID, None, tokens=100))
    counters.held.pop(0).callback(None)
    assert inFlight.called
    # The next admission of our slot was sent at once, carrying ours.
    assert counters.slotCalls[-1] == ("admit", keySlot(ORG_ID))
    assert counters.counts[ourTokens] == 120 + 100 + 100
    counters.held.pop(0).callback(None)
    assert following.called
    clock.advance(1)
    assert [kind for kind, _ in counters.slotCalls].count("adjust") == 1
    limiter.stop()


def test_settlementsAloneGoOnePerSlot() -> None:
    """
    Settlements of several organizations waiting with no admission in
    flight go in one call per slot; budget members' settlements and marks
    likewise (admission calls of no request).
    """
    counters = ClusterCounters()
    clock = fakeClock(WINDOW + 30)
    limiter = RedisRateLimiter(counters, clock, 60, book=_book(), settleDelay=0.01)
    for org in (ORG_ID, OTHER_ORG):
        key = budgetCounter(org, None, Budget(10_000, "day"), 0, "org", WINDOW + 30).key
        counters.counts[key] = 0
    decisions = [
        _done(limiter.hit(org, None, tokens=300, cost=40, ledgerID=f"{org}-1"))
        for org in (ORG_ID, OTHER_ORG)
    ]
    counters.slotCalls.clear()
    for decision in decisions:
        assert decision.reservation is not None
        limiter.settle(decision.reservation, 100, 30)
    clock.advance(0.02)
    assert sorted(counters.slotCalls) == sorted(
        [("settle", keySlot(ORG_ID)), ("settle", keySlot(OTHER_ORG))]
    )
    for org in (ORG_ID, OTHER_ORG):
        assert counters.counts[minuteKey(org, WINDOW) + ":tokens"] == 100
        key = budgetCounter(org, None, Budget(10_000, "day"), 0, "org", WINDOW + 30).key
        assert counters.counts[key] == 30
    counters.slotCalls.clear()
    limiter.recorded([f"{ORG_ID}-1", f"{OTHER_ORG}-1"])
    clock.advance(0.02)
    assert sorted(counters.slotCalls) == sorted(
        [("settle", keySlot(ORG_ID)), ("settle", keySlot(OTHER_ORG))]
    )
    assert all(counters.recordedAt[key] for key in counters.members)
    limiter.stop()


def test_renewalsGoOnePerSlot() -> None:
    """
    The leases of reservations in flight of several organizations are
    renewed in one call per slot.
    """
    counters = ClusterCounters()
    clock = fakeClock(WINDOW + 30)
    limiter = RedisRateLimiter(counters, clock, 60, book=_book(), settleDelay=0, lease=30.0)
    limiter.start()
    for org in (ORG_ID, OTHER_ORG):
        key = budgetCounter(org, None, Budget(10_000, "day"), 0, "org", WINDOW + 30).key
        counters.counts[key] = 0
        for n in range(3):
            _done(limiter.hit(org, None, cost=10, ledgerID=f"{org}-{n}"))
    counters.slotCalls.clear()
    clock.advance(10.1)
    assert sorted(counters.slotCalls) == sorted(
        [("renew", keySlot(ORG_ID)), ("renew", keySlot(OTHER_ORG))]
    )
    limiter.stop()


@pytest_twisted.ensureDeferred
async def test_theKeysOfEarlierReleasesAreLeftAlone(
    redisURL: str, redisServer: RedisServer
) -> None:
    """
    An upgrade under traffic: the keys of the releases before D16
    (C{ratelimit:<org>:...}, C{budget:<org>:...}, the organization without
    braces), here at a full minute and a spent budget, are neither read
    nor changed; the budget's counter of the new form is seeded from the
    ledger, so the period's spend is not forgotten.
    """
    from twisted.internet import reactor

    oldMinute = f"ratelimit:{ORG_ID}:{WINDOW}"
    oldDay = f"budget:{ORG_ID}:day:{DAY_START}"
    redisServer.command("SET", oldMinute, "1000")
    redisServer.command("SET", oldDay, "999999")
    book = LimitBook()
    book.replace(
        [LimitsRow(ORG_ID, None, Limits(rpm=5)), BudgetRow(ORG_ID, None, Budget(1000, "day"))]
    )
    target = parseRedisURL(redisURL)
    assert target is not None
    link = linkFor(reactor, target)
    ledger = Ledger(spent=600)
    limiter = RedisRateLimiter(
        link, fakeClock(WINDOW + 30), 60, book=book, spend=ledger, settleDelay=0
    )
    limiter.start()
    try:
        await waitFor(lambda: link.connected)
        decision = await limiter.hit(ORG_ID, None, cost=300)
        assert decision is not None and decision.allowed and decision.remaining == 4
        assert counter(redisServer, ORG_DAY) == 900
        refused = await limiter.hit(ORG_ID, None, cost=101)
        assert refused is not None and not refused.allowed
        assert counter(redisServer, oldMinute) == 1000
        assert counter(redisServer, oldDay) == 999999
    finally:
        await limiter.stop()


# A real Cluster


@pytest_twisted.ensureDeferred
async def test_aDaemonsLimiterOverACluster(sharedRedisCluster: RedisCluster) -> None:
    """
    The limiter a daemon makes of REDIS_URL=redis+cluster://... (as
    svc-proxy's and svc-worker's assemblies do) counts on the Cluster:
    each organization's minute on the master of its slot.
    """
    from twisted.internet import reactor

    cluster = sharedRedisCluster
    cluster.flushAll()
    # The limiter's own clock in one minute; the link's is the reactor.
    clock = fakeClock(WINDOW + 30)
    limiter = makeRateLimiter(reactor, clock, parseRedisURL(cluster.url), 2, {})
    assert isinstance(limiter, RedisRateLimiter)
    limiter.start()
    try:
        await waitFor(limiter.connected)
        taken: set[str] = set()
        for index in range(3):
            org = _orgOn(cluster, index, taken)
            decisions = [await limiter.hit(org, None) for _ in range(3)]
            assert [d is not None and d.allowed for d in decisions] == [True, True, False]
            port = cluster.nodes[index].port
            assert call(cluster.host, port, "GET", minuteKey(org, WINDOW)) == b"3"
        await limiter.checkReady()
    finally:
        await limiter.stop()


def _orgOn(cluster: RedisCluster, index: int, taken: set[str]) -> str:
    """
    An organization whose slot the master C{index} serves.
    """
    first, last = cluster.ranges()[index]
    for n in range(10_000):
        org = str(uuid.uuid5(uuid.NAMESPACE_OID, f"org-{n}"))
        if org not in taken and first <= keySlot(org) <= last:
            taken.add(org)
            return org
    raise AssertionError("no organization found")


@pytest.fixture
def privateCluster(tmp_path: Path) -> Any:
    cluster = RedisCluster.create(tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest_twisted.ensureDeferred
async def test_aClusterLinkFollowsAskAndMovedAndOutlivesAMaster(
    privateCluster: RedisCluster,
) -> None:
    """
    Against three real masters: each call goes to its key's master; while
    a slot migrates, a key already moved is found after ASK (ASKING, the
    call once more on the importing master); once it has moved, MOVED
    sends the call where the slot is and corrects the map. A master
    stopped makes the link not connected (the limiter's fail-open path)
    and fails the calls of its slots at once, the others' are answered,
    the readiness check names it; back, all is answered again.
    """
    from twisted.internet import reactor

    cluster = privateCluster
    target = parseRedisURL(cluster.url)
    assert target is not None
    link = ClusterLink(reactor, target)
    # The map read at the start only (and after MOVED): the steps below
    # see the redirections themselves.
    link.refreshInterval = 3600.0
    link.start()
    try:
        await waitFor(lambda: link.connected)
        taken: set[str] = set()
        orgs = [_orgOn(cluster, index, taken) for index in range(3)]
        keys = [minuteKey(org, WINDOW) for org in orgs]
        for key in keys:
            assert await link.increment(key, 2, 120) == 2
        for key, node in zip(keys, cluster.nodes, strict=True):
            assert call(cluster.host, node.port, "GET", key) == b"2"
        await link.ping()

        # ASK: the slot of a key not made yet migrates from master 0 to 1.
        moving = minuteKey(_orgOn(cluster, 0, taken), WINDOW)
        slot = str(keySlot(moving))
        source, destination = cluster.nodes[0], cluster.nodes[1]
        sourceID = call(cluster.host, source.port, "CLUSTER", "MYID").decode()
        destinationID = call(cluster.host, destination.port, "CLUSTER", "MYID").decode()
        call(cluster.host, destination.port, "CLUSTER", "SETSLOT", slot, "IMPORTING", sourceID)
        call(cluster.host, source.port, "CLUSTER", "SETSLOT", slot, "MIGRATING", destinationID)
        assert await link.increment(moving, 1, 120) == 1
        assert call(cluster.host, destination.port, "CLUSTER", "COUNTKEYSINSLOT", slot) == 1
        assert link.addressOf(moving) == (cluster.host, source.port)
        assert link.redirected == {"MOVED": 0, "ASK": 1}

        # MOVED: the migration ends; the link's map still names master 0.
        for node in (destination, source):
            call(cluster.host, node.port, "CLUSTER", "SETSLOT", slot, "NODE", destinationID)
        assert await link.increment(moving, 1, 120) == 2
        assert link.addressOf(moving) == (cluster.host, destination.port)
        assert link.redirected == {"MOVED": 1, "ASK": 1}

        # A master down: the link is not connected (the limiter goes on
        # unchecked), its slots' calls fail at once, the others' are
        # answered.
        down = cluster.nodes[2]
        down.stop()
        await waitFor(lambda: not link.connected)
        assert link.mastersUp() == {
            (cluster.host, node.port): node is not down for node in cluster.nodes
        }
        began = time.monotonic()
        with pytest.raises(Exception, match="no connection"):
            await link.increment(keys[2], 1, 120)
        assert time.monotonic() - began < 0.05
        assert await link.increment(keys[0], 1, 120) == 3
        with pytest.raises(Exception, match=f"{down.port} is down"):
            await link.ping()
        # Back, and once the cluster is ok again (it answers CLUSTERDOWN
        # until its masters have met again).
        cluster.start()
        await waitFor(lambda: link.connected, 15)
        # It kept nothing on disk: the count starts again.
        assert await link.increment(keys[2], 1, 120) == 1
        await link.ping()
    finally:
        await link.stop()
    assert not link.connected
