"""
The rate limiter's circuit breaker (decisions D10): the state machine of
L{svcd.limits.breaker.CircuitBreaker} on a fake clock, then the limiter
using it over in-memory counters (its gauge, its two log lines, the
requests that skip Redis). The same against a real Redis frozen under
load through a real proxy is in tests/test_faults_edge.py.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from proxydoubles import MemoryCounters
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from svcd.limits.breaker import CircuitBreaker, Permit
from svcd.limits.check import RateDecision
from svcd.limits.limiter import RedisRateLimiter
from svcd.proxy.metrics import ProxyMetrics


def test_closedPermitsEveryCall() -> None:
    """
    A closed circuit gives every caller an ordinary permit, and successes
    change nothing.
    """
    breaker = CircuitBreaker(Clock())
    for _ in range(3):
        permit = breaker.permit()
        assert permit is Permit.ORDINARY
        assert not breaker.succeeded(permit)
    assert not breaker.isOpen


def test_failureOpensForOneSecond() -> None:
    """
    A failed call opens the circuit (reported once): for the next second
    every caller is refused a permit, even when later calls made before
    the opening fail or succeed.
    """
    clock = Clock()
    breaker = CircuitBreaker(clock)
    first, second = breaker.permit(), breaker.permit()
    assert first is second is Permit.ORDINARY
    assert breaker.failed(Permit.ORDINARY)
    assert breaker.isOpen
    # The other call made before the opening ends later: ignored.
    assert not breaker.failed(Permit.ORDINARY)
    assert not breaker.succeeded(Permit.ORDINARY)
    assert breaker.isOpen
    clock.advance(0.999)
    assert breaker.permit() is None


def test_halfOpenLetsExactlyOneTry() -> None:
    """
    One second after the opening, the first caller gets the trial and
    every caller while it is in flight is refused, however long it takes.
    """
    clock = Clock()
    breaker = CircuitBreaker(clock)
    breaker.failed(Permit.ORDINARY)
    clock.advance(1.0)
    assert breaker.permit() is Permit.TRIAL
    assert [breaker.permit() for _ in range(5)] == [None] * 5
    clock.advance(10)
    assert breaker.permit() is None


def test_trialFailureReopensForAnotherSecond() -> None:
    """
    A failed trial keeps the circuit open (not reported as a new opening)
    for one more second from the failure, then allows one trial again.
    """
    clock = Clock()
    breaker = CircuitBreaker(clock)
    breaker.failed(Permit.ORDINARY)
    clock.advance(1.0)
    trial = breaker.permit()
    assert trial is Permit.TRIAL
    clock.advance(0.1)
    assert not breaker.failed(trial)
    assert breaker.isOpen
    clock.advance(0.999)
    assert breaker.permit() is None
    clock.advance(0.001)
    assert breaker.permit() is Permit.TRIAL


def test_trialSuccessCloses() -> None:
    """
    A successful trial closes the circuit (reported once): every caller
    gets an ordinary permit again.
    """
    clock = Clock()
    breaker = CircuitBreaker(clock)
    breaker.failed(Permit.ORDINARY)
    clock.advance(1.0)
    trial = breaker.permit()
    assert trial is Permit.TRIAL
    assert breaker.succeeded(trial)
    assert not breaker.isOpen
    assert [breaker.permit() for _ in range(3)] == [Permit.ORDINARY] * 3


def test_retryNowMakesTheNextCallTheTrial() -> None:
    """
    retryNow (a new Redis master found, decisions D16) lets the next call
    of an open circuit be its trial at once, and only one; on a closed
    circuit it changes nothing.
    """
    clock = Clock()
    breaker = CircuitBreaker(clock)
    breaker.retryNow()
    assert not breaker.isOpen
    breaker.failed(Permit.ORDINARY)
    clock.advance(0.1)
    assert breaker.permit() is None
    breaker.retryNow()
    trial = breaker.permit()
    assert trial is Permit.TRIAL
    assert breaker.permit() is None
    assert breaker.succeeded(trial)
    assert breaker.permit() is Permit.ORDINARY


def test_abandonedTrialPassesItsTurn() -> None:
    """
    A trial whose request went away without an outcome frees its place:
    the next caller tries.
    """
    clock = Clock()
    breaker = CircuitBreaker(clock)
    breaker.failed(Permit.ORDINARY)
    clock.advance(1.0)
    trial = breaker.permit()
    assert trial is Permit.TRIAL
    breaker.abandoned(trial)
    assert breaker.isOpen
    assert breaker.permit() is Permit.TRIAL


# The limiter with its breaker.

ORG = str(uuid.uuid4())


class Limited:
    """
    A limiter over in-memory counters on a fake clock, with its gauge.
    """

    def __init__(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_700_000_040)
        self.counters = MemoryCounters()
        self.metrics = ProxyMetrics(CollectorRegistry())
        self.limiter = RedisRateLimiter(
            self.counters,
            self.clock,
            60,
            circuitOpen=self.metrics.ratelimitCircuitOpen,
        )

    def gauge(self) -> float | None:
        return self.metrics.registry.get_sample_value("svc_proxy_ratelimit_circuit_open")

    def hit(self) -> Deferred[RateDecision | None]:
        return Deferred.fromCoroutine(self.limiter.hit(ORG, None))

    def hang(self) -> Deferred[int]:
        """
        Make Redis hold its replies (a frozen server).
        """
        held: Deferred[int] = Deferred()
        self.counters.reply = held
        return held

    def missDeadline(self, pending: Deferred[Any]) -> Any:
        """
        Let the 100 ms budget pass (and the extra turn of the reactor
        timeoutDeferred gives a late reply) and return the outcome.
        """
        self.clock.advance(0.1)
        self.clock.advance(0)
        return outcome(pending)


def outcome(pending: Deferred[Any]) -> Any:
    results: list[Any] = []
    pending.addBoth(results.append)
    assert results, "still pending"
    return results[0]


@pytest.fixture
def limited() -> Limited:
    return Limited()


def test_limiterOpensOnDeadlineAndSkipsRedis(limited: Limited) -> None:
    """
    A Redis reply missing its 100 ms deadline opens the circuit: gauge 1,
    one warning; for the next second requests go on at once without a
    decision and without sending anything to Redis.
    """
    assert limited.gauge() == 0
    limited.hang()
    with capturedLogs() as events:
        assert limited.missDeadline(limited.hit()) is None
        limited.counters.reply = None
        for _ in range(50):
            assert outcome(limited.hit()) is None
        limited.clock.advance(0.5)
        assert outcome(limited.hit()) is None
    assert limited.counters.counts == {}
    assert limited.gauge() == 1
    warnings = [event for event in events if event["log_level"].name == "warn"]
    assert len(warnings) == 1
    assert warnings[0]["error_type"] == "TimeoutError"
    assert warnings[0]["open_seconds"] == 1.0


def test_limiterTrialFailsThenSucceeds(limited: Limited) -> None:
    """
    After the second, one request tries Redis while the others skip it;
    the trial failing keeps the circuit open for another second without a
    new warning; the next trial succeeding closes it: gauge 0, one info
    line, decisions (with their headers) again for every request.
    """
    limited.counters.failure = ConnectionError("reset")
    with capturedLogs() as events:
        assert outcome(limited.hit()) is None
        limited.clock.advance(1.0)
        trial = limited.hang()
        pendingTrial = limited.hit()
        limited.counters.reply = None
        limited.counters.failure = None
        assert outcome(limited.hit()) is None
        assert limited.counters.counts == {}
        trial.errback(ConnectionError("still down"))
        assert outcome(pendingTrial) is None
        assert limited.gauge() == 1
        limited.clock.advance(0.5)
        assert outcome(limited.hit()) is None
        assert limited.counters.counts == {}
        limited.clock.advance(0.5)
        decision = outcome(limited.hit())
        assert isinstance(decision, RateDecision) and decision.remaining == 59
        assert limited.gauge() == 0
        later = outcome(limited.hit())
        assert isinstance(later, RateDecision) and later.remaining == 58
    levels = [(event["log_level"].name, event["log_format"]) for event in events]
    assert [level for level, _ in levels] == ["warn", "info"]
    assert "rate limiting resumed" in levels[1][1]


def test_limiterCancelledTrialFreesItsPlace(limited: Limited) -> None:
    """
    A trial whose request is cancelled (its client went away) does not
    leave the circuit stuck half-open: the next request tries Redis.
    """
    limited.counters.failure = ConnectionError("reset")
    assert outcome(limited.hit()) is None
    limited.clock.advance(1.0)
    limited.hang()
    pendingTrial = limited.hit()
    pendingTrial.cancel()
    assert isinstance(outcome(pendingTrial).value, CancelledError)
    limited.counters.reply = None
    limited.counters.failure = None
    decision = outcome(limited.hit())
    assert isinstance(decision, RateDecision)
    assert limited.gauge() == 0


def test_limiterReadinessIgnoresTheBreaker(limited: Limited) -> None:
    """
    The /ready check asks Redis itself while the circuit is open: it
    passes when Redis answers PING, whatever the breaker thinks.
    """
    limited.counters.failure = ConnectionError("reset")
    assert outcome(limited.hit()) is None
    assert limited.gauge() == 1
    assert outcome(limited.limiter.checkReady()) is None


def test_disconnectedRedisLeavesTheCircuitAlone(limited: Limited) -> None:
    """
    With Redis not connected requests fail open at once, as before the
    breaker (a throttled warning), and the circuit stays closed: nothing
    waited on a deadline.
    """
    limited.counters.connected = False
    assert outcome(limited.hit()) is None
    assert limited.gauge() == 0
