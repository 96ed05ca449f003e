"""
MemoryService's methods on memories (memory.proto): add, read, list,
change and delete a scope's memories, and search them, one search or many
in a call. They are a part of L{svcd.memory.grpcservice.MemoryServicer},
which sets what they use.
"""

from __future__ import annotations

import grpc
from twisted.logger import Logger

from svcd.memory.grpcrequests import Refusal, bounded, embeddingOf, scopeOf, statusOf
from svcd.memory.metrics import MemoryMetrics
from svcd.memory.records import (
    checkContent,
    checkMetadata,
    checkQuery,
    checkRequestID,
    checkSource,
    checkUUID,
)
from svcd.memory.search import MODES, TEXT, VECTOR, Searcher
from svcd.memory.store import MemoryStore
from svcd.memory.wire import memoryMessage, searchAnswer, searchManyAnswer
from svcd.memoryclient.records import MAX_SEARCHES_PER_CALL, InvalidMemory
from svcd.pb.memory.v1 import memory_pb2

DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100
MAX_K = 100
# The most characters of a text or hybrid search's query (a recall's query
# is a message's first 8,000).
MAX_QUERY_CHARACTERS = 8000


class MemoryMethods:
    """
    The methods on memories: each answers its request (Search and
    SearchMany with the bytes they wrote) or raises, and L{statusOf} says
    what status a failure is answered with.
    """

    log = Logger()
    # Set by MemoryServicer.
    metrics: MemoryMetrics
    _store: MemoryStore
    _searcher: Searcher
    _maxPerScope: int

    def AddMemory(self, request: memory_pb2.AddMemoryRequest) -> memory_pb2.Memory:
        scope = scopeOf(request.scope)
        content = checkContent(request.content)
        metadata = checkMetadata(request.metadata_json)
        source = checkSource(request.source or "api")
        sourceRequestID = checkRequestID("source_request_id", request.source_request_id, False)
        embedding = embeddingOf(request, "embedding")
        record = self._store.add(
            scope, content, metadata, source, sourceRequestID, embedding, self._maxPerScope
        )
        self._searcher.settle(scope)
        return memoryMessage(record)

    def GetMemory(self, request: memory_pb2.GetMemoryRequest) -> memory_pb2.Memory:
        scope = scopeOf(request.scope)
        return memoryMessage(self._store.get(scope, checkUUID("id", request.id)))

    def ListMemories(
        self, request: memory_pb2.ListMemoriesRequest
    ) -> memory_pb2.ListMemoriesResponse:
        scope = scopeOf(request.scope)
        limit = request.limit or DEFAULT_LIST_LIMIT
        bounded("limit", limit, 1, MAX_LIST_LIMIT)
        after = checkUUID("after", request.after) if request.after else None
        records, more = self._store.listMemories(scope, int(limit), after)
        return memory_pb2.ListMemoriesResponse(
            memories=[memoryMessage(each) for each in records], has_more=more
        )

    def UpdateMemory(self, request: memory_pb2.UpdateMemoryRequest) -> memory_pb2.Memory:
        scope = scopeOf(request.scope)
        memoryID = checkUUID("id", request.id)
        content = metadata = embedding = None
        if request.HasField("content"):
            content = checkContent(request.content)
            embedding = embeddingOf(request, "embedding")
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
        scope = scopeOf(request.scope)
        memoryID = checkUUID("id", request.id)
        self._store.delete(scope, memoryID)
        self._searcher.settle(scope)
        return memory_pb2.DeleteMemoryResponse(id=str(memoryID))

    def DeleteScope(self, request: memory_pb2.DeleteScopeRequest) -> memory_pb2.DeleteScopeResponse:
        scope = scopeOf(request.scope)
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
        scope = scopeOf(request.scope)
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
        k = int(bounded("k", request.k, 1, MAX_K))
        minScore = None
        if request.HasField("min_score"):
            minScore = bounded("min_score", request.min_score, -1.0, 1.0)
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
                    raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
                outcomes.append((0, self.Search(search)))
            except Exception as error:
                code, details = statusOf("SearchMany", error, self.log)
                outcomes.append((code.value[0], details))
            finally:
                self.metrics.answered("Search", code.name)
        return searchManyAnswer(outcomes)
