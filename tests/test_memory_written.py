"""
A replica's own inserts reach its caches without being read back: the
rows a transaction adds are given to the cache before it commits
(L{svcd.memory.vectorcache.VectorCache.expectWritten}), and the change
listener takes each when it hears its insert, reading from PostgreSQL
only what it was not given (L{svcd.memory.listener.MemoryListener}).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

import numpy
from memoryfixtures import vectorBytes

from svcd.memory.listener import MemoryListener
from svcd.memory.store.cacheloads import CachedRow, ScopeRows
from svcd.memory.vectorcache import MAX_WRITTEN_ROWS, ScopeKey, VectorCache
from svcd.memory.vectors import ScopeVectors

ORG, AGENT, OTHER_AGENT = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
KEY = ScopeKey(ORG, AGENT, "alice", "m", 2)


class CountingStore:
    """
    What the listener reads rows from: answers C{rows} for the ids asked,
    and remembers each question.
    """

    def __init__(self, rows: Iterable[CachedRow] = ()) -> None:
        self.rows = {row.memoryID: row for row in rows}
        self.asked: list[dict[uuid.UUID, set[uuid.UUID]]] = []

    def rowsForCacheByOrganization(
        self, memoryIDs: Mapping[uuid.UUID, Iterable[uuid.UUID]]
    ) -> dict[uuid.UUID, CachedRow]:
        asked = {orgID: set(ids) for orgID, ids in memoryIDs.items()}
        self.asked.append(asked)
        return {
            memoryID: self.rows[memoryID]
            for ids in asked.values()
            for memoryID in ids
            if memoryID in self.rows
        }


def row(memoryID: uuid.UUID, vector: list[float], agentID: uuid.UUID = AGENT) -> CachedRow:
    return CachedRow(memoryID, agentID, "alice", "m", 2, 7, vectorBytes(vector), "content")


def cachedScope() -> VectorCache:
    """
    A listening cache holding KEY's scope, empty.
    """
    cache = VectorCache(maxBytes=1 << 20)
    cache.listening()
    empty = ScopeRows(ids=b"", createdMicros=[], vectors=b"")
    cache.finishLoad(cache.beginLoad(KEY), ScopeVectors.fromRows(2, empty))
    return cache


def held(cache: VectorCache) -> list[int]:
    scope = cache.lookup(KEY)
    assert isinstance(scope, ScopeVectors)
    return sorted(scope.memoryKeys())


def listenerOf(cache: VectorCache) -> MemoryListener:
    return MemoryListener("postgresql://unused", cache)


def test_anInsertThisReplicaWroteIsTakenNotRead() -> None:
    """
    The row given before the commit is the one the cache holds once its
    insert is heard, and nothing is read from PostgreSQL.
    """
    cache = cachedScope()
    memoryID = uuid.uuid4()
    cache.expectWritten([row(memoryID, [1.0, 0.0])])
    store = CountingStore()
    listenerOf(cache)._apply([("insert", ORG, AGENT, memoryID)], store)  # type: ignore[arg-type]
    assert store.asked == []
    assert held(cache) == [memoryID.int]
    scope = cache.lookup(KEY)
    assert isinstance(scope, ScopeVectors)
    hits = scope.search(numpy.asarray([1.0, 0.0], dtype=numpy.float32), 1)
    assert [hit.memoryID for hit in hits] == [memoryID]
    # Taken: a second notification of it reads PostgreSQL.
    assert cache.takeWritten(memoryID) is None


def test_aRowNamedAgainInThePacketIsRead() -> None:
    """
    An insert this replica wrote and a later change of the same memory in
    one packet: the memory is read from PostgreSQL, as it now is (the
    row written is no longer what it holds).
    """
    cache = cachedScope()
    memoryID = uuid.uuid4()
    cache.expectWritten([row(memoryID, [1.0, 0.0])])
    now = row(memoryID, [0.0, 1.0])
    store = CountingStore([now])
    listenerOf(cache)._apply(
        [("insert", ORG, AGENT, memoryID), ("update", ORG, AGENT, memoryID)],
        store,  # type: ignore[arg-type]
    )
    assert store.asked == [{ORG: {memoryID}}]
    scope = cache.lookup(KEY)
    assert isinstance(scope, ScopeVectors)
    hits = scope.search(numpy.asarray([0.0, 1.0], dtype=numpy.float32), 1)
    assert [(hit.memoryID, round(hit.score, 6)) for hit in hits] == [(memoryID, 1.0)]


def test_othersWritesAreReadAndNothingIsLeftBehind() -> None:
    """
    A memory another replica inserted is read; a row this one wrote for an
    agent no scope of which is cached is taken all the same, so that it
    is not kept.
    """
    cache = cachedScope()
    theirs, unwatched = uuid.uuid4(), uuid.uuid4()
    cache.expectWritten([row(unwatched, [1.0, 1.0], OTHER_AGENT)])
    store = CountingStore([row(theirs, [1.0, 0.0])])
    listenerOf(cache)._apply(
        [("insert", ORG, AGENT, theirs), ("insert", ORG, OTHER_AGENT, unwatched)],
        store,  # type: ignore[arg-type]
    )
    assert store.asked == [{ORG: {theirs}}]
    assert held(cache) == [theirs.int]
    assert cache.takeWritten(unwatched) is None


def test_writtenRowsAreForgottenAndBounded() -> None:
    """
    Rows of a transaction that failed are forgotten; the cache's other
    state going (the listener lost) takes them too; and past
    MAX_WRITTEN_ROWS never heard, they are dropped.
    """
    cache = cachedScope()
    first, second = uuid.uuid4(), uuid.uuid4()
    cache.expectWritten([row(first, [1.0, 0.0]), row(second, [0.0, 1.0])])
    cache.forgetWritten([first])
    assert cache.takeWritten(first) is None
    cache.notListening()
    assert cache.takeWritten(second) is None
    cache.listening()
    many = [row(uuid.uuid4(), [1.0, 0.0]) for _ in range(MAX_WRITTEN_ROWS)]
    cache.expectWritten(many)
    cache.expectWritten([row(first, [1.0, 0.0])])
    assert cache.takeWritten(many[0].memoryID) is None
    assert cache.takeWritten(first) is not None
