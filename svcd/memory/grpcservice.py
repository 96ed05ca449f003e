"""
The gRPC face of svc-memory: the svc.memory.v1.MemoryService servicer,
with the standard health service and server reflection, hosted by a twistd
service so that the gRPC server starts and stops with the reactor.

Built as svc-auth's is (L{svcd.auth.grpcservice}): grpcio runs the
methods in its own thread pool, where the blocking work belongs (the
database, a scope's load on a cache miss, the search's product, which
releases the GIL); calls are admitted within L{svcd.auth.admission}'s
bounds (at once and per client connection, refused RESOURCE_EXHAUSTED
past them, never queued); requests are parsed here, so that one protobuf
cannot parse (a string that is not UTF-8) is INVALID_ARGUMENT rather than
grpcio's INTERNAL with a traceback. The server is built and hosted as
every daemon's (L{svcd.common.grpcserver}).

A write (add, a new content, a delete) through a replica that caches the
scope is answered only once its change is in that cache
(L{svcd.memory.search.Searcher.settle}): a caller reads its own writes;
other replicas follow within a second.

Nothing here logs a memory's content or an observation's messages.
"""

from __future__ import annotations

import datetime
import functools
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from twisted.internet.interfaces import IReactorThreads
from twisted.logger import Logger

from svcd.common.errors import rfc3339
from svcd.common.grpcadmission import AdmissionInterceptor, Bounds, RefusalLog
from svcd.common.grpcserver import HostedGrpcServer, ServerTLS, buildGrpcServer
from svcd.common.metrics import BUCKETS, Children
from svcd.memory.client import MAX_SEARCHES_PER_CALL
from svcd.memory.extracted import RECENT_WINDOW, OtherScope, Plan
from svcd.memory.records import (
    FORBIDDEN_DETAILS,
    FORGOTTEN_DETAILS,
    MAX_REASON_CHARACTERS,
    OTHER_LENGTH,
    Embedding,
    InvalidMemory,
    NewObservation,
    Scope,
    checkContent,
    checkEmbedding,
    checkEndedAt,
    checkMetadata,
    checkObservedMessages,
    checkQuery,
    checkRequestID,
    checkScope,
    checkSource,
    checkUUID,
)
from svcd.memory.search import MODES, TEXT, VECTOR, Searcher
from svcd.memory.store import (
    MemoryForbidden,
    MemoryNotFound,
    MemoryStore,
    ObservationForgotten,
    ObservationRelease,
    ScopeFull,
    StoreRejected,
    StoreUnavailable,
    StoreValueRefused,
)
from svcd.memory.vectors import CacheMetrics
from svcd.memory.wire import memoryMessage, searchAnswer, searchManyAnswer
from svcd.pb.memory.v1 import memory_pb2

SERVICE_NAME = "svc.memory.v1.MemoryService"
METHODS = tuple(
    method.name for method in memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].methods
)

# The details of FAILED_PRECONDITION for a full scope (409 MEMORY_FULL).
SCOPE_FULL = "memory scope is full"
DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
MAX_K = 100
# The most characters of a text or hybrid search's query (a recall's query
# is a message's first 8,000).
MAX_QUERY_CHARACTERS = 8000
MAX_OBSERVATIONS_PER_CALL = 500
MAX_CLAIM = 100
MAX_LEASE_SECONDS = 3600.0
MAX_RETRY_AFTER_SECONDS = 86_400.0
# svc-worker stores at most this many memories of one observation
# (decisions D13: an extraction answers at most 20).
MAX_STORED_PER_OBSERVATION = 20

Response = TypeVar("Response")


class MemoryMetrics:
    """
    What svc-memory publishes (docs/operations.rst, "Metrics").
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "svc_memory_grpc_requests_total",
            "MemoryService calls answered, by method and status code",
            ["method", "code"],
            registry=registry,
        )
        self.refused = Counter(
            "svc_memory_grpc_refused_total",
            "gRPC calls refused before their work: past a bound on calls at once (peer,"
            " total; answered RESOURCE_EXHAUSTED) or past their deadline (deadline)",
            ["reason"],
            registry=registry,
        )
        self.searchSeconds = Histogram(
            "svc_memory_search_duration_seconds",
            "Time of one Search, by whether what it ranked by was cached (hit) or"
            " loaded from PostgreSQL first (miss), and by mode (vector, text, hybrid)",
            ["cache", "mode"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.cacheBytes = Gauge(
            "svc_memory_cache_bytes",
            "Bytes the replica's cache holds: vectors, ids and times, and text indexes",
            registry=registry,
        )
        self.cacheTextBytes = Gauge(
            "svc_memory_cache_text_bytes",
            "Of svc_memory_cache_bytes, the bytes of text indexes (scopes searched in text"
            " or hybrid mode)",
            registry=registry,
        )
        self.cacheScopes = Gauge(
            "svc_memory_cache_scopes", "Scopes the replica's cache holds", registry=registry
        )
        self.cacheHits = Counter(
            "svc_memory_cache_hits_total", "Searches of a cached scope", registry=registry
        )
        self.cacheMisses = Counter(
            "svc_memory_cache_misses_total",
            "Searches whose scope was loaded from PostgreSQL",
            registry=registry,
        )
        self.cacheEvictions = Counter(
            "svc_memory_cache_evictions_total",
            "Scopes dropped from the cache to stay within SVC_MEMORY_CACHE_MB",
            registry=registry,
        )
        self.recordCacheBytes = Gauge(
            "svc_memory_record_cache_bytes",
            "Bytes of memories' records (content, metadata, ...) the replica's cache of"
            " records holds",
            registry=registry,
        )
        self.recordCacheScopes = Gauge(
            "svc_memory_record_cache_scopes",
            "Scopes whose records the replica's cache of records holds",
            registry=registry,
        )
        self.recordCacheHits = Counter(
            "svc_memory_record_cache_hits_total",
            "Searches whose hits' records were in the cache of records",
            registry=registry,
        )
        self.recordCacheMisses = Counter(
            "svc_memory_record_cache_misses_total",
            "Searches whose scope's records were not in the cache of records (loaded from"
            " PostgreSQL, or the hits read by id)",
            registry=registry,
        )
        self.recordCacheEvictions = Counter(
            "svc_memory_record_cache_evictions_total",
            "Scopes' records dropped to stay within SVC_MEMORY_RECORD_CACHE_MB",
            registry=registry,
        )
        self.observationsWaiting = Gauge(
            "svc_memory_observations_waiting",
            "Observations waiting for svc-worker, over every organization",
            registry=registry,
        )
        self.internalDenied = Counter(
            "svc_memory_internal_calls_denied_total",
            "Calls answered PERMISSION_DENIED because the client certificate is not named"
            " in SVC_GRPC_INTERNAL_SUBJECTS (the worker's methods: SVC_GRPC_WORKER_SUBJECTS)",
            ["method"],
            registry=registry,
        )
        self.queryDuration = Histogram(
            "svc_db_query_duration_seconds",
            "Time of one database transaction, by operation",
            ["operation"],
            buckets=BUCKETS,
            registry=registry,
        )
        self._children = Children()

    def answered(self, method: str, code: str) -> None:
        self._children.of(self.requests, method, code).inc()

    def cacheMetrics(self) -> CacheMetrics:
        def size(total: int, scopes: int) -> None:
            self.cacheBytes.set(total)
            self.cacheScopes.set(scopes)

        return CacheMetrics(
            hit=self.cacheHits.inc,
            miss=self.cacheMisses.inc,
            evicted=self.cacheEvictions.inc,
            size=size,
            textSize=self.cacheTextBytes.set,
        )

    def recordCacheMetrics(self) -> CacheMetrics:
        def size(total: int, scopes: int) -> None:
            self.recordCacheBytes.set(total)
            self.recordCacheScopes.set(scopes)

        return CacheMetrics(
            hit=self.recordCacheHits.inc,
            miss=self.recordCacheMisses.inc,
            evicted=self.recordCacheEvictions.inc,
            size=size,
        )


class _Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


def _scope(message: memory_pb2.Scope) -> Scope:
    return _checkedScope(message.org_id, message.agent_id, message.subject)


@functools.lru_cache(maxsize=4096)
def _checkedScope(orgID: str, agentID: str, subject: str) -> Scope:
    """
    L{checkScope}, remembered: a replica serves the same scopes over and
    over, and parsing two UUIDs and a subject was a tenth of a cached
    search's time. A refusal raises, and is not remembered.
    """
    return checkScope(orgID, agentID, subject)


def _embedding(request: Message, field: str) -> Any:
    if not request.HasField(field):
        raise InvalidMemory(field, "is required")
    embedding = getattr(request, field)
    return checkEmbedding(embedding.model, embedding.vector)


def _bounded(field: str, value: float, lowest: float, highest: float) -> float:
    if not lowest <= value <= highest:
        raise InvalidMemory(field, f"must be from {lowest:g} to {highest:g}")
    return value


def _owner(owner: str) -> str:
    if not 1 <= len(owner) <= 200 or not owner.isprintable():
        raise InvalidMemory("owner", "must be 1 to 200 printable characters")
    return owner


# The methods whose answers are written as bytes (svcd.memory.wire).
_ENCODED_ANSWERS = frozenset({"Search", "SearchMany"})
# The methods given the call's context too (its deadline).
_WITH_CONTEXT = frozenset({"SearchMany"})


class MemoryServicer:
    """
    Maps requests to L{MemoryStore} and L{Searcher}, and their refusals to
    status codes (see memory.proto).

    @param maxPerScope: SVC_MEMORY_MAX_PER_SCOPE.
    @param maxWaitingPerOrg: SVC_MEMORY_MAX_WAITING_PER_ORG (None: no
        bound).
    """

    log = Logger()

    def __init__(
        self,
        store: MemoryStore,
        searcher: Searcher,
        metrics: MemoryMetrics,
        maxPerScope: int,
        maxWaitingPerOrg: int | None = None,
    ) -> None:
        self._store = store
        self._searcher = searcher
        self.metrics = metrics
        self._maxPerScope = maxPerScope
        self._maxWaitingPerOrg = maxWaitingPerOrg

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """
        MemoryService's unary handlers by method name, each parsing the
        request's bytes itself; those of L{_ENCODED_ANSWERS} answer bytes
        they wrote, the others a message grpcio serializes.
        """
        handlers = {}
        for method in memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].methods:
            requestType = getattr(memory_pb2, method.input_type.name)
            responseType = getattr(memory_pb2, method.output_type.name)
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                self._handler(method.name, requestType, getattr(self, method.name)),
                request_deserializer=None,
                response_serializer=None
                if method.name in _ENCODED_ANSWERS
                else responseType.SerializeToString,
            )
        return handlers

    def _handler(
        self,
        method: str,
        requestType: type[Message],
        work: Callable[..., Message | bytes],
    ) -> Callable[[bytes, grpc.ServicerContext], Message | bytes]:
        def answer(raw: bytes, context: grpc.ServicerContext) -> Message | bytes:
            code = grpc.StatusCode.OK
            try:
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    raise _Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
                try:
                    request = requestType.FromString(raw)
                except DecodeError:
                    raise _Refusal(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request is not a valid {requestType.DESCRIPTOR.name}"
                        " (broken wire format, or a string that is not UTF-8)",
                    ) from None
                if method in _WITH_CONTEXT:
                    return work(request, context)
                return work(request)
            except Exception as error:
                code, details = self._statusOf(method, error)
            finally:
                self.metrics.answered(method, code.name)
            context.abort(code, details)
            raise AssertionError("context.abort returned")

        return answer

    def _statusOf(self, method: str, error: Exception) -> tuple[grpc.StatusCode, str]:
        """
        The status and details a method's failure is answered with (see
        memory.proto); an unexpected one is logged, with its traceback.
        """
        if isinstance(error, _Refusal):
            return error.code, str(error)
        if isinstance(error, InvalidMemory):
            return grpc.StatusCode.INVALID_ARGUMENT, str(error)
        if isinstance(error, ObservationForgotten):
            return grpc.StatusCode.NOT_FOUND, FORGOTTEN_DETAILS
        if isinstance(error, MemoryNotFound):
            return grpc.StatusCode.NOT_FOUND, "no such id"
        if isinstance(error, MemoryForbidden):
            return grpc.StatusCode.PERMISSION_DENIED, FORBIDDEN_DETAILS
        if isinstance(error, ScopeFull):
            return grpc.StatusCode.FAILED_PRECONDITION, SCOPE_FULL
        if isinstance(error, StoreRejected):
            return grpc.StatusCode.INVALID_ARGUMENT, "agent_id: not an agent of the organization"
        if isinstance(error, StoreValueRefused):
            return grpc.StatusCode.INVALID_ARGUMENT, str(error)
        if isinstance(error, StoreUnavailable):
            self.log.warn("{method} failed: {problem}", method=method, problem=str(error))
            return grpc.StatusCode.UNAVAILABLE, "database unavailable"
        self.log.failure("Unexpected failure in {method}", method=method)
        return grpc.StatusCode.INTERNAL, "internal error"

    # Memories.

    def AddMemory(self, request: memory_pb2.AddMemoryRequest) -> memory_pb2.Memory:
        scope = _scope(request.scope)
        content = checkContent(request.content)
        metadata = checkMetadata(request.metadata_json)
        source = checkSource(request.source or "api")
        sourceRequestID = checkRequestID("source_request_id", request.source_request_id, False)
        embedding = _embedding(request, "embedding")
        record = self._store.add(
            scope, content, metadata, source, sourceRequestID, embedding, self._maxPerScope
        )
        self._searcher.settle(scope)
        return memoryMessage(record)

    def GetMemory(self, request: memory_pb2.GetMemoryRequest) -> memory_pb2.Memory:
        scope = _scope(request.scope)
        return memoryMessage(self._store.get(scope, checkUUID("id", request.id)))

    def ListMemories(
        self, request: memory_pb2.ListMemoriesRequest
    ) -> memory_pb2.ListMemoriesResponse:
        scope = _scope(request.scope)
        limit = request.limit or DEFAULT_LIST_LIMIT
        _bounded("limit", limit, 1, MAX_LIST_LIMIT)
        after = checkUUID("after", request.after) if request.after else None
        records, more = self._store.listMemories(scope, int(limit), after)
        return memory_pb2.ListMemoriesResponse(
            memories=[memoryMessage(each) for each in records], has_more=more
        )

    def UpdateMemory(self, request: memory_pb2.UpdateMemoryRequest) -> memory_pb2.Memory:
        scope = _scope(request.scope)
        memoryID = checkUUID("id", request.id)
        content = metadata = embedding = None
        if request.HasField("content"):
            content = checkContent(request.content)
            embedding = _embedding(request, "embedding")
        elif request.HasField("embedding"):
            raise InvalidMemory("embedding", "is given only with a new content")
        if request.HasField("metadata_json"):
            metadata = checkMetadata(request.metadata_json)
        if content is None and metadata is None:
            raise InvalidMemory("content", "nothing to change: give content or metadata_json")
        record = self._store.update(scope, memoryID, content, metadata, embedding)
        # Even for metadata alone: the cache of records holds it.
        self._searcher.settle(scope)
        return memoryMessage(record)

    def DeleteMemory(
        self, request: memory_pb2.DeleteMemoryRequest
    ) -> memory_pb2.DeleteMemoryResponse:
        scope = _scope(request.scope)
        memoryID = checkUUID("id", request.id)
        self._store.delete(scope, memoryID)
        self._searcher.settle(scope)
        return memory_pb2.DeleteMemoryResponse(id=str(memoryID))

    def DeleteScope(self, request: memory_pb2.DeleteScopeRequest) -> memory_pb2.DeleteScopeResponse:
        scope = _scope(request.scope)
        memories, observations = self._store.deleteScope(scope)
        self._searcher.settle(scope)
        return memory_pb2.DeleteScopeResponse(
            memories_deleted=memories, observations_deleted=observations
        )

    def Search(self, request: memory_pb2.SearchRequest) -> bytes:
        """
        Answered as a SearchResponse's bytes (L{searchAnswer}): the hits'
        cached encodings copied into it, with no message built.
        """
        scope = _scope(request.scope)
        mode = request.mode or VECTOR
        if mode not in MODES:
            raise InvalidMemory("mode", "must be one of " + ", ".join(MODES))
        query = None
        if mode != TEXT:
            if not request.HasField("query"):
                raise InvalidMemory("query", "is required")
            query = checkQuery(request.query.model, request.query.vector)
        if mode != VECTOR and not 1 <= len(request.text) <= MAX_QUERY_CHARACTERS:
            raise InvalidMemory(
                "text", f"must be 1 to {MAX_QUERY_CHARACTERS:,} characters in {mode} mode"
            )
        k = int(_bounded("k", request.k, 1, MAX_K))
        minScore = None
        if request.HasField("min_score"):
            minScore = _bounded("min_score", request.min_score, -1.0, 1.0)
        return searchAnswer(self._searcher.search(scope, query, k, minScore, mode, request.text))

    def SearchMany(
        self, request: memory_pb2.SearchManyRequest, context: grpc.ServicerContext | None = None
    ) -> bytes:
        """
        Each search as L{Search} answers it, in turn on this thread: a
        search's refusal (or failure) is its outcome's status, logged as
        Search's would be, and the others go on. Each search is counted as
        a Search call of its outcome's status besides the SearchMany call
        itself, so that a database down shows as Search's UNAVAILABLE
        however the searches came. Once the call's deadline has passed
        (scopes loaded from PostgreSQL one after another), the searches not
        made yet are answered DEADLINE_EXCEEDED, so that those made still
        reach the caller. Answered as bytes (L{searchManyAnswer}).
        """
        if not 1 <= len(request.searches) <= MAX_SEARCHES_PER_CALL:
            raise InvalidMemory("searches", f"must hold 1 to {MAX_SEARCHES_PER_CALL} searches")
        outcomes: list[tuple[int, bytes | str]] = []
        for search in request.searches:
            code = grpc.StatusCode.OK
            try:
                remaining = context.time_remaining() if context is not None else None
                if remaining is not None and remaining <= 0:
                    raise _Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
                outcomes.append((0, self.Search(search)))
            except Exception as error:
                code, details = self._statusOf("SearchMany", error)
                outcomes.append((code.value[0], details))
            finally:
                self.metrics.answered("Search", code.name)
        return searchManyAnswer(outcomes)

    # Observations.

    def QueueObservations(
        self, request: memory_pb2.QueueObservationsRequest
    ) -> memory_pb2.QueueObservationsResponse:
        if not 1 <= len(request.observations) <= MAX_OBSERVATIONS_PER_CALL:
            raise InvalidMemory(
                "observations", f"must hold 1 to {MAX_OBSERVATIONS_PER_CALL} observations"
            )
        batch = []
        for index, observation in enumerate(request.observations):
            try:
                requestID = checkRequestID("request_id", observation.request_id, True)
                assert requestID is not None
                # A proxy of an earlier release sends no key: its request
                # id is the key, as it was then.
                key = checkRequestID("key", observation.key, False) or requestID
                batch.append(
                    NewObservation(
                        _scope(observation.scope),
                        requestID,
                        checkObservedMessages(
                            [(each.role, each.content) for each in observation.messages]
                        ),
                        key,
                        checkEndedAt(observation.ended_at),
                    )
                )
            except InvalidMemory as invalid:
                raise InvalidMemory(
                    f"observations[{index}].{invalid.field}", invalid.problem
                ) from None
        queued = self._store.queueObservations(batch, self._maxWaitingPerOrg)
        return memory_pb2.QueueObservationsResponse(
            queued=[
                memory_pb2.QueuedObservation(
                    request_id=each.requestID,
                    org_id=str(asked.scope.orgID),
                    id=str(each.observationID) if each.observationID is not None else "",
                    queued_now=each.queuedNow,
                    key=each.key,
                    refused=each.refused,
                )
                for asked, each in zip(batch, queued, strict=True)
            ]
        )

    def ClaimObservations(
        self, request: memory_pb2.ClaimObservationsRequest
    ) -> memory_pb2.ClaimObservationsResponse:
        owner = _owner(request.owner)
        limit = int(_bounded("limit", request.limit, 1, MAX_CLAIM))
        lease = _bounded("lease_seconds", request.lease_seconds, 1.0, MAX_LEASE_SECONDS)
        claimed = self._store.claimObservations(owner, lease, limit)
        return memory_pb2.ClaimObservationsResponse(
            observations=[
                memory_pb2.ClaimedObservation(
                    id=str(each.observationID),
                    scope=memory_pb2.Scope(
                        org_id=str(each.scope.orgID),
                        agent_id=str(each.scope.agentID),
                        subject=each.scope.subject,
                    ),
                    request_id=each.requestID,
                    messages=[
                        memory_pb2.ObservedMessage(role=message.role, content=message.content)
                        for message in each.messages
                    ],
                    attempts=each.attempts,
                    lease_expires_at=rfc3339(each.leaseExpiresAt),
                    lease_token=str(each.leaseToken) if each.leaseToken else "",
                )
                for each in claimed
            ]
        )

    def CompleteObservation(
        self, request: memory_pb2.CompleteObservationRequest
    ) -> memory_pb2.CompleteObservationResponse:
        orgID, observationID = _observation(request.org_id, request.id)
        completed = self._store.completeObservation(
            orgID, observationID, _owner(request.owner), _leaseToken(request.lease_token, False)
        )
        return memory_pb2.CompleteObservationResponse(completed=completed)

    def ReleaseObservation(
        self, request: memory_pb2.ReleaseObservationRequest
    ) -> memory_pb2.ReleaseObservationResponse:
        orgID, observationID = _observation(request.org_id, request.id)
        if len(request.reason) > MAX_REASON_CHARACTERS:
            raise InvalidMemory("reason", f"must be at most {MAX_REASON_CHARACTERS} characters")
        release = ObservationRelease(
            retryAfter=_bounded(
                "retry_after_seconds", request.retry_after_seconds, 0.0, MAX_RETRY_AFTER_SECONDS
            ),
            countAttempt=request.count_attempt,
            failed=request.failed,
            reason=request.reason,
        )
        released = self._store.releaseObservation(
            orgID,
            observationID,
            _owner(request.owner),
            release,
            _leaseToken(request.lease_token, False),
        )
        return memory_pb2.ReleaseObservationResponse(released=released)

    def RenewObservationLease(
        self, request: memory_pb2.RenewObservationLeaseRequest
    ) -> memory_pb2.RenewObservationLeaseResponse:
        orgID, observationID = _observation(request.org_id, request.id)
        owner = _owner(request.owner)
        token = _leaseToken(request.lease_token, True)
        assert token is not None
        lease = _bounded("lease_seconds", request.lease_seconds, 1.0, MAX_LEASE_SECONDS)
        expiresAt = self._store.renewObservationLease(orgID, observationID, owner, token, lease)
        if expiresAt is None:
            return memory_pb2.RenewObservationLeaseResponse(renewed=False)
        return memory_pb2.RenewObservationLeaseResponse(
            renewed=True, lease_expires_at=rfc3339(expiresAt)
        )

    def StoreObservation(
        self, request: memory_pb2.StoreObservationRequest
    ) -> memory_pb2.StoreObservationResponse:
        """
        svc-worker's last step for one observation (memory.proto): one call
        where it made one or two per memory and one more, each a gRPC round
        trip on both sides (bench/worker_drain.py measured the drain's
        rate bounded by them).

        The memories are written into the observation's own scope, whatever
        the call names (decisions D13, amended): a call naming another
        agent or subject is planned again for the observation's, and
        logged (ids only). The cache's nearest memories are asked first;
        the plan is finished, and its updates, additions and the
        observation's completion made, in one transaction under the scope's
        lock (L{MemoryStore.storeExtracted}, L{svcd.memory.extracted}): the
        same fact in two observations stored at once is one memory, and a
        memory deleted meanwhile is not written back. The cache is settled
        once, after.

        C{lease_seconds} is checked but no longer renews the lease: the
        transaction holds the observation's row, and nothing is written
        for a claim that lost it.
        """
        orgID, observationID = _observation(request.org_id, request.id)
        owner = _owner(request.owner)
        token = _leaseToken(request.lease_token, True)
        assert token is not None
        _bounded("lease_seconds", request.lease_seconds, 1.0, MAX_LEASE_SECONDS)
        scope = _scope(request.scope)
        if scope.orgID != orgID:
            raise InvalidMemory("scope.org_id", "must be org_id")
        requestID = checkRequestID("request_id", request.request_id, True)
        assert requestID is not None
        if len(request.memories) > MAX_STORED_PER_OBSERVATION:
            raise InvalidMemory(
                "memories", f"must hold at most {MAX_STORED_PER_OBSERVATION} memories"
            )
        dedupeScore = _bounded("dedupe_score", request.dedupe_score, -1.0, 1.0)
        memories = []
        for index, each in enumerate(request.memories):
            try:
                memories.append((checkContent(each.content), _embedding(each, "embedding")))
            except InvalidMemory as invalid:
                raise InvalidMemory(f"memories[{index}].{invalid.field}", invalid.problem) from None
            if memories[index][1].dimensions != memories[0][1].dimensions:
                # One provider's answer: one length (its planning compares them).
                raise InvalidMemory(f"memories[{index}].embedding", OTHER_LENGTH)
        # The observation's scope never changes: a second round always
        # finds it.
        for _ in range(2):
            plan = self._plan(scope, memories, dedupeScore)
            try:
                stored = self._store.storeExtracted(
                    orgID, observationID, owner, token, scope, requestID, plan, self._maxPerScope
                )
                break
            except OtherScope as other:
                self.log.warn(
                    "StoreObservation for observation {observation_id} of organization"
                    " {org_id} named another agent or subject than the observation's;"
                    " its memories go to the observation's agent {agent_id}",
                    observation_id=str(observationID),
                    org_id=str(orgID),
                    agent_id=str(other.scope.agentID),
                )
                scope = other.scope
        else:
            raise StoreUnavailable("the observation's scope changed twice")
        if stored is None:
            return memory_pb2.StoreObservationResponse(stored=False)
        if stored.added or stored.updated:
            self._searcher.settle(scope)
        return memory_pb2.StoreObservationResponse(
            stored=True,
            added_ids=[str(each.memoryID) for each in stored.added],
            updated=stored.updated,
        )

    def _plan(
        self, scope: Scope, memories: Sequence[tuple[str, Embedding]], dedupeScore: float
    ) -> Plan:
        """
        The memories with this replica's nearest of each in C{scope}
        (L{Searcher.nearest}), asked now, before any lock; the scope's
        writes since L{RECENT_WINDOW} before now are read under it.
        """
        since = datetime.datetime.now(datetime.UTC) - RECENT_WINDOW
        return Plan(
            memories,
            dedupeScore,
            lambda embedding: self._searcher.nearest(scope, embedding, dedupeScore),
            since,
        )


def _observation(orgText: str, idText: str) -> tuple[uuid.UUID, uuid.UUID]:
    return checkUUID("org_id", orgText), checkUUID("id", idText)


def _leaseToken(text: str, required: bool) -> uuid.UUID | None:
    """
    A claim's lease token; empty is None (any claim of the owner) where
    it is not C{required}: workers from before tokens name none.
    """
    if not text and not required:
        return None
    return checkUUID("lease_token", text)


class MemoryGrpcService(HostedGrpcServer):
    """
    svc-memory's gRPC server as a twistd service (L{HostedGrpcServer}).
    """

    serviceName = SERVICE_NAME
    label = "MemoryService"
    carries = "memories"

    def __init__(
        self,
        reactor: IReactorThreads,
        servicer: MemoryServicer,
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


def buildServer(
    servicer: MemoryServicer,
    host: str,
    port: int,
    bounds: Bounds,
    tls: ServerTLS | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """
    A grpcio server (L{buildGrpcServer}), bound but not started, serving
    MemoryService, health and reflection; with its health servicer and
    bound port. Admitted as svc-auth's (L{svcd.auth.grpcservice.buildServer}).

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
        threadNamePrefix="svc-memory-grpc",
        tls=tls,
        interceptors=interceptors,
        # A batch of observations (500 of up to 64 messages of 16 KiB) may
        # exceed grpcio's default of 4 MiB.
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
    )
