"""
The limiter's calls to Redis on the request's path, shared (decisions D5,
D10, D11): the hits of one counter key (or, with limits rows, the
admissions of one organization) that arrive while a call of theirs is in
flight wait for it and go together in the next, and a circuit breaker
(L{svcd.limits.breaker}) skips Redis for a while after a call failed.

A hit that could not be checked is answered an L{Unchecked} saying why
(the request goes on: the limiter fails open).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.limits.breaker import CircuitBreaker, Permit
from svcd.limits.keys import KEY_TTL_SECONDS, Counter
from svcd.limits.link import RedisCounters
from svcd.limits.scripts import LedgerWork, admitArguments
from svcd.limits.settlements import Settlements


class Gauge(Protocol):
    """
    What the limiter uses of a Prometheus gauge.
    """

    def set(self, value: float) -> None: ...


# Why a request was admitted without a check (decisions D12, amended): the
# reasons of svc_proxy_unchecked_admissions_total.
UNCHECKED_REDIS_UNAVAILABLE = "redis_unavailable"
UNCHECKED_BREAKER_OPEN = "breaker_open"
UNCHECKED_REDIS_FAILED = "redis_failed"
UNCHECKED_SPEND_UNKNOWN = "spend_unknown"
UNCHECKED_REASONS = (
    UNCHECKED_REDIS_UNAVAILABLE,
    UNCHECKED_BREAKER_OPEN,
    UNCHECKED_REDIS_FAILED,
    UNCHECKED_SPEND_UNKNOWN,
)


@attrs.frozen
class Unchecked:
    """
    What a shared call answers a hit it could not check, and why.
    """

    reason: str


_SKIPPED = Unchecked(UNCHECKED_BREAKER_OPEN)
_FAILED = Unchecked(UNCHECKED_REDIS_FAILED)


@attrs.define(eq=False)
class _KeyCalls:
    """
    The calls of one counter key (or, with limits rows, of one
    organization's admissions): the hits counted by the call in flight, in
    the order they came, and the hits that came since, which share the
    next call.
    """

    sent: list[Deferred[Any]] = attrs.Factory(list)
    call: Deferred[Any] | None = None
    waiting: list[Deferred[Any]] = attrs.Factory(list)
    # Admissions (D11): the counters of each hit not yet sent, and its
    # ledger id (D12, amended) or None.
    counters: dict[Deferred[Any], tuple[tuple[Counter, ...], str | None]] = attrs.Factory(dict)


class SharedCalls:
    """
    Hits of one key share calls (see L{svcd.limits.limiter.RedisRateLimiter}):
    a hit sends its call at once when none of its key is in flight; the
    hits that come while one is wait for it to end and then go together in
    the next call. An admission call carries the settlements waiting
    (L{Settlements.take}), so that they cost no round trip of their own.

    @param log: the limiter's logger: the circuit's changes are logged
        under its namespace.
    @param timing: the lease and record grace of budget members, as the
        admission script takes them (L{svcd.limits.members.BudgetMembers}).
    """

    def __init__(
        self,
        counters: RedisCounters,
        clock: Clock,
        breaker: CircuitBreaker,
        settlements: Settlements,
        log: Logger,
        timing: str,
        timeout: float,
        openSeconds: float,
        circuitOpen: Gauge | None,
    ) -> None:
        self._counters = counters
        self._clock = clock
        self._breaker = breaker
        self._settlements = settlements
        self._log = log
        self._timing = timing
        self._timeout = timeout
        self._openSeconds = openSeconds
        self._circuitOpen = circuitOpen
        self._byKey: dict[str, _KeyCalls] = {}
        # A change of the circuit, to be logged by the first request to
        # resume (in its context: the line then carries its request_id).
        self._news: tuple[str, str] | None = None

    def join(
        self, key: str, counters: tuple[Counter, ...] | None, ledgerID: str | None = None
    ) -> Deferred[Any]:
        """
        This hit's count in C{key} (or, with C{counters}, the admission
        script's answer for it), or an L{Unchecked} when Redis is skipped
        or fails (fail open).
        """
        calls = self._byKey.get(key)
        if calls is None:
            calls = self._byKey[key] = _KeyCalls()
        counted: Deferred[Any] = Deferred(lambda withdrawn: self._withdraw(calls, withdrawn))
        if counters is not None:
            calls.counters[counted] = (counters, ledgerID)
        if calls.call is None:
            calls.waiting.append(counted)
            self._send(key, calls)
        elif self._breaker.isOpen:
            # The call in flight is the half-open circuit's one trial: the
            # others skip Redis meanwhile.
            counted.callback(_SKIPPED)
        else:
            calls.waiting.append(counted)
        if counted.called:
            calls.counters.pop(counted, None)
        return counted

    def _send(self, key: str, calls: _KeyCalls) -> None:
        hits, calls.waiting = calls.waiting, []
        admissions = [calls.counters.pop(hit) for hit in hits] if calls.counters else None
        permit = self._breaker.permit()
        if permit is None:
            # The circuit is open: Redis failed less than a second ago, or
            # a trial is finding out whether it is back.
            self._forget(key, calls)
            _fire(hits, lambda _: _SKIPPED)
            return
        calls.sent = hits
        request: Deferred[Any]
        slot = 0
        if admissions is not None:
            keys, arguments = admitArguments([counters for counters, _ in admissions])
            # Settlements waiting ride on this call (C{ADMIT_SCRIPT}), those
            # of its hash slot (one organization's keys are one slot: D16).
            adjustments, settlements, marks = self._settlements.take(keys)
            ledger = None
            if settlements or marks or any(ledgerID for _, ledgerID in admissions):
                ledger = LedgerWork(
                    ",".join(ledgerID or "-" for _, ledgerID in admissions),
                    settlements,
                    marks,
                    self._timing,
                )
            slot = self._settlements.admissionSent(keys)
            request = self._counters.admit(keys, arguments, adjustments, ledger)
        else:
            request = self._counters.increment(key, len(hits), KEY_TTL_SECONDS)
        call = calls.call = timeoutDeferred(request, self._timeout, asReactorTime(self._clock))
        if admissions is not None:
            sending = self._settlements.sending
            if sending[0] or sending[1]:
                call.addErrback(self._settlements.sendAgain, sending)
        call.addCallbacks(
            self._counted,
            self._failed,
            callbackArgs=(key, calls, permit, hits),
            errbackArgs=(key, calls, permit, hits),
        )
        if admissions is not None:
            # After _counted or _failed, which send the next call of the
            # organization, if any, first.
            call.addBoth(self._admitted, slot)

    def _admitted(self, result: object, slot: int) -> object:
        self._settlements.admitted(slot)
        return result

    def _counted(
        self,
        total: int | list[list[int]],
        key: str,
        calls: _KeyCalls,
        permit: Permit,
        hits: list[Deferred[Any]],
    ) -> None:
        calls.call = None
        if self._breaker.succeeded(permit):
            self._setCircuitOpen(False)
            self._news = ("closed", "")
        self._next(key, calls)
        if isinstance(total, list):
            answers = total
            _fire(hits, lambda index: [int(value) for value in answers[index]])
            return
        first = total - len(hits) + 1
        _fire(hits, lambda index: first + index)

    def _failed(
        self,
        failure: Failure,
        key: str,
        calls: _KeyCalls,
        permit: Permit,
        hits: list[Deferred[Any]],
    ) -> None:
        calls.call = None
        if failure.check(CancelledError):
            # Every hit it counted was withdrawn (their clients went away).
            self._breaker.abandoned(permit)
        elif self._breaker.failed(permit):
            self._setCircuitOpen(True)
            self._news = ("opened", type(failure.value).__name__)
        self._next(key, calls)
        _fire(hits, lambda _: _FAILED)

    def announce(self) -> None:
        """
        Log the circuit's last change, if any not logged yet: called by a
        request once its call has answered, so that the line carries its
        context.
        """
        news = self._news
        if news is None:
            return
        self._news = None
        change, errorType = news
        if change == "closed":
            self._log.info("Redis rate-limit counter answers again; rate limiting resumed")
        else:
            self._log.warn(
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
        if calls.call is None and not calls.waiting and self._byKey.get(key) is calls:
            del self._byKey[key]

    def _withdraw(self, calls: _KeyCalls, hit: Deferred[Any]) -> None:
        """
        A hit's request was cancelled: it leaves the hits waiting, or, once
        sent, stays counted (its place in the call's count is taken); a
        call every hit of which has withdrawn is cancelled.
        """
        if hit in calls.waiting:
            calls.waiting.remove(hit)
            calls.counters.pop(hit, None)
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


# Stands in for a hit withdrawn after its call was sent.
_WITHDRAWN: Deferred[Any] = succeed(None)


def _fire(hits: list[Deferred[Any]], count: Callable[[int], object]) -> None:
    for index, hit in enumerate(hits):
        if not hit.called:
            hit.callback(count(index))
