"""
The limiter's scripts in Redis (decisions D5, D11, D12): the Lua that
counts, admits, settles, renews and reconciles, each one atomic step, the
packing of their arguments and the parsing of their answers.

Each request costs at most one call of L{ADMIT_SCRIPT} (or of
L{INCREMENT_SCRIPT} for an organization without limits rows), and
settlements ride on it; the other scripts run off the request's path.
L{svcd.limits.link.RedisLink} sends them (with EVALSHA once cached).
"""

from __future__ import annotations

import attrs

from svcd.limits.keys import Counter

# INCRBY the number of hits, and EXPIRE when the key is new (or somehow
# lost its TTL), in one atomic step. ARGV: the TTL, the number of hits.
INCREMENT_SCRIPT = """
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
# C{ADJUST_SCRIPT} does: a settlement rides on the next admission instead
# of costing a round trip of its own.
#
# Decisions D12, amended: a budget's counter K also keeps each reservation
# made with a ledger id as a member (see
# L{svcd.limits.limiter.RedisRateLimiter}): K:members, a
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

ADMIT_SCRIPT = (
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
RENEW_SCRIPT = (
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
RECONCILE_SCRIPT = (
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
TIME_SCRIPT = """
local t = redis.call('TIME')
return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""


def packAdmitArguments(arguments: list[int]) -> str:
    """
    The admission script's arguments as its ARGV[1] (C{ADMIT_SCRIPT}); its
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
    amended; C{ADMIT_SCRIPT}'s ARGV[3] to ARGV[6]), packed: one ledger id
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
SEED_SCRIPT = """
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) and 1 or 0
"""

# Decisions D11: token reservations settled to what the provider counted.
# ARGV: one delta per key; a key that has expired is left alone (its
# minute is long over, and a negative count must not be made).
ADJUST_SCRIPT = """
for index, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('INCRBY', key, ARGV[index])
  end
end
return 0
"""


def admitArguments(admissions: list[tuple[Counter, ...]]) -> tuple[list[str], list[int]]:
    """
    The keys and arguments of C{ADMIT_SCRIPT} for these requests.
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
