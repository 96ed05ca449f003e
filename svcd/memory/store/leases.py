"""
An observation svc-worker claimed, under its lease
(sql/0013_observation_lease_token.sql): completed, handed back, its lease
renewed, or its memories stored with its completion in one transaction.
Completing one remembers its key as done (sql/0014, sql/0015), so that a
copy sent again is not queued again.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Sequence

import attrs

from svcd.common.ids import uuid7
from svcd.memory.extracted import OtherScope, Plan, Stored, recentRows, updateExtracted
from svcd.memory.forgetting import forgottenSince
from svcd.memory.records import EXTRACTED, OTHER_LENGTH, MemoryRecord
from svcd.memory.store.base import (
    BaseStore,
    Cursor,
    MemoryForbidden,
    MemoryNotFound,
    ObservationForgotten,
    ScopeFull,
    oneRow,
    refuse,
)
from svcd.memory.store.cacheloads import MICROS, CachedRow
from svcd.memory.store.memories import MEMORY_COLUMNS, checkLength, lockScope, memoryRecord
from svcd.memoryclient.records import Embedding, InvalidMemory, Scope


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


class LeasesStore(BaseStore):
    """
    The observations svc-worker holds.
    """

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
            refuse(cursor, "svc_observation_exists", observationID)
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
            refuse(cursor, "svc_observation_exists", observationID)
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
            refuse(cursor, "svc_observation_exists", observationID)
            raise AssertionError("unreachable")

        return self._run("observation_renew", renew, orgID)

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
        syncNonce: str | None = None,
        written: Callable[[Sequence[CachedRow]], None] | None = None,
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
        (L{svcd.memory.store.deletions}): it either waits for this
        transaction and then deletes its memories, or deletes the
        observation first and this one finds it gone.

        Under the lock the plan is made (L{Plan.writes}: the cache's
        nearest and the scope's memories written in the last seconds, read
        here), so that two observations of the same fact stored at once,
        through one replica or two, make one memory
        (L{svcd.memory.extracted}). Its updates are made (one of a memory
        deleted meanwhile is dropped, never added back), then its additions
        as L{svcd.memory.store.memories.MemoriesStore.add} adds one: once
        per request and content (one the scope already holds from this
        request with this content is answered instead), within the cap.

        @param syncNonce: the sync marker to send once everything is
            written, in this transaction (L{svcd.memory.search.Searcher.expectWrite}).
        @param written: told the rows added, as the change listener would
            read them, before the transaction commits
            (L{svcd.memory.vectorcache.VectorCache.expectWritten}).
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
            lockScope(cursor, scope)
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
            records = _addExtracted(cursor, own, sourceRequestID, adds, maxPerScope, written)
            if syncNonce is None:
                cursor.execute(_finishing("id = %s"), (observationID,))
            else:
                # The marker after the changes: their notifications were
                # sent by the statements above (sql/0019_notify_ids.sql).
                cursor.execute(
                    _finishing("id = %s", sync=True), (observationID, f"sync:{syncNonce}")
                )
            return Stored(records, updated, dropped)

        return self._run("observation_store", store, orgID)


def _finishing(condition: str, sync: bool = False) -> str:
    """
    The statement that finishes the observation C{condition} selects (a
    constant of this module, with its parameters): its row deleted and its
    key (sql/0015; its request id beside it) remembered in
    memory_observations_done (sql/0014), in one statement, so that a
    resent copy is not queued again while the record lasts; it answers
    the deleted row's id. With C{sync}, it also sends the payload of one
    more parameter on the change listeners' channel.
    """
    notify = ", pg_notify('svc_memory_changes', %s)" if sync else ""
    return (
        f"WITH gone AS (DELETE FROM memory_observations WHERE {condition}"
        " RETURNING id, org_id, request_id, observation_key),"
        " done AS (INSERT INTO memory_observations_done"
        " (org_id, request_id, observation_key, observation_id)"
        " SELECT org_id, request_id, observation_key, id FROM gone ON CONFLICT DO NOTHING)"
        f" SELECT id{notify} FROM gone"
    )


def _refuseObservation(cursor: Cursor, observationID: uuid.UUID, scope: Scope) -> None:
    """
    Raise why an observation of C{scope} was not found: forgotten
    (L{ObservationForgotten}), or as L{svcd.memory.store.base.refuse} says.
    """
    cursor.execute("SELECT svc_observation_exists(%s) AS found", (observationID,))
    if oneRow(cursor.fetchone())["found"]:
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
    written: Callable[[Sequence[CachedRow]], None] | None = None,
) -> list[MemoryRecord]:
    """
    The additions of L{LeasesStore.storeExtracted}, under the scope's lock
    (taken by the caller): what the scope holds from this request, its
    count and its newest vector's length read in one statement, the new
    memories written in another, and told to C{written} as the change
    listener would read them back.
    """
    if not memories:
        return []
    model = memories[0][1].model
    cursor.execute(
        f"SELECT scope.held, scope.newest, mine.* FROM (SELECT"
        " (SELECT count(*) FROM memories"
        " WHERE org_id = %s AND agent_id = %s AND subject = %s) AS held,"
        " (SELECT dimensions FROM memories WHERE org_id = %s AND agent_id = %s"
        " AND subject = %s AND embedding_model = %s"
        " ORDER BY created_at DESC, id DESC LIMIT 1) AS newest) AS scope"
        f" LEFT JOIN LATERAL (SELECT {MEMORY_COLUMNS} FROM memories"
        " WHERE org_id = %s AND source = 'extracted' AND source_request_id = %s"
        " AND agent_id = %s AND subject = %s) AS mine ON true"
        " ORDER BY mine.created_at DESC, mine.id DESC",
        (
            *(scope.orgID, scope.agentID, scope.subject),
            *(scope.orgID, scope.agentID, scope.subject, model),
            *(scope.orgID, sourceRequestID, scope.agentID, scope.subject),
        ),
    )
    rows = cursor.fetchall()
    count = oneRow(rows[0] if rows else None)["held"]
    # The oldest of each content last, so that it wins, as add's LIMIT 1 of
    # the oldest does.
    held = {row["content"]: memoryRecord(row) for row in rows if row["id"] is not None}
    fresh: dict[str, Embedding] = {}
    for content, embedding in memories:
        if content not in held and content not in fresh:
            fresh[content] = embedding
    if not fresh:
        return [held[content] for content, _ in memories]
    if count + len(fresh) > maxPerScope:
        raise ScopeFull(f"the scope holds {maxPerScope} memories already")
    # Each length of each model checked once: the scope's newest vector of
    # the model has the length every other one has, and those added here
    # are of one length (StoreObservation checks).
    lengths: dict[str, set[int]] = {}
    for each in fresh.values():
        lengths.setdefault(each.model, set()).add(each.dimensions)
    for embedding in {each.model: each for each in fresh.values()}.values():
        if len(lengths[embedding.model]) > 1:
            # Two lengths of one model: one of them is not the other's.
            raise InvalidMemory("embedding", OTHER_LENGTH)
        if embedding.model != model:
            checkLength(cursor, scope, embedding)
        elif rows[0]["newest"] not in (None, embedding.dimensions):
            raise InvalidMemory("embedding", OTHER_LENGTH)
    ids = [uuid7() for _ in fresh]
    # One statement for them all, stamped after the scope's lock
    # (svcd.memory.extracted); the ids, made in order, order them as
    # their creation did.
    cursor.execute(
        "INSERT INTO memories (id, org_id, agent_id, subject, content, metadata,"
        " source, source_request_id, embedding_model, dimensions, vector, created_at,"
        " updated_at)"
        " SELECT new.id, %s, %s, %s, new.content, '{}'::jsonb, %s, %s, new.model,"
        " new.dimensions, new.vector, stamp, stamp"
        " FROM unnest(%s::uuid[], %s::text[], %s::text[], %s::integer[], %s::bytea[])"
        " AS new (id, content, model, dimensions, vector), clock_timestamp() AS stamp"
        f" RETURNING {MEMORY_COLUMNS}, {MICROS}",
        (
            scope.orgID,
            scope.agentID,
            scope.subject,
            EXTRACTED,
            sourceRequestID,
            ids,
            list(fresh),
            [each.model for each in fresh.values()],
            [each.dimensions for each in fresh.values()],
            [each.vector for each in fresh.values()],
        ),
    )
    inserted = {row["id"]: row for row in cursor.fetchall()}
    rowsForCache = []
    for (content, embedding), memoryID in zip(fresh.items(), ids, strict=True):
        row = inserted[memoryID]
        held[content] = record = memoryRecord(row)
        rowsForCache.append(
            CachedRow(
                memoryID=memoryID,
                agentID=scope.agentID,
                subject=scope.subject,
                model=embedding.model,
                dimensions=embedding.dimensions,
                createdMicros=row["created_micros"],
                vector=embedding.vector,
                content=content,
                record=record,
            )
        )
    if written is not None:
        written(rowsForCache)
    return [held[content] for content, _ in memories]
