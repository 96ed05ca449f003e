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
deadline, a circuit breaker (L{svcd.limits.breaker}) skips Redis for one
second, then lets one request try it, so a hung Redis costs one deadline
per second instead of one per request.
"""

from __future__ import annotations

import datetime
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import txredisapi
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IDelayedCall, IReactorTCP
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.config import RedisTarget
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.common.readiness import CheckFailed
from svcd.limits.book import NO_LIMITS, Applicable, LimitBook
from svcd.limits.breaker import CircuitBreaker, Permit
from svcd.limits.records import Budget, Reservation

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

# Decisions D11 and D12: every counter of a batch of requests of one
# organization, checked and counted in one atomic step. ARGV[1] holds the
# arguments packed in one string of comma-separated integers
# (L{packAdmitArguments}): the number of requests, then for each request the
# number of its counters followed by (key index, amount, limit, ttl) for
# each. A request is admitted only when every one of its counters has room
# for its amount, and then counts against all of them; a refused one counts
# against none. A counter with a ttl is made when missing and given that
# ttl; one without (a budget's spend, seeded from the ledger) must exist.
# ARGV[2], when not empty, holds settlements (decisions D11) waiting to be
# sent, packed the same way as pairs (key index, delta), applied first as
# C{_ADJUST_SCRIPT} does: a settlement rides on the next admission instead
# of costing a round trip of its own.
#
# Decisions D12, amended: a budget's counter K also keeps each reservation
# made with a ledger id as a member (see L{RedisRateLimiter}): K:members, a
# hash ledger id -> the amount K counts for it; K:leases, a sorted set
# ledger id -> the Redis time (ms) after which reconciliation drops it;
# K:recorded, ledger id -> the Redis time the proxy learned its row was
# committed. The optional arguments (L{LedgerWork}): ARGV[3] one ledger id
# per request ("-" for none), and each admitted request's budget counters
# get its member, leased for ARGV[6]'s first value; ARGV[4] settlements
# of members as triples (key index, ledger id, cost), each setting the
# member to its cost (K moved by the difference; a member gone, swept or
# lost with Redis, is made again and K counts its cost, so that spend is
# never forgotten before the ledger has it) and leasing it for the record
# grace (ARGV[6]'s second value); ARGV[5] pairs (key index, ledger id) of
# rows the ledger committed, marked in K:recorded. Times are Redis's own
# (TIME), so the proxies' clocks never matter. Companions are given K's
# TTL.
# Answers one string (L{parseAdmitReply}): for each request, separated by
# ";", "refused,count,...": refused is 0 when admitted, the position (from
# 1) of the first counter without room, or minus the position of the first
# counter that must be seeded; each count is the counter's value after the
# request (admitted) or as it was (refused).
#
# Why strings: txredisapi builds a command and parses a reply element by
# element in Python, which for a batch of requests with three counters each
# cost more of the proxy's time than the rest of the limiter; one argument
# and one bulk reply cost it almost nothing, and Lua splits and joins them
# in C. Amounts are added with the integers' own text (a Lua number turns
# into "1e+15" past 14 digits), counts are formatted with %d for the same
# reason: exact up to 2**53 (Lua's numbers are doubles), nine million
# dollars of a budget's period in nano-dollars.
_LEDGER_LUA = """
local nowMs = nil
local function now()
  if nowMs == nil then
    local t = redis.call('TIME')
    nowMs = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return nowMs
end
local touched = {}
local function keepTTL()
  for key in pairs(touched) do
    local ttl = redis.call('PTTL', key)
    if ttl > 0 then
      for _, suffix in ipairs({':members', ':leases', ':recorded'}) do
        if redis.call('PTTL', key .. suffix) == -1 then
          redis.call('PEXPIRE', key .. suffix, ttl)
        end
      end
    end
  end
end
local function words(text)
  local found = {}
  if text then
    for word in string.gmatch(text, '[^,]+') do
      found[#found + 1] = word
    end
  end
  return found
end
"""

_ADMIT_SCRIPT = (
    _LEDGER_LUA
    + """
local timing = words(ARGV[6])
local lease = tonumber(timing[1] or '0')
local grace = tonumber(timing[2] or '0')
if ARGV[2] and ARGV[2] ~= '' then
  local deltas = words(ARGV[2])
  for p = 1, #deltas, 2 do
    local key = KEYS[tonumber(deltas[p])]
    if redis.call('EXISTS', key) == 1 then
      redis.call('INCRBY', key, deltas[p + 1])
    end
  end
end
local settled = words(ARGV[4])
for p = 1, #settled, 3 do
  local key = KEYS[tonumber(settled[p])]
  if redis.call('EXISTS', key) == 1 then
    local id, cost = settled[p + 1], settled[p + 2]
    local members = key .. ':members'
    local held = redis.call('HGET', members, id)
    if held then
      local delta = tonumber(cost) - tonumber(held)
      if delta ~= 0 then
        redis.call('INCRBY', key, string.format('%d', delta))
      end
    else
      redis.call('INCRBY', key, cost)
    end
    redis.call('HSET', members, id, cost)
    redis.call('ZADD', key .. ':leases', string.format('%d', now() + grace), id)
    touched[key] = true
  end
end
local marks = words(ARGV[5])
for p = 1, #marks, 2 do
  local key = KEYS[tonumber(marks[p])]
  if redis.call('HEXISTS', key .. ':members', marks[p + 1]) == 1 then
    redis.call('ZADD', key .. ':recorded', string.format('%d', now()), marks[p + 1])
    touched[key] = true
  end
end
local ledgerIDs = words(ARGV[3])
local raw = {}
local args = {}
for word in string.gmatch(ARGV[1], '[^,]+') do
  raw[#raw + 1] = word
  args[#args + 1] = tonumber(word)
end
local values = {}
local present = {}
local function value(index)
  local v = values[index]
  if v == nil then
    local stored = redis.call('GET', KEYS[index])
    present[index] = stored ~= false
    v = tonumber(stored or '0')
    values[index] = v
  end
  return v
end
local results = {}
local at = 2
for request = 1, args[1] do
  local n = args[at]
  local first = at + 1
  at = first + 4 * n
  local refused = 0
  local counts = {}
  for c = 1, n do
    local base = first + 4 * (c - 1)
    local index = args[base]
    local v = value(index)
    counts[c] = v
    if refused == 0 then
      if args[base + 3] == 0 and not present[index] then
        refused = -c
      elseif v + args[base + 1] > args[base + 2] then
        refused = c
      end
    end
  end
  if refused == 0 then
    local id = ledgerIDs[request]
    if id == '-' then
      id = nil
    end
    for c = 1, n do
      local base = first + 4 * (c - 1)
      local index = args[base]
      local amount = args[base + 1]
      local ttl = args[base + 3]
      if amount > 0 then
        local v = redis.call('INCRBY', KEYS[index], raw[base + 1])
        if ttl > 0 and (v == amount or redis.call('TTL', KEYS[index]) < 0) then
          redis.call('EXPIRE', KEYS[index], ttl)
        end
        values[index] = v
        present[index] = true
      end
      if id and ttl == 0 then
        local key = KEYS[index]
        redis.call('HSET', key .. ':members', id, raw[base + 1])
        redis.call('ZADD', key .. ':leases', string.format('%d', now() + lease), id)
        touched[key] = true
      end
      counts[c] = values[index]
    end
  end
  local answer = {string.format('%d', refused)}
  for c = 1, n do
    answer[c + 1] = string.format('%d', counts[c])
  end
  results[request] = table.concat(answer, ',')
end
keepTTL()
return table.concat(results, ';')
"""
)

# Decisions D12, amended: the proxy's reservations still in flight keep
# their members: each lease pushed ARGV[1] ms past Redis's time, and a
# member that is gone (swept while this proxy could not renew, or lost
# with Redis) made again and counted in K, since its request may still
# spend it. KEYS: budget counters; ARGV[2]: triples (key index, ledger id,
# amount). A counter that is gone is left to be seeded from the ledger.
# Answers how many members were made again.
_RENEW_SCRIPT = (
    _LEDGER_LUA
    + """
local lease = tonumber(ARGV[1])
local triples = words(ARGV[2])
local made = 0
for p = 1, #triples, 3 do
  local key = KEYS[tonumber(triples[p])]
  if redis.call('EXISTS', key) == 1 then
    local id = triples[p + 1]
    if redis.call('HSETNX', key .. ':members', id, triples[p + 2]) == 1 then
      redis.call('INCRBY', key, triples[p + 2])
      made = made + 1
    end
    redis.call('ZADD', key .. ':leases', string.format('%d', now() + lease), id)
    touched[key] = true
  end
end
keepTTL()
return made
"""
)

# Decisions D12, amended: a budget's counter brought back to the ledger.
# KEYS[1]: the counter K. ARGV: t0 (Redis time in ms, taken before the
# ledger was asked), L (the ledger's spend for the period, read after t0),
# the TTL for a K that is gone. Members whose lease passed are dropped
# (an admission whose proxy died, or a settlement older than the record
# grace: its row is in L by now, or lost), and so are members whose row
# was recorded before t0 (L has it); K becomes L plus the members left,
# which are still in flight or not yet in L. A row committed between t0
# and L's reading is counted twice until the next round: the safe side.
# Answers "before,after,members": K before (-1 when gone), K after, the
# members counted.
_RECONCILE_SCRIPT = (
    _LEDGER_LUA
    + """
local key = KEYS[1]
local members, leases, recorded = key .. ':members', key .. ':leases', key .. ':recorded'
local t0 = ARGV[1]
for _, id in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', string.format('%d', now()))) do
  redis.call('HDEL', members, id)
  redis.call('ZREM', recorded, id)
end
redis.call('ZREMRANGEBYSCORE', leases, '-inf', string.format('%d', now()))
for _, id in ipairs(redis.call('ZRANGEBYSCORE', recorded, '-inf', t0)) do
  redis.call('HDEL', members, id)
  redis.call('ZREM', leases, id)
end
redis.call('ZREMRANGEBYSCORE', recorded, '-inf', t0)
local held = 0
local amounts = redis.call('HVALS', members)
for _, amount in ipairs(amounts) do
  held = held + tonumber(amount)
end
local before = redis.call('GET', key)
local after = string.format('%d', tonumber(ARGV[2]) + held)
if before then
  redis.call('SET', key, after, 'KEEPTTL')
else
  redis.call('SET', key, after, 'EX', ARGV[3])
  before = '-1'
end
touched[key] = true
keepTTL()
return before .. ',' .. after .. ',' .. string.format('%d', #amounts)
"""
)

# Redis's own time in ms: the t0 of a reconciliation.
_TIME_SCRIPT = """
local t = redis.call('TIME')
return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""


def packAdmitArguments(arguments: list[int]) -> str:
    """
    The admission script's arguments as its ARGV[1] (C{_ADMIT_SCRIPT}); its
    settlements, pairs of (key index, delta), the same way as its ARGV[2].
    """
    return ",".join(map(str, arguments))


def parseAdmitReply(reply: str | bytes) -> list[list[int]]:
    """
    The admission script's answer, one list of integers per request.
    """
    text = reply.decode("ascii") if isinstance(reply, bytes) else reply
    if not text:
        # No request: settlements sent alone.
        return []
    return [[int(word) for word in request.split(",")] for request in text.split(";")]


@attrs.frozen
class LedgerWork:
    """
    The admission script's arguments about budget members (decisions D12,
    amended; C{_ADMIT_SCRIPT}'s ARGV[3] to ARGV[6]), packed: one ledger id
    per request ("-" for none), settlements (key index, ledger id, cost),
    marks of recorded rows (key index, ledger id), and the lease and
    record grace in ms.
    """

    ledgerIDs: str = ""
    settlements: str = ""
    marks: str = ""
    timing: str = ""

    def arguments(self) -> list[str]:
        return [self.ledgerIDs, self.settlements, self.marks, self.timing]


def parseReconcileReply(reply: str | bytes) -> tuple[int, int, int]:
    """
    The reconciliation script's answer: the counter before (-1 when it was
    gone), after, and the members it still counts.
    """
    text = reply.decode("ascii") if isinstance(reply, bytes) else reply
    before, after, members = (int(word) for word in text.split(","))
    return before, after, members


# Decisions D12: a budget's spend taken again from the ledger, unless a
# proxy did it first. ARGV: the value, the ttl.
_SEED_SCRIPT = """
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) and 1 or 0
"""

# Decisions D11: token reservations settled to what the provider counted.
# ARGV: one delta per key; a key that has expired is left alone (its
# minute is long over, and a negative count must not be made).
_ADJUST_SCRIPT = """
for index, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('INCRBY', key, ARGV[index])
  end
end
return 0
"""

# What a limit is of, and whose (the 429's detail, the metrics' labels).
REQUESTS = "requests"
TOKENS = "tokens"
BUDGET = "budget"
ORG = "org"
AGENT = "agent"


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
    # budget's spend, seeded from the ledger: L{RedisRateLimiter}).
    ttl: int = KEY_TTL_SECONDS
    # When it starts again from nothing (Unix seconds): a 429's
    # Retry-After counts to it. 0: the minute's end.
    reset: int = 0


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


class RateLimiter(Protocol):
    """
    What the proxy needs of a rate limiter.
    """

    async def hit(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int = 0,
        cost: int = 0,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        """
        Count one request of C{orgID} by C{agentID}, reserving C{tokens}
        where a token limit applies and C{cost} (nano-dollars) where a
        budget does, and decide on it; C{None} when the
        limiter could not decide and the request goes on (fail open).
        Without limits rows (D11) the agent is ignored: the limit is the
        organization's (D5). With C{ledgerID} (the request's ledger row
        key, decisions D12 amended) each budget holds the reservation as a
        member of its own until the ledger has the row.
        """

    async def hitTokens(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int,
        cost: int,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        """
        As L{hit}, for a call checked and counted against token limits and
        budgets only, never against a requests limit (svc-worker's provider
        calls, decisions D13: the organization's requests per minute are
        its clients' requests); C{None} at once, without Redis, when
        neither applies.
        """

    def applicable(self, orgID: str, agentID: str | None) -> Applicable:
        """
        The limits rows that apply to a request of C{orgID} by C{agentID}.
        """

    def settle(self, reservation: Reservation, tokens: int, cost: int = 0) -> None:
        """
        Correct a reservation to the C{tokens} the provider counted and
        their C{cost} (0 releases it), in the minute and period it was
        made.
        """

    def recorded(self, ledgerIDs: Sequence[str]) -> None:
        """
        The ledger committed the rows of C{ledgerIDs} (the outbox tells,
        after svc-auth's acknowledgement): their budget members may go at
        the next reconciliation, since the ledger's spend now holds them.
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


class Spend(Protocol):
    """
    What a budget's period has cost so far, from the ledger (decisions
    D12): svc-auth's GetSpend.
    """

    def __call__(
        self, orgID: str, agentID: str | None, since: int, until: int
    ) -> Deferred[int]: ...


class Gauge(Protocol):
    """
    What the limiter uses of a Prometheus gauge.
    """

    def set(self, value: float) -> None: ...


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
class _Unchecked:
    """
    What a shared call answers a hit it could not check, and why.
    """

    reason: str


_SKIPPED = _Unchecked(UNCHECKED_BREAKER_OPEN)
_FAILED = _Unchecked(UNCHECKED_REDIS_FAILED)


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

    def admit(
        self,
        keys: list[str],
        arguments: list[int],
        adjustments: list[int] | None = None,
        ledger: LedgerWork | None = None,
    ) -> Deferred[list[list[int]]]:
        """
        Run the admission script (C{_ADMIT_SCRIPT}) over C{keys} with
        C{arguments}; fires with its answer for each request.
        """

    def renew(self, keys: list[str], leaseMs: int, triples: str) -> Deferred[object]:
        """
        Push the leases of members still in flight (C{_RENEW_SCRIPT}).
        """

    def reconcile(self, key: str, t0: int, spent: int, ttl: int) -> Deferred[tuple[int, int, int]]:
        """
        Bring a budget's counter back to the ledger (C{_RECONCILE_SCRIPT}).
        """

    def redisTime(self) -> Deferred[int]:
        """
        Redis's own time, in ms.
        """

    def adjust(self, keys: list[str], deltas: list[int]) -> Deferred[object]:
        """
        Add each delta to its key, where the key still exists.
        """

    def seed(self, key: str, value: int, ttl: int) -> Deferred[object]:
        """
        Set C{key} to C{value} for C{ttl} seconds unless it exists.
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

    def admit(
        self,
        keys: list[str],
        arguments: list[int],
        adjustments: list[int] | None = None,
        ledger: LedgerWork | None = None,
    ) -> Deferred[list[list[int]]]:
        packed = [packAdmitArguments(arguments), packAdmitArguments(adjustments or [])]
        if ledger is not None:
            packed += ledger.arguments()
        reply: Deferred[str | bytes] = self._factory.handler.eval(_ADMIT_SCRIPT, keys, packed)
        return reply.addCallback(parseAdmitReply)

    def renew(self, keys: list[str], leaseMs: int, triples: str) -> Deferred[object]:
        result: Deferred[object] = self._factory.handler.eval(
            _RENEW_SCRIPT, keys, [leaseMs, triples]
        )
        return result

    def reconcile(self, key: str, t0: int, spent: int, ttl: int) -> Deferred[tuple[int, int, int]]:
        reply: Deferred[str | bytes] = self._factory.handler.eval(
            _RECONCILE_SCRIPT, [key], [t0, spent, ttl]
        )
        return reply.addCallback(parseReconcileReply)

    def redisTime(self) -> Deferred[int]:
        result: Deferred[int] = self._factory.handler.eval(_TIME_SCRIPT, [], [])
        return result

    def adjust(self, keys: list[str], deltas: list[int]) -> Deferred[object]:
        result: Deferred[object] = self._factory.handler.eval(_ADJUST_SCRIPT, keys, deltas)
        return result

    def seed(self, key: str, value: int, ttl: int) -> Deferred[object]:
        result: Deferred[object] = self._factory.handler.eval(_SEED_SCRIPT, [key], [value, ttl])
        return result

    def ping(self) -> Deferred[object]:
        result: Deferred[object] = self._factory.handler.ping()
        return result


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


@attrs.define(eq=False)
class _BudgetUse:
    """
    A budget counter this proxy used lately (decisions D12, amended): whose
    it is, its limit, and when it was last used, so that reconciliation
    visits it while it matters.
    """

    orgID: str
    agentID: str | None
    limit: int
    lastUsed: float


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

    With limits rows (decisions D11, L{LimitBook}) a request has up to four
    counters (its organization's requests and tokens, its agent's requests
    and tokens), all checked and counted in one script call
    (C{_ADMIT_SCRIPT}) so that no replica can admit past any of them; the
    requests of one organization share calls the same way, one call
    checking each of them in the order they came. An organization and
    agent without rows are counted exactly as D5 says, above.

    Budgets converge to the ledger (decisions D12, amended). A budget's
    counter K stays one integer, so admission is one GET and one INCRBY;
    beside it each reservation made with a ledger id is a member (its
    amount in K:members, a lease in K:leases, in Redis's time). While its
    request is in flight this proxy renews the lease every C{lease}/3
    seconds; its settlement sets the member to the cost and leases it for
    C{recordGrace}; once the outbox says the ledger committed the row
    (L{recorded}) the member is marked in K:recorded. Every
    C{reconcileInterval} (with jitter) each budget counter used lately is
    set to the ledger's spend plus its members left, after dropping those
    whose lease passed (a proxy killed mid-request, a settlement older
    than the grace) and those recorded before the ledger was read. So
    spend admitted while Redis was away is added, a lost settlement is
    released within a lease and a round, and a stale restore is corrected,
    with at most a row counted twice for a round (the safe side).

    @param clock: the time source for windows, the timer of the Redis
        budget and the circuit breaker; tests pass a
        L{twisted.internet.task.Clock}.
    @param circuitOpen: the gauge C{svc_proxy_ratelimit_circuit_open}, set
        to 1 while the breaker skips Redis and to 0 once it closes.
    @param openSeconds: how long the breaker skips Redis after a failure.
    @param settleDelay: how long a settlement waits, when no admission
        call is in flight, for one to ride on before it is sent alone:
        under load the next comes within a millisecond, and a count that
        is corrected a few milliseconds later changes nothing that
        matters. 0: alone at once.
    @param unchecked: the counter C{svc_proxy_unchecked_admissions_total}
        (label C{reason}): every request let through without checking a
        limit or a budget.
    @param lease: seconds a member of a request in flight is kept without
        renewal (SVC_BUDGET_LEASE).
    @param recordGrace: seconds a settled member is kept without its row
        being recorded (SVC_BUDGET_RECORD_GRACE); also how long this proxy
        remembers a settled reservation's counters for L{recorded}.
    @param reconcileInterval: seconds between reconciliations
        (SVC_BUDGET_RECONCILE_INTERVAL); 0 turns them off.
    @param random: a number in [0, 1) for the jitter of reconciliations.
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
        book: LimitBook | None = None,
        spend: Spend | None = None,
        settleDelay: float = 0.01,
        unchecked: LabelledCounter | None = None,
        lease: float = 30.0,
        recordGrace: float = 300.0,
        reconcileInterval: float = 30.0,
        random: Callable[[], float] = random.random,
    ) -> None:
        self._counters = counters
        self._settleDelay = settleDelay
        self._settleTimer: IDelayedCall | None = None
        self._book = book if book is not None else LimitBook()
        # Decisions D12: what a budget's period has cost, from the ledger,
        # when Redis has no count of it.
        self._spend = spend
        self._seeding: dict[str, Deferred[None]] = {}
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
        # Settlements (D11) not yet sent, by key, and the call in flight.
        self._adjustments: dict[str, int] = {}
        self._adjusting: Deferred[object] | None = None
        # Admission calls in flight: while there is one, settlements wait
        # to ride on the next (see L{settle}).
        self._admitting = 0
        # Decisions D12, amended: fail-open counted, by reason.
        self._uncheckedCounter = unchecked
        self._uncheckedChildren: dict[str, Incrementable] = {}
        # Budget members (see the class docstring): the settlements of
        # members and the marks of recorded rows not yet sent, by (key,
        # ledger id); this proxy's reservations in flight (ledger id ->
        # cost keys, amount, when admitted), whose leases it renews; the
        # settled ones it remembers for L{recorded} (ledger id -> cost
        # keys, when settled; oldest first); the budget counters it used.
        self._lease = lease
        self._recordGrace = recordGrace
        self._timing = f"{round(lease * 1000)},{round(recordGrace * 1000)}"
        self._memberSettlements: dict[tuple[str, str], int] = {}
        self._marks: dict[tuple[str, str], None] = {}
        # When a failed call's settlements may go alone again.
        self._retryAt = 0.0
        # What the last call made took of those (L{_takeSettlements}).
        self._sending: tuple[dict[tuple[str, str], int], dict[tuple[str, str], None]] = ({}, {})
        self._inFlight: dict[str, tuple[tuple[str, ...], int, float]] = {}
        self._settled: dict[str, tuple[tuple[str, ...], float]] = {}
        self._budgets: dict[str, _BudgetUse] = {}
        self._reconcileInterval = reconcileInterval
        self._random = random
        self._renewals: LoopingCall | None = None
        self._renewing: Deferred[object] | None = None
        self._reconcileTimer: IDelayedCall | None = None
        self._reconciling: Deferred[None] | None = None
        self._lastCorrectionLog: float | None = None
        self._correctionsUnlogged = 0
        # Budget counters set from the ledger, and those among them whose
        # correction was large (tests and operators' curiosity).
        self.reconciled = 0
        self.corrections = 0

    def limitFor(self, orgID: str) -> int:
        """
        Requests per minute allowed to C{orgID} by the environment.
        """
        return self._orgRPM.get(orgID, self._defaultRPM)

    def applicable(self, orgID: str, agentID: str | None) -> Applicable:
        return self._book.applicable(orgID, agentID)

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

    async def hit(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int = 0,
        cost: int = 0,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        return await self._hit(orgID, agentID, tokens, cost, ledgerID, True)

    async def hitTokens(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int,
        cost: int,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        return await self._hit(orgID, agentID, tokens, cost, ledgerID, False)

    async def _hit(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int,
        cost: int,
        ledgerID: str | None,
        countRequest: bool,
    ) -> RateDecision | None:
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
        count = await self._join(f"ratelimit:{orgID}:{windowStart}", None)
        if self._news is not None:
            self._announce(self._news)
        if isinstance(count, _Unchecked):
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
            counts: list[int] | _Unchecked = await self._join(f"admit:{orgID}", counters, ledgerID)
            if self._news is not None:
                self._announce(self._news)
            if isinstance(counts, _Unchecked):
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
                        self._inFlight[ledgerID] = (reservation.costKeys, reservation.cost, now)
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
        orgKey = f"ratelimit:{orgID}:{windowStart}"
        counters = [Counter(orgKey, 1, rpm, REQUESTS, ORG)] if countRequest else []
        if org is not None and org.tpm is not None:
            counters.append(Counter(orgKey + ":tokens", reserved, org.tpm, TOKENS, ORG))
        if applicable.orgBudget is not None:
            budget = _budgetCounter(orgID, None, applicable.orgBudget, cost, ORG, now)
            self._used(budget, orgID, None, now)
            counters.append(budget)
        agentKey = f"{orgKey}:agent:{agentID}"
        if countRequest and agent is not None and agent.rpm is not None:
            counters.append(Counter(agentKey, 1, agent.rpm, REQUESTS, AGENT))
        if agent is not None and agent.tpm is not None:
            counters.append(Counter(agentKey + ":tokens", reserved, agent.tpm, TOKENS, AGENT))
        if applicable.agentBudget is not None:
            budget = _budgetCounter(orgID, agentID, applicable.agentBudget, cost, AGENT, now)
            self._used(budget, orgID, agentID, now)
            counters.append(budget)
        return tuple(counters)

    def _used(self, budget: Counter, orgID: str, agentID: str | None, now: float) -> None:
        if self._reconcileInterval <= 0:
            # Nothing would visit (or forget) it.
            return
        use = self._budgets.get(budget.key)
        if use is None:
            self._budgets[budget.key] = _BudgetUse(orgID, agentID, budget.limit, now)
        else:
            use.limit = budget.limit
            use.lastUsed = now

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
            seeding.addBoth(_passing(lambda: self._seeding.pop(counter.key, None)))
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
        since, until = _budgetPeriod(counter.key, now)
        spent = await self._spend(orgID, agentID, since, until)
        await timeoutDeferred(
            self._counters.seed(counter.key, spent, until - int(now) + _BUDGET_KEY_SLACK),
            self._timeout,
            asReactorTime(self._clock),
        )

    def settle(self, reservation: Reservation, tokens: int, cost: int = 0) -> None:
        changed = False
        delta = tokens - reservation.tokens
        if delta:
            changed = True
            for key in reservation.keys:
                self._adjustments[key] = self._adjustments.get(key, 0) + delta
        ledgerID = reservation.ledgerID
        if ledgerID is not None and reservation.costKeys:
            # The member is set to the cost, even an unchanged one: its
            # lease becomes the record grace, so that it stays counted
            # until the ledger has the row.
            changed = True
            self._inFlight.pop(ledgerID, None)
            now = self._clock.seconds()
            for key in reservation.costKeys:
                self._memberSettlements[key, ledgerID] = cost
                # Reconciled for a while yet: the member goes once its row
                # is recorded, which only a reconciliation does.
                use = self._budgets.get(key)
                if use is not None:
                    use.lastUsed = now
            self._rememberSettled(ledgerID, reservation.costKeys, now)
        elif cost - reservation.cost:
            changed = True
            for key in reservation.costKeys:
                self._adjustments[key] = self._adjustments.get(key, 0) + cost - reservation.cost
        if changed:
            self._settleSoon()

    def _rememberSettled(self, ledgerID: str, costKeys: tuple[str, ...], now: float) -> None:
        """
        Keep a settled reservation's counters for L{recorded}, for the
        record grace at most (oldest forgotten first): its member is
        dropped by then anyway.
        """
        self._settled[ledgerID] = (costKeys, now)
        settled = self._settled
        while settled:
            oldest = next(iter(settled))
            if now - settled[oldest][1] <= self._recordGrace:
                break
            del settled[oldest]

    def recorded(self, ledgerIDs: Sequence[str]) -> None:
        marked = False
        for ledgerID in ledgerIDs:
            settled = self._settled.pop(ledgerID, None)
            if settled is None:
                continue
            for key in settled[0]:
                self._marks[key, ledgerID] = None
            marked = True
        if marked:
            self._settleSoon()

    def _hasSettlements(self) -> bool:
        return bool(self._adjustments or self._memberSettlements or self._marks)

    def _settleSoon(self) -> None:
        """
        Have the settlements waiting sent: by the next admission call, in
        flight or coming within C{settleDelay}, else alone.
        """
        if self._adjusting is not None or self._admitting or self._settleTimer is not None:
            return
        delay = max(self._settleDelay, self._retryAt - self._clock.seconds())
        if delay <= 0:
            self._sendAdjustments()
            return
        self._settleTimer = asReactorTime(self._clock).callLater(delay, self._settleAlone)

    def _settleAlone(self) -> None:
        self._settleTimer = None
        if self._hasSettlements() and self._adjusting is None and not self._admitting:
            self._sendAdjustments()

    def _admitted(self) -> None:
        """
        An admission call ended. Under load the next one follows at once
        and takes the settlements that came meanwhile; when none is sent
        (this was the last), they go on their own.
        """
        self._admitting -= 1
        if self._hasSettlements() and not self._admitting:
            self._settleSoon()

    def _takeSettlements(self, keys: list[str]) -> tuple[list[int], str, str]:
        """
        Every settlement waiting, as the admission script's arguments over
        C{keys} (extended with the keys they need): the per-key deltas,
        the members' settlements, the marks of recorded rows. The members'
        settlements and marks taken are kept in L{_sending} until the
        call's outcome: both are idempotent (a member set to its cost, a
        row marked), so a call that failed, or missed its deadline and
        perhaps did run, has them sent again (L{_sendAgain}).
        """
        where = {each: index for index, each in enumerate(keys, 1)}

        def indexOf(key: str) -> int:
            index = where.get(key)
            if index is None:
                keys.append(key)
                index = where[key] = len(keys)
            return index

        adjustments: list[int] = []
        if self._adjustments:
            waiting, self._adjustments = self._adjustments, {}
            for adjusted, delta in waiting.items():
                if delta:
                    adjustments += (indexOf(adjusted), delta)
        settlements = ""
        members: dict[tuple[str, str], int] = {}
        if self._memberSettlements:
            members, self._memberSettlements = self._memberSettlements, {}
            settlements = ",".join(
                f"{indexOf(key)},{ledgerID},{cost}" for (key, ledgerID), cost in members.items()
            )
        marks = ""
        marked: dict[tuple[str, str], None] = {}
        if self._marks:
            marked, self._marks = self._marks, {}
            marks = ",".join(f"{indexOf(key)},{ledgerID}" for key, ledgerID in marked)
        self._sending = (members, marked)
        return adjustments, settlements, marks

    def _sendAgain(
        self,
        failure: Failure,
        sent: tuple[dict[tuple[str, str], int], dict[tuple[str, str], None]],
    ) -> Failure:
        """
        A call carrying members' settlements or marks failed: they wait
        for the next call (a newer settlement of the same member wins).
        While Redis is not connected they are dropped instead (L{
        _sendAdjustments}): the leases and reconciliation heal that.
        """
        members, marked = sent
        for member, cost in members.items():
            self._memberSettlements.setdefault(member, cost)
        for mark in marked:
            self._marks.setdefault(mark, None)
        # Not at once: a Redis that answers errors must not be asked again
        # in a loop. They ride on the next admission meanwhile.
        self._retryAt = self._clock.seconds() + self._openSeconds
        return failure

    def _sendAdjustments(self) -> None:
        """
        Send every settlement waiting, in one call; those that come while
        it is in flight go in the next. Off the request's path: a failed
        call leaves its reservations counted as they were (the safe side;
        members are released by their leases and reconciliation).
        """
        if not self._hasSettlements():
            return
        if not self._counters.connected:
            self._adjustments, self._memberSettlements, self._marks = {}, {}, {}
            return
        keys: list[str] = []
        adjustments, settlements, marks = self._takeSettlements(keys)
        request: Deferred[object]
        if settlements or marks:
            request = self._counters.admit(
                keys,
                [0],
                adjustments,
                LedgerWork("", settlements, marks, self._timing),
            ).addCallback(lambda _: None)
        elif adjustments:
            request = self._counters.adjust(keys, adjustments[1::2])
        else:
            return
        call = self._adjusting = timeoutDeferred(request, self._timeout, asReactorTime(self._clock))
        call.addErrback(self._sendAgain, self._sending)
        call.addErrback(self._adjustFailed, len(keys))
        call.addBoth(self._adjusted)

    def _adjustFailed(self, failure: Failure, keys: int) -> None:
        self._unavailable.warn(
            "Redis did not take the settlements of {keys} counters ({error_type}); token"
            " reservations stay counted, budget members are sent again",
            keys=keys,
            error_type=type(failure.value).__name__,
        )

    def _adjusted(self, result: object) -> None:
        self._adjusting = None
        if self._hasSettlements() and not self._admitting:
            self._settleSoon()

    # Budget members kept in flight, and reconciliation (D12, amended).

    def _renew(self) -> None:
        """
        Push the leases of this proxy's reservations in flight: one call
        per round, or one per L{_RENEWALS_PER_CALL} members for a proxy
        holding more (so that no call keeps Redis from the admissions of
        every proxy for long); a reservation held past
        L{_MAX_HOLD_SECONDS} (one whose settlement never came) is left to
        its lease.
        """
        if not self._inFlight or self._renewing is not None or not self._counters.connected:
            return
        now = self._clock.seconds()
        members: list[tuple[str, str, int]] = []
        for ledgerID, (costKeys, amount, since) in list(self._inFlight.items()):
            if now - since > _MAX_HOLD_SECONDS:
                del self._inFlight[ledgerID]
                continue
            members += ((key, ledgerID, amount) for key in costKeys)
        if not members:
            return
        renewing = self._renewing = Deferred.fromCoroutine(self._renewAll(members))
        renewing.addErrback(self._backgroundFailed, "renew the leases of requests in flight")
        renewing.addBoth(_passing(self._renewed))

    async def _renewAll(self, members: list[tuple[str, str, int]]) -> None:
        leaseMs = round(self._lease * 1000)
        for start in range(0, len(members), _RENEWALS_PER_CALL):
            keys: list[str] = []
            where: dict[str, int] = {}
            triples: list[str] = []
            for key, ledgerID, amount in members[start : start + _RENEWALS_PER_CALL]:
                index = where.get(key)
                if index is None:
                    keys.append(key)
                    index = where[key] = len(keys)
                triples.append(f"{index},{ledgerID},{amount}")
            await timeoutDeferred(
                self._counters.renew(keys, leaseMs, ",".join(triples)),
                max(self._timeout, _BACKGROUND_TIMEOUT),
                asReactorTime(self._clock),
            )

    def _renewed(self) -> None:
        self._renewing = None

    def _backgroundFailed(self, failure: Failure, what: str) -> None:
        self._unavailable.warn(
            "Redis could not {what} ({error_type}); tried again at the next round",
            what=what,
            error_type=type(failure.value).__name__,
        )

    def _scheduleReconciliation(self) -> None:
        if self._reconcileInterval <= 0:
            return
        # Between 3/4 of the interval and the whole: proxies spread out, and
        # no two rounds are ever further apart than the interval (the bound
        # the operator set, and the one the release of a lost settlement
        # is promised within).
        delay = self._reconcileInterval * (0.75 + 0.25 * self._random())
        self._reconcileTimer = asReactorTime(self._clock).callLater(delay, self._reconcileDue)

    def _reconcileDue(self) -> None:
        self._reconcileTimer = None
        if self._reconciling is None:
            self._reconciling = self.reconcile()
            self._reconciling.addBoth(_passing(self._reconcileEnded))
        self._scheduleReconciliation()

    def _reconcileEnded(self) -> None:
        self._reconciling = None

    def reconcile(self) -> Deferred[None]:
        """
        One round: each budget counter this proxy used within the record
        grace and two intervals (or holds a reservation in flight in) set
        to the ledger's spend plus its members left. Fires when done;
        never fails.
        """
        return Deferred.fromCoroutine(self._reconcileAll())

    async def _reconcileAll(self) -> None:
        now = self._clock.seconds()
        # A counter is visited while a member of this proxy's making may be
        # in it: in flight (holding), or settled within the record grace.
        horizon = now - self._recordGrace - _RECENT_ROUNDS * self._reconcileInterval
        holding = {key for costKeys, _, _ in self._inFlight.values() for key in costKeys}
        for key, use in list(self._budgets.items()):
            start, end = _periodOfKey(key)
            if end + _BUDGET_KEY_SLACK < now or (use.lastUsed < horizon and key not in holding):
                del self._budgets[key]
                continue
            if self._spend is None or not self._counters.connected or self._breaker.isOpen:
                return
            try:
                await self._reconcileOne(key, use, start, end, now)
            except CancelledError:
                raise
            except Exception as error:
                self._unavailable.warn(
                    "A budget's counter could not be reconciled with the ledger ({error_type});"
                    " it stays as it is until the next round",
                    error_type=type(error).__name__,
                )

    async def _reconcileOne(
        self, key: str, use: _BudgetUse, start: int, end: int, now: float
    ) -> None:
        assert self._spend is not None
        reactorTime = asReactorTime(self._clock)
        deadline = max(self._timeout, _BACKGROUND_TIMEOUT)
        # t0 before the ledger is read: a row recorded before t0 is in L.
        t0 = await timeoutDeferred(self._counters.redisTime(), deadline, reactorTime)
        spent = await self._spend(use.orgID, use.agentID, start, end)
        ttl = max(1, end - int(now) + _BUDGET_KEY_SLACK)
        before, after, members = await timeoutDeferred(
            self._counters.reconcile(key, int(t0), spent, ttl), deadline, reactorTime
        )
        self.reconciled += 1
        correction = after - before if before >= 0 else after
        if before >= 0 and abs(correction) * _LARGE_CORRECTION < max(use.limit, 1):
            return
        self.corrections += 1
        now = self._clock.seconds()
        if self._lastCorrectionLog is not None and now - self._lastCorrectionLog < 10.0:
            self._correctionsUnlogged += 1
            return
        self._lastCorrectionLog = now
        unlogged, self._correctionsUnlogged = self._correctionsUnlogged, 0
        self.log.info(
            "A budget's counter was set to the ledger's spend plus {members} reservations"
            " still counted: {before} -> {after} nano-dollars (-1: it was gone); {unlogged}"
            " more large corrections since the last line",
            members=members,
            before=before,
            after=after,
            spent=spent,
            unlogged=unlogged,
        )

    # Shared calls (see the class docstring).

    def _join(
        self, key: str, counters: tuple[Counter, ...] | None, ledgerID: str | None = None
    ) -> Deferred[Any]:
        """
        This hit's count in C{key} (or, with C{counters}, the admission
        script's answer for it), or an L{_Unchecked} when Redis is skipped
        or fails (fail open).
        """
        calls = self._calls.get(key)
        if calls is None:
            calls = self._calls[key] = _KeyCalls()
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
        if admissions is not None:
            keys, arguments = _admitArguments([counters for counters, _ in admissions])
            # Settlements waiting ride on this call (C{_ADMIT_SCRIPT}).
            adjustments, settlements, marks = self._takeSettlements(keys)
            ledger = None
            if settlements or marks or any(ledgerID for _, ledgerID in admissions):
                ledger = LedgerWork(
                    ",".join(ledgerID or "-" for _, ledgerID in admissions),
                    settlements,
                    marks,
                    self._timing,
                )
            self._admitting += 1
            request = self._counters.admit(keys, arguments, adjustments, ledger)
        else:
            request = self._counters.increment(key, len(hits), KEY_TTL_SECONDS)
        call = calls.call = timeoutDeferred(request, self._timeout, asReactorTime(self._clock))
        if admissions is not None and (self._sending[0] or self._sending[1]):
            call.addErrback(self._sendAgain, self._sending)
        call.addCallbacks(
            self._counted,
            self._failed,
            callbackArgs=(key, calls, permit, hits),
            errbackArgs=(key, calls, permit, hits),
        )
        if admissions is not None:
            # After _counted or _failed, which send the next call of the
            # organization, if any, first.
            call.addBoth(_passing(self._admitted))

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

    def checkReady(self) -> Deferred[None]:
        # Straight to Redis, past the breaker: /ready reports the truth.
        if not self._counters.connected:
            return fail(CheckFailed("not connected to Redis"))

        def answered(reply: object) -> None:
            return None

        return self._counters.ping().addCallback(answered)

    def start(self) -> None:
        self._counters.start()
        if self._lease > 0:
            self._renewals = LoopingCall(self._renew)
            self._renewals.clock = asReactorTime(self._clock)
            self._renewals.start(self._lease / 3, now=False)
        self._scheduleReconciliation()

    def stop(self) -> Deferred[None]:
        if self._renewals is not None and self._renewals.running:
            self._renewals.stop()
        self._renewals = None
        if self._reconcileTimer is not None and self._reconcileTimer.active():
            self._reconcileTimer.cancel()
        self._reconcileTimer = None
        # The settlements still waiting go first, so that a stop does not
        # leave reservations counted until their minute ends.
        if self._settleTimer is not None and self._settleTimer.active():
            self._settleTimer.cancel()
        self._settleTimer = None
        if self._hasSettlements() and self._adjusting is None:
            self._sendAdjustments()
        adjusting = self._adjusting
        if adjusting is None:
            return self._counters.stop()
        flushed: Deferred[None] = Deferred()
        adjusting.addBoth(lambda _: flushed.callback(None))
        return flushed.addCallback(lambda _: self._counters.stop())

    def connected(self) -> bool:
        """
        Is the connection to Redis up? (What a starting proxy waits for
        before it listens.)
        """
        return self._counters.connected


# Stands in for a hit withdrawn after its call was sent.
_WITHDRAWN: Deferred[Any] = succeed(None)


def _fire(hits: list[Deferred[Any]], count: Callable[[int], object]) -> None:
    for index, hit in enumerate(hits):
        if not hit.called:
            hit.callback(count(index))


def _admitArguments(admissions: list[tuple[Counter, ...]]) -> tuple[list[str], list[int]]:
    """
    The keys and arguments of C{_ADMIT_SCRIPT} for these requests.
    """
    keys: list[str] = []
    where: dict[str, int] = {}
    arguments = [len(admissions)]
    for counters in admissions:
        arguments.append(len(counters))
        for counter in counters:
            index = where.get(counter.key)
            if index is None:
                keys.append(counter.key)
                index = where[counter.key] = len(keys)
            arguments += (index, counter.amount, counter.limit, counter.ttl)
    return keys, arguments


# A budget key outlives its period by this much (seconds), so a settlement
# arriving just after the period's end still finds it.
_BUDGET_KEY_SLACK = 3600
# Seeding a budget and asking again, at most this many times a request.
_SEED_ATTEMPTS = 3
# Decisions D12, amended: a budget counter is reconciled until the record
# grace and this many rounds have passed since this proxy last used it (or
# while it holds a reservation of it in flight).
_RECENT_ROUNDS = 2
# A reservation whose settlement has not come after this many seconds is
# no longer renewed (its request cannot still run: the edge settles every
# reservation, and upstream timeouts are minutes): its lease releases it.
_MAX_HOLD_SECONDS = 3600.0
# Members renewed by one call at most (a few ms of Redis).
_RENEWALS_PER_CALL = 2000
# Deadline of the calls off the request's path (renewals, reconciliation).
_BACKGROUND_TIMEOUT = 2.0
# A correction larger than 1/this of the budget is logged.
_LARGE_CORRECTION = 100


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
    key = f"budget:{orgID}:{period}:{start}"
    return key if agentID is None else f"{key}:agent:{agentID}"


def _budgetPeriod(key: str, now: float) -> tuple[int, int]:
    # budget:<org>:<period>:<start>[:agent:<agent>]
    return budgetPeriod(key.split(":")[2], now)


def _periodOfKey(key: str) -> tuple[int, int]:
    """
    The period a budget counter counts (from its key's start, whatever
    the time now).
    """
    parts = key.split(":")
    return budgetPeriod(parts[2], int(parts[3]))


def _budgetCounter(
    orgID: str, agentID: str | None, budget: Budget, cost: int, scope: str, now: float
) -> Counter:
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


def _passing(action: Callable[[], object]) -> Callable[[object], object]:
    def passing(result: object) -> object:
        action()
        return result

    return passing


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


class DisabledRateLimiter:
    """
    The limiter when REDIS_URL is empty: every request goes on without
    X-RateLimit-* headers, and /ready reports redis as failed.
    """

    log = Logger()

    def __init__(self, clock: Clock, warnInterval: float = 60.0) -> None:
        self._notConfigured = ThrottledWarning(self.log, clock, warnInterval)

    async def hit(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int = 0,
        cost: int = 0,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        self._notConfigured.warn("REDIS_URL is not configured; rate limiting is off")
        return None

    async def hitTokens(
        self,
        orgID: str,
        agentID: str | None,
        tokens: int,
        cost: int,
        ledgerID: str | None = None,
    ) -> RateDecision | None:
        return await self.hit(orgID, agentID, tokens, cost, ledgerID)

    def applicable(self, orgID: str, agentID: str | None) -> Applicable:
        return NO_LIMITS

    def settle(self, reservation: Reservation, tokens: int, cost: int = 0) -> None:
        pass

    def recorded(self, ledgerIDs: Sequence[str]) -> None:
        pass

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
    book: LimitBook | None = None,
    spend: Spend | None = None,
    timeout: float = 0.1,
    unchecked: LabelledCounter | None = None,
    lease: float = 30.0,
    recordGrace: float = 300.0,
    reconcileInterval: float = 30.0,
) -> RedisRateLimiter | DisabledRateLimiter:
    """
    The limiter for a configuration: over Redis when REDIS_URL is set.
    """
    if target is None:
        return DisabledRateLimiter(clock)
    return RedisRateLimiter(
        RedisLink(reactor, target),
        clock,
        defaultRPM,
        orgRPM,
        circuitOpen=circuitOpen,
        book=book,
        spend=spend,
        timeout=timeout,
        unchecked=unchecked,
        lease=lease,
        recordGrace=recordGrace,
        reconcileInterval=reconcileInterval,
    )
