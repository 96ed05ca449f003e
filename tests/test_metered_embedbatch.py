"""
Recalls' embeddings coalesced by organization (decisions D13,
L{svcd.metered.batches.EmbeddingBatches} over L{Embedder.embedEach}),
against the scripted upstream process and the real Embedder: texts that
pile up while their organization's forward is in flight go together in one
upstream request, each caller with its own vector, its own row under its
own call, and its share of the provider's usage (by the texts' D11
estimates, adding up to what the provider counted); organizations never
share a request; a text given up is recorded client_gone at once, held or
sharing a forward, and a forward every text gave up is cancelled; an
upstream error or a full ledger fails every text of a shared forward.

Embedder.embed itself (a text forwarded alone) is
tests/test_metered_embedder.py's; Coalescer's rules with plain Deferreds
are tests/test_common_coalesce.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import pytest
import pytest_twisted
from limitshelpers import waitFor
from proxydoubles import MemoryCounters, MemoryLedger
from twisted.internet.defer import CancelledError, Deferred, succeed
from upstreamfixtures import clearedUpstream

from svcd.common.errors import ApiError, ErrorCode
from svcd.devkit.upstream.client import RecordedRequest, ScriptedUpstream
from svcd.devkit.upstream.content import DEFAULT_EMBEDDING_DIMENSIONS, embeddingOf
from svcd.limits.admission import Admission
from svcd.limits.book import LimitBook
from svcd.limits.limiter import RedisRateLimiter
from svcd.limits.reservation import inputsEstimate
from svcd.metered.batches import EmbeddingBatches
from svcd.metered.embedder import Embedded, Embedder, EmbeddingCall
from svcd.metering.usage import Usage
from svcd.pb.auth.v1 import auth_pb2
from svcd.providers.providersfile import providersFromEnvironment
from svcd.providers.records import UpstreamRecord
from svcd.providers.table import ProviderTable
from svcd.providers.upstream import Forwarder
from svcd.proxy.metrics import ProxyMetrics

# Starts the scripted upstream process (conftest.py, pytest.ini).
pytestmark = pytest.mark.e2e


@pytest.fixture
def scriptedUpstream(moduleUpstream: ScriptedUpstream) -> ScriptedUpstream:
    """
    The module's one scripted upstream (upstreamfixtures.py), its log of
    requests emptied: the tests read only their own requests, and one
    upstream per test was most of the module's time.
    """
    return clearedUpstream(moduleUpstream)


ORG = "0190f0a0-0000-7000-8000-000000000001"
OTHER_ORG = "0190f0a0-0000-7000-8000-000000000011"
AGENT = "0190f0a0-0000-7000-8000-000000000002"
TOKEN = "0190f0a0-0000-7000-8000-000000000003"
DIMENSIONS = DEFAULT_EMBEDDING_DIMENSIONS

# What the provider says it counted for any request of "embed" (and the
# slow ones): a fixed count, so that its split among a request's texts is
# plain to see.
PROVIDER_TOKENS = 100
# 0.02 dollars a million tokens: 20 nano-dollars a token.
NANO_USD_PER_TOKEN = 20

PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[models]]
name = "embed"
provider = "scripted"
upstream_model = "usage:{tokens}:0"
kind = "embedding"
dimensions = {dimensions}
price = {{ input = "0.02" }}

[[models]]
name = "embed-slow"
provider = "scripted"
upstream_model = "slow:2000+usage:{tokens}:0"
kind = "embedding"
dimensions = {dimensions}
price = {{ input = "0.02" }}

[[models]]
name = "embed-stuck"
provider = "scripted"
upstream_model = "slow:60000"
kind = "embedding"
dimensions = {dimensions}

[[models]]
name = "embed-rejected"
provider = "scripted"
upstream_model = "status:400"
kind = "embedding"

[[models]]
name = "embed-failing"
provider = "scripted"
upstream_model = "status:500"
kind = "embedding"
"""

# Texts of different lengths, so that the split of a shared request's
# usage by their estimates is visible (and differs from a split by words,
# 30 and 70, or an even one).
SHORT = "the cat sat"
LONG = "a dog ran far away from home"
FIRST = "first of all"


@attrs.define
class Harness:
    embedder: Embedder
    providers: ProviderTable
    ledger: MemoryLedger
    upstream: ScriptedUpstream

    def inputs(self) -> list[list[str]]:
        """
        The inputs of each request the upstream received, in order.
        """
        return [request.body["input"] for request in self.upstream.requests()]

    def rowsOf(self, requestID: str) -> list[auth_pb2.UsageRow]:
        return [row for row in self.ledger.rows if row.request_id == requestID]

    def rowOf(self, requestID: str) -> auth_pb2.UsageRow:
        [row] = self.rowsOf(requestID)
        return row


@pytest.fixture
def harness(tmp_path: Path, scriptedUpstream: ScriptedUpstream) -> Iterator[Harness]:
    """
    The real Embedder, its Forwarder pointed at the scripted upstream, its
    rows kept in a list (as tests/test_metered_embedder.py builds it).
    """
    from twisted.internet import reactor

    providersFile = tmp_path / "providers.toml"
    providersFile.write_text(
        PROVIDERS.format(
            base=scriptedUpstream.baseURL, dimensions=DIMENSIONS, tokens=PROVIDER_TOKENS
        )
    )
    providers = providersFromEnvironment({"SVC_PROVIDERS_FILE": str(providersFile)}, time.time)
    assert providers is not None
    metrics = ProxyMetrics()
    limiter = RedisRateLimiter(
        MemoryCounters(), reactor, 60, book=LimitBook(), spend=lambda *_: succeed(0)
    )
    admission = Admission(limiter, metrics, reactor)
    forwarder = Forwarder(reactor, reactor, tuple(providers.providers.values()), metrics)
    ledger = MemoryLedger()
    embedder = Embedder(providers, forwarder, admission, ledger, reactor)
    yield Harness(embedder, providers, ledger, scriptedUpstream)
    forwarder.close()


def callOf(index: int, orgID: str = ORG) -> EmbeddingCall:
    """
    A call of its own for the C{index}th text: its own request id, ledger
    id and parent.
    """
    return EmbeddingCall(
        orgID=orgID,
        agentID=AGENT,
        tokenID=TOKEN,
        requestID=f"req-{orgID[-2:]}-{index}",
        ledgerID=f"0190f0a0-0000-7000-8000-0000{orgID[-2:]}0001{index:02d}",
        parentRequestID=f"parent-{orgID[-2:]}-{index}",
    )


@attrs.define
class Caller:
    """
    One recall's embedding through the batches: its text, call, record and
    Deferred.
    """

    text: str
    call: EmbeddingCall
    record: UpstreamRecord
    embedding: Deferred[Embedded]


def embedAll(
    batches: EmbeddingBatches,
    harness: Harness,
    model: str,
    texts: Sequence[str],
    orgID: str = ORG,
    first: int = 0,
) -> list[Caller]:
    """
    Embed each of C{texts} for a caller of its own, all in this turn of
    the reactor.
    """
    callers = []
    for index, text in enumerate(texts, first):
        call, record = callOf(index, orgID), UpstreamRecord()
        embedding = batches.embed(harness.providers.models[model], (text,), call, record=record)
        callers.append(Caller(text, call, record, embedding))
    return callers


def fired(embedding: Deferred[Embedded]) -> bool:
    """
    Whether C{embedding} has its result (a function, so that a check
    after a cancellation is not narrowed away by the one before it).
    """
    return embedding.called


async def settled(embedding: Deferred[Embedded]) -> Embedded:
    """
    C{embedding}'s vectors, waited for 10 s at most (a text never
    answered fails the test rather than hangs it).
    """
    await waitFor(lambda: fired(embedding))
    return await embedding


async def failure(embedding: Deferred[Embedded]) -> BaseException:
    """
    What C{embedding} failed with (it must fail, within 10 s).
    """
    await waitFor(lambda: fired(embedding))
    try:
        await embedding
    except BaseException as error:
        return error
    raise AssertionError("the embedding did not fail")


def requestWith(harness: Harness, inputs: list[str]) -> Callable[[], RecordedRequest | None]:
    def found() -> RecordedRequest | None:
        for request in harness.upstream.requests():
            if request.body["input"] == inputs:
                return request
        return None

    return found


def ended(request: RecordedRequest | None) -> bool:
    """
    Whether the upstream has ended C{request}'s answer (finished, or its
    client gone).
    """
    return request is not None and request.ended is not None


@pytest_twisted.ensureDeferred
async def test_textsThatPileUpShareOneForward(harness: Harness) -> None:
    """
    Three texts of one organization in one turn: the first is forwarded
    alone, the two that came while it was in flight together in one
    upstream request. Each caller gets its own text's vector and its own
    row (its request id, ledger id and parent); the shared request's
    usage is split by the texts' estimates (4 and 10 tokens: 29 and 71 of
    the provider's 100, not 30 and 70 by words nor 50 each), the rows add
    up to what the provider counted, and each caller's record carries
    its share.
    """
    batches = EmbeddingBatches(harness.embedder, maxInFlight=1)
    texts = [FIRST, SHORT, LONG]
    assert [inputsEstimate((text,)) for text in texts[1:]] == [4, 10]
    callers = embedAll(batches, harness, "embed", texts)
    embedded = [await settled(caller.embedding) for caller in callers]

    requests = harness.upstream.requests()
    assert [request.body for request in requests] == [
        {"model": f"usage:{PROVIDER_TOKENS}:0", "input": inputs, "encoding_format": "base64"}
        for inputs in ([FIRST], [SHORT, LONG])
    ]
    assert [each.vectors for each in embedded] == [
        (embeddingOf(text, DIMENSIONS)[1],) for text in texts
    ]
    assert [each.model for each in embedded] == ["embed"] * 3
    assert [each.promptTokens for each in embedded] == [PROVIDER_TOKENS, 29, 71]

    assert len(harness.ledger.rows) == 3
    for caller, tokens in zip(callers, [PROVIDER_TOKENS, 29, 71], strict=True):
        row = harness.rowOf(caller.call.requestID)
        assert (row.ledger_id, row.parent_request_id) == (
            caller.call.ledgerID,
            caller.call.parentRequestID,
        )
        assert (row.kind, row.outcome, row.model, row.org_id, row.agent_id) == (
            "embedding",
            "ok",
            "embed",
            ORG,
            AGENT,
        )
        assert (row.prompt_tokens, row.tokens_from) == (tokens, "provider")
        assert row.cost_nano_usd == tokens * NANO_USD_PER_TOKEN
        assert caller.record.usage == Usage(promptTokens=tokens, completionTokens=0)
        assert (caller.record.provider, caller.record.model) == ("scripted", "embed")
    shared = [harness.rowOf(caller.call.requestID) for caller in callers[1:]]
    assert sum(row.prompt_tokens for row in shared) == PROVIDER_TOKENS


@pytest_twisted.ensureDeferred
async def test_organizationsNeverShareARequest(harness: Harness) -> None:
    """
    Two organizations' texts, interleaved in one turn: each organization's
    first goes alone at once (the other organization's forward in flight
    does not hold it back), and its other two go together, never with the
    other organization's. Each row is its own organization's.
    """
    batches = EmbeddingBatches(harness.embedder, maxInFlight=1)
    callers = []
    for index, (alpha, beta) in enumerate(
        [("alpha one", "beta one"), ("alpha two", "beta two"), ("alpha three", "beta three")]
    ):
        callers += embedAll(batches, harness, "embed", [alpha], ORG, first=index)
        callers += embedAll(batches, harness, "embed", [beta], OTHER_ORG, first=index)
    embedded = [await settled(caller.embedding) for caller in callers]

    assert sorted(harness.inputs()) == sorted(
        [["alpha one"], ["beta one"], ["alpha two", "alpha three"], ["beta two", "beta three"]]
    )
    assert [each.vectors[0] for each in embedded] == [
        embeddingOf(caller.text, DIMENSIONS)[1] for caller in callers
    ]
    assert len(harness.ledger.rows) == 6
    for caller in callers:
        row = harness.rowOf(caller.call.requestID)
        assert (row.org_id, row.outcome) == (caller.call.orgID, "ok")


@pytest_twisted.ensureDeferred
async def test_aHeldTextCancelledIsNeverSent(harness: Harness) -> None:
    """
    Cancelling a text still held fails it with CancelledError at once and
    records its one row client_gone, counting its estimate; it is never
    forwarded, and the texts around it are embedded as if it had never
    come (the last one alone, once the first's forward ended).
    """
    batches = EmbeddingBatches(harness.embedder, maxInFlight=1)
    first, held, last = embedAll(batches, harness, "embed", [FIRST, SHORT, LONG])
    held.embedding.cancel()
    assert fired(held.embedding)
    assert isinstance(await failure(held.embedding), CancelledError)
    row = harness.rowOf(held.call.requestID)
    assert (row.outcome, row.tokens_from, row.prompt_tokens, row.ledger_id) == (
        "client_gone",
        "reservation",
        inputsEstimate((SHORT,)),
        held.call.ledgerID,
    )

    embedded = [await settled(caller.embedding) for caller in (first, last)]
    assert [each.vectors[0] for each in embedded] == [
        embeddingOf(FIRST, DIMENSIONS)[1],
        embeddingOf(LONG, DIMENSIONS)[1],
    ]
    assert harness.inputs() == [[FIRST], [LONG]]
    assert len(harness.ledger.rows) == 3
    assert len(harness.rowsOf(held.call.requestID)) == 1
    assert [harness.rowOf(caller.call.requestID).outcome for caller in (first, last)] == [
        "ok",
        "ok",
    ]


@pytest_twisted.ensureDeferred
async def test_aTextGivenUpInASharedForwardLeavesItToTheOthers(harness: Harness) -> None:
    """
    A text cancelled while the forward it shares is in flight fails at
    once with CancelledError, its row recorded client_gone (its estimate)
    then; the forward goes on to its end for the other text, which gets
    its vector and an ok row with its share of the provider's usage (its
    estimate's part, 71 of 100: the given-up text's part is not handed
    on), and the given-up text is not recorded again.
    """
    batches = EmbeddingBatches(harness.embedder, maxInFlight=1)
    first, gone, kept = embedAll(batches, harness, "embed-slow", [FIRST, SHORT, LONG])
    # The first forward, once it reached the upstream, is ended at once
    # (cancelled, alone: Embedder.embed's own cancellation), which sends
    # the held two together.
    await waitFor(lambda: harness.inputs() == [[FIRST]])
    first.embedding.cancel()
    assert isinstance(await failure(first.embedding), CancelledError)
    sharedRequest = requestWith(harness, [SHORT, LONG])
    await waitFor(lambda: sharedRequest() is not None)
    assert not fired(gone.embedding) and not fired(kept.embedding)

    gone.embedding.cancel()
    assert fired(gone.embedding)
    assert isinstance(await failure(gone.embedding), CancelledError)
    row = harness.rowOf(gone.call.requestID)
    assert (row.outcome, row.tokens_from, row.prompt_tokens) == (
        "client_gone",
        "reservation",
        inputsEstimate((SHORT,)),
    )
    # Where it was sent, as a lone cancelled forward's row says.
    assert (row.provider, row.model) == ("scripted", "embed-slow")
    assert not fired(kept.embedding)

    embedded = await settled(kept.embedding)
    assert embedded.vectors == (embeddingOf(LONG, DIMENSIONS)[1],)
    assert embedded.promptTokens == 71
    row = harness.rowOf(kept.call.requestID)
    assert (row.outcome, row.prompt_tokens, row.tokens_from) == ("ok", 71, "provider")
    assert kept.record.usage == Usage(promptTokens=71, completionTokens=0)
    await waitFor(lambda: ended(sharedRequest()))
    request = sharedRequest()
    assert request is not None and request.outcome == "finished"
    assert len(harness.rowsOf(gone.call.requestID)) == 1
    assert len(harness.ledger.rows) == 3
    assert harness.rowOf(first.call.requestID).outcome == "client_gone"


@pytest_twisted.ensureDeferred
async def test_aForwardEveryTextGaveUpIsCancelled(harness: Harness) -> None:
    """
    The forward goes on while one of its texts is waited for; once the
    last gives up too, it is cancelled: the upstream sees its client go
    (long before its answer was due), every row is client_gone, recorded
    once, and nothing more is recorded.
    """
    batches = EmbeddingBatches(harness.embedder, maxInFlight=1)
    first, gone, last = embedAll(batches, harness, "embed-stuck", [FIRST, SHORT, LONG])
    await waitFor(lambda: harness.inputs() == [[FIRST]])
    first.embedding.cancel()
    assert isinstance(await failure(first.embedding), CancelledError)
    sharedRequest = requestWith(harness, [SHORT, LONG])
    await waitFor(lambda: sharedRequest() is not None)

    gone.embedding.cancel()
    assert isinstance(await failure(gone.embedding), CancelledError)
    # Not cancelled: a cancelled forward would have failed the last text.
    assert not fired(last.embedding)
    last.embedding.cancel()
    assert isinstance(await failure(last.embedding), CancelledError)

    await waitFor(lambda: ended(sharedRequest()))
    request = sharedRequest()
    assert request is not None and request.outcome == "clientGone"
    assert sorted(row.request_id for row in harness.ledger.rows) == sorted(
        caller.call.requestID for caller in (first, gone, last)
    )
    assert {row.outcome for row in harness.ledger.rows} == {"client_gone"}
    for caller in (gone, last):
        assert harness.rowOf(caller.call.requestID).prompt_tokens == inputsEstimate((caller.text,))


@pytest_twisted.ensureDeferred
async def test_anUpstreamErrorFailsEveryTextOfASharedForward(harness: Harness) -> None:
    """
    The provider failing a shared request (a 5xx) fails each of its texts
    with the ApiError of decisions D9 (UPSTREAM_ERROR), and each has its
    own upstream_error row, counting nothing.
    """
    batches = EmbeddingBatches(harness.embedder, maxInFlight=1)
    callers = embedAll(batches, harness, "embed-failing", [FIRST, SHORT, LONG])
    for caller in callers:
        error = await failure(caller.embedding)
        assert isinstance(error, ApiError) and error.code is ErrorCode.UPSTREAM_ERROR
    assert harness.inputs() == [[FIRST], [SHORT, LONG]]
    assert len(harness.ledger.rows) == 3
    for caller in callers:
        row = harness.rowOf(caller.call.requestID)
        assert (row.outcome, row.prompt_tokens, row.ledger_id) == (
            "upstream_error",
            0,
            caller.call.ledgerID,
        )


@pytest_twisted.ensureDeferred
async def test_aSharedRequestRefusedIsSentAgainTextByText(harness: Harness) -> None:
    """
    The provider refusing a shared request (a 4xx: perhaps one text too
    long for the model) sends each of its texts again alone, so that one
    text's refusal is its own: here the model refuses everything, so each
    text fails UPSTREAM_REJECTED after its own request, and has exactly
    one row (the shared request, refused and not counted, has none).
    """
    batches = EmbeddingBatches(harness.embedder, maxInFlight=1)
    callers = embedAll(batches, harness, "embed-rejected", [FIRST, SHORT, LONG])
    for caller in callers:
        error = await failure(caller.embedding)
        assert isinstance(error, ApiError) and error.code is ErrorCode.UPSTREAM_REJECTED
    assert harness.inputs() == [[FIRST], [SHORT, LONG], [SHORT], [LONG]]
    assert len(harness.ledger.rows) == 3
    for caller in callers:
        row = harness.rowOf(caller.call.requestID)
        assert (row.outcome, row.prompt_tokens, row.ledger_id) == (
            "upstream_error",
            0,
            caller.call.ledgerID,
        )


@pytest_twisted.ensureDeferred
async def test_aFullLedgerRefusesASharedForward(harness: Harness) -> None:
    """
    When the ledger has no room by the time the held texts would be
    forwarded, each fails 503 SERVICE_DEGRADED; nothing of theirs is
    forwarded nor recorded (the first, forwarded while there was room,
    is answered and recorded).
    """
    batches = EmbeddingBatches(harness.embedder, maxInFlight=1)
    first, *held = embedAll(batches, harness, "embed", [FIRST, SHORT, LONG])
    harness.ledger.full = True
    await settled(first.embedding)
    for caller in held:
        error = await failure(caller.embedding)
        assert isinstance(error, ApiError) and error.code is ErrorCode.SERVICE_DEGRADED
    assert harness.inputs() == [[FIRST]]
    assert [row.request_id for row in harness.ledger.rows] == [first.call.requestID]
