"""
Forwarding a chat completion to its provider (decisions D9), an embeddings
request (D13: the same path, to C{<base_url>/embeddings}, never streamed),
or a request of Anthropic's Messages API (D14): the request sent upstream,
the persistent connections it goes over, every upstream fault mapped to
the gateway's error, fallbacks, usage, metrics and the upstream client
span.

What differs between them is an L{Operation}
(L{svcd.providers.operations}), the client's dialect, and per attempt
its L{Leg} for the provider's C{api}: the path appended to the provider's
base URL, how the body sent is made from the client's object (translated
when the dialects differ), how the answer and its stream reach the client
and where their usage is, whether it may stream. Everything else (the
timeouts, the fault mapping below, the fallbacks, the pool of connections
and its bound per provider, which all share) is one code.

What is sent: the client's JSON object, with C{model} replaced by the
model's C{upstream_model} and every other key kept; for a stream,
C{stream_options.include_usage} is asked for (the usage event is relayed
only when the client asked for it too); under a budget, when the client
named no output cap, the cap the budget assumed, under the model's
C{cap_field} (decisions D12, amended; L{attemptBody}, which the edge also
uses to measure the bytes a budget reserves for). Headers: C{Content-Type:
application/json}, C{Authorization: Bearer <key>} when the provider has a
key, C{X-Request-ID} and C{traceparent}: nothing else of the client's, never
its token. An Anthropic provider (decisions D14) is sent its key as
C{x-api-key} (never C{Authorization}) and C{anthropic-version} (the
client's, else L{ANTHROPIC_VERSION}) and C{anthropic-beta} when the route
passes the client's (C{clientHeaders}).

Connections: a pool of persistent connections per provider
(L{svcd.providers.http1}), on the reactor (no thread per request);
at most C{max_connections} requests are in flight per provider, the others
wait their turn within their deadline. Not treq, nor the C{Agent} it wraps:
forwarding wants none of their cookie, redirect and decoding layers (no
cookie is ever kept, no redirect followed, no compression asked for), and
their per-request machinery cost more CPU than the rest of the proxy's
pipeline (measured against nginx: 880 to 1,270 µs per request through
treq, 500 to 650 through C{Agent}; C{Agent}'s client side alone 156 µs
against 27 for the lean client; see http1's docstring). An idle connection
is used again only within C{IDLE_CONNECTION_SECONDS} of its last answer,
below the keep-alive timeout of common servers (uvicorn's is 5 s), so that
a request is seldom sent on a connection the server is closing.

Faults before any byte reached the client, in the envelope (D9):

  ====================================  ====  =======================
  upstream                              HTTP  code
  ====================================  ====  =======================
  refused, reset, broken, 5xx, 2xx      502   UPSTREAM_ERROR
  that is not what was asked, 401,
  403, 404 (the operator's key or
  model is wrong)
  no answer within C{timeout} (stream:  504   UPSTREAM_TIMEOUT
  no first event within
  C{idle_timeout})
  429                                   429   UPSTREAM_RATE_LIMITED
                                              (with its Retry-After)
  any other 4xx                         same  UPSTREAM_REJECTED (its
                                              message in C{detail})
  ====================================  ====  =======================

Every fault but UPSTREAM_REJECTED tries the model's fallbacks in order;
when all fail, the last one's error is the answer. The model that answered
is named in C{X-SVC-Upstream-Model}. An Anthropic provider's refusals
follow the same table (its 529 is a 5xx); one that says it is overloaded
(529, C{overloaded_error}) is remembered in the record
(L{UpstreamRecord.overloaded}) for the client's error of Anthropic's
dialect, and its error event mid-stream is mapped by
L{svcd.dialects.errors.apiErrorOfAnthropic} (before the client's first
byte, a fault a fallback may answer).

The tries (decisions D15) are the router's plan (L{svcd.providers.routing}):
the model's deployments, then each fallback's, each in its routing order;
each try is sent, translated and recorded as its deployment's model
(L{svcd.metering.models.Model.atDeployment}: the record and the ledger row name its provider
and upstream model), and tells the router how it went: its first byte (a
whole answer's head, a stream's first event), a 429 and its
C{Retry-After} (a cooldown), any other fault before the first byte or a
stream broken after it (a failure); a refusal of the request
(UPSTREAM_REJECTED) or a client gone only ends it. With the model's
C{first_byte_timeout}, a try without its first byte in that time is
cancelled as when its client goes away (the upstream sees its connection
closed), and the next try follows.

Every attempt's body is made before the first is sent (decisions D14): a
request its model cannot be sent (a field with no counterpart in the
provider's dialect) is a 400 naming the field with nothing forwarded; a
fallback that cannot take it is skipped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from random import Random
from typing import Any, Protocol

import attrs
from opentelemetry import trace
from opentelemetry.trace import Span, Tracer
from twisted.internet.defer import (
    CancelledError,
    Deferred,
    TimeoutError,
    succeed,
)
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.errors import ApiError, ErrorCode
from svcd.common.tracing import traceparentOf
from svcd.dialects.errors import BadAnswer as Untranslated
from svcd.metering.models import ANTHROPIC, Model, Provider
from svcd.metering.usage import Usage
from svcd.providers.cooldowns import Cooldown, retryAfterSeconds
from svcd.providers.faults import UpstreamFault, brokenFault, refusalFault, timeoutFault
from svcd.providers.genai import CallTelemetry, GenAIMetrics, responseModelOf
from svcd.providers.http1 import UpstreamAnswer
from svcd.providers.links import Link
from svcd.providers.operations import (
    ANTHROPIC_VERSION,
    CHAT_COMPLETIONS,
    Leg,
    Operation,
)
from svcd.providers.passages import Exchange
from svcd.providers.records import UpstreamRecord
from svcd.providers.relay import BodyReader, StreamFault, StreamRelay
from svcd.providers.routing import Flight, Router, Try, bodyKey
from svcd.providers.tries import (
    BROKEN,
    CANCELLED,
    FAILED,
    FIRST_BYTE_TIMEOUT,
    OK,
    RATE_LIMITED,
    REJECTED,
    DeploymentMetrics,
    FirstByte,
    prepare,
)

UPSTREAM_MODEL_HEADER = b"X-SVC-Upstream-Model"
ANTHROPIC_VERSION_HEADER = b"anthropic-version"
ANTHROPIC_BETA_HEADER = b"anthropic-beta"
_DEFAULT_VERSION = ANTHROPIC_VERSION.encode("ascii")
_JSON = b"application/json"
_EVENT_STREAM = b"text/event-stream"


class ClientStream(Protocol):
    """
    The client's response as a stream, given by the edge: C{begin} writes
    the status line and headers (the edge's own, such as X-Request-ID and
    X-RateLimit-*, plus C{headers}).
    """

    def begin(
        self, status: int, contentType: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> None: ...

    def write(self, data: bytes) -> None: ...

    def registerProducer(self, producer: IPushProducer) -> None: ...

    def unregisterProducer(self) -> None: ...


@attrs.frozen
class Answer:
    """
    A non-streaming answer for the client (a streamed one has already been
    written when C{streamed} is set).

    @ivar document: a whole answer's JSON as the forwarder parsed it (for
        its usage), so that a caller reading more of it (the gateway's own
        embeddings, L{svcd.metered.embedder}) does not parse it again;
        None for a stream.
    """

    status: int
    body: bytes
    contentType: bytes = _JSON
    headers: list[tuple[bytes, bytes]] = attrs.field(factory=list)
    streamed: bool = False
    document: object = attrs.field(default=None, repr=False, eq=False)


class UpstreamMetrics(Protocol):
    """
    What the forwarder counts, on the metrics of the daemon that uses it
    (svc-proxy's L{svcd.proxy.metrics.ProxyMetrics} exports it as the
    C{svc_proxy_upstream_*} series): a Protocol, so that this package
    imports no daemon's metrics.
    """

    def observeUpstream(
        self, provider: str, model: str, status: str, seconds: float, usage: Usage | None
    ) -> None:
        """
        One request to a provider: its outcome, its duration, its tokens.
        """


class Forwarder:
    """
    Forwards chat completions to the providers of a providers file.

    @param providers: every configured provider (a client and a pool each
        are made here).
    @param tracer: makes the upstream client span of each try of a
        sampled request (L{svcd.providers.genai}).
    @param router: the deployments' routing state (decisions D15); by
        default one of the forwarder's own, on C{clock}.
    @param genai: the GenAI histograms each try is recorded in while they
        are bound to a meter.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        clock: Clock,
        providers: Sequence[Provider],
        metrics: UpstreamMetrics,
        tracer: Tracer | None = None,
        router: Router | None = None,
        genai: GenAIMetrics | None = None,
    ) -> None:
        self._clock = clock
        self._metrics = metrics
        self._deployments = metrics if isinstance(metrics, DeploymentMetrics) else None
        self._telemetry = CallTelemetry(providers, tracer, genai)
        self._router = router if router is not None else Router(clock, Random())
        self._links = {provider.name: Link(reactor, clock, provider) for provider in providers}

    def close(self) -> Deferred[None]:
        """
        Close every pooled connection (at shutdown, once requests drained).
        """
        for link in self._links.values():
            link.pool.close()
        return succeed(None)

    async def forward(
        self,
        document: Mapping[str, Any],
        attempts: Sequence[Model],
        requestID: str,
        client: ClientStream,
        errorEvent: Callable[[ApiError], bytes],
        record: UpstreamRecord,
        outputCap: int | None = None,
        operation: Operation | None = None,
        bodies: Mapping[str, bytes] | None = None,
        onEventData: Callable[[bytes], None] | None = None,
        clientHeaders: Mapping[bytes, bytes] | None = None,
    ) -> Answer:
        """
        Forward C{document} (the client's JSON object, in the dialect of
        C{operation}) to the first of C{attempts} that answers, trying the
        next on a fault that allows a fallback; a stream is relayed to
        C{client} as it comes. Whatever dialect each attempt's provider
        speaks, the client gets its own (decisions D14): the answer's body,
        the stream's events and C{errorEvent}'s are in the client's
        dialect.

        @param errorEvent: the event that ends a stream after a fault, in
            the client's dialect (C{record.overloaded} says whether the
            provider said it was overloaded).
        @param outputCap: the output cap to send with each attempt (under
            the key of that attempt's provider, see L{Operation.body}), or
            None to send the client's own (or, to an Anthropic provider,
            which requires one, the model's).
        @param operation: what is asked; a chat completion by default.
        @param bodies: attempts' bodies already made, by
            L{svcd.providers.routing.bodyKey} (a model's name, and its
            deployment's index past the first), as
            C{operation.body(document, model.atDeployment(index),
            outputCap)} makes them (a budget's reservation measured them,
            decisions D12 amended): sent as they are rather than
            serialized again.
        @param onEventData: given the data of each event of a stream as it
            is relayed to the client (L{StreamRelay}'s C{onData}), in the
            client's dialect.
        @param clientHeaders: the client's headers that an Anthropic
            provider is given as they are: C{anthropic-version} and
            C{anthropic-beta} (lowercase names); others are ignored, and
            other providers get none.
        @raise ApiError: 400 VALIDATION_ERROR naming the field when the
            first attempt cannot be sent the request (nothing was sent);
            else the last attempt's fault, when none answered.
        """
        if operation is None:
            operation = CHAT_COMPLETIONS
        stream = operation.streams and document.get("stream") is True
        prepared = prepare(operation, document, attempts, outputCap, bodies)
        exchange = Exchange(document, requestID, int(self._clock.seconds()), outputCap)
        fault: UpstreamFault | None = None
        record.tries = 0

        def accepts(attempt: Try) -> bool:
            return bodyKey(attempt.model, attempt.index) in prepared

        for attempt in self._router.plan(attempts, accepts=accepts):
            leg, made = prepared[bodyKey(attempt.model, attempt.index)]
            model = attempt.target
            body = made if made is not None else leg.body(document, model, outputCap)
            record.tries += 1
            record.deployment = attempt.deployment.name
            flight = self._router.start(attempt)
            self._started(attempt)
            outcome = CANCELLED
            try:
                answer = await self._try(
                    model,
                    leg,
                    body,
                    exchange,
                    flight,
                    stream,
                    client,
                    errorEvent,
                    record,
                    onEventData,
                    clientHeaders,
                )
                if record.brokenMidStream:
                    # After the client's first byte: no retry (D9), but the
                    # deployment failed.
                    outcome = BROKEN
                    self._cooled(attempt, flight.failed())
                else:
                    outcome = OK
                return answer
            except UpstreamFault as failed:
                fault = failed
                record.overloaded = failed.overloaded
                outcome = self._failedTry(attempt, flight, failed)
                if not failed.fallback:
                    break
            finally:
                flight.finished()
                if self._deployments is not None:
                    self._deployments.deploymentEnded(
                        attempt.model.name, attempt.deployment.name, outcome
                    )
        assert fault is not None, "a model always has at least one attempt"
        raise fault.error

    # One try.

    async def _try(
        self,
        model: Model,
        leg: Leg,
        body: bytes,
        exchange: Exchange,
        flight: Flight,
        stream: bool,
        client: ClientStream,
        errorEvent: Callable[[ApiError], bytes],
        record: UpstreamRecord,
        onEventData: Callable[[bytes], None] | None,
        clientHeaders: Mapping[bytes, bytes] | None,
    ) -> Answer:
        """
        One try on one deployment, its wait for the first byte bounded by
        the model's C{first_byte_timeout} (decisions D15): on expiry the
        try is cancelled as when its client goes away (the upstream sees
        its connection closed), and it is a fault that allows the next
        try.
        """
        waiting = FirstByte(flight)
        work: Deferred[Answer]
        if stream:
            work = Deferred.fromCoroutine(
                self._stream(
                    model,
                    leg,
                    body,
                    exchange,
                    client,
                    errorEvent,
                    record,
                    onEventData,
                    clientHeaders,
                    waiting,
                )
            )
        else:
            work = Deferred.fromCoroutine(
                self._complete(model, leg, body, exchange, record, clientHeaders, waiting)
            )
        if model.firstByteTimeout is not None and not work.called:
            waiting.timer = asReactorTime(self._clock).callLater(
                model.firstByteTimeout, waiting.expire, work
            )
        try:
            return await work
        except CancelledError:
            if waiting.expired:
                raise timeoutFault(FIRST_BYTE_TIMEOUT) from None
            raise
        finally:
            waiting.disarm()

    def _started(self, attempt: Try) -> None:
        if self._deployments is not None:
            self._deployments.deploymentStarted(attempt.model.name, attempt.deployment.name)

    def _cooled(self, attempt: Try, cooldown: Cooldown | None) -> None:
        if cooldown is not None and self._deployments is not None:
            self._deployments.deploymentCooled(
                attempt.model.name, attempt.deployment.name, cooldown.reason
            )

    def _failedTry(self, attempt: Try, flight: Flight, fault: UpstreamFault) -> str:
        """
        Tell the router how a try failed before the client's first byte;
        the outcome label. A refusal of the client's request is not the
        deployment's failure.
        """
        code = fault.error.code
        if code is ErrorCode.UPSTREAM_REJECTED:
            return REJECTED
        if code is ErrorCode.UPSTREAM_RATE_LIMITED:
            retryAfter = dict(fault.error.headers or ()).get("Retry-After")
            now = self._clock.seconds()
            self._cooled(attempt, flight.rateLimited(retryAfterSeconds(retryAfter, now)))
            return RATE_LIMITED
        self._cooled(attempt, flight.failed())
        return FAILED

    def _begin(
        self,
        model: Model,
        leg: Leg,
        exchange: Exchange,
        record: UpstreamRecord,
        clientHeaders: Mapping[bytes, bytes] | None,
        stream: bool,
    ) -> tuple[Link, dict[bytes, bytes], Span | None]:
        link = self._links[model.provider.name]
        record.provider = model.provider.name
        record.model = model.name
        record.upstreamModel = model.upstreamModel
        record.usage = None
        record.overloaded = False
        # Content-Type and the key are the pool's own (Link).
        headers = {b"X-Request-ID": exchange.requestID.encode("ascii")}
        if model.provider.api == ANTHROPIC:
            _anthropicHeaders(headers, clientHeaders)
        span = self._telemetry.span(leg, model, record.deployment, stream, exchange)
        spanContext = (span or trace.get_current_span()).get_span_context()
        if spanContext.is_valid:
            headers[b"traceparent"] = traceparentOf(spanContext).encode("ascii")
        return link, headers, span

    def _finish(
        self,
        model: Model,
        leg: Leg,
        span: Span | None,
        label: str,
        began: float,
        record: UpstreamRecord,
        responseModel: str | None,
    ) -> None:
        elapsed = time.perf_counter() - began
        record.upstreamMilliseconds = round(elapsed * 1000, 3)
        self._metrics.observeUpstream(model.provider.name, model.name, label, elapsed, record.usage)
        self._telemetry.ended(
            span, leg.genAIOperation, model, label, elapsed, record.usage, responseModel
        )

    async def _complete(
        self,
        model: Model,
        leg: Leg,
        body: bytes,
        exchange: Exchange,
        record: UpstreamRecord,
        clientHeaders: Mapping[bytes, bytes] | None,
        waiting: FirstByte,
    ) -> Answer:
        """
        A non-streaming attempt: the whole answer within C{timeout}, in
        the client's dialect; its first byte is its response's head.
        """
        link, headers, span = self._begin(model, leg, exchange, record, clientHeaders, False)
        began = time.perf_counter()
        label = "cancelled"
        responseModel = None
        try:
            work = Deferred.fromCoroutine(
                link.exchange(body, headers, link.target(leg), waiting.arrived)
            )
            try:
                response, answer = await timeoutDeferred(
                    work, model.provider.timeout, asReactorTime(self._clock)
                )
            except TimeoutError:
                raise timeoutFault() from None
            label = str(response.code)
            if not 200 <= response.code < 300:
                raise refusalFault(response, answer, model.provider)
            try:
                parsed = json.loads(answer)
                responseModel = responseModelOf(parsed)
                translated = leg.answer(parsed, exchange)
            except (ValueError, RecursionError, Untranslated):
                raise brokenFault("invalid") from None
            record.usage = translated.usage
            if translated.document is not None:
                parsed = translated.document
                answer = _dumps(parsed)
            return Answer(
                200,
                answer,
                headers=[(UPSTREAM_MODEL_HEADER, _ascii(model.name))],
                document=parsed,
            )
        except UpstreamFault as fault:
            label = fault.label
            raise
        except CancelledError:
            label = FIRST_BYTE_TIMEOUT if waiting.expired else "cancelled"
            raise
        finally:
            self._finish(model, leg, span, label, began, record, responseModel)

    async def _stream(
        self,
        model: Model,
        leg: Leg,
        body: bytes,
        exchange: Exchange,
        client: ClientStream,
        errorEvent: Callable[[ApiError], bytes],
        record: UpstreamRecord,
        onEventData: Callable[[bytes], None] | None,
        clientHeaders: Mapping[bytes, bytes] | None,
        waiting: FirstByte,
    ) -> Answer:
        """
        A streaming attempt: the first event within C{idle_timeout} (until
        then a fault allows a fallback), then every event relayed as it
        comes (through the leg's passage, when it has one), each within
        C{idle_timeout} of the one before. Its first byte is its first
        event.
        """
        link, headers, span = self._begin(model, leg, exchange, record, clientHeaders, True)
        began = time.perf_counter()
        provider = model.provider
        side = _StreamSide(client, model.name, errorEvent, record, waiting.arrived)
        label = "cancelled"
        try:
            async with link.turn(provider.idleTimeout, self._clock) as remaining:
                response = await self._openStream(
                    link, body, headers, provider, remaining, link.target(leg)
                )
                relay = side.relay = StreamRelay(
                    self._clock,
                    remaining(),
                    provider.idleTimeout,
                    side.begin,
                    side.client.write,
                    side.faultEvent,
                    _wantsUsage(exchange.document),
                    onEventData,
                    leg.passage(exchange, model) if leg.passage is not None else None,
                )
                label = await self._relayStream(response, relay, side, record)
            return Answer(200, b"", _EVENT_STREAM, streamed=True)
        except UpstreamFault as fault:
            label = fault.label
            raise
        except CancelledError:
            label = FIRST_BYTE_TIMEOUT if waiting.expired else "cancelled"
            raise
        except Exception:
            if not side.committed:
                raise
            # A bug after the status line went out: the stream cannot turn
            # into an error answer any more; end it as a fault would.
            label = "stream_error"
            record.brokenMidStream = True
            self.log.failure("Fault relaying a stream from {provider}", provider=provider.name)
            client.write(errorEvent(ApiError(ErrorCode.INTERNAL_ERROR)))
            return Answer(200, b"", _EVENT_STREAM, streamed=True)
        finally:
            # The relay holds the side's begin, and the side the relay: a
            # reference cycle, through the client to the whole request,
            # until this (tests/test_gc_cycles.py).
            responseModel = side.relay.responseModel if side.relay is not None else None
            side.relay = None
            self._finish(model, leg, span, label, began, record, responseModel)

    async def _openStream(
        self,
        link: Link,
        body: bytes,
        headers: Mapping[bytes, bytes],
        provider: Provider,
        remaining: Callable[[], float],
        target: bytes | None,
    ) -> UpstreamAnswer:
        """
        The provider's answer to a streamed request, up to its head: a
        fault here, before any byte reached the client, allows a fallback.
        """
        try:
            response = await timeoutDeferred(
                link.send(body, headers, target), remaining(), asReactorTime(self._clock)
            )
        except TimeoutError:
            raise timeoutFault() from None
        if not 200 <= response.code < 300:
            answer = await _readRefusal(response, remaining(), self._clock)
            raise refusalFault(response, answer, provider)
        contentType = response.headers.getRawHeaders(b"content-type") or [b""]
        if not contentType[0].lower().startswith(_EVENT_STREAM):
            _discard(response)
            raise brokenFault("invalid")
        return response

    async def _relayStream(
        self,
        response: UpstreamAnswer,
        relay: StreamRelay,
        side: _StreamSide,
        record: UpstreamRecord,
    ) -> str:
        """
        Relay the answer's events to the client as they come; the label of
        C{svc_proxy_upstream_requests_total}. Until the first event a fault
        is an L{UpstreamFault} (a fallback may answer); after it, the relay
        ends the stream with its error event.
        """
        response.deliverBody(relay)
        try:
            await relay.started
        except StreamFault as fault:
            raise _faultBeforeFirstByte(fault) from None
        try:
            record.usage = await relay.finished
            return str(response.code)
        except StreamFault as fault:
            record.usage = relay.usage
            record.brokenMidStream = True
            record.overloaded = fault.overloaded
            return f"stream_{fault.kind}"
        finally:
            side.client.unregisterProducer()


@attrs.define(eq=False)
class _StreamSide:
    """
    The client's side of one streamed attempt: its status line and headers
    go out with the first event, then the relay is its producer.
    """

    client: ClientStream
    modelName: str
    errorEvent: Callable[[ApiError], bytes]
    record: UpstreamRecord
    arrived: Callable[[], None]
    relay: StreamRelay | None = None
    committed: bool = False

    def begin(self) -> None:
        self.arrived()
        self.committed = True
        self.client.begin(200, _EVENT_STREAM, [(UPSTREAM_MODEL_HEADER, _ascii(self.modelName))])
        assert self.relay is not None
        self.client.registerProducer(self.relay)

    def faultEvent(self, fault: StreamFault) -> bytes:
        error = fault.error
        if error is None:
            timedOut = fault.kind == "timeout"
            error = ApiError(ErrorCode.UPSTREAM_TIMEOUT if timedOut else ErrorCode.UPSTREAM_ERROR)
        # Read by the route's errorEvent (decisions D14: overloaded_error).
        self.record.overloaded = fault.overloaded
        return self.errorEvent(error)


def _anthropicHeaders(
    headers: dict[bytes, bytes], clientHeaders: Mapping[bytes, bytes] | None
) -> None:
    """
    Add an Anthropic provider's headers of the request (decisions D14):
    C{anthropic-version}, the client's or L{ANTHROPIC_VERSION}, and the
    client's C{anthropic-beta}.
    """
    version = beta = None
    if clientHeaders is not None:
        version = clientHeaders.get(ANTHROPIC_VERSION_HEADER)
        beta = clientHeaders.get(ANTHROPIC_BETA_HEADER)
    headers[ANTHROPIC_VERSION_HEADER] = version or _DEFAULT_VERSION
    if beta:
        headers[ANTHROPIC_BETA_HEADER] = beta


def _faultBeforeFirstByte(fault: StreamFault) -> UpstreamFault:
    """
    A stream's fault before any byte reached the client: a fallback may
    answer (but for a request the provider refused).
    """
    if fault.error is not None:
        return UpstreamFault(fault.error, "error_event", overloaded=fault.overloaded)
    return timeoutFault() if fault.kind == "timeout" else brokenFault(fault.kind)


def _dumps(document: object) -> bytes:
    """
    C{document} as compact UTF-8 JSON; a lone surrogate (JSON's escape of
    one, which a client or a provider may send) has no UTF-8 form, and such
    a document is written with every non-ASCII character escaped instead:
    the same JSON, never an exception on the request's path.
    """
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(document, separators=(",", ":")).encode("ascii")


def _wantsUsage(document: Mapping[str, Any]) -> bool:
    options = document.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _ascii(text: str) -> bytes:
    return text.encode("ascii", "replace")


def _discard(response: UpstreamAnswer) -> None:
    reader = BodyReader(limit=0)
    response.deliverBody(reader)
    reader.finished.addErrback(lambda _: None)


async def _readRefusal(response: UpstreamAnswer, budget: float, clock: Clock) -> bytes:
    """
    The (bounded) body of an upstream's refusal, or nothing if it does not
    come in time.
    """
    reader = BodyReader(limit=64 * 1024)
    response.deliverBody(reader)
    try:
        return await timeoutDeferred(reader.finished, budget, asReactorTime(clock))
    except (TimeoutError, StreamFault):
        return b""
