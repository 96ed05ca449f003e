"""
Deletions are final for everything said before them (decisions D13,
amended, "Forgetting reaches every copy"; sql/0017_forgetting.sql).

Each deletion (one memory, a scope, an agent's purge) leaves its time in
memory_deletions, under a digest of its scope (never the subject itself),
and in the same transaction deletes the waiting observations it covers.
Queueing drops an observation whose answer ended at or before a deletion
of its scope or its agent (L{FORGOTTEN}). Together these leave no
observation said before a deletion anywhere in svc-memory after it:

  - one queued before the deletion waits in memory_observations, and the
    deletion deletes it (a scope's or an agent's deletion deletes all
    their waiting observations, as before; one memory's deletion those of
    its scope that ended at or before it);
  - one that reaches svc-memory after the deletion is refused at queueing;
  - one a worker holds is deleted under it, and its StoreObservation,
    which locks its row, finds it gone and stores nothing.

The race between a deletion and a queueing of the same agent is closed by
a transaction-scoped advisory lock on the agent: a deletion takes it
alone (before any row lock), queueing shares it (for every agent of its
batch, before any row lock). A queueing that commits first has its
observations deleted by the deletion, which waits for it; one that comes
after reads the deletion's committed time. A deletion's time is read once
it holds the lock (C{clock_timestamp()}, not C{now()}, the transaction's
start: a deletion that waited for a queueing is later than what that
queueing committed).

Times: an observation's end is the proxy's clock (Observation.ended_at),
a deletion's the database's. The hosts are assumed to be kept in sync
(NTP); an answer that ended within their skew of a deletion may be
dropped or kept. An end later than the queueing (a proxy's clock ahead)
is taken as the queueing's time: an observation cannot end after it
arrives, and a clock far ahead must not let one escape every deletion.
"""

from __future__ import annotations

import datetime
import hashlib
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

from svcd.memory.records import NewObservation
from svcd.memoryclient.records import Scope

__all__ = [
    "FORGOTTEN",
    "agentDigest",
    "forgottenAmong",
    "forgottenSince",
    "lockAgents",
    "recordDeletion",
    "scopeDigest",
]

Cursor = psycopg.Cursor[dict[str, Any]]

# QueuedObservation.refused for an observation dropped by a deletion, and
# the outcome it is counted under (svc_proxy_memory_observations_total,
# svc_worker_observations_total).
FORGOTTEN = "forgotten"

# An arbitrary constant naming "forgetting an agent" in the key of the
# advisory lock deletions and queueing take (another than the scope's
# lock of svcd.memory.store).
_AGENT_LOCK_SEED = 0x5EC_0917

_SCOPE_MARKER = b"svc-memory-deletion:scope\x00"
_AGENT_MARKER = b"svc-memory-deletion:agent\x00"


def scopeDigest(scope: Scope) -> bytes:
    """
    The key of a scope's deletions: SHA-256 over its organization, agent
    and subject (a subject holds no NUL and comes last, so the bytes are
    unambiguous). Not the subject: a forgotten user must not stay named.
    """
    return hashlib.sha256(
        _SCOPE_MARKER + scope.orgID.bytes + scope.agentID.bytes + scope.subject.encode("utf-8")
    ).digest()


def agentDigest(orgID: uuid.UUID, agentID: uuid.UUID) -> bytes:
    """
    The key of a whole agent's deletions (svcctl memory purge without
    --subject), apart from every scope's by its marker.
    """
    return hashlib.sha256(_AGENT_MARKER + orgID.bytes + agentID.bytes).digest()


def _lockKey(orgID: uuid.UUID, agentID: uuid.UUID) -> str:
    return f"{orgID}:{agentID}"


def lockAgents(cursor: Cursor, agents: Iterable[tuple[uuid.UUID, uuid.UUID]]) -> None:
    """
    Share the forgetting lock of each (organization, agent): taken by
    queueing before any row lock, so that no deletion of these agents
    runs until it commits, and none it must see is uncommitted. Shared
    locks never wait for each other, so their order does not matter.
    """
    keys = sorted({_lockKey(orgID, agentID) for orgID, agentID in agents})
    if keys:
        cursor.execute(
            "SELECT count(pg_advisory_xact_lock_shared(hashtextextended(agent, %s)))"
            " FROM unnest(%s::text[]) AS agent",
            (_AGENT_LOCK_SEED, keys),
        )


def recordDeletion(
    cursor: Cursor, orgID: uuid.UUID, agentID: uuid.UUID, subject: str | None
) -> datetime.datetime:
    """
    Record a deletion of the scope (C{subject} None: of the whole agent)
    in the deleting transaction, in the organization's context: the
    agent's forgetting lock first, alone, before any row lock; then the
    database's time, which the row keeps unless a later one is there; the
    time is answered, for the deletion of the observations it covers.
    """
    cursor.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s, %s))",
        (_lockKey(orgID, agentID), _AGENT_LOCK_SEED),
    )
    digest = (
        agentDigest(orgID, agentID)
        if subject is None
        else scopeDigest(Scope(orgID, agentID, subject))
    )
    cursor.execute("SELECT clock_timestamp() AS at")
    row = cursor.fetchone()
    assert row is not None
    at: datetime.datetime = row["at"]
    cursor.execute(
        "INSERT INTO memory_deletions AS held (org_id, agent_id, scope_digest, deleted_at)"
        " VALUES (%s, %s, %s, %s) ON CONFLICT (org_id, scope_digest)"
        " DO UPDATE SET deleted_at = greatest(held.deleted_at, excluded.deleted_at)",
        (orgID, agentID, digest, at),
    )
    return at


def forgottenAmong(
    cursor: Cursor, orgID: uuid.UUID, observations: Sequence[NewObservation]
) -> list[bool]:
    """
    Whether each of one organization's observations is forgotten: its
    answer ended (at most now, see the module's docstring) at or before
    the latest deletion of its scope or of its agent. In the
    organization's context, after L{lockAgents}.
    """
    if not observations:
        return []
    digests: dict[bytes, None] = {}
    for each in observations:
        digests[scopeDigest(each.scope)] = None
        digests[agentDigest(each.scope.orgID, each.scope.agentID)] = None
    cursor.execute(
        "SELECT scope_digest, deleted_at, now() AS now FROM memory_deletions"
        " WHERE org_id = %s AND scope_digest = ANY(%s)",
        (orgID, list(digests)),
    )
    rows = cursor.fetchall()
    if not rows:
        return [False] * len(observations)
    now: datetime.datetime = rows[0]["now"]
    deleted = {bytes(row["scope_digest"]): row["deleted_at"] for row in rows}
    answers = []
    for each in observations:
        ended = now if each.endedAt is None else min(each.endedAt, now)
        latest = [
            at
            for at in (
                deleted.get(scopeDigest(each.scope)),
                deleted.get(agentDigest(each.scope.orgID, each.scope.agentID)),
            )
            if at is not None
        ]
        answers.append(bool(latest) and ended <= max(latest))
    return answers


def forgottenSince(cursor: Cursor, scope: Scope, observationID: uuid.UUID) -> bool:
    """
    Whether an observation found gone was forgotten rather than dropped
    (svcctl memory jobs drop): a deletion of its scope or agent is
    recorded at or after it was queued (the time of its id, a UUID v7,
    svc-memory's clock). Only tells what a worker counts it as.
    """
    queuedAt = datetime.datetime.fromtimestamp((observationID.int >> 80) / 1000, datetime.UTC)
    cursor.execute(
        "SELECT 1 FROM memory_deletions WHERE org_id = %s AND scope_digest = ANY(%s)"
        " AND deleted_at >= %s LIMIT 1",
        (
            scope.orgID,
            [scopeDigest(scope), agentDigest(scope.orgID, scope.agentID)],
            queuedAt,
        ),
    )
    return cursor.fetchone() is not None
