"""
The observations not yet done, as an operator sees and handles them
(svcctl memory jobs [retry|drop]): never their messages.
"""

from __future__ import annotations

import datetime
import uuid

import attrs

from svcd.memory.store.base import BaseStore, Cursor, MemoryNotFound


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


class JobsStore(BaseStore):
    """
    svcctl memory jobs.
    """

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
