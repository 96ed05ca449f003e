"""
The gateway's own embeddings (decisions D13, L{svcd.metered.embedder}),
against the scripted upstream process: what is forwarded, the vectors
decoded into float32 bytes, the reservation settled, the one ledger row of
kind embedding (with its parent), faults as decisions D9 but never a
fallback (decisions D13 amended, "Vectors never mix"), vectors memory
cannot use refused as the provider's fault with the provider paid, and a
call cancelled or out of time recorded client_gone.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
import pytest_twisted
from proxydoubles import MemoryCounters, MemoryLedger
from twisted.internet.defer import CancelledError, TimeoutError, succeed
from twisted.internet.task import deferLater
from upstreamfixtures import clearedUpstream

from svcd.common.errors import ApiError, ErrorCode
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.devkit.upstream.content import DEFAULT_EMBEDDING_DIMENSIONS, embeddingOf
from svcd.limits.admission import Admission
from svcd.limits.book import LimitBook, LimitsRow
from svcd.limits.limiter import RedisRateLimiter
from svcd.limits.records import Limits, Reservation
from svcd.limits.reservation import inputsEstimate
from svcd.metered.embedder import Embedder, EmbeddingCall, RowsDue, reserveTexts
from svcd.metering.usage import Usage
from svcd.providers.providersfile import providersFromEnvironment
from svcd.providers.records import UpstreamRecord
from svcd.providers.table import ProviderTable
from svcd.providers.upstream import Answer, Forwarder
from svcd.providers.vectors import decodeVectors
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
AGENT = "0190f0a0-0000-7000-8000-000000000002"
DIMENSIONS = DEFAULT_EMBEDDING_DIMENSIONS

PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[providers]]
name = "other"
base_url = "{other}"

[[models]]
name = "embed"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
dimensions = {dimensions}
price = {{ input = "0.02" }}

[[models]]
name = "embed-failing"
provider = "scripted"
upstream_model = "status:503"
kind = "embedding"
fallbacks = ["embed-spare"]

[[models]]
name = "embed-spare"
provider = "other"
upstream_model = "echo"
kind = "embedding"

[[models]]
name = "embed-rejected"
provider = "scripted"
upstream_model = "status:400"
kind = "embedding"
fallbacks = ["embed-spare"]

[[models]]
name = "embed-slow"
provider = "scripted"
upstream_model = "slow:5000"
kind = "embedding"

[[models]]
name = "embed-short"
provider = "scripted"
upstream_model = "vectors:short"
kind = "embedding"
dimensions = {dimensions}
price = {{ input = "0.02" }}

[[models]]
name = "embed-huge"
provider = "scripted"
upstream_model = "vectors:huge"
kind = "embedding"
price = {{ input = "0.02" }}

[[models]]
name = "embed-nan"
provider = "scripted"
upstream_model = "vectors:nan"
kind = "embedding"
price = {{ input = "0.02" }}

[[models]]
name = "embed-infinity"
provider = "scripted"
upstream_model = "vectors:infinity"
kind = "embedding"
price = {{ input = "0.02" }}
"""


async def waitFor(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    from twisted.internet import reactor

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {seconds} s")
        await deferLater(reactor, 0.02, lambda: None)


@attrs.define
class Harness:
    embedder: Embedder
    providers: ProviderTable
    admission: Admission
    counters: MemoryCounters
    book: LimitBook
    ledger: MemoryLedger
    upstream: ScriptedUpstream
    forwarder: Forwarder

    def tokensCounted(self) -> int:
        return sum(count for key, count in self.counters.counts.items() if key.endswith(":tokens"))

    async def reserve(self, texts: list[str]) -> tuple[Reservation, str]:
        """
        Admit a call for C{texts} under a token limit, as a route's rate
        limit step does: its reservation and ledger id.
        """
        self.book.replace([LimitsRow(ORG, None, Limits(tpm=100_000))])
        model = self.providers.models["embed"]
        tokens, cost = reserveTexts(
            texts, model, self.providers, ORG, self.admission.applicable(ORG, AGENT)
        )
        ledgerID = "0190f0a0-0000-7000-8000-0000000000aa"
        reservation = await self.admission.admit(ORG, AGENT, [], tokens, cost, ledgerID)
        assert reservation is not None
        return reservation, ledgerID


@pytest.fixture
def harness(tmp_path: Path, scriptedUpstream: ScriptedUpstream) -> Iterator[Harness]:
    from twisted.internet import reactor

    providersFile = tmp_path / "providers.toml"
    providersFile.write_text(
        PROVIDERS.format(
            base=scriptedUpstream.baseURL,
            other=scriptedUpstream.baseURLUnder("other"),
            dimensions=DIMENSIONS,
        )
    )
    providers = providersFromEnvironment({"SVC_PROVIDERS_FILE": str(providersFile)}, time.time)
    assert providers is not None
    metrics = ProxyMetrics()
    counters = MemoryCounters()
    book = LimitBook()
    limiter = RedisRateLimiter(counters, reactor, 60, book=book, spend=lambda *_: succeed(0))
    admission = Admission(limiter, metrics, reactor)
    forwarder = Forwarder(reactor, reactor, tuple(providers.providers.values()), metrics)
    ledger = MemoryLedger()
    embedder = Embedder(providers, forwarder, admission, ledger, reactor)
    yield Harness(
        embedder, providers, admission, counters, book, ledger, scriptedUpstream, forwarder
    )
    forwarder.close()


def call(**fields: Any) -> EmbeddingCall:
    return EmbeddingCall(
        **{
            "orgID": ORG,
            "agentID": AGENT,
            "tokenID": "0190f0a0-0000-7000-8000-000000000003",
            "requestID": "0190f0a0-0000-7000-8000-000000000004",
            **fields,
        }
    )


@pytest_twisted.ensureDeferred
async def test_textsAreEmbeddedSettledAndRecorded(harness: Harness) -> None:
    """
    The texts are forwarded in one request asking for base64; the vectors
    come back as the provider's float32 bytes, in the texts' order; the
    reservation made under the call's ledger id is settled to the
    provider's prompt tokens; one row of kind embedding is recorded under
    that ledger id, with the parent request id.
    """
    texts = ["the cat sat", "a dog ran far"]
    reservation, ledgerID = await harness.reserve(texts)
    assert harness.tokensCounted() == inputsEstimate(texts)
    embedded = await harness.embedder.embed(
        harness.providers.models["embed"],
        texts,
        call(ledgerID=ledgerID, parentRequestID="parent-1"),
        reservation=reservation,
    )
    [received] = harness.upstream.requests()
    assert received.path == "/v1/embeddings"
    assert received.body == {"model": "echo", "input": texts, "encoding_format": "base64"}
    assert embedded.model == "embed"
    assert embedded.vectors == tuple(embeddingOf(text, DIMENSIONS)[1] for text in texts)
    assert embedded.dimensions == DIMENSIONS
    assert embedded.promptTokens == 7
    await waitFor(lambda: harness.tokensCounted() == 7)
    [row] = harness.ledger.rows
    assert (row.ledger_id, row.request_id, row.parent_request_id) == (
        ledgerID,
        "0190f0a0-0000-7000-8000-000000000004",
        "parent-1",
    )
    assert (row.kind, row.outcome, row.model_requested, row.model, row.stream) == (
        "embedding",
        "ok",
        "embed",
        "embed",
        False,
    )
    assert (row.org_id, row.agent_id, row.token_id) == (
        ORG,
        AGENT,
        "0190f0a0-0000-7000-8000-000000000003",
    )
    assert (row.prompt_tokens, row.completion_tokens, row.tokens_from) == (7, 0, "provider")
    assert row.cost_nano_usd == 7 * 20


@pytest_twisted.ensureDeferred
async def test_aCallWithoutReservationHasALedgerIDOfItsOwn(harness: Harness) -> None:
    """
    A call that reserved nothing gets a ledger id of its own, and no
    parent when none is given.
    """
    await harness.embedder.embed(harness.providers.models["embed"], ["one"], call())
    [row] = harness.ledger.rows
    assert len(row.ledger_id) == 36 and row.parent_request_id == ""


@pytest_twisted.ensureDeferred
async def test_aFallbackNeverAnswersInPlaceOfAFailingModel(harness: Harness) -> None:
    """
    The gateway's own embeddings are the model's alone (decisions D13
    amended, "Vectors never mix"; they were its fallback's before): a
    fault that would try the fallbacks for a client's own embeddings
    fails the call, nothing is sent to the fallback, and the one row is
    the model's.
    """
    with pytest.raises(ApiError):
        await harness.embedder.embed(harness.providers.models["embed-failing"], ["the cat"], call())
    assert [each.path for each in harness.upstream.requests()] == ["/v1/embeddings"]
    [row] = harness.ledger.rows
    assert (row.model_requested, row.model, row.outcome) == (
        "embed-failing",
        "embed-failing",
        "upstream_error",
    )


@pytest.mark.parametrize("model", ["embed-short", "embed-huge", "embed-nan", "embed-infinity"])
@pytest_twisted.ensureDeferred
async def test_vectorsMemoryCannotUseAreTheProvidersFault(harness: Harness, model: str) -> None:
    """
    A vector one value shorter than the model's dimensions, or holding a
    JSON number beyond float32 (1e39, which raised OverflowError: a 500
    with the row recorded ok), NaN or an infinity, is 502 UPSTREAM_ERROR;
    the provider was paid: the reservation is settled to its prompt
    tokens and the row, upstream_error, counts and costs them.
    """
    texts = ["the cat sat"]
    reservation, ledgerID = await harness.reserve(texts)
    with pytest.raises(ApiError) as raised:
        await harness.embedder.embed(
            harness.providers.models[model],
            texts,
            call(ledgerID=ledgerID),
            reservation=reservation,
        )
    assert raised.value.code is ErrorCode.UPSTREAM_ERROR
    await waitFor(lambda: harness.tokensCounted() == 3)
    [row] = harness.ledger.rows
    assert (row.outcome, row.model, row.prompt_tokens, row.tokens_from, row.ledger_id) == (
        "upstream_error",
        model,
        3,
        "provider",
        ledgerID,
    )
    assert row.cost_nano_usd == 3 * 20


@pytest_twisted.ensureDeferred
async def test_aRefusalIsTheProvidersFault(harness: Harness) -> None:
    """
    The provider's own 4xx is UPSTREAM_REJECTED with no fallback tried;
    the reservation is released and the row records the fault, no
    tokens.
    """
    reservation, ledgerID = await harness.reserve(["the cat"])
    with pytest.raises(ApiError) as raised:
        await harness.embedder.embed(
            harness.providers.models["embed-rejected"],
            ["the cat"],
            call(ledgerID=ledgerID),
            reservation=reservation,
        )
    assert raised.value.code is ErrorCode.UPSTREAM_REJECTED
    assert len(harness.upstream.requests()) == 1
    await waitFor(lambda: harness.tokensCounted() == 0)
    [row] = harness.ledger.rows
    assert (row.outcome, row.prompt_tokens, row.ledger_id) == ("upstream_error", 0, ledgerID)


@pytest_twisted.ensureDeferred
async def test_aCancelledCallIsRecordedClientGone(harness: Harness) -> None:
    """
    Cancelling the call mid-flight cancels the forward, and the row is
    recorded client_gone with the texts' estimate (as the limits kept
    it).
    """
    texts = ["the cat sat on the mat"]
    embedding = harness.embedder.embed(harness.providers.models["embed-slow"], texts, call())
    await waitFor(lambda: len(harness.upstream.requests()) == 1)
    embedding.cancel()
    with pytest.raises(CancelledError):
        await embedding
    [row] = harness.ledger.rows
    assert (row.outcome, row.tokens_from, row.prompt_tokens) == (
        "client_gone",
        "reservation",
        inputsEstimate(texts),
    )


@pytest_twisted.ensureDeferred
async def test_aCallOutOfTimeIsCancelled(harness: Harness) -> None:
    """
    With a timeout, a call the provider does not answer in time fails
    with TimeoutError at the timeout, and its row is client_gone.
    """
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        await harness.embedder.embed(
            harness.providers.models["embed-slow"], ["the cat"], call(), timeout=0.2
        )
    assert time.monotonic() - began < 3
    [row] = harness.ledger.rows
    assert row.outcome == "client_gone"


@pytest_twisted.ensureDeferred
async def test_anAnsweredCallsRowWaitsForItsCaller(harness: Harness) -> None:
    """
    With C{rowsDue}, a call that answered gives its vectors before its row
    is recorded, and the row is recorded, once, when the caller says so; a
    row that comes after that is recorded at once.
    """
    model = harness.providers.models["embed"]
    rows = RowsDue()
    embedded = await harness.embedder.embed(model, ["the cat sat"], call(), rowsDue=rows)
    assert embedded.promptTokens is not None
    assert harness.ledger.rows == []
    rows.record()
    [row] = harness.ledger.rows
    assert (row.kind, row.outcome, row.prompt_tokens) == (
        "embedding",
        "ok",
        embedded.promptTokens,
    )
    rows.record()
    assert len(harness.ledger.rows) == 1
    await harness.embedder.embed(model, ["a dog ran"], call(), rowsDue=rows)
    assert len(harness.ledger.rows) == 2


@pytest_twisted.ensureDeferred
async def test_aFailedOrCancelledCallsRowIsRecordedAtOnce(harness: Harness) -> None:
    """
    With C{rowsDue}, a call that failed or was cancelled is recorded when
    it ends, as without it: nothing is left for the caller to record.
    """
    rows = RowsDue()
    with pytest.raises(ApiError):
        await harness.embedder.embed(
            harness.providers.models["embed-failing"], ["the cat"], call(), rowsDue=rows
        )
    [failed] = harness.ledger.rows
    assert failed.outcome == "upstream_error"
    embedding = harness.embedder.embed(
        harness.providers.models["embed-slow"], ["the cat"], call(), rowsDue=rows
    )
    await waitFor(lambda: len(harness.upstream.requests()) == 2)
    embedding.cancel()
    with pytest.raises(CancelledError):
        await embedding
    assert [row.outcome for row in harness.ledger.rows] == ["upstream_error", "client_gone"]


@pytest_twisted.ensureDeferred
async def test_aFullLedgerRefusesBeforeForwarding(harness: Harness) -> None:
    """
    When the ledger has no room, the call is 503 SERVICE_DEGRADED, its
    reservation released, nothing forwarded nor recorded.
    """
    reservation, ledgerID = await harness.reserve(["the cat"])
    harness.ledger.full = True
    with pytest.raises(ApiError) as raised:
        await harness.embedder.embed(
            harness.providers.models["embed"],
            ["the cat"],
            call(ledgerID=ledgerID),
            reservation=reservation,
        )
    assert raised.value.code is ErrorCode.SERVICE_DEGRADED
    assert harness.upstream.requests() == []
    assert harness.ledger.rows == []
    await waitFor(lambda: harness.tokensCounted() == 0)


def answer(data: list[dict[str, Any]]) -> bytes:
    return json.dumps({"object": "list", "data": data}).encode()


def test_vectorsAreDecodedInIndexOrder() -> None:
    """
    Base64 vectors are their bytes; an answer of numbers (a provider that
    ignored encoding_format) is packed as little-endian float32; the
    order is the answer's index, whatever the order of its items.
    """
    first = struct.pack("<2f", 1.0, 0.5)
    second = struct.pack("<2f", -1.0, 0.25)
    decoded = decodeVectors(
        answer(
            [
                {"index": 1, "embedding": [-1.0, 0.25]},
                {"index": 0, "embedding": base64.b64encode(first).decode()},
            ]
        ),
        2,
    )
    assert decoded == (first, second)


@pytest.mark.parametrize(
    "data",
    [
        [],
        [{"index": 0, "embedding": "AAAA"}, {"index": 0, "embedding": "AAAA"}],
        [{"index": 0, "embedding": "AAAAAAAA"}, {"index": 1, "embedding": "AAAA"}],
        [{"index": 0, "embedding": "AAA"}, {"index": 1, "embedding": "AAAA"}],
        [{"index": 0, "embedding": ""}, {"index": 1, "embedding": ""}],
        [{"index": 0, "embedding": [True]}, {"index": 1, "embedding": [1]}],
        [{"index": 2, "embedding": "AAAA"}, {"index": 1, "embedding": "AAAA"}],
        [{"embedding": "AAAA"}, {"index": 1, "embedding": "AAAA"}],
    ],
)
def test_unusableVectorsAreTheProvidersFault(data: list[dict[str, Any]]) -> None:
    """
    Anything but one non-empty vector per text, all of one length, is 502
    UPSTREAM_ERROR.
    """
    with pytest.raises(ApiError) as raised:
        decodeVectors(answer(data), 2)
    assert raised.value.code is ErrorCode.UPSTREAM_ERROR


def _base64(*values: float) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


@pytest.mark.parametrize(
    "embedding",
    [
        [1e39, 0.5],
        [-1e39, 0.5],
        [10**400, 0.5],
        [float("nan"), 0.5],
        [float("inf"), 0.5],
        _base64(float("nan"), 0.5),
        _base64(float("-inf"), 0.5),
    ],
)
def test_aValueNotAFiniteFloat32IsTheProvidersFault(embedding: object) -> None:
    """
    A value beyond float32's range as a JSON number (which raised
    OverflowError, not ApiError), NaN or an infinity, as numbers or as
    base64, is 502 UPSTREAM_ERROR.
    """
    with pytest.raises(ApiError) as raised:
        decodeVectors(json.dumps({"data": [{"index": 0, "embedding": embedding}]}).encode(), 1)
    assert raised.value.code is ErrorCode.UPSTREAM_ERROR


@pytest.mark.parametrize("dimensions", [1, 3])
def test_aVectorNotOfTheModelsDimensionsIsTheProvidersFault(dimensions: int) -> None:
    """
    Given the model's dimensions, a vector of another length is 502
    UPSTREAM_ERROR; of that length, it is read.
    """
    body = answer([{"index": 0, "embedding": _base64(1.0, 0.5)}])
    assert decodeVectors(body, 1, 2) == (struct.pack("<2f", 1.0, 0.5),)
    with pytest.raises(ApiError) as raised:
        decodeVectors(body, 1, dimensions)
    assert raised.value.code is ErrorCode.UPSTREAM_ERROR


@attrs.define
class AnswersWithoutVectors:
    """
    A forwarder whose provider answers 200 with a document that holds no
    vectors (an error object under a 200, as a broken provider or proxy
    sends), with or without its usage.
    """

    usage: Usage | None
    forwarded: int = 0

    def forward(
        self,
        document: Any,
        attempts: Any,
        requestID: str,
        client: Any,
        errorEvent: Any,
        record: UpstreamRecord,
        **named: Any,
    ) -> Any:
        record.usage = self.usage
        record.model = "embed"
        self.forwarded += 1
        body = b'{"error": {"message": "overloaded"}}'
        return succeed(Answer(200, body, document=json.loads(body)))


@pytest.mark.parametrize("usage", [None, Usage(promptTokens=4, completionTokens=0)])
@pytest_twisted.ensureDeferred
async def test_anAnswerWithoutVectorsIsRecordedAsTheProvidersFault(
    harness: Harness, usage: Usage | None
) -> None:
    """
    A 200 without vectors is 502 UPSTREAM_ERROR, and its row says
    upstream_error (as a recall's charge reads it): with no usage the
    reservation is released and the row counts nothing; with usage, what
    the provider counted.
    """
    from twisted.internet import reactor

    texts = ["the cat sat"]
    reservation, ledgerID = await harness.reserve(texts)
    forwarder = AnswersWithoutVectors(usage)
    embedder = Embedder(
        harness.providers, cast(Forwarder, forwarder), harness.admission, harness.ledger, reactor
    )
    with pytest.raises(ApiError) as raised:
        await embedder.embed(
            harness.providers.models["embed"],
            texts,
            call(ledgerID=ledgerID),
            reservation=reservation,
        )
    assert raised.value.code is ErrorCode.UPSTREAM_ERROR and forwarder.forwarded == 1
    counted = 0 if usage is None else usage.promptTokens
    await waitFor(lambda: harness.tokensCounted() == counted)
    [row] = harness.ledger.rows
    assert (row.outcome, row.prompt_tokens, row.ledger_id) == ("upstream_error", counted, ledgerID)
