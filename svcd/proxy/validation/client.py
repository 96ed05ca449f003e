"""
The proxy's validations by svc-auth: ValidateToken and ValidateAgent over
the proxy's one connection to svc-auth (L{svcd.authclient}, which the
ledger's sender and the change feed share), each call under its own
deadline, mapped to the HTTP errors of spec 4.3, 5.6 and decisions D4.
Auth fails closed: whatever is not a clear answer becomes a 503.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc
from opentelemetry import trace
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger

from svcd.authclient.connection import AuthConnection, AuthMethod, resultLabel, statusOf
from svcd.authclient.feed import (
    FeedCall,
    budgetFromProto,
    limitsFromProto,
    memorySettingsFromProto,
    openChangeFeed,
)
from svcd.authclient.slots import FIRST_STAGE, LATER_STAGE
from svcd.common.errors import ApiError, ErrorCode, FieldError, FieldErrorCode, validationError
from svcd.common.ids import parseUUID
from svcd.common.logthrottle import ThrottledWarning
from svcd.common.pat import READINESS_SENTINEL
from svcd.common.readiness import CheckFailed
from svcd.common.tracing import traceMetadata
from svcd.limits.book import LimitBook
from svcd.limits.records import Budget, Limits, MemorySettings
from svcd.pb.auth.v1 import auth_pb2
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.records import AgentInfo, TokenInfo
from svcd.proxy.validation.sharedcalls import SharedCalls

# The request header naming the calling agent.
AGENT_HEADER = "X-SVC-Agent-ID"

# The message svc-auth gives a paused, suspended or archived agent (spec 3).
AGENT_NOT_ACTIVE = "agent is not active"

VALIDATE_TOKEN = AuthMethod(
    "ValidateToken", auth_pb2.ValidateTokenRequest, auth_pb2.ValidateTokenResponse
)
VALIDATE_AGENT = AuthMethod(
    "ValidateAgent", auth_pb2.ValidateAgentRequest, auth_pb2.ValidateAgentResponse
)


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


# The answers that say nothing about the token or agent, only that the call
# failed (its deadline, svc-auth unreachable, no free slot in time).
_NO_ANSWER = frozenset({ErrorCode.SERVICE_DEGRADED, ErrorCode.AUTH_UNAVAILABLE})


def _failedWithoutAnswer(error: BaseException) -> bool:
    return isinstance(error, ApiError) and error.code in _NO_ANSWER


class GrpcAuthClient:
    """
    L{AuthClient} over the proxy's one L{AuthConnection} to svc-auth,
    which the ledger's sender (L{svcd.ledger.sender.LedgerSender}) and the
    change feed share: one channel, and one set of slots in which
    ValidateAgent calls go before ValidateToken calls
    (L{svcd.authclient.slots.CallSlots}). A call that found no free slot
    in time fails closed like a timeout; each validation's duration is
    recorded by how it ended.

    @param timeout: the deadline of each validate call, in seconds.
    @param readinessTimeout: the deadline of the /ready probe, which is
        sent at once, outside the slots.
    @param limitBook: learns the limits and budgets riding on the answers
        (decisions D11, D12).

    Concurrent validations of one question share one call
    (L{SharedCalls}).
    """

    log = Logger()

    def __init__(
        self,
        connection: AuthConnection,
        timeout: float,
        metrics: ProxyMetrics,
        readinessTimeout: float = 0.5,
        limitBook: LimitBook | None = None,
    ) -> None:
        self._connection = connection
        # Decisions D11: the limits rows riding on the answers, learned
        # while the change feed is not live.
        self._limitBook = limitBook
        self._tokenCalls: SharedCalls[str, TokenInfo] = SharedCalls()
        self._agentCalls: SharedCalls[tuple[str, str, str], AgentInfo] = SharedCalls()
        self._timeout = timeout
        self._metrics = metrics
        self._readinessTimeout = readinessTimeout
        self._unavailable = ThrottledWarning(self.log, connection.clock)

    def openChangeFeed(self) -> FeedCall:
        """
        Start svc-auth's change feed on the shared channel (called from
        the feed's own thread, after L{start}).
        """
        return openChangeFeed(self._connection.startedChannel())

    def start(self) -> None:
        """
        Start the connection to svc-auth: the channel connects now, so
        that the first request does not spend its short deadline on the
        handshakes.
        """
        self._connection.start()

    def channelReady(self) -> bool:
        """
        Has the channel connected to svc-auth since L{start}? (What a
        starting proxy waits for before it listens.)
        """
        return self._connection.channelReady()

    def close(self) -> None:
        """
        Close the connection (the ledger's sender shares it); calls in
        flight end with CANCELLED.
        """
        self._connection.close()

    def validateToken(self, accessToken: str) -> Deferred[TokenInfo]:
        return self._tokenCalls.ask(
            accessToken,
            lambda: Deferred.fromCoroutine(self._validateTokenCall(accessToken)),
            _failedWithoutAnswer,
        )

    async def _validateTokenCall(self, accessToken: str) -> TokenInfo:
        request = auth_pb2.ValidateTokenRequest(access_token=accessToken)
        try:
            response = await self._connection.call(
                VALIDATE_TOKEN,
                request,
                self._timeout,
                FIRST_STAGE,
                observe=self._metrics.observeAuthCall,
            )
        except CancelledError:
            raise
        except Exception as error:
            code, details = statusOf(error)
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
            response = await self._connection.call(
                VALIDATE_AGENT,
                request,
                self._timeout,
                LATER_STAGE,
                metadata,
                observe=self._metrics.observeAuthCall,
            )
        except CancelledError:
            raise
        except Exception as error:
            code, details = statusOf(error)
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
            grpc_status=resultLabel(code),
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
            await self._connection.sendNow(
                VALIDATE_TOKEN, request, self._readinessTimeout, metadata
            )
        except CancelledError:
            raise
        except Exception as error:
            code, _ = statusOf(error)
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
