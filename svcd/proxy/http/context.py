"""
The request context that travels through the middleware, the answer it
produces, and the shapes of layers, steps and routes.

A I{layer} wraps everything inside it (C{async def layer(ctx, inner) ->
Reply}); a I{step} checks one thing and either returns or raises
L{ApiError} (C{async def step(ctx) -> None}); a route's I{handler} makes
the answer (C{async def handler(ctx) -> Reply}).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
from opentelemetry.trace import INVALID_SPAN, Span
from twisted.web.server import Request

from svcd.common.errors import ApiError
from svcd.limits.records import Reservation
from svcd.metering.models import OPENAI
from svcd.providers.records import UpstreamRecord
from svcd.proxy.http.embeddingsbody import EmbeddingsRequest
from svcd.proxy.observe import Observing
from svcd.proxy.recall import Recall
from svcd.proxy.records import AgentInfo, TokenInfo

JSON = b"application/json"


def jsonBody(document: object) -> bytes:
    """
    C{document} as the compact UTF-8 JSON of an answer's body.
    """
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


@attrs.define(slots=True)
class Reply:
    """
    An HTTP answer not yet written: status, body, content type and the
    headers particular to it.
    """

    status: int
    body: bytes
    contentType: bytes = JSON
    headers: list[tuple[bytes, bytes]] = attrs.field(factory=list)
    # Written already, as a stream, status line and headers included
    # (svcd.proxy.http.routes.chat._ClientStream).
    streamed: bool = False


class Conversation(Protocol):
    """
    What the routes that forward a conversation to a model (chat
    completions, messages) read of their parsed body, whichever dialect it
    is in: L{svcd.proxy.http.chatbody.ChatRequest} and
    L{svcd.proxy.http.messagesbody.MessagesRequest} are ones, and both are
    L{svcd.limits.reservation.ChatBody}s.
    """

    @property
    def model(self) -> str: ...

    @property
    def stream(self) -> bool: ...

    @property
    def messages(self) -> Sequence[Mapping[str, Any]]:
        """
        The conversation as chat messages (role, content string or text
        parts): what D11's estimate, a recall's query and an observation
        read (decisions D11, D13).
        """

    @property
    def document(self) -> Mapping[str, Any]:
        """
        The whole JSON object as the client sent it: what is forwarded.
        """

    @property
    def maxTokens(self) -> int | None: ...

    @property
    def maxCompletionTokens(self) -> int | None: ...

    @property
    def choices(self) -> int: ...


@attrs.define(slots=True, repr=False)
class RequestContext:
    """
    Everything known about one request as it goes through the steps.

    The repr is left out on purpose: this holds the bearer token.
    """

    request: Request
    route: Route
    method: str
    params: Mapping[str, str]
    started: float = 0.0
    requestID: str = ""
    traceID: str = ""
    # The request's server span; a non-recording one when not sampled.
    span: Span = INVALID_SPAN
    pathOrgID: str | None = None
    accessToken: str | None = None
    token: TokenInfo | None = None
    orgID: str | None = None
    agentID: str | None = None
    agent: AgentInfo | None = None
    # Headers every answer to this request carries from here on, such as
    # X-RateLimit-*.
    responseHeaders: list[tuple[bytes, bytes]] = attrs.field(factory=list)
    status: int = 0
    # What forwarding to a provider did, for the access log.
    upstream: UpstreamRecord = attrs.field(factory=UpstreamRecord)
    # The chat body (or the messages body, decisions D14), when a token
    # reservation needed it before the handler (decisions D11), or why it
    # was refused (for the handler to answer, in the spec's order).
    chat: Conversation | None = None
    chatError: ApiError | None = None
    # The same of an embeddings body (decisions D13).
    embeddings: EmbeddingsRequest | None = None
    embeddingsError: ApiError | None = None
    # The same of a memory route's body (decisions D13: the memory routes
    # that embed reserve at their rate limit step): the parsed body, or why
    # it was refused.
    memoryBody: object | None = None
    memoryError: ApiError | None = None
    # The tokens (and cost) this request holds until it is settled
    # (decisions D11, D12).
    reservation: Reservation | None = None
    # What a forwarded request was reserved for: its prompt's estimate and
    # its output cap, in tokens.
    estimate: tuple[int, int] | None = None
    # Decisions D12, amended: the ledger key of a request admitted for
    # forwarding (a UUID v7 of the gateway's, never the client's); whether
    # a budget applies to it; the output cap sent to the provider because
    # the request named none (under a budget only); whether the handler
    # handed it to the forwarder (which then settles its reservation).
    ledgerID: str = ""
    budgeted: bool = False
    sentCap: int | None = None
    forwarded: bool = False
    # The bodies a budget's reservation measured, by model name: what each
    # attempt is sent, serialized once (None: made when forwarded).
    sentBodies: dict[str, bytes] | None = None
    # Decisions D13: a chat completion's recall, when recall is on for it,
    # and its observation, when observe is.
    recall: Recall | None = None
    observing: Observing | None = None

    @property
    def dialect(self) -> str:
        """
        The dialect this request's answers, errors included, are written
        in: its route's (decisions D14).
        """
        return self.route.dialect


Step = Callable[[RequestContext], Awaitable[None]]
Handler = Callable[[RequestContext], Awaitable[Reply]]
Layer = Callable[[RequestContext, Handler], Awaitable[Reply]]


@attrs.frozen
class Pipeline:
    """
    The steps of one method of a route, in order, then its handler.
    """

    steps: Sequence[Step]
    handler: Handler


@attrs.frozen
class _Nested:
    """
    A layer bound to what it wraps.
    """

    layer: Layer
    inner: Handler

    def __call__(self, ctx: RequestContext) -> Awaitable[Reply]:
        return self.layer(ctx, self.inner)


def compose(layers: Sequence[Layer], innermost: Handler) -> Handler:
    """
    Nest C{layers} (outermost first) around C{innermost}, once, at start.
    """
    handler = innermost
    for layer in reversed(layers):
        handler = _Nested(layer, handler)
    return handler


# The methods of RFC 9110 and PATCH: the only ones a span is named after,
# so a client inventing methods cannot inflate the set of span names.
HTTP_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)


def _spanNames(route: Route) -> Mapping[str, str]:
    return {method: f"{method} {route.template}" for method in HTTP_METHODS}


@attrs.frozen
class Route:
    """
    A path template and what each allowed method runs; C{template} is the
    C{route} label of metrics, the C{http.route} of spans and the second
    word of their names (C{spanNames}, made once, by method). C{dialect}
    is the one its clients speak, in which its errors are written
    (decisions D14: Anthropic's envelope on C{/v1/messages}).
    """

    template: str
    methods: Mapping[str, Pipeline]
    dialect: str = OPENAI
    spanNames: Mapping[str, str] = attrs.field(
        init=False, default=attrs.Factory(_spanNames, takes_self=True), eq=False, repr=False
    )


def newTraceID() -> str:
    """
    A fresh 128-bit trace id, never all zeros: the fallback for an answer
    made before (or without) the request's span.
    """
    while True:
        traceID = os.urandom(16).hex()
        if traceID != "0" * 32:
            return traceID
