"""
Test doubles for svc-proxy's dependencies, with the interfaces of the real
ones: an in-memory auth client and in-memory Redis counters (so tests run
the real L{RedisRateLimiter} logic without Redis).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure
from txredisapi import ResponseError

from svcd.common.errors import ApiError, ErrorCode
from svcd.common.pat import formatToken, newSecret
from svcd.common.permissions import Permission
from svcd.common.readiness import CheckFailed
from svcd.limits.clusterlink import keySlot
from svcd.proxy.records import AgentInfo, TokenInfo


def _redisTime() -> int:
    return int(time.time() * 1000)


def newToken() -> str:
    """
    A bearer value of the real PAT format (it passes the proxy's format
    check), known to no auth service.
    """
    return formatToken(uuid.uuid4(), newSecret())


@attrs.define
class FakeAuthClient:
    """
    An L{svcd.proxy.validation.client.AuthClient} answering from dictionaries.

    An unknown token is 401 INVALID_TOKEN; an unknown agent, or one of
    another organization, 403 AGENT_NOT_AUTHORIZED. An entry may also be an
    exception to fail with, or a Deferred to return as is (to hold a
    request in flight).
    """

    tokens: dict[str, TokenInfo | Exception | Deferred[TokenInfo]] = attrs.field(factory=dict)
    agents: dict[str, AgentInfo | Exception | Deferred[AgentInfo]] = attrs.field(factory=dict)
    # None: reachable; an exception to fail with; a Deferred to return.
    reachable: Exception | Deferred[None] | None = None
    calls: list[tuple[str, ...]] = attrs.field(factory=list)
    started: bool = False
    closed: bool = False

    def addTenant(
        self,
        permissions: int = Permission.ProxyChatCompletion,
        tokenAgent: bool = False,
        status: str = "active",
        orgID: str | None = None,
    ) -> tuple[str, str, str]:
        """
        Register a new organization (or C{orgID}) with one agent and one
        token.

        @param tokenAgent: bind the token to the agent.
        @return: (token, org id, agent id)
        """
        token, agentID = newToken(), str(uuid.uuid4())
        orgID = orgID or str(uuid.uuid4())
        self.tokens[token] = TokenInfo(
            orgID=orgID,
            permissions=int(permissions),
            agentID=agentID if tokenAgent else None,
            tokenID=str(uuid.uuid4()),
        )
        if status == "active":
            self.agents[agentID] = AgentInfo(agentID=agentID, orgID=orgID, status=status)
        else:
            self.agents[agentID] = ApiError(ErrorCode.AGENT_SUSPENDED)
        return token, orgID, agentID

    def validateToken(self, accessToken: str) -> Deferred[TokenInfo]:
        self.calls.append(("ValidateToken", accessToken))
        outcome = self.tokens.get(accessToken, ApiError(ErrorCode.INVALID_TOKEN))
        if isinstance(outcome, Deferred):
            return outcome
        if isinstance(outcome, Exception):
            return fail(outcome)
        return succeed(outcome)

    def validateAgent(self, accessToken: str, agentID: str, orgID: str) -> Deferred[AgentInfo]:
        self.calls.append(("ValidateAgent", accessToken, agentID, orgID))
        outcome = self.agents.get(agentID, ApiError(ErrorCode.AGENT_NOT_AUTHORIZED))
        if isinstance(outcome, Deferred):
            return outcome
        if isinstance(outcome, Exception):
            return fail(outcome)
        if outcome.orgID != orgID:
            return fail(ApiError(ErrorCode.AGENT_NOT_AUTHORIZED))
        return succeed(outcome)

    def checkReachable(self) -> Deferred[None]:
        self.calls.append(("checkReachable",))
        if isinstance(self.reachable, Deferred):
            return self.reachable
        if self.reachable is not None:
            return fail(self.reachable)
        return succeed(None)

    def start(self) -> None:
        self.started = True

    def close(self) -> None:
        self.closed = True


class _HeldAnswers:
    """
    The calls answered by one held reply (L{MemoryCounters.reply}).
    """

    def __init__(self) -> None:
        self._answers: list[Deferred[int]] = []
        self._outcome: list[int | Failure] = []

    def add(self, answer: Deferred[int]) -> Deferred[int]:
        self._answers.append(answer)
        if self._outcome:
            self._deliver(answer, self._outcome[0])
        return answer

    def fire(self, outcome: int | Failure) -> None:
        self._outcome.append(outcome)
        for answer in self._answers:
            self._deliver(answer, outcome)

    def _deliver(self, answer: Deferred[int], outcome: int | Failure) -> None:
        if answer.called:
            return
        if isinstance(outcome, Failure):
            answer.errback(outcome)
        else:
            answer.callback(outcome)


@attrs.define
class MemoryCounters:
    """
    L{svcd.limits.limiter.RedisCounters} in a dictionary; C{connected}
    can be switched off to see the limiter fail open.
    """

    counts: dict[str, int] = attrs.field(factory=dict)
    ttls: dict[str, int] = attrs.field(factory=dict)
    connected: bool = True
    failure: Exception | None = None
    # When set, what increment returns (to hold a reply back).
    reply: Deferred[int] | None = None
    # Each call's key and number of hits, in order.
    calls: list[tuple[str, int]] = attrs.field(factory=list)
    # Each admission call's keys and arguments (decisions D11), in order.
    admissions: list[tuple[list[str], list[int]]] = attrs.field(factory=list)
    _held: dict[Deferred[int], _HeldAnswers] = attrs.field(factory=dict, init=False, repr=False)
    started: bool = False
    stopped: bool = False
    # Budget members (decisions D12, amended): by counter, ledger id ->
    # amount, lease deadline and time recorded (ms of C{now}).
    members: dict[str, dict[str, int]] = attrs.field(factory=dict)
    leases: dict[str, dict[str, int]] = attrs.field(factory=dict)
    recordedAt: dict[str, dict[str, int]] = attrs.field(factory=dict)
    # Redis's TIME in ms, for leases.
    now: Callable[[], int] = _redisTime

    def increment(self, key: str, hits: int, ttl: int) -> Deferred[int]:
        if self.reply is not None:
            return self._heldAnswer(self.reply)
        if self.failure is not None:
            return fail(self.failure)
        self.calls.append((key, hits))
        self.counts[key] = self.counts.get(key, 0) + hits
        self.ttls.setdefault(key, ttl)
        return succeed(self.counts[key])

    def admit(
        self,
        keys: list[str],
        arguments: list[int],
        adjustments: list[int] | None = None,
        ledger: Any = None,
    ) -> Deferred[list[list[int]]]:
        """
        The admission script of decisions D11 and D12 (C{_ADMIT_SCRIPT}),
        step for step, over the dictionary: the settlements riding on it
        first (deltas, then members' settlements, then marks of recorded
        rows), then the requests.
        """
        if self.failure is not None:
            return fail(self.failure)
        if arguments != [0]:
            self.admissions.append((list(keys), list(arguments)))
        pairs = list(adjustments or [])
        for index, delta in zip(pairs[::2], pairs[1::2], strict=True):
            if keys[index - 1] in self.counts:
                self.counts[keys[index - 1]] += delta
        ledgerIDs: list[str] = []
        lease = 0
        if ledger is not None:
            timing = [int(word) for word in ledger.timing.split(",") if word]
            lease, grace = [*timing, 0, 0][:2]
            settled = [word for word in ledger.settlements.split(",") if word]
            for p in range(0, len(settled), 3):
                key, ledgerID, cost = keys[int(settled[p]) - 1], settled[p + 1], int(settled[p + 2])
                if key in self.counts:
                    held = self.members.setdefault(key, {}).get(ledgerID)
                    self.counts[key] += cost - (held or 0)
                    self.members[key][ledgerID] = cost
                    self.leases.setdefault(key, {})[ledgerID] = self.now() + grace
            marks = [word for word in ledger.marks.split(",") if word]
            for p in range(0, len(marks), 2):
                key, ledgerID = keys[int(marks[p]) - 1], marks[p + 1]
                if ledgerID in self.members.get(key, {}):
                    self.recordedAt.setdefault(key, {})[ledgerID] = self.now()
            ledgerIDs = [word for word in ledger.ledgerIDs.split(",") if word]
        at = 1
        answers: list[list[int]] = []
        for _ in range(arguments[0]):
            n = arguments[at]
            counters: list[tuple[str, int, int, int]] = []
            for c in range(n):
                index, amount, limit, ttl = arguments[at + 1 + 4 * c : at + 5 + 4 * c]
                counters.append((keys[index - 1], amount, limit, ttl))
            at += 1 + 4 * n
            refused = 0
            for position, (key, amount, limit, ttl) in enumerate(counters, 1):
                if ttl == 0 and key not in self.counts:
                    refused = -position
                    break
                if self.counts.get(key, 0) + amount > limit:
                    refused = position
                    break
            if not refused:
                ledgerID = ledgerIDs[len(answers)] if len(answers) < len(ledgerIDs) else "-"
                for key, amount, _, ttl in counters:
                    if amount > 0:
                        self.counts[key] = self.counts.get(key, 0) + amount
                        if ttl > 0:
                            self.ttls.setdefault(key, ttl)
                    if ledgerID != "-" and ttl == 0:
                        self.members.setdefault(key, {})[ledgerID] = amount
                        self.leases.setdefault(key, {})[ledgerID] = self.now() + lease
            answers.append([refused, *(self.counts.get(key, 0) for key, _, _, _ in counters)])
        return succeed(answers)

    def seed(self, key: str, value: int, ttl: int) -> Deferred[object]:
        """
        SET NX EX, as C{_SEED_SCRIPT}.
        """
        if self.failure is not None:
            return fail(self.failure)
        if key in self.counts:
            return succeed(0)
        self.counts[key] = value
        self.ttls[key] = ttl
        return succeed(1)

    def adjust(self, keys: list[str], deltas: list[int]) -> Deferred[object]:
        """
        The settlement script of decisions D11: each delta added to its key
        where the key exists.
        """
        if self.failure is not None:
            return fail(self.failure)
        for key, delta in zip(keys, deltas, strict=True):
            if key in self.counts:
                self.counts[key] += delta
        return succeed(0)

    def renew(self, keys: list[str], leaseMs: int, triples: str) -> Deferred[object]:
        """
        C{_RENEW_SCRIPT}: leases pushed, members gone made again.
        """
        if self.failure is not None:
            return fail(self.failure)
        words = [word for word in triples.split(",") if word]
        made = 0
        for p in range(0, len(words), 3):
            key, ledgerID, amount = keys[int(words[p]) - 1], words[p + 1], int(words[p + 2])
            if key not in self.counts:
                continue
            members = self.members.setdefault(key, {})
            if ledgerID not in members:
                members[ledgerID] = amount
                self.counts[key] += amount
                made += 1
            self.leases.setdefault(key, {})[ledgerID] = self.now() + leaseMs
        return succeed(made)

    def reconcile(self, key: str, t0: int, spent: int, ttl: int) -> Deferred[tuple[int, int, int]]:
        """
        C{_RECONCILE_SCRIPT}: members whose lease passed or recorded before
        C{t0} dropped, the counter set to C{spent} plus the others.
        """
        if self.failure is not None:
            return fail(self.failure)
        now = self.now()
        members = self.members.setdefault(key, {})
        leases = self.leases.setdefault(key, {})
        recorded = self.recordedAt.setdefault(key, {})
        for ledgerID, deadline in list(leases.items()):
            if deadline <= now:
                members.pop(ledgerID, None)
                recorded.pop(ledgerID, None)
                del leases[ledgerID]
        for ledgerID, when in list(recorded.items()):
            if when <= t0:
                members.pop(ledgerID, None)
                leases.pop(ledgerID, None)
                del recorded[ledgerID]
        before = self.counts.get(key, -1)
        self.counts[key] = spent + sum(members.values())
        self.ttls.setdefault(key, ttl)
        return succeed((before, self.counts[key], len(members)))

    def redisTime(self, key: str = "") -> Deferred[int]:
        if self.failure is not None:
            return fail(self.failure)
        return succeed(self.now())

    def _heldAnswer(self, held: Deferred[int]) -> Deferred[int]:
        """
        A Deferred of its own for each call, answered as C{held} is: one
        Deferred handed to several callers would hand each the result the
        callbacks of the one before left.
        """
        answers = self._held.get(held)
        if answers is None:
            answers = self._held[held] = _HeldAnswers()
            held.addBoth(answers.fire)
        return answers.add(Deferred())

    def ping(self) -> Deferred[object]:
        if not self.connected:
            return fail(CheckFailed("not connected to Redis"))
        return succeed("PONG")

    def start(self) -> None:
        self.started = True

    def stop(self) -> Deferred[None]:
        self.stopped = True
        return succeed(None)


@attrs.define
class ClusterCounters(MemoryCounters):
    """
    L{MemoryCounters} as a Redis Cluster's (decisions D16): they have
    C{slotOf}, so the limiter splits its calls per hash slot, and a call
    over keys of several slots fails as CROSSSLOT does; each call's kind
    and slot noted in C{slotCalls}.
    """

    slotCalls: list[tuple[str, int]] = attrs.field(factory=list)

    def slotOf(self, key: str) -> int:
        return keySlot(key)

    def _oneSlot(self, kind: str, keys: list[str]) -> Deferred[Any] | None:
        slots = {keySlot(key) for key in keys}
        if len(slots) > 1:
            return fail(ResponseError("CROSSSLOT Keys in request don't hash to the same slot"))
        self.slotCalls.append((kind, slots.pop() if slots else -1))
        return None

    def increment(self, key: str, hits: int, ttl: int) -> Deferred[int]:
        return self._oneSlot("increment", [key]) or super().increment(key, hits, ttl)

    def admit(
        self,
        keys: list[str],
        arguments: list[int],
        adjustments: list[int] | None = None,
        ledger: Any = None,
    ) -> Deferred[list[list[int]]]:
        crossed = self._oneSlot("admit" if arguments != [0] else "settle", keys)
        return crossed or super().admit(keys, arguments, adjustments, ledger)

    def adjust(self, keys: list[str], deltas: list[int]) -> Deferred[object]:
        return self._oneSlot("adjust", keys) or super().adjust(keys, deltas)

    def renew(self, keys: list[str], leaseMs: int, triples: str) -> Deferred[object]:
        return self._oneSlot("renew", keys) or super().renew(keys, leaseMs, triples)


async def listeningProxy(
    reactor: Any,
    auth: FakeAuthClient,
    counters: MemoryCounters,
    maxRequestBodyBytes: int,
    shutdownTimeout: float = 2.0,
    **siteOptions: float | None,
) -> tuple[Any, int]:
    """
    A real svc-proxy service listening on a free loopback port, assembled
    as the daemon is (L{svcd.proxy.assembly.assembleProxy}) around the
    in-memory auth client and counters: for tests that need real sockets
    (early 413, timeouts, hostile clients) but no other process. Returns
    the started L{ProxyService} and its port; stop it with stopService.

    @param siteOptions: C{maxBufferedBodyBytes}, and the site's C{timeout}
        (idle) and C{requestTimeout}.
    """
    from svcd.proxy.assembly import assembleProxy
    from svcd.proxy.config import ProxyConfig
    from svcd.proxy.http.site import DEFAULT_IDLE_TIMEOUT, DEFAULT_REQUEST_TIMEOUT

    options = dict(siteOptions)
    maxBufferedBodyBytes = options.pop("maxBufferedBodyBytes", None)
    idleTimeout = options.pop("timeout", DEFAULT_IDLE_TIMEOUT)
    requestTimeout = options.pop("requestTimeout", DEFAULT_REQUEST_TIMEOUT)
    if options:
        raise TypeError(f"unknown site options: {', '.join(sorted(options))}")
    config = ProxyConfig(
        authGrpcAddr="auth.test:9091",
        host="127.0.0.1",
        port=0,
        maxRequestBodyBytes=maxRequestBodyBytes,
        shutdownTimeout=shutdownTimeout,
    )
    if maxBufferedBodyBytes is not None:
        config = attrs.evolve(config, maxBufferedBodyBytes=int(maxBufferedBodyBytes))
    service = assembleProxy(
        config,
        reactor,
        auth=auth,
        counters=counters,
        idleTimeout=idleTimeout,
        requestTimeout=requestTimeout,
    ).service
    service.startService()
    port: Any = await service.whenListening()
    return service, port.getHost().port


class MemoryLedger:
    """
    L{svcd.ledger.rows.UsageLedger} in a list: the rows recorded, in
    order, and a switch for a full outbox.
    """

    def __init__(self) -> None:
        self.rows: list[Any] = []
        self.full = False

    def hasRoom(self) -> bool:
        return not self.full

    def record(self, row: Any) -> None:
        self.rows.append(row)
