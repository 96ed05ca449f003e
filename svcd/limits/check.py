"""
The limiter's check of one request (decisions D5, D11, D12): the counters
it is checked against and counted in, the one shared call that does it
(L{svcd.limits.calls}), the budgets' spend seeded from the ledger when
Redis has none, and the decision (L{RateDecision}) with its X-RateLimit-*
headers. An organization and agent without limits rows are counted as D5
says: one counter, the organization's requests in the minute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import attrs
from twisted.internet.defer import CancelledError, Deferred

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.limits.book import NO_LIMITS, Applicable, LimitBook
from svcd.limits.calls import (
    UNCHECKED_REDIS_UNAVAILABLE,
    UNCHECKED_SPEND_UNKNOWN,
    SharedCalls,
    Unchecked,
)
from svcd.limits.keys import (
    AGENT,
    BUDGET_KEY_SLACK,
    ORG,
    REQUESTS,
    TOKENS,
    WINDOW_SECONDS,
    Counter,
    budgetCounter,
    budgetPeriodAt,
    minuteKey,
)
from svcd.limits.link import RedisCounters
from svcd.limits.members import BudgetMembers
from svcd.limits.reconciliation import Reconciliation, Spend
from svcd.limits.records import Reservation

# Seeding a budget and asking again, at most this many times a request.
_SEED_ATTEMPTS = 3


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
    # With a token limit in force (D11): the one with the least room,
    # remaining after this request's reservation.
    tokenLimit: int | None = None
    tokenRemaining: int | None = None
    # What refused the request: (REQUESTS, TOKENS or BUDGET, ORG or AGENT).
    refusedBy: tuple[str, str] | None = None
    # The tokens an admitted request holds until it is settled.
    reservation: Reservation | None = None

    def headers(self) -> list[tuple[bytes, bytes]]:
        """
        X-RateLimit-Limit, X-RateLimit-Remaining and X-RateLimit-Reset,
        and their -Tokens forms when a token limit is in force.
        """
        headers = [
            (b"X-RateLimit-Limit", b"%d" % self.limit),
            (b"X-RateLimit-Remaining", b"%d" % self.remaining),
            (b"X-RateLimit-Reset", b"%d" % self.reset),
        ]
        if self.tokenLimit is not None and self.tokenRemaining is not None:
            headers += [
                (b"X-RateLimit-Limit-Tokens", b"%d" % self.tokenLimit),
                (b"X-RateLimit-Remaining-Tokens", b"%d" % self.tokenRemaining),
                (b"X-RateLimit-Reset-Tokens", b"%d" % self.reset),
            ]
        return headers


class Incrementable(Protocol):
    """
    What the limiter uses of one child of a Prometheus counter.
    """

    def inc(self, amount: float = 1) -> None: ...


class LabelledCounter(Protocol):
    """
    What the limiter uses of a Prometheus counter with one label
    (C{svc_proxy_unchecked_admissions_total{reason}}).
    """

    def labels(self, *labelvalues: str) -> Incrementable: ...


class RequestCheck:
    """
    Checks and counts each request, in one shared call (see
    L{svcd.limits.limiter.RedisRateLimiter}).

    @param unchecked: the counter C{svc_proxy_unchecked_admissions_total}
        (label C{reason}): every request let through without checking a
        limit or a budget.
    """

    def __init__(
        self,
        counters: RedisCounters,
        clock: Clock,
        book: LimitBook,
        calls: SharedCalls,
        members: BudgetMembers,
        reconciliation: Reconciliation,
        spend: Spend | None,
        unavailable: ThrottledWarning,
        timeout: float,
        defaultRPM: int,
        orgRPM: Mapping[str, int] | None,
        unchecked: LabelledCounter | None,
    ) -> None:
        self._counters = counters
        self._clock = clock
        self._book = book
        self._calls = calls
        self._members = members
        self._reconciliation = reconciliation
        # Decisions D12: what a budget's period has cost, from the ledger,
        # when Redis has no count of it.
        self._spend = spend
        self._seeding: dict[str, Deferred[None]] = {}
        self._unavailable = unavailable
        self._timeout = timeout
        self._defaultRPM = defaultRPM
        self._orgRPM = dict(orgRPM or {})
        # Decisions D12, amended: fail-open counted, by reason.
        self._uncheckedCounter = unchecked
        self._uncheckedChildren: dict[str, Incrementable] = {}

    def limitFor(self, orgID: str) -> int:
        """
        Requests per minute allowed to C{orgID} by the environment.
        """
        return self._orgRPM.get(orgID, self._defaultRPM)

    def _uncheckedAdmission(self, reason: str) -> None:
        """
        Count one request let through without a check (decisions D12,
        amended); the throttled warnings say why in the log.
        """
        if self._uncheckedCounter is None:
            return
        child = self._uncheckedChildren.get(reason)
        if child is None:
            child = self._uncheckedChildren[reason] = self._uncheckedCounter.labels(reason)
        child.inc()

    async def check(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int,
        cost: int,
        ledgerID: str | None,
        countRequest: bool,
    ) -> RateDecision | None:
        """
        The decision on one request (see
        L{svcd.limits.limiter.RateLimiter.hit}, and C{hitTokens} when not
        C{countRequest}); C{None} when the request goes on unchecked.
        """
        now = self._clock.seconds()
        windowStart = int(now) // WINDOW_SECONDS * WINDOW_SECONDS
        if not countRequest:
            reserving = self._book.applicable(orgID, agentID)
            if not (reserving.tokenLimited or reserving.budgeted):
                # Nothing that counts such a call: no check was skipped.
                return None
        if not self._counters.connected:
            self._unavailable.warn("Redis is not connected; rate limiting is off until it is back")
            self._uncheckedAdmission(UNCHECKED_REDIS_UNAVAILABLE)
            return None
        applicable = self._book.applicable(orgID, agentID)
        if applicable is not NO_LIMITS:
            if ledgerID is not None and (not ledgerID or "," in ledgerID or ledgerID == "-"):
                # Not a key the script's packing can carry: a per-key delta.
                ledgerID = None
            return await self._admit(
                orgID, agentID, tokens, cost, applicable, now, windowStart, ledgerID, countRequest
            )
        count = await self._calls.join(minuteKey(orgID, windowStart), None)
        self._calls.announce()
        if isinstance(count, Unchecked):
            self._uncheckedAdmission(count.reason)
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

    # Limits rows (decisions D11).

    async def _admit(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int,
        cost: int,
        applicable: Applicable,
        now: float,
        windowStart: int,
        ledgerID: str | None = None,
        countRequest: bool = True,
    ) -> RateDecision | None:
        counters = self._countersOf(
            orgID, agentID, tokens, cost, applicable, now, windowStart, countRequest
        )
        spendUnknown = False
        for _ in range(_SEED_ATTEMPTS):
            counts: list[int] | Unchecked = await self._calls.join(
                f"admit:{orgID}", counters, ledgerID
            )
            self._calls.announce()
            if isinstance(counts, Unchecked):
                self._uncheckedAdmission(counts.reason)
                return None
            if counts[0] >= 0:
                decision = _decision(counters, counts, windowStart + WINDOW_SECONDS, now)
                if decision.allowed:
                    if spendUnknown:
                        self._uncheckedAdmission(UNCHECKED_SPEND_UNKNOWN)
                    reservation = decision.reservation
                    if ledgerID is not None and reservation is not None and reservation.costKeys:
                        reservation = attrs.evolve(reservation, ledgerID=ledgerID)
                        decision = attrs.evolve(decision, reservation=reservation)
                        self._members.hold(ledgerID, reservation.costKeys, reservation.cost, now)
                return decision
            # A budget's spend is not in Redis (a new period, or Redis lost
            # it): take it again from the ledger, then ask again.
            unseeded = counters[-counts[0] - 1]
            whose = agentID if unseeded.scope == AGENT else None
            if not await self._seed(orgID, whose, unseeded, now):
                # The ledger could not say: this request goes on without
                # that budget (fail open, as for Redis), the next tries again.
                counters = tuple(c for c in counters if c.key != unseeded.key)
                spendUnknown = True
                if not counters:
                    # A call that counts no request had that budget alone.
                    break
        self._uncheckedAdmission(UNCHECKED_SPEND_UNKNOWN)
        return None

    def _countersOf(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int,
        cost: int,
        applicable: Applicable,
        now: float,
        windowStart: int,
        countRequest: bool = True,
    ) -> tuple[Counter, ...]:
        """
        The counters of one request, in the order a refusal is reported:
        the organization's requests, tokens and budget, then its agent's
        (without the requests counters when not C{countRequest}).
        A reservation larger than a whole C{tpm} is cut to it, so that such
        a request still runs in an otherwise empty minute; a worst-case
        cost larger than a budget is refused (it could pass it).
        """
        org, agent = applicable.org, applicable.agent
        rpm = org.rpm if org is not None and org.rpm is not None else self.limitFor(orgID)
        tpms = [row.tpm for row in (org, agent) if row is not None and row.tpm is not None]
        reserved = min(tokens, *tpms) if tpms else 0
        orgKey = minuteKey(orgID, windowStart)
        counters = [Counter(orgKey, 1, rpm, REQUESTS, ORG)] if countRequest else []
        if org is not None and org.tpm is not None:
            counters.append(Counter(orgKey + ":tokens", reserved, org.tpm, TOKENS, ORG))
        if applicable.orgBudget is not None:
            budget = budgetCounter(orgID, None, applicable.orgBudget, cost, ORG, now)
            self._reconciliation.used(budget, orgID, None, now)
            counters.append(budget)
        agentKey = f"{orgKey}:agent:{agentID}"
        if countRequest and agent is not None and agent.rpm is not None:
            counters.append(Counter(agentKey, 1, agent.rpm, REQUESTS, AGENT))
        if agent is not None and agent.tpm is not None:
            counters.append(Counter(agentKey + ":tokens", reserved, agent.tpm, TOKENS, AGENT))
        if applicable.agentBudget is not None:
            budget = budgetCounter(orgID, agentID, applicable.agentBudget, cost, AGENT, now)
            self._reconciliation.used(budget, orgID, agentID, now)
            counters.append(budget)
        return tuple(counters)

    async def _seed(self, orgID: str, agentID: str | None, counter: Counter, now: float) -> bool:
        """
        Put in Redis what the ledger says the budget's period has cost so
        far, unless another request or proxy did it first; one lookup per
        counter at a time. False when the ledger could not be asked.
        """
        seeding = self._seeding.get(counter.key)
        if seeding is None:
            seeding = self._seeding[counter.key] = Deferred.fromCoroutine(
                self._seedOnce(orgID, agentID, counter, now)
            )
            seeding.addBoth(self._seeded, counter.key)
        try:
            await seeding
        except CancelledError:
            raise
        except Exception as error:
            self._unavailable.warn(
                "A budget's spend could not be taken from the ledger ({error_type}); the"
                " request goes on without that budget, the next one tries again",
                error_type=type(error).__name__,
            )
            return False
        return True

    async def _seedOnce(
        self, orgID: str, agentID: str | None, counter: Counter, now: float
    ) -> None:
        if self._spend is None:
            raise LookupError("no ledger to ask")
        since, until = budgetPeriodAt(counter.key, now)
        spent = await self._spend(orgID, agentID, since, until)
        await timeoutDeferred(
            self._counters.seed(counter.key, spent, until - int(now) + BUDGET_KEY_SLACK),
            self._timeout,
            asReactorTime(self._clock),
        )

    def _seeded(self, result: object, key: str) -> object:
        self._seeding.pop(key, None)
        return result


def _decision(
    counters: tuple[Counter, ...], answer: list[int], minuteEnd: int, now: float
) -> RateDecision:
    """
    The decision on one request from the admission script's answer: the
    requests limit with the least room for X-RateLimit-*, the token limit
    with the least room for its -Tokens forms, what refused it (and when
    that frees up), and what an admitted one holds until it is settled.
    """
    refused, counts = answer[0], answer[1:]
    requests: tuple[int, int] | None = None
    tokens: tuple[int, int] | None = None
    tokenKeys: list[str] = []
    costKeys: list[str] = []
    reserved = cost = 0
    for counter, count in zip(counters, counts, strict=True):
        room = (counter.limit, max(0, counter.limit - count))
        if counter.kind == REQUESTS:
            if requests is None or room[1] < requests[1]:
                requests = room
        elif counter.kind == TOKENS:
            tokenKeys.append(counter.key)
            reserved = counter.amount
            if tokens is None or room[1] < tokens[1]:
                tokens = room
        else:
            costKeys.append(counter.key)
            cost = counter.amount
    if requests is None:
        # A call that counts no request (svc-worker's): the headers, which
        # nobody reads, describe the token limit.
        requests = tokens if tokens is not None else (0, 0)
    reservation = None
    if not refused and (tokenKeys or costKeys):
        reservation = Reservation(tuple(tokenKeys), reserved, tuple(costKeys), cost)
    refusedBy = None
    retryAfter = max(1, math.ceil(minuteEnd - now))
    if refused:
        culprit = counters[refused - 1]
        refusedBy = (culprit.kind, culprit.scope)
        if culprit.reset:
            retryAfter = max(1, math.ceil(culprit.reset - now))
    return RateDecision(
        allowed=not refused,
        limit=requests[0],
        remaining=requests[1],
        reset=minuteEnd,
        retryAfter=retryAfter,
        tokenLimit=tokens[0] if tokens is not None else None,
        tokenRemaining=tokens[1] if tokens is not None else None,
        refusedBy=refusedBy,
        reservation=reservation,
    )
