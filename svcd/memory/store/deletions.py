"""
Forgetting (svcd/memory/forgetting.py): a memory, a scope or an agent
deleted with the waiting observations the deletion covers, and the
deletion recorded, in one transaction.
"""

from __future__ import annotations

import uuid
from typing import Any

from svcd.memory.forgetting import recordDeletion
from svcd.memory.store.base import BaseStore, Cursor, refuse
from svcd.memoryclient.records import Scope


class DeletionsStore(BaseStore):
    """
    Deletions, through the API and svcctl.
    """

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
                refuse(cursor, "svc_memory_exists", memoryID)
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


def _deleteObservations(cursor: Cursor, condition: str, parameters: tuple[Any, ...]) -> int:
    """
    Delete the waiting observations C{condition} selects, locked first in
    the order queueing locks them (by key:
    L{svcd.memory.store.queue.ObservationQueueStore.queueObservations}),
    in one statement (one snapshot: a second statement would reach
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
    # LeasesStore.storeExtracted), so this waits for it and then deletes
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
