"""
Tests of svc-memory's change listener as decisions D13, amended, has it:
"a replica that cannot listen says so" (any failure of the listener, a bug
as much as a lost connection, empties the replica's caches and makes
/ready 503 until it listens again; a silent connection is noticed within a
second), and "subjects are personal data" (a notification names ids
only). Against a real PostgreSQL; the caches alone are tested in
tests/test_memory_vectors.py and tests/test_memory_recordcache.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from authfixtures import Tenant
from memoryfixtures import MODEL, embedding, scopeOf, storeOn, vectorBytes
from memoryservice import RunningMemoryService
from tcprelay import TcpRelay
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from waiting import waitUntil
from zope.interface import provider

from svcd.common.readiness import readinessReport
from svcd.memory.assembly import listenerCheck
from svcd.memory.listener import CHANNEL, MemoryListener, parsePayload
from svcd.memory.recordcache import RecordCache
from svcd.memory.text import ScopeText, TextKey
from svcd.memory.vectorcache import VectorCache
from svcd.pb.memory.v1 import memory_pb2

# How late, past the second D13 allows, the test's own polling thread may
# notice a change of state on this machine: two cores shared by several
# test runs can leave a thread unscheduled for a few tens of
# milliseconds, seldom more. The guarantee itself has no slack (the
# lease runs out one second after a beat that was sent before the
# silence), so this is the test's tolerance, not the listener's.
POLLING_SLACK = 0.25


def protoScope(tenant: Tenant, subject: str) -> memory_pb2.Scope:
    return memory_pb2.Scope(org_id=str(tenant.orgID), agent_id=str(tenant.agentID), subject=subject)


def add(service: RunningMemoryService, where: memory_pb2.Scope, content: str) -> str:
    memory: memory_pb2.Memory = service.stub.AddMemory(
        memory_pb2.AddMemoryRequest(
            scope=where,
            content=content,
            embedding=memory_pb2.Embedding(model=MODEL, vector=vectorBytes([1.0, 0.0])),
        ),
        timeout=10,
    )
    return memory.id


def answered(service: RunningMemoryService, where: memory_pb2.Scope) -> list[str]:
    answer = service.stub.Search(
        memory_pb2.SearchRequest(
            scope=where,
            query=memory_pb2.Embedding(model=MODEL, vector=vectorBytes([1.0, 0.0])),
            k=10,
        ),
        timeout=10,
    )
    return [each.memory.id for each in answer.results]


def cached(service: RunningMemoryService, where: memory_pb2.Scope) -> None:
    """
    Search the scope, then wait until the replica holds its records and
    vectors (the records load on their own thread).
    """
    answered(service, where)
    triple = (uuid.UUID(where.org_id), uuid.UUID(where.agent_id), where.subject)
    waitUntil(
        lambda: service.parts.records.watches(*triple) and service.parts.cache.watches(*triple),
        5.0,
    )
    waitUntil(lambda: service.parts.records.scopeCount() > 0, 5.0)


def readyStatus(service: RunningMemoryService) -> int:
    """
    The status /ready answers for the replica's listener check (the check
    svc-memory's daemon runs, L{svcd.memory.assembly.listenerCheck}).
    """
    results: list[tuple[int, object]] = []
    report = Deferred.fromCoroutine(readinessReport([listenerCheck(service.parts)], Clock()))
    report.addCallback(results.append)
    assert results, "the listener check answers at once"
    return results[0][0]


@pytest.fixture
def listenerEvents() -> Iterator[list[LogEvent]]:
    """
    The events the change listeners log during the test.
    """
    events: list[LogEvent] = []

    @provider(ILogObserver)
    def observe(event: LogEvent) -> None:
        if "listening" in event.get("log_namespace", "") or "listener" in event.get(
            "log_namespace", ""
        ):
            events.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield events
    finally:
        globalLogPublisher.removeObserver(observe)


def test_anUnexpectedFailureEmptiesTheCachesAndTheListenerRecovers(
    replicas: tuple[RunningMemoryService, RunningMemoryService],
    acme: Tenant,
    monkeypatch: pytest.MonkeyPatch,
    listenerEvents: list[LogEvent],
) -> None:
    """
    An exception the listener does not expect (here a cache's, while it
    applies a deletion made through another replica) does not end its
    thread: the replica's caches are emptied, so the deleted memory is no
    longer answered within the second; the failure is logged once, by
    type and place, never its message; the listener listens again and
    follows changes as before.
    """
    first, second = replicas
    where = protoScope(acme, "failing")
    memoryID = add(first, where, "likes tea")
    cached(second, where)
    failures: list[int] = []
    applyHeard = second.parts.records.applyHeard

    def failOnce(*args: object) -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("secret-payload")
        applyHeard(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(second.parts.records, "applyHeard", failOnce)
    first.stub.DeleteMemory(memory_pb2.DeleteMemoryRequest(scope=where, id=memoryID), timeout=10)
    waitUntil(lambda: bool(failures) and answered(second, where) == [], 1.0)

    waitUntil(second.parts.cache.isListening, 5.0)
    waitUntil(second.parts.records.isListening, 5.0)
    errors = [each for each in listenerEvents if each.get("error") == "RuntimeError"]
    assert len(errors) == 1
    assert "secret-payload" not in repr(errors[0])
    assert errors[0]["where"].endswith(".py:" + errors[0]["where"].rsplit(":", 1)[1])

    # Following changes again.
    again = add(first, where, "likes coffee")
    cached(second, where)
    assert answered(second, where) == [again]
    first.stub.DeleteMemory(memory_pb2.DeleteMemoryRequest(scope=where, id=again), timeout=10)
    waitUntil(lambda: answered(second, where) == [], 1.0)


def test_whileTheListenerFailsReadyIs503(
    memoryService: RunningMemoryService, acme: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    /ready's listener check is critical: while every attempt of the
    listener fails (here a bug when listening begins) the replica answers
    503, its searches read PostgreSQL and keep nothing; once the listener
    listens again, 200.
    """
    assert readyStatus(memoryService) == 200
    broken = [True]
    listening = memoryService.parts.records.listening

    def failing(until: float = float("inf")) -> None:
        if broken:
            raise ValueError("a bug")
        listening(until)

    monkeypatch.setattr(memoryService.parts.records, "listening", failing)
    # A failure of the connection (it is cut) makes the listener begin again.
    with psycopg.connect(memoryService.parts.settings.postgresDSN, autocommit=True) as owner:
        owner.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'svc-memory-listener' AND datname = current_database()"
        )
    waitUntil(lambda: readyStatus(memoryService) == 503, 2.0)
    where = protoScope(acme, "meanwhile")
    memoryID = add(memoryService, where, "likes tea")
    assert answered(memoryService, where) == [memoryID]
    assert memoryService.parts.records.scopeCount() == 0
    assert memoryService.parts.cache.scopeCount() == 0
    assert readyStatus(memoryService) == 503

    broken.clear()
    waitUntil(lambda: readyStatus(memoryService) == 200, 5.0)


def test_aSilentConnectionIsNoticedWithinASecond(migratedDSN: str) -> None:
    """
    A listener whose connection stops moving bytes (a frozen relay: no
    error, no reset, as a stalled network or a hung server) empties its
    caches, and its check fails, at most one second after the silence
    began; once bytes move again it listens again. The listener's own
    timings are the daemon's (a beat every 0.2 s, a lease of 1 s).
    """
    port = psycopg.conninfo.conninfo_to_dict(migratedDSN)["port"]
    relay = TcpRelay(int(str(port))).start()
    dsn = psycopg.conninfo.make_conninfo(migratedDSN, host="127.0.0.1", port=relay.port)
    cache, records = VectorCache(1 << 20), RecordCache(1 << 20)
    listener = MemoryListener(dsn, cache, records=records, reconnectDelay=0.2)
    listener.start()
    try:
        waitUntil(lambda: cache.isListening() and records.isListening(), 10.0)
        held = cache.beginLoad(TextKey(uuid.uuid4(), uuid.uuid4(), ""))
        cache.finishLoad(held, ScopeText())
        assert cache.scopeCount() == 1
        silent = time.monotonic()
        relay.freeze()
        waitUntil(lambda: not cache.isListening() and not records.isListening(), 5.0)
        noticed = time.monotonic() - silent
        assert noticed <= 1.0 + POLLING_SLACK, noticed
        assert cache.scopeCount() == 0
        relay.thaw()
        waitUntil(lambda: cache.isListening() and records.isListening(), 10.0)
    finally:
        relay.thaw()
        listener.stop()
        relay.stop()


def test_aBlockedListenerThreadStillLetsTheCachesGoWithinASecond(migratedDSN: str) -> None:
    """
    The second holds whatever the listener's thread is doing: blocked
    (here in its count of waiting observations, as it would be in a read
    of a frozen server until TCP gives up), its caches' lease runs out one
    second after its last beat was sent and they are emptied; once it is
    free again it gives the connection up and listens anew.
    """
    blocked, release = threading.Event(), threading.Event()

    def waiting(count: int) -> None:
        if blocked.is_set():
            release.wait(10)

    cache, records = VectorCache(1 << 20), RecordCache(1 << 20)
    listener = MemoryListener(
        migratedDSN,
        cache,
        records=records,
        waiting=waiting,
        reconnectDelay=0.2,
        waitingInterval=0.1,
    )
    listener.start()
    try:
        waitUntil(lambda: cache.isListening() and records.isListening(), 10.0)
        cache.finishLoad(cache.beginLoad(TextKey(uuid.uuid4(), uuid.uuid4(), "")), ScopeText())
        started = time.monotonic()
        blocked.set()
        waitUntil(lambda: not cache.isListening() and not records.isListening(), 5.0)
        assert time.monotonic() - started <= 1.0 + POLLING_SLACK
        assert cache.scopeCount() == 0
        blocked.clear()
        release.set()
        waitUntil(lambda: cache.isListening() and records.isListening(), 10.0)
    finally:
        blocked.clear()
        release.set()
        listener.stop()


def test_notificationsNameIdsOnly(migratedDSN: str, acme: Tenant) -> None:
    """
    Subjects are personal data (D13, amended): a memory added, changed,
    moved to another subject, deleted, and a scope purged, are announced on
    svc_memory_changes by operation, organization, agent and id, never
    with the subject (which any role that may connect could LISTEN to).
    """
    subject = f"someone-{uuid.uuid4().hex}@example.com"
    other = f"another-{uuid.uuid4().hex}@example.com"
    where = scopeOf(acme, subject)
    payloads: list[str] = []
    with psycopg.connect(migratedDSN, autocommit=True) as listening:
        listening.execute(f"LISTEN {CHANNEL}")
        with storeOn(migratedDSN) as store:
            first = store.add(where, "likes tea", "{}", "api", None, embedding([1.0, 0.0]), 100)
            second = store.add(where, "likes coffee", "{}", "api", None, embedding([0.0, 1.0]), 100)
            store.update(where, first.memoryID, "likes green tea", None, embedding([1.0, 0.1]))
            with psycopg.connect(migratedDSN, autocommit=True) as owner:
                owner.execute(
                    "UPDATE memories SET subject = %s WHERE id = %s", (other, second.memoryID)
                )
            store.delete(where, first.memoryID)
            store.deleteScope(scopeOf(acme, other))
        org, agent = acme.orgID, acme.agentID
        expected = [
            f"insert:{org}:{agent}:{first.memoryID}",
            f"insert:{org}:{agent}:{second.memoryID}",
            f"update:{org}:{agent}:{first.memoryID}",
            f"delete:{org}:{agent}:{second.memoryID}",
            f"update:{org}:{agent}:{second.memoryID}",
            f"delete:{org}:{agent}:{first.memoryID}",
            f"delete:{org}:{agent}:{second.memoryID}",
        ]
        deadline = time.monotonic() + 10
        while len([each for each in payloads if not each.startswith("sync:")]) < len(expected):
            assert time.monotonic() < deadline, payloads
            for notification in listening.notifies(timeout=0.5, stop_after=1):
                payloads.append(notification.payload)
    assert all(subject not in each and other not in each for each in payloads)
    assert [each for each in payloads if not each.startswith("sync:")] == expected


def test_bothPayloadFormsAreRead() -> None:
    """
    A replica of this release reads the ids of the payloads of the
    release before (with the subject last), so it may run before the
    migration; anything else is not a change.
    """
    org, agent, memoryID = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert parsePayload(f"delete:{org}:{agent}:{memoryID}") == ("delete", org, agent, memoryID)
    assert parsePayload(f"insert:{org}:{agent}:{memoryID}:a:b@c") == (
        "insert",
        org,
        agent,
        memoryID,
    )
    assert parsePayload(f"upsert:{org}:{agent}:{memoryID}") is None
    assert parsePayload(f"update:{org}:{agent}") is None
    assert parsePayload(f"update:{org}:{agent}:not-an-id") is None
