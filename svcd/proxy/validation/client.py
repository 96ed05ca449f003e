"""
The proxy's link to svc-auth: ValidateToken and ValidateAgent over one
shared gRPC channel, each call under its own deadline, mapped to the HTTP
errors of spec 4.3, 5.6 and decisions D4. Auth fails closed: whatever is
not a clear answer becomes a 503.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, succeed
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.errors import ApiError, ErrorCode, FieldError, FieldErrorCode, validationError
from svcd.common.grpcdefer import deferredFromFuture
from svcd.common.ids import parseUUID
from svcd.common.logthrottle import ThrottledWarning
from svcd.common.pat import READINESS_SENTINEL
from svcd.common.readiness import CheckFailed
from svcd.common.tracing import traceMetadata
from svcd.limits.book import LimitBook
from svcd.limits.records import Budget, Limits, MemorySettings
from svcd.pb.auth.v1 import auth_pb2
from svcd.proxy.config import ProxyConfig
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.records import AgentInfo, TokenInfo
from svcd.proxy.validation.feed import (
    FeedCall,
    budgetFromProto,
    limitsFromProto,
    memorySettingsFromProto,
    openChangeFeed,
)
from svcd.proxy.validation.sharedcalls import SharedCalls

# The request header naming the calling agent.
AGENT_HEADER = "X-SVC-Agent-ID"

# The message svc-auth gives a paused, suspended or archived agent (spec 3).
AGENT_NOT_ACTIVE = "agent is not active"

_SERVICE = "svc.auth.v1.AuthService"
_VALIDATE_TOKEN = "/svc.auth.v1.AuthService/ValidateToken"  # noqa: S105 - a method name
_VALIDATE_AGENT = "/svc.auth.v1.AuthService/ValidateAgent"
_GET_SPEND = "/svc.auth.v1.AuthService/GetSpend"
# A sum over a budget's period of the ledger: rarer and dearer than a
# validation (once per budget and period, or after Redis lost its counts).
SPEND_TIMEOUT = 2.0
_RECORD_USAGE = "/svc.auth.v1.AuthService/RecordUsage"
# A batch of up to 500 usage rows committed in one transaction (decisions
# D12); a call that misses it is sent again, and svc-auth records each row
# once.
RECORD_USAGE_TIMEOUT = 5.0
_SPAN_ERROR = Status(StatusCode.ERROR)
# A request's calls in order, for L{CallSlots}.
_TOKEN_STAGE = 0
_AGENT_STAGE = 1


class AuthClient(Protocol):
    """
    What the proxy needs of svc-auth. Every method returns a cancellable
    Deferred; the validate calls fail with an L{ApiError} ready for the
    client.
    """

    def validateToken(self, accessToken: str) -> Deferred[TokenInfo]:
        """
        Validate a bearer token.

        @raise ApiError: 401 INVALID_TOKEN or 503 SERVICE_DEGRADED.
        """

    def validateAgent(self, accessToken: str, agentID: str, orgID: str) -> Deferred[AgentInfo]:
        """
        Verify that C{agentID} is an active agent of C{orgID}, as the holder
        of C{accessToken}.

        @raise ApiError: 403 AGENT_SUSPENDED or AGENT_NOT_AUTHORIZED, 400
            VALIDATION_ERROR, 401 INVALID_TOKEN or 503 AUTH_UNAVAILABLE.
        """

    def checkReachable(self) -> Deferred[None]:
        """
        The /ready check C{auth_grpc}: fires when svc-auth answers
        ValidateToken for the readiness sentinel, fails with
        L{CheckFailed} otherwise.
        """


def agentHeaderInvalid() -> ApiError:
    """
    400 VALIDATION_ERROR for an X-SVC-Agent-ID that is not a UUID (decisions
    D4), whether the proxy or svc-auth notices.
    """
    return validationError(
        [FieldError(AGENT_HEADER, FieldErrorCode.INVALID_FORMAT, "must be a UUID")]
    )


def tokenFailure(code: grpc.StatusCode | None) -> ApiError:
    """
    The HTTP error for a ValidateToken call that did not answer OK; C{None}
    stands for a failure without a gRPC status.
    """
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ApiError(ErrorCode.INVALID_TOKEN)
    return ApiError(ErrorCode.SERVICE_DEGRADED)


def agentFailure(code: grpc.StatusCode | None, details: str | None) -> ApiError:
    """
    The HTTP error for a ValidateAgent call that did not answer OK.
    """
    if code == grpc.StatusCode.PERMISSION_DENIED:
        if details == AGENT_NOT_ACTIVE:
            return ApiError(ErrorCode.AGENT_SUSPENDED)
        return ApiError(ErrorCode.AGENT_NOT_AUTHORIZED)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return agentHeaderInvalid()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ApiError(ErrorCode.INVALID_TOKEN)
    return ApiError(ErrorCode.AUTH_UNAVAILABLE)


def _statusOf(error: BaseException) -> tuple[grpc.StatusCode | None, str | None]:
    if isinstance(error, grpc.Call):
        return error.code(), error.details()
    return None, None


def _resultLabel(code: grpc.StatusCode | None) -> str:
    return "error" if code is None else str(code.name).lower()


def authChannel(config: ProxyConfig) -> Any:
    """
    The one channel to svc-auth: plaintext when no TLS variable is set,
    else TLS with the configured CA and, for mutual TLS, client
    certificate.
    """
    if config.authTLS is None:
        return grpc.insecure_channel(config.authGrpcAddr, options=CHANNEL_OPTIONS)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=config.authTLS.rootCertificates,
        private_key=config.authTLS.privateKey,
        certificate_chain=config.authTLS.certificateChain,
    )
    return grpc.secure_channel(config.authGrpcAddr, credentials, options=CHANNEL_OPTIONS)


# grpcio's default reconnect backoff grows to two minutes: after svc-auth
# has been away for a while, the proxy would keep failing closed long after
# it is back. Retry the connection at least every second instead, so
# service resumes within a second or so of svc-auth's return; calls made
# while the channel is down still fail at once (no wait_for_ready), which
# is what failing closed needs.
#
# A stopping svc-auth cancels the calls it had received but not yet begun
# (gRPC's server shutdown does; it also tells the channel to go elsewhere).
# ValidateToken and ValidateAgent only read, so a call svc-auth cancelled
# is sent once more, within the same deadline, to the replica the channel
# then uses (SVC_AUTH_GRPC_ADDR may name several): a rolling restart of
# the replicas then fails no request. A call the proxy cancels itself (its
# client went away) is never retried, and no other failure is.
RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [
                    {"service": "svc.auth.v1.AuthService", "method": "ValidateToken"},
                    {"service": "svc.auth.v1.AuthService", "method": "ValidateAgent"},
                ],
                "retryPolicy": {
                    "maxAttempts": 2,
                    "initialBackoff": "0.005s",
                    "maxBackoff": "0.02s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["CANCELLED"],
                },
            }
        ]
    }
)
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a dead svc-auth host (no RST, e.g. a lost VM) between calls.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", RETRY_SERVICE_CONFIG),
)


class CallSlots:
    """
    At most C{size} calls to svc-auth in flight; the others wait here, the
    later stage of a request first.

    A chat request makes two calls, ValidateToken (stage 0) and then
    ValidateAgent (stage 1). Under overload a plain FIFO would make a
    request that has already been through ValidateToken queue again behind
    every newer request, and perhaps time out there, wasting the work done
    for it and turning it into a 503. Serving the higher stage first
    finishes requests already begun before starting new ones; within a
    stage, waiting is first come, first served.

    A waiter whose Deferred is cancelled (its queue timeout) is skipped
    when its turn comes.
    """

    def __init__(self, size: int, stages: int = 2) -> None:
        self._free = size
        self._waiting: tuple[deque[Deferred[None]], ...] = tuple(deque() for _ in range(stages))

    def acquire(self, stage: int) -> Deferred[None]:
        """
        A Deferred that fires when the caller may send its call; it must
        then call L{release} once the call has ended.
        """
        if self._free:
            self._free -= 1
            return succeed(None)
        turn: Deferred[None] = Deferred()
        self._waiting[stage].append(turn)
        return turn

    def release(self) -> None:
        for waiting in reversed(self._waiting):
            while waiting:
                turn = waiting.popleft()
                if not turn.called:
                    turn.callback(None)
                    return
        self._free += 1


# The answers that say nothing about the token or agent, only that the call
# failed (its deadline, svc-auth unreachable, no free slot in time).
_NO_ANSWER = frozenset({ErrorCode.SERVICE_DEGRADED, ErrorCode.AUTH_UNAVAILABLE})


def _failedWithoutAnswer(error: BaseException) -> bool:
    return isinstance(error, ApiError) and error.code in _NO_ANSWER


class QueueTimeout(Exception):
    """
    A call waited longer than the queue timeout for a free slot; it was
    never sent, and the request fails closed as for a timeout.
    """


class GrpcAuthClient:
    """
    L{AuthClient} over a gRPC channel, using grpcio's future API bridged to
    Deferreds with C{callFromThread} (L{deferredFromFuture}), never
    C{deferToThread}: no call ever blocks the reactor thread or holds a
    thread while in flight (docs/design.rst, "Threads, the reactor and
    grpcio").

    @param channelFactory: makes the one shared L{grpc.Channel} to
        svc-auth. It is called at L{start} (or the first call), not here:
        twistd builds the service before it forks to daemonise, and a gRPC
        channel must not cross a fork.
    @param timeout: the deadline of each validate call, in seconds.
    @param tracer: makes a client span around each call of a sampled
        request; without it (or for an unsampled request) the caller's
        own span context is what the call carries.

    At most C{maxInFlight} calls are in flight at once; the others wait
    their turn here (ValidateAgent calls before ValidateToken calls, see
    L{CallSlots}), for at most C{queueTimeout} seconds, and each call's
    deadline starts only when it is sent. Under overload, requests then
    queue in the proxy instead of all missing their deadline at once
    inside svc-auth (and a call that waited too long fails closed like a
    timeout).

    Every call carries the current span's context as W3C C{traceparent}
    gRPC metadata (the proxy makes the request's span current), so
    svc-auth's spans join the request's trace; an unsampled request sends
    its unsampled flag, and svc-auth records nothing for it either.
    """

    log = Logger()

    def __init__(
        self,
        channelFactory: Callable[[], Any],
        reactor: IReactorFromThreads,
        clock: Clock,
        timeout: float,
        metrics: ProxyMetrics,
        readinessTimeout: float = 0.5,
        tracer: Tracer | None = None,
        maxInFlight: int = 16,
        queueTimeout: float = 1.0,
        limitBook: LimitBook | None = None,
        usageTimeout: float = RECORD_USAGE_TIMEOUT,
    ) -> None:
        self._channelFactory = channelFactory
        self._usageTimeout = usageTimeout
        # Decisions D11: the limits rows riding on the answers, learned
        # while the change feed is not live.
        self._limitBook = limitBook
        self._clock = clock
        self._slots = CallSlots(maxInFlight)
        self._tokenCalls: SharedCalls[str, TokenInfo] = SharedCalls()
        self._agentCalls: SharedCalls[tuple[str, str, str], AgentInfo] = SharedCalls()
        self._queueTimeout = queueTimeout
        self._tracer = tracer
        self._reactor = reactor
        self._timeout = timeout
        self._metrics = metrics
        self._readinessTimeout = readinessTimeout
        self._channel: Any = None
        self._validateTokenMethod: Any = None
        self._validateAgentMethod: Any = None
        self._getSpendMethod: Any = None
        self._recordUsageMethod: Any = None
        self._unavailable = ThrottledWarning(self.log, clock)
        self._ready: Any = None
        self._channelReady = False
        self._closed = False

    def _connect(self) -> None:
        if self._closed:
            raise RuntimeError("the client of svc-auth is closed")
        channel = self._channel = self._channelFactory()
        self._validateTokenMethod = channel.unary_unary(
            _VALIDATE_TOKEN,
            request_serializer=auth_pb2.ValidateTokenRequest.SerializeToString,
            response_deserializer=auth_pb2.ValidateTokenResponse.FromString,
            _registered_method=True,
        )
        self._validateAgentMethod = channel.unary_unary(
            _VALIDATE_AGENT,
            request_serializer=auth_pb2.ValidateAgentRequest.SerializeToString,
            response_deserializer=auth_pb2.ValidateAgentResponse.FromString,
            _registered_method=True,
        )
        self._getSpendMethod = channel.unary_unary(
            _GET_SPEND,
            request_serializer=auth_pb2.GetSpendRequest.SerializeToString,
            response_deserializer=auth_pb2.GetSpendResponse.FromString,
            _registered_method=True,
        )
        self._recordUsageMethod = channel.unary_unary(
            _RECORD_USAGE,
            request_serializer=auth_pb2.RecordUsageRequest.SerializeToString,
            response_deserializer=auth_pb2.RecordUsageResponse.FromString,
            _registered_method=True,
        )

    @property
    def _validateToken(self) -> Any:
        if self._channel is None:
            self._connect()
        return self._validateTokenMethod

    @property
    def _validateAgent(self) -> Any:
        if self._channel is None:
            self._connect()
        return self._validateAgentMethod

    def getSpend(self, orgID: str, agentID: str | None, since: int, until: int) -> Deferred[int]:
        """
        What C{orgID} (or its agent C{agentID}) has spent in [since,
        until), in nano-dollars, from svc-auth's ledger (decisions D12).
        """
        return Deferred.fromCoroutine(self._getSpendCall(orgID, agentID, since, until))

    async def _getSpendCall(self, orgID: str, agentID: str | None, since: int, until: int) -> int:
        if self._channel is None:
            self._connect()
        request = auth_pb2.GetSpendRequest(
            org_id=orgID, agent_id=agentID or "", since_unix=since, until_unix=until
        )
        response = await self._call(
            self._getSpendMethod, "GetSpend", request, SPEND_TIMEOUT, _AGENT_STAGE, observed=False
        )
        return int(response.cost_nano_usd)

    def recordUsage(
        self, rows: Sequence[auth_pb2.UsageRow]
    ) -> Deferred[auth_pb2.RecordUsageResponse]:
        """
        Send a batch of usage rows to svc-auth, which answers once it has
        committed them all (decisions D12). Fails with the call's
        L{grpc.RpcError} (DEADLINE_EXCEEDED past the client's usage
        timeout); cancelling the Deferred cancels the call.
        """
        return Deferred.fromCoroutine(self._recordUsageCall(rows))

    async def _recordUsageCall(
        self, rows: Sequence[auth_pb2.UsageRow]
    ) -> auth_pb2.RecordUsageResponse:
        if self._channel is None:
            self._connect()
        request = auth_pb2.RecordUsageRequest(rows=rows)
        # The lowest stage: a batch of rows can wait behind the validations
        # of requests that clients are waiting for.
        response: auth_pb2.RecordUsageResponse = await self._call(
            self._recordUsageMethod,
            "RecordUsage",
            request,
            self._usageTimeout,
            _TOKEN_STAGE,
            observed=False,
        )
        return response

    def openChangeFeed(self) -> FeedCall:
        """
        Start svc-auth's change feed on the shared channel (called from
        the feed's own thread, after L{start}).
        """
        channel = self._channel
        if channel is None or self._closed:
            raise RuntimeError("the client of svc-auth is not started")
        return openChangeFeed(channel)

    def start(self) -> None:
        """
        Make the channel and ask it to connect now, so that the first
        request does not spend its short deadline on the TCP and HTTP/2
        handshakes; log when it is ready.
        """
        if self._channel is None:
            self._connect()
        self._ready = grpc.channel_ready_future(self._channel)
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
        starting proxy waits for before it listens.)
        """
        return self._channelReady

    def _address(self) -> str:
        target = getattr(self._channel, "_target", None)
        return str(target) if target else "(unknown)"

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

    def _traced(
        self, name: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> tuple[Span | None, tuple[tuple[str, str], ...] | None]:
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
                f"{_SERVICE}/{name}",
                kind=SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.service": _SERVICE, "rpc.method": name},
                record_exception=False,
            )
            spanContext = span.get_span_context()
        if spanContext.is_valid:
            metadata += traceMetadata(spanContext)
        return span, metadata or None

    async def _call(
        self,
        method: Any,
        name: str,
        request: Any,
        deadline: float,
        stage: int,
        metadata: tuple[tuple[str, str], ...] = (),
        observed: bool = True,
    ) -> Any:
        """
        One unary call of a request's C{stage} (0 for ValidateToken, 1 for
        ValidateAgent and the rest), carrying the trace context; the
        duration of a validation (C{observed}) is recorded by how it
        ended.
        """
        span, outgoing = self._traced(name, metadata)
        began = time.perf_counter()
        label = "ok"
        code: grpc.StatusCode | None = grpc.StatusCode.OK
        turn = self._slots.acquire(stage)
        try:
            if not turn.called:
                try:
                    await timeoutDeferred(turn, self._queueTimeout, asReactorTime(self._clock))
                except TimeoutError:
                    raise QueueTimeout(
                        f"no free slot for a call to svc-auth within {self._queueTimeout}s"
                    ) from None
            try:
                return await deferredFromFuture(
                    self._reactor, method.future(request, timeout=deadline, metadata=outgoing)
                )
            finally:
                self._slots.release()
        except CancelledError:
            label, code = "cancelled", grpc.StatusCode.CANCELLED
            raise
        except QueueTimeout:
            label, code = "queue_timeout", None
            raise
        except Exception as error:
            code = _statusOf(error)[0]
            label = _resultLabel(code)
            raise
        finally:
            if observed:
                self._metrics.observeAuthCall(label, time.perf_counter() - began)
            if span is not None:
                if code is not None:
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code is not grpc.StatusCode.OK:
                    span.set_status(_SPAN_ERROR)
                span.end()

    def validateToken(self, accessToken: str) -> Deferred[TokenInfo]:
        return self._tokenCalls.ask(
            accessToken,
            lambda: Deferred.fromCoroutine(self._validateTokenCall(accessToken)),
            _failedWithoutAnswer,
        )

    async def _validateTokenCall(self, accessToken: str) -> TokenInfo:
        request = auth_pb2.ValidateTokenRequest(access_token=accessToken)
        try:
            response: auth_pb2.ValidateTokenResponse = await self._call(
                self._validateToken, "ValidateToken", request, self._timeout, _TOKEN_STAGE
            )
        except CancelledError:
            raise
        except Exception as error:
            code, details = _statusOf(error)
            if code != grpc.StatusCode.UNAUTHENTICATED:
                self._warnUnavailable("ValidateToken", code, details, error)
            raise tokenFailure(code) from None
        orgID = parseUUID(response.org_id)
        agentID = parseUUID(response.agent_id) if response.agent_id else None
        if orgID is None or (response.agent_id and agentID is None):
            # svc-auth vouched for something that is not a UUID: trust
            # nothing of it (fail closed).
            self.log.error("ValidateToken answered OK with a malformed org_id or agent_id")
            raise ApiError(ErrorCode.SERVICE_DEGRADED)
        if self._limitBook is not None:
            self._limitBook.learnOrg(
                str(orgID),
                limitsOf(response, "org_limits"),
                budgetOf(response, "org_budget"),
                memorySettingsOf(response, "org_memory_settings"),
            )
        return TokenInfo(
            orgID=str(orgID),
            permissions=response.permissions,
            agentID=str(agentID) if agentID is not None else None,
            userID=response.user_id or None,
            tokenID=response.token_id or None,
            expiresAt=response.expires_at or None,
        )

    def validateAgent(self, accessToken: str, agentID: str, orgID: str) -> Deferred[AgentInfo]:
        return self._agentCalls.ask(
            (accessToken, agentID, orgID),
            lambda: Deferred.fromCoroutine(self._validateAgentCall(accessToken, agentID, orgID)),
            _failedWithoutAnswer,
        )

    async def _validateAgentCall(self, accessToken: str, agentID: str, orgID: str) -> AgentInfo:
        request = auth_pb2.ValidateAgentRequest(agent_id=agentID, org_id=orgID)
        metadata = (("authorization", "Bearer " + accessToken),)
        try:
            response: auth_pb2.ValidateAgentResponse = await self._call(
                self._validateAgent,
                "ValidateAgent",
                request,
                self._timeout,
                _AGENT_STAGE,
                metadata,
            )
        except CancelledError:
            raise
        except Exception as error:
            code, details = _statusOf(error)
            failure = agentFailure(code, details)
            if failure.code is ErrorCode.AUTH_UNAVAILABLE:
                self._warnUnavailable("ValidateAgent", code, details, error)
            raise failure from None
        if response.status != "active":
            # OK for an inactive agent would be a bug of svc-auth; the proxy
            # fails closed all the same.
            raise ApiError(ErrorCode.AGENT_SUSPENDED)
        if self._limitBook is not None:
            self._limitBook.learnAgent(
                orgID,
                agentID,
                limitsOf(response, "agent_limits"),
                budgetOf(response, "agent_budget"),
                memorySettingsOf(response, "agent_memory_settings"),
            )
        return AgentInfo(agentID=agentID, orgID=orgID, status=response.status)

    def _warnUnavailable(
        self,
        method: str,
        code: grpc.StatusCode | None,
        details: str | None,
        error: BaseException,
    ) -> None:
        self._unavailable.warn(
            "{method} to svc-auth failed ({grpc_status}: {grpc_details}); answering 503",
            method=method,
            grpc_status=_resultLabel(code),
            grpc_details=details if code is not None else type(error).__name__,
        )

    def checkReachable(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._checkReachable())

    async def _checkReachable(self) -> None:
        request = auth_pb2.ValidateTokenRequest(access_token=READINESS_SENTINEL)
        # The trace context only: a /ready probe is not worth a client span.
        spanContext = trace.get_current_span().get_span_context()
        metadata = traceMetadata(spanContext) if spanContext.is_valid else None
        try:
            future = self._validateToken.future(
                request, timeout=self._readinessTimeout, metadata=metadata
            )
            await deferredFromFuture(self._reactor, future)
        except CancelledError:
            raise
        except Exception as error:
            code, _ = _statusOf(error)
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return
            if code is None:
                raise CheckFailed(f"ValidateToken failed: {type(error).__name__}") from None
            raise CheckFailed(f"ValidateToken answered {code.name}") from None


def limitsOf(message: Any, field: str) -> Limits | None:
    """
    The limits row in C{message}'s C{field} (decisions D11), or None when
    the message has none.
    """
    return limitsFromProto(getattr(message, field)) if message.HasField(field) else None


def budgetOf(message: Any, field: str) -> Budget | None:
    """
    The budget in C{message}'s C{field} (decisions D12), or None when the
    message has none.
    """
    return budgetFromProto(getattr(message, field)) if message.HasField(field) else None


def memorySettingsOf(message: Any, field: str) -> MemorySettings | None:
    """
    The memory settings in C{message}'s C{field} (decisions D13), or None
    when the message has none.
    """
    if not message.HasField(field):
        return None
    return memorySettingsFromProto(getattr(message, field))
