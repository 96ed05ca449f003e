"""
The organization rate limit of spec section 8 and decisions D5: a fixed
calendar-minute window per organization, counted in Redis under
C{ratelimit:<org_id>:<window_start_unix_seconds>}.

At most one round trip per request, and under load far fewer: a Lua
script adds to the counter and gives a fresh key its TTL atomically
(txredisapi sends it with EVALSHA once the script is cached), and the hits
of one key that arrive while its call is in flight share the next call,
which adds their number at once (see L{RedisRateLimiter}). The limiter
fails open: with Redis unconfigured, down, or slower than its budget, the
request goes on without X-RateLimit-* headers and a warning is logged.
Failing open is also cheap (D10): after a counter call fails or misses its
deadline, a circuit breaker (L{svcd.proxy.limits.breaker}) skips Redis for one
second, then lets one request try it, so a hung Redis costs one deadline
per second instead of one per request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import txredisapi
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IReactorTCP
from twisted.logger import Logger
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.common.readiness import CheckFailed
from svcd.proxy.config import RedisTarget
from svcd.proxy.limits.breaker import CircuitBreaker, Permit

WINDOW_SECONDS = 60
# Longer than the window so a counter outlives any clock skew between
# proxies sharing it; the window start in the key keeps windows apart.
KEY_TTL_SECONDS = 2 * WINDOW_SECONDS

# INCRBY the number of hits, and EXPIRE when the key is new (or somehow
# lost its TTL), in one atomic step. ARGV: the TTL, the number of hits.
_INCREMENT_SCRIPT = """
local count = redis.call('INCRBY', KEYS[1], ARGV[2])
if count == tonumber(ARGV[2]) or redis.call('TTL', KEYS[1]) < 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
return count
"""


@attrs.frozen
class RateDecision:
    """
    The limiter's verdict on one request, with the values of the
    X-RateLimit-* headers (decisions D5).
    """

    allowed: bool
    limit: int
    remaining: int
    reset: int
    retryAfter: int

    def headers(self) -> list[tuple[bytes, bytes]]:
        """
        X-RateLimit-Limit, X-RateLimit-Remaining and X-RateLimit-Reset.
        """
        return [
            (b"X-RateLimit-Limit", b"%d" % self.limit),
            (b"X-RateLimit-Remaining", b"%d" % self.remaining),
            (b"X-RateLimit-Reset", b"%d" % self.reset),
        ]


class RateLimiter(Protocol):
    """
    What the proxy needs of a rate limiter.
    """

    async def hit(self, orgID: str, agentID: str | None) -> RateDecision | None:
        """
        Count one request of C{orgID} (the agent is accepted and ignored:
        the limit is per organization) and decide on it; C{None} when the
        limiter could not decide and the request goes on (fail open).
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


class Gauge(Protocol):
    """
    What the limiter uses of a Prometheus gauge.
    """

    def set(self, value: float) -> None: ...


class RedisCounters(Protocol):
    """
    The Redis operations the limiter uses; L{RedisLink} is the real one.
    """

    @property
    def connected(self) -> bool: ...

    def increment(self, key: str, hits: int, ttl: int) -> Deferred[int]:
        """
        Add C{hits} to the counter C{key} (giving a new key C{ttl}
        seconds to live); fires with the count after them.
        """

    def ping(self) -> Deferred[object]: ...

    def start(self) -> None: ...

    def stop(self) -> Deferred[None]: ...


class RedisLink:
    """
    One reconnecting txredisapi connection to Redis.

    txredisapi queues a command made while disconnected until a connection
    comes back; a request must not wait for that, so L{connected} lets the
    limiter fail open at once instead.
    """

    # Reconnect attempts back off up to this many seconds, so the limiter
    # is back within seconds of Redis returning.
    maxReconnectDelay = 2.0

    def __init__(
        self,
        reactor: IReactorTCP,
        target: RedisTarget,
        connectTimeout: float = 1.0,
        replyTimeout: float = 2.0,
    ) -> None:
        self._reactor = reactor
        self._target = target
        self._connectTimeout = connectTimeout
        self._replyTimeout = replyTimeout
        self._factory: Any = None

    @property
    def connected(self) -> bool:
        return self._factory is not None and self._factory.size > 0

    def start(self) -> None:
        factory = txredisapi.RedisFactory(
            f"{self._target.host}:{self._target.port}",
            self._target.db,
            1,
            isLazy=True,
            password=self._target.password,
            username=self._target.username,
            # A reply that never comes means a broken connection: drop it
            # and reconnect rather than queue every later command behind it.
            replyTimeout=self._replyTimeout,
        )
        factory.maxDelay = self.maxReconnectDelay
        factory.startConnecting(
            HostnameEndpoint(
                self._reactor, self._target.host, self._target.port, timeout=self._connectTimeout
            )
        )
        self._factory = factory

    def stop(self) -> Deferred[None]:
        factory, self._factory = self._factory, None
        if factory is None:
            return succeed(None)
        done: Deferred[None] = factory.disconnect()
        return done

    def increment(self, key: str, hits: int, ttl: int) -> Deferred[int]:
        result: Deferred[int] = self._factory.handler.eval(_INCREMENT_SCRIPT, [key], [ttl, hits])
        return result

    def ping(self) -> Deferred[object]:
        result: Deferred[object] = self._factory.handler.ping()
        return result


@attrs.define(eq=False)
class _KeyCalls:
    """
    The calls of one counter key: the hits counted by the call in flight,
    in the order they came, and the hits that came since, which share the
    next call.
    """

    sent: list[Deferred[int | None]] = attrs.Factory(list)
    call: Deferred[int] | None = None
    waiting: list[Deferred[int | None]] = attrs.Factory(list)


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

    @param clock: the time source for windows, the timer of the Redis
        budget and the circuit breaker; tests pass a
        L{twisted.internet.task.Clock}.
    @param circuitOpen: the gauge C{svc_proxy_ratelimit_circuit_open}, set
        to 1 while the breaker skips Redis and to 0 once it closes.
    @param openSeconds: how long the breaker skips Redis after a failure.
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
    ) -> None:
        self._counters = counters
        self._clock = clock
        self._defaultRPM = defaultRPM
        self._orgRPM = dict(orgRPM or {})
        self._timeout = timeout
        self._unavailable = ThrottledWarning(self.log, clock, warnInterval)
        self._breaker = CircuitBreaker(clock, openSeconds)
        self._openSeconds = openSeconds
        self._circuitOpen = circuitOpen
        self._calls: dict[str, _KeyCalls] = {}
        # A change of the circuit, to be logged by the first request to
        # resume (in its context: the line then carries its request_id).
        self._news: tuple[str, str] | None = None

    def limitFor(self, orgID: str) -> int:
        """
        Requests per minute allowed to C{orgID}.
        """
        return self._orgRPM.get(orgID, self._defaultRPM)

    async def hit(self, orgID: str, agentID: str | None) -> RateDecision | None:
        now = self._clock.seconds()
        windowStart = int(now) // WINDOW_SECONDS * WINDOW_SECONDS
        if not self._counters.connected:
            self._unavailable.warn("Redis is not connected; rate limiting is off until it is back")
            return None
        count = await self._count(f"ratelimit:{orgID}:{windowStart}")
        if self._news is not None:
            self._announce(self._news)
        if count is None:
            return None
        limit = self.limitFor(orgID)
        reset = windowStart + WINDOW_SECONDS
        return RateDecision(
            allowed=count <= limit,
            limit=limit,
            remaining=max(0, limit - count),
            reset=reset,
            retryAfter=max(1, math.ceil(reset - now)),
        )

    # Shared calls (see the class docstring).

    def _count(self, key: str) -> Deferred[int | None]:
        """
        This hit's count in C{key}, or None when Redis is skipped or fails
        (fail open).
        """
        calls = self._calls.get(key)
        if calls is None:
            calls = self._calls[key] = _KeyCalls()
        counted: Deferred[int | None] = Deferred(lambda withdrawn: self._withdraw(calls, withdrawn))
        if calls.call is None:
            calls.waiting.append(counted)
            self._send(key, calls)
        elif self._breaker.isOpen:
            # The call in flight is the half-open circuit's one trial: the
            # others skip Redis meanwhile.
            counted.callback(None)
        else:
            calls.waiting.append(counted)
        return counted

    def _send(self, key: str, calls: _KeyCalls) -> None:
        hits, calls.waiting = calls.waiting, []
        permit = self._breaker.permit()
        if permit is None:
            # The circuit is open: Redis failed less than a second ago, or
            # a trial is finding out whether it is back.
            self._forget(key, calls)
            _fire(hits, lambda _: None)
            return
        calls.sent = hits
        call = calls.call = timeoutDeferred(
            self._counters.increment(key, len(hits), KEY_TTL_SECONDS),
            self._timeout,
            asReactorTime(self._clock),
        )
        call.addCallbacks(
            self._counted,
            self._failed,
            callbackArgs=(key, calls, permit, hits),
            errbackArgs=(key, calls, permit, hits),
        )

    def _counted(
        self,
        total: int,
        key: str,
        calls: _KeyCalls,
        permit: Permit,
        hits: list[Deferred[int | None]],
    ) -> None:
        calls.call = None
        if self._breaker.succeeded(permit):
            self._setCircuitOpen(False)
            self._news = ("closed", "")
        self._next(key, calls)
        first = total - len(hits) + 1
        _fire(hits, lambda index: first + index)

    def _failed(
        self,
        failure: Failure,
        key: str,
        calls: _KeyCalls,
        permit: Permit,
        hits: list[Deferred[int | None]],
    ) -> None:
        calls.call = None
        if failure.check(CancelledError):
            # Every hit it counted was withdrawn (their clients went away).
            self._breaker.abandoned(permit)
        elif self._breaker.failed(permit):
            self._setCircuitOpen(True)
            self._news = ("opened", type(failure.value).__name__)
        self._next(key, calls)
        _fire(hits, lambda _: None)

    def _announce(self, news: tuple[str, str]) -> None:
        self._news = None
        change, errorType = news
        if change == "closed":
            self.log.info("Redis rate-limit counter answers again; rate limiting resumed")
        else:
            self.log.warn(
                "Redis rate-limit counter failed ({error_type}); requests go on without"
                " rate limits, Redis is skipped for {open_seconds} s, then tried again",
                error_type=errorType,
                open_seconds=self._openSeconds,
            )

    def _next(self, key: str, calls: _KeyCalls) -> None:
        if calls.waiting:
            self._send(key, calls)
        else:
            self._forget(key, calls)

    def _forget(self, key: str, calls: _KeyCalls) -> None:
        if calls.call is None and not calls.waiting and self._calls.get(key) is calls:
            del self._calls[key]

    def _withdraw(self, calls: _KeyCalls, hit: Deferred[int | None]) -> None:
        """
        A hit's request was cancelled: it leaves the hits waiting, or, once
        sent, stays counted (its place in the call's count is taken); a
        call every hit of which has withdrawn is cancelled.
        """
        if hit in calls.waiting:
            calls.waiting.remove(hit)
            return
        if hit in calls.sent:
            # Its place stays (the counts of the hits after it depend on
            # it), taken by a hit already answered, so that the call's
            # outcome does not fire this one, which Deferred.cancel fails.
            calls.sent[calls.sent.index(hit)] = _WITHDRAWN
            if calls.call is not None and all(other.called for other in calls.sent):
                calls.call.cancel()

    def _setCircuitOpen(self, isOpen: bool) -> None:
        if self._circuitOpen is not None:
            self._circuitOpen.set(1 if isOpen else 0)

    def checkReady(self) -> Deferred[None]:
        # Straight to Redis, past the breaker: /ready reports the truth.
        if not self._counters.connected:
            return fail(CheckFailed("not connected to Redis"))

        def answered(reply: object) -> None:
            return None

        return self._counters.ping().addCallback(answered)

    def start(self) -> None:
        self._counters.start()

    def stop(self) -> Deferred[None]:
        return self._counters.stop()

    def connected(self) -> bool:
        """
        Is the connection to Redis up? (What a starting proxy waits for
        before it listens.)
        """
        return self._counters.connected


# Stands in for a hit withdrawn after its call was sent.
_WITHDRAWN: Deferred[int | None] = succeed(None)


def _fire(hits: list[Deferred[int | None]], count: Callable[[int], int | None]) -> None:
    for index, hit in enumerate(hits):
        if not hit.called:
            hit.callback(count(index))


class DisabledRateLimiter:
    """
    The limiter when REDIS_URL is empty: every request goes on without
    X-RateLimit-* headers, and /ready reports redis as failed.
    """

    log = Logger()

    def __init__(self, clock: Clock, warnInterval: float = 60.0) -> None:
        self._notConfigured = ThrottledWarning(self.log, clock, warnInterval)

    async def hit(self, orgID: str, agentID: str | None) -> RateDecision | None:
        self._notConfigured.warn("REDIS_URL is not configured; rate limiting is off")
        return None

    def checkReady(self) -> Deferred[None]:
        return fail(CheckFailed("REDIS_URL is not configured"))

    def start(self) -> None:
        self.log.warn("REDIS_URL is not configured; rate limiting is off")

    def stop(self) -> Deferred[None]:
        return succeed(None)


def makeRateLimiter(
    reactor: IReactorTCP,
    clock: Clock,
    target: RedisTarget | None,
    defaultRPM: int,
    orgRPM: Mapping[str, int],
    circuitOpen: Gauge | None = None,
) -> RedisRateLimiter | DisabledRateLimiter:
    """
    The limiter for a configuration: over Redis when REDIS_URL is set.
    """
    if target is None:
        return DisabledRateLimiter(clock)
    return RedisRateLimiter(
        RedisLink(reactor, target), clock, defaultRPM, orgRPM, circuitOpen=circuitOpen
    )
