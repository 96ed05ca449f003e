"""
One observation, from its claim to its completion (decisions D13): what
svc-worker does with each, and what it pays for each step.

  1. With an C{extraction_model}, a chat completion asks it for the
     memories (L{svcd.worker.extraction}); without one, the user's text is
     the one memory.
  2. One embeddings call embeds them all (L{svcd.metered.embedder}, the
     gateway's own embeddings, as the proxy's recall makes them).
  3. For each, the scope's nearest memory at or above C{dedupe_score}
     takes the new content (same id), else it is added (source
     C{extracted}, the observation's request id); then the observation is
     completed (svc-memory deletes it). Both in one call to svc-memory
     (C{StoreObservation}), which stores nothing when another claim holds
     the lease, writes into the observation's own scope whatever the call
     names, and plans under the scope's lock so that the same fact in
     observations stored at once is one memory.

Each provider call is the organization's (decisions D11, D12, D12
amended): admitted against its and its agent's token limits and budgets
(never a requests limit: rpm counts clients' requests, and a worker
draining a backlog must not lock the organization's clients out), with
the true worst case reserved (the prompt's bytes, the output cap sent
upstream under the model's C{cap_field}), settled to the provider's usage,
and recorded as one ledger row of kind C{extraction} or C{embedding} whose
parent is the observation's request id.

How an observation can end other than completed is an exception of this
module, which the loop (L{svcd.worker.loop}) turns into svc-memory's
release: L{Deferral} (a limit's or a budget's refusal, a full ledger,
svc-memory unreachable: waits, no attempt counted; after a paid
extraction, a L{FailedAttempt} that waits at least as long) or
L{FailedAttempt} (counted, backed off, kept as failed after the last).

At least once, never twice: each step may run again after a crash (the
lease runs out and another claim takes the observation). Extraction and
embedding run again and are paid again (they happened again); a memory
already stored is found by the search (score 1 to itself) and takes the
same content, and svc-memory adds an extracted memory once per request and
content whatever the search says (sql/0011_memory_extracted_index.sql).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from twisted.internet.defer import CancelledError
from twisted.logger import Logger

from svcd.common.clocks import Clock
from svcd.common.errors import ApiError, ErrorCode
from svcd.common.ids import uuid7Text
from svcd.ledger.rows import EXTRACTION, UsageLedger, usageRow
from svcd.limits.admission import Admission
from svcd.limits.book import Applicable
from svcd.limits.records import Reservation
from svcd.limits.reservation import attemptsOf, outputCap, promptEstimate, worstCaseCost
from svcd.memoryclient.client import MemoryClient
from svcd.memoryclient.errors import MemoryCallFailed, MemoryFull, MemoryNotFound, MemoryUnavailable
from svcd.memoryclient.records import FORGOTTEN_DETAILS, Embedding, Scope
from svcd.metered.embedder import (
    NEVER_STREAMED,
    Embedder,
    EmbeddingCall,
    embeddingRefusal,
    memoryAttempts,
    noErrorEvent,
    reserveTexts,
)
from svcd.metering.charges import CLIENT_GONE, OK, UPSTREAM_ERROR, chargeOf
from svcd.metering.models import Model
from svcd.providers.operations import CHAT_COMPLETIONS
from svcd.providers.records import UpstreamRecord
from svcd.providers.table import MemoryConfig, ProviderTable
from svcd.providers.upstream import Forwarder
from svcd.worker.extraction import BadExtraction, Turn, extractionRequest, memoriesOf, userText
from svcd.worker.lease import LeaseLost, ObservationLease
from svcd.worker.metrics import DONE, EMPTY, FORGOTTEN, LOST, WorkerMetrics

# The longest a refusal makes an observation wait (decisions D13): a
# budget's Retry-After runs to the end of its day or month.
MAX_DEFERRAL = 300.0
# How long an observation waits when the ledger has no room for its rows,
# or svc-memory did not answer.
BUSY_DEFERRAL = 5.0


class Deferral(Exception):
    """
    The observation must wait C{retryAfter} seconds through no fault of its
    own: not charged, not lost, no attempt counted (decisions D13).
    """

    def __init__(self, retryAfter: float, reason: str) -> None:
        super().__init__(reason)
        self.retryAfter = min(max(retryAfter, 0.0), MAX_DEFERRAL)
        self.reason = reason


class FailedAttempt(Exception):
    """
    An attempt failed (a provider's fault, an answer not as decided, a
    value svc-memory refused): counted, and tried again after a backoff,
    unless C{final} (no attempt can mend it, as a full scope).

    @ivar reason: for operators (svcctl memory jobs); never content.
    """

    def __init__(self, reason: str, final: bool = False, retryAfter: float = 0.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.final = final
        # At least this long before the next attempt (a refusal's
        # Retry-After), whatever the backoff.
        self.retryAfter = retryAfter


@attrs.frozen
class Observation:
    """
    A claimed observation (svc-memory's C{ClaimedObservation}).

    @ivar attempts: failed attempts before this claim.
    """

    observationID: str
    orgID: str
    agentID: str
    subject: str = attrs.field(repr=False)
    requestID: str
    turns: tuple[Turn, ...] = attrs.field(repr=False)
    attempts: int
    leaseToken: str = ""

    @property
    def scope(self) -> Scope:
        return Scope(uuid.UUID(self.orgID), uuid.UUID(self.agentID), self.subject)

    @classmethod
    def fromClaim(cls, claimed: Any) -> Observation:
        """
        From svc-memory's C{ClaimedObservation} message.
        """
        return cls(
            observationID=claimed.id,
            orgID=claimed.scope.org_id,
            agentID=claimed.scope.agent_id,
            subject=claimed.scope.subject,
            requestID=claimed.request_id,
            turns=tuple(Turn(each.role, each.content) for each in claimed.messages),
            attempts=claimed.attempts,
            leaseToken=claimed.lease_token,
        )


@attrs.frozen
class _ChatBody:
    """
    The extraction request in the shape the worst case reads
    (L{svcd.limits.reservation.ChatBody}).
    """

    document: Mapping[str, Any]
    maxTokens: int | None = None
    maxCompletionTokens: int | None = None
    choices: int = 1

    @property
    def messages(self) -> Sequence[Mapping[str, Any]]:
        messages: Sequence[Mapping[str, Any]] = self.document["messages"]
        return messages


def _apiReason(error: ApiError) -> str:
    """
    An operator's reason for a provider's fault: the code and the
    gateway's own message, never the provider's words (which may quote
    content).
    """
    return f"{error.code.value}: {error.message}"


def _retryAfter(error: ApiError) -> float:
    for name, value in error.headers:
        if name.lower() == "retry-after" and value.isascii() and value.isdigit():
            return float(value)
    return BUSY_DEFERRAL


class ObservationProcessor:
    """
    Turns one claimed observation into memories (see the module docstring).

    @param owner: the name the worker's leases are held under.
    @param memory: svc-memory's client.
    @param providers: the providers file, with its C{[memory]} table.
    @param forwarder: the providers' client (the extraction's chat
        completion).
    @param embedder: the gateway's own embeddings.
    @param admission: the limits and budgets of each provider call.
    @param ledger: where each call's row goes.
    """

    log = Logger()

    def __init__(
        self,
        owner: str,
        memory: MemoryClient,
        providers: ProviderTable,
        forwarder: Forwarder,
        embedder: Embedder,
        admission: Admission,
        ledger: UsageLedger,
        metrics: WorkerMetrics,
        clock: Clock,
    ) -> None:
        memoryConfig = providers.memory
        if memoryConfig is None:
            raise ValueError("svc-worker needs the providers file's [memory] table")
        self._owner = owner
        self._memory = memory
        self._providers = providers
        self._settings: MemoryConfig = memoryConfig
        self._forwarder = forwarder
        self._embedder = embedder
        self._admission = admission
        self._ledger = ledger
        self._metrics = metrics
        self._clock = clock

    async def process(self, observation: Observation, lease: ObservationLease) -> str:
        """
        Extract, embed, store and complete C{observation}.

        @param lease: its lease: held (renewed first when late) before the
            embeddings call, so that a worker that lost it pays for
            nothing more; svc-memory's StoreObservation checks it, under
            the observation's row lock, before it stores anything.
        @return: its outcome: L{DONE}, L{EMPTY} (nothing to remember),
            L{FORGOTTEN} (a deletion of its scope or agent took it
            meanwhile) or L{LOST} (it was dropped meanwhile).
        @raise Deferral: it must wait.
        @raise FailedAttempt: this attempt failed.
        @raise LeaseLost: another claim holds it now: nothing was stored.
        @raise LeaseUnrenewable: svc-memory did not renew its lease.
        """
        applicable = self._admission.applicable(observation.orgID, observation.agentID)
        extraction = self._settings.extractionModel
        if extraction is None:
            text = userText(observation.turns)
            memories = [text] if text else []
        else:
            memories = await self._extract(observation, extraction, applicable)
        try:
            embeddings: list[Embedding] = []
            if memories:
                await lease.hold()
                embedded = await self._embed(observation, memories, applicable)
                embeddings = [Embedding(embedded.model, vector) for vector in embedded.vectors]
            return await self._store(
                observation,
                lease,
                list(zip(memories, embeddings, strict=True)),
                DONE if memories else EMPTY,
            )
        except Deferral as deferral:
            if extraction is None:
                raise
            # The extraction is paid, and the next attempt pays it again:
            # counted, so that a wait that keeps coming after it (a tpm
            # that holds the extraction but never its embedding as well)
            # ends at SVC_WORKER_MAX_ATTEMPTS instead of paying forever.
            raise FailedAttempt(
                f"after its paid extraction: {deferral.reason}", retryAfter=deferral.retryAfter
            ) from None

    # The provider calls.

    def _refuseWithoutRoom(self) -> None:
        if not self._ledger.hasRoom():
            raise Deferral(BUSY_DEFERRAL, "the ledger's outbox is full")

    async def _admit(
        self, observation: Observation, tokens: int, cost: int, ledgerID: str
    ) -> Reservation | None:
        try:
            return await self._admission.admit(
                observation.orgID,
                observation.agentID,
                [],
                tokens,
                cost,
                ledgerID=ledgerID,
                countRequest=False,
            )
        except ApiError as refusal:
            raise Deferral(_retryAfter(refusal), _apiReason(refusal)) from None

    async def _extract(
        self, observation: Observation, model: Model, applicable: Applicable
    ) -> list[str]:
        """
        Ask the extraction model for the observation's memories, as the
        organization: admitted, settled, one row of kind C{extraction}.
        """
        self._refuseWithoutRoom()
        budgeted = applicable.budgeted
        attempts = attemptsOf(self._providers, model, observation.orgID, budgeted)
        if not attempts:
            raise FailedAttempt(
                "the extraction model has no price (and a budget applies) or is not open"
                " to this organization",
                final=True,
            )
        document = extractionRequest(model.name, observation.turns)
        chat = _ChatBody(document)
        # The cap is always sent (under each model's cap_field), so that
        # what tpm reserves and what a budget assumes both bound the answer.
        cap = outputCap(document, applicable, model.maxOutputTokens)
        prompt = promptEstimate(chat.messages)
        cost = worstCaseCost(chat, attempts, cap, cap) if budgeted else 0
        ledgerID = uuid7Text()
        reservation = await self._admit(observation, prompt + cap, cost, ledgerID)
        record = UpstreamRecord()
        startedAt = self._clock.seconds()
        outcome = OK
        try:
            answer = await self._forwarder.forward(
                document,
                attempts,
                ledgerID,
                NEVER_STREAMED,
                noErrorEvent,
                record,
                outputCap=cap,
                operation=CHAT_COMPLETIONS,
            )
        except ApiError as fault:
            outcome = UPSTREAM_ERROR
            raise FailedAttempt(f"extraction: {_apiReason(fault)}") from None
        except CancelledError:
            outcome = CLIENT_GONE
            raise
        finally:
            self._account(
                observation, model, reservation, record, outcome, (prompt, cap), startedAt, ledgerID
            )
        try:
            return memoriesOf(answer.body)
        except BadExtraction as bad:
            raise FailedAttempt(f"extraction: {bad}") from None

    def _account(
        self,
        observation: Observation,
        model: Model,
        reservation: Reservation | None,
        record: UpstreamRecord,
        outcome: str,
        estimate: tuple[int, int],
        startedAt: float,
        ledgerID: str,
    ) -> None:
        """
        Settle the extraction's reservation and record its row, however it
        ended (as the proxy's chat route does): to the provider's usage at
        the price of the model that answered; released after a fault with
        no usage; kept otherwise (a cancelled call: the limiter's lease
        ends it, and the row counts the estimate).
        """
        usage = record.usage
        answered = self._providers.models.get(record.model or "") or model
        if usage is not None:
            self._admission.settleUsage(
                reservation, usage, answered, observation.orgID, ledgerID, ledgerID
            )
        elif outcome == UPSTREAM_ERROR and reservation is not None:
            self._admission.settle(reservation, 0)
        self._ledger.record(
            usageRow(
                ledgerID=ledgerID,
                requestID=ledgerID,
                orgID=observation.orgID,
                agentID=observation.agentID,
                tokenID=None,
                modelRequested=model.name,
                model=record.model,
                provider=record.provider,
                upstreamModel=record.upstreamModel,
                stream=False,
                outcome=outcome,
                charge=chargeOf(usage, outcome, estimate, answered.price),
                startedAt=startedAt,
                endedAt=self._clock.seconds(),
                kind=EXTRACTION,
                parentRequestID=observation.requestID,
            )
        )

    async def _embed(
        self, observation: Observation, texts: list[str], applicable: Applicable
    ) -> Any:
        """
        Embed the memories in one call, as the organization (one row of kind
        C{embedding}, by the gateway's embedder), with the memory model
        alone (never a fallback, whose vectors would never be found).

        An answer whose vectors memory cannot use (their length, a value
        that is not a finite float32: 502 UPSTREAM_ERROR, its row kept, the
        provider paid) is a failed attempt like any provider's fault:
        counted and backed off, for a provider that misbehaves now may
        answer well later, and one that never does ends at
        C{SVC_WORKER_MAX_ATTEMPTS} instead of paying forever.
        """
        self._refuseWithoutRoom()
        model = self._settings.embeddingModel
        budgeted = applicable.budgeted
        refusal = embeddingRefusal(model, budgeted)
        if refusal is not None or not memoryAttempts(model, observation.orgID, budgeted):
            raise FailedAttempt(
                "the embedding model has no price (and a budget applies) or is not open"
                " to this organization",
                final=True,
            )
        tokens, cost = reserveTexts(texts, model, self._providers, observation.orgID, applicable)
        ledgerID = uuid7Text()
        reservation = await self._admit(observation, tokens, cost, ledgerID)
        call = EmbeddingCall(
            observation.orgID,
            observation.agentID,
            None,
            requestID=ledgerID,
            ledgerID=ledgerID,
            parentRequestID=observation.requestID,
        )
        try:
            return await self._embedder.embed(
                model, texts, call, reservation=reservation, budgeted=budgeted
            )
        except ApiError as fault:
            if fault.code is ErrorCode.SERVICE_DEGRADED:
                raise Deferral(BUSY_DEFERRAL, "the ledger's outbox is full") from None
            raise FailedAttempt(f"embedding: {_apiReason(fault)}") from None

    # svc-memory.

    async def _store(
        self,
        observation: Observation,
        lease: ObservationLease,
        memories: list[tuple[str, Embedding]],
        outcome: str,
    ) -> str:
        """
        Merge the memories into the scope (the nearest at or above
        C{dedupe_score} takes the new content, else it is added) and
        complete the observation, in one call to svc-memory, which renews
        the lease first and stores nothing when another claim holds it.
        When the observation is no longer there (a purge or a drop while
        it was processed), svc-memory deletes the memories it added for it,
        so that nothing forgotten comes back.
        """
        try:
            stored = await self._memory.storeObservation(
                observation.orgID,
                observation.observationID,
                self._owner,
                lease.token,
                lease.seconds,
                observation.scope,
                observation.requestID,
                memories,
                self._settings.dedupeScore,
            )
        except MemoryNotFound as gone:
            return FORGOTTEN if gone.details == FORGOTTEN_DETAILS else LOST
        except MemoryFull:
            raise FailedAttempt("the memory scope is full", final=True) from None
        except MemoryUnavailable as error:
            raise Deferral(
                BUSY_DEFERRAL, f"svc-memory did not answer ({_memoryReason(error)})"
            ) from None
        except MemoryCallFailed as error:
            raise FailedAttempt(f"svc-memory refused a memory ({_memoryReason(error)})") from None
        for _ in stored.added_ids:
            self._metrics.wrote("added")
        for _ in range(stored.updated):
            self._metrics.wrote("updated")
        if not stored.stored:
            if not stored.added_ids and not stored.updated:
                raise LeaseLost()
            # Its lease passed to another claim while it was stored: that
            # claim completes it (and finds these memories in place).
            return LOST
        return outcome


def _memoryReason(error: MemoryCallFailed) -> str:
    return error.code.name if error.code is not None else error.details
