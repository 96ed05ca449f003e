"""
The memory routes of svc-proxy (decisions D13), on svc-memory: the edge
establishes who calls (token, agent) and whose memories (the subject
header, L{svcd.proxy.memoryheaders.memorySubject}), embeds what must be
embedded (L{svcd.metered.embedder}: a ledger row of kind C{embedding}
each) and asks svc-memory (L{svcd.memoryclient.client}).

  - C{POST /v1/memories}: C{{"content", "metadata"?}} embedded and
    stored, 201 the memory; C{{"messages"}} queued as an observation for
    svc-worker, 202 once svc-memory committed it (its id is the same for
    the same request id: a retry queues nothing twice).
  - C{GET /v1/memories} (newest first, C{limit}, C{after}), C{GET},
    C{PATCH} (re-embedded when the content changes) and C{DELETE
    /v1/memories/{id}}, C{DELETE /v1/memories} (the scope's memories and
    waiting observations).
  - C{POST /v1/memories/search}: the query embedded, the scope searched.

Every route runs the token (MemoryRead to read and search, MemoryWrite to
write), the agent and the rate limit, as every route; the routes that
embed reserve the texts' estimate at that rate limit step
(L{MemoryRoutes.reserving}), so that a request is one Redis script
call, and under a budget their worst case. Then, in the handler: the
subject header (400), the body or query (400), memory's configuration
(501 MEMORY_NOT_CONFIGURED), then the work.

Memory is configured for a request when svc-proxy has svc-memory's address
and the providers file its C{[memory]} table (else every route is 501),
and, for the routes that embed (adding, a PATCH with content, searching),
when the table's embedding model is offered to the caller's organization
and, under a budget, has a price (else those routes are 501; reading and
forgetting what is stored stay possible).

What svc-memory answers is mapped here (L{_failure}): another
organization's, agent's or subject's memory is 403 (never 404), no such id
404, a full scope 409 MEMORY_FULL, no answer in time 503 SERVICE_DEGRADED.
A provider's fault while embedding is the forwarder's (decisions D9), and
nothing is stored. Memory embeds with the C{[memory]} model alone, never
one of its fallbacks (decisions D13 amended, "Vectors never mix": a
fallback's vectors live in another space and would never be found); a
vector that memory cannot use is 502 UPSTREAM_ERROR with nothing stored
and the embedding's row kept: one not the model's C{dimensions} long, or
with a value that is not a finite float32 (the embedder's,
L{svcd.providers.vectors}), or not the length of the scope's other
vectors of the model (svc-memory's INVALID_ARGUMENT on C{embedding}).
Contents, queries and messages are never logged: lengths and counts only.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from twisted.logger import Logger

from svcd.common.clocks import Clock
from svcd.common.errors import ApiError, ErrorCode, FieldError, FieldErrorCode, validationError
from svcd.common.ids import uuid7Text
from svcd.common.logbounds import loggedText
from svcd.common.logthrottle import ThrottledWarning
from svcd.limits.admission import Admission
from svcd.memoryclient.client import MemoryClient
from svcd.memoryclient.errors import (
    MemoryCallFailed,
    MemoryForbidden,
    MemoryFull,
    MemoryInvalid,
    MemoryNotFound,
    MemoryUnavailable,
)
from svcd.memoryclient.records import (
    QUEUE_FULL,
    Embedding,
    InvalidMemory,
    ObservedMessage,
    Scope,
    checkEmbedding,
)
from svcd.metered.embedder import Embedder, EmbeddingCall, embeddingRefusal, reserveTexts
from svcd.metering.models import Model
from svcd.pb.memory.v1 import memory_pb2
from svcd.providers.table import MemoryConfig
from svcd.proxy.http.context import Reply, RequestContext, jsonBody
from svcd.proxy.http.memorybody import (
    Conversation,
    MemoryChange,
    MemorySearch,
    NewMemory,
    memoryJSON,
    parseAddBody,
    parseListQuery,
    parseMemoryID,
    parsePatchBody,
    parseSearchBody,
)
from svcd.proxy.http.steps import Reserve, bodyBytes
from svcd.proxy.memoryheaders import memorySubject
from svcd.proxy.observe import endedAtText

B = TypeVar("B")

_SCORE_DIGITS = 6

# Retry-After of a 429 MEMORY_QUEUE_FULL, in seconds. The organization's
# queue empties at the workers' pace, not at a time anyone can name: a
# minute lets a worker take some 10,000 observations at bench/README's
# rate, whereas a client that knows no better (no Retry-After) retries at
# once and adds a queueing transaction per try to svc-memory for nothing.
# Every other 429 of the gateway says when to come back too.
QUEUE_FULL_RETRY_AFTER = 60
# The statuses whose details gRPC or the client wrote (a transport's fault,
# a deadline, a bound), not svc-memory's code.
_TRANSPORT_CODES = (
    None,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
)


def _unavailable() -> ApiError:
    return ApiError(
        ErrorCode.SERVICE_DEGRADED, "Memory is unavailable right now; try again shortly."
    )


def _failure(failed: MemoryCallFailed, afterField: bool = False) -> ApiError:
    """
    The answer to a call svc-memory refused or did not answer.

    @param afterField: the call was a list's, whose C{after} names no
        memory when svc-memory answers NOT_FOUND (a 400 on C{after}, not
        a 404 of the route).
    """
    if isinstance(failed, MemoryNotFound):
        if afterField:
            return validationError(
                [FieldError("after", FieldErrorCode.INVALID_FORMAT, "names no memory")]
            )
        return ApiError(ErrorCode.NOT_FOUND, "No memory has this id.")
    if isinstance(failed, MemoryForbidden):
        # The spec's rule 2: another tenant's is 403, never 404.
        return ApiError(
            ErrorCode.INSUFFICIENT_PERMISSIONS,
            "The memory is not this agent's (or this subject's).",
        )
    if isinstance(failed, MemoryFull):
        return ApiError(ErrorCode.MEMORY_FULL)
    if isinstance(failed, MemoryInvalid):
        # The proxy checks what it sends first; what is left is a vector
        # svc-memory cannot take, which a provider made.
        field, _, problem = failed.details.partition(": ")
        if field.startswith(("embedding", "query")):
            return _badVectors()
        return validationError([FieldError(field, FieldErrorCode.INVALID_FORMAT, problem)])
    return _unavailable()


def _badVectors() -> ApiError:
    return ApiError(ErrorCode.UPSTREAM_ERROR, "The model provider's embeddings cannot be stored.")


class MemoryRoutes:
    """
    What the memory routes reserve at their rate limit (what they embed),
    and their handlers.

    @param config: the providers file's C{[memory]} table, None when
        memory is off (then every route answers 501 MEMORY_NOT_CONFIGURED).
    @param client: svc-memory's client, None when memory is off.
    @param embedder: embeds contents and queries, None without a
        providers file.
    """

    log = Logger()

    def __init__(
        self,
        config: MemoryConfig | None,
        client: MemoryClient | None,
        embedder: Embedder | None,
        admission: Admission,
        clock: Clock,
    ) -> None:
        self._config = config if client is not None and embedder is not None else None
        self._client = client
        self._embedder = embedder
        self._admission = admission
        self._clock = clock
        # svc-memory down or overloaded: every memory request notices.
        self._unavailable = ThrottledWarning(self.log, clock)

    # What a route that embeds reserves.

    def reserving(
        self, parse: Callable[[bytes], B], textsOf: Callable[[B], Sequence[str]]
    ) -> Reserve:
        """
        What the rate limit of a route that embeds reserves, as the
        embeddings route's (L{svcd.proxy.http.routes.embeddings.EmbeddingsRoutes.reserve}):
        when memory may embed for the caller and the body (read by
        C{parse}) has texts to embed (C{textsOf}), their estimate where a
        token limit applies, their worst-case cost where a budget does,
        under a ledger key made here. A body that fails its rules reserves
        nothing; its 400 comes from the handler, after the rate limit.
        """

        def reserve(ctx: RequestContext, orgID: str) -> tuple[int, int]:
            tokens = cost = 0
            model = self._embeddingModel(orgID)
            if model is not None:
                try:
                    body = parse(bodyBytes(ctx.request))
                except ApiError as refused:
                    ctx.memoryError = refused
                else:
                    ctx.memoryBody = body
                    texts = textsOf(body)
                    applicable = self._admission.applicable(orgID, ctx.agentID)
                    ctx.budgeted = applicable.budgeted
                    if texts:
                        ctx.ledgerID = uuid7Text()
                        if embeddingRefusal(model, applicable.budgeted) is None and (
                            applicable.tokenLimited or applicable.budgeted
                        ):
                            assert self._embedder is not None
                            tokens, cost = reserveTexts(
                                texts, model, self._embedder.providers, orgID, applicable
                            )
                            ctx.estimate = (tokens, 0)
            return tokens, cost

        return reserve

    # What every handler starts with.

    def _embeddingModel(self, orgID: str) -> Model | None:
        """
        The model memory embeds with for C{orgID}, None when memory is off
        or the model is not offered to it.
        """
        config = self._config
        if config is None:
            return None
        model = config.embeddingModel
        return model if model.allows(orgID) else None

    def _scope(self, ctx: RequestContext) -> Scope:
        """
        The request's scope: its organization, agent and subject (400 on
        the subject header).
        """
        subject = memorySubject(ctx.request)
        assert ctx.orgID is not None and ctx.agentID is not None
        return Scope(uuid.UUID(ctx.orgID), uuid.UUID(ctx.agentID), subject)

    def _memoryClient(self) -> MemoryClient:
        """
        svc-memory's client, or 501 when memory is off.
        """
        if self._config is None or self._client is None:
            raise ApiError(ErrorCode.MEMORY_NOT_CONFIGURED)
        return self._client

    def _embedding(
        self, ctx: RequestContext, embeds: bool = True
    ) -> tuple[MemoryClient, Embedder, Model]:
        """
        What a route that embeds needs, or 501: memory on, its model
        offered to the caller's organization and, under a budget, priced
        when this request C{embeds} (a text-mode search embeds nothing,
        and so is charged nothing).
        """
        client = self._memoryClient()
        assert ctx.orgID is not None and self._embedder is not None
        model = self._embeddingModel(ctx.orgID)
        if model is None:
            raise ApiError(
                ErrorCode.MEMORY_NOT_CONFIGURED,
                "Memory's embedding model is not offered to this organization.",
            )
        if embeds and embeddingRefusal(model, ctx.budgeted) is not None:
            raise ApiError(
                ErrorCode.MEMORY_NOT_CONFIGURED,
                "Memory's embedding model has no price, and a budget applies.",
            )
        return client, self._embedder, model

    def _body(self, ctx: RequestContext, parse: Callable[[bytes], B]) -> B:
        """
        The body the rate limit step read, or read now.
        """
        if ctx.memoryError is not None:
            raise ctx.memoryError
        if ctx.memoryBody is not None:
            body: B = ctx.memoryBody  # type: ignore[assignment]
            return body
        return parse(bodyBytes(ctx.request))

    def _release(self, ctx: RequestContext) -> None:
        """
        Release what a request reserved and never handed to the embedder.
        """
        reservation, ctx.reservation = ctx.reservation, None
        if reservation is not None:
            self._admission.settle(reservation, 0)

    async def _embed(
        self, ctx: RequestContext, embedder: Embedder, model: Model, text: str
    ) -> Embedding:
        """
        Embed C{text} for this request (its reservation settled, its row
        recorded under its ledger key) and check the vector as svc-memory
        will.
        """
        reservation, ctx.reservation = ctx.reservation, None
        token = ctx.token
        assert ctx.orgID is not None
        embedded = await embedder.embed(
            model,
            [text],
            EmbeddingCall(
                orgID=ctx.orgID,
                agentID=ctx.agentID,
                tokenID=token.tokenID if token is not None else None,
                requestID=ctx.requestID,
                ledgerID=ctx.ledgerID,
            ),
            reservation=reservation,
            budgeted=ctx.budgeted,
            record=ctx.upstream,
        )
        try:
            return checkEmbedding(embedded.model, embedded.vectors[0])
        except InvalidMemory:
            raise _badVectors() from None

    def _refused(
        self, ctx: RequestContext, failed: MemoryCallFailed, afterField: bool = False
    ) -> ApiError:
        """
        The answer to a failed call (L{_failure}); a call svc-memory did
        not answer is also logged, at most once per ten seconds, with its
        gRPC status and svc-memory's words (never content).
        """
        if isinstance(failed, MemoryUnavailable):
            code = failed.code
            self._unavailable.warn(
                "svc-memory did not answer: {code}: {details}",
                code=code.name if code is not None else None,
                # gRPC's own words, or the client's; an error svc-memory
                # wrote itself is left out, lest it quote a value.
                details=loggedText(failed.details) if code in _TRANSPORT_CODES else None,
                request_id=ctx.requestID,
            )
        return _failure(failed, afterField)

    def _logged(self, ctx: RequestContext, operation: str, **fields: object) -> None:
        """
        One line per memory operation: ids, counts and lengths, never a
        content, a query, a message or the subject (which may name a
        person).
        """
        self.log.info(
            "Memory {operation}",
            operation=operation,
            org_id=ctx.orgID,
            agent_id=ctx.agentID,
            request_id=ctx.requestID,
            trace_id=ctx.traceID,
            **fields,
        )

    # Handlers.

    async def add(self, ctx: RequestContext) -> Reply:
        """
        C{POST /v1/memories}: store a memory (201), or queue a
        conversation (202).
        """
        try:
            scope = self._scope(ctx)
            body = self._body(ctx, parseAddBody)
            if isinstance(body, Conversation):
                return await self._observe(ctx, scope, body)
            assert isinstance(body, NewMemory)
            client, embedder, model = self._embedding(ctx)
            self._logged(ctx, "add", content_characters=len(body.content))
            embedding = await self._embed(ctx, embedder, model, body.content)
            try:
                memory = await client.addMemory(
                    scope, body.content, embedding, body.metadataJSON, "api", ctx.requestID
                )
            except MemoryCallFailed as failed:
                raise self._refused(ctx, failed) from None
            return Reply(201, jsonBody(memoryJSON(memory)))
        finally:
            self._release(ctx)

    async def _observe(self, ctx: RequestContext, scope: Scope, body: Conversation) -> Reply:
        """
        Queue the conversation for svc-worker, answered once svc-memory
        committed it; its id is the observation's, the same for the same
        request id.
        """
        client = self._memoryClient()
        self._embedding(ctx)
        self._logged(ctx, "observe", message_count=len(body.messages))
        observation = memory_pb2.Observation(
            scope=memory_pb2.Scope(
                org_id=str(scope.orgID), agent_id=str(scope.agentID), subject=scope.subject
            ),
            request_id=ctx.requestID,
            messages=[
                memory_pb2.ObservedMessage(role=message.role, content=message.content)
                for message in body.messages
            ],
            key=conversationKey(scope, ctx.requestID, body.messages),
            # Said by the time of the request (decisions D13, amended): a
            # deletion after it does not take it.
            ended_at=endedAtText(ctx.started),
        )
        try:
            answer = await client.queueObservations([observation])
        except MemoryCallFailed as failed:
            raise self._refused(ctx, failed) from None
        [queued] = answer.queued
        if queued.refused == QUEUE_FULL:
            raise ApiError(
                ErrorCode.MEMORY_QUEUE_FULL,
                headers=[("Retry-After", str(QUEUE_FULL_RETRY_AFTER))],
            )
        return Reply(
            202, jsonBody({"object": "memory.observation", "id": queued.id, "status": "queued"})
        )

    async def listMemories(self, ctx: RequestContext) -> Reply:
        """
        C{GET /v1/memories}: a page of the scope's memories, newest first.
        """
        scope = self._scope(ctx)
        page = parseListQuery(ctx.request.args or {})
        client = self._memoryClient()
        try:
            answer = await client.listMemories(scope, page.limit, page.after or "")
        except MemoryCallFailed as failed:
            raise self._refused(ctx, failed, afterField=True) from None
        data = [memoryJSON(memory) for memory in answer.memories]
        return Reply(
            200,
            jsonBody(
                {
                    "object": "list",
                    "data": data,
                    "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None,
                    "has_more": answer.has_more,
                }
            ),
        )

    async def getMemory(self, ctx: RequestContext) -> Reply:
        """
        C{GET /v1/memories/{id}}.
        """
        scope = self._scope(ctx)
        memoryID = parseMemoryID(ctx.params["id"])
        client = self._memoryClient()
        try:
            memory = await client.getMemory(scope, memoryID)
        except MemoryCallFailed as failed:
            raise self._refused(ctx, failed) from None
        return Reply(200, jsonBody(memoryJSON(memory)))

    async def change(self, ctx: RequestContext) -> Reply:
        """
        C{PATCH /v1/memories/{id}}: a new content (re-embedded when it
        differs from the stored one) and/or metadata.

        The memory is read first: an id of another scope is 403 and an
        unknown one 404 before anything is embedded, and a content equal
        to the stored one is not embedded again.
        """
        try:
            scope = self._scope(ctx)
            memoryID = parseMemoryID(ctx.params["id"])
            change = self._body(ctx, parsePatchBody)
            assert isinstance(change, MemoryChange)
            client = self._memoryClient()
            try:
                current = await client.getMemory(scope, memoryID)
            except MemoryCallFailed as failed:
                raise self._refused(ctx, failed) from None
            content = change.content if change.content != current.content else None
            self._logged(
                ctx,
                "change",
                memory_id=memoryID,
                content_characters=len(content) if content is not None else None,
                metadata_changed=change.metadataJSON is not None,
            )
            if content is None and change.metadataJSON is None:
                return Reply(200, jsonBody(memoryJSON(current)))
            embedding = None
            if content is not None:
                client, embedder, model = self._embedding(ctx)
                embedding = await self._embed(ctx, embedder, model, content)
            try:
                memory = await client.updateMemory(
                    scope, memoryID, content, change.metadataJSON, embedding
                )
            except MemoryCallFailed as failed:
                raise self._refused(ctx, failed) from None
            return Reply(200, jsonBody(memoryJSON(memory)))
        finally:
            self._release(ctx)

    async def delete(self, ctx: RequestContext) -> Reply:
        """
        C{DELETE /v1/memories/{id}}: forgotten, everywhere.
        """
        scope = self._scope(ctx)
        memoryID = parseMemoryID(ctx.params["id"])
        client = self._memoryClient()
        self._logged(ctx, "delete", memory_id=memoryID)
        try:
            answer = await client.deleteMemory(scope, memoryID)
        except MemoryCallFailed as failed:
            raise self._refused(ctx, failed) from None
        return Reply(200, jsonBody({"id": answer.id, "object": "memory", "deleted": True}))

    async def deleteScope(self, ctx: RequestContext) -> Reply:
        """
        C{DELETE /v1/memories}: every memory of the agent and subject, and
        its observations not yet processed.
        """
        scope = self._scope(ctx)
        client = self._memoryClient()
        try:
            answer = await client.deleteScope(scope)
        except MemoryCallFailed as failed:
            raise self._refused(ctx, failed) from None
        self._logged(
            ctx,
            "delete scope",
            memories_deleted=answer.memories_deleted,
            observations_deleted=answer.observations_deleted,
        )
        return Reply(200, jsonBody({"deleted": answer.memories_deleted}))

    async def search(self, ctx: RequestContext) -> Reply:
        """
        C{POST /v1/memories/search}: the scope's best memories for the
        query, best first, by the body's C{mode} (decisions D13): by cosine
        similarity to the query embedded (C{vector}), by BM25 over their
        words (C{text}: nothing embedded, nothing charged), or both fused
        by rank (C{hybrid}).
        """
        try:
            scope = self._scope(ctx)
            search = self._body(ctx, parseSearchBody)
            assert isinstance(search, MemorySearch)
            client, embedder, model = self._embedding(ctx, embeds=bool(searchTexts(search)))
            self._logged(
                ctx,
                "search",
                query_characters=len(search.query),
                k=search.k,
                min_score=search.minScore,
                mode=search.mode,
            )
            query = None
            if search.mode != "text":
                query = await self._embed(ctx, embedder, model, search.query)
            try:
                answer = await client.search(
                    scope, query, search.k, search.minScore, mode=search.mode, text=search.query
                )
            except MemoryCallFailed as failed:
                raise self._refused(ctx, failed) from None
            data: list[dict[str, Any]] = [
                {"memory": memoryJSON(each.memory), "score": round(each.score, _SCORE_DIGITS)}
                for each in answer.results
            ]
            return Reply(200, jsonBody({"object": "list", "data": data}))
        finally:
            self._release(ctx)


def addTexts(body: NewMemory | Conversation) -> Sequence[str]:
    """
    What adding embeds: a memory's content; nothing for a conversation
    (svc-worker embeds what it learns, and pays then).
    """
    return (body.content,) if isinstance(body, NewMemory) else ()


def changeTexts(change: MemoryChange) -> Sequence[str]:
    """
    What a PATCH may embed: its new content (reserved even when it turns
    out to be the stored one, and then released).
    """
    return (change.content,) if change.content is not None else ()


def searchTexts(search: MemorySearch) -> Sequence[str]:
    """
    What a search embeds: its query, but in text mode (nothing).
    """
    return () if search.mode == "text" else (search.query,)


def conversationKey(scope: Scope, requestID: str, messages: Sequence[ObservedMessage]) -> str:
    """
    The idempotence key of a conversation posted to C{/v1/memories}: its
    request id, agent, subject and messages, digested. A retry (the same
    X-Request-ID and body) queues it once and answers the same
    observation id; a client that reuses a request id for another
    conversation, or another agent that sends the same one, queues its
    own, where a key of the request id alone answered it as queued before
    and never processed it. (A chat's observation is keyed by its ledger
    id: a chat is never retried into the same observation.)
    """
    document = json.dumps(
        [
            str(scope.agentID),
            scope.subject,
            requestID,
            [[message.role, message.content] for message in messages],
        ],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return "conversation:" + hashlib.sha256(document.encode("utf-8", "surrogatepass")).hexdigest()
