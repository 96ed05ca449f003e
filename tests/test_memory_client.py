"""
The client of svc-memory (svcd/memoryclient/) against the real
MemoryService: Deferreds fired on the reactor thread, each refusal as its
own exception (what the proxy maps to D13's HTTP answers), deadlines and
cancellation against a server that never answers, and the worker's queue.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import attrs
import grpc
import pytest
import pytest_twisted
from authfixtures import Tenant
from memoryfixtures import embedding, scopeOf
from memoryservice import RunningMemoryService
from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import deferLater

from svcd.devkit.servers import freePort
from svcd.memory.records import OTHER_LENGTH
from svcd.memoryclient.channel import memoryChannel
from svcd.memoryclient.client import MemoryClient
from svcd.memoryclient.errors import (
    MemoryForbidden,
    MemoryFull,
    MemoryInvalid,
    MemoryNotFound,
    MemoryUnavailable,
)
from svcd.memoryclient.records import Scope
from svcd.pb.memory.v1 import memory_pb2


def clientOf(address: str, timeout: float = 5.0) -> MemoryClient:
    from twisted.internet import reactor

    return MemoryClient(
        lambda: memoryChannel(address), IReactorFromThreads(reactor), timeout=timeout
    )


@pytest.fixture
def client(memoryService: RunningMemoryService) -> Iterator[MemoryClient]:
    made = clientOf(memoryService.address)
    made.start()
    yield made
    made.close()


@pytest_twisted.ensureDeferred
async def test_memoriesThroughTheClient(client: MemoryClient, acme: Tenant) -> None:
    """
    Add, get, list, update, search, delete and delete the scope through
    the Deferred API; each result arrives on the reactor thread.
    """
    scope = scopeOf(acme, "u")
    added = await client.addMemory(scope, "speaks French", embedding([1.0, 0.0]), '{"a":1}')
    assert threading.current_thread() is threading.main_thread()
    assert (added.content, added.metadata_json) == ("speaks French", '{"a":1}')
    assert (await client.getMemory(scope, added.id)) == added
    second = await client.addMemory(scope, "lives in Lyon", embedding([0.0, 1.0]))
    listed = await client.listMemories(scope, limit=10)
    assert [each.id for each in listed.memories] == [second.id, added.id]
    found = await client.search(scope, embedding([0.1, 1.0]), k=1)
    assert [(each.memory.id, round(each.score, 3)) for each in found.results] == [
        (second.id, 0.995)
    ]
    changed = await client.updateMemory(scope, added.id, metadataJSON='{"b":2}')
    assert (changed.content, changed.metadata_json) == ("speaks French", '{"b":2}')
    assert (await client.deleteMemory(scope, second.id)).id == second.id
    emptied = await client.deleteScope(scope)
    assert (emptied.memories_deleted, emptied.observations_deleted) == (1, 0)


@pytest_twisted.ensureDeferred
async def test_refusalsAreTheirOwnExceptions(
    migratedDSN: str, acme: Tenant, globex: Tenant
) -> None:
    """
    NOT_FOUND, PERMISSION_DENIED, FAILED_PRECONDITION (a full scope) and
    INVALID_ARGUMENT each fail the Deferred with their own exception,
    carrying the server's details.
    """
    service = RunningMemoryService(migratedDSN, maxPerScope=1).start()
    client = clientOf(service.address)
    try:
        scope = scopeOf(acme)
        added = await client.addMemory(scope, "only one", embedding([1.0]))
        with pytest.raises(MemoryNotFound):
            await client.getMemory(scope, "018f0000-0000-7000-8000-000000000000")
        with pytest.raises(MemoryForbidden):
            await client.deleteMemory(scopeOf(globex), added.id)
        with pytest.raises(MemoryFull):
            await client.addMemory(scope, "a second", embedding([1.0]))
        with pytest.raises(MemoryInvalid) as invalid:
            await client.search(scope, embedding([1.0]), k=1000)
        assert invalid.value.details.startswith("k")
        assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        client.close()
        service.stop()


@pytest_twisted.ensureDeferred
async def test_anUnreachableServiceIsUnavailable(acme: Tenant) -> None:
    """
    Nothing listening: the call fails at once with L{MemoryUnavailable}
    (the proxy's 503), not after its deadline.
    """
    client = clientOf(f"127.0.0.1:{freePort()}", timeout=30.0)
    try:
        started = time.monotonic()
        with pytest.raises(MemoryUnavailable) as raised:
            await client.getMemory(scopeOf(acme), "018f0000-0000-7000-8000-000000000000")
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 10
    finally:
        client.close()


@attrs.frozen
class HungServer:
    """
    A grpcio server whose GetMemory never answers until the test ends: a
    hung svc-memory. C{entered} is set once a call is in its handler, so
    that a test cancels a call known to be in flight (a bare listening
    socket would not do: grpcio gives up its HTTP/2 handshake after the
    channel's 100 ms connect timeout, failing the call before a loaded
    machine got round to cancelling it).
    """

    address: str
    entered: threading.Event


@contextlib.contextmanager
def oneMethodServer(method: str, behaviour: Any) -> Iterator[str]:
    """
    A grpcio server on a free loopback port answering MemoryService's
    C{method} with C{behaviour}, as a misbehaving svc-memory would; its
    address.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "svc.memory.v1.MemoryService",
                {method: grpc.unary_unary_rpc_method_handler(behaviour)},
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0).wait(5)


@pytest.fixture
def hungServer() -> Iterator[HungServer]:
    entered = threading.Event()
    release = threading.Event()

    def hang(request: bytes, context: grpc.ServicerContext) -> bytes:
        entered.set()
        release.wait(30)
        return b""

    with oneMethodServer("GetMemory", hang) as address:
        try:
            yield HungServer(address, entered)
        finally:
            release.set()


@pytest.fixture
def slowServer() -> Iterator[str]:
    """
    A grpcio server whose Search takes two seconds: a svc-memory stuck on
    its database.
    """

    def slowly(request: bytes, context: grpc.ServicerContext) -> bytes:
        time.sleep(2.0)
        return b""

    with oneMethodServer("Search", slowly) as address:
        yield address


@pytest_twisted.ensureDeferred
async def test_aHungServiceMeetsTheDeadline(slowServer: str, acme: Tenant) -> None:
    """
    The call's own deadline ends it (DEADLINE_EXCEEDED, as
    L{MemoryUnavailable}) while the reactor keeps running.
    """
    from twisted.internet import reactor

    client = clientOf(slowServer, timeout=0.5)
    try:
        started = time.monotonic()
        call = client.search(scopeOf(acme), embedding([1.0]), k=1)
        ticked = await deferLater(reactor, 0.05, time.monotonic)
        assert ticked - started < 0.25
        with pytest.raises(MemoryUnavailable) as raised:
            await call
        assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.45 < time.monotonic() - started < 1.9
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_cancellingCancelsTheCall(hungServer: HungServer, acme: Tenant) -> None:
    """
    Cancelling the Deferred (the proxy's client went away) ends a call in
    flight at once with CancelledError, long before its deadline.
    """
    from twisted.internet import reactor

    client = clientOf(hungServer.address, timeout=30.0)
    try:
        call = client.getMemory(scopeOf(acme), "018f0000-0000-7000-8000-000000000000")
        waited = time.monotonic()
        while not hungServer.entered.is_set():
            assert time.monotonic() - waited < 10, "the call never reached the server"
            await deferLater(reactor, 0.01, lambda: None)
        assert not call.called
        started = time.monotonic()
        call.cancel()
        with pytest.raises(CancelledError):
            await call
        assert time.monotonic() - started < 1
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_theWorkersQueueThroughTheClient(client: MemoryClient, acme: Tenant) -> None:
    """
    An observation queued (twice: once), claimed under a lease, released
    with its attempt counted, claimed again, and completed: gone.
    """
    observation = memory_pb2.Observation(
        scope=memory_pb2.Scope(org_id=str(acme.orgID), agent_id=str(acme.agentID)),
        request_id="req-42",
        messages=[
            memory_pb2.ObservedMessage(role="user", content="my cat is Tom"),
            memory_pb2.ObservedMessage(role="assistant", content="Nice cat"),
        ],
    )
    queued = await client.queueObservations([observation])
    again = await client.queueObservations([observation])
    assert queued.queued[0].id == again.queued[0].id and not again.queued[0].queued_now
    claimed = await client.claimObservations("worker-a", 10, 60.0)
    [held] = claimed.observations
    assert [each.content for each in held.messages] == ["my cat is Tom", "Nice cat"]
    assert (await client.claimObservations("worker-b", 10, 60.0)).observations == []
    released = await client.releaseObservation(
        str(acme.orgID), held.id, "worker-a", retryAfter=0.0, countAttempt=True, reason="x"
    )
    assert released.released
    [again2] = (await client.claimObservations("worker-b", 10, 60.0)).observations
    assert again2.attempts == 1
    assert (await client.completeObservation(str(acme.orgID), held.id, "worker-b")).completed
    with pytest.raises(MemoryNotFound):
        await client.completeObservation(str(acme.orgID), held.id, "worker-b")


@pytest_twisted.ensureDeferred
async def test_storeObservationMergesAndCompletesUnderTheLease(
    client: MemoryClient, acme: Tenant
) -> None:
    """
    StoreObservation, for the claim holding the lease: each memory is
    added (source extracted, the observation's request id), or takes the
    place of a near one at or above dedupe_score; the observation is
    completed. For a claim whose lease passed to another (a stale token),
    nothing is stored (stored false); for an observation gone meanwhile it
    is NOT_FOUND and the memories it added are deleted again. The lease is
    renewed only for its own token.
    """
    scope = scopeOf(acme, "merge")

    async def claimOne(requestID: str) -> memory_pb2.ClaimedObservation:
        await client.queueObservations(
            [
                memory_pb2.Observation(
                    scope=memory_pb2.Scope(
                        org_id=str(acme.orgID), agent_id=str(acme.agentID), subject="merge"
                    ),
                    request_id=requestID,
                    messages=[memory_pb2.ObservedMessage(role="user", content="facts")],
                )
            ]
        )
        [held] = (await client.claimObservations("worker-a", 10, 60.0)).observations
        return held

    held = await claimOne("req-store-1")
    renewed = await client.renewObservationLease(
        str(acme.orgID), held.id, "worker-a", held.lease_token, 120.0
    )
    assert renewed.renewed and renewed.lease_expires_at > held.lease_expires_at
    stale = await client.renewObservationLease(
        str(acme.orgID), held.id, "worker-a", "0190c0de-0000-7000-8000-0000000000aa", 60.0
    )
    assert not stale.renewed
    stored = await client.storeObservation(
        str(acme.orgID),
        held.id,
        "worker-a",
        "0190c0de-0000-7000-8000-0000000000aa",
        60.0,
        scope,
        "req-store-1",
        [("I keep bees.", embedding([1.0, 0.0, 0.0]))],
        0.9,
    )
    assert not stored.stored and not stored.added_ids
    assert (await client.listMemories(scope)).memories == []
    stored = await client.storeObservation(
        str(acme.orgID),
        held.id,
        "worker-a",
        held.lease_token,
        60.0,
        scope,
        "req-store-1",
        [
            ("I keep bees.", embedding([1.0, 0.0, 0.0])),
            ("I live in Lyon.", embedding([0.0, 1.0, 0.0])),
        ],
        0.9,
    )
    assert stored.stored and len(stored.added_ids) == 2 and stored.updated == 0
    listed = (await client.listMemories(scope)).memories
    assert sorted(each.content for each in listed) == ["I keep bees.", "I live in Lyon."]
    assert {(each.source, each.source_request_id) for each in listed} == {
        ("extracted", "req-store-1")
    }
    with pytest.raises(MemoryNotFound):
        await client.completeObservation(str(acme.orgID), held.id, "worker-a")

    again = await claimOne("req-store-2")
    stored = await client.storeObservation(
        str(acme.orgID),
        again.id,
        "worker-a",
        again.lease_token,
        60.0,
        scope,
        "req-store-2",
        [("I keep many bees.", embedding([0.99, 0.01, 0.0]))],
        0.9,
    )
    assert stored.stored and not stored.added_ids and stored.updated == 1
    contents = sorted(each.content for each in (await client.listMemories(scope)).memories)
    assert contents == ["I keep many bees.", "I live in Lyon."]

    # Two near memories of one observation: one memory, the later content
    # (as if the first had been stored before the second was searched).
    twins = await claimOne("req-store-twins")
    stored = await client.storeObservation(
        str(acme.orgID),
        twins.id,
        "worker-a",
        twins.lease_token,
        60.0,
        scope,
        "req-store-twins",
        [
            ("I own a red car.", embedding([0.0, 0.0, 1.0])),
            ("I own a red bike.", embedding([0.0, 0.01, 0.99])),
        ],
        0.9,
    )
    assert stored.stored and len(stored.added_ids) == 1 and stored.updated == 0
    contents = sorted(each.content for each in (await client.listMemories(scope)).memories)
    assert contents == ["I keep many bees.", "I live in Lyon.", "I own a red bike."]

    gone = await claimOne("req-store-3")
    await client.deleteScope(scopeOf(acme, "merge"))
    with pytest.raises(MemoryNotFound):
        await client.storeObservation(
            str(acme.orgID),
            gone.id,
            "worker-a",
            gone.lease_token,
            60.0,
            scope,
            "req-store-3",
            [("I keep wasps.", embedding([0.0, 0.0, 1.0]))],
            0.9,
        )
    assert (await client.listMemories(scope)).memories == []


@pytest_twisted.ensureDeferred
async def test_callsPastTheBoundWaitTheirTurn(slowServer: str, acme: Tenant) -> None:
    """
    With maxInFlight, calls past the bound wait for a turn instead of
    being sent (svc-memory would refuse them): the waiting one is sent once
    a slot frees, with what is left of its deadline; one that gets no turn
    within its deadline is MemoryUnavailable, and one cancelled while it
    waits leaves the queue.
    """
    from twisted.internet import reactor

    client = MemoryClient(
        lambda: memoryChannel(slowServer),
        IReactorFromThreads(reactor),
        timeout=5.0,
        maxInFlight=1,
        clock=reactor,
    )
    try:
        scope, query = scopeOf(acme), embedding([1.0])
        started = time.monotonic()
        first = client.search(scope, query, k=1)
        second = client.search(scope, query, k=1)
        late = client.search(scope, query, k=1, timeout=0.5)
        cancelled = client.search(scope, query, k=1)
        cancelled.cancel()
        with pytest.raises(CancelledError):
            await cancelled
        with pytest.raises(MemoryUnavailable) as raised:
            await late
        assert raised.value.code is None and "no turn" in raised.value.details
        assert 0.45 < time.monotonic() - started < 1.9
        # The slow server answers an empty message after two seconds: the
        # first call, then the second, one after the other.
        await first
        assert 1.9 < time.monotonic() - started < 3.9
        await second
        assert time.monotonic() - started > 3.9
    finally:
        client.close()


class _RefusingChannel:
    """
    A channel whose calls raise as they are made, as grpcio's does once it
    is closed.
    """

    def unary_unary(self, *_: object, **__: object) -> Any:
        return self

    def future(self, *_: object, **__: object) -> Any:
        raise ValueError("Cannot invoke RPC on closed channel!")


@pytest_twisted.ensureDeferred
async def test_aCallThatCannotBeMadeGivesItsTurnBack() -> None:
    """
    With maxInFlight, a call sent at once (a slot was free) that grpcio
    refuses as it is made fails its Deferred, and its slot is free again:
    the next call is made at once, not held until its deadline.
    """
    from twisted.internet import reactor

    client = MemoryClient(
        _RefusingChannel, IReactorFromThreads(reactor), timeout=5.0, maxInFlight=1, clock=reactor
    )
    started = time.monotonic()
    for _ in range(2):
        with pytest.raises(ValueError):
            await client.search(Scope(uuid.uuid4(), uuid.uuid4()), embedding([1.0]), k=1)
    assert time.monotonic() - started < 1


def test_aBoundNeedsAClock() -> None:
    from twisted.internet import reactor

    with pytest.raises(ValueError):
        MemoryClient(lambda: None, IReactorFromThreads(reactor), maxInFlight=1)


@pytest_twisted.ensureDeferred
async def test_aCallerNotAdmittedIsUnavailableNotForbidden(acme: Tenant) -> None:
    """
    svc-memory's PERMISSION_DENIED to a client certificate it does not
    admit (SVC_GRPC_INTERNAL_SUBJECTS) refuses no memory: the deployment's
    fault, L{MemoryUnavailable} (the proxy's 503), not L{MemoryForbidden}
    (its 403, "not this agent's"), which only svc-memory's own refusal of
    another tenant's memory is.
    """
    from svcd.auth.callers import DENIED_DETAILS

    def denied(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, DENIED_DETAILS)
        raise AssertionError("abort returned")

    with oneMethodServer("GetMemory", denied) as address:
        client = clientOf(address)
        try:
            with pytest.raises(MemoryUnavailable) as raised:
                await client.getMemory(scopeOf(acme), "018f0000-0000-7000-8000-000000000000")
            assert raised.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert raised.value.details == DENIED_DETAILS
            assert not isinstance(raised.value, MemoryForbidden)
        finally:
            client.close()


@pytest_twisted.ensureDeferred
async def test_aVectorOfAnotherLengthThanTheScopesIsRefused(
    client: MemoryClient, acme: Tenant
) -> None:
    """
    svc-memory refuses a vector whose length is not that of the scope's
    other vectors of its model (decisions D13 amended, "Vectors never
    mix"; it started a set of its own, silently), INVALID_ARGUMENT on
    "embedding" with details the proxy answers 502, not 400: an add, a new
    content (but for the scope's only memory of the model), a worker's
    memories (nothing stored, the observation not completed), and a
    worker's memories of two lengths (numpy's fault before: INTERNAL);
    and a search's query of another length, on "query" (it found nothing,
    silently). Another model's vectors, and another scope's, are their
    own.
    """
    scope = scopeOf(acme, "lengths")
    first = await client.addMemory(scope, "I keep bees.", embedding([1.0, 0.0, 0.0]))
    second = await client.addMemory(scope, "I live in Lyon.", embedding([0.0, 1.0, 0.0]))
    refused = "embedding: " + OTHER_LENGTH
    with pytest.raises(MemoryInvalid) as raised:
        await client.addMemory(scope, "I like tea.", embedding([1.0, 1.0]))
    assert raised.value.details == refused
    with pytest.raises(MemoryInvalid) as raised:
        await client.updateMemory(scope, first.id, "I keep wasps.", None, embedding([1.0, 1.0]))
    assert raised.value.details == refused
    with pytest.raises(MemoryInvalid) as raised:
        await client.search(scope, embedding([1.0, 1.0]), 5)
    assert raised.value.details == "query: " + OTHER_LENGTH
    with pytest.raises(MemoryInvalid):
        await client.search(scope, embedding([1.0, 1.0]), 5, mode="hybrid", text="tea")
    await client.addMemory(scope, "I like tea.", embedding([1.0, 1.0], model="other-model"))
    await client.addMemory(scopeOf(acme, "elsewhere"), "I like tea.", embedding([1.0, 1.0]))
    await client.queueObservations(
        [
            memory_pb2.Observation(
                scope=memory_pb2.Scope(
                    org_id=str(acme.orgID), agent_id=str(acme.agentID), subject="lengths"
                ),
                request_id="req-lengths",
                messages=[memory_pb2.ObservedMessage(role="user", content="facts")],
            )
        ]
    )
    [held] = (await client.claimObservations("worker-a", 10, 60.0)).observations
    for memories, details in [
        ([("I like coffee.", embedding([0.0, 1.0]))], refused),
        (
            [
                ("I like coffee.", embedding([0.0, 0.0, 1.0])),
                ("I like cake.", embedding([0.0, 1.0])),
            ],
            "memories[1].embedding: " + OTHER_LENGTH,
        ),
    ]:
        with pytest.raises(MemoryInvalid) as raised:
            await client.storeObservation(
                str(acme.orgID),
                held.id,
                "worker-a",
                held.lease_token,
                60.0,
                scope,
                "req-lengths",
                memories,
                0.99,
            )
        assert raised.value.details == details
    listed = (await client.listMemories(scope)).memories
    assert sorted(each.content for each in listed) == [
        "I keep bees.",
        "I like tea.",
        "I live in Lyon.",
    ]
    assert (await client.completeObservation(str(acme.orgID), held.id, "worker-a")).completed
    # The scope's only memory of the model takes a vector of any length.
    await client.deleteMemory(scope, second.id)
    changed = await client.updateMemory(
        scope, first.id, "I keep wasps.", None, embedding([1.0, 1.0])
    )
    assert changed.content == "I keep wasps."
