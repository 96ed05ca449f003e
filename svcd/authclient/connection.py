"""
The one connection a daemon holds to svc-auth: the channel, made at start
and closed at stop, the slots that bound the calls in flight, and each
unary call sent traced, slotted and under its own deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs
import grpc
from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

from svcd.authclient.slots import CallSlots, QueueTimeout
from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.grpcdefer import deferredFromFuture
from svcd.common.tracing import traceMetadata

SERVICE = "svc.auth.v1.AuthService"
_SPAN_ERROR = Status(StatusCode.ERROR)

Request = TypeVar("Request", bound=Message)
Response = TypeVar("Response", bound=Message)

# Call metadata: (key, value) pairs.
Metadata = tuple[tuple[str, str], ...]


@attrs.frozen
class AuthMethod(Generic[Request, Response]):
    """
    A unary method of svc-auth's AuthService: its name and the messages it
    takes and answers.
    """

    name: str
    request: type[Request]
    response: type[Response]

    @property
    def path(self) -> str:
        """
        The method's name on the wire.
        """
        return f"/{SERVICE}/{self.name}"


def statusOf(error: BaseException) -> tuple[grpc.StatusCode | None, str | None]:
    """
    The gRPC status code and details of a failed call, or C{(None, None)}
    for a failure without a gRPC status (no free slot, a closed channel).
    """
    if isinstance(error, grpc.Call):
        return error.code(), error.details()
    return None, None


def resultLabel(code: grpc.StatusCode | None) -> str:
    """
    How a call ended, as a metric's label value: the status code's name in
    lower case, or C{error} for a failure without a gRPC status.
    """
    return "error" if code is None else str(code.name).lower()


class AuthConnection:
    """
    The channel to svc-auth that every caller in a daemon shares (the
    proxy's validation, the ledger's sender and the change feed ride on one
    channel), with the calls' slots.

    Unary calls use grpcio's future API bridged to Deferreds with
    C{callFromThread} (L{deferredFromFuture}), never C{deferToThread}: no
    call ever blocks the reactor thread or holds a thread while in flight
    (docs/design.rst, "Threads, the reactor and grpcio").

    @param channelFactory: makes the L{grpc.Channel} (see
        L{svcd.authclient.channel.authChannel}). It is called at L{start}
        (or the first call), not here: twistd builds the service before it
        forks to daemonise, and a gRPC channel must not cross a fork.
    @param tracer: makes a client span around each call of a sampled
        request; without it (or for an unsampled request) the caller's
        own span context is what the call carries.

    At most C{maxInFlight} calls are in flight at once; the others wait
    their turn here (by stage, see L{CallSlots}), for at most
    C{queueTimeout} seconds, and each call's deadline starts only when it
    is sent. Under overload, requests then queue in the daemon instead of
    all missing their deadline at once inside svc-auth (and a call that
    waited too long fails with L{QueueTimeout}).

    Every call carries the current span's context as W3C C{traceparent}
    gRPC metadata, so svc-auth's spans join the caller's trace; an
    unsampled request sends its unsampled flag, and svc-auth records
    nothing for it either.
    """

    log = Logger()

    def __init__(
        self,
        channelFactory: Callable[[], Any],
        reactor: IReactorFromThreads,
        clock: Clock,
        *,
        tracer: Tracer | None = None,
        maxInFlight: int = 16,
        queueTimeout: float = 1.0,
    ) -> None:
        self._channelFactory = channelFactory
        self._reactor = reactor
        self.clock = clock
        self._tracer = tracer
        self._slots = CallSlots(maxInFlight)
        self._queueTimeout = queueTimeout
        self._channel: Any = None
        self._methods: dict[str, Any] = {}
        self._ready: Any = None
        self._channelReady = False
        self._closed = False

    def _connected(self) -> Any:
        """
        The channel, made now if it is not yet.

        @raise RuntimeError: when it was closed before it was made.
        """
        if self._channel is None:
            if self._closed:
                raise RuntimeError("the client of svc-auth is closed")
            self._channel = self._channelFactory()
        return self._channel

    def _stub(self, method: AuthMethod[Any, Any]) -> Any:
        """
        C{method}'s callable on the channel, registered once.

        @raise RuntimeError: when it was closed before it was made.
        @raise ValueError: when the channel is closed and C{method} was
            never registered on it (grpcio's own error for a call on a
            closed channel; registering a method on a closed channel
            crashes the process, grpcio 1.85).
        """
        channel = self._connected()
        stub = self._methods.get(method.name)
        if stub is None:
            if self._closed:
                raise ValueError("Cannot invoke RPC: the channel to svc-auth is closed")
            stub = self._methods[method.name] = channel.unary_unary(
                method.path,
                request_serializer=method.request.SerializeToString,
                response_deserializer=method.response.FromString,
                _registered_method=True,
            )
        return stub

    def start(self) -> None:
        """
        Make the channel and ask it to connect now, so that the first call
        does not spend its short deadline on the TCP and HTTP/2
        handshakes; log when it is ready.
        """
        self._ready = grpc.channel_ready_future(self._connected())
        Deferred.fromCoroutine(self._logWhenReady(self._ready))

    async def _logWhenReady(self, ready: Any) -> None:
        try:
            await deferredFromFuture(self._reactor, ready)
        except CancelledError:
            return
        self._channelReady = True
        self.log.info("gRPC channel to svc-auth {address} is ready", address=self._address())

    def channelReady(self) -> bool:
        """
        Has the channel connected to svc-auth since L{start}? (What a
        starting daemon waits for before it serves.)
        """
        return self._channelReady

    def _address(self) -> str:
        target = getattr(self._channel, "_target", None)
        return str(target) if target else "(unknown)"

    def startedChannel(self) -> Any:
        """
        The channel, for a call that is not unary (the change feed's
        stream, from its own thread, after L{start}).

        @raise RuntimeError: before L{start} or after L{close}.
        """
        channel = self._channel
        if channel is None or self._closed:
            raise RuntimeError("the client of svc-auth is not started")
        return channel

    def close(self) -> None:
        """
        Close the channel; calls in flight end with CANCELLED.
        """
        if not self._closed:
            self._closed = True
            if self._ready is not None:
                self._ready.cancel()
            if self._channel is not None:
                self._channel.close()

    def _traced(self, name: str, metadata: Metadata) -> tuple[Span | None, Metadata | None]:
        """
        The client span of a call named C{name} (only when the current span
        is recording and there is a tracer) and the call's metadata with the
        trace context added.

        Read synchronously by the caller's coroutine, before its first
        await, while the request's context is the current one.
        """
        current = trace.get_current_span()
        spanContext = current.get_span_context()
        span = None
        if self._tracer is not None and current.is_recording():
            span = self._tracer.start_span(
                f"{SERVICE}/{name}",
                kind=SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": name},
                record_exception=False,
            )
            spanContext = span.get_span_context()
        if spanContext.is_valid:
            metadata += traceMetadata(spanContext)
        return span, metadata or None

    async def call(
        self,
        method: AuthMethod[Request, Response],
        request: Request,
        deadline: float,
        stage: int,
        metadata: Metadata = (),
        observe: Callable[[str, float], None] | None = None,
    ) -> Response:
        """
        One unary call of a request's C{stage} (see L{CallSlots}), sent once
        a slot is free and then given C{deadline} seconds, carrying the
        trace context.

        Call it from a coroutine and await it at once: the trace context is
        read before the first await.

        @param observe: given how the call ended (C{ok}, C{cancelled},
            C{queue_timeout} or L{resultLabel}'s) and how long it took, in
            seconds, slot wait included.
        @raise RuntimeError: the connection was closed before any channel
            was made (nothing is observed).
        @raise QueueTimeout: no slot was free within the queue timeout.
        @raise grpc.RpcError: the call failed (also a L{grpc.Call}: see
            L{statusOf}).
        """
        self._connected()
        span, outgoing = self._traced(method.name, metadata)
        began = time.perf_counter()
        label = "ok"
        code: grpc.StatusCode | None = grpc.StatusCode.OK
        turn = self._slots.acquire(stage)
        try:
            if not turn.called:
                try:
                    await timeoutDeferred(turn, self._queueTimeout, asReactorTime(self.clock))
                except TimeoutError:
                    raise QueueTimeout(
                        f"no free slot for a call to svc-auth within {self._queueTimeout}s"
                    ) from None
            try:
                future = self._stub(method).future(request, timeout=deadline, metadata=outgoing)
                response: Response = await deferredFromFuture(self._reactor, future)
                return response
            finally:
                self._slots.release()
        except CancelledError:
            label, code = "cancelled", grpc.StatusCode.CANCELLED
            raise
        except QueueTimeout:
            label, code = "queue_timeout", None
            raise
        except Exception as error:
            code = statusOf(error)[0]
            label = resultLabel(code)
            raise
        finally:
            if observe is not None:
                observe(label, time.perf_counter() - began)
            if span is not None:
                if code is not None:
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code is not grpc.StatusCode.OK:
                    span.set_status(_SPAN_ERROR)
                span.end()

    def sendNow(
        self,
        method: AuthMethod[Request, Response],
        request: Request,
        deadline: float,
        metadata: Metadata | None = None,
    ) -> Deferred[Response]:
        """
        One unary call sent at once, outside the slots and without a span
        of its own: for a readiness probe, which must tell whether svc-auth
        answers now, not whether a slot is free.

        @raise RuntimeError: the connection was closed before any channel
            was made.
        @raise ValueError: the channel is closed.
        """
        future = self._stub(method).future(request, timeout=deadline, metadata=metadata)
        return deferredFromFuture(self._reactor, future)
