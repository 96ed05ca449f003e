"""
POST /v1/embeddings (decisions D13): the embeddings body parsed and
checked, forwarded to its model's provider as chat completions are
(decisions D9: C{<base_url>/embeddings}, the same headers, timeouts, fault
mapping and fallbacks; never streamed), its reservation admitted and
settled (D11, D12) and its usage row recorded (D12), of kind
C{embedding}, however the answer ended.

The route's steps are the chat route's, in the same order (body size,
content type, token with C{ProxyEmbeddings}, agent, rate limit, then the
body); only the model's kind, what is reserved and the row differ. What
an embeddings request reserves and when its model refuses it is
L{svcd.limits.reservation}'s (L{reserveEmbeddings}, L{embeddingsRefusal});
the answer is relayed as the provider gave it, float or base64 vectors
alike.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError
from twisted.logger import Logger

from svcd.common.clocks import Clock
from svcd.common.errors import ApiError, ErrorCode
from svcd.common.logbounds import loggedText
from svcd.ledger.rows import UsageLedger
from svcd.limits.admission import Admission
from svcd.limits.book import Applicable
from svcd.limits.reservation import (
    attemptsOf,
    embeddingsRefusal,
    inputsEstimate,
    reserveEmbeddings,
)
from svcd.metered.embedder import (
    NEVER_STREAMED,
    EmbeddingCall,
    accountEmbedding,
    ledgerFull,
    noErrorEvent,
)
from svcd.metering.charges import CLIENT_GONE, OK, UPSTREAM_ERROR
from svcd.metering.models import EMBEDDING as EMBEDDING_MODEL
from svcd.metering.models import Model
from svcd.providers.operations import EMBEDDINGS
from svcd.providers.table import ProviderTable
from svcd.providers.upstream import Forwarder
from svcd.proxy.http.context import Reply, RequestContext
from svcd.proxy.http.embeddingsbody import EmbeddingsRequest, parseEmbeddingsBody
from svcd.proxy.http.steps import bodyBytes, forwardedLimits


class EmbeddingsRoutes:
    """
    What the embeddings route reserves at its rate limit, and its
    handler.

    @param providers: the providers file; None answers 501, as chat does
        without one.
    @param ledger: where each forwarded request's usage row goes.
    """

    log = Logger()

    def __init__(
        self,
        providers: ProviderTable | None,
        forwarder: Forwarder | None,
        ledger: UsageLedger | None,
        admission: Admission,
        clock: Clock,
    ) -> None:
        self._providers = providers
        self._forwarder = forwarder
        self._ledger = ledger
        self._admission = admission
        self._clock = clock

    def reserve(self, ctx: RequestContext, orgID: str) -> tuple[int, int]:
        """
        What the rate limit reserves, as the chat route's
        (L{svcd.proxy.http.routes.chat.ChatRoutes.reserve}): the ledger
        key is made here, and the inputs' estimate is reserved when a
        token limit applies (D11), their worst-case cost when a budget
        does (D12). A body that fails its rules, or that its model cannot
        take, reserves nothing; its 400 comes from the handler, after the
        rate limit.
        """
        tokens = cost = 0
        providers = self._providers
        if providers is not None:
            applicable = forwardedLimits(ctx, self._admission, orgID)
            if applicable.tokenLimited or applicable.budgeted:
                reserved = self._reserve(ctx, orgID, providers, applicable)
                if reserved is not None:
                    tokens, cost = reserved
                    ctx.estimate = (tokens, 0)
        return tokens, cost

    def _reserve(
        self, ctx: RequestContext, orgID: str, providers: ProviderTable, applicable: Applicable
    ) -> tuple[int, int] | None:
        """
        The tokens and worst-case cost of a request that will be forwarded;
        None for one that will be refused (400 or 501).
        """
        try:
            embeddings = ctx.embeddings = parseEmbeddingsBody(bodyBytes(ctx.request))
        except ApiError as refused:
            ctx.embeddingsError = refused
            return None
        model = providers.modelFor(embeddings.model, orgID, EMBEDDING_MODEL)
        if model is None:
            return None
        refusal = embeddingsRefusal(embeddings, model, applicable.budgeted)
        if refusal is not None:
            ctx.embeddingsError = refusal
            return None
        return reserveEmbeddings(embeddings, model, providers, orgID, applicable)

    def _settle(self, ctx: RequestContext, tokens: int) -> None:
        """
        Correct this request's reservation to C{tokens} and no cost, once.
        """
        reservation, ctx.reservation = ctx.reservation, None
        if reservation is not None:
            self._admission.settle(reservation, tokens)

    async def embeddings(self, ctx: RequestContext) -> Reply:
        """
        Parse and validate the body, log its metadata (never an input),
        then forward it to its model's provider: 501 without a providers
        file, or for a model that is not an embedding model the caller's
        organization may use.

        A request refused here is never forwarded, and whatever it had
        reserved is released.
        """
        try:
            return await self._embeddings(ctx)
        finally:
            if ctx.reservation is not None and not ctx.forwarded:
                self._settle(ctx, 0)

    async def _embeddings(self, ctx: RequestContext) -> Reply:
        if ctx.embeddingsError is not None:
            raise ctx.embeddingsError
        embeddings = ctx.embeddings
        if embeddings is None:
            embeddings = parseEmbeddingsBody(bodyBytes(ctx.request))
        span = ctx.span
        if span.is_recording():
            # Metadata only, as in the log line: never an input.
            span.set_attributes(
                {
                    "gen_ai.request.model": loggedText(embeddings.model),
                    "svc.embeddings.input_count": len(embeddings.inputs),
                }
            )
        self.log.info(
            "Embeddings request for {model} with {input_count} inputs",
            org_id=ctx.orgID,
            request_id=ctx.requestID,
            trace_id=ctx.traceID,
            model=loggedText(embeddings.model),
            input_count=len(embeddings.inputs),
            encoding_format=embeddings.encodingFormat,
        )
        providers, forwarder = self._providers, self._forwarder
        if providers is None or forwarder is None:
            raise ApiError(ErrorCode.PROVIDER_NOT_CONFIGURED)
        assert ctx.orgID is not None
        model = providers.modelFor(embeddings.model, ctx.orgID, EMBEDDING_MODEL)
        if model is None:
            # Not listed, another organization's, or a chat model: never a
            # hint of which.
            raise ApiError(ErrorCode.PROVIDER_NOT_CONFIGURED)
        refusal = embeddingsRefusal(embeddings, model, ctx.budgeted)
        if refusal is not None:
            raise refusal
        ctx.forwarded = True
        return await self._forward(ctx, embeddings, model, providers, forwarder)

    async def _forward(
        self,
        ctx: RequestContext,
        embeddings: EmbeddingsRequest,
        model: Model,
        providers: ProviderTable,
        forwarder: Forwarder,
    ) -> Reply:
        """
        Forward to the model's provider, then settle the reservation and
        record the usage row, however it ended (L{accountEmbedding}, which
        the gateway's own embeddings share, L{svcd.metered.embedder}).
        """
        ledger = self._ledger
        if ledger is not None and not ledger.hasRoom():
            # Never an answer that goes unrecorded.
            self._settle(ctx, 0)
            raise ledgerFull()
        outcome = OK
        try:
            answer = await forwarder.forward(
                embeddings.document,
                attemptsOf(providers, model, ctx.orgID or "", ctx.budgeted),
                ctx.requestID,
                NEVER_STREAMED,
                noErrorEvent,
                ctx.upstream,
                operation=EMBEDDINGS,
            )
        except ApiError:
            outcome = UPSTREAM_ERROR
            raise
        except CancelledError:
            outcome = CLIENT_GONE
            raise
        finally:
            self._account(ctx, embeddings, model, providers, outcome)
        return Reply(
            answer.status, answer.body, contentType=answer.contentType, headers=list(answer.headers)
        )

    def _account(
        self,
        ctx: RequestContext,
        embeddings: EmbeddingsRequest,
        model: Model,
        providers: ProviderTable,
        outcome: str,
    ) -> None:
        """
        Settle the reservation and record the row of kind C{embedding}
        (L{accountEmbedding}); the row counts the inputs' estimate when no
        usage came.
        """
        reservation, ctx.reservation = ctx.reservation, None
        estimate = ctx.estimate
        token = ctx.token
        accountEmbedding(
            self._admission,
            self._ledger,
            providers,
            call=EmbeddingCall(
                orgID=ctx.orgID or "",
                agentID=ctx.agentID,
                tokenID=token.tokenID if token is not None else None,
                requestID=ctx.requestID,
                ledgerID=ctx.ledgerID,
            ),
            reservation=reservation,
            record=ctx.upstream,
            model=model,
            modelRequested=embeddings.model,
            outcome=outcome,
            estimate=estimate[0] if estimate is not None else inputsEstimate(embeddings.inputs),
            startedAt=ctx.started,
            endedAt=self._clock.seconds(),
        )
