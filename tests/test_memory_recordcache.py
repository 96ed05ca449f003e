"""
svc-memory's cache of records (svcd/memory/recordcache.py, decisions
D13): alone (loads, changes heard during a load, the listener's state,
bytes and their bound, against a model under Hypothesis), then in real
replicas on one PostgreSQL: a search of a cached scope reads nothing from
the database, every replica answers what any replica wrote within a
second (its own writes at once), and a forgotten memory's text leaves
every replica's cache.
"""

from __future__ import annotations

import datetime
import functools
import json
import uuid

import grpc
import pytest
from authfixtures import Tenant
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memoryfixtures import MODEL, vectorBytes
from memoryservice import RunningMemoryService
from waiting import waitUntil

from svcd.common.config import ConfigError
from svcd.memory.config import MemoryConfig
from svcd.memory.recordcache import (
    RECORD_OVERHEAD_BYTES,
    SCOPE_OVERHEAD_BYTES,
    RecordCache,
)
from svcd.memory.records import MemoryRecord
from svcd.memory.vectorcache import CacheMetrics
from svcd.memory.wire import encodedMemory
from svcd.pb.memory.v1 import memory_pb2

ORG, AGENT = uuid.uuid4(), uuid.uuid4()
TRIPLE = (ORG, AGENT, "")
MOMENT = datetime.datetime(2026, 11, 27, 12, 0, tzinfo=datetime.UTC)


def record(
    memoryID: uuid.UUID, content: str = "likes tea", subject: str = "", metadata: str = "{}"
) -> MemoryRecord:
    return MemoryRecord(
        memoryID=memoryID,
        orgID=ORG,
        agentID=AGENT,
        subject=subject,
        content=content,
        metadata=metadata,
        source="api",
        sourceRequestID=None,
        embeddingModel=MODEL,
        dimensions=2,
        createdAt=MOMENT,
        updatedAt=MOMENT,
    )


def loaded(cache: RecordCache, *records: MemoryRecord) -> dict[int, bytes]:
    """
    Load C{records} as the scope TRIPLE's whole content; what the load
    answers for their ids.
    """
    load = cache.beginLoad(TRIPLE)
    assert load is not None
    ids = [each.memoryID.int for each in records]
    return cache.finishLoad(load, {each.memoryID.int: encodedMemory(each) for each in records}, ids)


def test_aLoadedScopeAnswersItsRecords() -> None:
    """
    A scope's records, once loaded, are answered by id without another
    load (a hit); another scope is a miss; an id the scope does not hold is
    left out.
    """
    events: list[str] = []
    cache = RecordCache(
        10**6, CacheMetrics(hit=lambda: events.append("hit"), miss=lambda: events.append("miss"))
    )
    cache.listening()
    first, second = record(uuid.uuid4(), "likes tea"), record(uuid.uuid4(), "plays chess")
    assert cache.lookup(TRIPLE, [first.memoryID.int]) is None
    assert loaded(cache, first, second) == {
        first.memoryID.int: encodedMemory(first),
        second.memoryID.int: encodedMemory(second),
    }
    unknown = uuid.uuid4()
    found = cache.lookup(TRIPLE, [second.memoryID.int, unknown.int])
    assert found == {second.memoryID.int: encodedMemory(second)}
    assert memory_pb2.Memory.FromString(found[second.memoryID.int]).content == "plays chess"
    assert cache.lookup((ORG, AGENT, "other"), [first.memoryID.int]) is None
    assert events == ["miss", "hit", "miss"]


def test_changesHeardDuringALoadAreApplied() -> None:
    """
    A change heard while a scope loads is applied to what the load read;
    one heard after, to the held scope; a record that is no longer the
    scope's (another subject) leaves it rather than being held under it.
    """
    cache = RecordCache(10**6)
    cache.listening()
    kept, changed, gone, moved = (record(uuid.uuid4(), f"fact {n}") for n in range(4))
    load = cache.beginLoad(TRIPLE)
    assert load is not None and cache.watches(*TRIPLE)
    late = record(uuid.uuid4(), "added meanwhile")
    newer = record(changed.memoryID, "changed meanwhile")
    cache.apply(
        [
            (TRIPLE, gone.memoryID, None),
            (TRIPLE, changed.memoryID, newer),
            (TRIPLE, late.memoryID, late),
        ]
    )
    everything = [kept, changed, gone, moved]
    found = cache.finishLoad(
        load,
        {each.memoryID.int: encodedMemory(each) for each in everything},
        [each.memoryID.int for each in [*everything, late]],
    )
    assert found == {
        kept.memoryID.int: encodedMemory(kept),
        changed.memoryID.int: encodedMemory(newer),
        moved.memoryID.int: encodedMemory(moved),
        late.memoryID.int: encodedMemory(late),
    }
    cache.apply([(TRIPLE, moved.memoryID, record(moved.memoryID, subject="elsewhere"))])
    assert cache.lookup(TRIPLE, [moved.memoryID.int]) == {}


def test_changesNamedByIdReachTheScopeTheRecordIsIn() -> None:
    """
    Notifications name a memory's organization, agent and id, never its
    subject (sql/0019_notify_ids.sql): a record read anew is held in its
    own subject's scope (and leaves the one it was in), a deletion leaves
    the scope the record is held in, and one of a record not held yet
    reaches every load in progress of the agent; an agent with nothing
    held or loading is not watched.
    """
    cache = RecordCache(10**6)
    cache.listening()
    assert not cache.watchesAgent(ORG, AGENT)
    first, second = record(uuid.uuid4(), "fact one"), record(uuid.uuid4(), "fact two")
    loaded(cache, first, second)
    assert cache.watchesAgent(ORG, AGENT)
    cache.applyHeard([(ORG, AGENT, first.memoryID, None)])
    assert cache.lookup(TRIPLE, [first.memoryID.int, second.memoryID.int]) == {
        second.memoryID.int: encodedMemory(second)
    }
    other = (ORG, AGENT, "bob@example.com")
    load = cache.beginLoad(other)
    assert load is not None
    unseen = record(uuid.uuid4(), "read by the load", subject="bob@example.com")
    cache.applyHeard([(ORG, AGENT, unseen.memoryID, None)])
    moved = record(second.memoryID, "fact two", subject="bob@example.com")
    cache.applyHeard([(ORG, AGENT, second.memoryID, moved)])
    found = cache.finishLoad(
        load, {unseen.memoryID.int: encodedMemory(unseen)}, [unseen.memoryID.int]
    )
    assert found == {}
    assert cache.lookup(TRIPLE, [second.memoryID.int]) == {}
    assert cache.lookup(other, [second.memoryID.int]) == {second.memoryID.int: encodedMemory(moved)}


def test_nothingIsHeldWhileNotListening() -> None:
    """
    Before the listener hears changes, and once it loses them, nothing is
    held: no load may begin, and a load begun before the listener lost its
    connection answers its search but is not kept.
    """
    cache = RecordCache(10**6)
    assert cache.beginLoad(TRIPLE) is None
    cache.listening()
    memory = record(uuid.uuid4())
    load = cache.beginLoad(TRIPLE)
    assert load is not None
    cache.notListening()
    found = cache.finishLoad(
        load, {memory.memoryID.int: encodedMemory(memory)}, [memory.memoryID.int]
    )
    assert found == {memory.memoryID.int: encodedMemory(memory)}
    cache.listening()
    assert cache.lookup(TRIPLE, [memory.memoryID.int]) is None
    assert (cache.scopeCount(), cache.totalBytes) == (0, 0)


def test_theLeastRecentlySearchedScopeGoesFirst() -> None:
    """
    Past its bound the cache drops the scope searched least recently. A
    scope larger than the whole cache answers its search, is not kept,
    and its later searches read their hits by id (an empty answer, not a
    miss that would load it again) until the listener reconnects.
    """
    one = record(uuid.uuid4())
    scopeBytes = SCOPE_OVERHEAD_BYTES + len(encodedMemory(one)) + RECORD_OVERHEAD_BYTES
    cache = RecordCache(int(scopeBytes * 2.5))
    cache.listening()
    for subject in ("a", "b", "c"):
        triple = (ORG, AGENT, subject)
        load = cache.beginLoad(triple)
        assert load is not None
        cache.finishLoad(load, {one.memoryID.int: encodedMemory(one)}, [])
        if subject == "b":
            assert cache.lookup((ORG, AGENT, "a"), []) == {}
    assert cache.lookup((ORG, AGENT, "b"), []) is None
    assert cache.lookup((ORG, AGENT, "a"), []) == {}
    assert cache.totalBytes == 2 * scopeBytes <= cache.maxBytes
    many = [record(uuid.uuid4(), "x" * 100) for _ in range(10)]
    load = cache.beginLoad(TRIPLE)
    assert load is not None
    found = cache.finishLoad(
        load, {each.memoryID.int: encodedMemory(each) for each in many}, [many[0].memoryID.int]
    )
    assert found == {many[0].memoryID.int: encodedMemory(many[0])}
    assert cache.lookup(TRIPLE, [many[0].memoryID.int]) == {}
    cache.listening()
    assert cache.lookup(TRIPLE, [many[0].memoryID.int]) is None


contents = st.one_of(st.none(), st.text(min_size=1, max_size=40))


@settings(max_examples=60, deadline=None)
@given(
    initial=st.lists(st.text(min_size=1, max_size=40), max_size=6),
    changes=st.lists(st.tuples(st.integers(0, 9), contents), max_size=30),
    duringLoad=st.integers(0, 30),
)
def test_theCacheFollowsEveryChangeAndCountsItsBytes(
    initial: list[str], changes: list[tuple[int, str | None]], duringLoad: int
) -> None:
    """
    Whatever changes are heard, during the load or after: the records held
    are exactly the latest state of each memory (a deleted one's text is
    gone), and the bytes counted are their encodings' plus the overheads.
    """
    ids = [uuid.uuid4() for _ in range(10)]
    state: dict[uuid.UUID, MemoryRecord] = {
        ids[number]: record(ids[number], content) for number, content in enumerate(initial)
    }
    cache = RecordCache(10**9)
    cache.listening()
    load = cache.beginLoad(TRIPLE)
    assert load is not None
    readByLoad = {memoryID.int: encodedMemory(each) for memoryID, each in state.items()}
    for step, (number, content) in enumerate(changes):
        if step == duringLoad:
            cache.finishLoad(load, readByLoad, [])
        change = None if content is None else record(ids[number], content)
        if change is None:
            state.pop(ids[number], None)
        else:
            state[ids[number]] = change
        cache.apply([(TRIPLE, ids[number], change)])
    if duringLoad >= len(changes):
        cache.finishLoad(load, readByLoad, [])
    expected = {memoryID.int: encodedMemory(each) for memoryID, each in state.items()}
    assert cache.lookup(TRIPLE, [each.int for each in ids]) == expected
    assert cache.totalBytes == SCOPE_OVERHEAD_BYTES + sum(
        len(each) + RECORD_OVERHEAD_BYTES for each in expected.values()
    )


# Real replicas on one PostgreSQL.


def scope(tenant: Tenant, subject: str = "") -> memory_pb2.Scope:
    return memory_pb2.Scope(org_id=str(tenant.orgID), agent_id=str(tenant.agentID), subject=subject)


def embedding(values: list[float]) -> memory_pb2.Embedding:
    return memory_pb2.Embedding(model=MODEL, vector=vectorBytes(values))


def add(
    service: RunningMemoryService,
    where: memory_pb2.Scope,
    content: str,
    values: list[float],
    metadata: str = "",
) -> memory_pb2.Memory:
    memory: memory_pb2.Memory = service.stub.AddMemory(
        memory_pb2.AddMemoryRequest(
            scope=where, content=content, metadata_json=metadata, embedding=embedding(values)
        ),
        timeout=10,
    )
    return memory


def answered(
    service: RunningMemoryService, where: memory_pb2.Scope, values: list[float], k: int = 100
) -> list[memory_pb2.Memory]:
    answer = service.stub.Search(
        memory_pb2.SearchRequest(scope=where, query=embedding(values), k=k), timeout=10
    )
    return [each.memory for each in answer.results]


def transactions(service: RunningMemoryService) -> float:
    """
    How many database transactions the replica's pool has run (the
    listener's own connection is not counted).
    """
    total = 0.0
    for metric in service.registry.collect():
        if metric.name == "svc_db_query_duration_seconds":
            total += sum(
                sample.value for sample in metric.samples if sample.name.endswith("_count")
            )
    return total


def held(service: RunningMemoryService, where: memory_pb2.Scope) -> dict[str, memory_pb2.Memory]:
    """
    Every record the replica's cache holds of the scope, by id.
    """
    triple = (uuid.UUID(where.org_id), uuid.UUID(where.agent_id), where.subject)
    scopeRecords = service.parts.records._scopes.get(triple)
    if scopeRecords is None:
        return {}
    return {
        str(uuid.UUID(int=key)): memory_pb2.Memory.FromString(encoded)
        for key, encoded in scopeRecords._encoded.items()
    }


def holdsOnly(service: RunningMemoryService, where: memory_pb2.Scope, ids: set[str]) -> bool:
    return set(held(service, where)) == ids


def holdsExactly(
    service: RunningMemoryService, where: memory_pb2.Scope, truth: dict[str, memory_pb2.Memory]
) -> bool:
    return held(service, where) == truth


def searchedAndHeld(service: RunningMemoryService, where: memory_pb2.Scope) -> None:
    """
    Search the scope once, then wait for the replica's cache to hold its
    records (loaded on their own thread after a first search).
    """
    answered(service, where, [1.0, 0.0])
    triple = (uuid.UUID(where.org_id), uuid.UUID(where.agent_id), where.subject)
    waitUntil(lambda: triple in service.parts.records._scopes, 5.0)


def listed(service: RunningMemoryService, where: memory_pb2.Scope) -> dict[str, memory_pb2.Memory]:
    """
    The scope's memories as PostgreSQL has them now.
    """
    answer = service.stub.ListMemories(
        memory_pb2.ListMemoriesRequest(scope=where, limit=100), timeout=10
    )
    assert not answer.has_more
    return {each.id: each for each in answer.memories}


def test_aSearchOfACachedScopeReadsNothingFromPostgreSQL(
    memoryService: RunningMemoryService, acme: Tenant
) -> None:
    """
    The first search of a scope loads its vectors and answers its hits
    read by id, its records then load on their own; from then on searches
    run no database transaction at all, and answer each memory exactly as
    GetMemory reads it from PostgreSQL.
    """
    where = scope(acme, "user-1")
    for number in range(5):
        add(memoryService, where, f"fact {number}", [1.0, float(number)], f'{{"n": {number}}}')
    first = answered(memoryService, where, [1.0, 0.0])
    searchedAndHeld(memoryService, where)
    assert answered(memoryService, where, [1.0, 0.0]) == first
    before = transactions(memoryService)
    for number in range(10):
        hits = answered(memoryService, where, [float(number), 1.0], k=3)
        assert len(hits) == 3
    assert transactions(memoryService) == before
    for memory in answered(memoryService, where, [1.0, 0.0]):
        assert memory == memoryService.stub.GetMemory(
            memory_pb2.GetMemoryRequest(scope=where, id=memory.id), timeout=10
        )


def test_withoutTheListenerSearchesReadTheirHits(migratedDSN: str, acme: Tenant) -> None:
    """
    A replica that hears no changes holds no record, and answers its
    searches from PostgreSQL, current.
    """
    service = RunningMemoryService(migratedDSN, listen=False).start()
    try:
        where = scope(acme)
        memory = add(service, where, "likes tea", [1.0, 0.0])
        assert answered(service, where, [1.0, 0.0]) == [memory]
        service.stub.UpdateMemory(
            memory_pb2.UpdateMemoryRequest(scope=where, id=memory.id, metadata_json='{"a":1}')
        )
        assert [each.metadata_json for each in answered(service, where, [1.0, 0.0])] == ['{"a":1}']
        assert service.parts.records.scopeCount() == 0
    finally:
        service.stop()


def test_aReplicaReadsItsOwnWritesAndOthersWithinOneSecond(
    replicas: tuple[RunningMemoryService, RunningMemoryService], acme: Tenant
) -> None:
    """
    With the scope cached on both replicas: a new content, new metadata
    alone, and a deletion through one replica are answered by its own next
    search at once, and by the other's within one second, neither loading
    the scope again; the deleted memory's record leaves both caches.
    """
    first, second = replicas
    where = scope(acme, "shared")
    kept = add(first, where, "seed", [1.0, 0.0])
    other = add(first, where, "likes tea", [0.0, 1.0])
    for replica in replicas:
        searchedAndHeld(replica, where)
    misses = [
        replica.registry.get_sample_value("svc_memory_record_cache_misses_total")
        for replica in replicas
    ]

    first.stub.UpdateMemory(
        memory_pb2.UpdateMemoryRequest(
            scope=where, id=other.id, content="likes coffee", embedding=embedding([0.0, 1.0])
        ),
        timeout=10,
    )
    assert answered(first, where, [0.0, 1.0], k=1)[0].content == "likes coffee"
    waitUntil(lambda: answered(second, where, [0.0, 1.0], k=1)[0].content == "likes coffee", 1.0)

    second.stub.UpdateMemory(
        memory_pb2.UpdateMemoryRequest(scope=where, id=other.id, metadata_json='{"drink":1}'),
        timeout=10,
    )
    assert answered(second, where, [0.0, 1.0], k=1)[0].metadata_json == '{"drink":1}'
    waitUntil(
        lambda: answered(first, where, [0.0, 1.0], k=1)[0].metadata_json == '{"drink":1}', 1.0
    )

    first.stub.DeleteMemory(memory_pb2.DeleteMemoryRequest(scope=where, id=other.id), timeout=10)
    assert [each.id for each in answered(first, where, [0.0, 1.0])] == [kept.id]
    for replica in replicas:
        waitUntil(functools.partial(holdsOnly, replica, where, {kept.id}), 1.0)
        assert [each.id for each in answered(replica, where, [0.0, 1.0])] == [kept.id]
    assert [
        replica.registry.get_sample_value("svc_memory_record_cache_misses_total")
        for replica in replicas
    ] == misses


operations = st.lists(
    st.tuples(
        st.sampled_from(["add", "content", "metadata", "delete"]),
        st.integers(0, 1),  # through which replica
        st.integers(0, 7),  # which memory (of those there)
        st.integers(-3, 3),
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=operations)
def test_everyReplicaHoldsWhatPostgreSQLHolds(
    replicas: tuple[RunningMemoryService, RunningMemoryService],
    acme: Tenant,
    steps: list[tuple[str, int, int, int]],
) -> None:
    """
    After any adds, changes (of content with its vector, or of metadata
    alone) and deletions through either replica, both replicas' caches of
    the scope hold within one second exactly the records PostgreSQL holds
    (nothing of a deleted memory), and their searches answer them.
    """
    where = scope(acme, f"p-{uuid.uuid4().hex[:12]}")
    add(replicas[0], where, "seed", [1.0, 1.0])
    for replica in replicas:
        answered(replica, where, [1.0, 0.0])
    alive: list[str] = []
    try:
        for number, (operation, through, which, value) in enumerate(steps):
            replica = replicas[through]
            if operation == "add" or not alive:
                alive.append(add(replica, where, f"added {number}", [1.0, float(value)]).id)
                continue
            memoryID = alive[which % len(alive)]
            if operation == "content":
                replica.stub.UpdateMemory(
                    memory_pb2.UpdateMemoryRequest(
                        scope=where,
                        id=memoryID,
                        content=f"changed {number}",
                        embedding=embedding([float(value), 1.0]),
                    ),
                    timeout=10,
                )
            elif operation == "metadata":
                replica.stub.UpdateMemory(
                    memory_pb2.UpdateMemoryRequest(
                        scope=where, id=memoryID, metadata_json=json.dumps({"step": number})
                    ),
                    timeout=10,
                )
            else:
                replica.stub.DeleteMemory(
                    memory_pb2.DeleteMemoryRequest(scope=where, id=memoryID), timeout=10
                )
                alive.remove(memoryID)
        truth = listed(replicas[0], where)
        for replica in replicas:
            waitUntil(functools.partial(holdsExactly, replica, where, truth), 1.0)
            found = answered(replica, where, [1.0, 0.0])
            assert {each.id: each for each in found} == truth
    finally:
        try:
            replicas[0].stub.DeleteScope(memory_pb2.DeleteScopeRequest(scope=where), timeout=10)
        except grpc.RpcError:
            pass


def test_theCacheOfRecordsAndTheSplitAreConfigured() -> None:
    """
    SVC_MEMORY_RECORD_CACHE_MB sizes the cache of records (128 MiB by
    default), SVC_MEMORY_PARALLEL_ROWS the product's split (0: never);
    a value out of their range is refused, naming the variable.
    """
    base = {"POSTGRES_DSN": "host=127.0.0.1"}
    defaults = MemoryConfig.fromEnvironment(base)
    assert (defaults.recordCacheBytes, defaults.parallelRows) == (128 * 2**20, 2_048)
    chosen = MemoryConfig.fromEnvironment(
        {**base, "SVC_MEMORY_RECORD_CACHE_MB": "3", "SVC_MEMORY_PARALLEL_ROWS": "0"}
    )
    assert (chosen.recordCacheBytes, chosen.parallelRows) == (3 * 2**20, 0)
    for name, value in (("SVC_MEMORY_RECORD_CACHE_MB", "0"), ("SVC_MEMORY_PARALLEL_ROWS", "-1")):
        with pytest.raises(ConfigError) as refused:
            MemoryConfig.fromEnvironment({**base, name: value})
        assert name in str(refused.value)
