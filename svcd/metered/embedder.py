"""
The gateway embedding texts for itself, as an organization, and paying for
it (decisions D13): a memory's content or a search's query on svc-proxy's
memory routes, the last user message of a recall, the memories a worker
extracted.

One component for every such call (L{Embedder}), so that each is forwarded,
settled and recorded alike, and alike with a client's own C{POST
/v1/embeddings} (whose route shares L{accountEmbedding}):

  - forwarded through the L{Forwarder} with the L{EMBEDDINGS} operation
    (decisions D9's headers, timeouts and fault mapping): C{{"model",
    "input": [...], "encoding_format": "base64"}}, never streamed;
  - to the model alone, never one of its fallbacks (decisions D13
    amended, "Vectors never mix": a fallback's vectors live in another
    space, and a memory stored with them would never be found by the
    model's queries; L{memoryAttempts});
  - the answer's base64 vectors decoded into float32 bytes, little-endian,
    as svc-memory stores and searches them
    (L{svcd.providers.vectors.vectorsOf}): never a Python float per
    component; a vector not the model's C{dimensions} long (when the
    providers file gives them) or with a value that is not a finite
    float32 is the provider's fault (502), its row recorded with the
    provider's usage;
  - the reservation the caller made at its admission (or none) settled to
    the provider's C{usage.prompt_tokens} at the price of the model that
    answered, released after a fault (D11, D12);
  - one ledger row of kind C{embedding} (D12, D13), with the request it
    was made for as C{parent_request_id} when another request caused it,
    counting what L{embeddingCharge} says: the one rule that bills an
    embedding, which a recall's chat settles by too.

What the caller reserves beforehand is L{reserveTexts} (the texts' D11
estimate; under a budget, the worst case of
L{svcd.limits.reservation.reserveEmbeddings}), made at the caller's own
admission step so that one request costs one Redis script call.

Cancelling L{Embedder.embed} (a recall out of time, a client gone) cancels
the forward; the row is then recorded C{client_gone}, like any cancelled
forward's.

The metered call is above the three packages it joins: it imports the
providers' client, the limits and the ledger, none of which imports it
(nor each other). It imports nothing of svc-proxy, so that svc-worker can
use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IPushProducer

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.errors import ApiError, ErrorCode
from svcd.common.ids import uuid7Text
from svcd.ledger.rows import EMBEDDING, UsageLedger, usageRow
from svcd.limits.admission import Admission
from svcd.limits.book import Applicable
from svcd.limits.records import Reservation
from svcd.limits.reservation import (
    embeddingsRefusal,
    inputsEstimate,
    reserveEmbeddings,
)
from svcd.metering.charges import CLIENT_GONE, OK, UPSTREAM_ERROR, Charge, chargeOf
from svcd.metering.models import Model
from svcd.metering.usage import Usage
from svcd.providers.operations import EMBEDDINGS
from svcd.providers.records import UpstreamRecord
from svcd.providers.table import ProviderTable
from svcd.providers.upstream import Forwarder
from svcd.providers.vectors import vectorsOf

BASE64 = "base64"


@attrs.frozen
class EmbeddingCall:
    """
    Whose call it is and what it is recorded under.

    @ivar requestID: the request id of the row (the client-visible id of
        the request that embeds, or one of the caller's own).
    @ivar ledgerID: the row's key, the one the caller's reservation was
        admitted under (decisions D12, amended); empty for a new one (a
        call that reserved nothing).
    @ivar parentRequestID: the request this call was made for, when another
        request caused it (a recall's chat completion, a worker's
        observation); None for a request of the client's own.
    """

    orgID: str
    agentID: str | None
    tokenID: str | None
    requestID: str
    ledgerID: str = ""
    parentRequestID: str | None = None


@attrs.frozen
class Embedded:
    """
    The vectors of a call's texts, in the texts' order.

    @ivar model: the name (in the providers file) of the model that made
        them: always the model asked for (never one of its fallbacks,
        whose vectors compare with their own only).
    @ivar vectors: each text's float32 components, little-endian.
    @ivar promptTokens: the provider's count, None when it gave none.
    """

    model: str
    vectors: tuple[bytes, ...] = attrs.field(repr=False)
    promptTokens: int | None

    @property
    def dimensions(self) -> int:
        return len(self.vectors[0]) // 4 if self.vectors else 0


@attrs.frozen
class _Texts:
    """
    The gateway's embeddings request for C{inputs}, in the shape the
    reservation reads (L{svcd.limits.reservation.EmbeddingsBody}).
    """

    inputs: Sequence[str]
    document: Mapping[str, Any]
    dimensions: int | None = None


def embeddingsRequest(model: Model, texts: Sequence[str]) -> _Texts:
    """
    What is forwarded for C{texts}: the model's name (the forwarder puts
    its C{upstream_model} in its place), the texts, base64 vectors.
    """
    return _Texts(
        tuple(texts), {"model": model.name, "input": list(texts), "encoding_format": BASE64}
    )


def reserveTexts(
    texts: Sequence[str],
    model: Model,
    providers: ProviderTable,
    orgID: str,
    applicable: Applicable,
) -> tuple[int, int]:
    """
    What embedding C{texts} with C{model} reserves at the caller's
    admission, as C{(tokens, cost)}: the texts' D11 estimate, and under a
    budget its worst-case cost (L{reserveEmbeddings}) of the very body
    L{Embedder.embed} sends.
    """
    return reserveEmbeddings(
        embeddingsRequest(model, texts),
        model,
        providers,
        orgID,
        applicable,
        memoryAttempts(model, orgID, True),
    )


def memoryAttempts(model: Model, orgID: str, budgeted: bool) -> tuple[Model, ...]:
    """
    The models that may make the gateway's own vectors for C{model}: the
    model alone, never one of its fallbacks (decisions D13 amended,
    "Vectors never mix": a fallback's vectors live in another space, so a
    memory it embedded would never be found by the model's queries, nor a
    query it embedded find the model's memories); none when C{orgID} may
    not use it, or under a budget when it has no price (never billed at
    zero).
    """
    if not model.allows(orgID) or (budgeted and model.price is None):
        return ()
    return (model,)


def embeddingRefusal(model: Model, budgeted: bool) -> ApiError | None:
    """
    Why C{model} cannot embed for the gateway now: under a budget, a model
    without a price (never billed at zero); None when it can.
    """
    return embeddingsRefusal(embeddingsRequest(model, ()), model, budgeted)


def answeredBy(providers: ProviderTable, record: UpstreamRecord, model: Model) -> Model:
    """
    The model whose price a call is billed at: the one that answered (on a
    client's own C{POST /v1/embeddings}, perhaps a fallback of C{model}),
    else C{model} itself (nothing answered).
    """
    return providers.models.get(record.model or "") or model


def embeddingCharge(
    providers: ProviderTable,
    model: Model,
    record: UpstreamRecord,
    outcome: str,
    estimate: int,
) -> Charge:
    """
    The one rule that bills an embedding (decisions D12, D13), whoever made
    it: what its ledger row counts (L{accountEmbedding}: the gateway's own
    embeddings, the memory routes', a recall's, the worker's, and a
    client's C{POST /v1/embeddings}) and what a chat that recalled settles
    beside its own answer (L{svcd.proxy.recall}). The provider's prompt
    tokens when usage came; nothing after a fault (an embeddings answer
    has no first byte to fail after); else (cancelled, or an answer
    without usage) the texts' C{estimate}, with no output estimated. At
    the price of the model that answered (L{answeredBy}).
    """
    return chargeOf(
        record.usage, outcome, (estimate, 0), answeredBy(providers, record, model).price
    )


def accountEmbedding(
    admission: Admission,
    ledger: UsageLedger | None,
    providers: ProviderTable,
    *,
    call: EmbeddingCall,
    reservation: Reservation | None,
    record: UpstreamRecord,
    model: Model,
    modelRequested: str,
    outcome: str,
    estimate: int,
    startedAt: float,
    endedAt: float,
) -> None:
    """
    Settle one forwarded embeddings request and record its row, however it
    ended (C{outcome}): the reservation settled to the provider's prompt
    tokens at the price of the model that answered; released after a
    fault without usage; kept otherwise (a cancelled call: the limiter's
    lease ends it, and the row counts the C{estimate}, as the token limits
    kept it). Then the row, of kind C{embedding}, under C{call.ledgerID},
    counting the call's L{embeddingCharge}.

    The caller gives up C{reservation}: it is settled here or never.
    """
    usage = record.usage
    answered = answeredBy(providers, record, model)
    if usage is not None:
        admission.settleUsage(
            reservation, usage, answered, call.orgID, call.requestID, call.ledgerID
        )
    elif outcome == UPSTREAM_ERROR and reservation is not None:
        admission.settle(reservation, 0)
    if ledger is None:
        return
    ledger.record(
        usageRow(
            ledgerID=call.ledgerID,
            requestID=call.requestID,
            orgID=call.orgID,
            agentID=call.agentID,
            tokenID=call.tokenID,
            modelRequested=modelRequested,
            model=record.model,
            provider=record.provider,
            upstreamModel=record.upstreamModel,
            stream=False,
            outcome=outcome,
            charge=embeddingCharge(providers, model, record, outcome, estimate),
            startedAt=startedAt,
            endedAt=endedAt,
            kind=EMBEDDING,
            parentRequestID=call.parentRequestID,
        )
    )


def ledgerFull() -> ApiError:
    """
    The 503 of a call that would go unrecorded: the ledger's outbox is full
    (decisions D12: never an answer without its record).
    """
    return ApiError(
        ErrorCode.SERVICE_DEGRADED,
        "The gateway cannot record usage right now; try again shortly.",
    )


class RowsDue:
    """
    The ledger rows of a caller's embeddings that answered, recorded when
    the caller says (L{record}) rather than before their vectors are given:
    a recall sends its search first, in the same turn of the reactor, so
    that the row is not on the way to its answer. Each row is recorded
    once; one left here after L{record} is recorded at once.
    """

    def __init__(self) -> None:
        self._due: list[Callable[[], None]] = []
        self._recorded = False

    def add(self, account: Callable[[], None]) -> None:
        """
        Hold C{account} (a row's recording) until L{record}; after it, run
        it now.
        """
        if self._recorded:
            account()
        else:
            self._due.append(account)

    def record(self) -> None:
        """
        Record every row held, and from now on each as it comes. Called
        again, it records only what came since.
        """
        self._recorded = True
        due, self._due = self._due, []
        for account in due:
            account()


class Embedder:
    """
    Embeds texts for the gateway, as an organization, and pays for it (see
    the module docstring).

    @param providers: the providers file, which names the models and
        their prices.
    @param forwarder: the providers' client.
    @param admission: settles the callers' reservations.
    @param ledger: where each call's row goes; None records none.
    @param clock: the rows' times and the calls' timeouts.
    """

    def __init__(
        self,
        providers: ProviderTable,
        forwarder: Forwarder,
        admission: Admission,
        ledger: UsageLedger | None,
        clock: Clock,
    ) -> None:
        self.providers = providers
        self._forwarder = forwarder
        self._admission = admission
        self._ledger = ledger
        self._clock = clock

    def embed(
        self,
        model: Model,
        texts: Sequence[str],
        call: EmbeddingCall,
        *,
        reservation: Reservation | None = None,
        budgeted: bool = False,
        record: UpstreamRecord | None = None,
        timeout: float | None = None,
        rowsDue: RowsDue | None = None,
    ) -> Deferred[Embedded]:
        """
        Embed C{texts} (one or more, none empty) with C{model} (one the
        organization may use, looked up by the caller) for C{call}.

        Cancelling the Deferred cancels the forward; the row is recorded
        C{client_gone}.

        @param reservation: what the caller's admission reserved for this
            call (L{reserveTexts}), under C{call.ledgerID}; settled here.
        @param budgeted: whether a budget applies to the caller (then a
            model without a price is never tried).
        @param record: filled with what the forward did (provider, model,
            usage, time), for the caller's access log; one of its own by
            default.
        @param timeout: seconds the call may take before it is cancelled
            and fails with L{twisted.internet.defer.TimeoutError}; None
            for the providers' own timeouts only.
        @param rowsDue: where a call that answered leaves the recording
            of its row (its settlement and ledger row, L{accountEmbedding})
            rather than make it before its vectors are given (L{RowsDue}).
            A call that failed or was cancelled is recorded at once, as
            without it. None: the row at once.

        @return: a Deferred of the vectors (L{Embedded}); it fails with
            L{ApiError}: the provider's fault as decisions D9 maps it (no
            fallback is tried), 502 UPSTREAM_ERROR for an answer without
            usable vectors (L{vectorsOf}), 503 SERVICE_DEGRADED when the
            ledger has no room (nothing is forwarded then).
        """
        if not texts:
            raise ValueError("nothing to embed")
        if not call.ledgerID:
            call = attrs.evolve(call, ledgerID=uuid7Text())
        work = Deferred.fromCoroutine(
            self._embed(
                model,
                texts,
                call,
                reservation,
                budgeted,
                record if record is not None else UpstreamRecord(),
                rowsDue,
            )
        )
        if timeout is not None:
            # Cancelling the forward ends it at once (Deferred.cancel fires
            # what does not fire itself), so the row is recorded before the
            # caller sees the TimeoutError.
            work.addTimeout(timeout, asReactorTime(self._clock))
        return work

    async def _forward(
        self,
        model: Model,
        texts: Sequence[str],
        call: EmbeddingCall,
        budgeted: bool,
        record: UpstreamRecord,
    ) -> tuple[bytes, ...]:
        """
        Forward C{texts} to C{model} alone (L{memoryAttempts}) under
        C{call}'s request id, and read their vectors: an answer without
        usable ones (L{vectorsOf}: their count, their length, the model's
        C{dimensions}, finite float32 values) is the provider's fault
        (502), and the caller's row says so with the provider's usage (a
        recall's charge reads the same outcome).
        """
        attempts = memoryAttempts(model, call.orgID, budgeted)
        if not attempts:
            # The callers look the model up for the organization first.
            raise ValueError("the model may not embed for this organization")
        answer = await self._forwarder.forward(
            embeddingsRequest(model, texts).document,
            attempts,
            call.requestID,
            NEVER_STREAMED,
            noErrorEvent,
            record,
            operation=EMBEDDINGS,
        )
        return vectorsOf(answer.document, len(texts), model.dimensions)

    def now(self) -> float:
        """
        The clock's time, as the rows' times read it.
        """
        return self._clock.seconds()

    async def _embed(
        self,
        model: Model,
        texts: Sequence[str],
        call: EmbeddingCall,
        reservation: Reservation | None,
        budgeted: bool,
        record: UpstreamRecord,
        rowsDue: RowsDue | None = None,
    ) -> Embedded:
        ledger = self._ledger
        if ledger is not None and not ledger.hasRoom():
            if reservation is not None:
                self._admission.settle(reservation, 0)
            raise ledgerFull()
        startedAt = self._clock.seconds()
        outcome = OK

        def account() -> None:
            accountEmbedding(
                self._admission,
                ledger,
                self.providers,
                call=call,
                reservation=reservation,
                record=record,
                model=model,
                modelRequested=model.name,
                outcome=outcome,
                estimate=inputsEstimate(texts),
                startedAt=startedAt,
                endedAt=endedAt,
            )

        answered = False
        try:
            vectors = await self._forward(model, texts, call, budgeted, record)
            answered = True
        except ApiError:
            outcome = UPSTREAM_ERROR
            raise
        except CancelledError:
            outcome = CLIENT_GONE
            raise
        finally:
            endedAt = self._clock.seconds()
            if answered and rowsDue is not None:
                rowsDue.add(account)
            else:
                account()
        usage = record.usage
        return Embedded(
            model.name,
            vectors,
            usage.promptTokens if usage is not None else None,
        )

    async def embedEach(
        self, model: Model, texts: Sequence[SharedText], budgeted: bool = False
    ) -> list[Embedded]:
        """
        Embed several callers' texts in one forward
        (L{svcd.metered.batches.EmbeddingBatches}),
        each text recorded as its own call: one row each, under its own
        C{call}, with the provider's usage shared among the texts in
        proportion to their D11 estimates (L{apportioned}), so that the
        rows add up to what the provider counted (when no caller gave up).
        All of them one
        organization's, none with a
        reservation (a recall's charge is its chat's).

        A text whose caller gave up (L{giveUp}) is recorded then, as a
        cancelled call is (C{client_gone}, its estimate, in place of its
        share of what the provider counts after); the forward
        goes on for the others, and is cancelled by its own Deferred's
        cancellation (every text given up).

        @return: each text's L{Embedded}, in order; fails as L{embed}
            does, each text recorded (but for the ledger's 503, which
            forwards and records nothing).
        """
        ledger = self._ledger
        if ledger is not None and not ledger.hasRoom():
            raise ledgerFull()
        startedAt = self._clock.seconds()
        shared = UpstreamRecord()
        for each in texts:
            each.forward = shared
        outcome = OK
        try:
            vectors = await self._forward(
                model, [each.text for each in texts], texts[0].call, budgeted, shared
            )
        except ApiError as error:
            outcome = UPSTREAM_ERROR
            if error.code is ErrorCode.UPSTREAM_REJECTED and shared.usage is None:
                # The provider refused the request (a 4xx), perhaps for one
                # text of it (too long for the model): each goes again
                # alone, where it fails or not on its own, and is recorded
                # then. This request was not counted by the provider.
                outcome = REJECTED_TOGETHER
                raise RejectedTogether(error) from None
            raise
        except CancelledError:
            outcome = CLIENT_GONE
            raise
        finally:
            usage = shared.usage
            shares = usageShares(usage, [inputsEstimate((each.text,)) for each in texts])
            endedAt = self._clock.seconds()
            for each, share in zip(texts, shares, strict=True):
                if each.recorded or outcome == REJECTED_TOGETHER:
                    continue
                each.record.provider = shared.provider
                each.record.model = shared.model
                each.record.upstreamModel = shared.upstreamModel
                each.record.upstreamMilliseconds = shared.upstreamMilliseconds
                each.record.usage = share
                self._recordText(model, each, outcome, startedAt, endedAt)
        name = model.name
        return [
            Embedded(name, (vector,), share.promptTokens if share is not None else None)
            for vector, share in zip(vectors, shares, strict=True)
        ]

    def giveUp(self, model: Model, text: SharedText, startedAt: float) -> None:
        """
        Record the row of a text of L{embedEach} whose caller gave up on
        it before its answer, sent or not: C{client_gone}, counting its
        estimate, as a cancelled call's row does.
        """
        if text.recorded:
            return
        forward = text.forward
        if forward is not None:
            # Where it was sent, as a lone cancelled forward's row says.
            text.record.provider = forward.provider
            text.record.model = forward.model
            text.record.upstreamModel = forward.upstreamModel
        self._recordText(model, text, CLIENT_GONE, startedAt, self._clock.seconds())

    def _recordText(
        self, model: Model, text: SharedText, outcome: str, startedAt: float, endedAt: float
    ) -> None:
        text.recorded = True
        accountEmbedding(
            self._admission,
            self._ledger,
            self.providers,
            call=text.call,
            reservation=None,
            record=text.record,
            model=model,
            modelRequested=model.name,
            outcome=outcome,
            estimate=inputsEstimate((text.text,)),
            startedAt=startedAt,
            endedAt=endedAt,
        )


# embedEach's outcome when the provider refused a shared request: no row.
REJECTED_TOGETHER = "rejected_together"


class RejectedTogether(Exception):
    """
    The provider refused a request of several callers' texts with a 4xx
    (L{Embedder.embedEach}): nothing was recorded, and each text should be
    sent again alone, so that one text's refusal is its own.
    """

    def __init__(self, error: ApiError) -> None:
        super().__init__(str(error))
        self.error = error


@attrs.define(eq=False)
class SharedText:
    """
    One caller's text in a forward it may share (L{Embedder.embedEach}).

    @ivar record: the caller's, filled with the shared forward's provider,
        time and this text's share of its usage.
    @ivar recorded: whether its row has been recorded (once, however it
        ended).
    @ivar forward: the shared forward's record, once it is sent.
    """

    text: str = attrs.field(repr=False)
    call: EmbeddingCall
    record: UpstreamRecord
    recorded: bool = False
    forward: UpstreamRecord | None = None


def apportioned(total: int, weights: Sequence[int]) -> list[int]:
    """
    C{total} shared in proportion to C{weights} in whole parts that add up
    to it exactly: each its share rounded down, and what rounding left
    given one each to the largest remainders (the first on a tie).
    """
    if not weights:
        raise ValueError("nothing to share among")
    weight = sum(weights)
    if weight <= 0:
        weights, weight = [1] * len(weights), len(weights)
    parts = [total * each // weight for each in weights]
    left = total - sum(parts)
    order = sorted(
        range(len(weights)), key=lambda index: (-(total * weights[index] % weight), index)
    )
    for index in order[:left]:
        parts[index] += 1
    return parts


def usageShares(usage: Usage | None, estimates: Sequence[int]) -> list[Usage | None]:
    """
    Each text's part of a shared forward's usage (none without usage):
    prompt and cached tokens apportioned by the texts' estimates.
    """
    if usage is None:
        return [None] * len(estimates)
    # The cached and the uncached tokens each shared whole, so that each
    # text's cached part is within its prompt and both add up exactly.
    cachedTokens = min(max(usage.cachedTokens, 0), usage.promptTokens)
    cached = apportioned(cachedTokens, estimates)
    uncached = apportioned(usage.promptTokens - cachedTokens, estimates)
    return [
        Usage(promptTokens=part + fresh, completionTokens=0, cachedTokens=part)
        for part, fresh in zip(cached, uncached, strict=True)
    ]


class _NeverStreamed:
    """
    The client stream of a request that is never streamed: the forwarder
    writes to one only for a chat completion that asked for a stream.
    """

    def begin(
        self, status: int, contentType: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> None:
        raise AssertionError("an embeddings answer is never streamed")

    def write(self, data: bytes) -> None:
        raise AssertionError("an embeddings answer is never streamed")

    def registerProducer(self, producer: IPushProducer) -> None:
        raise AssertionError("an embeddings answer is never streamed")

    def unregisterProducer(self) -> None:
        raise AssertionError("an embeddings answer is never streamed")


NEVER_STREAMED = _NeverStreamed()


def noErrorEvent(error: ApiError) -> bytes:
    """
    The error event of a stream, which an embeddings answer never is.
    """
    raise AssertionError("an embeddings answer is never streamed")
