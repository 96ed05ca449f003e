"""
svc-proxy's organization rate limiter against a real Redis (spec section
8, decisions D5): the counter key and its TTL, the decision and its
headers, window rollover with a fake clock, several proxies sharing one
counter, failing open when Redis is down or frozen, and recovery.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, cast

import pytest
import pytest_twisted
from limitshelpers import WINDOW, counter, fakeClock, waitFor
from proxydoubles import FakeAuthClient
from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, deferLater
from twisted.logger import capturedLogs
from twisted.python.failure import Failure

from svcd.common.config import parseRedisURL
from svcd.devkit.redis import RedisServer
from svcd.limits.check import RateDecision
from svcd.limits.keys import KEY_TTL_SECONDS
from svcd.limits.limiter import DisabledRateLimiter, RedisRateLimiter
from svcd.limits.link import RedisCounters, linkFor
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.metrics import ProxyMetrics


async def connectedLimiter(
    url: str, clock: Any = None, defaultRPM: int = 60, orgRPM: dict[str, int] | None = None
) -> tuple[RedisRateLimiter, RedisCounters]:
    from twisted.internet import reactor

    target = parseRedisURL(url)
    assert target is not None
    link = linkFor(reactor, target)
    limiter = RedisRateLimiter(
        link, reactor if clock is None else clock, defaultRPM, orgRPM or {}, warnInterval=10.0
    )
    limiter.start()
    await waitFor(lambda: link.connected)
    return limiter, link


@pytest_twisted.ensureDeferred
async def test_countsInRedis(redisURL: str, redisServer: RedisServer) -> None:
    """
    Each hit increments ratelimit:{<org_id>}:<window start> in Redis, which
    gets a TTL of at least 60 s; the decision carries limit, remaining and
    reset.
    """
    orgID = str(uuid.uuid4())
    limiter, _ = await connectedLimiter(redisURL, fakeClock(WINDOW + 20))
    try:
        decisions = [await limiter.hit(orgID, str(uuid.uuid4())) for _ in range(3)]
        assert decisions == [
            RateDecision(allowed=True, limit=60, remaining=left, reset=WINDOW + 60, retryAfter=40)
            for left in (59, 58, 57)
        ]
        key = f"ratelimit:{{{orgID}}}:{WINDOW}"
        assert counter(redisServer, key) == 3
        ttl = int(redisServer.command("TTL", key)[1:])
        assert 60 <= ttl <= KEY_TTL_SECONDS
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_overLimit(redisURL: str) -> None:
    """
    Past the limit a hit is refused, with remaining 0 and Retry-After the
    seconds to the next minute.
    """
    orgID = str(uuid.uuid4())
    limiter, _ = await connectedLimiter(redisURL, fakeClock(WINDOW + 50.5), defaultRPM=2)
    try:
        results = [await limiter.hit(orgID, None) for _ in range(3)]
        assert [(r.allowed, r.remaining) for r in results if r] == [
            (True, 1),
            (True, 0),
            (False, 0),
        ]
        last = results[-1]
        assert last is not None and last.retryAfter == 10
        assert last.headers() == [
            (b"X-RateLimit-Limit", b"2"),
            (b"X-RateLimit-Remaining", b"0"),
            (b"X-RateLimit-Reset", str(WINDOW + 60).encode()),
        ]
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_windowRollover(redisURL: str, redisServer: RedisServer) -> None:
    """
    The next calendar minute has a counter of its own.
    """
    orgID = str(uuid.uuid4())
    clock = fakeClock(WINDOW + 59)
    limiter, _ = await connectedLimiter(redisURL, clock, defaultRPM=1)
    try:
        assert (await limiter.hit(orgID, None)) is not None
        refused = await limiter.hit(orgID, None)
        assert refused is not None and not refused.allowed and refused.retryAfter == 1
        clock.advance(1)
        allowed = await limiter.hit(orgID, None)
        assert allowed is not None and allowed.allowed
        assert allowed.reset == WINDOW + 120
        assert counter(redisServer, f"ratelimit:{{{orgID}}}:{WINDOW}") == 2
        assert counter(redisServer, f"ratelimit:{{{orgID}}}:{WINDOW + 60}") == 1
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_overrideAndSharedCounter(redisURL: str) -> None:
    """
    An override sets one org's limit; two proxies on one Redis share the
    organization's counter.
    """
    orgID, otherOrg = str(uuid.uuid4()), str(uuid.uuid4())
    clock = fakeClock(WINDOW)
    first, _ = await connectedLimiter(redisURL, clock, defaultRPM=5, orgRPM={orgID: 3})
    second, _ = await connectedLimiter(redisURL, clock, defaultRPM=5, orgRPM={orgID: 3})
    try:
        allowed = []
        for limiter in (first, second, first, second):
            decision = await limiter.hit(orgID, None)
            assert decision is not None
            allowed.append(decision.allowed)
        assert allowed == [True, True, True, False]
        other = await second.hit(otherOrg, None)
        assert other is not None and (other.limit, other.remaining) == (5, 4)
    finally:
        await first.stop()
        await second.stop()


@pytest_twisted.ensureDeferred
async def test_readiness(redisURL: str) -> None:
    """
    The redis check passes while Redis answers PING.
    """
    limiter, _ = await connectedLimiter(redisURL)
    try:
        await limiter.checkReady()
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_stopCloses(redisURL: str) -> None:
    """
    stop() closes the connection and does not reconnect.
    """
    from twisted.internet import reactor

    limiter, link = await connectedLimiter(redisURL)
    await limiter.stop()
    assert not link.connected
    await deferLater(reactor, 0.2, lambda: None)
    assert not link.connected


@pytest_twisted.ensureDeferred
async def test_failOpenAndRecover(privateRedis: RedisServer) -> None:
    """
    With Redis stopped, hits are allowed at once without a decision (no
    X-RateLimit-* headers) and one warning is logged for many of them; the
    readiness check fails. Once Redis is back the limiter reconnects by
    itself and counts again.
    """
    orgID = str(uuid.uuid4())
    limiter, link = await connectedLimiter(privateRedis.url)
    try:
        assert await limiter.hit(orgID, None) is not None
        privateRedis.stop()
        await waitFor(lambda: not link.connected)
        with capturedLogs() as events:
            began = time.monotonic()
            for _ in range(20):
                assert await limiter.hit(orgID, None) is None
            assert time.monotonic() - began < 0.1
        warnings = [e for e in events if e["log_level"].name == "warn"]
        assert len(warnings) == 1
        with pytest.raises(Exception, match="not connected"):
            await limiter.checkReady()

        privateRedis.start()
        await waitFor(lambda: link.connected, 15)
        decision = await limiter.hit(orgID, None)
        assert decision is not None and decision.allowed
        await limiter.checkReady()
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_frozenRedisDoesNotHang(privateRedis: RedisServer) -> None:
    """
    A Redis that accepts but never answers costs a request at most the
    100 ms budget; the request is allowed.
    """
    orgID = str(uuid.uuid4())
    limiter, _ = await connectedLimiter(privateRedis.url)
    try:
        privateRedis.freeze()
        began = time.monotonic()
        assert await limiter.hit(orgID, None) is None
        elapsed = time.monotonic() - began
        assert 0.09 <= elapsed < 0.3, elapsed
    finally:
        privateRedis.thaw()
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_notConfigured() -> None:
    """
    With REDIS_URL empty every hit is allowed without a decision and the
    readiness check fails saying so.
    """
    limiter = DisabledRateLimiter(Clock())
    assert parseRedisURL("") is None
    assert await limiter.hit(str(uuid.uuid4()), None) is None
    with pytest.raises(Exception, match=r"^REDIS_URL is not configured$"):
        await limiter.checkReady()


@pytest_twisted.ensureDeferred
async def test_throughTheEdge(redisURL: str) -> None:
    """
    The edge over a real Redis: X-RateLimit-* on success, then 429
    RATE_LIMITED with Retry-After, and svc_proxy_rate_limited_total.
    """
    clock = fakeClock(WINDOW + 30)
    limiter, _ = await connectedLimiter(redisURL, clock, defaultRPM=2)
    auth = FakeAuthClient()
    token, _, agentID = auth.addTenant()
    metrics = ProxyMetrics()
    edge = ProxyEdge(
        ProxyConfig(authGrpcAddr="auth.test:9091", defaultRPM=2), auth, limiter, metrics, clock
    )
    stub = StubTreq(edge.resource())
    headers = {"Authorization": "Bearer " + token, "X-SVC-Agent-ID": agentID}
    try:
        answers, contents = [], []
        for _ in range(3):
            response, content = await _get(stub, "/v1/internal/auth-probe", headers)
            answers.append(response)
            contents.append(content)
        assert [r.code for r in answers] == [200, 200, 429]
        assert [r.headers.getRawHeaders("X-RateLimit-Remaining") for r in answers] == [
            ["1"],
            ["0"],
            ["0"],
        ]
        assert answers[2].headers.getRawHeaders("Retry-After") == ["30"]
        assert answers[2].headers.getRawHeaders("X-RateLimit-Reset") == [str(WINDOW + 60)]
        body = json.loads(contents[2])
        assert body["error"]["code"] == "RATE_LIMITED"
        assert metrics.registry.get_sample_value("svc_proxy_rate_limited_total") == 1
    finally:
        await limiter.stop()


async def _pumped(stub: StubTreq, pending: Deferred[Any]) -> Any:
    """
    Wait for C{pending}, pumping the in-memory HTTP connection: the
    limiter's answer comes from a real socket, after StubTreq's own pass.
    """
    from twisted.internet import reactor

    outcome: list[Any] = []
    pending.addBoth(outcome.append)
    while not outcome:
        await deferLater(reactor, 0.005, stub.flush)
    if isinstance(outcome[0], Failure):
        outcome[0].raiseException()
    return outcome[0]


async def _get(stub: StubTreq, path: str, headers: dict[str, str]) -> tuple[Any, bytes]:
    # StubTreq sets get() and the others in its __init__ (setattr over
    # treq.__all__); treq's types do not declare them.
    request = stub.get("http://proxy.test" + path, headers=headers)  # type: ignore[attr-defined]
    response = await _pumped(stub, request)
    content = await _pumped(stub, response.content())
    return response, content


# Shared calls: hits of one key that come while its call is in flight.


class CountingLink:
    """
    A real L{RedisLink} that also notes each call's number of hits.
    """

    def __init__(self, link: RedisCounters) -> None:
        self.link = link
        self.calls: list[int] = []

    @property
    def connected(self) -> bool:
        return self.link.connected

    def increment(self, key: str, hits: int, ttl: int) -> Deferred[int]:
        self.calls.append(hits)
        return self.link.increment(key, hits, ttl)

    def ping(self) -> Deferred[object]:
        return self.link.ping()

    def start(self) -> None:
        self.link.start()

    def stop(self) -> Deferred[None]:
        return self.link.stop()


@pytest_twisted.ensureDeferred
async def test_concurrentHitsShareCalls(redisURL: str, redisServer: RedisServer) -> None:
    """
    40 hits of one organization at once against a real Redis: the first is
    sent alone, the 39 that came while it was in flight share the next
    call; each hit still gets a count of its own (remaining 39 down to 0,
    every value once, in the order the hits came) and Redis holds 40.
    """
    from twisted.internet import reactor

    target = parseRedisURL(redisURL)
    assert target is not None
    link = CountingLink(linkFor(reactor, target))
    # CountingLink has only what a limiter without a book calls (increment).
    limiter = RedisRateLimiter(cast(RedisCounters, link), fakeClock(WINDOW + 1), 40)
    limiter.start()
    await waitFor(lambda: link.connected)
    orgID = str(uuid.uuid4())
    try:
        pending = [Deferred.fromCoroutine(limiter.hit(orgID, None)) for _ in range(40)]
        decisions = [await each for each in pending]
        assert [d.remaining for d in decisions if d is not None] == list(range(39, -1, -1))
        assert all(d is not None and d.allowed for d in decisions)
        assert link.calls == [1, 39]
        assert counter(redisServer, f"ratelimit:{{{orgID}}}:{WINDOW}") == 40
        over = await limiter.hit(orgID, None)
        assert over is not None and not over.allowed
        assert link.calls == [1, 39, 1]
    finally:
        await limiter.stop()


class HeldCounters:
    """
    Counters in memory whose calls are answered when the test says.
    """

    def __init__(self) -> None:
        self.connected = True
        self.calls: list[tuple[int, Deferred[int]]] = []
        self.total = 0

    def increment(self, key: str, hits: int, ttl: int) -> Deferred[int]:
        call: Deferred[int] = Deferred()
        self.calls.append((hits, call))
        return call

    def answer(self, index: int) -> None:
        hits, call = self.calls[index]
        self.total += hits
        call.callback(self.total)


def held() -> tuple[RedisRateLimiter, HeldCounters]:
    counters = HeldCounters()
    return RedisRateLimiter(counters, fakeClock(WINDOW), 60), counters  # type: ignore[arg-type]


def hits(limiter: RedisRateLimiter, count: int) -> list[Deferred[RateDecision | None]]:
    return [Deferred.fromCoroutine(limiter.hit("org", None)) for _ in range(count)]


def remaining(pending: Deferred[RateDecision | None]) -> int | str:
    outcome: list[Any] = []
    pending.addBoth(outcome.append)
    assert outcome, "still pending"
    if isinstance(outcome[0], Failure):
        assert outcome[0].type is not None
        return outcome[0].type.__name__
    assert outcome[0] is not None
    return int(outcome[0].remaining)


def test_hitsWaitForTheCallInFlight() -> None:
    """
    Hits that come while a call is in flight wait for it and go in one
    call; hits that come while that one is in flight go in the next. No
    hit waits for more than the call before its own.
    """
    limiter, counters = held()
    first = hits(limiter, 1)
    second = hits(limiter, 3)
    assert [hits for hits, _ in counters.calls] == [1]
    counters.answer(0)
    assert remaining(first[0]) == 59
    assert [hits for hits, _ in counters.calls] == [1, 3]
    third = hits(limiter, 2)
    counters.answer(1)
    assert [remaining(each) for each in second] == [58, 57, 56]
    assert [hits for hits, _ in counters.calls] == [1, 3, 2]
    counters.answer(2)
    assert [remaining(each) for each in third] == [55, 54]
    assert limiter._calls._byKey == {}


def test_withdrawnHitsLeaveTheirPlace() -> None:
    """
    A waiting hit whose request is cancelled is not sent; a sent one keeps
    its place in the count (the hits after it keep theirs); a call whose
    hits all withdrew is cancelled, and the next hit is sent at once.
    """
    limiter, counters = held()
    first = hits(limiter, 1)
    waiting = hits(limiter, 3)
    waiting[1].cancel()
    assert remaining(waiting[1]) == "CancelledError"
    counters.answer(0)
    assert remaining(first[0]) == 59
    assert [hits for hits, _ in counters.calls] == [1, 2]
    waiting[0].cancel()
    assert remaining(waiting[0]) == "CancelledError"
    counters.answer(1)
    assert remaining(waiting[2]) == 57
    alone = hits(limiter, 1)
    alone[0].cancel()
    assert remaining(alone[0]) == "CancelledError"
    assert counters.calls[2][1].called, "a call nobody waits for is cancelled"
    nextHit = hits(limiter, 1)
    assert [hits for hits, _ in counters.calls] == [1, 2, 1, 1]
    counters.answer(3)
    assert remaining(nextHit[0]) == 56
