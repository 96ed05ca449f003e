"""
The routes that forward a conversation to its model's provider: POST
/v1/chat/completions (L{svcd.proxy.http.routes.chat}) and POST
/v1/messages (L{svcd.proxy.http.routes.messages}, decisions D14), each in
its own dialect, through the same steps in the same order: the body
parsed and checked, forwarded to its model's provider (decisions D9), its
reservation admitted and settled (D11, D12), its memories recalled and its
answer observed (D13), and its usage row recorded (D12), however the
answer ended.

What differs between the two is a L{ClientDialect}: how the body is
parsed, where recall's memories go, the words of the log line, and the
shape of errors (the edge's envelope for the route's dialect,
L{svcd.proxy.http.context.RequestContext.dialect}).

The policy lives with the limits and the ledger: what a chat completion
reserves and when its model refuses it (L{svcd.limits.reservation}), the
admission and settlement (L{svcd.limits.admission}), the row
(L{svcd.ledger.rows}). This module is the routes' glue between them and
the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from twisted.internet.defer import CancelledError
from twisted.logger import Logger

from svcd.common.clocks import Clock
from svcd.common.errors import ApiError, ErrorCode
from svcd.common.logbounds import loggedText
from svcd.common.twistedprivate import clientGone
from svcd.ledger.rows import UsageLedger, usageRow
from svcd.limits.admission import Admission
from svcd.limits.book import Applicable
from svcd.limits.reservation import (
    attemptsOf,
    estimateOf,
    modelRefusal,
    promptEstimate,
    reserve,
)
from svcd.metered.embedder import EmbeddingCall
from svcd.metering.charges import CLIENT_GONE, OK, UPSTREAM_ERROR, chargeOf
from svcd.metering.models import Model
from svcd.providers.operations import Operation
from svcd.providers.table import ProviderTable
from svcd.providers.upstream import Forwarder
from svcd.proxy.http.context import Conversation, Reply, RequestContext
from svcd.proxy.http.steps import bodyBytes, forwardedLimits
from svcd.proxy.observe import Observer
from svcd.proxy.recall import MEMORIES_HEADER, Recall, Recaller

ErrorReply = Callable[[RequestContext, ApiError], Reply]
StandardHeaders = Callable[[RequestContext, Reply], None]
# The model a body's C{model} names for the caller's organization, or None.
ModelOf = Callable[[object], Model | None]


@attrs.frozen
class ClientDialect:
    """
    What a route of conversations does in its clients' dialect.

    @ivar operation: what its requests ask of a provider, in its dialect
        (L{svcd.providers.operations}): how each attempt is carried to a
        provider of either C{api}, translated or not (decisions D14).
    @ivar parse: the body parsed and checked, given the model a name
        refers to for the caller (L{ModelOf}: a chat body's rules depend on
        its model's provider, decisions D14).
    @ivar withMemories: the request with recall's message of memories
        (decisions D13), where the dialect puts it.
    @ivar asked: what the log line says is asked (C{"Chat completion"}).
    @ivar errorEvent: the event that ends a broken stream, for the body of
        the edge's error envelope.
    @ivar passedOn: the client's headers an Anthropic provider is given as
        they are (lowercase names; decisions D14: C{anthropic-version},
        C{anthropic-beta} on the Messages route).
    """

    operation: Operation
    parse: Callable[[bytes, ModelOf], Conversation]
    withMemories: Callable[[Any, dict[str, str]], Conversation]
    asked: str
    errorEvent: Callable[[bytes], bytes]
    passedOn: tuple[bytes, ...] = ()

    def passedOnOf(self, request: Any) -> dict[bytes, bytes] | None:
        """
        The headers of C{passedOn} the client sent, by name; None for a
        dialect that passes none on.
        """
        if not self.passedOn:
            return None
        headers = request.requestHeaders
        passed = {}
        for name in self.passedOn:
            values = headers.getRawHeaders(name)
            if values:
                passed[name] = values[0]
        return passed


class ConversationRoutes:
    """
    What a route of conversations reserves at its rate limit, and its
    handler (L{handle}).

    @param dialect: its clients' (L{ClientDialect}).
    @param providers: the providers file; None is Phase 1 (501).
    @param ledger: where each forwarded request's usage row goes.
    @param errorReply: the edge's envelope of an error, for the event that
        ends a broken stream.
    @param standardHeaders: the edge's headers of every answer, for a
        stream's first bytes.
    @param recaller: context assembly (decisions D13), when memory is
        configured; None: requests are forwarded as they came.
    @param observer: observation (decisions D13), when memory is
        configured; None: no answer is observed.
    """

    log = Logger()

    def __init__(
        self,
        dialect: ClientDialect,
        providers: ProviderTable | None,
        forwarder: Forwarder | None,
        ledger: UsageLedger | None,
        admission: Admission,
        clock: Clock,
        errorReply: ErrorReply,
        standardHeaders: StandardHeaders,
        recaller: Recaller | None = None,
        observer: Observer | None = None,
    ) -> None:
        self._dialect = dialect
        self._providers = providers
        self._forwarder = forwarder
        self._ledger = ledger
        self._admission = admission
        self._clock = clock
        self._errorReply = errorReply
        self._standardHeaders = standardHeaders
        self._recaller = recaller
        self._observer = observer

    def reserve(self, ctx: RequestContext, orgID: str) -> tuple[int, int]:
        """
        What the chat route's rate limit reserves
        (L{svcd.proxy.http.steps.CallerSteps.rateLimit}): the request gets
        its ledger key here, where it is admitted for forwarding (decisions
        D12, amended), and reserves its tokens when a token limit applies
        to it (D11) and its worst-case cost when a budget does (D12). The
        body is parsed here for that, once; a body that fails its rules (or
        names a cap past its model's ceiling, or a model without a price
        under a budget) reserves nothing, and its 400 still comes from the
        handler, after the rate limit, in the spec's order.

        With memory configured (decisions D13), the recall is planned here
        too (L{Recaller.plan}: its settings, its headers, its query), and
        what it may add is part of the one reservation: the message of
        memories at its bound and the query's embedding.
        """
        tokens = cost = 0
        providers = self._providers
        if providers is not None:
            applicable = forwardedLimits(ctx, self._admission, orgID)
            if applicable.tokenLimited or applicable.budgeted or self._recaller is not None:
                reserved = self._reserve(ctx, orgID, providers, applicable)
                if reserved is not None:
                    prompt, cap, ctx.sentCap, cost, recallTokens = reserved
                    ctx.estimate = (prompt, cap)
                    tokens = prompt + cap + recallTokens
        return tokens, cost

    def _reserve(
        self, ctx: RequestContext, orgID: str, providers: ProviderTable, applicable: Applicable
    ) -> tuple[int, int, int | None, int, int] | None:
        """
        What a chat request that will be forwarded reserves at admission
        (decisions D11, D12): L{reserve}'s prompt, cap, cap sent and
        worst-case cost (the recall's embedding and message of memories
        included), and the tokens its recall may add (D13). None for a
        request that will be refused 400 (or 501), or that reserves
        nothing (no token limit nor budget).
        """
        try:
            chat = ctx.chat = self._parse(ctx, orgID)
        except ApiError as refused:
            ctx.chatError = refused
            return None
        model = providers.modelFor(chat.model, orgID)
        if model is None:
            # Not forwarded (501): nothing to reserve.
            return None
        refusal = modelRefusal(chat, model, applicable.budgeted) or self._dialect.operation.refusal(
            chat.document, model
        )
        if refusal is not None:
            ctx.chatError = refusal
            return None
        recaller = self._recaller
        plan = None
        if recaller is not None:
            try:
                plan = recaller.plan(
                    ctx.request, orgID, ctx.agentID, chat.messages, applicable.budgeted
                )
            except ApiError as refused:
                # A bad X-SVC-Memory or X-SVC-Memory-Subject: the handler's
                # 400, with nothing reserved.
                ctx.chatError = refused
                return None
            if plan is not None:
                ctx.recall = Recall(plan)
        if not (applicable.tokenLimited or applicable.budgeted):
            return None
        # Under a budget, the bodies measured are the bodies sent: serialized
        # once (L{worstCaseCost}), each as its provider is sent it
        # (decisions D14: translated when its dialect is not the client's).
        bodies = ctx.sentBodies = {} if applicable.budgeted else None
        body = self._dialect.operation.sendable
        extra = plan.extraBodyBytes() if plan is not None else 0
        prompt, cap, sentCap, cost = reserve(
            chat, model, providers, orgID, applicable, extra, bodies, body
        )
        if plan is None:
            return prompt, cap, sentCap, cost, 0
        if applicable.budgeted:
            cost += plan.embeddingCost(providers, orgID, applicable)
        return prompt, cap, sentCap, cost, plan.reserveTokens()

    def _parse(self, ctx: RequestContext, orgID: str) -> Conversation:
        """
        The request's body, parsed and checked by its dialect's rules for
        the model it names (L{ClientDialect.parse}).
        """
        providers = self._providers

        def modelOf(name: object) -> Model | None:
            if providers is None or not isinstance(name, str):
                return None
            return providers.modelFor(name, orgID)

        return self._dialect.parse(bodyBytes(ctx.request), modelOf)

    def _settle(self, ctx: RequestContext, tokens: int, cost: int = 0) -> None:
        """
        Correct this request's reservation to C{tokens} and C{cost}
        (decisions D11, D12), once.
        """
        reservation, ctx.reservation = ctx.reservation, None
        if reservation is not None:
            self._admission.settle(reservation, tokens, cost)

    async def handle(self, ctx: RequestContext) -> Reply:
        """
        Parse and validate the body, log its metadata (never the messages),
        then forward it to its model's provider (decisions D9): 501 when no
        provider is configured (Phase 1) or the model is not one the
        caller's organization may use.

        A request refused here is never forwarded, and whatever it had
        reserved is released (decisions D12, amended: a NO_PRICE 400 keeps
        nothing).
        """
        try:
            return await self._handle(ctx)
        finally:
            # Forwarded requests settle in _forward; this releases the
            # reservation of every refusal before it (once: _settle).
            if ctx.reservation is not None and not ctx.forwarded:
                self._settle(ctx, 0)

    async def _handle(self, ctx: RequestContext) -> Reply:
        if ctx.chatError is not None:
            raise ctx.chatError
        chat = ctx.chat if ctx.chat is not None else self._parse(ctx, ctx.orgID or "")
        # The client's own messages (a Messages body's turns, not the chat
        # messages the shared steps read of it).
        turns = len(chat.document.get("messages") or ())
        span = ctx.span
        if span.is_recording():
            # Metadata only, as in the log line: never a message's content.
            span.set_attributes(
                {
                    "gen_ai.request.model": loggedText(chat.model),
                    "svc.chat.message_count": turns,
                    "svc.chat.stream": chat.stream,
                }
            )
        self.log.info(
            "{asked} request for {model} with {message_count} messages",
            asked=self._dialect.asked,
            org_id=ctx.orgID,
            request_id=ctx.requestID,
            trace_id=ctx.traceID,
            model=loggedText(chat.model),
            message_count=turns,
            stream=chat.stream,
        )
        providers, forwarder = self._providers, self._forwarder
        if providers is None or forwarder is None:
            raise ApiError(ErrorCode.PROVIDER_NOT_CONFIGURED)
        assert ctx.orgID is not None
        model = providers.modelFor(chat.model, ctx.orgID)
        if model is None:
            # Never a hint that the model exists for another organization.
            raise ApiError(ErrorCode.PROVIDER_NOT_CONFIGURED)
        refusal = modelRefusal(chat, model, ctx.budgeted)
        if refusal is None:
            # Decisions D14: a field its provider's dialect cannot carry,
            # named; nothing is forwarded.
            refusal = self._dialect.operation.refusal(chat.document, model)
        if refusal is not None:
            raise refusal
        if self._observer is not None:
            ctx.observing = self._observer.plan(ctx.request, ctx.orgID, ctx.agentID, chat.stream)
        ctx.forwarded = True
        return await self._forward(ctx, chat, model, providers, forwarder)

    async def _forward(
        self,
        ctx: RequestContext,
        chat: Conversation,
        model: Model,
        providers: ProviderTable,
        forwarder: Forwarder,
    ) -> Reply:
        """
        Forward to the model's provider, then settle the request's
        reservation and record its usage row, however it ended (decisions
        D11, D12).
        """
        ledger = self._ledger
        if ledger is not None and not ledger.hasRoom():
            # Never an answer that goes unrecorded.
            self._settle(ctx, 0)
            raise ApiError(
                ErrorCode.SERVICE_DEGRADED,
                "The gateway cannot record usage right now; try again shortly.",
            )
        # Decisions D13: what the user said, before any memories were added.
        asked = chat.messages
        recall = ctx.recall
        if recall is not None:
            chat = await self._recall(ctx, chat, recall)
        observing = ctx.observing
        # A stream's text is gathered only for a request that observes.
        gather = None
        if observing is not None and observing.answer is not None:
            gather = observing.answer.addData
        outcome = OK
        try:
            answer = await forwarder.forward(
                chat.document,
                attemptsOf(providers, model, ctx.orgID or "", ctx.budgeted),
                ctx.requestID,
                _ClientStream(self._standardHeaders, ctx),
                lambda error: self.errorEvent(ctx, error),
                ctx.upstream,
                outputCap=ctx.sentCap,
                operation=self._dialect.operation,
                bodies=ctx.sentBodies,
                onEventData=gather,
                clientHeaders=self._dialect.passedOnOf(ctx.request),
            )
            if ctx.upstream.brokenMidStream:
                # The stream went out, then ended with an error event.
                outcome = UPSTREAM_ERROR
        except ApiError:
            outcome = UPSTREAM_ERROR
            raise
        except CancelledError:
            outcome = CLIENT_GONE
            raise
        finally:
            self._account(ctx, chat, model, providers, outcome)
        observer = self._observer
        if observing is not None and observer is not None and outcome == OK:
            # Decisions D13: an answer that ended ok becomes an observation,
            # recorded without waiting and never failing the answer.
            assert ctx.orgID is not None and ctx.agentID is not None
            observer.record(
                observing, ctx.orgID, ctx.agentID, ctx.requestID, asked, answer.body, ctx.ledgerID
            )
        return Reply(
            answer.status,
            answer.body,
            contentType=answer.contentType,
            headers=list(answer.headers),
            streamed=answer.streamed,
        )

    async def _recall(
        self, ctx: RequestContext, chat: Conversation, recall: Recall
    ) -> Conversation:
        """
        The request as it is forwarded (decisions D13): with the message of
        recalled memories when there are any, else as it came; the
        answer's C{X-SVC-Memories} says which. A fault or timeout of the
        recall is no fault of the request's: it goes on without memories.
        """
        recaller = self._recaller
        assert recaller is not None and ctx.orgID is not None
        token = ctx.token
        call = EmbeddingCall(
            orgID=ctx.orgID,
            agentID=ctx.agentID,
            tokenID=token.tokenID if token is not None else None,
            requestID=ctx.requestID,
            parentRequestID=ctx.requestID,
        )
        try:
            message = await recaller.memories(recall, call, ctx.budgeted)
        except CancelledError:
            # The client went away while recalling: nothing is forwarded,
            # and the reservation keeps what the embedding's row counts.
            self._settle(ctx, *recall.charge)
            raise
        ctx.responseHeaders.append((MEMORIES_HEADER, recall.header))
        if message is None:
            return chat
        chat = self._dialect.withMemories(chat, message)
        # Not the body the reservation measured any more.
        ctx.sentBodies = None
        if ctx.estimate is not None:
            # Decisions D11: the reservation counts the assembled messages,
            # and so does a row that keeps it.
            ctx.estimate = (promptEstimate(chat.messages), ctx.estimate[1])
        return chat

    def _account(
        self,
        ctx: RequestContext,
        chat: Conversation,
        model: Model,
        providers: ProviderTable,
        outcome: str,
    ) -> None:
        """
        Settle the reservation: released when the answer failed before its
        first byte; corrected to the provider's usage at the price of the
        model that answered; kept when no usage came (a client gone before
        it, a stream broken after its first byte). Then record the usage
        row.
        """
        upstream = ctx.upstream
        usage = upstream.usage
        answered = providers.models.get(upstream.model or "") or model
        # Decisions D13: a recall's embedding is settled with the chat, under
        # its reservation (docs/design.rst, D13 "Context assembly").
        plus = ctx.recall.charge if ctx.recall is not None else (0, 0)
        if usage is not None:
            reservation, ctx.reservation = ctx.reservation, None
            self._admission.settleUsage(
                reservation, usage, answered, ctx.orgID, ctx.requestID, ctx.ledgerID, plus
            )
        elif outcome == UPSTREAM_ERROR and not upstream.brokenMidStream:
            self._settle(ctx, *plus)
        if self._ledger is None:
            return
        estimate = ctx.estimate
        if estimate is None:
            estimate = estimateOf(
                chat, model, self._admission.applicable(ctx.orgID or "", ctx.agentID)
            )
        token = ctx.token
        self._ledger.record(
            usageRow(
                ledgerID=ctx.ledgerID,
                requestID=ctx.requestID,
                orgID=ctx.orgID or "",
                agentID=ctx.agentID,
                tokenID=token.tokenID if token is not None else None,
                modelRequested=chat.model,
                model=upstream.model,
                provider=upstream.provider,
                upstreamModel=upstream.upstreamModel,
                stream=chat.stream,
                outcome=outcome,
                charge=chargeOf(
                    usage,
                    outcome,
                    estimate,
                    answered.price,
                    afterFirstByte=upstream.brokenMidStream,
                ),
                startedAt=ctx.started,
                endedAt=self._clock.seconds(),
                memories=_injected(ctx.recall),
            )
        )

    def errorEvent(self, ctx: RequestContext, error: ApiError) -> bytes:
        """
        The one event that ends a stream after a fault (decisions D9), in
        the route's dialect (L{ClientDialect.errorEvent}).
        """
        return self._dialect.errorEvent(self._errorReply(ctx, error).body)


def _injected(recall: Recall | None) -> int | None:
    """
    The row's C{memories} (decisions D13): None without recall, else the
    memories the prompt got (0 after a fault, L{Recall.injected}).
    """
    return None if recall is None else recall.injected


class _ClientStream:
    """
    A request's response written as a stream (a relayed event stream): the
    status line and every header the answer would carry (request and trace
    ids, the time to this first byte, X-RateLimit-*), then each piece as it
    comes, with the relay as the producer so a slow client pauses it.
    """

    def __init__(self, standardHeaders: StandardHeaders, ctx: RequestContext) -> None:
        self._standardHeaders = standardHeaders
        self._ctx = ctx
        self._producing = False

    def _gone(self) -> bool:
        request: Any = self._ctx.request
        return bool(request.finished or clientGone(request))

    def begin(
        self, status: int, contentType: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> None:
        if self._gone():
            return
        request = self._ctx.request
        request.setResponseCode(status)
        outgoing = request.responseHeaders
        outgoing.setRawHeaders(b"Content-Type", [contentType])
        outgoing.setRawHeaders(b"Cache-Control", [b"no-cache"])
        outgoing.removeHeader(b"Server")
        reply = Reply(status, b"", contentType=contentType, headers=list(headers))
        self._standardHeaders(self._ctx, reply)
        for name, value in reply.headers:
            outgoing.addRawHeader(name, value)

    def write(self, data: bytes) -> None:
        if not self._gone():
            self._ctx.request.write(data)

    def registerProducer(self, producer: Any) -> None:
        if not self._gone():
            self._ctx.request.registerProducer(producer, True)
            self._producing = True

    def unregisterProducer(self) -> None:
        if self._producing and not self._gone():
            self._ctx.request.unregisterProducer()
        self._producing = False
