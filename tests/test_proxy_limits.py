"""
Limits rows in svc-proxy (decisions D11), piece by piece: the book of rows
and where it learns them, the reservation of a chat request (and of an
embeddings request, decisions D13), and the
admission script against a real Redis: every counter of a request
checked and counted at once, a refused request counting against none,
exact across two limiters sharing Redis, token reservations cut to
C{tpm} and settled. The Lua script is held to its Python twin (the
in-memory counters other tests use) by a Hypothesis test. The whole path
through real daemons is in tests/test_gateway_limits.py.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from limitshelpers import (
    AGENT_ID,
    DAY_END,
    DAY_START,
    ORG_DAY,
    ORG_ID,
    WINDOW,
    Ledger,
    budgetBook,
    counter,
    fakeClock,
    redisCall,
    waitFor,
)
from proxydoubles import MemoryCounters
from twisted.internet.defer import Deferred, gatherResults

from svcd.authclient.feed import limitsRowOf
from svcd.common.config import parseRedisURL
from svcd.devkit.redis import RedisServer
from svcd.limits.book import NO_LIMITS, Applicable, LimitBook, LimitsRow
from svcd.limits.check import RateDecision
from svcd.limits.keys import AGENT, BUDGET, ORG, REQUESTS, TOKENS, Counter, budgetPeriod
from svcd.limits.limiter import RedisRateLimiter
from svcd.limits.link import linkFor
from svcd.limits.records import Budget, Limits, Reservation
from svcd.limits.reservation import (
    DEFAULT_OUTPUT_CAP,
    embeddingsRefusal,
    inputsEstimate,
    namedCap,
    outputCap,
    promptEstimate,
    reserveEmbeddings,
)
from svcd.limits.scripts import (
    ADMIT_SCRIPT,
    LedgerWork,
    admitArguments,
    packAdmitArguments,
    parseAdmitReply,
)
from svcd.metering.bodies import embeddingsBody
from svcd.metering.models import EMBEDDING, Model, Provider
from svcd.metering.prices import Price
from svcd.pb.auth.v1 import auth_pb2
from svcd.providers.table import ProviderTable
from svcd.proxy.http.chatbody import parseChatBody
from svcd.proxy.http.embeddingsbody import parseEmbeddingsBody
from svcd.proxy.validation.client import limitsOf

OTHER_AGENT = "1f2e3d4c-5b6a-4798-8a7b-6c5d4e3f2a1b"


# The book


def decided(decisions: list[RateDecision | None]) -> list[RateDecision]:
    """
    The decisions of hits that each met a limit: none of them is None.
    """
    assert None not in decisions
    return [d for d in decisions if d is not None]


def test_bookWithoutRowsAppliesNothing() -> None:
    """
    An empty book answers the shared empty value, so the limiter keeps
    D5's path for every organization.
    """
    assert LimitBook().applicable(ORG_ID, AGENT_ID) is NO_LIMITS


def test_bookFromTheFeed() -> None:
    """
    A snapshot replaces every row (cleared ones dropped); a change sets,
    replaces or clears one; the agent's row is found only with its
    organization.
    """
    book = LimitBook()
    org = Limits(rpm=10, version=1)
    agent = Limits(tpm=500, version=2)
    book.replace(
        [
            LimitsRow(ORG_ID, None, org),
            LimitsRow(ORG_ID, AGENT_ID, agent),
            LimitsRow(str(uuid.uuid4()), None, None),
        ]
    )
    assert len(book) == 2
    assert book.applicable(ORG_ID, AGENT_ID) == Applicable(org, agent)
    assert book.applicable(ORG_ID, OTHER_AGENT) == Applicable(org, None)
    assert book.applicable(str(uuid.uuid4()), AGENT_ID) is NO_LIMITS
    book.changed(LimitsRow(ORG_ID, None, None))
    assert book.applicable(ORG_ID, AGENT_ID) == Applicable(None, agent)
    book.replace([])
    assert len(book) == 0


def test_bookLearnsFromAnswersOnlyWithoutALiveFeed() -> None:
    """
    While the feed is live its rows rule, so an answer read before a
    change cannot undo it; without one, each answer's row is taken (and
    an answer without a row clears it).
    """
    book = LimitBook()
    live = [True]
    book.feedLive = lambda: live[0]
    book.learnOrg(ORG_ID, Limits(rpm=5))
    book.learnAgent(ORG_ID, AGENT_ID, Limits(rpm=2))
    assert book.applicable(ORG_ID, AGENT_ID) is NO_LIMITS
    live[0] = False
    book.learnOrg(ORG_ID, Limits(rpm=5))
    book.learnAgent(ORG_ID, AGENT_ID, Limits(rpm=2))
    assert book.applicable(ORG_ID, AGENT_ID) == Applicable(Limits(rpm=5), Limits(rpm=2))
    book.learnAgent(ORG_ID, AGENT_ID, None)
    assert book.applicable(ORG_ID, AGENT_ID) == Applicable(Limits(rpm=5), None)


def test_limitsOffTheWire() -> None:
    """
    An unset value is absent on the wire and None here; a value that is
    not positive is never a limit of zero; a feed row with ids that are
    not 16 bytes is ignored.
    """
    answer = auth_pb2.ValidateTokenResponse(
        org_id=ORG_ID, org_limits=auth_pb2.Limits(tpm=900, max_output_tokens=0, version=7)
    )
    assert limitsOf(answer, "org_limits") == Limits(tpm=900, version=7)
    assert limitsOf(auth_pb2.ValidateTokenResponse(org_id=ORG_ID), "org_limits") is None
    change = auth_pb2.LimitsChanged(
        org_id=uuid.UUID(ORG_ID).bytes,
        agent_id=uuid.UUID(AGENT_ID).bytes,
        limits=auth_pb2.Limits(rpm=3, version=9),
    )
    assert limitsRowOf(change) == LimitsRow(ORG_ID, AGENT_ID, Limits(rpm=3, version=9))
    cleared = auth_pb2.LimitsChanged(org_id=uuid.UUID(ORG_ID).bytes)
    assert limitsRowOf(cleared) == LimitsRow(ORG_ID, None, None)
    assert limitsRowOf(auth_pb2.LimitsChanged(org_id=b"short")) is None


# The reservation


def test_promptEstimate() -> None:
    """
    The UTF-8 bytes of every message's content divided by 3, rounded up,
    plus 4 per message.
    """
    messages = [
        {"role": "system", "content": "abcd"},  # 4 bytes
        {"role": "user", "content": "é"},  # 2 bytes
        {"role": "user", "content": "日本"},  # 6 bytes
    ]
    assert promptEstimate(messages) == -(-12 // 3) + 4 * 3 == 16
    assert promptEstimate([{"role": "user", "content": "a"}]) == 1 + 4
    assert promptEstimate([]) == 0


def test_outputCapOrder() -> None:
    """
    max_completion_tokens, else max_tokens, else the agent's, else the
    organization's, else the model's, else 4096; a boolean or a value
    that is not positive is no cap.
    """
    both = Applicable(Limits(maxOutputTokens=300), Limits(maxOutputTokens=200))
    orgOnly = Applicable(Limits(maxOutputTokens=300), None)
    document = {"max_completion_tokens": 50, "max_tokens": 80}
    assert outputCap(document, both, 1000) == 50
    assert outputCap({"max_tokens": 80}, both, 1000) == 80
    assert outputCap({"max_tokens": True}, both, 1000) == 200
    assert outputCap({"max_tokens": 0}, orgOnly, 1000) == 300
    assert outputCap({}, NO_LIMITS, 1000) == 1000
    assert outputCap({}, NO_LIMITS, None) == DEFAULT_OUTPUT_CAP


# The admission script, against a real Redis


async def limiterWith(
    redisURL: str, book: LimitBook, clock: Any = None, defaultRPM: int = 60
) -> RedisRateLimiter:
    from twisted.internet import reactor

    target = parseRedisURL(redisURL)
    assert target is not None
    link = linkFor(reactor, target)
    # Settlements at once: these tests' clock does not move by itself
    # (test_settlementsRideOnTheNextAdmission covers the delay).
    limiter = RedisRateLimiter(
        link,
        clock if clock is not None else fakeClock(WINDOW + 30),
        defaultRPM,
        book=book,
        settleDelay=0,
    )
    limiter.start()
    await waitFor(lambda: link.connected)
    return limiter


def bookOf(org: Limits | None = None, agent: Limits | None = None) -> LimitBook:
    book = LimitBook()
    rows = [LimitsRow(ORG_ID, None, org), LimitsRow(ORG_ID, AGENT_ID, agent)]
    book.replace(rows)
    return book


ORG_REQUESTS = f"ratelimit:{{{ORG_ID}}}:{WINDOW}"
ORG_TOKENS = ORG_REQUESTS + ":tokens"
AGENT_REQUESTS = f"{ORG_REQUESTS}:agent:{AGENT_ID}"
AGENT_TOKENS = AGENT_REQUESTS + ":tokens"


@pytest_twisted.ensureDeferred
async def test_orgRowWinsOverTheEnvironmentAndRefusalsCountNothing(
    redisURL: str, redisServer: RedisServer
) -> None:
    """
    An organization's row sets its requests per minute over the
    environment's default; past it a request is refused as the org's
    requests limit, and the counter keeps only what was admitted.
    """
    limiter = await limiterWith(redisURL, bookOf(org=Limits(rpm=2)), defaultRPM=60)
    try:
        decisions = [await limiter.hit(ORG_ID, AGENT_ID) for _ in range(4)]
        assert [(d.allowed, d.limit, d.remaining, d.refusedBy) for d in decisions if d] == [
            (True, 2, 1, None),
            (True, 2, 0, None),
            (False, 2, 0, (REQUESTS, ORG)),
            (False, 2, 0, (REQUESTS, ORG)),
        ]
        assert decisions[-1] is not None and decisions[-1].retryAfter == 30
        assert counter(redisServer, ORG_REQUESTS) == 2
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_agentRowOnTopOfItsOrganization(redisURL: str, redisServer: RedisServer) -> None:
    """
    An agent's own rpm applies under its organization's: its third
    request is refused as the agent's limit (and counts against neither),
    while another agent of the organization goes on under the org's. The
    headers describe the requests limit with the least room.
    """
    limiter = await limiterWith(redisURL, bookOf(org=Limits(rpm=5), agent=Limits(rpm=2)))
    try:
        first = await limiter.hit(ORG_ID, AGENT_ID)
        assert first is not None and (first.limit, first.remaining) == (2, 1)
        await limiter.hit(ORG_ID, AGENT_ID)
        refused = await limiter.hit(ORG_ID, AGENT_ID)
        assert refused is not None and refused.refusedBy == (REQUESTS, AGENT)
        other = await limiter.hit(ORG_ID, OTHER_AGENT)
        assert other is not None and other.allowed and (other.limit, other.remaining) == (5, 2)
        assert counter(redisServer, ORG_REQUESTS) == 3
        assert counter(redisServer, AGENT_REQUESTS) == 2
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_tokensReservedThenSettled(redisURL: str, redisServer: RedisServer) -> None:
    """
    A token limit reserves the request's tokens at admission, shows the
    -Tokens headers (remaining after the reservation), and a settlement
    corrects the minute's count to what the provider counted.
    """
    limiter = await limiterWith(redisURL, bookOf(org=Limits(tpm=1000)))
    try:
        decision = await limiter.hit(ORG_ID, AGENT_ID, tokens=300)
        assert decision is not None and decision.allowed
        assert decision.reservation == Reservation((ORG_TOKENS,), 300)
        assert (decision.tokenLimit, decision.tokenRemaining) == (1000, 700)
        assert dict(decision.headers())[b"X-RateLimit-Remaining-Tokens"] == b"700"
        assert dict(decision.headers())[b"X-RateLimit-Limit-Tokens"] == b"1000"
        assert dict(decision.headers())[b"X-RateLimit-Reset-Tokens"] == b"%d" % (WINDOW + 60)
        assert counter(redisServer, ORG_TOKENS) == 300
        limiter.settle(decision.reservation, 120)
        await waitFor(lambda: counter(redisServer, ORG_TOKENS) == 120)
        # A release (an answer that failed before its first byte).
        second = await limiter.hit(ORG_ID, AGENT_ID, tokens=50)
        assert second is not None and second.reservation is not None
        assert counter(redisServer, ORG_TOKENS) == 170
        limiter.settle(second.reservation, 0)
        await waitFor(lambda: counter(redisServer, ORG_TOKENS) == 120)
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_aCallThatCountsNoRequest(redisURL: str, redisServer: RedisServer) -> None:
    """
    svc-worker's calls (decisions D13) count against token limits, never
    against a requests limit: with the org's and agent's rpm spent, such a
    call is still admitted and reserves its tokens, is refused as a token
    limit past tpm, and counts no request; with no token limit nor budget
    it is not even a call to Redis (no decision, nothing counted).
    """
    book = bookOf(org=Limits(rpm=1, tpm=1000), agent=Limits(rpm=1))
    limiter = await limiterWith(redisURL, book)
    try:
        assert (await limiter.hit(ORG_ID, AGENT_ID)) is not None
        spent = await limiter.hit(ORG_ID, AGENT_ID)
        assert spent is not None and spent.refusedBy == (REQUESTS, ORG)
        worker = await limiter.hitTokens(ORG_ID, AGENT_ID, 600, 0)
        assert worker is not None and worker.allowed
        assert worker.reservation == Reservation((ORG_TOKENS,), 600)
        refused = await limiter.hitTokens(ORG_ID, AGENT_ID, 600, 0)
        assert refused is not None and refused.refusedBy == (TOKENS, ORG)
        assert counter(redisServer, ORG_REQUESTS) == 1
        assert counter(redisServer, AGENT_REQUESTS) == 1
        assert counter(redisServer, ORG_TOKENS) == 600
        book.replace([LimitsRow(ORG_ID, None, Limits(rpm=1))])
        assert (await limiter.hitTokens(ORG_ID, AGENT_ID, 600, 0)) is None
        assert counter(redisServer, ORG_REQUESTS) == 1
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_reservationLargerThanTheLimitIsCutToIt(
    redisURL: str, redisServer: RedisServer
) -> None:
    """
    A reservation larger than the whole tpm (the smallest that applies)
    is cut to it: admitted in an empty minute, never locked out; the next
    request of the minute is refused as that token limit.
    """
    limiter = await limiterWith(
        redisURL, bookOf(org=Limits(tpm=1000), agent=Limits(tpm=100, rpm=50))
    )
    try:
        huge = await limiter.hit(ORG_ID, AGENT_ID, tokens=100_000)
        assert huge is not None and huge.allowed
        assert huge.reservation == Reservation((ORG_TOKENS, AGENT_TOKENS), 100)
        assert (huge.tokenLimit, huge.tokenRemaining) == (100, 0)
        refused = await limiter.hit(ORG_ID, AGENT_ID, tokens=1)
        assert refused is not None and refused.refusedBy == (TOKENS, AGENT)
        assert refused.reservation is None
        # Refused: counted against none of its four counters.
        assert counter(redisServer, ORG_REQUESTS) == 1
        assert counter(redisServer, AGENT_REQUESTS) == 1
        assert counter(redisServer, ORG_TOKENS) == 100
        assert counter(redisServer, AGENT_TOKENS) == 100
        # A request that reserves nothing (an auth probe) still passes.
        probe = await limiter.hit(ORG_ID, AGENT_ID, tokens=0)
        assert probe is not None and probe.allowed and probe.tokenRemaining == 0
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_aChangeNeverResetsTheMinute(redisURL: str) -> None:
    """
    Raising a limit mid-minute goes on from what the minute counted.
    """
    book = bookOf(org=Limits(rpm=2))
    limiter = await limiterWith(redisURL, book)
    try:
        assert [(await limiter.hit(ORG_ID, None)).allowed for _ in range(3)] == [  # type: ignore[union-attr]
            True,
            True,
            False,
        ]
        book.changed(LimitsRow(ORG_ID, None, Limits(rpm=4)))
        decisions = [await limiter.hit(ORG_ID, None) for _ in range(3)]
        assert [(d.allowed, d.remaining) for d in decisions if d] == [
            (True, 1),
            (True, 0),
            (False, 0),
        ]
    finally:
        await limiter.stop()


@pytest.mark.parametrize("agentRow", [False, True], ids=["org", "agent under org"])
@pytest_twisted.ensureDeferred
async def test_exactAcrossTwoLimiters(
    redisURL: str, redisServer: RedisServer, agentRow: bool
) -> None:
    """
    Two limiters (two replicas) on one Redis, 192 concurrent requests of
    one organization: exactly rpm are admitted and counted; with tpm and
    known reservations, the tokens reserved never pass tpm. With an agent
    row below its organization's, exactly the agent's rpm pass for it.
    (One fake clock for both, inside one minute: a real one could turn
    the minute during the test.)
    """
    agent = Limits(rpm=20, tpm=4000) if agentRow else None
    book = bookOf(org=Limits(rpm=50, tpm=10_000), agent=agent)
    clock = fakeClock(WINDOW + 30)
    replicas = [await limiterWith(redisURL, book, clock) for _ in range(2)]
    try:
        decisions: list[RateDecision | None] = await gatherResults(
            [
                Deferred.fromCoroutine(replicas[index % 2].hit(ORG_ID, AGENT_ID, tokens=150))
                for index in range(192)
            ]
        )
        assert all(d is not None for d in decisions)
        admitted = [d for d in decisions if d is not None and d.allowed]
        rpm = 20 if agentRow else 50
        assert len(admitted) == rpm
        assert counter(redisServer, ORG_REQUESTS) == rpm
        assert counter(redisServer, ORG_TOKENS) == 150 * rpm <= 10_000
        if agentRow:
            assert counter(redisServer, AGENT_REQUESTS) == rpm
            assert counter(redisServer, AGENT_TOKENS) == 150 * rpm <= 4000
    finally:
        for replica in replicas:
            await replica.stop()


@pytest_twisted.ensureDeferred
async def test_tokensNeverPassTheLimitUnderConcurrency(
    redisURL: str, redisServer: RedisServer
) -> None:
    """
    64 concurrent requests reserving 700 tokens each against a tpm of
    10,000 (and an rpm that never refuses), through two limiters: 14
    admitted (9,800 tokens), 50 refused as the token limit.
    """
    book = bookOf(org=Limits(rpm=1000, tpm=10_000))
    clock = fakeClock(WINDOW + 30)
    replicas = [await limiterWith(redisURL, book, clock) for _ in range(2)]
    try:
        decisions = decided(
            await gatherResults(
                [
                    Deferred.fromCoroutine(replicas[i % 2].hit(ORG_ID, AGENT_ID, tokens=700))
                    for i in range(64)
                ]
            )
        )
        admitted = [d for d in decisions if d.allowed]
        assert len(admitted) == 14
        assert counter(redisServer, ORG_TOKENS) == 9_800
        assert {d.refusedBy for d in decisions if not d.allowed} == {(TOKENS, ORG)}
    finally:
        for replica in replicas:
            await replica.stop()


class HeldCounters(MemoryCounters):
    """
    Admission calls answered only when the test says (in order), and
    settlements sent on their own recorded.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[Deferred[None], list[int]]] = []
        self.alone: list[tuple[list[str], list[int]]] = []

    def admit(
        self,
        keys: list[str],
        arguments: list[int],
        adjustments: list[int] | None = None,
        ledger: Any = None,
    ) -> Deferred[list[list[int]]]:
        answer: Deferred[list[list[int]]] = Deferred()
        super().admit(keys, arguments, adjustments, ledger).addCallback(answer.callback)
        held: Deferred[None] = Deferred()
        self.held.append((held, list(adjustments or [])))
        return held.addCallback(lambda _: answer)

    def adjust(self, keys: list[str], deltas: list[int]) -> Deferred[object]:
        self.alone.append((list(keys), list(deltas)))
        return super().adjust(keys, deltas)

    def answerNext(self) -> list[int]:
        held, adjustments = self.held.pop(0)
        held.callback(None)
        return adjustments


def test_settlementsRideOnTheNextAdmission() -> None:
    """
    A settlement made while an admission call of the organization is in
    flight is not a round trip of its own: it goes with the next
    admission call; once no admission call follows within the settle
    delay, what is left goes alone. The counts are the same either way.
    """
    counters = HeldCounters()
    clock = fakeClock(WINDOW + 30)
    limiter = RedisRateLimiter(
        counters, clock, 60, book=bookOf(org=Limits(tpm=1000, rpm=1000)), settleDelay=0.01
    )
    first = Deferred.fromCoroutine(limiter.hit(ORG_ID, AGENT_ID, tokens=300))
    assert counters.answerNext() == []
    decision = first.result
    assert isinstance(decision, RateDecision)
    assert decision.reservation == Reservation((ORG_TOKENS,), 300)
    second = Deferred.fromCoroutine(limiter.hit(ORG_ID, AGENT_ID, tokens=200))
    # Settled while the second's call is in flight: nothing goes alone.
    limiter.settle(decision.reservation, 120)
    assert counters.alone == []
    third = Deferred.fromCoroutine(limiter.hit(ORG_ID, AGENT_ID, tokens=100))
    assert counters.answerNext() == []
    # The third's call, sent as the second's ended, carries the settlement.
    assert counters.held[0][1] == [2, -180]
    assert counters.answerNext() == [2, -180]
    assert counters.counts[ORG_TOKENS] == 300 - 180 + 200 + 100
    # The last admission has ended: the next settlement waits a moment for
    # one to ride on, then goes alone.
    secondDecision = second.result
    assert isinstance(secondDecision, RateDecision)
    assert secondDecision.reservation is not None
    limiter.settle(secondDecision.reservation, 50)
    assert counters.alone == []
    clock.advance(0.01)
    assert counters.alone == [([ORG_TOKENS], [-150])]
    assert counters.counts[ORG_TOKENS] == 420 - 150
    thirdDecision = third.result
    assert isinstance(thirdDecision, RateDecision)
    assert thirdDecision.allowed


# The Lua script and its Python twin


def _evalInRedis(
    server: RedisServer, script: str, keys: list[str], arguments: list[int] | list[str]
) -> Any:
    """
    EVAL over a plain socket, with the reply read whole (RESP integers,
    bulk strings and arrays).
    """
    return redisCall(server, "EVAL", script, str(len(keys)), *keys, *map(str, arguments))


@st.composite
def _request(draw: st.DrawFn) -> tuple[Counter, ...]:
    keys = draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=4, unique=True))
    return tuple(
        Counter(
            key,
            draw(st.integers(min_value=0, max_value=30)),
            draw(st.integers(min_value=1, max_value=60)),
            REQUESTS,
            ORG,
            # 0: a counter that must exist (a budget's), else refused -c.
            ttl=draw(st.sampled_from([0, 120])),
        )
        for key in keys
    )


_LEDGER_IDS = ["L1", "L2", "L3", "L4"]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batches=st.lists(
        st.tuples(
            st.lists(
                st.tuples(_request(), st.sampled_from([None, *_LEDGER_IDS])),
                min_size=1,
                max_size=6,
            ),
            st.lists(
                st.tuples(st.sampled_from("abcde"), st.integers(min_value=-20, max_value=20)),
                max_size=3,
                unique_by=lambda pair: pair[0],
            ),
            st.lists(
                st.tuples(
                    st.sampled_from("abcd"),
                    st.sampled_from(_LEDGER_IDS),
                    st.integers(min_value=0, max_value=40),
                ),
                max_size=3,
                unique_by=lambda triple: triple[:2],
            ),
            st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from(_LEDGER_IDS)), max_size=3),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_scriptAgreesWithItsTwin(
    redisServer: RedisServer,
    batches: list[
        tuple[
            list[tuple[tuple[Counter, ...], str | None]],
            list[tuple[str, int]],
            list[tuple[str, str, int]],
            list[tuple[str, str]],
        ]
    ],
) -> None:
    """
    Random batches of requests over a few counters, each with settlements
    riding on it (of the batch's counters or of others, existing or not),
    and (decisions D12, amended) ledger ids on some requests, settlements
    of budget members (present, swept or never made) and marks of recorded
    rows: the Lua script in Redis and the in-memory counters answer alike,
    request by request, and leave the same counts, members, leases (to
    the clock's drift) and marks.
    """
    # In braces: every key of one call in one slot of a Redis Cluster.
    prefix = f"twin:{{{uuid.uuid4()}}}:"
    memory = MemoryCounters()
    # One key exists from the start in both, so counters that must exist
    # are sometimes found.
    redisServer.command("SET", prefix + "a", "5")
    memory.counts[prefix + "a"] = 5
    used: set[str] = set()
    for batch, deltas, settlements, marks in batches:
        renamed = [
            tuple(
                Counter(prefix + c.key, c.amount, c.limit, c.kind, c.scope, ttl=c.ttl)
                for c in counters
            )
            for counters, _ in batch
        ]
        keys, arguments = admitArguments(renamed)

        def indexOf(name: str, keys: list[str] = keys) -> int:
            if prefix + name not in keys:
                keys.append(prefix + name)
            return keys.index(prefix + name) + 1

        adjustments: list[int] = []
        for name, delta in deltas:
            adjustments += (indexOf(name), delta)
        ledger = LedgerWork(
            ",".join(ledgerID or "-" for _, ledgerID in batch),
            ",".join(f"{indexOf(name)},{ledgerID},{cost}" for name, ledgerID, cost in settlements),
            ",".join(f"{indexOf(name)},{ledgerID}" for name, ledgerID in marks),
            "30000,300000",
        )
        used.update(keys)
        inRedis = parseAdmitReply(
            _evalInRedis(
                redisServer,
                ADMIT_SCRIPT,
                keys,
                [
                    packAdmitArguments(arguments),
                    packAdmitArguments(adjustments),
                    *ledger.arguments(),
                ],
            )
        )
        inMemory: list[list[int]] = []
        memory.admit(keys, arguments, adjustments, ledger).addCallback(inMemory.extend)
        assert inRedis == inMemory
    for key, value in memory.counts.items():
        assert counter(redisServer, key) == value
    for key in used:
        members = redisCall(redisServer, "HGETALL", key + ":members")
        assert {
            members[i].decode(): int(members[i + 1]) for i in range(0, len(members), 2)
        } == memory.members.get(key, {})
        for suffix, twin in ((":leases", memory.leases), (":recorded", memory.recordedAt)):
            scores = redisCall(redisServer, "ZRANGE", key + suffix, "0", "-1", "WITHSCORES")
            inRedisScores = {
                scores[i].decode(): int(scores[i + 1]) for i in range(0, len(scores), 2)
            }
            assert set(inRedisScores) == set(twin.get(key, {}))
            for ledgerID, score in inRedisScores.items():
                assert abs(score - twin[key][ledgerID]) < 5000


def test_scriptCountsExactlyToWhatADoubleHolds(redisServer: RedisServer) -> None:
    """
    Amounts and counts up to 2**53 (nine million dollars in nano-dollars;
    a month's spend of a large organization has 15 digits already) are
    added and answered exactly: Lua's numbers are doubles, whose own text
    turns into "1e+15" past 14 digits.
    """
    key = f"big:{uuid.uuid4()}"
    amount = 2**53 - 10
    counters = (Counter(key, amount, 2**53, REQUESTS, ORG), Counter(key, 1, 2**53, REQUESTS, ORG))
    keys, arguments = admitArguments([counters])
    answer = parseAdmitReply(
        _evalInRedis(redisServer, ADMIT_SCRIPT, keys, [packAdmitArguments(arguments)])
    )
    assert answer == [[0, amount, amount + 1]]
    assert counter(redisServer, key) == amount + 1


# Budgets (decisions D12)


# 2023-11-14T22:14:00Z, inside WINDOW's month.
MONTH_START, MONTH_END = budgetPeriod("month", WINDOW)
AGENT_MONTH = f"budget:{{{ORG_ID}}}:month:{MONTH_START}:agent:{AGENT_ID}"


@given(moment=st.integers(min_value=0, max_value=4_102_444_799), fraction=st.floats(0, 0.999))
def test_budgetPeriodsFromTheCacheAreTheCalendars(moment: int, fraction: float) -> None:
    """
    The periods are worked out once a day and remembered: what comes from
    memory is the calendar's own day or month, whatever moment of it asks
    first (its first and last seconds included).
    """
    import datetime

    for period in ("day", "month"):
        start, end = budgetPeriod(period, moment + fraction)
        assert start <= moment < end
        first = datetime.datetime.fromtimestamp(start, datetime.UTC)
        assert (first.hour, first.minute, first.second) == (0, 0, 0)
        assert period == "day" or first.day == 1
        assert budgetPeriod(period, start) == budgetPeriod(period, end - 1) == (start, end)
        assert budgetPeriod(period, end)[0] == end


def test_budgetPeriods() -> None:
    """
    Calendar days and months in UTC, the month's end being the next
    month's first second (December's in the next year).
    """
    assert budgetPeriod("day", 1_700_000_040) == (1_699_920_000, 1_700_006_400)
    assert budgetPeriod("month", 1_700_000_040) == (1_698_796_800, 1_701_388_800)
    december = 1_702_000_000  # 2023-12-08
    assert budgetPeriod("month", december) == (1_701_388_800, 1_704_067_200)


async def budgetLimiter(redisURL: str, book: LimitBook, ledger: Ledger) -> RedisRateLimiter:
    from twisted.internet import reactor

    target = parseRedisURL(redisURL)
    assert target is not None
    link = linkFor(reactor, target)
    limiter = RedisRateLimiter(
        link, fakeClock(WINDOW + 30), 60, book=book, spend=ledger, settleDelay=0
    )
    limiter.start()
    await waitFor(lambda: link.connected)
    return limiter


@pytest_twisted.ensureDeferred
async def test_budgetIsSeededFromTheLedgerThenReserved(
    redisURL: str, redisServer: RedisServer
) -> None:
    """
    The first request of a day asks the ledger what the day has cost
    (once), puts it in Redis unless there, and reserves its worst case on
    top; past the budget a request is refused as the budget, with
    Retry-After to the day's end; a settlement corrects the spend.
    """
    ledger = Ledger(spent=600)
    limiter = await budgetLimiter(redisURL, budgetBook(org=Budget(1000, "day")), ledger)
    try:
        first = await limiter.hit(ORG_ID, AGENT_ID, tokens=10, cost=300)
        assert first is not None and first.allowed
        assert ledger.asked == [(ORG_ID, None, DAY_START, DAY_END)]
        assert counter(redisServer, ORG_DAY) == 900
        ttl = int(redisServer.command("TTL", ORG_DAY)[1:])
        assert DAY_END - WINDOW <= ttl <= DAY_END - WINDOW + 3600
        assert first.reservation == Reservation((), 0, (ORG_DAY,), 300)
        refused = await limiter.hit(ORG_ID, AGENT_ID, tokens=10, cost=101)
        assert refused is not None and refused.refusedBy == (BUDGET, ORG)
        assert refused.retryAfter == DAY_END - (WINDOW + 30)
        assert len(ledger.asked) == 1
        limiter.settle(first.reservation, 0, 40)
        await waitFor(lambda: counter(redisServer, ORG_DAY) == 640)
        again = await limiter.hit(ORG_ID, AGENT_ID, tokens=10, cost=101)
        assert again is not None and again.allowed
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_aRedisThatLostEverythingStillKnowsTheMonth(
    redisURL: str, redisServer: RedisServer
) -> None:
    """
    FLUSHALL mid-month: the next request takes the month's spend again
    from the ledger, so the budget is not reset.
    """
    ledger = Ledger(spent=0)
    book = budgetBook(agent=Budget(1000, "month"))
    limiter = await budgetLimiter(redisURL, book, ledger)
    try:
        assert (await limiter.hit(ORG_ID, AGENT_ID, cost=700)).allowed  # type: ignore[union-attr]
        redisServer.flushAll()
        ledger.spent = 700
        refused = await limiter.hit(ORG_ID, AGENT_ID, cost=400)
        assert refused is not None and refused.refusedBy == (BUDGET, AGENT)
        assert [asked[1] for asked in ledger.asked] == [AGENT_ID, AGENT_ID]
        assert counter(redisServer, AGENT_MONTH) == 700
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_concurrentRequestsSeedOnce(redisURL: str, redisServer: RedisServer) -> None:
    """
    Requests arriving together at an unseeded budget share one question
    to the ledger; then exactly as many are admitted as the budget holds.
    """
    ledger = Ledger(spent=0)
    limiter = await budgetLimiter(redisURL, budgetBook(org=Budget(1000, "day")), ledger)
    try:
        decisions = decided(
            await gatherResults(
                [Deferred.fromCoroutine(limiter.hit(ORG_ID, AGENT_ID, cost=100)) for _ in range(30)]
            )
        )
        assert sum(1 for d in decisions if d.allowed) == 10
        assert len(ledger.asked) == 1
        assert counter(redisServer, ORG_DAY) == 1000
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_aLedgerThatCannotAnswerFailsOpen(redisURL: str) -> None:
    """
    When the ledger cannot be asked, the request goes on without that
    budget (as without Redis), and the next one asks again.
    """
    ledger = Ledger(failing=True)
    limiter = await budgetLimiter(redisURL, budgetBook(org=Budget(1000, "day")), ledger)
    try:
        decision = await limiter.hit(ORG_ID, AGENT_ID, cost=5000)
        assert decision is not None and decision.allowed and decision.reservation is None
        await limiter.hit(ORG_ID, AGENT_ID, cost=1)
        assert len(ledger.asked) == 2
    finally:
        await limiter.stop()


def test_namedCapIsTheLargerOfBoth() -> None:
    """
    Decisions D12, amended: a request naming both caps is bounded by the
    larger (a provider may honour either); naming none, None (the budget
    then sends the cap it assumes).
    """
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]'
    assert namedCap(parseChatBody(body + b"}")) is None
    assert namedCap(parseChatBody(body + b', "max_tokens": 9}')) == 9
    assert namedCap(parseChatBody(body + b', "max_completion_tokens": 9, "max_tokens": 30}')) == 30
    assert namedCap(parseChatBody(body + b', "max_completion_tokens": 40, "max_tokens": 30}')) == 40


# Decisions D13: what an embeddings request reserves


def _embeddingsTable() -> ProviderTable:
    provider = Provider("local", "http://127.0.0.1:8000/v1")
    models = {
        "cheap": Model(
            "cheap",
            provider,
            "e",
            fallbacks=("dear", "free"),
            price=Price(input=20_000_000, output=0, cachedInput=20_000_000),
            kind=EMBEDDING,
            dimensions=64,
        ),
        "dear": Model(
            "dear",
            provider,
            "a-much-longer-upstream-name",
            price=Price(input=130_000_000, output=0, cachedInput=130_000_000),
            kind=EMBEDDING,
        ),
        "free": Model("free", provider, "f", kind=EMBEDDING),
    }
    return ProviderTable(providers={"local": provider}, models=models, path="p", loadedAt=0)


def test_anEmbeddingsReservationIsTheInputsEstimate() -> None:
    """
    Without a budget, an embeddings request reserves its inputs' estimate
    (each input's bytes / 3, rounded up: no tokens per message, no
    output) and no cost.
    """
    table = _embeddingsTable()
    body = parseEmbeddingsBody(b'{"model": "cheap", "input": ["abcd", "\\u00e9", "x"]}')
    tokenLimited = Applicable(Limits(tpm=1000), None)
    assert inputsEstimate(body.inputs) == 2 + 1 + 1
    assert reserveEmbeddings(body, table.models["cheap"], table, ORG_ID, tokenLimited) == (4, 0)


def test_anEmbeddingsBudgetReservesTheDearestBodyAtItsInputPrice() -> None:
    """
    Under a budget the worst case is a token per byte of the body each
    priced model that may answer is sent (its own upstream name in it),
    at its input price, the dearest of those; an unpriced fallback is
    never tried, so it counts nothing.
    """
    table = _embeddingsTable()
    raw = b'{"model": "cheap", "input": ["hello there", "general kenobi"]}'
    body = parseEmbeddingsBody(raw)
    budgeted = Applicable(None, None, orgBudget=Budget(10**9, "day"))
    sentToDear = embeddingsBody(body.document, table.models["dear"])
    assert sentToDear.startswith(b'{"model":"a-much-longer-upstream-name",')
    tokens, cost = reserveEmbeddings(body, table.models["cheap"], table, ORG_ID, budgeted)
    assert (tokens, cost) == (inputsEstimate(body.inputs), len(sentToDear) * 130)


def test_whatAnEmbeddingModelRefuses() -> None:
    """
    Under a budget a model without a price is NO_PRICE on model; dimensions
    past the model's own are TOO_MANY on dimensions; both at once when
    both hold; nothing otherwise (a model without dimensions takes any).
    """
    table = _embeddingsTable()
    wide = parseEmbeddingsBody(b'{"model": "free", "input": "x", "dimensions": 65}')
    refused = embeddingsRefusal(wide, table.models["free"], budgeted=True)
    assert refused is not None
    assert [(each.field, each.code.value) for each in refused.fieldErrors] == [
        ("model", "NO_PRICE")
    ]
    refused = embeddingsRefusal(wide, table.models["cheap"], budgeted=False)
    assert refused is not None
    assert [(each.field, each.code.value) for each in refused.fieldErrors] == [
        ("dimensions", "TOO_MANY")
    ]
    assert embeddingsRefusal(wide, table.models["free"], budgeted=False) is None
    exact = parseEmbeddingsBody(b'{"model": "cheap", "input": "x", "dimensions": 64}')
    assert embeddingsRefusal(exact, table.models["cheap"], budgeted=True) is None
