"""
What svc-worker's memories of one observation become (decisions D13, step
3: the scope's nearest memory at or above C{dedupe_score} takes the new
content, else a new memory), planned so that the same fact in
observations processed at the same time becomes one memory.

Two StoreObservation calls of one scope, on one replica or two, are made
one after the other by the scope's advisory lock
(L{svcd.memory.store.MemoryStore.storeExtracted}), and each plans under
it. A plan compares each memory with two sets: the replica's cache's
nearest memory (L{svcd.memory.search.Searcher.nearest}, asked before the
transaction, so that a cache miss never needs a second connection while
the lock is held), and every memory of the scope written since
L{RECENT_WINDOW} before that question, read from PostgreSQL under the
lock. A cache lags PostgreSQL by at most a second (D13): what it may not
hold yet was written within the window, and what the other call just
committed is read. The extracted writes stamp C{updated_at} with
C{clock_timestamp()}, after the lock, so that time spent waiting for it
never pushes a write out of the window.

A memory the cache still holds but that was deleted meanwhile is not
written back (D13 amended: "The worker never writes back a memory that was
deleted while it worked"): its update finds no row and is dropped; the
deletion was the user's wish.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy

from svcd.memory.ranking import Hit
from svcd.memory.records import MemoryRecord
from svcd.memoryclient.records import Embedding, Scope

# How far before the cache was asked the plan reads the scope's recent
# writes from PostgreSQL: D13's second of cache lag, with room for a
# clock of svc-memory's host ahead of PostgreSQL's and an API add's wait
# for the scope's lock (stamped at its transaction's start, within
# SVC_DB_STATEMENT_TIMEOUT's 5 s of its commit). Only the writes of these
# seconds are read: a scope written many times a second reads that many.
RECENT_WINDOW = datetime.timedelta(seconds=10)


class OtherScope(Exception):
    """
    The observation is not of the scope the call named: nothing was
    written; plan again for C{scope}, the observation's own.
    """

    def __init__(self, scope: Scope) -> None:
        super().__init__("the observation is of another agent or subject")
        self.scope = scope


@attrs.frozen
class RecentRow:
    """
    A memory of the scope written within the window: its id and vector.
    """

    memoryID: uuid.UUID
    model: str
    vector: bytes = attrs.field(repr=False)


@attrs.frozen
class Write:
    """
    One write of a plan: C{target} takes the content (None: added).
    """

    target: uuid.UUID | None
    content: str
    embedding: Embedding
    unit: Any = attrs.field(repr=False)


@attrs.frozen
class Stored:
    """
    What L{svcd.memory.store.MemoryStore.storeExtracted} wrote: the records
    added (in the order planned), how many memories took a new content,
    and how many updates were dropped for a memory deleted meanwhile.
    """

    added: list[MemoryRecord]
    updated: int = 0
    dropped: int = 0


@attrs.frozen
class _Memory:
    content: str
    embedding: Embedding
    unit: Any = attrs.field(repr=False)
    cached: Hit | None


class Plan:
    """
    One observation's memories, each with its cache's nearest, to be
    planned under the scope's lock (L{writes}).

    @param memories: contents and embeddings, in the worker's order.
    @param nearest: the replica's nearest memory of the scope at or above
        C{dedupeScore} for an embedding (None: none), asked here.
    @param since: when the cache was asked, less L{RECENT_WINDOW}: the
        scope's memories written since are read from PostgreSQL.
    """

    def __init__(
        self,
        memories: Sequence[tuple[str, Embedding]],
        dedupeScore: float,
        nearest: Callable[[Embedding], Hit | None] | None,
        since: datetime.datetime,
    ) -> None:
        self.since = since
        self.models = sorted({embedding.model for _, embedding in memories})
        self._dedupeScore = dedupeScore
        self._memories = [
            _Memory(content, embedding, unit(embedding), nearest(embedding) if nearest else None)
            for content, embedding in memories
        ]

    @classmethod
    def additions(cls, memories: Sequence[tuple[str, Embedding]]) -> Plan:
        """
        Every memory added, none compared (a dedupe score above any).
        """
        return cls(memories, 2.0, None, datetime.datetime.now(datetime.UTC))

    def writes(self, recent: Sequence[RecentRow]) -> list[Write]:
        """
        What each memory becomes, as if each were stored before the next
        was searched: the scope's nearest memory at or above the dedupe
        score (the cache's, or one of C{recent}, scored afresh) takes its
        content, unless one of this observation's earlier memories is at
        least as near, which then takes it instead; else it is added.
        """
        recentIDs = {row.memoryID for row in recent}
        matrices = _unitMatrices(recent)
        writes: list[Write] = []
        for memory in self._memories:
            earlier, earlierScore = -1, -2.0
            for index, write in enumerate(writes):
                score = float(numpy.dot(memory.unit, write.unit))
                if score > earlierScore:
                    earlier, earlierScore = index, score
            target, foundScore = self._nearest(memory, matrices, recentIDs)
            if earlier >= 0 and earlierScore >= self._dedupeScore and earlierScore >= foundScore:
                writes[earlier] = attrs.evolve(
                    writes[earlier],
                    content=memory.content,
                    embedding=memory.embedding,
                    unit=memory.unit,
                )
                continue
            if target is not None:
                same = [index for index, write in enumerate(writes) if write.target == target]
                if same:
                    writes[same[0]] = attrs.evolve(
                        writes[same[0]],
                        content=memory.content,
                        embedding=memory.embedding,
                        unit=memory.unit,
                    )
                else:
                    writes.append(Write(target, memory.content, memory.embedding, memory.unit))
                continue
            writes.append(Write(None, memory.content, memory.embedding, memory.unit))
        return writes

    def _nearest(
        self,
        memory: _Memory,
        matrices: dict[tuple[str, int], tuple[list[uuid.UUID], Any]],
        recentIDs: set[uuid.UUID],
    ) -> tuple[uuid.UUID | None, float]:
        """
        The nearest memory at or above the dedupe score and its score
        (None and -2 for none): the cache's, unless written within the
        window (then scored from its current vector), or one of those.
        """
        target, best = None, -2.0
        cached = memory.cached
        if cached is not None and cached.memoryID not in recentIDs:
            target, best = cached.memoryID, cached.score
        found = matrices.get((memory.embedding.model, memory.embedding.dimensions))
        if found is not None:
            ids, units = found
            scores = units @ memory.unit
            index = int(numpy.argmax(scores))
            score = float(scores[index])
            if score >= self._dedupeScore and score > best:
                target, best = ids[index], score
        return target, best


def _unitMatrices(
    recent: Sequence[RecentRow],
) -> dict[tuple[str, int], tuple[list[uuid.UUID], Any]]:
    """
    The recent rows' ids and unit vectors (one matrix, a row each), by
    model and dimensions.
    """
    grouped: dict[tuple[str, int], list[RecentRow]] = {}
    for row in recent:
        grouped.setdefault((row.model, len(row.vector) // 4), []).append(row)
    matrices = {}
    for (model, dimensions), rows in grouped.items():
        vectors = numpy.frombuffer(b"".join(row.vector for row in rows), dtype="<f4")
        vectors = vectors.reshape(len(rows), dimensions).astype(numpy.float64)
        norms = numpy.linalg.norm(vectors, axis=1)
        norms[norms == 0] = 1.0
        matrices[(model, dimensions)] = ([row.memoryID for row in rows], vectors / norms[:, None])
    return matrices


def unit(embedding: Embedding) -> Any:
    vector = numpy.frombuffer(embedding.vector, dtype="<f4").astype(numpy.float64)
    norm = float(numpy.linalg.norm(vector))
    return vector / norm if norm else vector


def recentRows(
    cursor: Any, scope: Scope, since: datetime.datetime, models: Sequence[str]
) -> list[RecentRow]:
    """
    The scope's memories made by one of C{models} written since C{since}:
    read in binary and as tuples, on a cursor of C{cursor}'s connection
    (so in its transaction), since a scope written many times a second
    has dozens, each a vector (hex in text, and a dictionary per row).
    """
    if not models:
        return []
    with cursor.connection.cursor(binary=True) as raw:
        raw.execute(
            "SELECT id, embedding_model, vector FROM memories"
            " WHERE org_id = %s AND agent_id = %s AND subject = %s"
            " AND updated_at >= %s AND embedding_model = ANY(%s)",
            (scope.orgID, scope.agentID, scope.subject, since, list(models)),
        )
        return [
            RecentRow(memoryID, model, bytes(vector)) for memoryID, model, vector in raw.fetchall()
        ]


def updateExtracted(cursor: Any, scope: Scope, writes: Sequence[Write]) -> tuple[int, int]:
    """
    The updates of a plan (each C{target} takes its write's content and
    vector), under the scope's lock; how many were made and how many
    dropped because their memory was deleted meanwhile.
    """
    updated = dropped = 0
    for write in writes:
        cursor.execute(
            "UPDATE memories SET content = %s, embedding_model = %s, dimensions = %s,"
            " vector = %s, updated_at = clock_timestamp()"
            " WHERE id = %s AND org_id = %s AND agent_id = %s AND subject = %s RETURNING id",
            (
                write.content,
                write.embedding.model,
                write.embedding.dimensions,
                write.embedding.vector,
                write.target,
                scope.orgID,
                scope.agentID,
                scope.subject,
            ),
        )
        if cursor.fetchone() is None:
            dropped += 1
        else:
            updated += 1
    return updated, dropped
