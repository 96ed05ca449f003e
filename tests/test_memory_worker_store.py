"""
StoreObservation, svc-worker's write of an observation's memories
(svcd/memory/extracted.py; decisions D13, amended), against real
MemoryService replicas on a real PostgreSQL: the memories go into the
observation's own agent and subject whatever the call names; a memory
deleted while the worker worked is not written back; and the same fact
in two observations stored at once, through two replicas whose caches
both searched the scope before either wrote, is one memory.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import pytest
from authfixtures import Tenant
from memoryfixtures import MODEL, embedding, scopeOf, secondAgent, vectorBytes
from memoryservice import RunningMemoryService

from svcd.auth.store import Store
from svcd.memory.extracted import Plan, RecentRow
from svcd.memory.ranking import Hit
from svcd.memoryclient.records import Embedding, Scope
from svcd.pb.memory.v1 import memory_pb2


def scopeMessage(scope: Scope) -> memory_pb2.Scope:
    return memory_pb2.Scope(
        org_id=str(scope.orgID), agent_id=str(scope.agentID), subject=scope.subject
    )


def claimed(
    service: RunningMemoryService, scope: Scope, requestID: str, owner: str = "w"
) -> memory_pb2.ClaimedObservation:
    service.stub.QueueObservations(
        memory_pb2.QueueObservationsRequest(
            observations=[
                memory_pb2.Observation(
                    scope=scopeMessage(scope),
                    request_id=requestID,
                    messages=[memory_pb2.ObservedMessage(role="user", content="said")],
                )
            ]
        ),
        timeout=10,
    )
    answer: memory_pb2.ClaimObservationsResponse = service.stub.ClaimObservations(
        memory_pb2.ClaimObservationsRequest(owner=owner, limit=1, lease_seconds=60), timeout=10
    )
    [held] = answer.observations
    assert held.request_id == requestID
    return held


def storeRequest(
    held: memory_pb2.ClaimedObservation,
    scope: Scope,
    memories: Sequence[tuple[str, Embedding]],
    owner: str = "w",
) -> memory_pb2.StoreObservationRequest:
    return memory_pb2.StoreObservationRequest(
        org_id=held.scope.org_id,
        id=held.id,
        owner=owner,
        lease_token=held.lease_token,
        lease_seconds=60,
        scope=scopeMessage(scope),
        request_id=held.request_id,
        memories=[
            memory_pb2.ExtractedMemory(
                content=content,
                embedding=memory_pb2.Embedding(model=each.model, vector=each.vector),
            )
            for content, each in memories
        ],
        dedupe_score=0.9,
    )


def contents(service: RunningMemoryService, scope: Scope) -> list[str]:
    listed = service.stub.ListMemories(
        memory_pb2.ListMemoriesRequest(scope=scopeMessage(scope), limit=100), timeout=10
    )
    return sorted(each.content for each in listed.memories)


def test_memoriesGoIntoTheObservationsOwnScope(
    memoryService: RunningMemoryService, acme: Tenant, owner: Store
) -> None:
    """
    A StoreObservation naming another subject, or another agent of the
    organization, stores into the observation's own agent and subject
    (and dedupes there): nothing reaches the scope the call named.
    """
    own = scopeOf(acme, "alice")
    otherSubject = scopeOf(acme, "bob")
    otherAgent = Scope(acme.orgID, secondAgent(owner, acme), "alice")
    first = claimed(memoryService, own, "req-1")
    answer = memoryService.stub.StoreObservation(
        storeRequest(first, otherSubject, [("I sail.", embedding([1.0, 0.0]))]), timeout=10
    )
    assert answer.stored and len(answer.added_ids) == 1
    second = claimed(memoryService, own, "req-2")
    answer = memoryService.stub.StoreObservation(
        storeRequest(
            second,
            otherAgent,
            [("I sail a lot.", embedding([0.99, 0.01])), ("I row.", embedding([0.0, 1.0]))],
        ),
        timeout=10,
    )
    assert answer.stored and len(answer.added_ids) == 1 and answer.updated == 1
    assert contents(memoryService, own) == ["I row.", "I sail a lot."]
    assert contents(memoryService, otherSubject) == []
    assert contents(memoryService, otherAgent) == []


def test_aMemoryDeletedWhileTheWorkerWorkedIsNotWrittenBack(
    memoryService: RunningMemoryService, acme: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    The replica's cache still names a memory deleted meanwhile as the
    nearest (it lags PostgreSQL by up to a second) for an observation said
    after the deletion: the write that would have given it the new content
    is dropped, not added as a new memory, and the observation is
    completed.
    """
    scope = scopeOf(acme, "carol")
    rome = embedding([1.0, 0.0])
    added = memoryService.stub.AddMemory(
        memory_pb2.AddMemoryRequest(
            scope=scopeMessage(scope),
            content="I live in Rome.",
            source="api",
            embedding=memory_pb2.Embedding(model=rome.model, vector=rome.vector),
        ),
        timeout=10,
    )
    memoryService.stub.DeleteMemory(
        memory_pb2.DeleteMemoryRequest(scope=scopeMessage(scope), id=added.id), timeout=10
    )
    # Said after the deletion (an observation said before it is forgotten
    # whole: test_memory_forgetting.py).
    held = claimed(memoryService, scope, "req-rome")
    stale = Hit(uuid.UUID(added.id), 0.99)
    monkeypatch.setattr(
        memoryService.parts.searcher, "nearest", lambda *arguments: stale, raising=False
    )
    answer = memoryService.stub.StoreObservation(
        storeRequest(held, scope, [("I live in Rome now.", embedding([0.99, 0.01]))]), timeout=10
    )
    assert answer.stored and list(answer.added_ids) == [] and answer.updated == 0
    assert contents(memoryService, scope) == []
    assert memoryService.parts.store.observationsWaiting() == 0


def test_theSameFactStoredAtOnceThroughTwoReplicasIsOneMemory(
    replicas: tuple[RunningMemoryService, RunningMemoryService],
    acme: Tenant,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """
    Two observations of one scope telling the same fact, stored at the
    same moment through two replicas, each of which searched its cache
    before either wrote (a barrier holds both searches until both are
    made): one memory, which the second took as an update; each
    observation completed.
    """
    scope = scopeOf(acme, "dave")
    first, second = replicas
    heldFirst = claimed(first, scope, "req-a", owner="w1")
    heldSecond = claimed(second, scope, "req-b", owner="w2")
    barrier = threading.Barrier(2, timeout=10)
    for replica in replicas:
        searcher = replica.parts.searcher
        nearest: Callable[..., Any] = searcher.nearest

        def searchedTogether(*arguments: Any, nearest: Callable[..., Any] = nearest) -> Any:
            found = nearest(*arguments)
            barrier.wait()
            return found

        monkeypatch.setattr(searcher, "nearest", searchedTogether, raising=False)
    fact = [("My favourite colour is green.", embedding([0.6, 0.8]))]
    with futures.ThreadPoolExecutor(2) as pool:
        answers = list(
            pool.map(
                lambda pair: pair[0].stub.StoreObservation(
                    storeRequest(pair[1], scope, fact, owner=pair[2]), timeout=20
                ),
                [(first, heldFirst, "w1"), (second, heldSecond, "w2")],
            )
        )
    assert all(each.stored for each in answers)
    assert sorted((len(each.added_ids), each.updated) for each in answers) == [(0, 1), (1, 0)]
    assert contents(first, scope) == ["My favourite colour is green."]
    assert first.parts.store.observationsWaiting() == 0


def test_aPlanScoresRecentWritesFromTheirCurrentVectors() -> None:
    """
    Under the lock a plan compares each memory with the scope's recent
    writes as they are now: one the cache scores high but whose vector
    changed since is scored afresh (and not taken), a recent one of the
    same model at or above the dedupe score is taken, and one of another
    model is never compared.
    """
    changed, recent, otherModel = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    fact = [("I live in Oslo.", embedding([1.0, 0.0]))]
    stale = Hit(changed, 0.99)
    since = datetime.datetime.now(datetime.UTC)
    plan = Plan(fact, 0.9, lambda _: stale, since)
    turned = RecentRow(changed, MODEL, vectorBytes([0.0, 1.0]))
    [write] = plan.writes([turned])
    assert write.target is None
    [write] = plan.writes([])
    assert write.target == changed
    near = RecentRow(recent, MODEL, vectorBytes([0.98, 0.05]))
    other = RecentRow(otherModel, "other-model", vectorBytes([1.0, 0.0]))
    [write] = Plan(fact, 0.9, lambda _: None, since).writes([turned, near, other])
    assert (write.target, write.content) == (recent, "I live in Oslo.")
    [write] = Plan(fact, 0.9, lambda _: None, since).writes([other])
    assert write.target is None
