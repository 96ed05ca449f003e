"""
The proxy's validation cache (svcd/proxy/validation/cache.py, decisions D8) and
its Bloom filter of known token ids (svcd/authclient/knowntokens.py), alone,
with an in-memory svc-auth, a switchable feed and task.Clock. The same
rules against real svc-auth replicas and proxies are in
test_gateway_cache.py.
"""

from __future__ import annotations

import datetime
import os
import uuid
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proxydoubles import FakeAuthClient
from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock

from svcd.authclient.feed import FeedNotLive
from svcd.authclient.knowntokens import MINIMUM_CAPACITY, KnownTokens
from svcd.common.errors import ApiError, ErrorCode
from svcd.common.pat import formatToken, newSecret, parseToken
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.records import AgentInfo, TokenInfo
from svcd.proxy.validation.cache import CachingAuthClient, ValidationCache

LAG = 1.5
TTL = 60.0
BUDGET = 3


@attrs.define
class SwitchableFeed:
    """
    A feed whose liveness the test sets, and whose heartbeats it sends.
    """

    isLive: bool = True
    started: bool = False
    stopped: bool = False
    waiting: list[tuple[int, Deferred[None]]] = attrs.field(factory=list)
    heartbeats: int = 0

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def live(self) -> bool:
        return self.isLive

    def afterHeartbeats(self, count: int) -> Deferred[None]:
        if not self.isLive:
            return fail(FeedNotLive())
        waiter: Deferred[None] = Deferred()
        self.waiting.append((self.heartbeats + count, waiter))
        return waiter

    def beat(self, count: int = 1) -> None:
        for _ in range(count):
            self.heartbeats += 1
            for target, waiter in list(self.waiting):
                if target == self.heartbeats:
                    self.waiting.remove((target, waiter))
                    waiter.callback(None)

    def lose(self) -> None:
        self.isLive = False
        waiting, self.waiting = self.waiting, []
        for _, waiter in waiting:
            waiter.errback(FeedNotLive())


@attrs.define
class Harness:
    clock: Clock
    wall: list[float]
    auth: FakeAuthClient
    cache: ValidationCache
    feed: SwitchableFeed
    metrics: ProxyMetrics
    client: CachingAuthClient

    def tokenID(self, token: str) -> uuid.UUID:
        parsed = parseToken(token)
        assert parsed is not None
        return parsed.tokenID

    def startSession(self, *tokens: str) -> None:
        """
        A feed session whose snapshot knows C{tokens}, old enough that
        answers may be kept.
        """
        known = KnownTokens()
        for token in tokens:
            known.add(self.tokenID(token).bytes)
        self.cache.feedStarted(known)
        self.clock.advance(LAG + 0.1)

    def calls(self, name: str) -> int:
        return sum(1 for call in self.auth.calls if call[0] == name)

    def sample(self, metric: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(metric, labels)
        return 0.0 if value is None else value


@pytest.fixture
def harness() -> Harness:
    clock = Clock()
    clock.advance(1000)
    wall = [1_800_000_000.0]
    auth = FakeAuthClient()
    cache = ValidationCache(clock, lambda: wall[0], size=100, ttl=TTL, failureBudget=BUDGET)
    feed = SwitchableFeed()
    metrics = ProxyMetrics()
    client = CachingAuthClient(auth, cache, feed, metrics)
    return Harness(clock, wall, auth, cache, feed, metrics, client)


def result(deferred: Any) -> Any:
    """
    The synchronous outcome of a fired Deferred: its result, or its
    failure's exception.
    """
    outcomes: list[Any] = []
    deferred.addBoth(outcomes.append)
    assert outcomes, "the Deferred has not fired"
    outcome = outcomes[0]
    return getattr(outcome, "value", outcome)


def test_aValidTokenIsAskedOnceThenAnsweredFromMemory(harness: Harness) -> None:
    """
    The first validation asks svc-auth; the next ones are answered from
    memory (counted as hits) with the same answer.
    """
    token, _, _ = harness.auth.addTenant()
    harness.startSession(token)
    first = result(harness.client.validateToken(token))
    assert isinstance(first, TokenInfo)
    for _ in range(5):
        assert result(harness.client.validateToken(token)) == first
    assert harness.calls("ValidateToken") == 1
    assert harness.sample("svc_proxy_auth_cache_hits_total", call="token") == 5
    assert harness.sample("svc_proxy_auth_cache_misses_total", call="token") == 1


def test_anotherSecretForAKnownTokenIsNotAnsweredFromMemory(harness: Harness) -> None:
    """
    A remembered token answers only its own secret: another secret for the
    same token id goes to svc-auth (which refuses it).
    """
    token, _, _ = harness.auth.addTenant()
    harness.startSession(token)
    result(harness.client.validateToken(token))
    forged = formatToken(harness.tokenID(token), newSecret())
    refusal = result(harness.client.validateToken(forged))
    assert isinstance(refusal, ApiError) and refusal.code is ErrorCode.INVALID_TOKEN
    assert harness.calls("ValidateToken") == 2


def test_aMadeUpTokenIDIsRefusedWithoutACall(harness: Harness) -> None:
    """
    A token id that the feed never announced is 401 INVALID_TOKEN with no
    call to svc-auth, counted as a local refusal, once two more heartbeats
    have come (not before: it might have been created a moment ago).
    """
    harness.startSession()
    answer = harness.client.validateToken(formatToken(uuid.uuid4(), newSecret()))
    harness.feed.beat()
    assert not answer.called
    harness.feed.beat()
    refusal = result(answer)
    assert isinstance(refusal, ApiError) and refusal.code is ErrorCode.INVALID_TOKEN
    assert harness.calls("ValidateToken") == 0
    assert harness.sample("svc_proxy_auth_local_refusals_total", reason="unknown_token") == 1


def test_aFloodOfMadeUpIDsIsRefusedWithoutWaitingPastTheBound(harness: Harness) -> None:
    """
    At most C{maxWaitingUnknown} requests with unknown ids wait for the
    heartbeats; the next ones are refused at once, without a call.
    """
    client = CachingAuthClient(
        harness.auth, harness.cache, harness.feed, harness.metrics, maxWaitingUnknown=2
    )
    harness.startSession()
    waiting = [client.validateToken(formatToken(uuid.uuid4(), newSecret())) for _ in range(2)]
    refused = result(client.validateToken(formatToken(uuid.uuid4(), newSecret())))
    assert isinstance(refused, ApiError) and refused.code is ErrorCode.INVALID_TOKEN
    assert not any(each.called for each in waiting)
    harness.feed.beat(2)
    assert all(isinstance(result(each), ApiError) for each in waiting)
    # Their places are free again: the next unknown id waits.
    later = client.validateToken(formatToken(uuid.uuid4(), newSecret()))
    assert not later.called
    harness.feed.beat(2)
    assert isinstance(result(later), ApiError)
    assert harness.calls("ValidateToken") == 0


def test_aTokenCreatedAfterTheSnapshotIsKnownFromItsChange(harness: Harness) -> None:
    """
    A token the snapshot did not hold is known as soon as the feed
    announces it, and then validated by svc-auth at once.
    """
    harness.startSession()
    token, _, _ = harness.auth.addTenant()
    harness.cache.tokenChanged(harness.tokenID(token).bytes)
    assert isinstance(result(harness.client.validateToken(token)), TokenInfo)


def test_aTokenCreatedAMomentAgoWorksAtOnce(harness: Harness) -> None:
    """
    A token whose creation the feed announces while its first request waits
    for the heartbeats is validated by svc-auth: a token created before the
    request is never refused for being unknown.
    """
    harness.startSession()
    token, _, _ = harness.auth.addTenant()
    answer = harness.client.validateToken(token)
    harness.cache.tokenChanged(harness.tokenID(token).bytes)
    harness.feed.beat(2)
    assert isinstance(result(answer), TokenInfo)
    assert harness.calls("ValidateToken") == 1


def test_anUnknownTokenIDGoesToSvcAuthWhenTheFeedIsLostMeanwhile(harness: Harness) -> None:
    """
    If the feed stops being live while an unknown id waits for its
    heartbeats, the request is validated by svc-auth as in Phase 1.
    """
    harness.startSession()
    token, _, _ = harness.auth.addTenant()
    answer = harness.client.validateToken(token)
    harness.feed.lose()
    assert isinstance(result(answer), TokenInfo)
    assert harness.calls("ValidateToken") == 1


def test_aWaitingRequestThatGoesAwayLeavesNothingBehind(harness: Harness) -> None:
    """
    Cancelling a request that waits for heartbeats (its client went away)
    ends it at once.
    """
    from twisted.internet.defer import CancelledError

    harness.startSession()
    answer = harness.client.validateToken(formatToken(uuid.uuid4(), newSecret()))
    answer.cancel()
    assert isinstance(result(answer), CancelledError)


def test_wrongSecretsForOneTokenIDHaveABudgetPerSecond(harness: Harness) -> None:
    """
    After svc-auth has refused C{BUDGET} bearers of one token id in a
    second, the rest of that second's are refused here without a call; a
    remembered valid bearer of that id is still answered; the next second
    starts a new budget.
    """
    token, _, _ = harness.auth.addTenant()
    harness.startSession(token)
    result(harness.client.validateToken(token))
    tokenID = harness.tokenID(token)
    for _ in range(BUDGET + 5):
        refusal = result(harness.client.validateToken(formatToken(tokenID, newSecret())))
        assert isinstance(refusal, ApiError) and refusal.code is ErrorCode.INVALID_TOKEN
    assert harness.calls("ValidateToken") == 1 + BUDGET
    assert harness.sample("svc_proxy_auth_local_refusals_total", reason="failure_budget") == 5
    assert isinstance(result(harness.client.validateToken(token)), TokenInfo)
    harness.clock.advance(1.0)
    result(harness.client.validateToken(formatToken(tokenID, newSecret())))
    assert harness.calls("ValidateToken") == 2 + BUDGET


def test_aFloodOfWrongSecretsDoesNotLockTheHolderOut(harness: Harness) -> None:
    """
    While the failure budget of a token id is spent, its holder (a secret
    svc-auth accepted before) is still asked of svc-auth once its answer is
    past the TTL, never refused here; a stranger's secret is.
    """
    token, _, _ = harness.auth.addTenant()
    harness.startSession(token)
    result(harness.client.validateToken(token))
    tokenID = harness.tokenID(token)
    harness.clock.advance(TTL + 1)
    for _ in range(BUDGET):
        result(harness.client.validateToken(formatToken(tokenID, newSecret())))
    calls = harness.calls("ValidateToken")
    assert isinstance(result(harness.client.validateToken(token)), TokenInfo)
    assert harness.calls("ValidateToken") == calls + 1
    refusal = result(harness.client.validateToken(formatToken(tokenID, newSecret())))
    assert isinstance(refusal, ApiError) and refusal.code is ErrorCode.INVALID_TOKEN
    assert harness.calls("ValidateToken") == calls + 1


def test_withoutALiveFeedEverythingGoesToSvcAuth(harness: Harness) -> None:
    """
    While the feed is not live nothing is answered or refused from memory:
    a remembered token, a made-up token and an over-budget id all go to
    svc-auth, exactly as in Phase 1.
    """
    token, orgID, agentID = harness.auth.addTenant()
    harness.startSession(token)
    result(harness.client.validateToken(token))
    result(harness.client.validateAgent(token, agentID, orgID))
    harness.feed.isLive = False
    result(harness.client.validateToken(token))
    result(harness.client.validateAgent(token, agentID, orgID))
    result(harness.client.validateToken(formatToken(uuid.uuid4(), newSecret())))
    assert harness.calls("ValidateToken") == 3
    assert not harness.feed.waiting
    assert harness.calls("ValidateAgent") == 2
    assert harness.sample("svc_proxy_auth_local_refusals_total", reason="unknown_token") == 0


def test_aChangeOfTheTokenDropsItsAnswer(harness: Harness) -> None:
    """
    The feed's news of a token (revoked, say) drops its answer: the next
    validation asks svc-auth.
    """
    token, _, _ = harness.auth.addTenant()
    harness.startSession(token)
    result(harness.client.validateToken(token))
    harness.cache.tokenChanged(harness.tokenID(token).bytes)
    harness.auth.tokens[token] = ApiError(ErrorCode.INVALID_TOKEN)
    refusal = result(harness.client.validateToken(token))
    assert isinstance(refusal, ApiError) and refusal.code is ErrorCode.INVALID_TOKEN


def test_anAnswerSoonAfterAChangeIsServedButNotKept(harness: Harness) -> None:
    """
    An answer to a call sent less than the replicas' lag after the feed
    reported a change of that token may come from a replica that has not
    heard of it yet: it answers its request but is not kept; once the lag
    has passed, answers are kept again.
    """
    token, _, _ = harness.auth.addTenant()
    harness.startSession(token)
    harness.cache.tokenChanged(harness.tokenID(token).bytes)
    harness.clock.advance(LAG - 0.1)
    result(harness.client.validateToken(token))
    result(harness.client.validateToken(token))
    assert harness.calls("ValidateToken") == 2
    harness.clock.advance(0.2)
    result(harness.client.validateToken(token))
    result(harness.client.validateToken(token))
    assert harness.calls("ValidateToken") == 3


def test_aChangeDuringTheCallKeepsItsAnswerOut(harness: Harness) -> None:
    """
    A change reported while the call is in flight keeps that call's answer
    out of memory, and so does a new feed session.
    """
    from twisted.internet.defer import Deferred

    token, _, _ = harness.auth.addTenant()
    harness.startSession(token)
    info = harness.auth.tokens[token]
    for interrupt in (
        lambda: harness.cache.tokenChanged(harness.tokenID(token).bytes),
        lambda: harness.cache.feedStarted(harness.cache._known),
    ):
        pending: Deferred[TokenInfo] = Deferred()
        harness.auth.tokens[token] = pending
        answer = harness.client.validateToken(token)
        interrupt()
        harness.clock.advance(LAG + 0.1)
        pending.callback(info)  # type: ignore[arg-type]
        assert result(answer) == info
        harness.auth.tokens[token] = info
        before = harness.calls("ValidateToken")
        result(harness.client.validateToken(token))
        assert harness.calls("ValidateToken") == before + 1


def test_aNewSessionForgetsEverything(harness: Harness) -> None:
    """
    A new feed session (after an outage in which changes may have been
    missed) starts from an empty memory.
    """
    token, orgID, agentID = harness.auth.addTenant()
    harness.startSession(token)
    result(harness.client.validateToken(token))
    result(harness.client.validateAgent(token, agentID, orgID))
    harness.startSession(token)
    assert len(harness.cache) == 0


def test_aTokenIsNeverAnsweredFromMemoryPastItsExpiry(harness: Harness) -> None:
    """
    A remembered token is used up to the instant before its expires_at
    and never at or after it.
    """
    token, orgID, _ = harness.auth.addTenant()
    expires = harness.wall[0] + 30
    stamp = datetime.datetime.fromtimestamp(expires, datetime.UTC).isoformat()
    harness.auth.tokens[token] = TokenInfo(orgID=orgID, permissions=1, expiresAt=stamp)
    harness.startSession(token)
    result(harness.client.validateToken(token))
    harness.wall[0] = expires - 0.001
    assert isinstance(result(harness.client.validateToken(token)), TokenInfo)
    assert harness.calls("ValidateToken") == 1
    harness.wall[0] = expires
    harness.auth.tokens[token] = ApiError(ErrorCode.INVALID_TOKEN)
    assert isinstance(result(harness.client.validateToken(token)), ApiError)
    assert harness.calls("ValidateToken") == 2


def test_answersLiveAtMostTheirTTL(harness: Harness) -> None:
    """
    A remembered answer is used for less than the TTL, then asked again.
    """
    token, _, _ = harness.auth.addTenant()
    harness.startSession(token)
    result(harness.client.validateToken(token))
    harness.clock.advance(TTL - 1)
    result(harness.client.validateToken(token))
    assert harness.calls("ValidateToken") == 1
    harness.clock.advance(1.001)
    result(harness.client.validateToken(token))
    assert harness.calls("ValidateToken") == 2


def test_memoryIsBoundedLeastRecentlyUsedFirst() -> None:
    """
    At most C{size} answers are kept; the least recently used goes first.
    """
    clock = Clock()
    auth = FakeAuthClient()
    cache = ValidationCache(clock, lambda: 0.0, size=3, ttl=TTL, failureBudget=BUDGET)
    client = CachingAuthClient(auth, cache, SwitchableFeed(), ProxyMetrics())
    tokens = [auth.addTenant()[0] for _ in range(4)]
    known = KnownTokens()
    for token in tokens:
        parsed = parseToken(token)
        assert parsed is not None
        known.add(parsed.tokenID.bytes)
    cache.feedStarted(known)
    clock.advance(LAG + 0.1)
    for token in tokens[:3]:
        result(client.validateToken(token))
    result(client.validateToken(tokens[0]))  # now the most recent
    result(client.validateToken(tokens[3]))  # pushes out tokens[1]
    assert len(cache) == 3
    before = len(auth.calls)
    result(client.validateToken(tokens[0]))
    assert len(auth.calls) == before
    result(client.validateToken(tokens[1]))
    assert len(auth.calls) == before + 1


def test_noRawTokenOrSecretIsKept(harness: Harness) -> None:
    """
    Nothing the cache keeps holds the bearer or its secret (keys are token
    ids, secrets are kept as keyed digests).
    """
    token, orgID, agentID = harness.auth.addTenant()
    harness.startSession(token)
    result(harness.client.validateToken(token))
    result(harness.client.validateAgent(token, agentID, orgID))
    secret = parseToken(token).secret  # type: ignore[union-attr]
    seen = repr(harness.cache._entries) + repr(list(harness.cache._entries))
    for entry in harness.cache._entries.values():
        seen += repr(attrs.asdict(entry))
    assert token not in seen and secret not in seen


def test_agentAnswersAreKeptPerOrganization(harness: Harness) -> None:
    """
    An active agent is answered from memory after one call, and so are a
    suspended agent's and an unknown agent's refusals; the feed's news of
    the agent drops its answers.
    """
    token, orgID, agentID = harness.auth.addTenant()
    paused, pausedOrg, pausedAgent = harness.auth.addTenant(status="paused")
    harness.startSession(token, paused)
    stranger = str(uuid.uuid4())
    for _ in range(3):
        assert isinstance(result(harness.client.validateAgent(token, agentID, orgID)), AgentInfo)
        suspended = result(harness.client.validateAgent(paused, pausedAgent, pausedOrg))
        assert suspended.code is ErrorCode.AGENT_SUSPENDED
        unknown = result(harness.client.validateAgent(token, stranger, orgID))
        assert unknown.code is ErrorCode.AGENT_NOT_AUTHORIZED
    assert harness.calls("ValidateAgent") == 3
    harness.cache.agentChanged(uuid.UUID(pausedAgent).bytes)
    harness.auth.agents[pausedAgent] = AgentInfo(pausedAgent, pausedOrg, "active")
    harness.clock.advance(LAG + 0.1)
    assert isinstance(
        result(harness.client.validateAgent(paused, pausedAgent, pausedOrg)), AgentInfo
    )
    assert harness.calls("ValidateAgent") == 4


def test_aTokenRevokedBetweenTheCallsIsNotKeptForTheAgent(harness: Harness) -> None:
    """
    ValidateAgent answering INVALID_TOKEN (the token revoked between the
    two calls) is about the token, not the agent: it is not kept.
    """
    token, orgID, agentID = harness.auth.addTenant()
    harness.startSession(token)
    harness.auth.agents[agentID] = ApiError(ErrorCode.INVALID_TOKEN)
    result(harness.client.validateAgent(token, agentID, orgID))
    result(harness.client.validateAgent(token, agentID, orgID))
    assert harness.calls("ValidateAgent") == 2


def test_startAndCloseReachTheFeedAndTheInnerClient(harness: Harness) -> None:
    """
    The service's start and stop start and stop both the feed and the gRPC
    client.
    """
    harness.client.start()
    assert harness.feed.started and harness.auth.started
    harness.client.close()
    assert harness.feed.stopped and harness.auth.closed


# The Bloom filter of known token ids.


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(min_size=16, max_size=16), max_size=300), st.integers(0, 1000))
def test_knownTokensHasNoFalseNegatives(ids: list[bytes], expected: int) -> None:
    """
    Every id added is found, whatever the sizing.
    """
    known = KnownTokens(expected)
    for tokenID in ids:
        known.add(tokenID)
    assert all(tokenID in known for tokenID in ids)


def test_knownTokensGrowsWithoutLosingIDs() -> None:
    """
    Past a layer's capacity a new, larger layer takes the next ids; every
    id is still found, and the memory grew instead of the error rate.
    """
    known = KnownTokens(0, key=b"k" * 16)
    before = known.memoryBytes()
    ids = [os.urandom(16) for _ in range(MINIMUM_CAPACITY + 1000)]
    known.addPacked(b"".join(ids))
    assert known.memoryBytes() == before * 3
    assert all(tokenID in known for tokenID in ids)
    assert len(known) == len(ids)


def test_knownTokensRarelyKnowsAMadeUpID() -> None:
    """
    Half full, as after a snapshot, the filter says "maybe" for a made-up
    id about once in 40,000 times; 100,000 probes find a handful at most.
    """
    known = KnownTokens(20_000, key=b"k" * 16)
    known.addPacked(os.urandom(16 * 20_000))
    falsePositives = sum(os.urandom(16) in known for _ in range(100_000))
    assert falsePositives <= 20


def test_knownTokensMemoryForAMillion() -> None:
    """
    Sized for a snapshot of a million tokens, the filter takes 4 MB (the
    figure the operations guide gives).
    """
    assert KnownTokens(1_000_000).memoryBytes() == 4_000_000
