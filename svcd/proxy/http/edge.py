"""
The HTTP edge of svc-proxy: its routes and middleware (spec 4.1).

Where to read the middleware order: L{ProxyEdge._globalLayers} lists the
global layers, outermost first, and L{ProxyEdge._routeTable} every route
with the steps of each of its methods in the order they run. A step that raises L{ApiError} stops
its route's chain there, so the precedence between errors is that order.

Routing is a table lookup on the canonical path (L{svcd.proxy.http.paths}):
every route takes every method, and every other path is the C{unmatched}
route, so 404 and 405 are answered by our own chain (with the envelope,
the headers, metrics and the access log).

Why the edge does not route with Klein, as svc-auth still does (it once
did): a request rendered by Klein sits in a reference cycle until the
cycle collector finds it. C{KleinResource.render} makes a closure that
refers to itself (C{processing_failed}, which holds the request;
twisted/klein pull request 101, open since 2016) and
werkzeug's matcher another (C{StateMachineMatcher.match._match}), so every
request left some 50 objects for the collector, whose pauses then landed
on the requests in flight (bench/README.rst, sixth round). Klein only
matched paths for the edge, which answered everything through its own
layers already; the canonical path leaves matching a dictionary lookup,
and the edge writes its answers itself (L{ProxyEdge.render}). A finished
request is freed by reference counting (tests/test_gc_cycles.py).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Awaitable, Mapping, Sequence
from io import BytesIO
from typing import IO, Any

import attrs
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.errors import (
    ApiError,
    ErrorCode,
    FieldError,
    FieldErrorCode,
    envelope,
    validationError,
)
from svcd.common.ids import canonicalUUID, parseRequestID, parseUUID, uuid7Text
from svcd.common.logbounds import loggedMethod, loggedText
from svcd.common.logs import REQUEST_ID
from svcd.common.logthrottle import ThrottledWarning
from svcd.common.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from svcd.common.metrics import exposition
from svcd.common.pat import isToken
from svcd.common.permissions import Permission
from svcd.common.readiness import Check, readinessReport
from svcd.common.recent import RecentResult
from svcd.common.tracing import activate, deactivate, parentFromHeaders, untracedProvider
from svcd.common.twistedprivate import clientGone
from svcd.ledger.rows import CLIENT_GONE, OK, UPSTREAM_ERROR, UsageLedger, usageRow
from svcd.limits.book import Applicable
from svcd.limits.limiter import BUDGET, ORG, RateDecision, RateLimiter
from svcd.limits.reservation import namedCap, outputCap, promptEstimate, worstCaseCost
from svcd.providers.table import Model, ProviderTable, modelsDocument
from svcd.providers.upstream import Forwarder
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.chatbody import ChatRequest, parseChatBody
from svcd.proxy.http.context import (
    HTTP_METHODS,
    Handler,
    Layer,
    Pipeline,
    Reply,
    RequestContext,
    Route,
    Step,
    newTraceID,
)
from svcd.proxy.http.paths import RouteTable, isCanonicalPath
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.validation.client import AGENT_HEADER, AuthClient, agentHeaderInvalid

_HEALTH_BODY = b'{"status":"ok","checks":{}}'
_AGENT_HEADER = AGENT_HEADER.encode("ascii")
_UNMATCHED = "unmatched"
_NO_PARAMS: Mapping[str, str] = {}
# Not an HTTP status: the metrics code of a request whose client went away
# before the answer (nginx's convention).
_CLIENT_CLOSED = 499
_SPAN_ERROR = Status(StatusCode.ERROR)
# Decisions D10: /ready answers from a check at most this many seconds old,
# one check at a time shared by every concurrent probe.
READY_MAX_AGE = 0.25
# At most one log line per this many seconds for settlements that passed
# their reservation (each is counted in the metric all the same).
OVERRUN_LOG_INTERVAL = 60.0


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


def _dumps(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class ProxyEdge:
    """
    The routes of spec 4.1 and 4.2 with their middleware.

    @param clock: the time source of request timings, envelope timestamps
        and readiness timeouts.
    @param tracer: makes the server span of each request; by default one
        that records nothing but still makes (or continues) trace ids.
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
    ) -> None:
        self._tracer = tracer if tracer is not None else untracedProvider().get_tracer(__name__)
        # Decisions D9: without a providers file, Phase 1 exactly (501, no
        # GET /v1/models).
        self._providers: ProviderTable | None = config.providers
        self._forwarder = forwarder
        # Decisions D12: where each forwarded request's usage row goes.
        self._ledger = ledger
        self._auth = auth
        self._limiter = limiter
        self._metrics = metrics
        self._clock = clock
        self._maxBody = config.maxRequestBodyBytes
        self._docsBase = config.errorDocsBase
        self._requestIDHeader = config.requestIDHeader.encode("ascii")
        self._traceIDHeader = config.traceIDHeader.encode("ascii")
        self._inFlight = 0
        self._idle: list[Deferred[None]] = []
        # Decisions D12, amended: overruns of a budget's worst case.
        self._overruns = ThrottledWarning(self.log, clock, OVERRUN_LOG_INTERVAL)
        self._readinessChecks = (
            Check("auth_grpc", auth.checkReachable),
            Check("redis", limiter.checkReady),
        )
        self.readiness = RecentResult(self._checkReadiness, clock, READY_MAX_AGE)

        self.layers = self._globalLayers()
        self._chain = compose(self.layers, self.router)
        self.routes = self._routeTable()
        self.unmatched = Route(_UNMATCHED, {})
        self._table = RouteTable((route.template, route) for route in self.routes)

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

    def _routeTable(self) -> tuple[Route, ...]:
        """
        Spec 4.1: each route's steps in order, then its handler. The first
        step to raise L{ApiError} answers, so this order is the precedence
        between errors.
        """
        chat = Pipeline(
            steps=(
                self.bodySizeLimit,
                self.contentType,
                self.tokenAuth(Permission.ProxyChatCompletion),
                self.agentVerify,
                self.rateLimit(reserveTokens=True),
            ),
            handler=self.chatCompletions,
        )
        routes: tuple[Route, ...] = (
            Route("/health", {"GET": Pipeline((), self.health)}),
            Route("/ready", {"GET": Pipeline((), self.ready)}),
            Route("/metrics", {"GET": Pipeline((), self.metricsPage)}),
            Route(
                "/v1/internal/auth-probe",
                {
                    "GET": Pipeline(
                        (self.tokenAuth(), self.agentVerify, self.rateLimit()),
                        self.authProbe,
                    )
                },
            ),
            Route(
                "/v1/orgs/{org_id}/auth-probe",
                {
                    "GET": Pipeline(
                        (
                            self.pathOrgID,
                            self.tokenAuth(matchPathOrg=True),
                            self.agentVerify,
                            self.rateLimit(),
                        ),
                        self.authProbe,
                    )
                },
            ),
            Route("/v1/chat/completions", {"POST": chat}),
            Route("/proxy/v1/chat/completions", {"POST": chat}),
        )
        if self._providers is not None:
            routes += (
                Route(
                    "/v1/models",
                    {
                        "GET": Pipeline(
                            (self.tokenAuth(), self.agentVerify, self.rateLimit()),
                            self.modelsList,
                        )
                    },
                ),
            )
        return routes

    # Routing and writing the answer.

    def resource(self) -> IResource:
        """
        The Twisted Web resource serving every route.
        """
        return _EdgeResource(self)

    def routeOf(self, path: bytes) -> tuple[Route, Mapping[str, str]]:
        """
        The route of a canonical path (L{isCanonicalPath}) whose segments
        are UTF-8 once percent-decoded, and its parameters, decoded;
        L{unmatched} for every other path.
        """
        return self._table.routeOf(path) or (self.unmatched, _NO_PARAMS)

    def render(self, request: IRequest, route: Route, params: Mapping[str, str]) -> int:
        """
        Answer C{request} for C{route}, through every layer and step, and
        write the answer; C{NOT_DONE_YET} for Twisted Web.
        """
        # Twisted's Request is untyped; these few calls go through Any.
        webRequest: Any = request
        answer = Deferred.fromCoroutine(self._respond(webRequest, route, params))
        if not answer.called:
            # The client went away: the request's work stops.
            webRequest.notifyFinish().addErrback(lambda _: answer.cancel())
        return NOT_DONE_YET

    async def _respond(self, webRequest: Any, route: Route, params: Mapping[str, str]) -> None:
        ctx = RequestContext(webRequest, route, webRequest.method.decode("latin-1"), params)
        try:
            body = await self._answer(ctx)
        except CancelledError:
            return
        except Exception:
            # The layers answer every fault of a step; this is a fault of
            # the edge itself. Twisted's own 500, as for any resource.
            if not webRequest.finished and not clientGone(webRequest):
                webRequest.processingFailed(Failure())
            return
        if not webRequest.finished and not clientGone(webRequest):
            webRequest.write(body)
            webRequest.finish()

    async def _answer(self, ctx: RequestContext) -> bytes:
        self._inFlight += 1
        try:
            reply = await self._chain(ctx)
            if reply.streamed:
                # Its status line, headers and body are written already.
                return b""
            request = ctx.request
            request.setResponseCode(reply.status)
            headers = request.responseHeaders
            headers.setRawHeaders(b"Content-Type", [reply.contentType])
            # A known length spares the chunked framing Twisted's
            # Request.write would otherwise use.
            headers.setRawHeaders(b"Content-Length", [b"%d" % len(reply.body)])
            # Twisted's "Server: TwistedWeb/<version>" tells attackers too much.
            headers.removeHeader(b"Server")
            for name, value in reply.headers:
                headers.addRawHeader(name, value)
            return reply.body
        finally:
            self._inFlight -= 1
            if not self._inFlight and self._idle:
                waiting, self._idle = self._idle, []
                for idle in waiting:
                    idle.callback(None)

    @property
    def requestsInFlight(self) -> int:
        """
        How many requests are being answered now.
        """
        return self._inFlight

    def whenIdle(self) -> Deferred[None]:
        """
        A Deferred that fires once no request is being answered; cancelling
        it (a stop's timeout) withdraws it.
        """

        def withdraw(waiter: Deferred[None]) -> None:
            if waiter in self._idle:
                self._idle.remove(waiter)

        idle: Deferred[None] = Deferred(withdraw)
        if not self._inFlight:
            idle.callback(None)
        else:
            self._idle.append(idle)
        return idle

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
        what the steps added (X-RateLimit-*).
        """
        reply = await inner(ctx)
        if not reply.streamed:
            self._addStandardHeaders(ctx, reply)
        return reply

    def _addStandardHeaders(self, ctx: RequestContext, reply: Reply) -> None:
        headers = reply.headers
        headers.extend(ctx.responseHeaders)
        headers.append((self._requestIDHeader, ctx.requestID.encode("ascii")))
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
                upstream_ms=upstream.upstreamMilliseconds,
                prompt_tokens=usage.promptTokens if usage is not None else None,
                completion_tokens=usage.completionTokens if usage is not None else None,
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
        alone (decisions D10): only the chat route reads a body, and only
        after the bearer token, so a request without an Authorization of
        the token's shape is answered (413, 415, then 401, as its steps
        order them) without its body ever being held.
        """
        try:
            bearerToken(request)
        except ApiError:
            return False
        return True

    def errorReply(self, ctx: RequestContext, error: ApiError) -> Reply:
        """
        The envelope of spec section 7 for C{error}.
        """
        now = datetime.datetime.fromtimestamp(self._clock.seconds(), datetime.UTC)
        document = envelope(error, requestID=ctx.requestID, now=now, docsBase=self._docsBase)
        reply = Reply(error.status, _dumps(document))
        for name, value in error.headers:
            reply.headers.append((name.encode("latin-1"), value.encode("latin-1")))
        return reply

    # Route steps.

    async def bodySizeLimit(self, ctx: RequestContext) -> None:
        """
        413 PAYLOAD_TOO_LARGE past SVC_MAX_REQUEST_BODY_BYTES.

        L{svcd.proxy.http.site.BodyLimitedRequest} has already refused to
        buffer such a body and marked the request; the other checks cover
        a plain L{Request} (as in tests).
        """
        request = ctx.request
        if getattr(request, "bodyTooLarge", False):
            raise self._tooLarge()
        declared = request.getHeader(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._maxBody:
            raise self._tooLarge()
        content = _body(request)
        size = content.seek(0, 2)
        content.seek(0)
        if size > self._maxBody:
            raise self._tooLarge()

    def _tooLarge(self) -> ApiError:
        return ApiError(ErrorCode.PAYLOAD_TOO_LARGE, detail=f"The limit is {self._maxBody} bytes.")

    async def contentType(self, ctx: RequestContext) -> None:
        """
        415 UNSUPPORTED_MEDIA_TYPE unless the body is application/json (a
        charset or other parameter is allowed).
        """
        value = ctx.request.getHeader(b"content-type")
        if value is None or value.split(b";", 1)[0].strip().lower() != b"application/json":
            raise ApiError(ErrorCode.UNSUPPORTED_MEDIA_TYPE)

    async def pathOrgID(self, ctx: RequestContext) -> None:
        """
        400 VALIDATION_ERROR (field org_id) for a path org id that is not a
        UUID, before any token check (decisions D4).
        """
        orgID = parseUUID(ctx.params.get("org_id", ""))
        if orgID is None:
            raise validationError(
                [FieldError("org_id", FieldErrorCode.INVALID_FORMAT, "must be a UUID")]
            )
        ctx.pathOrgID = str(orgID)

    def tokenAuth(self, permission: Permission | None = None, matchPathOrg: bool = False) -> Step:
        """
        The token auth step: the bearer token, validated by svc-auth, with
        the route's permission bit and, for the org-scoped probe, the path
        org equal to the token's org (403 INSUFFICIENT_PERMISSIONS).
        """

        async def tokenAuth(ctx: RequestContext) -> None:
            accessToken = bearerToken(ctx.request)
            token = await self._auth.validateToken(accessToken)
            if permission is not None and not token.permissions & permission:
                raise ApiError(ErrorCode.INSUFFICIENT_PERMISSIONS)
            if matchPathOrg and ctx.pathOrgID != token.orgID:
                raise ApiError(ErrorCode.INSUFFICIENT_PERMISSIONS)
            ctx.accessToken = accessToken
            ctx.token = token
            ctx.orgID = token.orgID

        return tokenAuth

    async def agentVerify(self, ctx: RequestContext) -> None:
        """
        The X-SVC-Agent-ID header (400 when missing or not a UUID), the
        token's own agent if it has one (403 AGENT_NOT_AUTHORIZED), then
        ValidateAgent with the caller's bearer.
        """
        values = ctx.request.requestHeaders.getRawHeaders(_AGENT_HEADER)
        if not values or not values[0]:
            raise ApiError(ErrorCode.MISSING_AGENT_ID)
        agentID = canonicalUUID(values[0].decode("latin-1")) if len(values) == 1 else None
        if agentID is None:
            raise agentHeaderInvalid()
        token = ctx.token
        assert token is not None and ctx.accessToken is not None
        if token.agentID is not None and token.agentID != agentID:
            raise ApiError(ErrorCode.AGENT_NOT_AUTHORIZED)
        ctx.agent = await self._auth.validateAgent(ctx.accessToken, agentID, token.orgID)
        ctx.agentID = agentID

    def rateLimit(self, reserveTokens: bool = False) -> Step:
        """
        The step of the organization's per-minute limit (and its agent's,
        with limits rows): X-RateLimit-* on the answer whatever it is, 429
        RATE_LIMITED with Retry-After past the limit.

        @param reserveTokens: the chat route's step: the request gets its
            ledger key here, where it is admitted for forwarding (decisions
            D12, amended), and reserves its tokens when a token limit
            applies to it (D11) and its worst-case cost when a budget does
            (D12). The body is parsed here for that, once; a body that
            fails its rules (or names a cap past its model's ceiling, or a
            model without a price under a budget) reserves nothing, and its
            400 still comes from the handler, after the rate limit, in the
            spec's order.
        """

        async def rateLimit(ctx: RequestContext) -> None:
            assert ctx.orgID is not None
            tokens = 0
            cost = 0
            ledgerID = None
            if reserveTokens and self._providers is not None:
                ledgerID = ctx.ledgerID = uuid7Text()
                applicable = self._limiter.applicable(ctx.orgID, ctx.agentID)
                ctx.budgeted = applicable.budgeted
                if applicable.tokenLimited or applicable.budgeted:
                    tokens, cost = self._reserve(ctx, self._providers, applicable)
            await self._limit(ctx, tokens, cost, ledgerID)

        return rateLimit

    def _reserve(
        self, ctx: RequestContext, providers: ProviderTable, applicable: Applicable
    ) -> tuple[int, int]:
        """
        The tokens and the worst-case cost (nano-dollars) a chat request
        that will be forwarded reserves at admission (decisions D11, D12).
        A request that will be refused 400 reserves nothing.
        """
        assert ctx.orgID is not None
        try:
            chat = ctx.chat = parseChatBody(_bodyBytes(ctx.request))
        except ApiError as refused:
            ctx.chatError = refused
            return 0, 0
        model = providers.modelFor(chat.model, ctx.orgID)
        if model is None:
            # Not forwarded (501): nothing to reserve.
            return 0, 0
        refusal = _modelRefusal(chat, model, applicable.budgeted)
        if refusal is not None:
            ctx.chatError = refusal
            return 0, 0
        prompt = promptEstimate(chat.messages)
        cap = outputCap(chat.document, applicable, model.maxOutputTokens)
        ctx.estimate = (prompt, cap)
        cost = 0
        if applicable.budgeted:
            named = namedCap(chat)
            if named is None:
                # Sent to the provider: the worst case holds only if the
                # provider is told the cap it assumes.
                ctx.sentCap = cap
            cost = worstCaseCost(
                chat, self._attempts(ctx, providers, model), named or cap, ctx.sentCap
            )
        return prompt + cap, cost

    def _attempts(
        self, ctx: RequestContext, providers: ProviderTable, model: Model
    ) -> tuple[Model, ...]:
        """
        The models a request may be answered by, in order: under a budget,
        never one without a price (decisions D12, amended: never billed at
        zero); the model asked for has one, or the request was refused.
        """
        attempts = providers.attempts(model, ctx.orgID or "")
        if ctx.budgeted:
            attempts = tuple(attempt for attempt in attempts if attempt.price is not None)
        return attempts

    async def _limit(
        self, ctx: RequestContext, tokens: int = 0, cost: int = 0, ledgerID: str | None = None
    ) -> None:
        assert ctx.orgID is not None
        decision = await self._limiter.hit(ctx.orgID, ctx.agentID, tokens, cost, ledgerID=ledgerID)
        if decision is None:
            return
        ctx.responseHeaders.extend(decision.headers())
        if not decision.allowed:
            self._metrics.rateLimited.inc()
            raise self._refusal(decision)
        reservation = decision.reservation
        if reservation is not None and (reservation.tokens or reservation.cost):
            ctx.reservation = reservation
            self._metrics.tokensReserved.inc(reservation.tokens)

    def _refusal(self, decision: RateDecision) -> ApiError:
        """
        The 429 of a refused request: RATE_LIMITED, or BUDGET_EXCEEDED
        (decisions D12), saying which limit refused it and whose.
        """
        retry = [("Retry-After", str(decision.retryAfter))]
        if decision.refusedBy is None:
            return ApiError(ErrorCode.RATE_LIMITED, headers=retry)
        limit, scope = decision.refusedBy
        self._metrics.limitRefusal(limit, scope)
        whose = "organization's" if scope == ORG else "agent's"
        if limit == BUDGET:
            return ApiError(
                ErrorCode.BUDGET_EXCEEDED,
                f"The {whose} budget of this period is spent.",
                detail={"scope": scope},
                headers=retry,
            )
        return ApiError(
            ErrorCode.RATE_LIMITED,
            f"The {whose} {limit} per minute are exceeded.",
            detail={"limit": limit, "scope": scope},
            headers=retry,
        )

    def _settle(self, ctx: RequestContext, tokens: int, cost: int = 0) -> None:
        """
        Correct this request's reservation to C{tokens} and C{cost}
        (decisions D11, D12), once.
        """
        reservation, ctx.reservation = ctx.reservation, None
        if reservation is not None:
            self._limiter.settle(reservation, tokens, cost)
            self._metrics.tokensSettled.inc(tokens)

    # Handlers.

    async def health(self, ctx: RequestContext) -> Reply:
        return Reply(200, _HEALTH_BODY)

    async def ready(self, ctx: RequestContext) -> Reply:
        """
        The readiness report, shared (decisions D10): a flood of anonymous
        probes costs one check of each dependency per L{READY_MAX_AGE}.
        """
        status, body = await self.readiness.get()
        return Reply(status, body)

    def _checkReadiness(self) -> Deferred[tuple[int, bytes]]:
        async def check() -> tuple[int, bytes]:
            status, body = await readinessReport(self._readinessChecks, asReactorTime(self._clock))
            return status, _dumps(body)

        return Deferred.fromCoroutine(check())

    async def metricsPage(self, ctx: RequestContext) -> Reply:
        return Reply(
            200, exposition(self._metrics.registry), contentType=METRICS_CONTENT_TYPE.encode()
        )

    async def authProbe(self, ctx: RequestContext) -> Reply:
        """
        200 with what the validated token and agent say.
        """
        assert ctx.token is not None
        return Reply(
            200,
            _dumps(
                {
                    "org_id": ctx.orgID,
                    "permissions": ctx.token.permissions,
                    "agent_id": ctx.agentID,
                }
            ),
        )

    async def modelsList(self, ctx: RequestContext) -> Reply:
        """
        GET /v1/models: the models the caller's organization may use, in
        OpenAI's list shape (decisions D9).
        """
        assert self._providers is not None and ctx.orgID is not None
        return Reply(200, _dumps(modelsDocument(self._providers, ctx.orgID)))

    async def chatCompletions(self, ctx: RequestContext) -> Reply:
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
            return await self._chatCompletions(ctx)
        finally:
            # Forwarded requests settle in _forward; this releases the
            # reservation of every refusal before it (once: _settle).
            if ctx.reservation is not None and not ctx.forwarded:
                self._settle(ctx, 0)

    async def _chatCompletions(self, ctx: RequestContext) -> Reply:
        if ctx.chatError is not None:
            raise ctx.chatError
        chat = ctx.chat if ctx.chat is not None else parseChatBody(_bodyBytes(ctx.request))
        span = ctx.span
        if span.is_recording():
            # Metadata only, as in the log line: never a message's content.
            span.set_attributes(
                {
                    "gen_ai.request.model": loggedText(chat.model),
                    "svc.chat.message_count": len(chat.messages),
                    "svc.chat.stream": chat.stream,
                }
            )
        self.log.info(
            "Chat completion request for {model} with {message_count} messages",
            org_id=ctx.orgID,
            request_id=ctx.requestID,
            trace_id=ctx.traceID,
            model=loggedText(chat.model),
            message_count=len(chat.messages),
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
        refusal = _modelRefusal(chat, model, ctx.budgeted)
        if refusal is not None:
            raise refusal
        ctx.forwarded = True
        return await self._forward(ctx, chat, model, providers, forwarder)

    async def _forward(
        self,
        ctx: RequestContext,
        chat: ChatRequest,
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
        outcome = OK
        try:
            answer = await forwarder.forward(
                chat.document,
                self._attempts(ctx, providers, model),
                ctx.requestID,
                _ClientStream(self, ctx),
                lambda error: self.errorEvent(ctx, error),
                ctx.upstream,
                outputCap=ctx.sentCap,
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
        return Reply(
            answer.status,
            answer.body,
            contentType=answer.contentType,
            headers=list(answer.headers),
            streamed=answer.streamed,
        )

    def _account(
        self,
        ctx: RequestContext,
        chat: ChatRequest,
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
        price = answered.price
        if usage is not None:
            cost = (
                price.cost(usage.promptTokens, usage.cachedTokens, usage.completionTokens)
                if price is not None
                else 0
            )
            reservation = ctx.reservation
            if reservation is not None and reservation.costKeys and cost > reservation.cost:
                self._overrun(ctx, reservation.cost, cost, answered)
            self._settle(ctx, usage.promptTokens + usage.completionTokens, cost)
        elif outcome == UPSTREAM_ERROR and not upstream.brokenMidStream:
            self._settle(ctx, 0)
        if self._ledger is None:
            return
        estimate = ctx.estimate
        if estimate is None:
            estimate = (
                promptEstimate(chat.messages),
                outputCap(
                    chat.document,
                    self._limiter.applicable(ctx.orgID or "", ctx.agentID),
                    model.maxOutputTokens,
                ),
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
                usage=usage,
                afterFirstByte=upstream.brokenMidStream,
                estimate=estimate,
                price=price,
                startedAt=ctx.started,
                endedAt=self._clock.seconds(),
            )
        )

    def _overrun(self, ctx: RequestContext, reserved: int, cost: int, answered: Model) -> None:
        """
        A provider answered more than its budget's worst case allowed (it
        ignored the cap it was sent, say): the cost is billed as the
        provider reported it (the settlement and the row say so), and the
        overrun is counted and logged, at most once per interval, so an
        operator can find the model that does not honour caps.
        """
        self._metrics.reservationOverruns.inc()
        self._overruns.warn(
            "A settlement passed its reservation's worst case: {cost_nano_usd} nano-dollars"
            " billed against {reserved_nano_usd} reserved, answered by {model}",
            org_id=ctx.orgID,
            request_id=ctx.requestID,
            ledger_id=ctx.ledgerID,
            model=answered.name,
            provider=answered.provider.name,
            reserved_nano_usd=reserved,
            cost_nano_usd=cost,
        )

    def errorEvent(self, ctx: RequestContext, error: ApiError) -> bytes:
        """
        The one event that ends a stream after a fault (decisions D9):
        C{data: {"error": ...}} with the envelope of spec section 7.
        """
        return b"data: " + self.errorReply(ctx, error).body + b"\n\n"


def _modelRefusal(chat: ChatRequest, model: Model, budgeted: bool) -> ApiError | None:
    """
    The 400 of a request its model cannot take (decisions D12, amended),
    every rule at once: an output cap past the model's ceiling (its
    C{max_output_tokens}, by default 1,048,576), and under a budget, a
    model without a price (NO_PRICE: never billed at zero). None when
    there is nothing to refuse.
    """
    errors: list[FieldError] = []
    if budgeted and model.price is None:
        errors.append(
            FieldError(
                "model", FieldErrorCode.NO_PRICE, "The model has no price, and a budget applies."
            )
        )
    ceiling = model.outputCeiling
    for field, cap in (
        ("max_tokens", chat.maxTokens),
        ("max_completion_tokens", chat.maxCompletionTokens),
    ):
        if cap is not None and cap > ceiling:
            errors.append(
                FieldError(
                    field, FieldErrorCode.TOO_MANY, f"must be at most {ceiling} for this model"
                )
            )
    return validationError(errors) if errors else None


def _loggedPath(request: Request) -> str:
    # The path without the query string, which may carry secrets.
    return loggedText(request.path.decode("latin-1"))


def _body(request: Request) -> IO[bytes]:
    content: IO[bytes] | None = request.content
    if content is None:
        # Set by the channel before the request is processed; an empty body
        # is the only sensible reading of its absence.
        return BytesIO()
    return content


def _bodyBytes(request: Request) -> bytes:
    content = _body(request)
    content.seek(0)
    return content.read()


def bearerToken(request: Request) -> str:
    """
    The token of an C{Authorization: Bearer <token>} header.

    @raise ApiError: 401 MISSING_TOKEN without the header, 401
        INVALID_TOKEN when it is not a bearer of our PAT format (checked
        here, so a malformed token costs no call to svc-auth).
    """
    values = request.requestHeaders.getRawHeaders(b"authorization")
    if values is None:
        raise ApiError(ErrorCode.MISSING_TOKEN)
    if len(values) != 1:
        raise ApiError(ErrorCode.INVALID_TOKEN)
    scheme, _, credential = values[0].partition(b" ")
    credential = credential.strip()
    if scheme.lower() != b"bearer" or not credential:
        raise ApiError(ErrorCode.INVALID_TOKEN)
    token = credential.decode("latin-1")
    if not isToken(token):
        raise ApiError(ErrorCode.INVALID_TOKEN)
    return token


class _ClientStream:
    """
    A request's response written as a stream (a relayed event stream): the
    status line and every header the answer would carry (request and trace
    ids, the time to this first byte, X-RateLimit-*), then each piece as it
    comes, with the relay as the producer so a slow client pauses it.
    """

    def __init__(self, edge: ProxyEdge, ctx: RequestContext) -> None:
        self._edge = edge
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
        self._edge._addStandardHeaders(self._ctx, reply)
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


@implementer(IResource)
class _EdgeResource:
    """
    The resource of every path: the edge routes it and answers.

    Whatever is not the canonical spelling of a route (decisions D10,
    L{svcd.proxy.http.paths}), or not UTF-8 in its path segments or Host
    once percent-decoded, is an unknown path: our 404.
    """

    isLeaf = True

    def __init__(self, edge: ProxyEdge) -> None:
        self._edge = edge

    def getChildWithDefault(self, name: bytes, request: IRequest) -> IResource:
        return self

    def putChild(self, path: bytes, child: IResource) -> None:
        raise NotImplementedError("the proxy's routes are fixed")

    def render(self, request: IRequest) -> Any:
        webRequest: Any = request
        edge = self._edge
        route, params = edge.unmatched, _NO_PARAMS
        path = webRequest.path
        if isCanonicalPath(path):
            try:
                webRequest.getRequestHostname().decode("utf-8")
                route, params = edge.routeOf(path)
            except UnicodeDecodeError:
                pass
        return edge.render(request, route, params)
