"""
Text and hybrid search through svc-memory over real grpcio and a real
PostgreSQL (decisions D13, "Hybrid search"): after random adds, edits and
deletes made through the service (so that the cached index follows them
through the change listener, as it does on every replica), the served
text ranking is a straightforward BM25 over the scope's rows in
PostgreSQL, and the hybrid ranking the reciprocal-rank fusion of that and
a straightforward cosine ranking; a second replica agrees within a second;
the requests' refusals.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import numpy
import pytest
from authfixtures import Tenant
from bm25reference import Document, bm25Ranking, fusedRanking
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memoryfixtures import MODEL, appConnection, vectorBytes, within
from memoryservice import RunningMemoryService
from psycopg.rows import dict_row

from svcd.memory.text import TextKey
from svcd.pb.memory.v1 import memory_pb2

# Vectors whose cosines with QUERY are far apart (1, 0.95, 0.71, 0, -1):
# the served float32 ranking and a float64 one cannot disagree.
PALETTE = [[1.0, 0.0, 0.0], [3.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]
QUERY = [1.0, 0.0, 0.0]
# Memories of another model (and size): in the text index, never in the
# vector ranking.
OTHER_MODEL = "embed-other"


def scope(tenant: Tenant, subject: str = "") -> memory_pb2.Scope:
    return memory_pb2.Scope(org_id=str(tenant.orgID), agent_id=str(tenant.agentID), subject=subject)


def embedding(values: list[float], model: str = MODEL) -> memory_pb2.Embedding:
    return memory_pb2.Embedding(model=model, vector=vectorBytes(values))


def served(
    service: RunningMemoryService, where: memory_pb2.Scope, mode: str, text: str, k: int = 100
) -> list[tuple[uuid.UUID, float]]:
    request = memory_pb2.SearchRequest(scope=where, k=k, mode=mode, text=text)
    if mode != "text":
        request.query.CopyFrom(embedding(QUERY))
    answer = service.stub.Search(request, timeout=10)
    return [(uuid.UUID(each.memory.id), each.score) for each in answer.results]


def scopeRows(dsn: str, where: memory_pb2.Scope) -> list[dict[str, Any]]:
    """
    The scope's rows as PostgreSQL holds them now, read apart from the
    service.
    """
    with appConnection(dsn) as connection:
        connection.execute("SELECT set_config('svc.org_id', %s, false)", (where.org_id,))
        cursor = connection.cursor(row_factory=dict_row)
        cursor.execute(
            "SELECT id, content, created_at, embedding_model, vector FROM memories"
            " WHERE org_id = %s AND agent_id = %s AND subject = %s",
            (where.org_id, where.agent_id, where.subject),
        )
        return cursor.fetchall()


def cosineRanking(rows: list[dict[str, Any]]) -> list[uuid.UUID]:
    query = numpy.asarray(QUERY, dtype=numpy.float64)
    scored = []
    for row in rows:
        if row["embedding_model"] != MODEL:
            continue
        vector = numpy.frombuffer(bytes(row["vector"]), dtype="<f4").astype(numpy.float64)
        cosine = float(vector @ query / numpy.linalg.norm(vector) / numpy.linalg.norm(query))
        scored.append((cosine, row["created_at"], row["id"].int, row["id"]))
    scored.sort(reverse=True)
    return [memoryID for _, _, _, memoryID in scored]


def expected(
    dsn: str, where: memory_pb2.Scope, query: str
) -> tuple[list[tuple[uuid.UUID, float]], list[tuple[uuid.UUID, float]]]:
    """
    The text and hybrid rankings a straightforward reading of D13 gives
    over the scope's rows.
    """
    rows = scopeRows(dsn, where)
    documents = [Document(row["id"], row["created_at"], row["content"]) for row in rows]
    text = bm25Ranking(documents, query)
    created: dict[uuid.UUID, object] = {row["id"]: row["created_at"] for row in rows}
    hybrid = fusedRanking([cosineRanking(rows), [memoryID for memoryID, _ in text]], created)
    return text, hybrid


def agrees(
    servedRanking: list[tuple[uuid.UUID, float]], reference: list[tuple[uuid.UUID, float]]
) -> bool:
    """
    The same memories in the same order, scores equal but for the float32
    of the wire.
    """
    return [each for each, _ in servedRanking] == [each for each, _ in reference] and all(
        abs(mine - theirs) <= 1e-6 * max(1.0, abs(theirs))
        for (_, mine), (_, theirs) in zip(servedRanking, reference, strict=True)
    )


def servesReference(
    dsn: str, service: RunningMemoryService, where: memory_pb2.Scope, query: str
) -> bool:
    """
    Whether the served text and hybrid rankings (all, and the first two)
    are those of the scope's rows in PostgreSQL now.
    """
    text, hybrid = expected(dsn, where, query)
    return (
        agrees(served(service, where, "text", query), text)
        and agrees(served(service, where, "hybrid", query), hybrid[:100])
        and agrees(served(service, where, "hybrid", query, k=2), hybrid[:2])
    )


vocabulary = st.sampled_from(
    [
        "Alice",
        "alice",
        "Paris",
        "2024",
        "café",
        "CAFÉ",
        "東京",
        "東京都",
        "Straße",
        "STRASSE",
        "tea",
        "green_tea",
        "x",
        "Ωmega",
    ]
)
separators = st.sampled_from([" ", ", ", "-", ". ", "\n"])


@st.composite
def contents(draw: st.DrawFn) -> str:
    chosen = draw(st.lists(vocabulary, min_size=0, max_size=6))
    text = "".join(word + draw(separators) for word in chosen).strip()
    return text or "?"


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), contents(), st.integers(0, 4), st.booleans()),
        st.tuples(st.just("edit"), st.integers(0, 1000), contents(), st.integers(0, 4)),
        st.tuples(st.just("metadata"), st.integers(0, 1000)),
        st.tuples(st.just("delete"), st.integers(0, 1000)),
    ),
    min_size=1,
    max_size=14,
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    initial=st.lists(st.tuples(contents(), st.integers(0, 4)), max_size=6),
    changes=operations,
    queries=st.lists(contents(), min_size=1, max_size=3),
)
def test_servedRankingsAreBM25AndItsFusion(
    migratedDSN: str,
    memoryService: RunningMemoryService,
    acme: Tenant,
    initial: list[tuple[str, int]],
    changes: list[tuple[Any, ...]],
    queries: list[str],
) -> None:
    """
    The scope's text index is built by a first text search, then kept
    current through the listener while memories are added (some by
    another model), edited (new content and vector), given new metadata
    and deleted through the service: after each change the text ranking
    is BM25 over the rows PostgreSQL holds, and the hybrid ranking the
    fusion of that and the cosine ranking, order and scores; the index
    was never loaded again.
    """
    stub = memoryService.stub
    subject = f"s-{uuid.uuid4().hex[:12]}"
    where = scope(acme, subject)
    held: list[str] = []

    def add(content: str, paletteIndex: int, otherModel: bool = False) -> None:
        vector = embedding(PALETTE[paletteIndex])
        if otherModel:
            vector = embedding([1.0, 2.0], OTHER_MODEL)
        memory = stub.AddMemory(
            memory_pb2.AddMemoryRequest(scope=where, content=content, embedding=vector),
            timeout=10,
        )
        held.append(memory.id)

    try:
        for content, paletteIndex in initial:
            add(content, paletteIndex)
        served(memoryService, where, "text", "warm")
        misses = memoryService.registry.get_sample_value("svc_memory_cache_misses_total")
        assert misses is not None
        for change in changes:
            if change[0] == "add":
                add(change[1], change[2], change[3])
            elif not held:
                pass
            elif change[0] == "edit":
                stub.UpdateMemory(
                    memory_pb2.UpdateMemoryRequest(
                        scope=where,
                        id=held[change[1] % len(held)],
                        content=change[2],
                        embedding=embedding(PALETTE[change[3]]),
                    ),
                    timeout=10,
                )
            elif change[0] == "metadata":
                stub.UpdateMemory(
                    memory_pb2.UpdateMemoryRequest(
                        scope=where, id=held[change[1] % len(held)], metadata_json='{"n": 1}'
                    ),
                    timeout=10,
                )
            else:
                stub.DeleteMemory(
                    memory_pb2.DeleteMemoryRequest(scope=where, id=held.pop(change[1] % len(held))),
                    timeout=10,
                )
            for query in queries:
                # A write is in this replica's index before it is answered
                # (read your writes), unless the listener is more than the
                # settling second late on a loaded machine: then it follows.
                within(
                    5.0,
                    functools.partial(servesReference, migratedDSN, memoryService, where, query),
                )
        # The vectors' first load is the one miss since: the text index
        # was kept, never read again.
        assert memoryService.registry.get_sample_value("svc_memory_cache_misses_total") == (
            misses + 1
        )
        cached = memoryService.cache.lookup(TextKey(acme.orgID, acme.agentID, subject))
        assert cached is not None
    finally:
        stub.DeleteScope(memory_pb2.DeleteScopeRequest(scope=where))


def test_anotherReplicasIndexFollowsWithinOneSecond(
    migratedDSN: str, replicas: tuple[RunningMemoryService, RunningMemoryService], acme: Tenant
) -> None:
    """
    Two replicas with the scope's text index cached: what one adds,
    changes and deletes, the other's text search finds (or no longer
    finds) within one second, without loading the index again.
    """
    first, second = replicas
    where = scope(acme, "shared")
    seed = first.stub.AddMemory(
        memory_pb2.AddMemoryRequest(scope=where, content="seed", embedding=embedding(QUERY))
    )
    for replica in replicas:
        assert [each for each, _ in served(replica, where, "text", "seed")] == [uuid.UUID(seed.id)]
    misses = second.registry.get_sample_value("svc_memory_cache_misses_total")

    added = first.stub.AddMemory(
        memory_pb2.AddMemoryRequest(
            scope=where, content="Alice flew to Paris", embedding=embedding(QUERY)
        )
    )
    addedID = uuid.UUID(added.id)

    def found(query: str) -> list[uuid.UUID]:
        return [each for each, _ in served(second, where, "text", query)]

    within(1.0, lambda: found("paris") == [addedID])
    first.stub.UpdateMemory(
        memory_pb2.UpdateMemoryRequest(
            scope=where, id=added.id, content="Alice flew to Tokyo", embedding=embedding(QUERY)
        )
    )
    within(1.0, lambda: found("paris") == [] and found("tokyo") == [addedID])
    first.stub.DeleteMemory(memory_pb2.DeleteMemoryRequest(scope=where, id=added.id))
    within(1.0, lambda: found("alice tokyo seed") == [uuid.UUID(seed.id)])
    assert second.registry.get_sample_value("svc_memory_cache_misses_total") == misses
    text, hybrid = expected(migratedDSN, where, "seed alice")
    assert agrees(served(second, where, "text", "seed alice"), text)
    assert agrees(served(second, where, "hybrid", "seed alice"), hybrid)


def refusal(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    error = raised.value
    assert isinstance(error, grpc.Call)
    return error.code(), error.details()


def test_searchRefusals(memoryService: RunningMemoryService, acme: Tenant) -> None:
    """
    An unknown mode, a text or hybrid search without its text, a vector or
    hybrid search without its embedding: INVALID_ARGUMENT, naming the
    field. A text search needs no embedding; min_score is ignored outside
    vector mode.
    """
    stub, where = memoryService.stub, scope(acme)
    stub.AddMemory(
        memory_pb2.AddMemoryRequest(scope=where, content="green tea", embedding=embedding(QUERY))
    )

    def search(**fields: Any) -> object:
        return stub.Search(memory_pb2.SearchRequest(scope=where, k=5, **fields), timeout=10)

    code, details = refusal(lambda: search(mode="semantic", text="tea", query=embedding(QUERY)))
    assert (code, details.split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, "mode")
    for mode in ("text", "hybrid"):
        code, details = refusal(functools.partial(search, mode=mode, query=embedding(QUERY)))
        assert (code, details.split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, "text")
    for mode in ("vector", "hybrid", ""):
        code, details = refusal(functools.partial(search, mode=mode, text="tea"))
        assert (code, details.split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, "query")
    answer = stub.Search(
        memory_pb2.SearchRequest(scope=where, k=5, mode="text", text="TEA", min_score=1.0)
    )
    assert [each.memory.content for each in answer.results] == ["green tea"]
    assert answer.results[0].score > 0
