"""
A scope's memories (the table memories of sql/0009_memory.sql): added,
read, listed and changed through the API, and an agent's listed for
svcctl; with what the other stores' writes of memories share: a row as a
L{MemoryRecord}, the scope's lock, and the rule that a scope's vectors of
one model have one length.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from svcd.common.ids import uuid7
from svcd.memory.records import EXTRACTED, OTHER_LENGTH, MemoryRecord
from svcd.memory.store.base import (
    BaseStore,
    Cursor,
    MemoryNotFound,
    ScopeFull,
    oneRow,
    refuse,
)
from svcd.memoryclient.records import Embedding, InvalidMemory, Scope

# An arbitrary constant naming "a memory scope" in the key of the
# advisory lock that serialises adds to one scope (L{MemoriesStore.add}).
_SCOPE_LOCK_SEED = 0x5EC_0913

MEMORY_COLUMNS = (
    "id, org_id, agent_id, subject, content, metadata::text AS metadata, source,"
    " source_request_id, embedding_model, dimensions, created_at, updated_at"
)


def _compactJSON(text: str) -> str:
    """
    PostgreSQL's spelling of a jsonb value, which puts spaces after
    separators, in the compact one the size rule counts. The empty object,
    most memories' metadata, is spelled alike both ways: a scope's load
    reads thousands at once.
    """
    if text == "{}":
        return text
    return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)


def memoryRecord(row: dict[str, Any]) -> MemoryRecord:
    return MemoryRecord(
        memoryID=row["id"],
        orgID=row["org_id"],
        agentID=row["agent_id"],
        subject=row["subject"],
        content=row["content"],
        metadata=_compactJSON(row["metadata"]),
        source=row["source"],
        sourceRequestID=row["source_request_id"],
        embeddingModel=row["embedding_model"],
        dimensions=row["dimensions"],
        createdAt=row["created_at"],
        updatedAt=row["updated_at"],
    )


class MemoriesStore(BaseStore):
    """
    A scope's memories, and an agent's for svcctl.
    """

    def add(
        self,
        scope: Scope,
        content: str,
        metadata: str,
        source: str,
        sourceRequestID: str | None,
        embedding: Embedding,
        maxPerScope: int,
    ) -> MemoryRecord:
        """
        Store a new memory (values already checked by
        L{svcd.memory.records}).

        The scope's cap holds under concurrency: adds to one scope take a
        transaction-scoped advisory lock on the scope before they count
        it, so two adds at C{maxPerScope - 1} run one after the other and
        the second finds the scope full. (Adds to other scopes do not wait,
        but for the rare collision of two scopes' 64-bit hashes.)

        An extracted memory (svc-worker's, decisions D13) is added once:
        when the scope holds one made from the same request
        (C{sourceRequestID}) with the same content, that one is answered
        and nothing is added, so that an observation processed again never
        stores a fact twice (sql/0011_memory_extracted_index.sql). Checked
        under the scope's lock, so two workers adding it at once add it
        once.

        @raise ScopeFull: the scope holds C{maxPerScope} memories already.
        @raise StoreRejected: the agent is not one of the organization's.
        @raise InvalidMemory: the vector is not the length of the scope's
            other vectors of its model (L{checkLength}).
        """
        memoryID = uuid7()

        def insert(cursor: Cursor) -> MemoryRecord:
            lockScope(cursor, scope)
            if source == EXTRACTED and sourceRequestID:
                cursor.execute(
                    f"SELECT {MEMORY_COLUMNS} FROM memories"
                    " WHERE org_id = %s AND source = 'extracted' AND source_request_id = %s"
                    " AND agent_id = %s AND subject = %s AND content = %s"
                    " ORDER BY created_at, id LIMIT 1",
                    (scope.orgID, sourceRequestID, scope.agentID, scope.subject, content),
                )
                row = cursor.fetchone()
                if row is not None:
                    return memoryRecord(row)
            cursor.execute(
                "SELECT count(*) AS held FROM memories"
                " WHERE org_id = %s AND agent_id = %s AND subject = %s",
                (scope.orgID, scope.agentID, scope.subject),
            )
            if oneRow(cursor.fetchone())["held"] >= maxPerScope:
                raise ScopeFull(f"the scope holds {maxPerScope} memories already")
            checkLength(cursor, scope, embedding)
            cursor.execute(
                "INSERT INTO memories (id, org_id, agent_id, subject, content, metadata, source,"
                " source_request_id, embedding_model, dimensions, vector)"
                " VALUES (%s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s, %s)"
                f" RETURNING {MEMORY_COLUMNS}",
                (
                    memoryID,
                    scope.orgID,
                    scope.agentID,
                    scope.subject,
                    content,
                    metadata,
                    source,
                    sourceRequestID,
                    embedding.model,
                    embedding.dimensions,
                    embedding.vector,
                ),
            )
            return memoryRecord(oneRow(cursor.fetchone()))

        return self._run("memory_add", insert, scope.orgID)

    def get(self, scope: Scope, memoryID: uuid.UUID) -> MemoryRecord:
        """
        @raise MemoryNotFound: no memory has this id.
        @raise MemoryForbidden: it is another scope's.
        """

        def query(cursor: Cursor) -> MemoryRecord:
            return memoryRecord(_inScope(cursor, scope, memoryID, MEMORY_COLUMNS))

        return self._run("memory_get", query, scope.orgID)

    def listMemories(
        self, scope: Scope, limit: int, after: uuid.UUID | None = None
    ) -> tuple[list[MemoryRecord], bool]:
        """
        Up to C{limit} memories of the scope, newest first (by creation,
        then id), after the memory C{after} when given; and whether more
        follow.

        @raise MemoryNotFound: C{after} names no memory.
        @raise MemoryForbidden: C{after} is another scope's.
        """

        def query(cursor: Cursor) -> tuple[list[MemoryRecord], bool]:
            condition = ""
            parameters: tuple[object, ...] = ()
            if after is not None:
                anchor = _inScope(cursor, scope, after, "created_at, id")
                condition = " AND (created_at, id) < (%s, %s)"
                parameters = (anchor["created_at"], anchor["id"])
            cursor.execute(
                f"SELECT {MEMORY_COLUMNS} FROM memories"
                " WHERE org_id = %s AND agent_id = %s AND subject = %s"
                f"{condition} ORDER BY created_at DESC, id DESC LIMIT %s",
                (scope.orgID, scope.agentID, scope.subject, *parameters, limit + 1),
            )
            rows = [memoryRecord(row) for row in cursor.fetchall()]
            return rows[:limit], len(rows) > limit

        return self._run("memory_list", query, scope.orgID)

    def listForOperator(
        self,
        orgID: uuid.UUID,
        agentID: uuid.UUID,
        subject: str | None,
        limit: int,
        after: uuid.UUID | None = None,
    ) -> tuple[list[MemoryRecord], bool]:
        """
        svcctl memory list: as L{listMemories}, over every subject of the
        agent when C{subject} is None.

        @raise MemoryNotFound: C{after} names no memory of the agent (or
            of the subject).
        """

        def query(cursor: Cursor) -> tuple[list[MemoryRecord], bool]:
            conditions = ["org_id = %s", "agent_id = %s"]
            values: list[object] = [orgID, agentID]
            if subject is not None:
                conditions.append("subject = %s")
                values.append(subject)
            where = " AND ".join(conditions)
            if after is not None:
                cursor.execute(
                    f"SELECT created_at, id FROM memories WHERE id = %s AND {where}",
                    (after, *values),
                )
                anchor = cursor.fetchone()
                if anchor is None:
                    raise MemoryNotFound("no such id")
                where += " AND (created_at, id) < (%s, %s)"
                values += [anchor["created_at"], anchor["id"]]
            cursor.execute(
                f"SELECT {MEMORY_COLUMNS} FROM memories WHERE {where}"
                " ORDER BY created_at DESC, id DESC LIMIT %s",
                (*values, limit + 1),
            )
            rows = [memoryRecord(row) for row in cursor.fetchall()]
            return rows[:limit], len(rows) > limit

        return self._run("memory_list_operator", query, orgID)

    def subjectOf(self, orgID: uuid.UUID, agentID: uuid.UUID, memoryID: uuid.UUID) -> str | None:
        """
        The subject of one of the agent's memories, or None when the agent
        has no memory with this id (svcctl memory show and delete without
        --subject).
        """

        def query(cursor: Cursor) -> str | None:
            cursor.execute(
                "SELECT subject FROM memories WHERE id = %s AND org_id = %s AND agent_id = %s",
                (memoryID, orgID, agentID),
            )
            row = cursor.fetchone()
            return None if row is None else str(row["subject"])

        return self._run("memory_subject", query, orgID)

    def update(
        self,
        scope: Scope,
        memoryID: uuid.UUID,
        content: str | None,
        metadata: str | None,
        embedding: Embedding | None,
    ) -> MemoryRecord:
        """
        Change a memory's content (with the C{embedding} of the new
        content), its metadata, or both; C{updated_at} becomes now.

        @raise MemoryNotFound: no memory has this id.
        @raise MemoryForbidden: it is another scope's.
        @raise InvalidMemory: the new vector is not the length of the
            scope's other vectors of its model (L{checkLength}).
        """
        assignments = ["updated_at = now()"]
        values: list[object] = []
        if content is not None:
            assignments.append("content = %s")
            values.append(content)
        if metadata is not None:
            assignments.append("metadata = %s::jsonb")
            values.append(metadata)
        if embedding is not None:
            assignments += ["embedding_model = %s", "dimensions = %s", "vector = %s"]
            values += [embedding.model, embedding.dimensions, embedding.vector]

        def change(cursor: Cursor) -> MemoryRecord:
            if embedding is not None:
                lockScope(cursor, scope)
                checkLength(cursor, scope, embedding, memoryID)
            cursor.execute(
                f"UPDATE memories SET {', '.join(assignments)}"
                " WHERE id = %s AND org_id = %s AND agent_id = %s AND subject = %s"
                f" RETURNING {MEMORY_COLUMNS}",
                (*values, memoryID, scope.orgID, scope.agentID, scope.subject),
            )
            row = cursor.fetchone()
            if row is None:
                refuse(cursor, "svc_memory_exists", memoryID)
            return memoryRecord(oneRow(row))

        return self._run("memory_update", change, scope.orgID)

    def memoriesByID(self, scope: Scope, memoryIDs: Sequence[uuid.UUID]) -> list[MemoryRecord]:
        """
        The memories of the scope among C{memoryIDs}, in no order: a
        search's results, read after the search (one deleted meanwhile is
        simply missing).
        """
        if not memoryIDs:
            return []

        def query(cursor: Cursor) -> list[MemoryRecord]:
            cursor.execute(
                f"SELECT {MEMORY_COLUMNS} FROM memories WHERE id = ANY(%s)"
                " AND org_id = %s AND agent_id = %s AND subject = %s",
                (list(memoryIDs), scope.orgID, scope.agentID, scope.subject),
            )
            return [memoryRecord(row) for row in cursor.fetchall()]

        return self._run("memory_by_id", query, scope.orgID)


def lockScope(cursor: Cursor, scope: Scope) -> None:
    cursor.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, %s))",
        (f"{scope.orgID}:{scope.agentID}:{scope.subject}", _SCOPE_LOCK_SEED),
    )


def checkLength(
    cursor: Cursor, scope: Scope, embedding: Embedding, memoryID: uuid.UUID | None = None
) -> None:
    """
    Refuse a vector whose length is not that of the scope's other vectors
    of its model (decisions D13 amended, "Vectors never mix"): a search
    compares a query only with vectors of its own length, so a memory of
    another length would start a set of its own, silently, that the
    model's queries never find. Called under the scope's lock, so that two
    writes of different lengths cannot both pass.

    One indexed look-up (C{memories_scope_newest}): the scope's newest
    memory of the model, other than C{memoryID} (the memory a new content
    replaces the vector of), whose length every other one shares, since
    each was checked so when written.

    @raise InvalidMemory: on the field C{embedding}, L{OTHER_LENGTH}.
    """
    held = newestLength(cursor, scope, embedding.model, memoryID)
    if held is not None and held != embedding.dimensions:
        raise InvalidMemory("embedding", OTHER_LENGTH)


def newestLength(
    cursor: Cursor, scope: Scope, model: str, memoryID: uuid.UUID | None = None
) -> int | None:
    """
    The length of the scope's newest vector of C{model} other than
    C{memoryID}'s (L{checkLength}), None when it holds none.
    """
    cursor.execute(
        "SELECT dimensions FROM memories"
        " WHERE org_id = %s AND agent_id = %s AND subject = %s AND embedding_model = %s"
        " AND id IS DISTINCT FROM %s"
        " ORDER BY created_at DESC, id DESC LIMIT 1",
        (scope.orgID, scope.agentID, scope.subject, model, memoryID),
    )
    row = cursor.fetchone()
    return None if row is None else int(row["dimensions"])


def _inScope(cursor: Cursor, scope: Scope, memoryID: uuid.UUID, columns: str) -> dict[str, Any]:
    """
    The row of memory C{memoryID} of the scope.

    @raise MemoryNotFound: no memory has this id.
    @raise MemoryForbidden: it exists, in another scope.
    """
    cursor.execute(
        f"SELECT {columns} FROM memories"
        " WHERE id = %s AND org_id = %s AND agent_id = %s AND subject = %s",
        (memoryID, scope.orgID, scope.agentID, scope.subject),
    )
    row = cursor.fetchone()
    if row is None:
        refuse(cursor, "svc_memory_exists", memoryID)
    return oneRow(row)
