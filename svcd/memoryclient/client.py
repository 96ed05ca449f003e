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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from opentelemetry import trace
from twisted.internet.defer import Deferred, DeferredSemaphore, TimeoutError, fail
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime
from twisted.logger import Logger

from svcd.common.grpcdefer import deferredFromFuture
from svcd.common.grpcspin import HeldCall, holdChannelThread
from svcd.common.tracing import traceMetadata
from svcd.memoryclient.errors import MemoryUnavailable, failureOf
from svcd.memoryclient.records import Embedding, Scope
from svcd.pb.memory.v1 import memory_pb2

_SERVICE = "/svc.memory.v1.MemoryService/"

# How long a call may take, unless the caller says otherwise: a search of a
# scope not yet cached loads it from PostgreSQL first.
DEFAULT_TIMEOUT = 2.0


def _released(result: Any, slots: DeferredSemaphore) -> Any:
    """
    Give a call's slot back once it has ended, however it ended.
    """
    slots.release()
    return result


def scopeMessage(scope: Scope) -> memory_pb2.Scope:
    return memory_pb2.Scope(
        org_id=_idText(scope.orgID), agent_id=_idText(scope.agentID), subject=scope.subject
    )


# An organization's or agent's id in its text form, remembered: a proxy
# sends the same few with every recall's search.
_idText = functools.lru_cache(maxsize=4096)(str)


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
    # Built by one constructor: each field set afterwards is a call into
    # protobuf of its own, on every recall.
    if query is None:
        if minScore is None:
            return memory_pb2.SearchRequest(scope=scopeMessage(scope), k=k, mode=mode, text=text)
        return memory_pb2.SearchRequest(
            scope=scopeMessage(scope), k=k, mode=mode, text=text, min_score=minScore
        )
    embedding = memory_pb2.Embedding(model=query.model, vector=query.vector)
    if minScore is None:
        return memory_pb2.SearchRequest(
            scope=scopeMessage(scope), query=embedding, k=k, mode=mode, text=text
        )
    return memory_pb2.SearchRequest(
        scope=scopeMessage(scope), query=embedding, k=k, mode=mode, text=text, min_score=minScore
    )


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
    @param holdThread: keep grpcio's channel thread running between calls
        (L{svcd.common.grpcspin}): a quiet proxy's recall would otherwise
        start it again for its one Search, and wait for it.
    """

    log = Logger()

    def __init__(
        self,
        channelFactory: Callable[[], Any],
        reactor: IReactorFromThreads,
        timeout: float = DEFAULT_TIMEOUT,
        maxInFlight: int | None = None,
        clock: IReactorTime | None = None,
        holdThread: bool = True,
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
        self._holdThread = holdThread
        self._held: HeldCall | None = None

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
        held, self._held = self._held, None
        if held is not None:
            held.release()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _connect(self) -> None:
        if self._closed:
            raise RuntimeError("the client of svc-memory is closed")
        if self._channel is not None:
            return
        channel = self._channel = self._channelFactory()
        if self._holdThread:
            self._held = holdChannelThread(channel)
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
        slots = self._slots
        if slots is None:
            return self._send(name, request, deadline)
        turn = slots.acquire()
        if turn.called:
            # A slot was free: the call goes now, as without a bound (no
            # coroutine to wait in), and gives its slot back when it ends.
            try:
                sent = self._send(name, request, deadline)
            except Exception:
                slots.release()
                return fail()
            return sent.addBoth(_released, slots)
        return Deferred.fromCoroutine(self._inTurn(name, request, deadline, slots, turn))

    async def _inTurn(
        self,
        name: str,
        request: Any,
        deadline: float,
        slots: DeferredSemaphore,
        turn: Deferred[DeferredSemaphore],
    ) -> Any:
        """
        Send the call once its C{turn} for a slot comes, with what is left
        of its deadline. The span's context is the caller's still: a
        coroutine runs in the context it was made in.
        """
        assert self._clock is not None
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
