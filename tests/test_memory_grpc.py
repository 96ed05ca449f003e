"""
svc-memory's MemoryService over real grpcio and a real PostgreSQL
(decisions D13): every method, the status of each refusal, isolation of
organizations under search, list and get (a property test), the cap, and
two replicas on one database that agree within a second.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import psycopg
import pytest
from authfixtures import Tenant, makeTenant
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memoryfixtures import MODEL, vectorBytes, within
from memoryservice import RunningMemoryService

from svcd.auth.store import Store
from svcd.memory.grpcrequests import SCOPE_FULL
from svcd.pb.memory.v1 import memory_pb2


def scope(tenant: Tenant, subject: str = "") -> memory_pb2.Scope:
    return memory_pb2.Scope(org_id=str(tenant.orgID), agent_id=str(tenant.agentID), subject=subject)


def vector(values: list[float], model: str = MODEL) -> memory_pb2.Embedding:
    return memory_pb2.Embedding(model=model, vector=vectorBytes(values))


def add(
    service: RunningMemoryService, where: memory_pb2.Scope, content: str, values: list[float]
) -> memory_pb2.Memory:
    memory: memory_pb2.Memory = service.stub.AddMemory(
        memory_pb2.AddMemoryRequest(scope=where, content=content, embedding=vector(values)),
        timeout=10,
    )
    return memory


def search(
    service: RunningMemoryService,
    where: memory_pb2.Scope,
    values: list[float],
    k: int = 10,
    model: str = MODEL,
) -> list[tuple[str, Any]]:
    answer = service.stub.Search(
        memory_pb2.SearchRequest(scope=where, query=vector(values, model), k=k), timeout=10
    )
    return [(each.memory.content, each.score) for each in answer.results]


def refusal(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    error = raised.value
    assert isinstance(error, grpc.Call)
    return error.code(), error.details()


def test_aMemoryGoesThroughEveryMethod(memoryService: RunningMemoryService, acme: Tenant) -> None:
    """
    Add (content trimmed, metadata compacted), get, list, search, update
    (a new vector with the new content), delete and delete the scope, as
    a caller sees them; never a vector in an answer.
    """
    stub, where = memoryService.stub, scope(acme, "user-7")
    added = stub.AddMemory(
        memory_pb2.AddMemoryRequest(
            scope=where,
            content="  likes green tea \n",
            metadata_json='{ "topic": "drinks" }',
            embedding=vector([1.0, 0.0, 0.0]),
        ),
        timeout=10,
    )
    assert (added.content, added.metadata_json, added.source) == (
        "likes green tea",
        '{"topic":"drinks"}',
        "api",
    )
    assert (added.subject, added.dimensions, added.embedding_model) == ("user-7", 3, MODEL)
    assert added.created_at.endswith("Z") and added.created_at == added.updated_at
    assert (
        stub.GetMemory(memory_pb2.GetMemoryRequest(scope=where, id=added.id), timeout=10) == added
    )
    other = add(memoryService, where, "plays chess", [0.0, 1.0, 0.0])
    listed = stub.ListMemories(memory_pb2.ListMemoriesRequest(scope=where, limit=1), timeout=10)
    assert [each.id for each in listed.memories] == [other.id] and listed.has_more
    assert search(memoryService, where, [0.9, 0.1, 0.0]) == [
        ("likes green tea", pytest.approx(0.9 / (0.82**0.5), abs=1e-6)),
        ("plays chess", pytest.approx(0.1 / (0.82**0.5), abs=1e-6)),
    ]
    changed = stub.UpdateMemory(
        memory_pb2.UpdateMemoryRequest(
            scope=where, id=added.id, content="likes black tea", embedding=vector([0.0, 0.0, 1.0])
        ),
        timeout=10,
    )
    assert changed.content == "likes black tea" and changed.updated_at > changed.created_at
    assert search(memoryService, where, [0.0, 0.0, 1.0], k=1) == [
        ("likes black tea", pytest.approx(1.0))
    ]
    deleted = stub.DeleteMemory(
        memory_pb2.DeleteMemoryRequest(scope=where, id=other.id), timeout=10
    )
    assert deleted.id == other.id
    assert [content for content, _ in search(memoryService, where, [0.0, 1.0, 0.0])] == [
        "likes black tea"
    ]
    emptied = stub.DeleteScope(memory_pb2.DeleteScopeRequest(scope=where), timeout=10)
    assert (emptied.memories_deleted, emptied.observations_deleted) == (1, 0)
    assert search(memoryService, where, [0.0, 0.0, 1.0]) == []


def test_refusalsHaveTheirStatus(
    memoryService: RunningMemoryService, owner: Store, acme: Tenant, globex: Tenant
) -> None:
    """
    Each refusal is the status the proxy maps to D13's HTTP answer: an
    unknown id NOT_FOUND, another organization's or agent's
    PERMISSION_DENIED, bad input INVALID_ARGUMENT naming the field.
    """
    stub, where = memoryService.stub, scope(acme)
    memory = add(memoryService, where, "mine", [1.0, 0.0])

    def get(at: memory_pb2.Scope, memoryID: str) -> Callable[[], object]:
        return lambda: stub.GetMemory(
            memory_pb2.GetMemoryRequest(scope=at, id=memoryID), timeout=10
        )

    assert refusal(get(where, str(uuid.uuid4())))[0] == grpc.StatusCode.NOT_FOUND
    assert refusal(get(scope(globex), memory.id))[0] == grpc.StatusCode.PERMISSION_DENIED
    sibling = memory_pb2.Scope(
        org_id=str(acme.orgID), agent_id=str(owner.createAgent(acme.orgID, "b").agentID)
    )
    assert refusal(get(sibling, memory.id))[0] == grpc.StatusCode.PERMISSION_DENIED
    cases: list[tuple[memory_pb2.AddMemoryRequest, str]] = [
        (
            memory_pb2.AddMemoryRequest(scope=where, content="   ", embedding=vector([1.0])),
            "content",
        ),
        (
            memory_pb2.AddMemoryRequest(scope=where, content="x" * 4001, embedding=vector([1.0])),
            "content",
        ),
        (
            memory_pb2.AddMemoryRequest(
                scope=where, content="x", metadata_json="[1]", embedding=vector([1.0])
            ),
            "metadata",
        ),
        (
            memory_pb2.AddMemoryRequest(
                scope=where,
                content="x",
                metadata_json='{"k":"' + "v" * 4100 + '"}',
                embedding=vector([1.0]),
            ),
            "metadata",
        ),
        (memory_pb2.AddMemoryRequest(scope=where, content="x"), "embedding"),
        (
            memory_pb2.AddMemoryRequest(scope=where, content="x", embedding=vector([0.0, 0.0])),
            "embedding.vector",
        ),
        (
            memory_pb2.AddMemoryRequest(
                scope=where,
                content="x",
                embedding=memory_pb2.Embedding(model=MODEL, vector=b"\x00\x00\x80\x7f"),
            ),
            "embedding.vector",
        ),
        (
            memory_pb2.AddMemoryRequest(
                scope=memory_pb2.Scope(org_id="nope", agent_id=str(acme.agentID)),
                content="x",
                embedding=vector([1.0]),
            ),
            "org_id",
        ),
        (
            memory_pb2.AddMemoryRequest(
                scope=scope(acme, "no spaces"), content="x", embedding=vector([1.0])
            ),
            "subject",
        ),
        (
            memory_pb2.AddMemoryRequest(
                scope=memory_pb2.Scope(org_id=str(acme.orgID), agent_id=str(globex.agentID)),
                content="x",
                embedding=vector([1.0]),
            ),
            "agent_id",
        ),
    ]
    for request, field in cases:
        code, details = refusal(functools.partial(stub.AddMemory, request, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
    code, details = refusal(
        lambda: stub.Search(
            memory_pb2.SearchRequest(scope=where, query=vector([1.0, 0.0]), k=0), timeout=10
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("k")
    code, details = refusal(
        lambda: stub.UpdateMemory(
            memory_pb2.UpdateMemoryRequest(scope=where, id=memory.id, content="new"), timeout=10
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("embedding")
    # A string that is not UTF-8: refused naming the message, not INTERNAL.
    raw = memoryService.channel.unary_unary(
        "/svc.memory.v1.MemoryService/GetMemory",
        request_serializer=lambda value: value,
        response_deserializer=lambda value: value,
    )
    code, _ = refusal(lambda: raw(b"\x12\x02\xff\xfe", timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_aFullScopeIsFailedPrecondition(migratedDSN: str, acme: Tenant) -> None:
    """
    Past SVC_MEMORY_MAX_PER_SCOPE an add is FAILED_PRECONDITION with the
    details the proxy reads as 409 MEMORY_FULL; after a delete there is
    room again.
    """
    service = RunningMemoryService(migratedDSN, maxPerScope=2).start()
    try:
        where = scope(acme)
        first = add(service, where, "one", [1.0])
        add(service, where, "two", [1.0])
        assert refusal(lambda: add(service, where, "three", [1.0])) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            SCOPE_FULL,
        )
        service.stub.DeleteMemory(memory_pb2.DeleteMemoryRequest(scope=where, id=first.id))
        add(service, where, "three", [1.0])
    finally:
        service.stop()


@pytest.fixture
def twoTenants(owner: Store) -> tuple[Tenant, Tenant]:
    return makeTenant(owner, "left"), makeTenant(owner, "right")


vectors = st.lists(
    st.lists(st.integers(-3, 3).map(float), min_size=3, max_size=3).filter(any),
    min_size=1,
    max_size=6,
)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(left=vectors, right=vectors, query=vectors, subject=st.sampled_from(["", "u1"]))
def test_organizationsNeverSeeEachOther(
    memoryService: RunningMemoryService,
    twoTenants: tuple[Tenant, Tenant],
    left: list[list[float]],
    right: list[list[float]],
    query: list[list[float]],
    subject: str,
) -> None:
    """
    Two organizations whose memories have the same and overlapping vectors
    (so that each other's would rank first): neither's search, list or get
    ever returns the other's memory, and the other's ids are
    PERMISSION_DENIED.
    """
    stub = memoryService.stub
    tenants = {"left": twoTenants[0], "right": twoTenants[1]}
    mine: dict[str, set[str]] = {"left": set(), "right": set()}
    for name, values in (("left", left + right), ("right", right + left)):
        for number, each in enumerate(values):
            mine[name].add(
                add(memoryService, scope(tenants[name], subject), f"{name}-{number}", each).id
            )
    try:
        for name, tenant in tenants.items():
            other = "right" if name == "left" else "left"
            where = scope(tenant, subject)
            for each in query:
                answer = stub.Search(
                    memory_pb2.SearchRequest(scope=where, query=vector(each), k=100), timeout=10
                )
                assert {hit.memory.id for hit in answer.results} == mine[name]
                assert all(hit.memory.org_id == str(tenant.orgID) for hit in answer.results)
            listed = stub.ListMemories(memory_pb2.ListMemoriesRequest(scope=where, limit=100))
            assert {each.id for each in listed.memories} == mine[name]
            for memoryID in mine[other]:
                code, _ = refusal(
                    functools.partial(
                        stub.GetMemory,
                        memory_pb2.GetMemoryRequest(scope=where, id=memoryID),
                        timeout=10,
                    )
                )
                assert code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        for tenant in tenants.values():
            stub.DeleteScope(memory_pb2.DeleteScopeRequest(scope=scope(tenant, subject)))


def onlySeed(replica: RunningMemoryService, where: memory_pb2.Scope) -> bool:
    return [content for content, _ in search(replica, where, [-1.0, 0.0])] == ["seed"]


def test_replicasAgreeWithinOneSecond(
    replicas: tuple[RunningMemoryService, RunningMemoryService], acme: Tenant
) -> None:
    """
    Two svc-memory replicas on one database, each with the scope already
    cached: what one adds, changes or deletes is found (or gone) by the
    other's search within one second, through PostgreSQL's notifications
    and never a reload (the scope stays cached, no miss is counted).
    """
    first, second = replicas
    where = scope(acme, "shared")
    add(first, where, "seed", [1.0, 0.0])
    for replica in replicas:
        assert [content for content, _ in search(replica, where, [1.0, 0.0])] == ["seed"]
    misses = [
        replica.registry.get_sample_value("svc_memory_cache_misses_total") for replica in replicas
    ]

    added = add(first, where, "added on the first", [0.0, 1.0])
    within(1.0, lambda: search(second, where, [0.0, 1.0], k=1)[0][0] == "added on the first")

    second.stub.UpdateMemory(
        memory_pb2.UpdateMemoryRequest(
            scope=where, id=added.id, content="changed on the second", embedding=vector([-1.0, 0.0])
        )
    )
    within(1.0, lambda: search(first, where, [-1.0, 0.0], k=1)[0][0] == "changed on the second")

    second.stub.DeleteMemory(memory_pb2.DeleteMemoryRequest(scope=where, id=added.id))
    for replica in replicas:
        within(1.0, functools.partial(onlySeed, replica, where))
    assert [
        replica.registry.get_sample_value("svc_memory_cache_misses_total") for replica in replicas
    ] == misses
    for replica in replicas:
        assert replica.cache.scopeCount() == 1


def test_forgottenMemoriesLeaveEveryReplicasCache(
    replicas: tuple[RunningMemoryService, RunningMemoryService], acme: Tenant
) -> None:
    """
    Deleting a scope through one replica empties the other's cached copy
    of it (its vectors, not only the answers read back from PostgreSQL).
    """
    first, second = replicas
    where = scope(acme)
    for number in range(5):
        add(first, where, f"fact {number}", [1.0, float(number)])
    search(second, where, [1.0, 0.0])
    [cached] = [second.cache.lookup(key) for key in list(second.cache._scopes)]
    assert cached is not None and cached.count == 5
    first.stub.DeleteScope(memory_pb2.DeleteScopeRequest(scope=where))
    within(1.0, lambda: cached.count == 0)


def test_theWaitingGaugeCountsObservations(
    memoryService: RunningMemoryService, acme: Tenant
) -> None:
    """
    Observations queued through gRPC are counted in
    svc_memory_observations_waiting, and a batch sent again queues none
    twice.
    """
    batch = memory_pb2.QueueObservationsRequest(
        observations=[
            memory_pb2.Observation(
                scope=scope(acme),
                request_id=f"req-{number}",
                messages=[memory_pb2.ObservedMessage(role="user", content="I am vegan")],
            )
            for number in range(3)
        ]
    )
    first = memoryService.stub.QueueObservations(batch, timeout=10)
    again = memoryService.stub.QueueObservations(batch, timeout=10)
    assert [each.queued_now for each in first.queued] == [True] * 3
    assert [each.queued_now for each in again.queued] == [False] * 3
    assert [each.id for each in first.queued] == [each.id for each in again.queued]
    within(
        5.0,
        lambda: memoryService.registry.get_sample_value("svc_memory_observations_waiting") == 3,
    )


def test_observationsAreQueuedByTheirKey(
    memoryService: RunningMemoryService, acme: Tenant, globex: Tenant
) -> None:
    """
    QueueObservations keys each observation by its C{key} (a proxy sends
    the request's ledger id): two that share a request id are two; one
    without a key (a proxy of an earlier release) is keyed by its request
    id. Each answer names its key and its organization, in the order
    asked, though the two organizations' share a request id; a key that
    is not printable is refused.
    """

    def observation(tenant: Tenant, requestID: str, key: str = "") -> memory_pb2.Observation:
        return memory_pb2.Observation(
            scope=scope(tenant),
            request_id=requestID,
            messages=[memory_pb2.ObservedMessage(role="user", content="I am vegan")],
            key=key,
        )

    batch = memory_pb2.QueueObservationsRequest(
        observations=[
            observation(globex, "req-same", "key-b"),
            observation(acme, "req-same", "key-a"),
            observation(acme, "req-same", "key-c"),
            observation(acme, "req-old"),
        ]
    )
    first = memoryService.stub.QueueObservations(batch, timeout=10).queued
    assert [(each.key, each.org_id, each.request_id, each.queued_now) for each in first] == [
        ("key-b", str(globex.orgID), "req-same", True),
        ("key-a", str(acme.orgID), "req-same", True),
        ("key-c", str(acme.orgID), "req-same", True),
        ("req-old", str(acme.orgID), "req-old", True),
    ]
    assert len({each.id for each in first}) == 4
    again = memoryService.stub.QueueObservations(
        memory_pb2.QueueObservationsRequest(
            observations=[observation(acme, "req-old", "req-old"), observation(acme, "x", "key-a")]
        ),
        timeout=10,
    ).queued
    assert [(each.id, each.queued_now) for each in again] == [
        (first[3].id, False),
        (first[1].id, False),
    ]
    with pytest.raises(grpc.RpcError) as refused:
        memoryService.stub.QueueObservations(
            memory_pb2.QueueObservationsRequest(observations=[observation(acme, "r", "bad\x00")]),
            timeout=10,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "observations[0].key" in refused.value.details()


def test_processedObservationsAreForgottenAfterTheRetention(migratedDSN: str, acme: Tenant) -> None:
    """
    A processed observation's request is remembered (a resend through gRPC
    is answered as queued before, and nothing waits), until the change
    listener prunes the record past SVC_MEMORY_DONE_RETENTION, within a
    few of its rounds.
    """
    service = RunningMemoryService(migratedDSN, doneRetention=60.0).start()
    try:
        batch = memory_pb2.QueueObservationsRequest(
            observations=[
                memory_pb2.Observation(
                    scope=scope(acme),
                    request_id="req-done",
                    messages=[memory_pb2.ObservedMessage(role="user", content="I am vegan")],
                )
            ]
        )
        [queued] = service.stub.QueueObservations(batch, timeout=10).queued
        [claimed] = service.stub.ClaimObservations(
            memory_pb2.ClaimObservationsRequest(owner="w", limit=1, lease_seconds=60),
            timeout=10,
        ).observations
        service.stub.CompleteObservation(
            memory_pb2.CompleteObservationRequest(
                org_id=str(acme.orgID), id=claimed.id, owner="w", lease_token=claimed.lease_token
            ),
            timeout=10,
        )
        [again] = service.stub.QueueObservations(batch, timeout=10).queued
        assert (again.id, again.queued_now) == (queued.id, False)
        within(
            5.0,
            lambda: service.registry.get_sample_value("svc_memory_observations_waiting") == 0,
        )
        with psycopg.connect(migratedDSN, autocommit=True) as connection:
            connection.execute(
                "UPDATE memory_observations_done SET done_at = now() - interval '61 seconds'"
            )

            def forgotten() -> bool:
                row = connection.execute("SELECT count(*) FROM memory_observations_done").fetchone()
                return row == (0,)

            within(5.0, forgotten)
        [anew] = service.stub.QueueObservations(batch, timeout=10).queued
        assert anew.queued_now and anew.id != queued.id
    finally:
        service.stop()
