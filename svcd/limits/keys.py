"""
What the limiter counts in Redis, and under which keys (decisions D5,
D11, D12, D16): a calendar minute's requests and tokens,
C{ratelimit:{<org_id>}:<window_start_unix_seconds>} (C{:tokens} after it
for the tokens, C{:agent:<agent_id>} for an agent's), and a budget's
calendar day or month,
C{budget:{<org_id>}:<period>:<start>[:agent:<agent_id>]}; L{Counter}, one
of them as a request is checked against it.

The organization is in braces, Redis Cluster's hash tag (D16): every key
of one organization, and the companions the scripts derive from them
(C{:members}, C{:leases}, C{:recorded}), hash to one slot, so that each
script call over one organization's keys runs on one Cluster node.

It imports nothing of the limiter but the shapes of the limit book
(L{svcd.limits.records}), so that the scripts (L{svcd.limits.scripts}) and
every part of the limiter can name these.
"""

from __future__ import annotations

import datetime

import attrs

from svcd.limits.records import Budget

WINDOW_SECONDS = 60
# Longer than the window so a counter outlives any clock skew between
# proxies sharing it; the window start in the key keeps windows apart.
KEY_TTL_SECONDS = 2 * WINDOW_SECONDS

# What a limit is of, and whose (the 429's detail, the metrics' labels).
REQUESTS = "requests"
TOKENS = "tokens"
BUDGET = "budget"
ORG = "org"
AGENT = "agent"

# A budget key outlives its period by this much (seconds), so a settlement
# arriving just after the period's end still finds it.
BUDGET_KEY_SLACK = 3600


@attrs.frozen
class Counter:
    """
    One counter a request is checked against and counted in: its Redis
    key, what the request adds (1 request, or its tokens), the limit, and
    what it limits.
    """

    key: str
    amount: int
    limit: int
    kind: str
    scope: str
    # Seconds the counter lives once made; 0 for one that must exist (a
    # budget's spend, seeded from the ledger: L{svcd.limits.check}).
    ttl: int = KEY_TTL_SECONDS
    # When it starts again from nothing (Unix seconds): a 429's
    # Retry-After counts to it. 0: the minute's end.
    reset: int = 0


def minuteKey(orgID: str, windowStart: int) -> str:
    """
    The key of an organization's requests in the minute that starts at
    C{windowStart} (decisions D5: the org id second, as the
    specification's tenancy rule asks; in braces, D16).
    """
    return f"ratelimit:{{{orgID}}}:{windowStart}"


def budgetPeriod(period: str, now: float) -> tuple[int, int]:
    """
    The calendar day or month (UTC) that holds C{now}: its start and its
    end, in Unix seconds.
    """
    # Every budgeted request asks; the calendar is worked out once a day.
    day = int(now) // 86400
    cached = _periods.get((period, day))
    if cached is None:
        if len(_periods) > 64:
            _periods.clear()
        cached = _periods[period, day] = _calendarPeriod(period, day * 86400)
    return cached


# (period, day number) -> the period's start and end (L{budgetPeriod}).
_periods: dict[tuple[str, int], tuple[int, int]] = {}


def _calendarPeriod(period: str, now: int) -> tuple[int, int]:
    moment = datetime.datetime.fromtimestamp(now, datetime.UTC)
    if period == "day":
        start = moment.replace(hour=0, minute=0, second=0)
        end = start + datetime.timedelta(days=1)
    else:
        start = moment.replace(day=1, hour=0, minute=0, second=0)
        end = (start + datetime.timedelta(days=32)).replace(day=1)
    return int(start.timestamp()), int(end.timestamp())


def _budgetKey(orgID: str, agentID: str | None, period: str, start: int) -> str:
    key = f"budget:{{{orgID}}}:{period}:{start}"
    return key if agentID is None else f"{key}:agent:{agentID}"


def budgetPeriodAt(key: str, now: float) -> tuple[int, int]:
    """
    The period of a budget counter's kind (day or month) that holds
    C{now}.
    """
    # budget:{<org>}:<period>:<start>[:agent:<agent>]
    return budgetPeriod(key.split(":")[2], now)


def periodOfKey(key: str) -> tuple[int, int]:
    """
    The period a budget counter counts (from its key's start, whatever
    the time now).
    """
    parts = key.split(":")
    return budgetPeriod(parts[2], int(parts[3]))


def budgetCounter(
    orgID: str, agentID: str | None, budget: Budget, cost: int, scope: str, now: float
) -> Counter:
    """
    The counter of C{budget} (the organization's, or its agent's) for
    the period that holds C{now}, to which a request adds C{cost}.
    """
    start, end = budgetPeriod(budget.period, now)
    return Counter(
        _budgetKey(orgID, agentID, budget.period, start),
        cost,
        budget.nanoUSD,
        BUDGET,
        scope,
        ttl=0,
        reset=end,
    )
