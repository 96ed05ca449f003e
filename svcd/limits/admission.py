"""
The limits and budgets of one request that calls a provider, from its
admission to its settlement (decisions D5, D11, D12): what svc-proxy's
routes ask of the limiter, in terms of plain values, so that any daemon
that calls providers admits and settles its calls the same way.

  - L{Admission.admit}: count the request against its organization's and
    agent's limits, reserving its tokens and worst-case cost; the
    X-RateLimit-* headers of its answer; the 429 (RATE_LIMITED or
    BUDGET_EXCEEDED) that refuses it.
  - L{Admission.settle}: correct a reservation to what the call used.
  - L{Admission.settleUsage}: the same from the provider's usage at the
    price of the model that answered, counting (and logging, at most once
    per L{OVERRUN_LOG_INTERVAL}) a cost past the worst case reserved.

Which tokens and cost a chat completion reserves is
L{svcd.limits.reservation}.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import Counter
from twisted.logger import Logger

from svcd.common.clocks import Clock
from svcd.common.errors import ApiError, ErrorCode
from svcd.common.logthrottle import ThrottledWarning
from svcd.limits.book import Applicable
from svcd.limits.check import RateDecision
from svcd.limits.keys import BUDGET, ORG
from svcd.limits.limiter import RateLimiter
from svcd.limits.records import Reservation
from svcd.metering.models import Model
from svcd.metering.usage import Usage

# At most one log line per this many seconds for settlements that passed
# their reservation (each is counted in the metric all the same).
OVERRUN_LOG_INTERVAL = 60.0


class AdmissionMetrics(Protocol):
    """
    What admission counts, on the metrics of the daemon that admits
    (svc-proxy's L{svcd.proxy.metrics.ProxyMetrics} exports them as
    C{svc_proxy_rate_limited}, C{svc_proxy_limit_refusals},
    C{svc_proxy_tokens_reserved}, C{svc_proxy_tokens_settled} and
    C{svc_proxy_reservation_overruns}): a Protocol, so that this package
    imports no daemon's metrics.
    """

    rateLimited: Counter
    tokensReserved: Counter
    tokensSettled: Counter
    reservationOverruns: Counter

    def limitRefusal(self, limit: str, scope: str) -> None:
        """
        Count one request refused by a limits row, by C{limit} and C{scope}.
        """


class Admission:
    """
    Admits requests against the limiter's counters and settles them.

    @param limiter: the counters (in Redis) and the limit book.
    @param metrics: where refusals, reservations and settlements are
        counted.
    @param clock: the time of the overruns' log throttle.
    """

    log = Logger()

    def __init__(self, limiter: RateLimiter, metrics: AdmissionMetrics, clock: Clock) -> None:
        self._limiter = limiter
        self._metrics = metrics
        # Decisions D12, amended: overruns of a budget's worst case.
        self._overruns = ThrottledWarning(self.log, clock, OVERRUN_LOG_INTERVAL)

    def applicable(self, orgID: str, agentID: str | None) -> Applicable:
        """
        The limits and budgets that apply to a caller, from memory.
        """
        return self._limiter.applicable(orgID, agentID)

    async def admit(
        self,
        orgID: str,
        agentID: str | None,
        headers: list[tuple[bytes, bytes]],
        tokens: int = 0,
        cost: int = 0,
        ledgerID: str | None = None,
        countRequest: bool = True,
    ) -> Reservation | None:
        """
        Count one request of C{orgID} (and C{agentID}) reserving C{tokens}
        and C{cost} (nano-dollars) under C{ledgerID}, and add the
        X-RateLimit-* headers of its answer to C{headers}, whatever the
        decision.

        @param countRequest: False for a call that counts against token
            limits and budgets only, never a requests limit (svc-worker's,
            decisions D13).

        @return: what the request holds until it is settled, or None when
            it holds nothing.
        @raise ApiError: 429 RATE_LIMITED or BUDGET_EXCEEDED, with
            Retry-After, past a limit.
        """
        if countRequest:
            decision = await self._limiter.hit(orgID, agentID, tokens, cost, ledgerID=ledgerID)
        else:
            decision = await self._limiter.hitTokens(orgID, agentID, tokens, cost, ledgerID)
        if decision is None:
            return None
        headers.extend(decision.headers())
        if not decision.allowed:
            self._metrics.rateLimited.inc()
            raise self._refusal(decision)
        reservation = decision.reservation
        if reservation is not None and (reservation.tokens or reservation.cost):
            self._metrics.tokensReserved.inc(reservation.tokens)
            return reservation
        return None

    def _refusal(self, decision: RateDecision) -> ApiError:
        """
        The 429 of a refused request: RATE_LIMITED, or BUDGET_EXCEEDED
        (decisions D12), saying which limit refused it and whose.
        """
        retry = [("Retry-After", str(decision.retryAfter))]
        if decision.refusedBy is None:
            return ApiError(ErrorCode.RATE_LIMITED, headers=retry)
        limit, scope = decision.refusedBy
        self._metrics.limitRefusal(limit, scope)
        whose = "organization's" if scope == ORG else "agent's"
        if limit == BUDGET:
            return ApiError(
                ErrorCode.BUDGET_EXCEEDED,
                f"The {whose} budget of this period is spent.",
                detail={"scope": scope},
                headers=retry,
            )
        return ApiError(
            ErrorCode.RATE_LIMITED,
            f"The {whose} {limit} per minute are exceeded.",
            detail={"limit": limit, "scope": scope},
            headers=retry,
        )

    def settle(self, reservation: Reservation, tokens: int, cost: int = 0) -> None:
        """
        Correct C{reservation} to C{tokens} and C{cost} (decisions D11,
        D12). The caller settles each reservation once.
        """
        self._limiter.settle(reservation, tokens, cost)
        self._metrics.tokensSettled.inc(tokens)

    def settleUsage(
        self,
        reservation: Reservation | None,
        usage: Usage,
        answered: Model,
        orgID: str | None,
        requestID: str,
        ledgerID: str,
        plus: tuple[int, int] = (0, 0),
    ) -> None:
        """
        Settle C{reservation} (if any) to the provider's C{usage}, at the
        price of the model that C{answered} (nothing without a price). A
        cost past the reservation's worst case is billed as the provider
        reported it, and counted and logged (L{_overrun}).

        @param plus: tokens and nano-dollars of a call the request made
            beside its answer under the same reservation (decisions D13: a
            recall's embedding), added to the settlement.
        """
        if reservation is None:
            return
        price = answered.price
        cost = (
            price.cost(
                usage.promptTokens,
                usage.cachedTokens,
                usage.completionTokens,
                usage.cacheWriteTokens,
            )
            if price is not None
            else 0
        ) + plus[1]
        if reservation.costKeys and cost > reservation.cost:
            self._overrun(orgID, requestID, ledgerID, reservation.cost, cost, answered)
        self.settle(reservation, usage.promptTokens + usage.completionTokens + plus[0], cost)

    def _overrun(
        self,
        orgID: str | None,
        requestID: str,
        ledgerID: str,
        reserved: int,
        cost: int,
        answered: Model,
    ) -> None:
        """
        A provider answered more than its budget's worst case allowed (it
        ignored the cap it was sent, say): the cost is billed as the
        provider reported it (the settlement and the row say so), and the
        overrun is counted and logged, at most once per interval, so an
        operator can find the model that does not honour caps.
        """
        self._metrics.reservationOverruns.inc()
        self._overruns.warn(
            "A settlement passed its reservation's worst case: {cost_nano_usd} nano-dollars"
            " billed against {reserved_nano_usd} reserved, answered by {model}",
            org_id=orgID,
            request_id=requestID,
            ledger_id=ledgerID,
            model=answered.name,
            provider=answered.provider.name,
            reserved_nano_usd=reserved,
            cost_nano_usd=cost,
        )
