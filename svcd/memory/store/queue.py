"""
The queue of observations (sql/0009_memory.sql's memory_observations):
conversations queued once per key within their organization's bound,
claimed by svc-worker in turn across organizations
(C{svc_claim_observations}, sql/0018_fair_claims.sql), counted, and the
records of those done or failed pruned.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence

from svcd.common.ids import uuid7
from svcd.memory.forgetting import FORGOTTEN, forgottenAmong, lockAgents
from svcd.memory.records import (
    ClaimedObservation,
    NewObservation,
    QueuedObservation,
    messagesFromJSON,
    messagesJSON,
)
from svcd.memory.store.base import BaseStore, Cursor, StoreUnavailable, oneRow
from svcd.memoryclient.records import QUEUE_FULL, Scope

# An arbitrary constant naming "an organization's queue of observations"
# in the key of the advisory lock that makes its queue calls take turns
# (L{ObservationQueueStore.queueObservations}).
_QUEUE_LOCK_SEED = 0x5EC_0918


class ObservationQueueStore(BaseStore):
    """
    The observations waiting for svc-worker.
    """

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

    def observationsWaiting(self) -> int:
        """
        How many observations wait, over every organization.
        """

        def query(cursor: Cursor) -> int:
            cursor.execute("SELECT svc_observations_waiting() AS waiting")
            return int(oneRow(cursor.fetchone())["waiting"])

        return self._run("observations_waiting", query, None)

    def pruneDone(self, retentionSeconds: float, limit: int = 10_000) -> int:
        """
        Forget processed observations older than C{retentionSeconds}, at
        most C{limit} of them, over every organization; how many.
        """

        def prune(cursor: Cursor) -> int:
            cursor.execute(
                "SELECT svc_prune_observations_done(%s, %s) AS pruned", (retentionSeconds, limit)
            )
            return int(oneRow(cursor.fetchone())["pruned"])

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
            return int(oneRow(cursor.fetchone())["pruned"])

        return self._run("observations_prune_failed", prune, None)


def _queueObservation(cursor: Cursor, observation: NewObservation) -> QueuedObservation:
    """
    Queue one observation, in its organization's context, unless one of
    the same key is waiting or was processed within the retention
    (L{ObservationQueueStore.queueObservations}).
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
    queue calls made to take turns first (L{ObservationQueueStore.queueObservations}).
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
    return maxWaiting - int(oneRow(cursor.fetchone())["waiting"])
