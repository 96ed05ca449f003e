"""
The organization rate limit of spec section 8 and decisions D5: a fixed
calendar-minute window per organization, counted in Redis under
C{ratelimit:<org_id>:<window_start_unix_seconds>}.

One round trip per request: a Lua script increments the counter and gives
a fresh key its TTL atomically (txredisapi sends it with EVALSHA once the
script is cached). The limiter fails open: with Redis unconfigured, down,
or slower than its budget, the request goes on without X-RateLimit-*
headers and a warning is logged. Failing open is also cheap (D10): after a
counter call fails or misses its deadline, a circuit breaker
(L{svcd.proxy.breaker}) skips Redis for one second, then lets one request
try it, so a hung Redis costs one deadline per second instead of one per
request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import txredisapi
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IReactorTCP
from twisted.logger import Logger

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.common.readiness import CheckFailed
from svcd.proxy.breaker import CircuitBreaker
from svcd.proxy.config import RedisTarget

WINDOW_SECONDS = 60
# Longer than the window so a counter outlives any clock skew between
# proxies sharing it; the window start in the key keeps windows apart.
KEY_TTL_SECONDS = 2 * WINDOW_SECONDS

# INCR, and EXPIRE when the key is new (or somehow lost its TTL), in one
# atomic step.
_INCREMENT_SCRIPT = """
local count = redis.call('INCR', KEYS[1])
if count == 1 or redis.call('TTL', KEYS[1]) < 0 then
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

    def increment(self, key: str, ttl: int) -> Deferred[int]: ...

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

    def increment(self, key: str, ttl: int) -> Deferred[int]:
        result: Deferred[int] = self._factory.handler.eval(_INCREMENT_SCRIPT, [key], [ttl])
        return result

    def ping(self) -> Deferred[object]:
        result: Deferred[object] = self._factory.handler.ping()
        return result


class RedisRateLimiter:
    """
    The fixed-window limiter over Redis.

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
        permit = self._breaker.permit()
        if permit is None:
            # The circuit is open: Redis failed less than a second ago, or
            # another request is trying it now.
            return None
        key = f"ratelimit:{orgID}:{windowStart}"
        try:
            count = await timeoutDeferred(
                self._counters.increment(key, KEY_TTL_SECONDS),
                self._timeout,
                asReactorTime(self._clock),
            )
        except CancelledError:
            self._breaker.abandoned(permit)
            raise
        except Exception as error:
            if self._breaker.failed(permit):
                self._setCircuitOpen(True)
                self.log.warn(
                    "Redis rate-limit counter failed ({error_type}); requests go on without"
                    " rate limits, Redis is skipped for {open_seconds} s, then tried again",
                    error_type=type(error).__name__,
                    open_seconds=self._openSeconds,
                )
            return None
        if self._breaker.succeeded(permit):
            self._setCircuitOpen(False)
            self.log.info("Redis rate-limit counter answers again; rate limiting resumed")
        limit = self.limitFor(orgID)
        reset = windowStart + WINDOW_SECONDS
        return RateDecision(
            allowed=count <= limit,
            limit=limit,
            remaining=max(0, limit - count),
            reset=reset,
            retryAfter=max(1, math.ceil(reset - now)),
        )

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
