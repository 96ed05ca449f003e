"""
Forgetting reaches every copy (decisions D13, amended;
sql/0017_forgetting.sql, svcd/memory/forgetting.py), against a real
PostgreSQL: a deletion of one memory, of a scope or of a whole agent is
final for every observation of an answer that ended at or before it,
whether it waits, is being processed, or reaches svc-memory afterwards;
the deletions keep no subject; observations failed for good are deleted
after their retention.
"""

from __future__ import annotations

import datetime
import threading
import uuid

import grpc
import psycopg
import pytest
from authfixtures import Tenant, ownerStore
from memoryfixtures import appConnection, embedding, scopeOf, secondAgent, storeOn, within
from memoryservice import RunningMemoryService
from psycopg.rows import dict_row

from svcd.auth.store import Store
from svcd.common.migrations import migrate
from svcd.memory.extracted import Plan
from svcd.memory.forgetting import FORGOTTEN, recordDeletion
from svcd.memory.records import NewObservation, QueuedObservation
from svcd.memory.store import MemoryStore
from svcd.memory.store.base import MemoryNotFound, ObservationForgotten
from svcd.memory.store.leases import ObservationRelease
from svcd.memoryclient.records import FORGOTTEN_DETAILS, ObservedMessage, Scope
from svcd.pb.memory.v1 import memory_pb2

UTC = datetime.UTC


def said(
    scope: Scope, key: str, endedAt: datetime.datetime | None, text: str = "I live in Oslo"
) -> NewObservation:
    return NewObservation(scope, f"req-{key}", (ObservedMessage("user", text),), key, endedAt)


def databaseNow(dsn: str) -> datetime.datetime:
    with psycopg.connect(dsn, autocommit=True) as connection:
        row = connection.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        moment: datetime.datetime = row[0]
        return moment


def queue(store: MemoryStore, *observations: NewObservation) -> list[QueuedObservation]:
    return store.queueObservations(list(observations))


def waitingKeys(dsn: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        return {
            row[0]
            for row in connection.execute(
                "SELECT observation_key FROM memory_observations"
            ).fetchall()
        }


def add(store: MemoryStore, scope: Scope, content: str) -> uuid.UUID:
    return store.add(scope, content, "{}", "api", None, embedding([1.0, 0.0]), 100).memoryID


def test_anObservationSaidBeforeItsScopesDeletionIsForgotten(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant
) -> None:
    """
    After a scope's deletion, an observation of it whose answer ended
    before (a journal replayed at a proxy's restart) is refused
    C{"forgotten"}, with no id, and nothing of it is stored; one that ended
    after it, or that names no end (the time it is queued), is queued; one
    of another subject is not concerned. A deletion of a scope that held
    nothing yet counts as much.
    """
    scope, other = scopeOf(acme, "ann@example.com"), scopeOf(acme, "bob")
    before = databaseNow(migratedDSN)
    assert memoryStore.deleteScope(scope) == (0, 0)
    after = databaseNow(migratedDSN)
    old, otherOld, new, unsaid = queue(
        memoryStore,
        said(scope, "old", before, "my secret is 42"),
        said(other, "other", before),
        said(scope, "new", after),
        said(scope, "unsaid", None),
    )
    assert old == QueuedObservation("req-old", None, False, "old", FORGOTTEN)
    assert otherOld.queuedNow and new.queuedNow and unsaid.queuedNow
    assert waitingKeys(migratedDSN) == {"other", "new", "unsaid"}
    # Sent again, it is refused again.
    assert queue(memoryStore, said(scope, "old", before))[0].refused == FORGOTTEN
    # A second deletion moves the line: what was queued after the first
    # and ended before the second is deleted with the scope, and refused
    # when it comes again.
    assert memoryStore.deleteScope(scope) == (0, 2)
    assert queue(memoryStore, said(scope, "new", after))[0].refused == FORGOTTEN


def test_aPurgeForgetsEverySubjectOfTheAgent(
    memoryStore: MemoryStore, migratedDSN: str, owner: Store, acme: Tenant
) -> None:
    """
    svcctl memory purge without --subject is final for every subject of
    the agent, the shared one included, and for no other agent.
    """
    otherAgent = Scope(acme.orgID, secondAgent(owner, acme), "ann")
    before = databaseNow(migratedDSN)
    memoryStore.purge(acme.orgID, acme.agentID)
    answers = queue(
        memoryStore,
        said(scopeOf(acme, "ann"), "a", before),
        said(scopeOf(acme), "b", before),
        said(otherAgent, "c", before),
    )
    assert [each.refused for each in answers] == [FORGOTTEN, FORGOTTEN, ""]
    assert waitingKeys(migratedDSN) == {"c"}


def test_deletingOneMemoryIsFinalForWhatItsScopeSaidBefore(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant
) -> None:
    """
    Deleting one memory records a deletion of its scope: the scope's
    waiting observations that ended before it are deleted with it (one
    might bring the fact back), another subject's are kept, and an
    observation of the scope said before it and sent after it is refused;
    one said after is queued. A deletion that fails (no such memory)
    records nothing.
    """
    scope = scopeOf(acme, "ann")
    memoryID = add(memoryStore, scope, "lives in Oslo")
    before = databaseNow(migratedDSN)
    queue(memoryStore, said(scope, "waiting", before), said(scopeOf(acme, "bob"), "bob", before))
    with pytest.raises(MemoryNotFound):
        memoryStore.delete(scope, uuid.uuid4())
    assert waitingKeys(migratedDSN) == {"waiting", "bob"}
    memoryStore.delete(scope, memoryID)
    assert waitingKeys(migratedDSN) == {"bob"}
    after = databaseNow(migratedDSN)
    late, fresh = queue(memoryStore, said(scope, "late", before), said(scope, "fresh", after))
    assert (late.refused, fresh.refused, fresh.queuedNow) == (FORGOTTEN, "", True)


def test_anEndAheadOfTheQueueingIsTakenAsTheQueueing(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant
) -> None:
    """
    An answer cannot end after it reaches svc-memory: an end ahead of the
    queueing (a proxy's clock ahead) counts as the queueing's time, so
    that it cannot escape a deletion made after it arrived.
    """
    scope = scopeOf(acme, "ann")
    memoryID = add(memoryStore, scope, "lives in Oslo")
    queue(memoryStore, said(scope, "ahead", datetime.datetime(2100, 1, 1, tzinfo=UTC)))
    memoryStore.delete(scope, memoryID)
    assert waitingKeys(migratedDSN) == set()


def test_anObservationForgottenWhileProcessedStoresNothing(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant
) -> None:
    """
    A worker that claimed an observation before its scope's deletion and
    stores after it stores nothing, and is told it was forgotten (its
    lease renewal too, given the scope); one dropped by an operator is
    only not found.
    """
    scope, other = scopeOf(acme, "ann"), scopeOf(acme, "bob")
    queue(memoryStore, said(scope, "taken", None), said(other, "dropped", None))
    claimed = {each.requestID: each for each in memoryStore.claimObservations("w", 60.0, 10)}
    memoryStore.dropJob(acme.orgID, claimed["req-dropped"].observationID)
    memoryStore.deleteScope(scope)
    taken = claimed["req-taken"]
    assert taken.leaseToken is not None
    with pytest.raises(ObservationForgotten):
        memoryStore.storeExtracted(
            acme.orgID,
            taken.observationID,
            "w",
            taken.leaseToken,
            scope,
            "req-taken",
            Plan.additions([("lives in Oslo", embedding([1.0, 0.0]))]),
            100,
        )
    with pytest.raises(ObservationForgotten):
        memoryStore.renewObservationLease(
            acme.orgID, taken.observationID, "w", taken.leaseToken, 60.0, scope
        )
    assert memoryStore.listMemories(scope, 10) == ([], False)
    dropped = claimed["req-dropped"]
    assert dropped.leaseToken is not None
    with pytest.raises(MemoryNotFound) as raised:
        memoryStore.storeExtracted(
            acme.orgID,
            dropped.observationID,
            "w",
            dropped.leaseToken,
            other,
            "req-dropped",
            Plan.additions([]),
            100,
        )
    assert not isinstance(raised.value, ObservationForgotten)


def test_aQueueingWaitsForADeletionUnderWay(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant
) -> None:
    """
    A batch queued while a deletion of its agent is under way waits for
    it, then sees it: an observation said before it is refused, never
    queued behind the deletion's back.
    """
    scope = scopeOf(acme, "ann")
    before = databaseNow(migratedDSN)
    answers: list[list[QueuedObservation]] = []
    with appConnection(migratedDSN) as deleting:
        with deleting.transaction():
            deleting.execute("SELECT set_config('svc.org_id', %s, true)", (str(acme.orgID),))
            with deleting.cursor(row_factory=dict_row) as cursor:
                recordDeletion(cursor, acme.orgID, acme.agentID, "ann")
            sending = threading.Thread(
                target=lambda: answers.append(queue(memoryStore, said(scope, "race", before)))
            )
            sending.start()
            with psycopg.connect(migratedDSN, autocommit=True) as watching:
                within(
                    10,
                    lambda: (
                        watching.execute(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                            " AND wait_event = 'advisory' AND application_name = 'memory-test'"
                        ).fetchone()
                        == (1,)
                    ),
                )
        sending.join(10)
    assert not sending.is_alive()
    assert [each.refused for each in answers[0]] == [FORGOTTEN]
    assert waitingKeys(migratedDSN) == set()


def test_deletionsKeepNoSubject(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant, globex: Tenant
) -> None:
    """
    A deletion is kept under a digest of its scope: the subject is in no
    table afterwards. Under row-level security an organization sees only
    its own deletions.
    """
    subject = "forget-" + uuid.uuid4().hex[:12] + "@example.com"
    scope = scopeOf(acme, subject)
    add(memoryStore, scope, "likes tea")
    memoryStore.deleteScope(scope)
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        tables = [
            row[0]
            for row in connection.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
            ).fetchall()
        ]
        holding = [
            table
            for table in tables
            if connection.execute(
                f'SELECT count(*) FROM "{table}" AS row WHERE row::text LIKE %s',
                (f"%{subject.split('@')[0]}%",),
            ).fetchone()
            != (0,)
        ]
        assert holding == []
        assert connection.execute("SELECT count(*) FROM memory_deletions").fetchone() == (1,)
    with appConnection(migratedDSN) as app, app.transaction():
        app.execute("SELECT set_config('svc.org_id', %s, true)", (str(globex.orgID),))
        assert app.execute("SELECT count(*) FROM memory_deletions").fetchone() == (0,)


def test_failedObservationsAreDeletedAfterTheirRetention(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant
) -> None:
    """
    An observation failed for good keeps its messages for svcctl memory
    jobs retry until its failure is older than the retention; then the
    prune deletes it. Waiting ones, however old, are left alone.
    """
    scope = scopeOf(acme, "ann")
    queue(memoryStore, said(scope, "failed", None), said(scope, "waiting", None))
    claimed = {each.requestID: each for each in memoryStore.claimObservations("w", 60.0, 10)}
    failed = claimed["req-failed"]
    assert memoryStore.releaseObservation(
        acme.orgID,
        failed.observationID,
        "w",
        ObservationRelease(0.0, True, True, "extraction: bad answer"),
        failed.leaseToken,
    )
    assert memoryStore.pruneFailed(3600.0) == 0
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        connection.execute(
            "UPDATE memory_observations SET updated_at = now() - interval '2 hours',"
            " created_at = now() - interval '3 hours'"
        )
    assert memoryStore.pruneFailed(3600.0) == 1
    assert memoryStore.pruneFailed(3600.0) == 0
    assert waitingKeys(migratedDSN) == {"waiting"}
    with pytest.raises(MemoryNotFound):
        memoryStore.retryJob(acme.orgID, failed.observationID)


def test_theListenerDeletesFailedObservations(migratedDSN: str, acme: Tenant) -> None:
    """
    svc-memory's periodic prune (its change listener's, with the processed
    ones') deletes failed observations past SVC_MEMORY_FAILED_RETENTION.
    """
    service = RunningMemoryService(migratedDSN, failedRetention=60.0).start()
    try:
        queue(service.store, said(scopeOf(acme), "failed", None))
        [claimed] = service.store.claimObservations("w", 60.0, 1)
        service.store.releaseObservation(
            acme.orgID,
            claimed.observationID,
            "w",
            ObservationRelease(0.0, True, True, "failed"),
            claimed.leaseToken,
        )
        with psycopg.connect(migratedDSN, autocommit=True) as connection:
            connection.execute(
                "UPDATE memory_observations SET updated_at = now() - interval '61 seconds'"
            )
        within(5.0, lambda: waitingKeys(migratedDSN) == set())
    finally:
        service.stop()


def test_queueObservationsAnswersForgottenOverGrpc(
    memoryService: RunningMemoryService, migratedDSN: str, acme: Tenant
) -> None:
    """
    Over gRPC: Observation.ended_at is read as RFC 3339; an observation
    said before its scope's deletion is answered refused C{"forgotten"}
    with an empty id; StoreObservation of one forgotten while a worker
    held it is NOT_FOUND with the details that tell svc-worker so; an
    ended_at that is no time is INVALID_ARGUMENT naming it.
    """
    where = memory_pb2.Scope(org_id=str(acme.orgID), agent_id=str(acme.agentID), subject="ann")

    def observation(key: str, endedAt: str) -> memory_pb2.Observation:
        return memory_pb2.Observation(
            scope=where,
            request_id=f"req-{key}",
            key=key,
            ended_at=endedAt,
            messages=[memory_pb2.ObservedMessage(role="user", content="I live in Oslo")],
        )

    stub = memoryService.stub
    stub.QueueObservations(
        memory_pb2.QueueObservationsRequest(observations=[observation("held", "")]), timeout=10
    )
    [held] = stub.ClaimObservations(
        memory_pb2.ClaimObservationsRequest(owner="w", limit=1, lease_seconds=60), timeout=10
    ).observations
    stub.DeleteScope(memory_pb2.DeleteScopeRequest(scope=where), timeout=10)
    [forgotten, kept] = stub.QueueObservations(
        memory_pb2.QueueObservationsRequest(
            observations=[
                observation("old", "2026-01-01T00:00:00.000Z"),
                observation("new", "2100-01-01T00:00:00Z"),
            ]
        ),
        timeout=10,
    ).queued
    assert (forgotten.refused, forgotten.id, forgotten.queued_now) == (FORGOTTEN, "", False)
    assert (forgotten.key, forgotten.org_id) == ("old", str(acme.orgID))
    assert (kept.refused, kept.queued_now) == ("", True) and kept.id
    with pytest.raises(grpc.RpcError) as raised:
        stub.StoreObservation(
            memory_pb2.StoreObservationRequest(
                org_id=str(acme.orgID),
                id=held.id,
                owner="w",
                lease_token=held.lease_token,
                lease_seconds=60,
                scope=where,
                request_id="req-held",
                dedupe_score=0.9,
            ),
            timeout=10,
        )
    assert (raised.value.code(), raised.value.details()) == (
        grpc.StatusCode.NOT_FOUND,
        FORGOTTEN_DETAILS,
    )
    with pytest.raises(grpc.RpcError) as invalid:
        stub.QueueObservations(
            memory_pb2.QueueObservationsRequest(observations=[observation("bad", "yesterday")]),
            timeout=10,
        )
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "observations[0].ended_at" in invalid.value.details()


def test_rowsQueuedBeforeTheMigrationEndWhenTheyWereQueued(databaseDSN: str) -> None:
    """
    An observation queued before sql/0017 has no end: its queueing's time
    stands for it, and deleting one memory of its scope afterwards deletes
    it.
    """
    migrate(databaseDSN, through="0015_observation_key.sql")
    store, connection = ownerStore(databaseDSN)
    try:
        orgID = store.createOrganization("before")
        agentID = store.createAgent(orgID, "before-agent").agentID
        connection.execute(
            "INSERT INTO memory_observations"
            " (id, org_id, agent_id, subject, request_id, observation_key, messages)"
            " VALUES (%s, %s, %s, 'ann', 'req-old', 'old', '[]')",
            (uuid.uuid4(), orgID, agentID),
        )
        assert "0017_forgetting.sql" in migrate(databaseDSN)
        with storeOn(databaseDSN) as memoryStore:
            scope = Scope(orgID, agentID, "ann")
            memoryStore.delete(scope, add(memoryStore, scope, "lives in Oslo"))
        assert waitingKeys(databaseDSN) == set()
    finally:
        connection.close()
