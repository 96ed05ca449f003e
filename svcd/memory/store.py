"""
All SQL of svc-memory (sql/0009_memory.sql).

As in svc-auth's store (L{svcd.auth.store}), every method blocks and so
runs off the reactor thread (grpcio's server threads, the change
listener's thread, the HTTP side's database pool, svcctl), and each call
is one transaction that first names its organization with
C{set_config('svc.org_id', ..., true)}; row-level security, forced on both
tables for the role svc_memory_app, does the rest. A query in the wrong
organization's context finds nothing, and a write there is refused by the
database itself.

Ids of other organizations' rows cannot be seen, yet a memory of another
organization or agent must be answered "forbidden" rather than "not
found" (decisions D13): L{MemoryForbidden} comes from
C{svc_memory_exists(id)}, which answers whether an id exists at all and
nothing else.
"""

from __future__ import annotations

import datetime
import itertools
import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import attrs
import psycopg
from prometheus_client import Histogram
from psycopg_pool import ConnectionPool

from svcd.common.ids import uuid7
from svcd.common.pgtransactions import (
    StoreRejected,
    StoreUnavailable,
    StoreValueRefused,
    runTransaction,
)
from svcd.memory.extracted import OtherScope, Plan, Stored, recentRows, updateExtracted
from svcd.memory.forgetting import (
    FORGOTTEN,
    forgottenAmong,
    forgottenSince,
    lockAgents,
    recordDeletion,
)
from svcd.memory.records import (
    EXTRACTED,
    OTHER_LENGTH,
    QUEUE_FULL,
    ClaimedObservation,
    Embedding,
    InvalidMemory,
    MemoryRecord,
    NewObservation,
    QueuedObservation,
    Scope,
    messagesFromJSON,
    messagesJSON,
)

__all__ = [
    "APPLICATION_ROLE",
    "MemoryForbidden",
    "MemoryNotFound",
    "MemoryStore",
    "ObservationForgotten",
    "ScopeFull",
    "StoreRejected",
    "StoreUnavailable",
    "StoreValueRefused",
]

T = TypeVar("T")

ConnectionSource = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]
Cursor = psycopg.Cursor[dict[str, Any]]

APPLICATION_ROLE = "svc_memory_app"

# An arbitrary constant naming "a memory scope" in the key of the
# advisory lock that serialises adds to one scope (L{MemoryStore.add}).
_SCOPE_LOCK_SEED = 0x5EC_0913
# The same for "an organization's queue of observations"
# (L{MemoryStore.queueObservations}).
_QUEUE_LOCK_SEED = 0x5EC_0918


class MemoryNotFound(Exception):
    """
    No memory (or observation) has this id, in any organization.
    """


class ObservationForgotten(MemoryNotFound):
    """
    The observation is gone, taken by a deletion of its scope or agent
    (svcd/memory/forgetting.py), not dropped by an operator.
    """


class MemoryForbidden(Exception):
    """
    The id exists, but belongs to another organization, agent or subject.
    """


class ScopeFull(Exception):
    """
    The scope holds SVC_MEMORY_MAX_PER_SCOPE memories already.
    """


def connectionPool(
    dsn: str,
    *,
    minimum: int,
    maximum: int,
    statementTimeout: float,
    applicationName: str,
) -> ConnectionPool:
    """
    svc-memory's pool of autocommit connections, not yet opened: each acts
    as svc_memory_app, whatever role the DSN logs in as, and no statement
    runs longer than C{statementTimeout}.
    """
    statementTimeoutMs = int(statementTimeout * 1000)

    def configure(connection: psycopg.Connection[Any]) -> None:
        connection.execute(f"SET ROLE {APPLICATION_ROLE}")
        connection.execute(f"SET statement_timeout = {statementTimeoutMs}")

    return ConnectionPool(
        dsn,
        min_size=minimum,
        max_size=maximum,
        kwargs={"autocommit": True, "connect_timeout": 3, "application_name": applicationName},
        configure=configure,
        timeout=2.0,
        name=applicationName,
        open=False,
    )


_MEMORY_COLUMNS = (
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


def _memory(row: dict[str, Any]) -> MemoryRecord:
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


_MICROS = "(extract(epoch FROM created_at) * 1000000)::bigint AS created_micros"


@attrs.frozen
class ObservationJob:
    """
    An observation not yet done, as an operator sees it (svcctl memory
    jobs): never its messages.
    """

    observationID: uuid.UUID
    agentID: uuid.UUID
    subject: str = attrs.field(repr=False)
    state: str
    attempts: int
    reason: str | None
    nextAttemptAt: datetime.datetime


@attrs.frozen
class ObservationRelease:
    """
    How a worker hands back an observation it claimed but did not finish.

    @ivar retryAfter: seconds until it may be claimed again.
    @ivar countAttempt: whether this was a failed attempt (False for a
        refusal by a limit or a budget, which is no fault of the
        observation, decisions D13).
    @ivar failed: keep it as failed: no more attempts.
    @ivar reason: why, for operators (never content).
    """

    retryAfter: float
    countAttempt: bool
    failed: bool
    reason: str


class MemoryStore:
    """
    The tenant-scoped queries of svc-memory over a source of connections
    that act as svc_memory_app.

    @param connections: returns a context manager yielding an autocommit
        connection; a psycopg_pool pool's C{connection} method for the
        daemon, one plain connection for svcctl and the listener.
    @param queryDuration: svc_db_query_duration_seconds, or None.
    @param dropDeadConnections: the pool's C{check}, called when a
        connection is found dead before a transaction did anything.
    """

    def __init__(
        self,
        connections: ConnectionSource,
        queryDuration: Histogram | None = None,
        dropDeadConnections: Callable[[], None] | None = None,
    ) -> None:
        self._connections = connections
        self._queryDuration = queryDuration
        self._dropDeadConnections = dropDeadConnections

    def _run(
        self,
        operation: str,
        body: Callable[[Cursor], T],
        orgID: uuid.UUID | None,
        *,
        binary: bool = False,
    ) -> T:
        """
        Run C{body} in one transaction in C{orgID}'s context (None: no
        organization, in which row-level security shows no row), as
        svc-auth's store runs its own (L{runTransaction}).
        """
        return runTransaction(
            self._connections,
            operation,
            body,
            (("svc.org_id", str(orgID) if orgID else ""),),
            queryDuration=self._queryDuration,
            dropDeadConnections=self._dropDeadConnections,
            binary=binary,
        )

    def ping(self) -> None:
        """
        A trivial round trip, for readiness.
        """
        self._run("ping", lambda cursor: cursor.execute("SELECT 1"), None)

    def notifySync(self, nonce: str) -> None:
        """
        Send the sync marker C{nonce} on the change listeners' channel,
        after a write has committed (L{svcd.memory.listener}).
        """
        self._run(
            "memory_sync",
            lambda cursor: cursor.execute(
                "SELECT pg_notify('svc_memory_changes', %s)", (f"sync:{nonce}",)
            ),
            None,
        )

    # Memories.

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
            other vectors of its model (L{_checkLength}).
        """
        memoryID = uuid7()

        def insert(cursor: Cursor) -> MemoryRecord:
            _lockScope(cursor, scope)
            if source == EXTRACTED and sourceRequestID:
                cursor.execute(
                    f"SELECT {_MEMORY_COLUMNS} FROM memories"
                    " WHERE org_id = %s AND source = 'extracted' AND source_request_id = %s"
                    " AND agent_id = %s AND subject = %s AND content = %s"
                    " ORDER BY created_at, id LIMIT 1",
                    (scope.orgID, sourceRequestID, scope.agentID, scope.subject, content),
                )
                row = cursor.fetchone()
                if row is not None:
                    return _memory(row)
            cursor.execute(
                "SELECT count(*) AS held FROM memories"
                " WHERE org_id = %s AND agent_id = %s AND subject = %s",
                (scope.orgID, scope.agentID, scope.subject),
            )
            if _one(cursor.fetchone())["held"] >= maxPerScope:
                raise ScopeFull(f"the scope holds {maxPerScope} memories already")
            _checkLength(cursor, scope, embedding)
            cursor.execute(
                "INSERT INTO memories (id, org_id, agent_id, subject, content, metadata, source,"
                " source_request_id, embedding_model, dimensions, vector)"
                " VALUES (%s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s, %s)"
                f" RETURNING {_MEMORY_COLUMNS}",
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
            return _memory(_one(cursor.fetchone()))

        return self._run("memory_add", insert, scope.orgID)

    def storeExtracted(
        self,
        orgID: uuid.UUID,
        observationID: uuid.UUID,
        owner: str,
        leaseToken: uuid.UUID,
        scope: Scope,
        sourceRequestID: str,
        plan: Plan,
        maxPerScope: int,
    ) -> Stored | None:
        """
        svc-worker's memories of one observation written (source
        C{extracted}) and the observation completed, in one transaction,
        while the claim named by C{owner} and C{leaseToken} holds its
        lease.

        The memories go into the observation's own scope, whatever the
        call named (decisions D13, amended): C{scope} is the one the plan's
        cache was asked about, and an observation of another raises
        L{OtherScope} before anything is written.

        The scope's lock comes first, then the observation's row (a claim,
        whose C{FOR UPDATE SKIP LOCKED} passes a locked row by, cannot take
        it meanwhile), so the memories are written only if the lease is the
        claim's, and the observation is deleted with them or not at all.
        A purge or a scope's deletion deletes observations before memories
        (L{_deleteScope}): it either waits for this transaction and then
        deletes its memories, or deletes the observation first and this
        one finds it gone.

        Under the lock the plan is made (L{Plan.writes}: the cache's
        nearest and the scope's memories written in the last seconds, read
        here), so that two observations of the same fact stored at once,
        through one replica or two, make one memory
        (L{svcd.memory.extracted}). Its updates are made (one of a memory
        deleted meanwhile is dropped, never added back), then its additions
        as L{add} adds one: once per request and content (one the scope
        already holds from this request with this content is answered
        instead), within the cap.

        @return: what was written; None when the lease is no longer the
            claim's (nothing written).
        @raise MemoryNotFound: the observation is gone (dropped; or
            L{ObservationForgotten}: a deletion took it): nothing written.
        @raise MemoryForbidden: it is another organization's.
        @raise OtherScope: it is of another agent or subject than C{scope}.
        @raise ScopeFull: the scope cannot hold them all: nothing written.
        @raise InvalidMemory: a vector is not the length of the scope's
            other vectors of its model: nothing written.
        """

        def store(cursor: Cursor) -> Stored | None:
            _lockScope(cursor, scope)
            cursor.execute(
                "SELECT agent_id, subject FROM memory_observations WHERE id = %s AND org_id = %s"
                " AND lease_owner = %s AND lease_token = %s FOR UPDATE",
                (observationID, orgID, owner, leaseToken),
            )
            row = cursor.fetchone()
            if row is None:
                cursor.execute("SELECT 1 FROM memory_observations WHERE id = %s", (observationID,))
                if cursor.fetchone() is not None:
                    return None
                _refuseObservation(cursor, observationID, scope)
                raise AssertionError("unreachable")
            own = Scope(orgID, row["agent_id"], row["subject"])
            if own != scope:
                # The lock taken is another scope's: roll back, plan again.
                raise OtherScope(own)
            writes = plan.writes(recentRows(cursor, own, plan.since, plan.models))
            updated, dropped = updateExtracted(
                cursor, own, [write for write in writes if write.target is not None]
            )
            adds = [(write.content, write.embedding) for write in writes if write.target is None]
            records = _addExtracted(cursor, own, sourceRequestID, adds, maxPerScope)
            cursor.execute(_finishing("id = %s"), (observationID,))
            return Stored(records, updated, dropped)

        return self._run("observation_store", store, orgID)

    def get(self, scope: Scope, memoryID: uuid.UUID) -> MemoryRecord:
        """
        @raise MemoryNotFound: no memory has this id.
        @raise MemoryForbidden: it is another scope's.
        """

        def query(cursor: Cursor) -> MemoryRecord:
            return _memory(_inScope(cursor, scope, memoryID, _MEMORY_COLUMNS))

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
                f"SELECT {_MEMORY_COLUMNS} FROM memories"
                " WHERE org_id = %s AND agent_id = %s AND subject = %s"
                f"{condition} ORDER BY created_at DESC, id DESC LIMIT %s",
                (scope.orgID, scope.agentID, scope.subject, *parameters, limit + 1),
            )
            rows = [_memory(row) for row in cursor.fetchall()]
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
                f"SELECT {_MEMORY_COLUMNS} FROM memories WHERE {where}"
                " ORDER BY created_at DESC, id DESC LIMIT %s",
                (*values, limit + 1),
            )
            rows = [_memory(row) for row in cursor.fetchall()]
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
            scope's other vectors of its model (L{_checkLength}).
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
                _lockScope(cursor, scope)
                _checkLength(cursor, scope, embedding, memoryID)
            cursor.execute(
                f"UPDATE memories SET {', '.join(assignments)}"
                " WHERE id = %s AND org_id = %s AND agent_id = %s AND subject = %s"
                f" RETURNING {_MEMORY_COLUMNS}",
                (*values, memoryID, scope.orgID, scope.agentID, scope.subject),
            )
            row = cursor.fetchone()
            if row is None:
                _refuse(cursor, "svc_memory_exists", memoryID)
            return _memory(_one(row))

        return self._run("memory_update", change, scope.orgID)

    def delete(self, scope: Scope, memoryID: uuid.UUID) -> None:
        """
        Forget a memory: its row and vector leave the table at commit.
        Final for everything said before it (svcd/memory/forgetting.py):
        the deletion is recorded for its scope, and the scope's waiting
        observations that ended at or before it are deleted too (one
        might say again what was forgotten).

        @raise MemoryNotFound: no memory has this id.
        @raise MemoryForbidden: it is another scope's.
        """

        def remove(cursor: Cursor) -> None:
            at = recordDeletion(cursor, scope.orgID, scope.agentID, scope.subject)
            cursor.execute(
                "DELETE FROM memories"
                " WHERE id = %s AND org_id = %s AND agent_id = %s AND subject = %s RETURNING id",
                (memoryID, scope.orgID, scope.agentID, scope.subject),
            )
            if cursor.fetchone() is None:
                _refuse(cursor, "svc_memory_exists", memoryID)
            _deleteObservations(
                cursor,
                "org_id = %s AND agent_id = %s AND subject = %s"
                " AND coalesce(ended_at, created_at) <= %s",
                (scope.orgID, scope.agentID, scope.subject, at),
            )

        self._run("memory_delete", remove, scope.orgID)

    def deleteScope(self, scope: Scope) -> tuple[int, int]:
        """
        Forget every memory of the scope and drop its observations not yet
        processed; how many of each. Recorded, so that an observation said
        before it and sent after it is dropped (svcd/memory/forgetting.py),
        even when the scope held nothing yet.
        """

        def remove(cursor: Cursor) -> tuple[int, int]:
            recordDeletion(cursor, scope.orgID, scope.agentID, scope.subject)
            return _deleteScope(cursor, scope)

        return self._run("memory_delete_scope", remove, scope.orgID)

    def purge(self, orgID: uuid.UUID, agentID: uuid.UUID) -> tuple[int, int]:
        """
        Forget every memory and observation of an agent, in every subject
        (svcctl memory purge without --subject); recorded for the whole
        agent, as L{deleteScope} for a scope.
        """

        def remove(cursor: Cursor) -> tuple[int, int]:
            recordDeletion(cursor, orgID, agentID, None)
            # Observations first, as _deleteScope.
            observations = _deleteObservations(
                cursor, "org_id = %s AND agent_id = %s", (orgID, agentID)
            )
            cursor.execute(
                "DELETE FROM memories WHERE org_id = %s AND agent_id = %s", (orgID, agentID)
            )
            return cursor.rowcount, observations

        return self._run("memory_purge", remove, orgID)

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
                f"SELECT {_MEMORY_COLUMNS} FROM memories WHERE id = ANY(%s)"
                " AND org_id = %s AND agent_id = %s AND subject = %s",
                (list(memoryIDs), scope.orgID, scope.agentID, scope.subject),
            )
            return [_memory(row) for row in cursor.fetchall()]

        return self._run("memory_by_id", query, scope.orgID)

    def scopeRows(self, scope: Scope, model: str, dimensions: int) -> ScopeRows:
        """
        Every vector of the scope made by C{model} with C{dimensions}
        components: a cache's load on a miss. Read in binary, so that ids
        and vectors arrive as bytes, never a Python object per component.
        """

        def query(cursor: Cursor) -> ScopeRows:
            cursor.execute(
                f"SELECT uuid_send(id) AS id, {_MICROS}, vector FROM memories"
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
        same: L{_checkLength}), None when it holds none: one indexed
        look-up, for a search that found no vector of its query's length.
        """
        return self._run(
            "memory_scope_length", lambda cursor: _scopeLength(cursor, scope, model), scope.orgID
        )

    def scopeTexts(self, scope: Scope) -> ScopeTexts:
        """
        Every memory's content of the scope, whatever model embedded it: a
        text index's load on a miss (decisions D13, "Hybrid search").
        """

        def query(cursor: Cursor) -> ScopeTexts:
            cursor.execute(
                f"SELECT uuid_send(id) AS id, {_MICROS}, content FROM memories"
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
                f"SELECT {_MEMORY_COLUMNS} FROM memories"
                " WHERE org_id = %s AND agent_id = %s AND subject = %s",
                (scope.orgID, scope.agentID, scope.subject),
            )
            return [_memory(row) for row in cursor.fetchall()]

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
                    f"SELECT {_MEMORY_COLUMNS}, {_MICROS}, vector FROM memories WHERE id = ANY(%s)",
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
                        record=_memory(row),
                    )
            return found

        return self._run("memory_cache_rows", query, wanted[0][0], binary=True)

    # Observations.

    def queueObservations(
        self, observations: Sequence[NewObservation], maxWaitingPerOrg: int | None = None
    ) -> list[QueuedObservation]:
        """
        Queue each observation unless its organization has one with the
        same key already (L{NewObservation.key}: the proxy's ledger id of
        the request), waiting or processed within the retention
        (sql/0014_observations_done.sql, sql/0015_observation_key.sql): a
        batch sent again queues nothing twice, and an extraction is not
        paid twice; two requests that share a client's request id are two
        observations.
        All of them in one transaction, in their organizations' contexts
        one after the other; answered only once committed, in the order
        given.

        One whose answer ended at or before a deletion of its scope or agent
        is not queued, and answered refused C{"forgotten"}
        (svcd/memory/forgetting.py).

        @param maxWaitingPerOrg: SVC_MEMORY_MAX_WAITING_PER_ORG (None: no
            bound). An organization's new observations past this many
            waiting are answered refused L{QUEUE_FULL} and not queued
            (decisions D13, amended); one queued before is answered as
            before all the same. The organization's queue calls take turns
            (an advisory lock for the transaction), so that two at once
            cannot both count room that only one of them has: queueing
            never makes more than this many wait.
        """
        if not observations:
            return []

        def insert(cursor: Cursor) -> list[QueuedObservation]:
            queued: dict[int, QueuedObservation] = {}
            # Before any row lock: no deletion of these agents runs until
            # this commits.
            lockAgents(cursor, ((each.scope.orgID, each.scope.agentID) for each in observations))
            # One organization's observations together, in a stable order;
            # answered in the order given.
            ordered = sorted(
                enumerate(observations), key=lambda pair: (str(pair[1].scope.orgID), pair[1].key)
            )
            for orgID, group in itertools.groupby(ordered, key=lambda pair: pair[1].scope.orgID):
                held = list(group)
                cursor.execute("SELECT set_config('svc.org_id', %s, true)", (str(orgID),))
                room = None if maxWaitingPerOrg is None else _room(cursor, orgID, maxWaitingPerOrg)
                # The copies of these waiting now, locked: a worker's
                # transaction finishing one (its row deleted, its key
                # remembered) is waited for, so that the statements of
                # _queueObservation, each on a snapshot of its own, see it
                # done rather than queue it again (two extractions paid).
                # One finishing later waits for this commit.
                cursor.execute(
                    "SELECT 1 FROM memory_observations"
                    " WHERE org_id = %s AND observation_key = ANY(%s)"
                    " ORDER BY observation_key FOR UPDATE",
                    (orgID, [each.key for _, each in held]),
                )
                forgotten = forgottenAmong(cursor, orgID, [each for _, each in held])
                for (index, observation), gone in zip(held, forgotten, strict=True):
                    if gone:
                        queued[index] = QueuedObservation(
                            observation.requestID, None, False, observation.key, FORGOTTEN
                        )
                    elif room is None or room > 0:
                        queued[index] = _queueObservation(cursor, observation)
                        if room is not None and queued[index].queuedNow:
                            room -= 1
                    else:
                        queued[index] = _queuedBefore(cursor, observation) or QueuedObservation(
                            observation.requestID, None, False, observation.key, QUEUE_FULL
                        )
            return [queued[index] for index in range(len(observations))]

        return self._run("observation_queue", insert, None)

    def claimObservations(
        self, owner: str, leaseSeconds: float, limit: int
    ) -> list[ClaimedObservation]:
        """
        Lease up to C{limit} due observations of any organization to
        C{owner} (C{svc_claim_observations}, sql/0009_memory.sql).
        """

        def claim(cursor: Cursor) -> list[ClaimedObservation]:
            cursor.execute(
                "SELECT * FROM svc_claim_observations(%s, %s, %s)", (owner, leaseSeconds, limit)
            )
            return [
                ClaimedObservation(
                    observationID=row["id"],
                    scope=Scope(row["org_id"], row["agent_id"], row["subject"]),
                    requestID=row["request_id"],
                    messages=messagesFromJSON(row["messages"]),
                    attempts=row["attempts"],
                    leaseExpiresAt=row["lease_expires_at"],
                    leaseToken=row["lease_token"],
                )
                for row in cursor.fetchall()
            ]

        return self._run("observation_claim", claim, None)

    def completeObservation(
        self,
        orgID: uuid.UUID,
        observationID: uuid.UUID,
        owner: str,
        leaseToken: uuid.UUID | None = None,
    ) -> bool:
        """
        A processed observation is deleted, and its request remembered as
        done (L{_finishing}). False when C{owner} (and, given
        C{leaseToken}, that claim) no longer holds its lease (it ran out
        and another claim may hold it now): the row is left to that claim.

        @raise MemoryNotFound: no observation has this id (done already,
            or dropped).
        @raise MemoryForbidden: it is another organization's.
        """

        def remove(cursor: Cursor) -> bool:
            cursor.execute(
                _finishing(
                    "id = %s AND org_id = %s AND lease_owner = %s"
                    " AND (%s::uuid IS NULL OR lease_token = %s)"
                ),
                (observationID, orgID, owner, leaseToken, leaseToken),
            )
            if cursor.fetchone() is not None:
                return True
            cursor.execute("SELECT 1 FROM memory_observations WHERE id = %s", (observationID,))
            if cursor.fetchone() is not None:
                return False
            _refuse(cursor, "svc_observation_exists", observationID)
            raise AssertionError("unreachable")

        return self._run("observation_complete", remove, orgID)

    def releaseObservation(
        self,
        orgID: uuid.UUID,
        observationID: uuid.UUID,
        owner: str,
        release: ObservationRelease,
        leaseToken: uuid.UUID | None = None,
    ) -> bool:
        """
        Hand back a claimed observation: waiting again after
        C{release.retryAfter} seconds, or failed for good. False when
        C{owner} (and, given C{leaseToken}, that claim) no longer holds its
        lease.

        @raise MemoryNotFound: no observation has this id.
        @raise MemoryForbidden: it is another organization's.
        """

        def hand(cursor: Cursor) -> bool:
            cursor.execute(
                "UPDATE memory_observations SET lease_owner = NULL, lease_expires_at = NULL,"
                " lease_token = NULL, attempts = attempts + %s, state = %s, reason = %s,"
                " next_attempt_at = now() + make_interval(secs => %s), updated_at = now()"
                " WHERE id = %s AND org_id = %s AND lease_owner = %s"
                " AND (%s::uuid IS NULL OR lease_token = %s) RETURNING id",
                (
                    1 if release.countAttempt else 0,
                    "failed" if release.failed else "waiting",
                    release.reason or None,
                    release.retryAfter,
                    observationID,
                    orgID,
                    owner,
                    leaseToken,
                    leaseToken,
                ),
            )
            if cursor.fetchone() is not None:
                return True
            cursor.execute("SELECT 1 FROM memory_observations WHERE id = %s", (observationID,))
            if cursor.fetchone() is not None:
                return False
            _refuse(cursor, "svc_observation_exists", observationID)
            raise AssertionError("unreachable")

        return self._run("observation_release", hand, orgID)

    def renewObservationLease(
        self,
        orgID: uuid.UUID,
        observationID: uuid.UUID,
        owner: str,
        leaseToken: uuid.UUID,
        leaseSeconds: float,
        scope: Scope | None = None,
    ) -> datetime.datetime | None:
        """
        Extend the lease of an observation still being processed to
        C{leaseSeconds} from now, if the claim named by C{owner} and
        C{leaseToken} still holds it (sql/0013_observation_lease_token.sql).
        In the organization's context: a worker renews only the rows of
        the organization it names, as it completes and releases them.

        A lease that ran out is renewed too when no claim took it since
        (the token is unchanged): nobody else has worked on it. A claim
        racing this renewal locks the row first or waits for it; either
        way one of them sees the other's token.

        @param scope: the observation's, when the caller knows it: a gone
            observation is then told forgotten (L{ObservationForgotten}).
        @return: when the renewed lease ends; None when the lease is no
            longer this claim's (the worker must abandon the observation).
        @raise MemoryNotFound: no observation has this id (done, dropped
            or forgotten).
        @raise MemoryForbidden: it is another organization's.
        """

        def renew(cursor: Cursor) -> datetime.datetime | None:
            cursor.execute(
                "UPDATE memory_observations"
                " SET lease_expires_at = now() + make_interval(secs => %s)"
                " WHERE id = %s AND org_id = %s AND lease_owner = %s AND lease_token = %s"
                " AND state = 'waiting' RETURNING lease_expires_at",
                (leaseSeconds, observationID, orgID, owner, leaseToken),
            )
            row = cursor.fetchone()
            if row is not None:
                expiresAt: datetime.datetime = row["lease_expires_at"]
                return expiresAt
            cursor.execute("SELECT 1 FROM memory_observations WHERE id = %s", (observationID,))
            if cursor.fetchone() is not None:
                return None
            if scope is not None:
                _refuseObservation(cursor, observationID, scope)
            _refuse(cursor, "svc_observation_exists", observationID)
            raise AssertionError("unreachable")

        return self._run("observation_renew", renew, orgID)

    # Jobs, for operators (svcctl memory jobs).

    def listJobs(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None, limit: int
    ) -> list[ObservationJob]:
        """
        The organization's observations not yet done (waiting or failed),
        the next due first, failed ones last: never their messages.
        """

        def query(cursor: Cursor) -> list[ObservationJob]:
            cursor.execute(
                "SELECT id, agent_id, subject, state, attempts, reason, next_attempt_at"
                " FROM memory_observations WHERE org_id = %s"
                " AND (%s::uuid IS NULL OR agent_id = %s::uuid)"
                " ORDER BY state = 'failed', next_attempt_at, id LIMIT %s",
                (orgID, agentID, agentID, limit),
            )
            return [
                ObservationJob(
                    observationID=row["id"],
                    agentID=row["agent_id"],
                    subject=row["subject"],
                    state=row["state"],
                    attempts=row["attempts"],
                    reason=row["reason"],
                    nextAttemptAt=row["next_attempt_at"],
                )
                for row in cursor.fetchall()
            ]

        return self._run("observation_jobs", query, orgID)

    def retryJob(self, orgID: uuid.UUID, observationID: uuid.UUID) -> ObservationJob:
        """
        Make an observation due now with its attempts counted from zero
        again (a failed one waits again). A lease a worker holds is left to
        it: the worker's own release decides what comes next.

        @raise MemoryNotFound: the organization has no such observation.
        """

        def update(cursor: Cursor) -> ObservationJob:
            cursor.execute(
                "UPDATE memory_observations SET state = 'waiting', attempts = 0,"
                " reason = NULL, next_attempt_at = now(), updated_at = now()"
                " WHERE id = %s AND org_id = %s"
                " RETURNING id, agent_id, subject, state, attempts, reason, next_attempt_at",
                (observationID, orgID),
            )
            row = cursor.fetchone()
            if row is None:
                raise MemoryNotFound("no such observation")
            return ObservationJob(
                observationID=row["id"],
                agentID=row["agent_id"],
                subject=row["subject"],
                state=row["state"],
                attempts=row["attempts"],
                reason=row["reason"],
                nextAttemptAt=row["next_attempt_at"],
            )

        return self._run("observation_retry", update, orgID)

    def dropJob(self, orgID: uuid.UUID, observationID: uuid.UUID) -> None:
        """
        Delete an observation, processed or not (a worker holding it finds
        it gone when it completes, and removes the memories it added).

        @raise MemoryNotFound: the organization has no such observation.
        """

        def delete(cursor: Cursor) -> None:
            cursor.execute(
                "DELETE FROM memory_observations WHERE id = %s AND org_id = %s RETURNING id",
                (observationID, orgID),
            )
            if cursor.fetchone() is None:
                raise MemoryNotFound("no such observation")

        self._run("observation_drop", delete, orgID)

    def pruneDone(self, retentionSeconds: float, limit: int = 10_000) -> int:
        """
        Forget processed observations older than C{retentionSeconds}, at
        most C{limit} of them, over every organization; how many.
        """

        def prune(cursor: Cursor) -> int:
            cursor.execute(
                "SELECT svc_prune_observations_done(%s, %s) AS pruned", (retentionSeconds, limit)
            )
            return int(_one(cursor.fetchone())["pruned"])

        return self._run("observations_prune", prune, None)

    def pruneFailed(self, retentionSeconds: float, limit: int = 10_000) -> int:
        """
        Delete observations failed for good whose failure is older than
        C{retentionSeconds} (SVC_MEMORY_FAILED_RETENTION), at most C{limit}
        of them, over every organization; how many. Their messages are
        content, kept only for svcctl memory jobs retry (decisions D13,
        amended).
        """

        def prune(cursor: Cursor) -> int:
            cursor.execute(
                "SELECT svc_prune_observations_failed(%s, %s) AS pruned",
                (retentionSeconds, limit),
            )
            return int(_one(cursor.fetchone())["pruned"])

        return self._run("observations_prune_failed", prune, None)

    def observationsWaiting(self) -> int:
        """
        How many observations wait, over every organization.
        """

        def query(cursor: Cursor) -> int:
            cursor.execute("SELECT svc_observations_waiting() AS waiting")
            return int(_one(cursor.fetchone())["waiting"])

        return self._run("observations_waiting", query, None)


def _queueObservation(cursor: Cursor, observation: NewObservation) -> QueuedObservation:
    """
    Queue one observation, in its organization's context, unless one of
    the same key is waiting or was processed within the retention
    (L{MemoryStore.queueObservations}).
    """
    orgID, key = observation.scope.orgID, observation.key
    cursor.execute(
        "INSERT INTO memory_observations"
        " (id, org_id, agent_id, subject, request_id, observation_key, messages, ended_at)"
        " SELECT %s, %s, %s, %s, %s, %s, %s::jsonb, least(coalesce(%s::timestamptz, now()), now())"
        " WHERE NOT EXISTS (SELECT 1 FROM memory_observations_done"
        " WHERE org_id = %s AND observation_key = %s)"
        " ON CONFLICT (org_id, observation_key) DO NOTHING RETURNING id",
        (
            uuid7(),
            orgID,
            observation.scope.agentID,
            observation.scope.subject,
            observation.requestID,
            key,
            messagesJSON(observation.messages),
            observation.endedAt,
            orgID,
            key,
        ),
    )
    row = cursor.fetchone()
    if row is not None:
        return QueuedObservation(observation.requestID, row["id"], True, key)
    # Queued before: waiting (or failed) still, or processed within the
    # retention.
    before = _queuedBefore(cursor, observation)
    if before is None:
        raise StoreUnavailable("an observation neither queued nor found")
    return before


def _queuedBefore(cursor: Cursor, observation: NewObservation) -> QueuedObservation | None:
    """
    The observation of the same key as C{observation}, waiting (or failed)
    still or processed within the retention, as queued before; None when
    there is none.
    """
    orgID, key = observation.scope.orgID, observation.key
    cursor.execute(
        "SELECT id FROM memory_observations WHERE org_id = %s AND observation_key = %s"
        " UNION ALL SELECT observation_id FROM memory_observations_done"
        " WHERE org_id = %s AND observation_key = %s LIMIT 1",
        (orgID, key, orgID, key),
    )
    row = cursor.fetchone()
    if row is None:
        return None
    return QueuedObservation(observation.requestID, row["id"], False, key)


def _room(cursor: Cursor, orgID: uuid.UUID, maxWaiting: int) -> int:
    """
    How many more observations the organization may have waiting, its
    queue calls made to take turns first (L{MemoryStore.queueObservations}).
    The count stops at C{maxWaiting}: an index-only scan of at most that
    many entries of memory_observations_org_due (sql/0018).
    """
    cursor.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, %s))",
        (str(orgID), _QUEUE_LOCK_SEED),
    )
    cursor.execute(
        "SELECT count(*) AS waiting FROM (SELECT 1 FROM memory_observations"
        " WHERE org_id = %s AND state = 'waiting' LIMIT %s) AS counted",
        (orgID, maxWaiting),
    )
    return maxWaiting - int(_one(cursor.fetchone())["waiting"])


def _finishing(condition: str) -> str:
    """
    The statement that finishes the observation C{condition} selects (a
    constant of this module, with its parameters): its row deleted and its
    key (sql/0015; its request id beside it) remembered in
    memory_observations_done (sql/0014), in one statement, so that a
    resent copy is not queued again while the record lasts; it answers
    the deleted row's id.
    """
    return (
        f"WITH gone AS (DELETE FROM memory_observations WHERE {condition}"
        " RETURNING id, org_id, request_id, observation_key),"
        " done AS (INSERT INTO memory_observations_done"
        " (org_id, request_id, observation_key, observation_id)"
        " SELECT org_id, request_id, observation_key, id FROM gone ON CONFLICT DO NOTHING)"
        " SELECT id FROM gone"
    )


def _one(row: dict[str, Any] | None) -> dict[str, Any]:
    if row is None:
        raise StoreUnavailable("a statement that returns a row returned none")
    return row


def _lockScope(cursor: Cursor, scope: Scope) -> None:
    cursor.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, %s))",
        (f"{scope.orgID}:{scope.agentID}:{scope.subject}", _SCOPE_LOCK_SEED),
    )


def _checkLength(
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
    held = _scopeLength(cursor, scope, embedding.model, memoryID)
    if held is not None and held != embedding.dimensions:
        raise InvalidMemory("embedding", OTHER_LENGTH)


def _scopeLength(
    cursor: Cursor, scope: Scope, model: str, memoryID: uuid.UUID | None = None
) -> int | None:
    """
    The length of the scope's newest vector of C{model} other than
    C{memoryID}'s (L{_checkLength}), None when it holds none.
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
        _refuse(cursor, "svc_memory_exists", memoryID)
    return _one(row)


def _refuse(cursor: Cursor, existence: str, identifier: uuid.UUID) -> None:
    """
    Raise why an id was not found in the caller's scope: it exists
    elsewhere (L{MemoryForbidden}) or nowhere (L{MemoryNotFound}).
    """
    cursor.execute(f"SELECT {existence}(%s) AS found", (identifier,))
    if _one(cursor.fetchone())["found"]:
        raise MemoryForbidden("the id belongs to another organization, agent or subject")
    raise MemoryNotFound("no such id")


def _refuseObservation(cursor: Cursor, observationID: uuid.UUID, scope: Scope) -> None:
    """
    Raise why an observation of C{scope} was not found: forgotten
    (L{ObservationForgotten}), or as L{_refuse} says.
    """
    cursor.execute("SELECT svc_observation_exists(%s) AS found", (observationID,))
    if _one(cursor.fetchone())["found"]:
        raise MemoryForbidden("the id belongs to another organization")
    if forgottenSince(cursor, scope, observationID):
        raise ObservationForgotten("the observation was forgotten")
    raise MemoryNotFound("no such id")


def _addExtracted(
    cursor: Cursor,
    scope: Scope,
    sourceRequestID: str,
    memories: Sequence[tuple[str, Embedding]],
    maxPerScope: int,
) -> list[MemoryRecord]:
    """
    The additions of L{MemoryStore.storeExtracted}, under the scope's lock
    (taken by the caller).
    """
    if not memories:
        return []
    cursor.execute(
        f"SELECT {_MEMORY_COLUMNS} FROM memories"
        " WHERE org_id = %s AND source = 'extracted' AND source_request_id = %s"
        " AND agent_id = %s AND subject = %s ORDER BY created_at DESC, id DESC",
        (scope.orgID, sourceRequestID, scope.agentID, scope.subject),
    )
    # The oldest of each content last, so that it wins, as add's LIMIT 1 of
    # the oldest does.
    held = {row["content"]: _memory(row) for row in cursor.fetchall()}
    cursor.execute(
        "SELECT count(*) AS held FROM memories"
        " WHERE org_id = %s AND agent_id = %s AND subject = %s",
        (scope.orgID, scope.agentID, scope.subject),
    )
    count = _one(cursor.fetchone())["held"]
    records = []
    # Each length of each model checked once: after the first insert, the
    # scope's newest memory of the model is one of these.
    checked = set()
    for content, embedding in memories:
        if content in held:
            records.append(held[content])
            continue
        if count >= maxPerScope:
            raise ScopeFull(f"the scope holds {maxPerScope} memories already")
        if (embedding.model, embedding.dimensions) not in checked:
            _checkLength(cursor, scope, embedding)
            checked.add((embedding.model, embedding.dimensions))
        # Stamped after the scope's lock (svcd.memory.extracted).
        cursor.execute(
            "INSERT INTO memories (id, org_id, agent_id, subject, content, metadata,"
            " source, source_request_id, embedding_model, dimensions, vector, created_at,"
            " updated_at)"
            " SELECT %s, %s, %s, %s, %s, '{}'::jsonb, %s, %s, %s, %s, %s, stamp, stamp"
            " FROM clock_timestamp() AS stamp"
            f" RETURNING {_MEMORY_COLUMNS}",
            (
                uuid7(),
                scope.orgID,
                scope.agentID,
                scope.subject,
                content,
                EXTRACTED,
                sourceRequestID,
                embedding.model,
                embedding.dimensions,
                embedding.vector,
            ),
        )
        record = _memory(_one(cursor.fetchone()))
        held[content] = record
        records.append(record)
        count += 1
    return records


def _deleteObservations(cursor: Cursor, condition: str, parameters: tuple[Any, ...]) -> int:
    """
    Delete the waiting observations C{condition} selects, locked first in
    the order queueing locks them (L{MemoryStore.queueObservations}: by
    key), in one statement (one snapshot: a second statement would reach
    rows committed in between, in the table's order), so that a deletion
    of a scope and a resent batch holding several of its observations
    never wait for each other in a cycle, which PostgreSQL ends by
    aborting one; how many.
    """
    cursor.execute(
        "DELETE FROM memory_observations WHERE id IN (SELECT id FROM memory_observations"
        f" WHERE {condition} ORDER BY observation_key FOR UPDATE)",
        parameters,
    )
    return cursor.rowcount


def _deleteScope(cursor: Cursor, scope: Scope) -> tuple[int, int]:
    # Observations first: a worker storing one of them holds its row (see
    # MemoryStore.storeExtracted), so this waits for it and then deletes
    # its memories too, or deletes the observation before it stores.
    observations = _deleteObservations(
        cursor,
        "org_id = %s AND agent_id = %s AND subject = %s",
        (scope.orgID, scope.agentID, scope.subject),
    )
    cursor.execute(
        "DELETE FROM memories WHERE org_id = %s AND agent_id = %s AND subject = %s",
        (scope.orgID, scope.agentID, scope.subject),
    )
    return cursor.rowcount, observations
