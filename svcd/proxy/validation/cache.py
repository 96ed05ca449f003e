"""
The proxy's validation cache (decisions D8): ValidateToken and
ValidateAgent answered from memory while svc-auth's change feed is live,
made-up token ids refused without a call, and a budget of failed secrets
per token id.

What is remembered, and for how long:

  - A token's answer (L{TokenInfo}), keyed on its token id and kept with a
    keyed BLAKE2b digest of its secret (a random key made at start): the
    raw token is never a key and never kept; a request's secret is
    compared, in constant time, by its digest. Only answers that said OK
    are kept; wrong secrets are not.
  - An agent's answer for one organization: active (L{AgentInfo}), or the
    refusal AGENT_SUSPENDED / AGENT_NOT_AUTHORIZED; it does not depend on
    the token, whose own answer comes from the step before.
  - At most C{size} entries, least recently used out first, each for at
    most C{ttl} seconds, and a token's never past its expires_at.

Why an answer is sometimes not kept: several svc-auth replicas may answer,
and each hears of a change within a second of it (decisions D7), not at
the instant the feed told us. An answer to a call sent less than
C{replicaLag} seconds after the feed reported a change of that token or
agent (or after the feed's session began: changes may have gone unheard
before it) may come from a replica that has not heard yet; it serves its
request (as it would have in Phase 1) but is not kept.

What is refused without a call, only while the feed is live:

  - A token id that svc-auth does not know (L{KnownTokens}, which never
    misses a known id): 401 INVALID_TOKEN, once two more heartbeats have
    shown that it was not merely created a moment ago (a token created
    before the request is then known: it works at once, everywhere). At
    most 64 such requests wait at once; past that (a flood of made-up
    ids) they are refused without waiting.
  - A token id for which svc-auth has refused C{failureBudget} bearers in
    the current second: 401 INVALID_TOKEN for the rest of that second, so
    that a flood of wrong secrets for one real token id cannot keep
    svc-auth's argon2 workers busy. The token's holder is not locked out
    by such a flood: a bearer whose secret svc-auth accepted before is
    answered from memory, or, once its answer is past the TTL, still asked
    of svc-auth (the entry keeps the secret's digest until the LRU or the
    feed drops it). Only a holder this proxy has never seen (after a
    restart of the feed, say) may be refused while the flood lasts.

When the feed is not live, everything goes to svc-auth exactly as in
Phase 1 (L{GrpcAuthClient}, with its shared calls), and nothing is
refused here.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

from svcd.authclient.feed import FeedNotLive
from svcd.authclient.knowntokens import KnownTokens
from svcd.common.clocks import Clock
from svcd.common.errors import ApiError, ErrorCode
from svcd.common.pat import PREFIX
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.records import AgentInfo, TokenInfo
from svcd.proxy.validation.client import AuthClient

# Decisions D7: a change reaches every svc-auth replica within one second;
# half a second more for the call's own way.
REPLICA_LAG = 1.5

_ID_START = len(PREFIX)
_ID_END = _ID_START + 36
_SECRET_START = _ID_END + 1

# Refusals of ValidateAgent that depend only on the agent and the
# organization, and so may be remembered.
_AGENT_REFUSALS = frozenset({ErrorCode.AGENT_SUSPENDED, ErrorCode.AGENT_NOT_AUTHORIZED})

# Requests with an unknown token id waiting for the feed's heartbeats at
# most at once; past it, such requests are refused without waiting.
MAX_WAITING_UNKNOWN = 64

# The failure budget forgets past seconds once it tracks this many ids.
_FAILURE_IDS = 100_000
# Change times are pruned once this many are kept.
_CHANGES_KEPT = 4_096


@attrs.define(slots=True)
class _TokenEntry:
    info: TokenInfo
    digest: bytes = attrs.field(repr=False)
    # Wall-clock second of the token's expires_at, or None.
    expiresAt: float | None
    storedAt: float


@attrs.define(slots=True)
class _AgentEntry:
    # By organization id: the answer (AgentInfo or a refusal's code) and
    # when it was stored.
    answers: dict[str, tuple[AgentInfo | ErrorCode, float]]


@attrs.frozen
class Ticket:
    """
    Taken when a call is sent; says later whether its answer may be kept.
    """

    session: int
    sentAt: float


def _expiresAt(info: TokenInfo) -> float | None:
    if info.expiresAt is None:
        return None
    try:
        return datetime.datetime.fromisoformat(info.expiresAt).timestamp()
    except ValueError:
        # Not a time we can read: keep nothing rather than guess.
        return float("-inf")


class ValidationCache:
    """
    The remembered answers, the known token ids and the failure budget;
    the consumer of the change feed. Reactor thread only.

    @param clock: the time source of ages and budgets.
    @param wallClock: Unix time, for expires_at.
    """

    def __init__(
        self,
        clock: Clock,
        wallClock: Callable[[], float],
        size: int,
        ttl: float,
        failureBudget: int,
        replicaLag: float = REPLICA_LAG,
        key: bytes | None = None,
    ) -> None:
        self._clock = clock
        self._wallClock = wallClock
        self._size = size
        self._ttl = ttl
        self._failureBudget = failureBudget
        self._replicaLag = replicaLag
        self._key = key if key is not None else os.urandom(32)
        self._entries: OrderedDict[tuple[str, str], _TokenEntry | _AgentEntry] = OrderedDict()
        self._known = KnownTokens()
        self._session = 0
        self._sessionStartedAt = float("-inf")
        self._tokenChangedAt: dict[str, float] = {}
        self._agentChangedAt: dict[str, float] = {}
        self._failures: dict[str, tuple[int, int]] = {}

    # The feed's news.

    def feedStarted(self, known: KnownTokens) -> None:
        self._entries.clear()
        self._tokenChangedAt.clear()
        self._agentChangedAt.clear()
        self._known = known
        self._session += 1
        self._sessionStartedAt = self._clock.seconds()

    def tokenChanged(self, tokenID: bytes) -> None:
        self._known.add(tokenID)
        idText = str(uuid.UUID(bytes=tokenID))
        self._entries.pop(("t", idText), None)
        self._noteChange(self._tokenChangedAt, idText)

    def agentChanged(self, agentID: bytes) -> None:
        idText = str(uuid.UUID(bytes=agentID))
        self._entries.pop(("a", idText), None)
        self._noteChange(self._agentChangedAt, idText)

    def _noteChange(self, changes: dict[str, float], idText: str) -> None:
        now = self._clock.seconds()
        changes[idText] = now
        if len(changes) > _CHANGES_KEPT:
            for stale in [key for key, at in changes.items() if now - at > self._replicaLag]:
                del changes[stale]

    # Tokens.

    def digest(self, secret: str) -> bytes:
        """
        The keyed digest a secret is remembered and compared by.
        """
        return hashlib.blake2b(secret.encode("ascii"), key=self._key, digest_size=16).digest()

    def token(self, tokenID: str, digest: bytes) -> TokenInfo | None:
        """
        The remembered answer for this token and secret, if any and still
        good.
        """
        key = ("t", tokenID)
        entry = self._entries.get(key)
        if entry is None:
            return None
        assert isinstance(entry, _TokenEntry)
        if entry.expiresAt is not None and self._wallClock() >= entry.expiresAt:
            del self._entries[key]
            return None
        if self._clock.seconds() - entry.storedAt >= self._ttl:
            # Past its TTL the answer is not used, but the entry stays (until
            # the LRU or the feed drops it) as proof that this secret was
            # right: see knownGood.
            return None
        if not hmac.compare_digest(entry.digest, digest):
            return None
        self._entries.move_to_end(key)
        return entry.info

    def knownGood(self, tokenID: str, digest: bytes) -> bool:
        """
        Was this very secret of this token accepted by svc-auth, and has the
        feed said nothing of the token since? (Its answer may be too old to
        use.) Such a bearer is the token's holder, not someone guessing: the
        failure budget does not refuse it.
        """
        entry = self._entries.get(("t", tokenID))
        return isinstance(entry, _TokenEntry) and hmac.compare_digest(entry.digest, digest)

    def known(self, tokenID: str) -> bool:
        """
        Might svc-auth accept a bearer of this token id?
        """
        return uuid.UUID(tokenID).bytes in self._known

    def ticket(self) -> Ticket:
        return Ticket(self._session, self._clock.seconds())

    def rememberToken(self, tokenID: str, digest: bytes, info: TokenInfo, ticket: Ticket) -> None:
        if not self._keepable(ticket, self._tokenChangedAt.get(tokenID)):
            return
        expiresAt = _expiresAt(info)
        if expiresAt is not None and self._wallClock() >= expiresAt:
            return
        self._store(("t", tokenID), _TokenEntry(info, digest, expiresAt, self._clock.seconds()))

    def _keepable(self, ticket: Ticket, changedAt: float | None) -> bool:
        if ticket.session != self._session:
            return False
        latest = (
            self._sessionStartedAt if changedAt is None else max(self._sessionStartedAt, changedAt)
        )
        return ticket.sentAt - latest > self._replicaLag

    def _store(self, key: tuple[str, str], entry: _TokenEntry | _AgentEntry) -> None:
        entries = self._entries
        entries[key] = entry
        entries.move_to_end(key)
        while len(entries) > self._size:
            entries.popitem(last=False)

    # The failure budget.

    def overBudget(self, tokenID: str) -> bool:
        """
        Has svc-auth refused this token id C{failureBudget} times this
        second?
        """
        spent = self._failures.get(tokenID)
        return (
            spent is not None
            and spent[0] == int(self._clock.seconds())
            and spent[1] >= self._failureBudget
        )

    def refused(self, tokenID: str) -> None:
        """
        svc-auth refused a bearer of this token id.
        """
        second = int(self._clock.seconds())
        spent = self._failures.get(tokenID)
        count = spent[1] + 1 if spent is not None and spent[0] == second else 1
        if spent is None and len(self._failures) >= _FAILURE_IDS:
            self._failures = {
                key: value for key, value in self._failures.items() if value[0] == second
            }
        self._failures[tokenID] = (second, count)

    # Agents.

    def agent(self, agentID: str, orgID: str) -> AgentInfo | ErrorCode | None:
        """
        The remembered answer for this agent in this organization, if any.
        """
        key = ("a", agentID)
        entry = self._entries.get(key)
        if entry is None:
            return None
        assert isinstance(entry, _AgentEntry)
        answer = entry.answers.get(orgID)
        if answer is None:
            return None
        if self._clock.seconds() - answer[1] >= self._ttl:
            del entry.answers[orgID]
            return None
        self._entries.move_to_end(key)
        return answer[0]

    def rememberAgent(
        self, agentID: str, orgID: str, answer: AgentInfo | ErrorCode, ticket: Ticket
    ) -> None:
        if not self._keepable(ticket, self._agentChangedAt.get(agentID)):
            return
        key = ("a", agentID)
        entry = self._entries.get(key)
        if not isinstance(entry, _AgentEntry):
            entry = _AgentEntry({})
        entry.answers[orgID] = (answer, self._clock.seconds())
        self._store(key, entry)

    def __len__(self) -> int:
        return len(self._entries)


class LifecycleAuthClient(AuthClient, Protocol):
    """
    An auth client the service starts and closes.
    """

    def start(self) -> None: ...

    def close(self) -> None: ...


class Feed(Protocol):
    """
    What the client needs of the change feed (L{svcd.authclient.feed.ChangeFeed}).
    """

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def live(self) -> bool: ...

    def afterHeartbeats(self, count: int) -> Deferred[None]: ...


class CachingAuthClient:
    """
    L{AuthClient} answering from a L{ValidationCache} while the change feed
    is live, and through C{inner} otherwise (and on every miss).
    """

    def __init__(
        self,
        inner: LifecycleAuthClient,
        cache: ValidationCache,
        feed: Feed,
        metrics: ProxyMetrics,
        maxWaitingUnknown: int = MAX_WAITING_UNKNOWN,
    ) -> None:
        self._inner = inner
        self._cache = cache
        self._feed = feed
        self._metrics = metrics
        self._maxWaitingUnknown = maxWaitingUnknown
        self._waitingUnknown = 0

    def start(self) -> None:
        self._inner.start()
        self._feed.start()

    def close(self) -> None:
        self._feed.stop()
        self._inner.close()

    def checkReachable(self) -> Deferred[None]:
        return self._inner.checkReachable()

    def validateToken(self, accessToken: str) -> Deferred[TokenInfo]:
        metrics, cache = self._metrics, self._cache
        if not self._feed.live():
            metrics.authCacheMiss("token")
            return self._inner.validateToken(accessToken)
        # The edge has checked the bearer's shape (svcd.common.pat).
        tokenID = accessToken[_ID_START:_ID_END]
        digest = cache.digest(accessToken[_SECRET_START:])
        info = cache.token(tokenID, digest)
        if info is not None:
            metrics.authCacheHit("token")
            return succeed(info)
        metrics.authCacheMiss("token")
        if not cache.known(tokenID):
            if self._waitingUnknown >= self._maxWaitingUnknown:
                # A flood of made-up ids: refuse at once rather than hold
                # more requests (a token created this instant may then be
                # refused once; D8 gives it a second to work everywhere).
                metrics.authLocalRefusal("unknown_token")
                return fail(ApiError(ErrorCode.INVALID_TOKEN))
            return Deferred.fromCoroutine(self._unknownToken(accessToken, tokenID, digest))
        return self._askForToken(accessToken, tokenID, digest)

    async def _unknownToken(self, accessToken: str, tokenID: str, digest: bytes) -> TokenInfo:
        """
        A token id the feed has not announced: made up, or created a moment
        ago and still on its way to us. Two heartbeats settle which (see
        L{ChangeFeed.afterHeartbeats}): a token created before this request
        is known by then. A made-up id is refused without a call, about a
        fifth of a second later; if the feed stops being live meanwhile,
        the request goes to svc-auth as in Phase 1.
        """
        self._waitingUnknown += 1
        try:
            await self._feed.afterHeartbeats(2)
        except FeedNotLive:
            return await self._inner.validateToken(accessToken)
        finally:
            self._waitingUnknown -= 1
        if not self._cache.known(tokenID):
            self._metrics.authLocalRefusal("unknown_token")
            raise ApiError(ErrorCode.INVALID_TOKEN)
        return await self._askForToken(accessToken, tokenID, digest)

    def _askForToken(self, accessToken: str, tokenID: str, digest: bytes) -> Deferred[TokenInfo]:
        """
        Ask svc-auth about a known token id, within the failure budget, and
        keep the answer if it may be kept.
        """
        metrics, cache = self._metrics, self._cache
        if cache.overBudget(tokenID) and not cache.knownGood(tokenID, digest):
            metrics.authLocalRefusal("failure_budget")
            return fail(ApiError(ErrorCode.INVALID_TOKEN))
        ticket = cache.ticket()

        def answered(info: TokenInfo) -> TokenInfo:
            if self._feed.live():
                cache.rememberToken(tokenID, digest, info, ticket)
            return info

        def refused(failure: Failure) -> Failure:
            error = failure.value
            if isinstance(error, ApiError) and error.code is ErrorCode.INVALID_TOKEN:
                cache.refused(tokenID)
            return failure

        return self._inner.validateToken(accessToken).addCallbacks(answered, refused)

    def validateAgent(self, accessToken: str, agentID: str, orgID: str) -> Deferred[AgentInfo]:
        metrics, cache = self._metrics, self._cache
        if not self._feed.live():
            metrics.authCacheMiss("agent")
            return self._inner.validateAgent(accessToken, agentID, orgID)
        answer = cache.agent(agentID, orgID)
        if answer is not None:
            metrics.authCacheHit("agent")
            if isinstance(answer, ErrorCode):
                return fail(ApiError(answer))
            return succeed(answer)
        metrics.authCacheMiss("agent")
        ticket = cache.ticket()

        def answered(info: AgentInfo) -> AgentInfo:
            if self._feed.live():
                cache.rememberAgent(agentID, orgID, info, ticket)
            return info

        def refused(failure: Failure) -> Failure:
            error = failure.value
            if isinstance(error, ApiError) and error.code in _AGENT_REFUSALS and self._feed.live():
                cache.rememberAgent(agentID, orgID, error.code, ticket)
            return failure

        return self._inner.validateAgent(accessToken, agentID, orgID).addCallbacks(
            answered, refused
        )
