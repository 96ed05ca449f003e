"""
What a replica's caches load from PostgreSQL: a scope's vectors
(L{svcd.memory.vectors}), texts (L{svcd.memory.text}) or records
(L{svcd.memory.recordcache}) on a miss, and the rows of the memories the
change listener heard of (L{svcd.memory.listener}).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

import attrs

from svcd.memory.records import MemoryRecord
from svcd.memory.store.base import BaseStore, Cursor
from svcd.memory.store.memories import MEMORY_COLUMNS, memoryRecord, newestLength
from svcd.memoryclient.records import Scope


@attrs.frozen
class CachedRow:
    """
    One memory as the change listener reads it for a replica's caches: what
    the cache of vectors holds (L{svcd.memory.vectors}), its words for the
    text indexes (L{svcd.memory.text}) and, in C{record}, what the cache of
    records holds (L{svcd.memory.recordcache}).

    @ivar createdMicros: C{created_at} in microseconds since the epoch, the
        tie-break of a search.
    @ivar record: the memory as a reader sees it (content, metadata,
        source, times), read in the same statement as the vector, so both
        caches follow one state of the row; for any part of svc-memory that
        keeps what memories say. None only where a test builds a row for
        the vectors alone.
    """

    memoryID: uuid.UUID
    agentID: uuid.UUID
    subject: str = attrs.field(repr=False)
    model: str
    dimensions: int
    createdMicros: int
    vector: bytes = attrs.field(repr=False)
    content: str = attrs.field(repr=False)
    record: MemoryRecord | None = attrs.field(default=None, repr=False)


@attrs.frozen
class ScopeRows:
    """
    Every vector of one scope and model: C{ids} 16 bytes per memory (the
    UUIDs' bytes, big-endian), C{createdMicros} one int each, C{vectors}
    C{dimensions} float32 components each, little-endian; all in the same
    order.
    """

    ids: bytes = attrs.field(repr=False)
    createdMicros: list[int] = attrs.field(repr=False)
    vectors: bytes = attrs.field(repr=False)

    @property
    def count(self) -> int:
        return len(self.ids) // 16


@attrs.frozen
class ScopeTexts:
    """
    Every memory of one scope (any embedding model's), for its text index:
    C{ids} as in L{ScopeRows}, C{createdMicros} and C{contents} in the same
    order.
    """

    ids: bytes = attrs.field(repr=False)
    createdMicros: list[int] = attrs.field(repr=False)
    contents: list[str] = attrs.field(repr=False)

    @property
    def count(self) -> int:
        return len(self.ids) // 16


# A memory's creation in microseconds since the epoch, as every cache holds it.
MICROS = "(extract(epoch FROM created_at) * 1000000)::bigint AS created_micros"


class CacheLoadsStore(BaseStore):
    """
    The loads of a replica's caches.
    """

    def scopeRows(self, scope: Scope, model: str, dimensions: int) -> ScopeRows:
        """
        Every vector of the scope made by C{model} with C{dimensions}
        components: a cache's load on a miss. Read in binary, so that ids
        and vectors arrive as bytes, never a Python object per component.
        """

        def query(cursor: Cursor) -> ScopeRows:
            cursor.execute(
                f"SELECT uuid_send(id) AS id, {MICROS}, vector FROM memories"
                " WHERE org_id = %s AND agent_id = %s AND subject = %s"
                " AND embedding_model = %s AND dimensions = %s",
                (scope.orgID, scope.agentID, scope.subject, model, dimensions),
            )
            ids, created, vectors = [], [], []
            for row in cursor:
                ids.append(row["id"])
                created.append(row["created_micros"])
                vectors.append(row["vector"])
            return ScopeRows(b"".join(ids), created, b"".join(vectors))

        return self._run("memory_scope_vectors", query, scope.orgID, binary=True)

    def scopeLength(self, scope: Scope, model: str) -> int | None:
        """
        The length of the scope's vectors of C{model} (every one has the
        same: L{svcd.memory.store.memories.checkLength}), None when it holds none: one indexed
        look-up, for a search that found no vector of its query's length.
        """
        return self._run(
            "memory_scope_length", lambda cursor: newestLength(cursor, scope, model), scope.orgID
        )

    def scopeTexts(self, scope: Scope) -> ScopeTexts:
        """
        Every memory's content of the scope, whatever model embedded it: a
        text index's load on a miss (decisions D13, "Hybrid search").
        """

        def query(cursor: Cursor) -> ScopeTexts:
            cursor.execute(
                f"SELECT uuid_send(id) AS id, {MICROS}, content FROM memories"
                " WHERE org_id = %s AND agent_id = %s AND subject = %s",
                (scope.orgID, scope.agentID, scope.subject),
            )
            ids, created, contents = [], [], []
            for row in cursor:
                ids.append(row["id"])
                created.append(row["created_micros"])
                contents.append(row["content"])
            return ScopeTexts(b"".join(ids), created, contents)

        return self._run("memory_scope_texts", query, scope.orgID, binary=True)

    def scopeRecords(self, scope: Scope) -> list[MemoryRecord]:
        """
        Every memory of the scope, whatever model made its vector, without
        the vectors: the cache of records' load on a miss.
        """

        def query(cursor: Cursor) -> list[MemoryRecord]:
            cursor.execute(
                f"SELECT {MEMORY_COLUMNS} FROM memories"
                " WHERE org_id = %s AND agent_id = %s AND subject = %s",
                (scope.orgID, scope.agentID, scope.subject),
            )
            return [memoryRecord(row) for row in cursor.fetchall()]

        return self._run("memory_scope_records", query, scope.orgID)

    def rowsForCache(
        self, orgID: uuid.UUID, memoryIDs: Iterable[uuid.UUID]
    ) -> dict[uuid.UUID, CachedRow]:
        """
        The current state of some memories of one organization, for the
        change listener: those still there, by id (one deleted since its
        notification is missing), each with its vector and its record.
        """
        return self.rowsForCacheByOrganization({orgID: memoryIDs})

    def rowsForCacheByOrganization(
        self, memoryIDs: Mapping[uuid.UUID, Iterable[uuid.UUID]]
    ) -> dict[uuid.UUID, CachedRow]:
        """
        L{rowsForCache} of several organizations in one transaction, each
        organization's rows read in its own context: a packet of
        notifications names many organizations when the claims take each
        organization's observations in turn (sql/0018_fair_claims.sql),
        and a transaction each (its pool checkout, BEGIN and COMMIT) was
        most of the listener's time then.
        """
        wanted = [(orgID, list(ids)) for orgID, ids in memoryIDs.items()]
        if not wanted:
            return {}

        def query(cursor: Cursor) -> dict[uuid.UUID, CachedRow]:
            found: dict[uuid.UUID, CachedRow] = {}
            for index, (orgID, ids) in enumerate(wanted):
                if index:
                    cursor.execute("SELECT set_config('svc.org_id', %s, true)", (str(orgID),))
                cursor.execute(
                    f"SELECT {MEMORY_COLUMNS}, {MICROS}, vector FROM memories WHERE id = ANY(%s)",
                    (ids,),
                )
                for row in cursor.fetchall():
                    found[row["id"]] = CachedRow(
                        memoryID=row["id"],
                        agentID=row["agent_id"],
                        subject=row["subject"],
                        model=row["embedding_model"],
                        dimensions=row["dimensions"],
                        createdMicros=row["created_micros"],
                        vector=bytes(row["vector"]),
                        content=row["content"],
                        record=memoryRecord(row),
                    )
            return found

        return self._run("memory_cache_rows", query, wanted[0][0], binary=True)
