"""
The client of svc-memory for svc-proxy and svc-worker (decisions D13):
every MemoryService method as a Deferred, over one shared channel.

As the proxy's client of svc-auth (L{svcd.proxy.validation.client}):
grpcio's future API bridged to the reactor with C{callFromThread}
(L{svcd.common.grpcdefer.deferredFromFuture}), never a thread held per
call; a deadline on every call, given to grpcio itself (C{timeout=}), so
that it ends on time whatever the reactor does; cancelling a Deferred
cancels its call. The channel is made by a factory at the first call (or
L{MemoryClient.start}), never before twistd forks, and carries the
current span's trace context.

Refusals come back as L{MemoryCallFailed} subclasses, one per status of
memory.proto, so that the proxy maps each to its HTTP answer (D13): 404,
403, 409 MEMORY_FULL, 400, and 503 SERVICE_DEGRADED for anything that is
no answer (unreachable, deadline, overloaded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import grpc
from opentelemetry import trace
from twisted.internet.defer import (
    Deferred,
    DeferredList,
    DeferredSemaphore,
    TimeoutError,
    fail,
    succeed,
)
from twisted.internet.interfaces import IDelayedCall, IReactorFromThreads, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from svcd.common.coalesce import Coalescer
from svcd.common.deferreds import fireUnlessCalled
from svcd.common.grpcdefer import deferredFromFuture
from svcd.common.tracing import traceMetadata
from svcd.memory.records import FORBIDDEN_DETAILS, Embedding, Scope
from svcd.pb.memory.v1 import memory_pb2

_SERVICE = "/svc.memory.v1.MemoryService/"

# How long a call may take, unless the caller says otherwise: a search of a
# scope not yet cached loads it from PostgreSQL first.
DEFAULT_TIMEOUT = 2.0

# As the proxy's channel to svc-auth: reconnect within a second of
# svc-memory's return, notice a dead host between calls, and fail a call
# made while the channel is down at once (no wait_for_ready).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)

T = TypeVar("T")

# The most searches of one SearchMany (svc-memory refuses more).
MAX_SEARCHES_PER_CALL = 64


class MemoryCallFailed(Exception):
    """
    A call to svc-memory did not answer OK; C{code} is its gRPC status
    (None for a failure without one) and C{details} the server's words.
    """

    def __init__(self, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"{code.name if code else 'no status'}: {details}")
        self.code = code
        self.details = details


class MemoryNotFound(MemoryCallFailed):
    """
    No memory (or observation) has this id (404).
    """


class MemoryForbidden(MemoryCallFailed):
    """
    The id is another organization's, agent's or subject's (403).
    """


class MemoryFull(MemoryCallFailed):
    """
    The scope holds SVC_MEMORY_MAX_PER_SCOPE memories (409 MEMORY_FULL).
    """


class MemoryInvalid(MemoryCallFailed):
    """
    A value svc-memory refused; C{details} names the field (400).
    """


class MemoryUnavailable(MemoryCallFailed):
    """
    No answer: unreachable, past the deadline, overloaded, or its database
    down, or this client's certificate not admitted as an internal caller
    (503 SERVICE_DEGRADED: the deployment's fault, never the caller's).
    """


_FAILURES: dict[grpc.StatusCode, type[MemoryCallFailed]] = {
    grpc.StatusCode.NOT_FOUND: MemoryNotFound,
    grpc.StatusCode.PERMISSION_DENIED: MemoryForbidden,
    grpc.StatusCode.FAILED_PRECONDITION: MemoryFull,
    grpc.StatusCode.INVALID_ARGUMENT: MemoryInvalid,
}


def failureOf(error: BaseException) -> MemoryCallFailed:
    """
    The L{MemoryCallFailed} of a failed call's exception.
    """
    if isinstance(error, grpc.Call):
        return refusalOf(error.code(), error.details() or "")
    return MemoryUnavailable(None, type(error).__name__)


def refusalOf(code: grpc.StatusCode, details: str) -> MemoryCallFailed:
    """
    The L{MemoryCallFailed} of a status and its details.
    """
    if code is grpc.StatusCode.PERMISSION_DENIED and details != FORBIDDEN_DETAILS:
        # svc-memory did not admit this client's certificate
        # (SVC_GRPC_INTERNAL_SUBJECTS): no memory was refused.
        return MemoryUnavailable(code, details)
    return _FAILURES.get(code, MemoryUnavailable)(code, details)


@attrs.frozen
class ClientTLS:
    """
    TLS of the channel to svc-memory: the CA that signed its certificate
    and, for mutual TLS, this client's certificate and key (PEM).
    """

    rootCertificates: bytes | None
    certificateChain: bytes | None = None
    privateKey: bytes | None = attrs.field(default=None, repr=False)


def memoryChannel(address: str, tls: ClientTLS | None = None) -> Any:
    """
    A channel to svc-memory at C{address} (a target grpcio accepts, such
    as C{host:port} or C{ipv4:a:port,b:port}): plaintext without C{tls}.
    """
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.rootCertificates,
        private_key=tls.privateKey,
        certificate_chain=tls.certificateChain,
    )
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def scopeMessage(scope: Scope) -> memory_pb2.Scope:
    return memory_pb2.Scope(
        org_id=str(scope.orgID), agent_id=str(scope.agentID), subject=scope.subject
    )


def embeddingMessage(embedding: Embedding) -> memory_pb2.Embedding:
    return memory_pb2.Embedding(model=embedding.model, vector=embedding.vector)


def searchRequest(
    scope: Scope,
    query: Embedding | None,
    k: int,
    minScore: float | None,
    mode: str,
    text: str,
) -> memory_pb2.SearchRequest:
    """
    A Search's request, as L{MemoryClient.search} and L{SearchBatches}
    send it (see L{MemoryClient.search} for the arguments).
    """
    request = memory_pb2.SearchRequest(scope=scopeMessage(scope), k=k, mode=mode, text=text)
    if query is not None:
        request.query.CopyFrom(embeddingMessage(query))
    if minScore is not None:
        request.min_score = minScore
    return request


class MemoryClient:
    """
    MemoryService's methods as Deferreds; each fails with a
    L{MemoryCallFailed}, or L{twisted.internet.defer.CancelledError} when
    its caller cancelled it.

    @param channelFactory: makes the one channel (L{memoryChannel}), at
        the first call or L{start}.
    @param timeout: each call's deadline in seconds, unless the call names
        its own.
    @param maxInFlight: at most this many calls at once; the others wait
        their turn here, within their own deadline (what they waited is
        taken from it), and fail L{MemoryUnavailable} when none comes in
        time. svc-memory refuses a connection's calls past its
        C{SVC_GRPC_MAX_CALLS_PER_PEER} (16 by default) at once, so a busy
        proxy that sent them all would be refused rather than served a
        moment later. None: no bound here. Needs C{clock}.
    @param clock: measures the wait for a turn (the reactor).
    """

    log = Logger()

    def __init__(
        self,
        channelFactory: Callable[[], Any],
        reactor: IReactorFromThreads,
        timeout: float = DEFAULT_TIMEOUT,
        maxInFlight: int | None = None,
        clock: IReactorTime | None = None,
    ) -> None:
        if maxInFlight is not None and clock is None:
            raise ValueError("a bound on calls in flight needs a clock")
        self._channelFactory = channelFactory
        self._reactor = reactor
        self._timeout = timeout
        self._slots = DeferredSemaphore(maxInFlight) if maxInFlight is not None else None
        self._clock = clock
        self._channel: Any = None
        self._methods: dict[str, Any] = {}
        self._closed = False

    def start(self) -> None:
        """
        Make the channel now and ask it to connect, so that the first call
        does not pay for the handshakes.
        """
        self._connect()
        grpc.channel_ready_future(self._channel)

    def close(self) -> None:
        """
        Close the channel; calls in flight end CANCELLED.
        """
        self._closed = True
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _connect(self) -> None:
        if self._closed:
            raise RuntimeError("the client of svc-memory is closed")
        if self._channel is not None:
            return
        channel = self._channel = self._channelFactory()
        service = memory_pb2.DESCRIPTOR.services_by_name["MemoryService"]
        for method in service.methods:
            requestType = getattr(memory_pb2, method.input_type.name)
            responseType = getattr(memory_pb2, method.output_type.name)
            self._methods[method.name] = channel.unary_unary(
                _SERVICE + method.name,
                request_serializer=requestType.SerializeToString,
                response_deserializer=responseType.FromString,
                _registered_method=True,
            )

    @property
    def timeout(self) -> float:
        """
        A call's deadline in seconds when it names none.
        """
        return self._timeout

    def call(self, name: str, request: Any, timeout: float | None = None) -> Deferred[Any]:
        """
        Call the method C{name} with C{request}, within C{timeout} seconds
        (the client's by default).
        """
        return self._call(name, request, timeout)

    def _call(self, name: str, request: Any, timeout: float | None = None) -> Deferred[Any]:
        deadline = self._timeout if timeout is None else timeout
        if self._slots is None:
            return self._send(name, request, deadline)
        return Deferred.fromCoroutine(self._inTurn(name, request, deadline, self._slots))

    async def _inTurn(
        self, name: str, request: Any, deadline: float, slots: DeferredSemaphore
    ) -> Any:
        """
        Send the call once a slot is free, with what is left of its
        deadline. The span's context is the caller's still: a coroutine runs
        in the context it was made in.
        """
        assert self._clock is not None
        turn = slots.acquire()
        if not turn.called:
            began = self._clock.seconds()
            turn.addTimeout(deadline, self._clock)
            try:
                await turn
            except TimeoutError:
                raise MemoryUnavailable(
                    None, f"no turn for a call to svc-memory within {deadline}s"
                ) from None
            deadline -= self._clock.seconds() - began
        try:
            return await self._send(name, request, deadline)
        finally:
            slots.release()

    def _send(self, name: str, request: Any, timeout: float) -> Deferred[Any]:
        try:
            self._connect()
        except RuntimeError as error:
            return fail(MemoryUnavailable(None, str(error)))
        spanContext = trace.get_current_span().get_span_context()
        metadata = traceMetadata(spanContext) if spanContext.is_valid else None
        future = self._methods[name].future(request, timeout=timeout, metadata=metadata)
        called: Deferred[Any] = deferredFromFuture(self._reactor, future)

        def failed(failure: Any) -> Any:
            if isinstance(failure.value, grpc.RpcError):
                raise failureOf(failure.value)
            return failure

        return called.addErrback(failed)

    # Memories.

    def addMemory(
        self,
        scope: Scope,
        content: str,
        embedding: Embedding,
        metadataJSON: str = "",
        source: str = "api",
        sourceRequestID: str = "",
    ) -> Deferred[memory_pb2.Memory]:
        return self._call(
            "AddMemory",
            memory_pb2.AddMemoryRequest(
                scope=scopeMessage(scope),
                content=content,
                metadata_json=metadataJSON,
                source=source,
                source_request_id=sourceRequestID,
                embedding=embeddingMessage(embedding),
            ),
        )

    def getMemory(self, scope: Scope, memoryID: str) -> Deferred[memory_pb2.Memory]:
        return self._call(
            "GetMemory", memory_pb2.GetMemoryRequest(scope=scopeMessage(scope), id=memoryID)
        )

    def listMemories(
        self, scope: Scope, limit: int = 20, after: str = ""
    ) -> Deferred[memory_pb2.ListMemoriesResponse]:
        return self._call(
            "ListMemories",
            memory_pb2.ListMemoriesRequest(scope=scopeMessage(scope), limit=limit, after=after),
        )

    def updateMemory(
        self,
        scope: Scope,
        memoryID: str,
        content: str | None = None,
        metadataJSON: str | None = None,
        embedding: Embedding | None = None,
    ) -> Deferred[memory_pb2.Memory]:
        request = memory_pb2.UpdateMemoryRequest(scope=scopeMessage(scope), id=memoryID)
        if content is not None:
            request.content = content
        if metadataJSON is not None:
            request.metadata_json = metadataJSON
        if embedding is not None:
            request.embedding.CopyFrom(embeddingMessage(embedding))
        return self._call("UpdateMemory", request)

    def deleteMemory(
        self, scope: Scope, memoryID: str
    ) -> Deferred[memory_pb2.DeleteMemoryResponse]:
        return self._call(
            "DeleteMemory", memory_pb2.DeleteMemoryRequest(scope=scopeMessage(scope), id=memoryID)
        )

    def deleteScope(self, scope: Scope) -> Deferred[memory_pb2.DeleteScopeResponse]:
        return self._call("DeleteScope", memory_pb2.DeleteScopeRequest(scope=scopeMessage(scope)))

    def search(
        self,
        scope: Scope,
        query: Embedding | None,
        k: int,
        minScore: float | None = None,
        timeout: float | None = None,
        mode: str = "vector",
        text: str = "",
    ) -> Deferred[memory_pb2.SearchResponse]:
        """
        @param query: the query embedded; None in C{"text"} mode, which
            needs none.
        @param timeout: this call's deadline (context assembly has a short
            one of its own, decisions D13).
        @param mode: C{"vector"}, C{"text"} or C{"hybrid"} (decisions D13,
            "Hybrid search"); C{text}, the query's text, is what the last
            two rank by.
        """
        return self._call("Search", searchRequest(scope, query, k, minScore, mode, text), timeout)

    # Observations.

    def queueObservations(
        self, observations: Sequence[memory_pb2.Observation]
    ) -> Deferred[memory_pb2.QueueObservationsResponse]:
        """
        Queue observations; fires once svc-memory has committed them (and
        may be sent again: each is queued once per key, its request id
        when it has none).
        """
        return self._call(
            "QueueObservations", memory_pb2.QueueObservationsRequest(observations=observations)
        )

    def claimObservations(
        self, owner: str, limit: int, leaseSeconds: float
    ) -> Deferred[memory_pb2.ClaimObservationsResponse]:
        return self._call(
            "ClaimObservations",
            memory_pb2.ClaimObservationsRequest(
                owner=owner, limit=limit, lease_seconds=leaseSeconds
            ),
        )

    def completeObservation(
        self, orgID: str, observationID: str, owner: str, leaseToken: str = ""
    ) -> Deferred[memory_pb2.CompleteObservationResponse]:
        return self._call(
            "CompleteObservation",
            memory_pb2.CompleteObservationRequest(
                org_id=orgID, id=observationID, owner=owner, lease_token=leaseToken
            ),
        )

    def storeObservation(
        self,
        orgID: str,
        observationID: str,
        owner: str,
        leaseToken: str,
        leaseSeconds: float,
        scope: Scope,
        requestID: str,
        memories: Sequence[tuple[str, Embedding]],
        dedupeScore: float,
    ) -> Deferred[memory_pb2.StoreObservationResponse]:
        """
        Merge an observation's memories into its scope and complete it, in
        one call (memory.proto's StoreObservation).
        """
        return self._call(
            "StoreObservation",
            memory_pb2.StoreObservationRequest(
                org_id=orgID,
                id=observationID,
                owner=owner,
                lease_token=leaseToken,
                lease_seconds=leaseSeconds,
                scope=scopeMessage(scope),
                request_id=requestID,
                memories=[
                    memory_pb2.ExtractedMemory(
                        content=content, embedding=embeddingMessage(embedding)
                    )
                    for content, embedding in memories
                ],
                dedupe_score=dedupeScore,
            ),
        )

    def renewObservationLease(
        self, orgID: str, observationID: str, owner: str, leaseToken: str, leaseSeconds: float
    ) -> Deferred[memory_pb2.RenewObservationLeaseResponse]:
        return self._call(
            "RenewObservationLease",
            memory_pb2.RenewObservationLeaseRequest(
                org_id=orgID,
                id=observationID,
                owner=owner,
                lease_token=leaseToken,
                lease_seconds=leaseSeconds,
            ),
        )

    def releaseObservation(
        self,
        orgID: str,
        observationID: str,
        owner: str,
        retryAfter: float,
        countAttempt: bool,
        failed: bool = False,
        reason: str = "",
        leaseToken: str = "",
    ) -> Deferred[memory_pb2.ReleaseObservationResponse]:
        return self._call(
            "ReleaseObservation",
            memory_pb2.ReleaseObservationRequest(
                org_id=orgID,
                id=observationID,
                owner=owner,
                retry_after_seconds=retryAfter,
                count_attempt=countAttempt,
                failed=failed,
                reason=reason,
                lease_token=leaseToken,
            ),
        )


@attrs.define(eq=False)
class _Waiting:
    """
    A search of L{SearchBatches}: its request, when its deadline passes
    (on the clock's time), its caller's Deferred, while it is held the
    timer that fails it at its deadline, and once sent, its call and the
    searches that share it.
    """

    # The query's text and vector: never in a repr.
    request: memory_pb2.SearchRequest = attrs.field(repr=False)
    deadline: float
    result: Deferred[memory_pb2.SearchResponse] = attrs.field(init=False)
    timer: IDelayedCall | None = None
    call: Deferred[Any] | None = None
    batch: Sequence[_Waiting] = ()

    def stopTimer(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None and timer.active():
            timer.cancel()


class SearchBatches:
    """
    A client's searches coalesced by organization (L{svcd.common.coalesce}):
    a search of an organization with fewer than C{maxInFlight} searches in
    flight is sent at once, alone, as L{MemoryClient.search} sends it;
    those that come while it has that many are sent together when one
    ends, up to C{maxBatch} in one SearchMany. A quiet proxy's recall waits
    for nothing; a busy one's share a call's cost (its creation and
    grpcio's hand-offs in this process, svc-memory's handling of a call),
    which is more CPU than the search itself. Organizations never share a
    call, so that one's slow search (a scope loaded from PostgreSQL) holds
    back no other's.

    What a search waits for its turn counts in its own deadline: one whose
    deadline passes while it waits fails L{MemoryUnavailable} then, unsent,
    and one sent has what is left (a SearchMany has its latest search's).
    Cancelling a search's Deferred fails it at once with
    L{twisted.internet.defer.CancelledError}; its call goes on for the
    others that share it, and is cancelled when none is left waiting.

    An svc-memory of an earlier release answers SearchMany UNIMPLEMENTED:
    that batch's searches are then sent again one call each, as is every
    later batch until C{retryBatchesAfter} seconds have passed (a rolling
    upgrade).

    @param client: what sends the calls.
    @param clock: the deadlines' time (the reactor).
    @param maxInFlight: an organization's calls in flight before its
        searches wait to share one (C{SVC_MEMORY_RECALL_CALLS}).
    @param maxBatch: the most searches of one call (svc-memory takes
        L{MAX_SEARCHES_PER_CALL}).
    """

    log = Logger()

    def __init__(
        self,
        client: MemoryClient,
        clock: IReactorTime,
        maxInFlight: int = 1,
        maxBatch: int = MAX_SEARCHES_PER_CALL,
        retryBatchesAfter: float = 60.0,
    ) -> None:
        if not 1 <= maxBatch <= MAX_SEARCHES_PER_CALL:
            raise ValueError(f"a batch holds 1 to {MAX_SEARCHES_PER_CALL} searches")
        self._client = client
        self._clock = clock
        self._retryBatchesAfter = retryBatchesAfter
        self._batchesRefusedAt: float | None = None
        self._coalescer: Coalescer[str, _Waiting] = Coalescer(self._send, maxBatch, maxInFlight)

    def search(
        self,
        scope: Scope,
        query: Embedding | None,
        k: int,
        minScore: float | None = None,
        timeout: float | None = None,
        mode: str = "vector",
        text: str = "",
    ) -> Deferred[memory_pb2.SearchResponse]:
        """
        As L{MemoryClient.search}.
        """
        seconds = self._client.timeout if timeout is None else timeout
        waiting = _Waiting(
            searchRequest(scope, query, k, minScore, mode, text), self._clock.seconds() + seconds
        )
        waiting.result = Deferred(lambda _: self._cancelled(waiting))
        self._coalescer.submit(waiting.request.scope.org_id, waiting)
        if waiting.call is None and not waiting.result.called:
            # Held: it fails at its deadline if its turn has not come.
            waiting.timer = self._clock.callLater(seconds, self._expired, waiting)
        return waiting.result

    def _expired(self, waiting: _Waiting) -> None:
        waiting.timer = None
        if self._coalescer.withdraw(waiting.request.scope.org_id, waiting):
            waiting.result.errback(_pastItsDeadline())

    def _cancelled(self, waiting: _Waiting) -> None:
        # Deferred.cancel fails the search's Deferred with CancelledError
        # after this. Still held: it is not sent. Sent: its call goes on
        # for the others, and ends when none is left.
        waiting.stopTimer()
        if waiting.call is None:
            self._coalescer.withdraw(waiting.request.scope.org_id, waiting)
        elif all(each is waiting or each.result.called for each in waiting.batch):
            waiting.call.cancel()

    def _send(self, _: str, batch: list[_Waiting]) -> Deferred[Any]:
        now = self._clock.seconds()
        due = []
        for waiting in batch:
            waiting.stopTimer()
            if waiting.deadline > now:
                due.append(waiting)
            else:
                waiting.result.errback(_pastItsDeadline())
        if not due:
            return succeed(None)
        return self._sendDue(due, now).addBoth(_forget, due)

    def _sendDue(self, due: list[_Waiting], now: float) -> Deferred[Any]:
        if len(due) == 1:
            return self._sendAlone(due[0], now)
        refused = self._batchesRefusedAt
        if refused is not None and now - refused < self._retryBatchesAfter:
            return self._eachAlone(due, now)
        called: Deferred[Any] = self._client.call(
            "SearchMany",
            memory_pb2.SearchManyRequest(searches=[each.request for each in due]),
            max(each.deadline for each in due) - now,
        )
        for waiting in due:
            waiting.call, waiting.batch = called, due
        return called.addCallbacks(
            self._answered, self._failed, callbackArgs=(due,), errbackArgs=(due,)
        )

    def _sendAlone(self, waiting: _Waiting, now: float) -> Deferred[Any]:
        called: Deferred[Any] = self._client.call(
            "Search", waiting.request, max(waiting.deadline - now, _LEAST_SECONDS)
        )
        waiting.call, waiting.batch = called, (waiting,)
        return called.addBoth(fireUnlessCalled, waiting.result)

    def _eachAlone(self, batch: Sequence[_Waiting], now: float) -> Deferred[Any]:
        sent = []
        for waiting in batch:
            if waiting.result.called:
                continue
            if waiting.deadline <= now:
                waiting.result.errback(_pastItsDeadline())
            else:
                sent.append(self._sendAlone(waiting, now))
        return DeferredList(sent)

    def _answered(self, answer: memory_pb2.SearchManyResponse, batch: list[_Waiting]) -> None:
        for index, waiting in enumerate(batch):
            if waiting.result.called:
                continue
            if index >= len(answer.outcomes):
                waiting.result.errback(MemoryUnavailable(None, "SearchMany answered too few"))
                continue
            outcome = answer.outcomes[index]
            if outcome.code == 0:
                waiting.result.callback(outcome.response)
            else:
                code = _CODES.get(outcome.code, grpc.StatusCode.UNKNOWN)
                waiting.result.errback(refusalOf(code, outcome.details))

    def _failed(self, failure: Failure, batch: list[_Waiting]) -> Deferred[Any] | None:
        error = failure.value
        if isinstance(error, MemoryCallFailed) and error.code is grpc.StatusCode.UNIMPLEMENTED:
            # An svc-memory of an earlier release: each alone, now and for
            # a while. The next batch waits for these.
            now = self._clock.seconds()
            self._batchesRefusedAt = now
            self.log.info("svc-memory answers no SearchMany: searches go one call each for now")
            return self._eachAlone(batch, now)
        for waiting in batch:
            if not waiting.result.called:
                waiting.result.errback(failure)
        return None


def _forget(result: object, batch: Sequence[_Waiting]) -> object:
    """
    Cut the references between a call's searches and the call, once it
    has ended: a search refers to its call and its batch (which holds it),
    and without this every recall would leave a cycle for the collector.
    """
    for waiting in batch:
        waiting.call, waiting.batch = None, ()
    return result


def _pastItsDeadline() -> MemoryUnavailable:
    """
    The failure of a search whose deadline passed while it waited for its
    turn: DEADLINE_EXCEEDED, as grpcio's own deadline would end it.
    """
    return MemoryUnavailable(
        grpc.StatusCode.DEADLINE_EXCEEDED, "the search's deadline passed before its turn"
    )


# The shortest deadline a search that waited its turn is sent with.
_LEAST_SECONDS = 0.001


_CODES = {code.value[0]: code for code in grpc.StatusCode}
