"""
The HTTP edge of svc-proxy: its routes and middleware (spec 4.1).

Where to read the middleware order: L{ProxyEdge._globalLayers} lists the
global layers, outermost first, L{ProxyEdge._opening} the steps every
route of a caller opens with, and L{ProxyEdge._routeTable} every route
with the steps of each of its methods in the order they run. A step that
raises L{ApiError} stops its route's chain there, so the precedence
between errors is that order.

This module keeps the global layers and the route table only. The steps
every route shares (the body's bounds, the caller, the per-minute limit)
are L{svcd.proxy.http.steps}; each route family's own steps, what it
reserves at the per-minute limit and its handlers are a module of
L{svcd.proxy.http.routes}; what a forwarded request
reserves, settles and records is the limits' and the ledger's
(L{svcd.limits.admission}, L{svcd.limits.reservation},
L{svcd.ledger.rows}). A new route family is a module there and its lines
in the table, not methods here.

Routing and writing the answer are the edge's resource's
(L{svcd.proxy.http.resource.EdgeResource}), which runs every request
through the chain of layers made here.
"""

from __future__ import annotations

import datetime

from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.web.resource import IResource
from twisted.web.server import Request

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.errors import ApiError, ErrorCode, envelope
from svcd.common.ids import parseRequestID, uuid7Text
from svcd.common.logbounds import loggedMethod, loggedText
from svcd.common.logs import REQUEST_ID
from svcd.common.permissions import Permission
from svcd.common.readiness import Check
from svcd.common.tracing import activate, deactivate, parentFromHeaders, untracedProvider
from svcd.dialects.errors import anthropicErrorBody
from svcd.ledger.rows import UsageLedger
from svcd.limits.admission import Admission
from svcd.limits.book import LimitBook
from svcd.limits.limiter import RateLimiter
from svcd.memoryclient.batches import SearchBatches
from svcd.memoryclient.client import MemoryClient
from svcd.metered.batches import EmbeddingBatches
from svcd.metered.embedder import Embedder
from svcd.metering.models import ANTHROPIC
from svcd.providers.upstream import Forwarder
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.context import (
    HTTP_METHODS,
    Handler,
    Layer,
    Pipeline,
    Reply,
    RequestContext,
    Route,
    Step,
    compose,
    jsonBody,
    newTraceID,
)
from svcd.proxy.http.memorybody import parseAddBody, parsePatchBody, parseSearchBody
from svcd.proxy.http.paths import COUNT_TOKENS_PATH, MESSAGES_PATH
from svcd.proxy.http.resource import EdgeResource
from svcd.proxy.http.routes.chat import CHAT
from svcd.proxy.http.routes.conversation import ConversationRoutes
from svcd.proxy.http.routes.embeddings import EmbeddingsRoutes
from svcd.proxy.http.routes.memories import MemoryRoutes, addTexts, changeTexts, searchTexts
from svcd.proxy.http.routes.messages import MESSAGES, CountTokens
from svcd.proxy.http.routes.models import ModelRoutes
from svcd.proxy.http.routes.ops import OperationsRoutes
from svcd.proxy.http.routes.probes import ProbeRoutes
from svcd.proxy.http.steps import CallerSteps, Credential, Reserve, apiKeyOrBearer
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.observe import Observer
from svcd.proxy.recall import Recaller
from svcd.proxy.validation.client import AuthClient

_UNMATCHED = "unmatched"
# Not an HTTP status: the metrics code of a request whose client went away
# before the answer (nginx's convention).
_CLIENT_CLOSED = 499
_SPAN_ERROR = Status(StatusCode.ERROR)


# The header of Anthropic's API that carries its request id.
_ANTHROPIC_REQUEST_ID = b"request-id"


class ProxyEdge:
    """
    The routes of spec 4.1 and 4.2 with their middleware.

    @param clock: the time source of request timings, envelope timestamps
        and readiness timeouts.
    @param forwarder: the providers' client (decisions D9), None without a
        providers file.
    @param ledger: where each forwarded request's usage row goes (decisions
        D12), None for none.
    @param tracer: makes the server span of each request; by default one
        that records nothing but still makes (or continues) trace ids.
    @param memory: the client of svc-memory (decisions D13), given when
        memory is on (C{config.memory}); the memory routes answer 501
        MEMORY_NOT_CONFIGURED without it.
    @param limitBook: the limiter's book, whose memory settings say which
        chat completions recall (decisions D13); by default an empty one
        (no recall).
    @param observer: decides which chat completions observe and records
        their observations (decisions D13), when memory is on; None: no
        chat completion observes.

    @ivar embedder: how the gateway embeds texts for itself and pays for
        it (decisions D13: memories, queries, recall), None without a
        providers file.
    @ivar memoryClient: the client of svc-memory when memory is on (both
        the client and C{config.memory}), else None: for the route
        families that use memory (the memory routes, recall).
    """

    log = Logger()

    def __init__(
        self,
        config: ProxyConfig,
        auth: AuthClient,
        limiter: RateLimiter,
        metrics: ProxyMetrics,
        clock: Clock,
        tracer: Tracer | None = None,
        forwarder: Forwarder | None = None,
        ledger: UsageLedger | None = None,
        memory: MemoryClient | None = None,
        limitBook: LimitBook | None = None,
        observer: Observer | None = None,
    ) -> None:
        self._tracer = tracer if tracer is not None else untracedProvider().get_tracer(__name__)
        self._metrics = metrics
        self._clock = clock
        self._docsBase = config.errorDocsBase
        self._requestIDHeader = config.requestIDHeader.encode("ascii")
        # Unless the operator named that header already (decisions D14).
        self._anthropicRequestID = self._requestIDHeader.lower() != _ANTHROPIC_REQUEST_ID
        self._traceIDHeader = config.traceIDHeader.encode("ascii")

        # The route families, each with what its routes read.
        admission = Admission(limiter, metrics, clock)
        self.caller = CallerSteps(auth, admission, config.maxRequestBodyBytes)
        self.ops = OperationsRoutes(
            metrics,
            (Check("auth_grpc", auth.checkReachable), Check("redis", limiter.checkReady)),
            clock,
        )
        self.probes = ProbeRoutes()
        # Decisions D9: without a providers file, Phase 1 exactly (501, no
        # GET /v1/models). Decisions D12: the ledger is where each
        # forwarded request's usage row goes.
        providers = config.providers
        self.models = ModelRoutes(providers) if providers is not None else None
        # Decisions D13: embeddings, forwarded and metered as chat is.
        self.embeddings = EmbeddingsRoutes(providers, forwarder, ledger, admission, clock)
        self.embedder = (
            Embedder(providers, forwarder, admission, ledger, clock)
            if providers is not None and forwarder is not None
            else None
        )
        # Decisions D13: context assembly, when memory is on.
        recaller = None
        if config.memory is not None and memory is not None and self.embedder is not None:
            recaller = Recaller(
                config.memory,
                # A busy proxy's recalls share their calls (decisions D13,
                # "Context assembly").
                SearchBatches(memory, asReactorTime(clock), config.memoryRecallCalls),
                EmbeddingBatches(self.embedder, config.memoryRecallCalls),
                limitBook if limitBook is not None else LimitBook(),
                clock,
                config.memoryTimeout,
                metrics,
            )
        # The routes of conversations: chat completions, and Anthropic's
        # Messages API (decisions D14), through the same steps.
        conversations = [
            ConversationRoutes(
                dialect,
                providers,
                forwarder,
                ledger,
                admission,
                clock,
                self.errorReply,
                self._addStandardHeaders,
                recaller,
                observer if memory is not None and config.memory is not None else None,
            )
            for dialect in (CHAT, MESSAGES)
        ]
        self.chat, self.messages = conversations
        self.countTokens = CountTokens(providers, forwarder)
        # Decisions D13: the memory routes, on svc-memory; off (501) unless
        # both its address and the providers file's [memory] table are
        # given.
        memoryConfig = config.memory
        self.memoryClient = memory if memoryConfig is not None else None
        self.memory = MemoryRoutes(
            memoryConfig if memory is not None else None,
            memory if memoryConfig is not None else None,
            self.embedder,
            admission,
            clock,
        )

        self.layers = self._globalLayers()
        self._chain = compose(self.layers, self.router)
        self.routes = self._routeTable()
        self.unmatched = Route(_UNMATCHED, {})
        self._resource = EdgeResource(self._chain, self.routes, self.unmatched)

    def _globalLayers(self) -> tuple[Layer, ...]:
        """
        Spec 4.1: the global order for every route, outermost first; the
        router (the route's own steps) is innermost.
        """
        return (
            self.requestContext,
            self.tracingSpan,
            self.recordMetrics,
            self.responseHeaders,
            self.accessLog,
        )

    def _opening(
        self,
        permission: Permission | None = None,
        reserve: Reserve | None = None,
        body: bool = False,
        matchPathOrg: bool = False,
        credential: Credential | None = None,
    ) -> tuple[Step, ...]:
        """
        Spec 4.1: how every route of a caller opens, in this order: the
        body's size and type (a route that reads a C{body}), the bearer
        token (or where C{credential} finds it, decisions D14) with the
        route's C{permission} (for the org-scoped probe, the path org
        equal to the token's: C{matchPathOrg}), the agent, then the
        per-minute limit, which also reserves what the route's C{reserve}
        says (decisions D11, D12), in the same Redis call. The steps are
        L{CallerSteps}'.
        """
        caller = self.caller
        bounds = (caller.bodySizeLimit, caller.contentType) if body else ()
        return (
            *bounds,
            caller.tokenAuth(permission, matchPathOrg, credential),
            caller.agentVerify,
            caller.rateLimit(reserve),
        )

    def _routeTable(self) -> tuple[Route, ...]:
        """
        Spec 4.1: each route's steps in order, then its handler. The first
        step to raise L{ApiError} answers, so this order is the precedence
        between errors. Every route of a caller opens with L{_opening};
        each route family's own steps, what it reserves and its handler
        are in its module (L{svcd.proxy.http.routes}).
        """
        opening, ops, probes, chat, embeddings = (
            self._opening,
            self.ops,
            self.probes,
            self.chat,
            self.embeddings,
        )
        chatCompletions = Pipeline(
            opening(Permission.ProxyChatCompletion, chat.reserve, body=True),
            chat.handle,
        )
        embeddingsRoute = Pipeline(
            opening(Permission.ProxyEmbeddings, embeddings.reserve, body=True),
            embeddings.embeddings,
        )
        routes: tuple[Route, ...] = (
            Route("/health", {"GET": Pipeline((), ops.health)}),
            Route("/ready", {"GET": Pipeline((), ops.ready)}),
            Route("/metrics", {"GET": Pipeline((), ops.metricsPage)}),
            Route("/v1/internal/auth-probe", {"GET": Pipeline(opening(), probes.authProbe)}),
            Route(
                "/v1/orgs/{org_id}/auth-probe",
                {
                    "GET": Pipeline(
                        (probes.pathOrgID, *opening(matchPathOrg=True)), probes.authProbe
                    )
                },
            ),
            Route("/v1/chat/completions", {"POST": chatCompletions}),
            Route("/proxy/v1/chat/completions", {"POST": chatCompletions}),
            Route("/v1/embeddings", {"POST": embeddingsRoute}),
            *self._messagesRoutes(),
            *self._memoryRoutes(),
        )
        if self.models is not None:
            routes += (Route("/v1/models", {"GET": Pipeline(opening(), self.models.modelsList)}),)
        return routes

    def _messagesRoutes(self) -> tuple[Route, ...]:
        """
        Decisions D14: Anthropic's Messages API, its token in C{x-api-key}
        or C{Authorization: Bearer}, its errors in Anthropic's envelope
        (the routes' dialect); /v1/messages opens as chat completions do,
        count_tokens the same but reserves nothing (it counts toward the
        requests per minute only).
        """
        opening, messages = self._opening, self.messages
        chat, found = Permission.ProxyChatCompletion, apiKeyOrBearer
        return (
            Route(
                MESSAGES_PATH,
                {
                    "POST": Pipeline(
                        opening(chat, messages.reserve, body=True, credential=found),
                        messages.handle,
                    )
                },
                dialect=ANTHROPIC,
            ),
            Route(
                COUNT_TOKENS_PATH,
                {
                    "POST": Pipeline(
                        opening(chat, body=True, credential=found), self.countTokens.countTokens
                    )
                },
                dialect=ANTHROPIC,
            ),
        )

    def _memoryRoutes(self) -> tuple[Route, ...]:
        """
        Decisions D13: the memory routes, each through the token (with
        MemoryRead to read and search, MemoryWrite to write), the agent
        and the rate limit, which reserves what a route embeds; a route
        with a body checks its size and type first, as chat does.
        """
        opening, memory = self._opening, self.memory
        read, write = Permission.MemoryRead, Permission.MemoryWrite
        adding = memory.reserving(parseAddBody, addTexts)
        changing = memory.reserving(parsePatchBody, changeTexts)
        searching = memory.reserving(parseSearchBody, searchTexts)
        return (
            Route(
                "/v1/memories",
                {
                    "POST": Pipeline(opening(write, adding, body=True), memory.add),
                    "GET": Pipeline(opening(read), memory.listMemories),
                    "DELETE": Pipeline(opening(write), memory.deleteScope),
                },
            ),
            Route(
                "/v1/memories/search",
                {"POST": Pipeline(opening(read, searching, body=True), memory.search)},
            ),
            Route(
                "/v1/memories/{id}",
                {
                    "GET": Pipeline(opening(read), memory.getMemory),
                    "PATCH": Pipeline(opening(write, changing, body=True), memory.change),
                    "DELETE": Pipeline(opening(write), memory.delete),
                },
            ),
        )

    # Serving.

    def resource(self) -> IResource:
        """
        The Twisted Web resource serving every route.
        """
        return self._resource

    @property
    def requestsInFlight(self) -> int:
        """
        How many requests are being answered now.
        """
        return self._resource.requestsInFlight

    def whenIdle(self) -> Deferred[None]:
        """
        A Deferred that fires once no request is being answered; cancelling
        it (a stop's timeout) withdraws it.
        """
        return self._resource.whenIdle()

    # Global layers, outermost first.

    async def requestContext(self, ctx: RequestContext, inner: Handler) -> Reply:
        """
        Start time and request id (an inbound v4 or v7 UUID is kept), and
        the last line of defence: a fault in any inner layer still gets a
        500 envelope.
        """
        ctx.started = self._clock.seconds()
        inbound = ctx.request.requestHeaders.getRawHeaders(self._requestIDHeader)
        requestID = None
        if inbound:
            requestID = parseRequestID(inbound[0].decode("latin-1"))
        ctx.requestID = str(requestID) if requestID is not None else uuid7Text()
        # Every line logged from here on in this request's context carries
        # its request id (svcd.common.logs).
        scope = REQUEST_ID.set(ctx.requestID)
        try:
            return await inner(ctx)
        except CancelledError:
            raise
        except Exception:
            self.log.failure(
                "Fault in the middleware of {route}",
                route=ctx.route.template,
                request_id=ctx.requestID,
                trace_id=ctx.traceID or None,
            )
            if not ctx.traceID:
                ctx.traceID = newTraceID()
            reply = self.errorReply(ctx, ApiError(ErrorCode.INTERNAL_ERROR))
            self._addStandardHeaders(ctx, reply)
            return reply
        finally:
            REQUEST_ID.reset(scope)

    async def tracingSpan(self, ctx: RequestContext, inner: Handler) -> Reply:
        """
        The request's server span, continuing the trace of a valid inbound
        W3C C{traceparent}, and its trace id (X-Trace-ID), sampled or not.

        The span is OpenTelemetry's current span while the inner layers
        run, so the auth client propagates it to svc-auth and log lines
        carry its trace_id. Named C{<method> <route template>}, never the
        raw path; status ERROR for an answer of 500 and above. Attributes
        are built only for a recording (sampled) span.
        """
        method = ctx.method
        route = ctx.route
        parent = parentFromHeaders(ctx.request.requestHeaders)
        name = route.spanNames.get(method)
        if name is None:
            name = f"HTTP {route.template}"
        span = self._tracer.start_span(name, parent, kind=SpanKind.SERVER, record_exception=False)
        ctx.span = span
        spanContext = span.get_span_context()
        # An SDK disabled by OTEL_SDK_DISABLED hands out invalid spans.
        ctx.traceID = format(spanContext.trace_id, "032x") if spanContext.is_valid else newTraceID()
        recording = span.is_recording()
        if recording:
            span.set_attributes(
                {
                    "http.request.method": method if method in HTTP_METHODS else "_OTHER",
                    "svc.request_id": ctx.requestID,
                }
            )
            if route is not self.unmatched:
                span.set_attribute("http.route", route.template)
        token = activate(span, parent)
        try:
            reply = await inner(ctx)
        except CancelledError:
            if recording:
                span.set_attribute("http.response.status_code", _CLIENT_CLOSED)
            raise
        except Exception as error:
            if recording:
                span.set_attribute("http.response.status_code", 500)
                span.set_attribute("error.type", type(error).__name__)
                span.set_status(_SPAN_ERROR)
            raise
        else:
            if recording:
                status = reply.status
                span.set_attribute("http.response.status_code", status)
                if ctx.orgID is not None:
                    span.set_attribute("svc.org_id", ctx.orgID)
                if status >= 500:
                    span.set_attribute("error.type", str(status))
                    span.set_status(_SPAN_ERROR)
            return reply
        finally:
            deactivate(token)
            span.end()

    async def recordMetrics(self, ctx: RequestContext, inner: Handler) -> Reply:
        """
        svc_proxy_requests_total and svc_proxy_request_duration_seconds.
        """
        try:
            reply = await inner(ctx)
        except CancelledError:
            self._metrics.observeRequest(
                ctx.route.template, ctx.method, _CLIENT_CLOSED, self._clock.seconds() - ctx.started
            )
            raise
        self._metrics.observeRequest(
            ctx.route.template, ctx.method, reply.status, self._clock.seconds() - ctx.started
        )
        return reply

    async def responseHeaders(self, ctx: RequestContext, inner: Handler) -> Reply:
        """
        X-Request-ID, X-Trace-ID and X-Response-Time on every answer, plus
        what the steps added (X-RateLimit-*); on the Messages routes the
        request id in C{request-id} too (decisions D14).
        """
        reply = await inner(ctx)
        if not reply.streamed:
            self._addStandardHeaders(ctx, reply)
        return reply

    def _addStandardHeaders(self, ctx: RequestContext, reply: Reply) -> None:
        headers = reply.headers
        headers.extend(ctx.responseHeaders)
        requestID = ctx.requestID.encode("ascii")
        headers.append((self._requestIDHeader, requestID))
        if ctx.dialect == ANTHROPIC and self._anthropicRequestID:
            # Where Anthropic's API puts it, and its SDKs read it (a
            # message's _request_id, an error's request_id): the same id.
            headers.append((_ANTHROPIC_REQUEST_ID, requestID))
        if ctx.traceID:
            headers.append((self._traceIDHeader, ctx.traceID.encode("ascii")))
        elapsed = (self._clock.seconds() - ctx.started) * 1000
        headers.append((b"X-Response-Time", b"%.3f" % elapsed))

    async def accessLog(self, ctx: RequestContext, inner: Handler) -> Reply:
        """
        One line per request, with its ids; never a header value or body.
        """
        try:
            reply = await inner(ctx)
        except CancelledError:
            self.log.info(
                "{method} {route}: client went away",
                method=loggedMethod(ctx.method),
                route=ctx.route.template,
                path=_loggedPath(ctx.request),
                request_id=ctx.requestID,
                trace_id=ctx.traceID,
            )
            raise
        fields: dict[str, object] = {
            "method": loggedMethod(ctx.method),
            "route": ctx.route.template,
            "path": _loggedPath(ctx.request),
            "status": reply.status,
            "duration_ms": round((self._clock.seconds() - ctx.started) * 1000, 3),
            "request_id": ctx.requestID,
            "trace_id": ctx.traceID,
            "org_id": ctx.orgID,
            "agent_id": ctx.agentID,
        }
        upstream = ctx.upstream
        if upstream.provider is not None:
            # Forwarded to a provider (decisions D9): what it cost.
            usage = upstream.usage
            fields.update(
                provider=upstream.provider,
                model=upstream.model,
                upstream_model=upstream.upstreamModel,
                deployment=upstream.deployment,
                tries=upstream.tries,
                upstream_ms=upstream.upstreamMilliseconds,
                prompt_tokens=usage.promptTokens if usage is not None else None,
                completion_tokens=usage.completionTokens if usage is not None else None,
            )
        recall = ctx.recall
        if recall is not None:
            # Decisions D13: how many memories the prompt got (0 after a
            # fault, as the ledger row says), how the recall ended (the
            # metric's outcome; None when it made no call), what finding
            # them took and, of that, the embedding's exchange; never their
            # content.
            fields.update(
                memories=recall.injected,
                memory_outcome=recall.outcome,
                memory_ms=round(recall.milliseconds, 3),
                memory_embedding_ms=recall.embeddingMilliseconds,
            )
        self.log.info("{method} {route} {status}", **fields)
        return reply

    async def router(self, ctx: RequestContext) -> Reply:
        """
        The innermost layer: the route's steps in order, then its handler;
        an L{ApiError} becomes its envelope, anything else a 500. Before
        them, for every route, the refusal the site made at the headers
        when it had no room for the body (L{svcd.proxy.http.site}).
        """
        try:
            refusal: ApiError | None = getattr(ctx.request, "bodyRefusal", None)
            if refusal is not None:
                # The site had no room left for this request's body and did
                # not read it (decisions D10: 503 SERVICE_DEGRADED).
                raise refusal
            pipeline = ctx.route.methods.get(ctx.method)
            if pipeline is None:
                if not ctx.route.methods:
                    raise ApiError(ErrorCode.NOT_FOUND)
                raise ApiError(
                    ErrorCode.METHOD_NOT_ALLOWED,
                    headers=[("Allow", ", ".join(ctx.route.methods))],
                )
            for step in pipeline.steps:
                await step(ctx)
            return await pipeline.handler(ctx)
        except ApiError as error:
            # An error raised out of a failed Deferred (a refusal of
            # svc-auth's, say) has a traceback through Failure.raiseException,
            # whose frame holds the Failure, which holds the error: a cycle,
            # holding this request through the frames of the steps. The
            # answer needs none of it.
            error.__traceback__ = None
            return self.errorReply(ctx, error)
        except CancelledError:
            raise
        except Exception:
            self.log.failure(
                "Unhandled fault answering {method} {route}",
                method=loggedMethod(ctx.method),
                route=ctx.route.template,
                request_id=ctx.requestID,
                trace_id=ctx.traceID,
            )
            return self.errorReply(ctx, ApiError(ErrorCode.INTERNAL_ERROR))

    def bodyWanted(self, request: Request) -> bool:
        """
        Whether the site should read C{request}'s body, from its headers
        alone (decisions D10): only the routes with a body read it, and
        only after the token, so a request without a token of the token's
        shape (in C{Authorization: Bearer}, or in C{x-api-key} as the
        Messages routes take it, decisions D14) is answered (413, 415, then
        401, as its steps order them) without its body ever being held.
        The site asks before the request line's path is known to the
        request, so every route takes either header here; a route that
        wants the bearer alone still answers 401 without one.
        """
        try:
            apiKeyOrBearer(request)
        except ApiError:
            return False
        return True

    def errorReply(self, ctx: RequestContext, error: ApiError) -> Reply:
        """
        The envelope of spec section 7 for C{error}, or Anthropic's on the
        routes of its dialect (decisions D14): the same status, code and
        headers (Retry-After, Allow) either way.
        """
        if ctx.dialect == ANTHROPIC:
            # A provider that said it was overloaded makes a 5xx an
            # overloaded_error, which Anthropic's SDKs retry.
            document = anthropicErrorBody(
                error, requestID=ctx.requestID, overloaded=ctx.upstream.overloaded
            )
        else:
            now = datetime.datetime.fromtimestamp(self._clock.seconds(), datetime.UTC)
            document = envelope(error, requestID=ctx.requestID, now=now, docsBase=self._docsBase)
        reply = Reply(error.status, jsonBody(document))
        for name, value in error.headers:
            reply.headers.append((name.encode("latin-1"), value.encode("latin-1")))
        return reply


def _loggedPath(request: Request) -> str:
    # The path without the query string, which may carry secrets.
    return loggedText(request.path.decode("latin-1"))
