"""
svc-memory's store against a real PostgreSQL (sql/0009_memory.sql,
decisions D13): memories kept, listed, changed and forgotten in their
scope; the scope's cap under concurrency; row-level security enforced by
the database itself; observations queued once per request id and leased.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from authfixtures import Tenant, ownerStore
from memoryfixtures import (
    MODEL,
    appConnection,
    embedding,
    scopeOf,
    secondAgent,
    storeOn,
    vectorBytes,
    within,
)

from svcd.auth.store import Store
from svcd.common.migrations import migrate
from svcd.common.pgtransactions import StoreRejected
from svcd.memory.extracted import Plan
from svcd.memory.records import ClaimedObservation, MemoryRecord, NewObservation, QueuedObservation
from svcd.memory.store import MemoryStore
from svcd.memory.store.base import MemoryForbidden, MemoryNotFound, ScopeFull
from svcd.memory.store.leases import ObservationRelease, _finishing
from svcd.memoryclient.records import Embedding, ObservedMessage, Scope


def add(
    store: MemoryStore, scope: Scope, content: str, values: list[float] | None = None
) -> uuid.UUID:
    record = store.add(
        scope, content, "{}", "api", None, embedding(values or [1.0, 0.0]), maxPerScope=100
    )
    return record.memoryID


def test_addThenGetGivesTheMemoryBack(memoryStore: MemoryStore, acme: Tenant) -> None:
    """
    A memory added is read back with its content, metadata, source, model
    and dimensions, and its two timestamps equal.
    """
    scope = scopeOf(acme, "user-1")
    added = memoryStore.add(
        scope,
        "likes tea",
        '{"b":1,"a":"x"}',
        "extracted",
        "req-1",
        embedding([0.5, 0.5, 0.0]),
        maxPerScope=10,
    )
    got = memoryStore.get(scope, added.memoryID)
    assert got == added
    assert (got.content, got.metadata, got.source, got.sourceRequestID) == (
        "likes tea",
        '{"a":"x","b":1}',
        "extracted",
        "req-1",
    )
    assert (got.embeddingModel, got.dimensions, got.subject) == (MODEL, 3, "user-1")
    assert got.createdAt == got.updatedAt
    assert got.memoryID.version == 7


def test_anotherScopesIdIsForbiddenAnUnknownOneNotFound(
    memoryStore: MemoryStore, owner: Store, acme: Tenant, globex: Tenant
) -> None:
    """
    An id of another organization, another agent or another subject is
    refused as forbidden, by get, update and delete alike; an id nobody
    holds is not found; the memory itself is untouched.
    """
    scope = scopeOf(acme, "u")
    memoryID = add(memoryStore, scope, "secret plan")
    strangers = [
        scopeOf(globex, "u"),
        Scope(acme.orgID, secondAgent(owner, acme), "u"),
        scopeOf(acme, "v"),
    ]
    for stranger in strangers:
        with pytest.raises(MemoryForbidden):
            memoryStore.get(stranger, memoryID)
        with pytest.raises(MemoryForbidden):
            memoryStore.update(stranger, memoryID, "changed", None, embedding([0.0, 1.0]))
        with pytest.raises(MemoryForbidden):
            memoryStore.delete(stranger, memoryID)
        with pytest.raises(MemoryForbidden):
            memoryStore.listMemories(stranger, 10, after=memoryID)
    unknown = uuid.uuid4()
    for call in (
        lambda: memoryStore.get(scope, unknown),
        lambda: memoryStore.delete(scope, unknown),
        lambda: memoryStore.update(scope, unknown, None, "{}", None),
        lambda: memoryStore.listMemories(scope, 10, after=unknown),
    ):
        with pytest.raises(MemoryNotFound):
            call()
    assert memoryStore.get(scope, memoryID).content == "secret plan"


def test_listIsNewestFirstAndPagesWithAfter(memoryStore: MemoryStore, acme: Tenant) -> None:
    """
    A scope's memories list newest first; C{after} continues past the
    memory it names, and C{has_more} says whether another page follows.
    Other subjects' memories never appear.
    """
    scope = scopeOf(acme)
    ids = [add(memoryStore, scope, f"fact {number}") for number in range(5)]
    add(memoryStore, scopeOf(acme, "other"), "not mine")
    first, more = memoryStore.listMemories(scope, 2)
    assert [each.memoryID for each in first] == [ids[4], ids[3]] and more
    second, more = memoryStore.listMemories(scope, 2, after=first[-1].memoryID)
    assert [each.memoryID for each in second] == [ids[2], ids[1]] and more
    third, more = memoryStore.listMemories(scope, 2, after=second[-1].memoryID)
    assert [each.memoryID for each in third] == [ids[0]] and not more


def test_updateChangesContentVectorAndMetadata(memoryStore: MemoryStore, acme: Tenant) -> None:
    """
    An update changes what it names (metadata alone keeps the content and
    vector; content comes with its new vector) and moves updated_at on.
    """
    scope = scopeOf(acme)
    memoryID = add(memoryStore, scope, "old", [1.0, 0.0])
    onlyMetadata = memoryStore.update(scope, memoryID, None, '{"k":"v"}', None)
    assert (onlyMetadata.content, onlyMetadata.metadata) == ("old", '{"k":"v"}')
    changed = memoryStore.update(scope, memoryID, "new", None, embedding([0.0, 1.0, 0.0], "m2"))
    assert (changed.content, changed.metadata, changed.embeddingModel, changed.dimensions) == (
        "new",
        '{"k":"v"}',
        "m2",
        3,
    )
    assert changed.updatedAt > changed.createdAt
    rows = memoryStore.rowsForCache(acme.orgID, [memoryID])
    assert rows[memoryID].vector == vectorBytes([0.0, 1.0, 0.0])
    # The listener's row carries the record as a reader sees it, and the
    # load of a scope's records reads the same.
    assert rows[memoryID].record == changed == memoryStore.get(scope, memoryID)
    assert memoryStore.scopeRecords(scope) == [changed]


def test_theCapHoldsUnderConcurrentAdds(memoryStore: MemoryStore, acme: Tenant) -> None:
    """
    Eight adds at once to a scope one short of its cap: exactly one is
    stored, the others are refused as full, and the scope holds exactly
    the cap. Another subject of the same agent is not affected.
    """
    scope = scopeOf(acme, "capped")
    cap = 5
    for number in range(cap - 1):
        memoryStore.add(scope, f"m{number}", "{}", "api", None, embedding([1.0]), cap)
    start = threading.Barrier(8)
    outcomes: list[str] = []
    lock = threading.Lock()

    def adder(number: int) -> None:
        start.wait()
        try:
            memoryStore.add(scope, f"racer {number}", "{}", "api", None, embedding([1.0]), cap)
            outcome = "stored"
        except ScopeFull:
            outcome = "full"
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=adder, args=(number,)) for number in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes) == ["full"] * 7 + ["stored"]
    memories, _ = memoryStore.listMemories(scope, 100)
    assert len(memories) == cap
    with pytest.raises(ScopeFull):
        memoryStore.add(scope, "one more", "{}", "api", None, embedding([1.0]), cap)
    memoryStore.add(scopeOf(acme, "elsewhere"), "fine", "{}", "api", None, embedding([1.0]), cap)


def test_anExtractedMemoryIsAddedOncePerRequestAndContent(
    memoryStore: MemoryStore, acme: Tenant
) -> None:
    """
    svc-worker's adds are idempotent (decisions D13): an extracted memory
    added again from the same request with the same content, at once from
    eight threads too, is the memory first added (same id), one row;
    another content, another request, another subject or the API's
    source each make a memory of their own.
    """
    scope = scopeOf(acme, "user-1")

    def extracted(content: str, request: str = "req-1", where: Scope = scope) -> uuid.UUID:
        record = memoryStore.add(
            where, content, "{}", "extracted", request, embedding([1.0, 0.0]), maxPerScope=100
        )
        return record.memoryID

    first = extracted("lives in Paris")
    assert extracted("lives in Paris") == first
    start = threading.Barrier(8)
    ids: list[uuid.UUID] = []

    def racer() -> None:
        start.wait()
        ids.append(extracted("likes tea"))

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(ids) == 8 and len(set(ids)) == 1
    others = {
        extracted("lives in Rome"),
        extracted("lives in Paris", "req-2"),
        extracted("lives in Paris", where=scopeOf(acme, "user-2")),
        memoryStore.add(
            scope, "lives in Paris", "{}", "api", "req-1", embedding([1.0, 0.0]), 100
        ).memoryID,
    }
    assert len(others) == 4 and not others & {first, ids[0]}
    memories, _ = memoryStore.listMemories(scope, 100)
    assert sorted(each.content for each in memories) == [
        "likes tea",
        "lives in Paris",
        "lives in Paris",
        "lives in Paris",
        "lives in Rome",
    ]


def test_anObservationsMemoriesAreStoredWithItsCompletionOncePerContent(
    memoryStore: MemoryStore, acme: Tenant
) -> None:
    """
    storeExtracted adds an observation's memories and deletes the
    observation in one transaction, for the claim holding its lease: each
    memory once per request and content (the same content twice in one
    call, or one added before by add, is the memory first added). For a
    stale token nothing is added and the observation stays; for a batch
    the scope's cap cannot hold, nothing is added and the observation
    stays; for an observation gone, MemoryNotFound.
    """
    scope = scopeOf(acme, "batch")

    def claimed(requestID: str) -> ClaimedObservation:
        memoryStore.queueObservations(
            [NewObservation(scope, requestID, (ObservedMessage("user", "x"),))]
        )
        [held] = memoryStore.claimObservations("worker-1", 60.0, 1)
        assert held.leaseToken is not None
        return held

    def store(
        held: ClaimedObservation,
        memories: list[tuple[str, Embedding]],
        token: uuid.UUID | None = None,
        cap: int = 100,
    ) -> list[MemoryRecord] | None:
        stored = memoryStore.storeExtracted(
            acme.orgID,
            held.observationID,
            "worker-1",
            token or held.leaseToken or uuid.uuid4(),
            scope,
            held.requestID,
            Plan.additions(memories),
            cap,
        )
        return None if stored is None else stored.added

    single = memoryStore.add(
        scope, "likes tea", "{}", "extracted", "req-1", embedding([1.0, 0.0]), maxPerScope=100
    )
    first = claimed("req-1")
    assert store(first, [("lives in Paris", embedding([0.0, 1.0]))], token=uuid.uuid4()) is None
    assert memoryStore.listMemories(scope, 100)[0] == [single]
    records = store(
        first,
        [
            ("lives in Paris", embedding([0.0, 1.0])),
            ("likes tea", embedding([1.0, 0.0])),
            ("lives in Paris", embedding([0.0, 1.0])),
        ],
    )
    assert records is not None
    assert records[1].memoryID == single.memoryID
    assert records[0].memoryID == records[2].memoryID
    assert {each.source for each in records} == {"extracted"}
    with pytest.raises(MemoryNotFound):
        store(first, [("lives in Paris", embedding([0.0, 1.0]))])
    second = claimed("req-2")
    with pytest.raises(ScopeFull):
        store(
            second,
            [("new one", embedding([1.0, 1.0])), ("another", embedding([1.0, -1.0]))],
            cap=3,
        )
    assert memoryStore.observationsWaiting() == 1
    memories, _ = memoryStore.listMemories(scope, 100)
    assert sorted(each.content for each in memories) == ["likes tea", "lives in Paris"]
    assert store(second, []) == []
    assert memoryStore.observationsWaiting() == 0


def test_anAgentOfAnotherOrganizationIsRefused(
    memoryStore: MemoryStore, acme: Tenant, globex: Tenant
) -> None:
    """
    A memory cannot name another organization's agent: the foreign key
    refuses it, row-level security or not.
    """
    with pytest.raises(StoreRejected):
        add(memoryStore, Scope(acme.orgID, globex.agentID), "misfiled")


def test_deleteScopeForgetsMemoriesAndObservations(memoryStore: MemoryStore, acme: Tenant) -> None:
    """
    Deleting a scope removes its memories and waiting observations, says
    how many of each, and leaves other subjects alone.
    """
    scope, other = scopeOf(acme, "a"), scopeOf(acme, "b")
    for number in range(3):
        add(memoryStore, scope, f"fact {number}")
    kept = add(memoryStore, other, "other subject")
    memoryStore.queueObservations(
        [NewObservation(scope, "req-1", (ObservedMessage("user", "hello"),))]
    )
    assert memoryStore.deleteScope(scope) == (3, 1)
    assert memoryStore.listMemories(scope, 10) == ([], False)
    assert memoryStore.get(other, kept).content == "other subject"
    assert memoryStore.deleteScope(scope) == (0, 0)


def test_forgettingLeavesTheTextNowhere(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant
) -> None:
    """
    A deleted memory's text is in no table of the database afterwards: no
    history, no soft delete, no copy.
    """
    scope = scopeOf(acme)
    marker = "forget-me-" + uuid.uuid4().hex
    memoryID = add(memoryStore, scope, marker)
    assert _tablesHolding(migratedDSN, marker) == ["memories"]
    memoryStore.delete(scope, memoryID)
    assert _tablesHolding(migratedDSN, marker) == []
    with pytest.raises(MemoryNotFound):
        memoryStore.get(scope, memoryID)


def _tablesHolding(dsn: str, text: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        tables = [
            row[0]
            for row in connection.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
            ).fetchall()
        ]
        return [
            table
            for table in tables
            if connection.execute(
                f'SELECT count(*) FROM "{table}" AS row WHERE row::text LIKE %s',
                (f"%{text}%",),
            ).fetchone()
            != (0,)
        ]


def test_theDatabaseRefusesTheWrongOrganizationsContext(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant, globex: Tenant
) -> None:
    """
    Row-level security, in PostgreSQL itself: as svc_memory_app in
    globex's context, acme's memory is invisible to SELECT, UPDATE and
    DELETE, and an INSERT of a row of acme's is refused; with no context
    at all nothing is visible.
    """
    memoryID = add(memoryStore, scopeOf(acme), "acme's")
    with appConnection(migratedDSN) as connection:
        with connection.transaction():
            connection.execute("SELECT set_config('svc.org_id', %s, true)", (str(globex.orgID),))
            assert connection.execute("SELECT count(*) FROM memories").fetchone() == (0,)
            changed = connection.execute(
                "UPDATE memories SET content = 'stolen' WHERE id = %s", (memoryID,)
            )
            assert changed.rowcount == 0
            deleted = connection.execute("DELETE FROM memories WHERE id = %s", (memoryID,))
            assert deleted.rowcount == 0
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            with connection.transaction():
                connection.execute(
                    "SELECT set_config('svc.org_id', %s, true)", (str(globex.orgID),)
                )
                connection.execute(
                    "INSERT INTO memory_observations (id, org_id, agent_id, request_id, messages)"
                    " VALUES (%s, %s, %s, 'r', '[]')",
                    (uuid.uuid4(), acme.orgID, acme.agentID),
                )
        assert connection.execute("SELECT count(*) FROM memories").fetchone() == (0,)
        # svc_memory_app cannot read svc-auth's tables at all.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute("SELECT count(*) FROM tokens")
    assert memoryStore.get(scopeOf(acme), memoryID).content == "acme's"


def test_theListenersRowsOfManyOrganizationsAreReadInOneTransaction(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant, globex: Tenant
) -> None:
    """
    The change listener reads a packet's rows of several organizations in
    one transaction (a transaction per organization was most of its time
    when the claims take organizations in turn), each organization's in
    its own context: a memory is read only under its own organization.
    """
    acmeID = add(memoryStore, scopeOf(acme), "acme's")
    globexID = add(memoryStore, scopeOf(globex), "globex's")
    taken: list[object] = []
    with appConnection(migratedDSN) as connection:

        @contextlib.contextmanager
        def connections() -> Iterator[psycopg.Connection[object]]:
            taken.append(connection)
            yield connection

        store = MemoryStore(connections)
        rows = store.rowsForCacheByOrganization({acme.orgID: [acmeID], globex.orgID: [globexID]})
        assert len(taken) == 1
        assert {memoryID: row.content for memoryID, row in rows.items()} == {
            acmeID: "acme's",
            globexID: "globex's",
        }
        assert rows[globexID].record == memoryStore.get(scopeOf(globex), globexID)
        crossed = store.rowsForCacheByOrganization({globex.orgID: [acmeID], acme.orgID: [globexID]})
        assert crossed == {}
        assert store.rowsForCacheByOrganization({}) == {}


def test_observationsQueueOncePerRequestID(memoryStore: MemoryStore, acme: Tenant) -> None:
    """
    Queueing a batch twice queues each observation once: the second call
    answers the same ids, marked as queued before.
    """
    scope = scopeOf(acme, "s")
    batch = [
        NewObservation(scope, "req-a", (ObservedMessage("user", "I live in Lyon"),)),
        NewObservation(
            scope,
            "req-b",
            (ObservedMessage("user", "hi"), ObservedMessage("assistant", "hello")),
        ),
    ]
    first = memoryStore.queueObservations(batch)
    again = memoryStore.queueObservations(batch)
    assert [each.queuedNow for each in first] == [True, True]
    assert [each.queuedNow for each in again] == [False, False]
    assert [each.observationID for each in first] == [each.observationID for each in again]
    assert memoryStore.observationsWaiting() == 2


def test_observationsAreKeyedByTheirKeyNotTheirRequestID(
    memoryStore: MemoryStore, acme: Tenant
) -> None:
    """
    Two requests that share a client's request id (an application that
    hands its own inbound request id to every call it makes) are two
    observations: queueing is idempotent by the key (the proxy's ledger id
    of each request), waiting or processed, and each keeps the request id
    the worker names as its parent. The answers come in the order asked.
    """
    scope = scopeOf(acme, "keyed")

    def new(key: str, text: str) -> NewObservation:
        return NewObservation(scope, "req-shared", (ObservedMessage("user", text),), key)

    second, first = memoryStore.queueObservations(
        [new("key-2", "I live in Oslo"), new("key-1", "I work in Bergen")]
    )
    assert [second.key, first.key] == ["key-2", "key-1"]
    assert first.queuedNow and second.queuedNow
    assert first.observationID != second.observationID
    assert first.observationID is not None and second.observationID is not None
    assert memoryStore.queueObservations([new("key-1", "I work in Bergen")]) == [
        QueuedObservation("req-shared", first.observationID, False, "key-1")
    ]
    claimed = memoryStore.claimObservations("w", 60.0, 10)
    assert {each.observationID for each in claimed} == {
        first.observationID,
        second.observationID,
    }
    assert {each.requestID for each in claimed} == {"req-shared"}
    held = {each.observationID: each for each in claimed}[first.observationID]
    assert memoryStore.completeObservation(acme.orgID, held.observationID, "w", held.leaseToken)
    [again, third] = memoryStore.queueObservations(
        [new("key-1", "I work in Bergen"), new("key-3", "I like skiing")]
    )
    assert again == QueuedObservation("req-shared", first.observationID, False, "key-1")
    assert third.queuedNow
    assert memoryStore.observationsWaiting() == 2


def test_theKeyMigrationKeepsWaitingAndProcessedObservations(databaseDSN: str) -> None:
    """
    On a queue written before sql/0015 (keyed by request id): an
    observation waiting and one processed are keyed by their request ids,
    so that the copies a proxy of the earlier release resends (no key) are
    answered as queued before; a new proxy's observation of the same
    request id (its ledger id as key) is one of its own; an svc-memory of
    the earlier release still running finishes one without naming a key,
    and it is remembered by its request id; pruning still forgets the
    processed one.
    """
    assert migrate(databaseDSN, through="0014_observations_done.sql")[-1] == (
        "0014_observations_done.sql"
    )
    store, connection = ownerStore(databaseDSN)
    try:
        orgID = store.createOrganization("before")
        agentID = store.createAgent(orgID, "before-agent").agentID
        waitingID, doneID = uuid.uuid4(), uuid.uuid4()
        connection.execute(
            "INSERT INTO memory_observations (id, org_id, agent_id, subject, request_id, messages)"
            " VALUES (%s, %s, %s, '', 'req-waiting', '[]')",
            (waitingID, orgID, agentID),
        )
        connection.execute(
            "INSERT INTO memory_observations_done (org_id, request_id, observation_id)"
            " VALUES (%s, 'req-done', %s)",
            (orgID, doneID),
        )
        assert migrate(databaseDSN)[0] == "0015_observation_key.sql"
        with storeOn(databaseDSN) as memoryStore:
            scope = Scope(orgID, agentID, "")
            message = (ObservedMessage("user", "I live in Oslo"),)
            waiting, done, keyed = memoryStore.queueObservations(
                [
                    NewObservation(scope, "req-waiting", message),
                    NewObservation(scope, "req-done", message),
                    NewObservation(scope, "req-waiting", message, "ledger-1"),
                ]
            )
            assert (waiting, done) == (
                QueuedObservation("req-waiting", waitingID, False),
                QueuedObservation("req-done", doneID, False),
            )
            assert (keyed.requestID, keyed.key, keyed.queuedNow) == (
                "req-waiting",
                "ledger-1",
                True,
            )
            assert keyed.observationID not in (waitingID, doneID)
            # An svc-memory of the earlier release, still running, finishes
            # an observation as it did (no key): keyed by its request id.
            with appConnection(databaseDSN) as earlier, earlier.transaction():
                earlier.execute("SELECT set_config('svc.org_id', %s, true)", (str(orgID),))
                earlier.execute(
                    "WITH gone AS (DELETE FROM memory_observations WHERE id = %s"
                    " RETURNING id, org_id, request_id)"
                    " INSERT INTO memory_observations_done (org_id, request_id, observation_id)"
                    " SELECT org_id, request_id, id FROM gone ON CONFLICT DO NOTHING",
                    (waitingID,),
                )
            [finished] = memoryStore.queueObservations(
                [NewObservation(scope, "req-waiting", message)]
            )
            assert finished == QueuedObservation("req-waiting", waitingID, False)
            # A waiting observation without a key is refused, never keyed by
            # the client's request id behind the code's back.
            with (
                pytest.raises(psycopg.errors.NotNullViolation),
                appConnection(databaseDSN) as forgetful,
                forgetful.transaction(),
            ):
                forgetful.execute("SELECT set_config('svc.org_id', %s, true)", (str(orgID),))
                forgetful.execute(
                    "INSERT INTO memory_observations"
                    " (id, org_id, agent_id, subject, request_id, messages)"
                    " VALUES (%s, %s, %s, '', 'req-new', '[]')",
                    (uuid.uuid4(), orgID, agentID),
                )
            connection.execute(
                "UPDATE memory_observations_done SET done_at = now() - interval '2 hours'"
                " WHERE request_id = 'req-done'"
            )
            assert memoryStore.pruneDone(3600.0) == 1
            [anew] = memoryStore.queueObservations([NewObservation(scope, "req-done", message)])
            assert anew.queuedNow
    finally:
        connection.close()


def test_aProcessedObservationIsNotQueuedAgainWithinTheRetention(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant, globex: Tenant
) -> None:
    """
    An observation finished (completed, or its memories stored) is
    remembered by request id: the same request queued again, as a proxy's
    journal resends a batch whose acknowledgement it lost, is answered as
    queued before with the same id and never claimed, so its extraction
    is not paid twice. Another organization's request of the same id is
    its own. Once older than the retention the record is pruned, and the
    request id would queue anew. Under row-level security an organization
    sees only its own records.
    """
    scope = scopeOf(acme, "done")

    def queue(orgScope: Scope, requestID: str) -> QueuedObservation:
        [queued] = memoryStore.queueObservations(
            [NewObservation(orgScope, requestID, (ObservedMessage("user", "I live in Oslo"),))]
        )
        return queued

    completed = queue(scope, "req-complete")
    stored = queue(scope, "req-store")
    claimed = {each.requestID: each for each in memoryStore.claimObservations("w", 60.0, 10)}
    assert completed.observationID is not None
    assert memoryStore.completeObservation(
        acme.orgID, completed.observationID, "w", claimed["req-complete"].leaseToken
    )
    held = claimed["req-store"]
    assert held.leaseToken is not None
    written = memoryStore.storeExtracted(
        acme.orgID,
        held.observationID,
        "w",
        held.leaseToken,
        scope,
        "req-store",
        Plan.additions([("lives in Oslo", embedding([1.0, 0.0]))]),
        100,
    )
    assert written is not None and len(written.added) == 1
    for first in (completed, stored):
        again = queue(scope, first.requestID)
        assert again == QueuedObservation(first.requestID, first.observationID, False)
    assert memoryStore.observationsWaiting() == 0
    assert memoryStore.claimObservations("w", 60.0, 10) == []
    assert queue(scopeOf(globex), "req-complete").queuedNow
    with appConnection(migratedDSN) as connection:
        with connection.transaction():
            connection.execute("SELECT set_config('svc.org_id', %s, true)", (str(globex.orgID),))
            assert connection.execute(
                "SELECT count(*) FROM memory_observations_done"
            ).fetchone() == (0,)
    assert memoryStore.pruneDone(3600.0) == 0
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        connection.execute(
            "UPDATE memory_observations_done SET done_at = now() - interval '2 hours'"
            " WHERE request_id = 'req-complete'"
        )
    assert memoryStore.pruneDone(3600.0) == 1
    assert memoryStore.pruneDone(3600.0) == 0
    assert queue(scope, "req-complete").queuedNow
    assert not queue(scope, "req-store").queuedNow


def test_aCopyQueuedWhileItsObservationIsFinishingIsNotQueuedAgain(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant
) -> None:
    """
    A resent copy that arrives while a worker's transaction is finishing
    the same observation (its row deleted and its request id remembered,
    not yet committed) waits for that transaction and then finds it done:
    queueing it again would have the worker pay its extraction twice. (The
    copy's insert waits on the deleted row's unique key either way; what
    it must not do is decide "not done" from a snapshot taken before the
    finishing committed.)
    """
    scope = scopeOf(acme, "race")
    [queued] = memoryStore.queueObservations(
        [NewObservation(scope, "req-race", (ObservedMessage("user", "I live in Rome"),))]
    )
    [held] = memoryStore.claimObservations("w", 60.0, 10)
    answers: list[list[QueuedObservation]] = []
    with appConnection(migratedDSN) as finishing:
        with finishing.transaction():
            finishing.execute("SELECT set_config('svc.org_id', %s, true)", (str(acme.orgID),))
            finished = finishing.execute(
                _finishing("id = %s AND lease_owner = %s"), (held.observationID, "w")
            ).fetchall()
            assert len(finished) == 1
            resend = threading.Thread(
                target=lambda: answers.append(
                    memoryStore.queueObservations(
                        [
                            NewObservation(
                                scope, "req-race", (ObservedMessage("user", "I live in Rome"),)
                            )
                        ]
                    )
                )
            )
            resend.start()
            # Until the copy's transaction waits for this one.
            with psycopg.connect(migratedDSN, autocommit=True) as watching:
                within(
                    10,
                    lambda: (
                        watching.execute(
                            "SELECT count(*) FROM pg_stat_activity"
                            " WHERE wait_event_type = 'Lock' AND application_name = 'memory-test'"
                        ).fetchone()
                        == (1,)
                    ),
                )
        resend.join(10)
    assert not resend.is_alive()
    assert answers == [[QueuedObservation("req-race", queued.observationID, False)]]
    assert memoryStore.observationsWaiting() == 0
    assert memoryStore.claimObservations("w", 60.0, 10) == []


def test_claimLeasesCompleteDeletesReleaseRequeues(
    memoryStore: MemoryStore, acme: Tenant, globex: Tenant
) -> None:
    """
    A claim leases due observations of every organization to one owner
    (a second claim gets none of them); completing deletes one; releasing
    one makes it due again later with its attempt counted, or kept as
    failed; a stranger's complete is refused.
    """
    memoryStore.queueObservations(
        [
            NewObservation(scopeOf(acme), "a", (ObservedMessage("user", "one"),)),
            NewObservation(scopeOf(globex), "g", (ObservedMessage("user", "two"),)),
        ]
    )
    claimed = memoryStore.claimObservations("worker-1", 60.0, 10)
    assert sorted(each.requestID for each in claimed) == ["a", "g"]
    assert memoryStore.claimObservations("worker-2", 60.0, 10) == []
    byRequest = {each.requestID: each for each in claimed}
    acmeOne, globexOne = byRequest["a"], byRequest["g"]
    assert acmeOne.messages == (ObservedMessage("user", "one"),)
    with pytest.raises(MemoryForbidden):
        memoryStore.completeObservation(globex.orgID, acmeOne.observationID, "worker-1")
    assert not memoryStore.completeObservation(acme.orgID, acmeOne.observationID, "worker-2")
    assert memoryStore.completeObservation(acme.orgID, acmeOne.observationID, "worker-1")
    with pytest.raises(MemoryNotFound):
        memoryStore.completeObservation(acme.orgID, acmeOne.observationID, "worker-1")
    released = memoryStore.releaseObservation(
        globex.orgID,
        globexOne.observationID,
        "worker-1",
        ObservationRelease(retryAfter=0.0, countAttempt=True, failed=False, reason="bad json"),
    )
    assert released
    again = memoryStore.claimObservations("worker-2", 60.0, 10)
    assert [(each.requestID, each.attempts) for each in again] == [("g", 1)]
    memoryStore.releaseObservation(
        globex.orgID,
        globexOne.observationID,
        "worker-2",
        ObservationRelease(retryAfter=0.0, countAttempt=True, failed=True, reason="gave up"),
    )
    assert memoryStore.claimObservations("worker-3", 60.0, 10) == []
    assert memoryStore.observationsWaiting() == 0


def test_anExpiredLeaseReturnsTheObservation(memoryStore: MemoryStore, acme: Tenant) -> None:
    """
    An observation whose lease ran out (its worker died) is claimed again
    by the next worker, and the first can no longer complete it.
    """
    memoryStore.queueObservations(
        [NewObservation(scopeOf(acme), "r", (ObservedMessage("user", "x"),))]
    )
    [first] = memoryStore.claimObservations("dead-worker", 0.0, 1)
    [second] = memoryStore.claimObservations("live-worker", 60.0, 1)
    assert first.observationID == second.observationID
    assert not memoryStore.completeObservation(acme.orgID, first.observationID, "dead-worker")
    assert memoryStore.completeObservation(acme.orgID, first.observationID, "live-worker")


def test_onlyTheClaimHoldingALeaseRenewsIt(
    memoryStore: MemoryStore, acme: Tenant, globex: Tenant
) -> None:
    """
    Each claim has a token of its own. The claim holding the lease renews
    it (to the seconds asked, from now), even once it ran out if no claim
    took it since; a later claim, even under the same owner, makes the
    first claim's renewal, completion and release refused (False), and
    only the new token completes. A renewal in another organization's name
    is refused (row-level security); one of a deleted observation is
    NOT_FOUND.
    """
    memoryStore.queueObservations(
        [NewObservation(scopeOf(acme), "r", (ObservedMessage("user", "x"),))]
    )
    [first] = memoryStore.claimObservations("worker-1", 0.0, 1)
    assert first.leaseToken is not None
    renewed = memoryStore.renewObservationLease(
        acme.orgID, first.observationID, "worker-1", first.leaseToken, 120.0
    )
    assert renewed is not None and renewed > first.leaseExpiresAt
    assert memoryStore.claimObservations("worker-1", 60.0, 1) == []
    with pytest.raises(MemoryForbidden):
        memoryStore.renewObservationLease(
            globex.orgID, first.observationID, "worker-1", first.leaseToken, 60.0
        )
    # The lease runs out at once; the same owner claims it again: a new token.
    assert memoryStore.renewObservationLease(
        acme.orgID, first.observationID, "worker-1", first.leaseToken, 0.0
    )
    [second] = memoryStore.claimObservations("worker-1", 60.0, 1)
    assert second.leaseToken not in (None, first.leaseToken)
    assert (
        memoryStore.renewObservationLease(
            acme.orgID, first.observationID, "worker-1", first.leaseToken, 60.0
        )
        is None
    )
    assert not memoryStore.completeObservation(
        acme.orgID, first.observationID, "worker-1", first.leaseToken
    )
    assert not memoryStore.releaseObservation(
        acme.orgID,
        first.observationID,
        "worker-1",
        ObservationRelease(retryAfter=0.0, countAttempt=True, failed=False, reason="late"),
        first.leaseToken,
    )
    assert memoryStore.completeObservation(
        acme.orgID, second.observationID, "worker-1", second.leaseToken
    )
    with pytest.raises(MemoryNotFound):
        memoryStore.renewObservationLease(
            acme.orgID, second.observationID, "worker-1", second.leaseToken, 60.0
        )
