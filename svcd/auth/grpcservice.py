"""
The gRPC face of svc-auth: the svc.auth.v1.AuthService servicer, plus the
standard grpc.health.v1.Health service and server reflection, hosted by a
twistd service so that the gRPC server starts and stops with the reactor
beside the HTTP side.

grpcio runs servicer methods in its own thread pool, which is where the
blocking work of L{Authority} (database, argon2) belongs: nothing here runs
on the reactor thread. How many calls that pool serves at once, and per
client connection, is L{svcd.common.grpcadmission}'s business.

Requests are parsed here rather than by grpcio: grpcio answers a request
that protobuf cannot parse (a string field that is not UTF-8) with INTERNAL
and logs a traceback, while it is only a client's bad input, answered
INVALID_ARGUMENT naming the field (decisions D10).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry, Counter, Histogram
from twisted.internet.interfaces import IReactorThreads
from twisted.logger import Logger

from svcd.auth.authority import (
    Authority,
    DeadlinePassed,
    InvalidArgument,
    Overloaded,
    PermissionDenied,
    Refusal,
    TryAgain,
    Unauthenticated,
    Unavailable,
    bearerFromMetadata,
)
from svcd.auth.feed import (
    ChangeHub,
    FeedEnded,
    FeedUnavailable,
    Snapshots,
    TooManyStreams,
    snapshotMessages,
)
from svcd.auth.limits import (
    BudgetsTable,
    LimitsTable,
    MemorySettingsTable,
    budgetMessage,
    limitsMessage,
    memorySettingsMessage,
)
from svcd.auth.store.tokens import TokenRecord
from svcd.auth.usage import (
    REJECT_REASONS,
    BadUsage,
    RejectedRow,
    checkBatch,
    clampInt64,
    formatMoment,
    totalOf,
    usageSum,
)
from svcd.common.errors import rfc3339
from svcd.common.grpcadmission import DEADLINE, AdmissionInterceptor, Bounds, RefusalLog
from svcd.common.grpcserver import HostedGrpcServer, ServerTLS, buildGrpcServer
from svcd.common.ids import parseUUID
from svcd.common.metrics import BUCKETS, Children
from svcd.common.pgtransactions import StoreUnavailable
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc

SERVICE_NAME = "svc.auth.v1.AuthService"

_STATUS_OF_REFUSAL: dict[type[Refusal], grpc.StatusCode] = {
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.INTERNAL,
    TryAgain: grpc.StatusCode.UNAVAILABLE,
    DeadlinePassed: grpc.StatusCode.DEADLINE_EXCEEDED,
}

_RESULT_OF_REFUSAL: dict[type[Refusal], str] = {
    Unauthenticated: "unauthenticated",
    PermissionDenied: "permission_denied",
    InvalidArgument: "invalid_argument",
    Overloaded: "overloaded",
    Unavailable: "error",
    TryAgain: "unavailable",
    DeadlinePassed: "deadline_exceeded",
}

# A call without a deadline reports one centuries away.
_NO_DEADLINE = 365 * 24 * 3600.0

Response = TypeVar("Response")


class AuthMetrics:
    """
    The metrics svc-auth publishes about its gRPC methods.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.validateToken = Histogram(
            "svc_auth_validate_token_duration_seconds",
            "Time to answer ValidateToken, by result",
            ["result"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.validateAgent = Histogram(
            "svc_auth_validate_agent_duration_seconds",
            "Time to answer ValidateAgent, by result",
            ["result"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "svc_auth_grpc_requests_total",
            "gRPC requests answered, by method and status code",
            ["method", "code"],
            registry=registry,
        )
        self.refused = Counter(
            "svc_auth_grpc_refused_total",
            "gRPC calls refused before their work: past a bound on calls at once "
            "(peer, total; answered RESOURCE_EXHAUSTED) or past their deadline (deadline)",
            ["reason"],
            registry=registry,
        )
        self.usageRowsRejected = Counter(
            "svc_auth_usage_rows_rejected_total",
            "Usage rows RecordUsage did not record and never will, by reason: invalid (a"
            " value the ledger cannot hold) or conflict (its key is recorded with other"
            " content)",
            ["reason"],
            registry=registry,
        )
        self._children = Children()

    def answered(self, method: str, code: str) -> None:
        """
        Count one answered call of C{method} with status C{code}.
        """
        self._children.of(self.requests, method, code).inc()

    def observe(self, duration: Histogram, result: str, seconds: float) -> None:
        """
        Record C{seconds} in the C{result} series of C{duration}.
        """
        self._children.of(duration, result).observe(seconds)


class RejectedRowsLog:
    """
    Counts the usage rows RecordUsage rejects in
    svc_auth_usage_rows_rejected_total{reason} and logs them, at most one
    warning per C{interval} per reason, with the count since the last line
    and the ids of the latest row (its ledger and organization ids, the
    reason and the detail; never anything else of the row). A proxy sets
    rejected rows aside for good, so each one is money an operator should
    look at; the throttle keeps a flood of them from flooding the log.

    Called from grpcio's threads: the bookkeeping holds a lock.

    @param clock: monotonic seconds.
    """

    log = Logger()

    def __init__(
        self, counter: Counter, clock: Callable[[], float] = time.monotonic, interval: float = 60.0
    ) -> None:
        self._counter = counter
        self._clock = clock
        self._interval = interval
        self._children = Children()
        self._lock = threading.Lock()
        self._lastLogged: dict[str, float] = {}
        self._unlogged: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        for reason in REJECT_REASONS:
            # Present from the start at 0, so that rate() sees the first one.
            self._children.of(counter, reason)

    def rejected(self, rows: Sequence[RejectedRow]) -> None:
        """
        Count C{rows}; log the latest of each reason unless a line for that
        reason was logged in the last interval.
        """
        latest: dict[str, RejectedRow] = {}
        counts: dict[str, int] = {}
        for row in rows:
            self._children.of(self._counter, row.reason).inc()
            latest[row.reason] = row
            counts[row.reason] = counts.get(row.reason, 0) + 1
        now = self._clock()
        for reason, row in latest.items():
            with self._lock:
                self._unlogged[reason] += counts[reason]
                last = self._lastLogged.get(reason)
                if last is not None and now - last < self._interval:
                    continue
                self._lastLogged[reason] = now
                count, self._unlogged[reason] = self._unlogged[reason], 0
            self.log.warn(
                "Rejected {rejected} usage row(s) as {reason} (see"
                " svc_auth_usage_rows_rejected_total); the latest: ledger id {ledger_id} of"
                " organization {org_id}: {detail}",
                rejected=count,
                reason=reason,
                ledger_id=row.ledgerID,
                org_id=row.orgID,
                detail=row.detail,
            )


def _deadlineOf(context: grpc.ServicerContext) -> float | None:
    """
    The call's deadline in time.monotonic() seconds, or None.
    """
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE:
        return None
    return time.monotonic() + float(remaining)


def _bearer(context: grpc.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata():
        if key == "authorization":
            return str(value)
    return None


def _tokenInfo(record: TokenRecord) -> auth_pb2.TokenInfo:
    return auth_pb2.TokenInfo(
        token_id=str(record.tokenID),
        org_id=str(record.orgID),
        name=record.name or "",
        agent_id=str(record.agentID) if record.agentID else "",
        user_id=str(record.userID) if record.userID else "",
        permissions=record.permissions,
        expires_at=rfc3339(record.expiresAt) if record.expiresAt else "",
        revoked=record.revokedAt is not None,
        created_at=rfc3339(record.createdAt),
    )


class AuthServicer(auth_pb2_grpc.AuthServiceServicer):
    """
    Maps L{Authority}'s answers and refusals to gRPC messages and status
    codes (spec 4.3, decisions D4 and D6).
    """

    log = Logger()

    def __init__(
        self,
        authority: Authority,
        metrics: AuthMetrics,
        hub: ChangeHub | None = None,
        snapshots: Snapshots | None = None,
        limits: LimitsTable | None = None,
        budgets: BudgetsTable | None = None,
        memorySettings: MemorySettingsTable | None = None,
    ) -> None:
        self._authority = authority
        self._metrics = metrics
        self._hub = hub
        self._snapshots = snapshots
        self._limits = limits
        self._budgets = budgets
        self._memorySettings = memorySettings
        self._refusals = RefusalLog(metrics.refused)
        self._rejectedRows = RejectedRowsLog(metrics.usageRowsRejected)
        self._durations = {
            "ValidateToken": metrics.validateToken,
            "ValidateAgent": metrics.validateAgent,
        }

    @property
    def metrics(self) -> AuthMetrics:
        return self._metrics

    def endChangeFeeds(self) -> int:
        """
        svc-auth is stopping: end every change feed stream now and refuse
        new ones (L{ChangeHub.stop}); how many were ended.
        """
        if self._hub is None:
            return 0
        return self._hub.stop()

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """
        AuthService's method handlers, by method name, as grpcio's generated
        C{add_AuthServiceServicer_to_server} makes them, except that each
        takes the request's bytes and parses them itself (see the module
        docstring). A method with a stream of responses gets a stream
        handler; one with a stream of requests is not supported.
        """
        handlers = {}
        for method in auth_pb2.DESCRIPTOR.services_by_name["AuthService"].methods:
            if method.client_streaming:
                raise NotImplementedError(f"{method.name}: a stream of requests")
            requestType = getattr(auth_pb2, method.input_type.name)
            responseType = getattr(auth_pb2, method.output_type.name)
            behaviour = self._parsing(method.name, requestType, getattr(self, method.name))
            handlerOf = grpc.unary_unary_rpc_method_handler
            if method.server_streaming:
                handlerOf = grpc.unary_stream_rpc_method_handler
                behaviour = _streaming(behaviour)
            handlers[method.name] = handlerOf(
                behaviour,
                request_deserializer=None,
                response_serializer=responseType.SerializeToString,
            )
        return handlers

    def _parsing(
        self,
        method: str,
        requestType: type[Message],
        behaviour: Callable[[Any, grpc.ServicerContext], Any],
    ) -> Callable[[bytes, grpc.ServicerContext], Any]:
        def parsed(raw: bytes, context: grpc.ServicerContext) -> Any:
            try:
                request = requestType.FromString(raw)
            except DecodeError:
                refusal = _unparsable(method, requestType.DESCRIPTOR, raw)

                def refuse() -> None:
                    raise refusal

                return self._answer(method, context, refuse, self._durations.get(method))
            return behaviour(request, context)

        return parsed

    def _answer(
        self,
        method: str,
        context: grpc.ServicerContext,
        work: Callable[[], Response],
        duration: Histogram | None = None,
    ) -> Response:
        started = time.perf_counter()
        result, code = "ok", grpc.StatusCode.OK
        try:
            return work()
        except Refusal as refusal:
            result = _RESULT_OF_REFUSAL[type(refusal)]
            code = _STATUS_OF_REFUSAL[type(refusal)]
            if isinstance(refusal, DeadlinePassed):
                self._refusals.refused(DEADLINE, method=method)
            context.abort(code, str(refusal))
            raise AssertionError("context.abort returned") from None
        except Exception:
            result, code = "error", grpc.StatusCode.INTERNAL
            self.log.failure("Unexpected failure in {method}", method=method)
            context.abort(code, "internal error")
            raise AssertionError("context.abort returned") from None
        finally:
            if duration is not None:
                self._metrics.observe(duration, result, time.perf_counter() - started)
            self._metrics.answered(method, code.name)

    def ValidateToken(
        self, request: auth_pb2.ValidateTokenRequest, context: grpc.ServicerContext
    ) -> auth_pb2.ValidateTokenResponse:
        def validate() -> auth_pb2.ValidateTokenResponse:
            deadline = _deadlineOf(context)
            caller = self._authority.validateToken(request.access_token, deadline)
            answer = auth_pb2.ValidateTokenResponse(
                org_id=str(caller.orgID),
                permissions=caller.permissions,
                agent_id=str(caller.agentID) if caller.agentID else "",
                user_id=str(caller.userID) if caller.userID else "",
                token_id=str(caller.tokenID),
                expires_at=rfc3339(caller.expiresAt) if caller.expiresAt else "",
            )
            limits = self._authority.limitsOf(caller.orgID, None, deadline)
            if limits is not None:
                answer.org_limits.CopyFrom(limitsMessage(limits))
            budget = self._authority.budgetOf(caller.orgID, None, deadline)
            if budget is not None:
                answer.org_budget.CopyFrom(budgetMessage(budget))
            settings = self._authority.memorySettingsOf(caller.orgID, None, deadline)
            if settings is not None:
                answer.org_memory_settings.CopyFrom(memorySettingsMessage(settings))
            return answer

        return self._answer("ValidateToken", context, validate, self._metrics.validateToken)

    def ValidateAgent(
        self, request: auth_pb2.ValidateAgentRequest, context: grpc.ServicerContext
    ) -> auth_pb2.ValidateAgentResponse:
        def validate() -> auth_pb2.ValidateAgentResponse:
            deadline = _deadlineOf(context)
            status = self._authority.validateAgent(
                _requireBearer(context), request.agent_id, request.org_id, deadline
            )
            answer = auth_pb2.ValidateAgentResponse(
                agent_id=request.agent_id, org_id=request.org_id, status=status
            )
            # Both parsed already by validateAgent, which refuses otherwise.
            orgID, agentID = parseUUID(request.org_id), parseUUID(request.agent_id)
            if orgID is None or agentID is None:
                raise InvalidArgument("org_id or agent_id is not a UUID")
            limits = self._authority.limitsOf(orgID, agentID, deadline)
            if limits is not None:
                answer.agent_limits.CopyFrom(limitsMessage(limits))
            budget = self._authority.budgetOf(orgID, agentID, deadline)
            if budget is not None:
                answer.agent_budget.CopyFrom(budgetMessage(budget))
            settings = self._authority.memorySettingsOf(orgID, agentID, deadline)
            if settings is not None:
                answer.agent_memory_settings.CopyFrom(memorySettingsMessage(settings))
            return answer

        return self._answer("ValidateAgent", context, validate, self._metrics.validateAgent)

    def CreateToken(
        self, request: auth_pb2.CreateTokenRequest, context: grpc.ServicerContext
    ) -> auth_pb2.CreateTokenResponse:
        def create() -> auth_pb2.CreateTokenResponse:
            token, record = self._authority.createToken(
                _requireBearer(context),
                name=request.name,
                permissions=request.permissions,
                agentIDText=request.agent_id,
                expiresInSeconds=request.expires_in_seconds,
                deadline=_deadlineOf(context),
            )
            return auth_pb2.CreateTokenResponse(token=token, info=_tokenInfo(record))

        return self._answer("CreateToken", context, create)

    def RevokeToken(
        self, request: auth_pb2.RevokeTokenRequest, context: grpc.ServicerContext
    ) -> auth_pb2.RevokeTokenResponse:
        def revoke() -> auth_pb2.RevokeTokenResponse:
            record = self._authority.revokeToken(
                _requireBearer(context), request.token_id, _deadlineOf(context)
            )
            return auth_pb2.RevokeTokenResponse(token_id=str(record.tokenID), revoked=True)

        return self._answer("RevokeToken", context, revoke)

    def ListTokens(
        self, request: auth_pb2.ListTokensRequest, context: grpc.ServicerContext
    ) -> auth_pb2.ListTokensResponse:
        def listing() -> auth_pb2.ListTokensResponse:
            records = self._authority.listTokens(_requireBearer(context), _deadlineOf(context))
            return auth_pb2.ListTokensResponse(tokens=[_tokenInfo(each) for each in records])

        return self._answer("ListTokens", context, listing)

    def RecordUsage(
        self, request: auth_pb2.RecordUsageRequest, context: grpc.ServicerContext
    ) -> auth_pb2.RecordUsageResponse:
        """
        Record a batch of usage rows (decisions D12 and D12 amended): each
        row is checked on its own, the good ones go in one transaction,
        and the answer comes only after its commit, counting the rows
        recorded now and the duplicates and listing the rows rejected
        (invalid, or a conflict), which the proxy sets aside. A batch bad
        as a whole (past MAXIMUM_USAGE_BATCH rows) is INVALID_ARGUMENT. A
        failing database is UNAVAILABLE, so the proxy keeps the rows and
        sends them again.
        """

        def record() -> auth_pb2.RecordUsageResponse:
            try:
                batch = checkBatch(request.rows)
            except BadUsage as error:
                raise InvalidArgument(str(error)) from None
            recorded, duplicates, rejected = self._authority.recordUsage(
                batch, _deadlineOf(context)
            )
            if rejected:
                self._rejectedRows.rejected(rejected)
            return auth_pb2.RecordUsageResponse(
                recorded=recorded,
                duplicates=duplicates,
                rejected=[
                    auth_pb2.RejectedUsageRow(
                        index=each.index, reason=each.reason, detail=each.detail
                    )
                    for each in rejected
                ],
            )

        return self._answer("RecordUsage", context, record)

    def GetSpend(
        self, request: auth_pb2.GetSpendRequest, context: grpc.ServicerContext
    ) -> auth_pb2.GetSpendResponse:
        """
        What an organization or agent spent in a span (decisions D12). The
        ledger's sum is exact and may pass int64 (issue 28, item 8); the
        answer is then the largest int64, which is safe: a budget is at
        most 9 * 10^15 nano-dollars (svcctl's ceiling), a thousandth of
        that, so a spend so large is past every budget either way, and the
        proxy refuses exactly as it would with the exact sum.
        """

        def spend() -> auth_pb2.GetSpendResponse:
            cost = self._authority.spend(
                request.org_id,
                request.agent_id,
                request.since_unix,
                request.until_unix,
                _deadlineOf(context),
            )
            return auth_pb2.GetSpendResponse(cost_nano_usd=clampInt64(cost))

        return self._answer("GetSpend", context, spend)

    def GetUsage(
        self, request: auth_pb2.GetUsageRequest, context: grpc.ServicerContext
    ) -> auth_pb2.GetUsageResponse:
        def usage() -> auth_pb2.GetUsageResponse:
            orgID, since, until, by, sums = self._authority.usage(
                _requireBearer(context),
                request.agent_id,
                request.since,
                request.until,
                request.by,
                _deadlineOf(context),
            )
            return auth_pb2.GetUsageResponse(
                org_id=str(orgID),
                since=formatMoment(since),
                until=formatMoment(until),
                by=by,
                rows=[usageSum(each) for each in sums],
                total=usageSum(totalOf(sums)),
            )

        return self._answer("GetUsage", context, usage)

    def WatchChanges(
        self, request: auth_pb2.WatchChangesRequest, context: grpc.ServicerContext
    ) -> Iterator[auth_pb2.Change]:
        """
        The change feed of decisions D8 (see L{svcd.auth.feed}): a snapshot
        of the token ids that may be accepted, of every limits row, of
        every budget and of every memory settings row, then
        every change and a heartbeat about every 100 ms, until the client
        goes away or the listener loses PostgreSQL (UNAVAILABLE: start
        over).
        """
        hub, snapshots = self._hub, self._snapshots
        if hub is None or snapshots is None:
            self._metrics.answered("WatchChanges", "UNIMPLEMENTED")
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server has no change feed")
            return
        try:
            stream = hub.open()
        except FeedUnavailable as refusal:
            self._metrics.answered("WatchChanges", "UNAVAILABLE")
            context.abort(grpc.StatusCode.UNAVAILABLE, str(refusal))
            return
        except TooManyStreams as refusal:
            self._metrics.answered("WatchChanges", "RESOURCE_EXHAUSTED")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refusal))
            return
        code = grpc.StatusCode.CANCELLED
        self.log.info("Change feed stream opened for {peer}", peer=context.peer())
        try:
            try:
                ids = snapshots.since(stream.openedAt)
            except StoreUnavailable as error:
                self.log.warn("Change feed snapshot failed: {problem}", problem=str(error))
                code = grpc.StatusCode.UNAVAILABLE
                context.abort(code, "database unavailable")
                return
            # Like the ids, read after the stream was registered (see
            # L{svcd.auth.feed}); the table is current while the hub serves.
            limits = self._limits.rows() if self._limits is not None else ()
            budgets = self._budgets.rows() if self._budgets is not None else ()
            settings = self._memorySettings.rows() if self._memorySettings is not None else ()
            yield from snapshotMessages(ids, limits, budgets, settings)
            while context.is_active():
                change = stream.next(timeout=0.5)
                if change is None:
                    continue
                if isinstance(change, FeedEnded):
                    code = grpc.StatusCode.UNAVAILABLE
                    context.abort(code, change.reason)
                    return
                yield change
        finally:
            hub.close(stream)
            self._metrics.answered("WatchChanges", code.name)
            self.log.info("Change feed stream closed for {peer}", peer=context.peer())


def _streaming(
    behaviour: Callable[[bytes, grpc.ServicerContext], Any],
) -> Callable[[bytes, grpc.ServicerContext], Iterator[Any]]:
    """
    C{behaviour} as a generator of responses, whether it refuses the
    request at once (raising) or returns the method's own generator.
    """

    def streamed(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from behaviour(raw, context)

    return streamed


def _requireBearer(context: grpc.ServicerContext) -> str:
    return bearerFromMetadata(_bearer(context))


def _unparsable(method: str, descriptor: Any, raw: bytes) -> Refusal:
    """
    The refusal of a request that protobuf cannot parse: a malformed token
    for ValidateToken's access_token (spec 4.3), else InvalidArgument
    naming the string field whose bytes are not UTF-8, or the message when
    the wire format itself is broken.
    """
    field = _undecodableField(descriptor, raw)
    if method == "ValidateToken" and field == "access_token":
        return Unauthenticated("malformed token")
    if field is not None:
        return InvalidArgument(f"{field} is not valid UTF-8")
    return InvalidArgument(f"the request is not a valid {descriptor.name}")


def _undecodableField(descriptor: Any, raw: bytes) -> str | None:
    """
    The name of the first string field of C{raw} (the wire format of a
    flat C{descriptor} message, as AuthService's requests are) whose bytes
    are not UTF-8 (a lone surrogate among them), or None.
    """
    position = 0
    try:
        while position < len(raw):
            key, position = _varint(raw, position)
            number, wireType = key >> 3, key & 7
            if wireType == 0:
                _, position = _varint(raw, position)
            elif wireType == 1:
                position += 8
            elif wireType == 5:
                position += 4
            elif wireType == 2:
                length, position = _varint(raw, position)
                value = raw[position : position + length]
                position += length
                field = descriptor.fields_by_number.get(number)
                if field is not None and field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        return str(field.name)
            else:
                return None
    except IndexError:
        return None
    return None


def _varint(raw: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift >= 70:
            raise IndexError("varint too long")


class GrpcServerService(HostedGrpcServer):
    """
    svc-auth's gRPC server as a twistd service (L{HostedGrpcServer}). A
    stop also ends the change feed streams at once: they never end by
    themselves, and would hold the stop for the whole grace. On a proxy's
    connection the end of its stream thus follows the GOAWAY, so the calls
    it makes while its feed is down, and its next feed, go to another
    replica (or fail closed at once with none), never to this one, whose
    pending calls a stop cancels.
    """

    serviceName = SERVICE_NAME
    label = "AuthService"
    carries = "tokens"

    def __init__(
        self,
        reactor: IReactorThreads,
        servicer: AuthServicer,
        host: str,
        port: int,
        bounds: Bounds,
        gracePeriod: float,
        tls: ServerTLS | None = None,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
    ) -> None:
        super().__init__(reactor, host, port, gracePeriod, tls)
        self._servicer = servicer
        self._bounds = bounds
        self._interceptors = tuple(interceptors)

    def build(self, port: int) -> tuple[grpc.Server, health.HealthServicer, int]:
        return buildServer(
            self._servicer, self._host, port, self._bounds, self._tls, self._interceptors
        )

    def stopping(self) -> None:
        ended = self._servicer.endChangeFeeds()
        if ended:
            self.log.info("Ended {count} change feed stream(s): svc-auth is stopping", count=ended)


def buildServer(
    servicer: AuthServicer,
    host: str,
    port: int,
    bounds: Bounds,
    tls: ServerTLS | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """
    A grpcio server (L{buildGrpcServer}), bound but not started, serving
    AuthService, the standard health service and server reflection;
    returns it with its health servicer and the bound port (useful when
    C{port} is 0). Calls are admitted by L{AdmissionInterceptor} within
    C{bounds}.

    @raise GrpcBindError: when the address cannot be bound.
    """
    return buildGrpcServer(
        SERVICE_NAME,
        servicer.handlers(),
        host,
        port,
        threads=bounds.threads,
        streamsPerConnection=bounds.streamsPerConnection,
        admission=AdmissionInterceptor(
            bounds,
            RefusalLog(servicer.metrics.refused),
            answered=servicer.metrics.answered,
            countedService=SERVICE_NAME,
        ),
        threadNamePrefix="svc-auth-grpc",
        tls=tls,
        interceptors=interceptors,
    )
