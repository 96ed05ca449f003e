"""
POST /v1/messages and POST /v1/messages/count_tokens (decisions D14):
Anthropic's Messages API for Anthropic's SDKs.

/v1/messages is a route of conversations
(L{svcd.proxy.http.routes.conversation.ConversationRoutes}) in Anthropic's
dialect (L{MESSAGES}): through the same steps as chat completions, in the
same order (the token, in C{x-api-key} or C{Authorization: Bearer}; the
agent; ProxyChatCompletion; the limits; the body, L{svcd.dialects.checks};
the model; the budget; memory; the ledger), with recall's memories in
C{system} (L{svcd.proxy.http.messagesbody.withMemories}), errors in
Anthropic's envelope (L{svcd.dialects.errors.anthropicErrorBody}, which the
edge writes for every route of this dialect, the shared steps' refusals
included) and a broken stream ended by Anthropic's C{error} event.

/v1/messages/count_tokens (L{CountTokens}) reserves nothing and records no
row (it counts toward the requests per minute only): a model of an
Anthropic provider counts, any other model's count is D11's estimate of
the body.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger

from svcd.common.errors import ApiError, ErrorCode
from svcd.common.logbounds import loggedText
from svcd.limits.reservation import attemptsOf, promptEstimate
from svcd.providers.operations import COUNT_TOKENS
from svcd.providers.operations import MESSAGES as MESSAGES_OPERATION
from svcd.providers.table import ProviderTable
from svcd.providers.upstream import ANTHROPIC_BETA_HEADER, ANTHROPIC_VERSION_HEADER, Forwarder
from svcd.proxy.http.context import Reply, RequestContext, jsonBody
from svcd.proxy.http.messagesbody import MessagesRequest, parseMessagesRequest, withMemories
from svcd.proxy.http.routes.conversation import ClientDialect, ModelOf
from svcd.proxy.http.steps import bodyBytes


def _errorEvent(envelope: bytes) -> bytes:
    # Anthropic's error event: the same object as its error answers.
    return b"event: error\ndata: " + envelope + b"\n\n"


def _parse(body: bytes, modelOf: ModelOf) -> MessagesRequest:
    # A Messages body's rules are the same for every model.
    return parseMessagesRequest(body)


MESSAGES = ClientDialect(
    MESSAGES_OPERATION,
    _parse,
    withMemories,
    "Messages",
    _errorEvent,
    (ANTHROPIC_VERSION_HEADER, ANTHROPIC_BETA_HEADER),
)


class CountTokens:
    """
    The handler of POST /v1/messages/count_tokens.

    @param providers: the providers file; None is Phase 1 (501).
    @param forwarder: the providers' client, None without a providers file.
    """

    log = Logger()

    def __init__(self, providers: ProviderTable | None, forwarder: Forwarder | None) -> None:
        self._providers = providers
        self._forwarder = forwarder

    async def countTokens(self, ctx: RequestContext) -> Reply:
        """
        The input tokens of a Messages body, for its model: 501 as for
        /v1/messages when no provider is configured or the model is not
        one the caller's organization may use. A model of an Anthropic
        provider is counted by it (C{<base_url>/messages/count_tokens}, its
        answer relayed as given, with its fallbacks of Anthropic providers);
        any other's count is D11's estimate of the body (the one a limit
        reserves for it on /v1/messages). Nothing is reserved nor recorded
        (decisions D14: it counts toward the requests per minute only).
        """
        request = parseMessagesRequest(bodyBytes(ctx.request), countTokens=True)
        self.log.info(
            "Token count request for {model} with {message_count} messages",
            org_id=ctx.orgID,
            request_id=ctx.requestID,
            trace_id=ctx.traceID,
            model=loggedText(request.model),
            message_count=len(request.document["messages"]),
        )
        providers = self._providers
        if providers is None:
            raise ApiError(ErrorCode.PROVIDER_NOT_CONFIGURED)
        assert ctx.orgID is not None
        model = providers.modelFor(request.model, ctx.orgID)
        if model is None:
            raise ApiError(ErrorCode.PROVIDER_NOT_CONFIGURED)
        forwarder = self._forwarder
        if forwarder is None or COUNT_TOKENS.leg(model.provider) is None:
            return Reply(200, jsonBody({"input_tokens": promptEstimate(request.messages)}))
        answer = await forwarder.forward(
            request.document,
            attemptsOf(providers, model, ctx.orgID, False),
            ctx.requestID,
            _UNSTREAMED,
            _noEvent,
            ctx.upstream,
            operation=COUNT_TOKENS,
            clientHeaders=MESSAGES.passedOnOf(ctx.request),
        )
        return Reply(answer.status, answer.body, headers=list(answer.headers))


class _Unstreamed:
    """
    The client's side of a request that never streams (count_tokens): the
    forwarder writes nothing to it.
    """

    def begin(
        self, status: int, contentType: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> None:
        raise AssertionError("count_tokens does not stream")

    def write(self, data: bytes) -> None:
        raise AssertionError("count_tokens does not stream")

    def registerProducer(self, producer: IPushProducer) -> None:
        raise AssertionError("count_tokens does not stream")

    def unregisterProducer(self) -> None:
        pass


_UNSTREAMED = _Unstreamed()


def _noEvent(error: ApiError) -> bytes:
    raise AssertionError("count_tokens does not stream")
