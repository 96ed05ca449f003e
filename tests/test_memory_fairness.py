"""
No organization holds up another (decisions D13, amended;
sql/0018_fair_claims.sql), against a real PostgreSQL: claims take the
organizations in turn, counting what each has in hand, and an
organization's observations past SVC_MEMORY_MAX_WAITING_PER_ORG waiting
are refused "queue_full", exactly, also under concurrent queue calls,
while one queued before is answered as before.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from collections import Counter
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memoryfixtures import storeOn
from memoryservice import RunningMemoryService

from svcd.common.config import ConfigError
from svcd.memory.config import MemoryConfig
from svcd.memory.records import NewObservation, QueuedObservation
from svcd.memory.store import MemoryStore
from svcd.memoryclient.records import QUEUE_FULL, ObservedMessage, Scope
from svcd.pb.memory.v1 import memory_pb2

MESSAGES = (ObservedMessage("user", "I live in Oslo"),)


def scopeOf(orgID: uuid.UUID) -> Scope:
    # Observations need no organization row: the claim and the queue read
    # memory_observations alone.
    return Scope(orgID, uuid.UUID(int=orgID.int ^ 1), "")


def queue(
    store: MemoryStore, orgID: uuid.UUID, keys: list[str], cap: int | None = None
) -> list[QueuedObservation]:
    return store.queueObservations(
        [NewObservation(scopeOf(orgID), f"req-{key}", MESSAGES, key) for key in keys], cap
    )


@pytest.fixture
def ownerConnection(migratedDSN: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        yield connection


def test_anotherOrganizationsObservationIsInTheFirstClaim(memoryStore: MemoryStore) -> None:
    """
    One organization queued 400 conversations, then another one: a claim
    of 10 takes the second organization's (first in, first out took it
    after 399 of the first's), and the first's oldest ones with it.
    """
    crowded, quiet = uuid.uuid4(), uuid.uuid4()
    backlog = queue(memoryStore, crowded, [f"a-{n:03}" for n in range(400)])
    [alone] = queue(memoryStore, quiet, ["b-000"])
    claimed = memoryStore.claimObservations("worker-1", 60.0, 10)
    assert len(claimed) == 10
    assert alone.observationID in {each.observationID for each in claimed}
    # The backlog's oldest: all queued in one transaction, so due at the
    # same time, in the order of their ids.
    oldest = sorted(each.observationID for each in backlog if each.observationID is not None)
    assert {each.observationID for each in claimed if each.scope.orgID == crowded} == set(
        oldest[:9]
    )


def test_anOrganizationWithNothingInHandGoesFirst(memoryStore: MemoryStore) -> None:
    """
    A worker whose concurrency is full claims one observation as each
    ends: an organization that queued after another's backlog was claimed
    into the workers' hands has its observation taken by the next claim
    of one, not after the rest of the backlog.
    """
    crowded, quiet = uuid.uuid4(), uuid.uuid4()
    queue(memoryStore, crowded, [f"a-{n:03}" for n in range(100)])
    inHand = memoryStore.claimObservations("worker-1", 60.0, 64)
    assert {each.scope.orgID for each in inHand} == {crowded}
    [alone] = queue(memoryStore, quiet, ["b-000"])
    [next] = memoryStore.claimObservations("worker-1", 60.0, 1)
    assert next.observationID == alone.observationID


# The shapes of queues: per organization, how many observations are due,
# how many are in a worker's hand, how many wait for a later attempt, and
# how many have a lease that ran out (due again); and the claims' sizes.
organizationShapes = st.lists(
    st.tuples(st.integers(0, 12), st.integers(0, 4), st.integers(0, 2), st.integers(0, 2)),
    min_size=1,
    max_size=6,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    shapes=organizationShapes,
    limits=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    ages=st.randoms(use_true_random=False),
)
def test_eachClaimTakesTheOrganizationsInTurn(
    memoryStore: MemoryStore,
    ownerConnection: psycopg.Connection[tuple[object, ...]],
    shapes: list[tuple[int, int, int, int]],
    limits: list[int],
    ages: object,
) -> None:
    """
    Whatever the organizations' queues hold, each claim of k takes the k
    due observations of lowest turn (an organization's observations in
    hand, plus the observation's place among its due ones, oldest due
    first), the oldest due first among equal turns: every organization's
    first before any organization's second when none has any in hand.
    Checked claim after claim against a model of the rule, the claimed
    ones staying in hand.
    """
    import random

    assert isinstance(ages, random.Random)
    ownerConnection.execute("DELETE FROM memory_observations")
    now = datetime.datetime.now(datetime.UTC)
    # id -> (org, next_attempt_at); in hand per organization.
    due: dict[uuid.UUID, tuple[uuid.UUID, datetime.datetime]] = {}
    held: Counter[uuid.UUID] = Counter()
    for number, (dueCount, inHand, later, expired) in enumerate(shapes):
        orgID = uuid.UUID(int=(number + 1) << 64 | ages.getrandbits(32))
        keys = [f"o{number}-{n}" for n in range(dueCount + inHand + later + expired)]
        rows = queue(memoryStore, orgID, keys)
        for index, row in enumerate(rows):
            assert row.observationID is not None
            # Due at some time in the last hour, in no order of keys or
            # organizations: ties of age are decided by id.
            at = now - datetime.timedelta(seconds=ages.randrange(3600))
            lease: datetime.datetime | None = None
            if index < inHand:
                lease = now + datetime.timedelta(hours=1)
                held[orgID] += 1
            elif index < inHand + later:
                at = now + datetime.timedelta(hours=1)
            elif index < inHand + later + expired:
                lease = now - datetime.timedelta(minutes=1)
            ownerConnection.execute(
                "UPDATE memory_observations SET next_attempt_at = %s, lease_expires_at = %s,"
                " lease_owner = CASE WHEN %s::timestamptz IS NULL THEN NULL ELSE 'other' END"
                " WHERE id = %s",
                (at, lease, lease, row.observationID),
            )
            if not inHand <= index < inHand + later and (lease is None or lease < now):
                due[row.observationID] = (orgID, at)
    for limit in limits:
        places: Counter[uuid.UUID] = Counter()
        turns = {}
        for observationID, (orgID, at) in sorted(
            due.items(), key=lambda item: (item[1][1], item[0])
        ):
            places[orgID] += 1
            turns[observationID] = (held[orgID] + places[orgID], at, observationID)
        expected = set(sorted(turns, key=turns.__getitem__)[:limit])
        claimed = memoryStore.claimObservations("worker-1", 600.0, limit)
        assert {each.observationID for each in claimed} == expected
        for each in claimed:
            held[each.scope.orgID] += 1
            del due[each.observationID]


def test_pastTheCapObservationsAreRefusedQueueFull(
    memoryStore: MemoryStore, ownerConnection: psycopg.Connection[tuple[object, ...]]
) -> None:
    """
    With a cap of 3: an organization's observations past 3 waiting are
    refused queue_full, without an id, and not queued (those of a batch
    in the order of their keys, the proxy's ledger ids: the latest last);
    one queued before, waiting or processed, is answered as before all
    the same; another organization has room of its own; a failed
    observation is not waiting; once one is processed there is room for
    one more.
    """
    crowded, other = uuid.uuid4(), uuid.uuid4()
    first = queue(memoryStore, crowded, ["k1", "k2"], cap=3)
    assert [each.queuedNow for each in first] == [True, True]
    batch = queue(memoryStore, crowded, ["k5", "k3", "k4", "k1"], cap=3)
    assert [(each.key, each.queuedNow, each.refused) for each in batch] == [
        ("k5", False, QUEUE_FULL),
        ("k3", True, ""),
        ("k4", False, QUEUE_FULL),
        ("k1", False, ""),
    ]
    assert batch[0].observationID is None and batch[2].observationID is None
    assert batch[3].observationID == first[0].observationID
    assert ownerConnection.execute(
        "SELECT observation_key FROM memory_observations WHERE org_id = %s"
        " ORDER BY observation_key",
        (crowded,),
    ).fetchall() == [("k1",), ("k2",), ("k3",)]
    assert [each.queuedNow for each in queue(memoryStore, other, ["k1", "k2", "k3"], 3)] == [
        True,
        True,
        True,
    ]
    # One processed: room for one, and the processed one is answered as
    # queued before, not queued again.
    [held] = memoryStore.claimObservations("worker-1", 60.0, 1)
    assert held.scope.orgID in (crowded, other)
    crowdedHeld = held
    while crowdedHeld.scope.orgID != crowded:
        [crowdedHeld] = memoryStore.claimObservations("worker-1", 60.0, 1)
    assert crowdedHeld.leaseToken is not None
    memoryStore.completeObservation(
        crowded, crowdedHeld.observationID, "worker-1", crowdedHeld.leaseToken
    )
    again = queue(memoryStore, crowded, [crowdedHeld.requestID[4:], "k4", "k5"], cap=3)
    assert [(each.queuedNow, each.refused) for each in again] == [
        (False, ""),
        (True, ""),
        (False, QUEUE_FULL),
    ]
    assert again[0].observationID == crowdedHeld.observationID
    # A failed observation waits no more.
    ownerConnection.execute(
        "UPDATE memory_observations SET state = 'failed'"
        " WHERE org_id = %s AND observation_key = 'k4'",
        (crowded,),
    )
    assert queue(memoryStore, crowded, ["k5"], cap=3)[0].queuedNow


def test_concurrentQueueCallsNeverPassTheCap(migratedDSN: str) -> None:
    """
    Eight queue calls of one organization at once, each of five new
    observations, under a cap of 12: exactly 12 are queued and the 28
    others refused, whatever the interleaving (each call counts and
    inserts in its turn).
    """
    orgID = uuid.uuid4()
    answers: list[list[QueuedObservation]] = []
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def call(number: int) -> None:
        try:
            with storeOn(migratedDSN) as store:
                start.wait(timeout=30)
                answers.append(queue(store, orgID, [f"t{number}-{n}" for n in range(5)], 12))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=call, args=(number,)) for number in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    outcomes = Counter(each.refused or "queued" for answer in answers for each in answer)
    assert outcomes == {"queued": 12, QUEUE_FULL: 28}
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*) FROM memory_observations WHERE org_id = %s", (orgID,)
        ).fetchone()
    assert row == (12,)


def test_queueObservationsAnswersRefusedQueueFull(migratedDSN: str) -> None:
    """
    Over gRPC, with SVC_MEMORY_MAX_WAITING_PER_ORG 2: the third new
    observation of an organization is answered refused "queue_full" with
    no id; the first, sent again, is answered with its id as before.
    """
    orgID = uuid.uuid4()
    where = memory_pb2.Scope(org_id=str(orgID), agent_id=str(uuid.uuid4()), subject="")

    def observation(key: str) -> memory_pb2.Observation:
        return memory_pb2.Observation(
            scope=where,
            request_id=f"req-{key}",
            messages=[memory_pb2.ObservedMessage(role="user", content="I am vegan")],
            key=key,
        )

    service = RunningMemoryService(migratedDSN, maxWaitingPerOrg=2, listen=False).start()
    try:
        answer = service.stub.QueueObservations(
            memory_pb2.QueueObservationsRequest(
                observations=[observation(key) for key in ("k1", "k2", "k3", "k1")]
            ),
            timeout=10,
        ).queued
    finally:
        service.stop()
    assert [(each.key, each.queued_now, each.refused) for each in answer] == [
        ("k1", True, ""),
        ("k2", True, ""),
        ("k3", False, QUEUE_FULL),
        ("k1", False, ""),
    ]
    assert answer[2].id == "" and answer[3].id == answer[0].id != ""


def test_theCapIsRead() -> None:
    """
    SVC_MEMORY_MAX_WAITING_PER_ORG is 100,000 unless set, and must be a
    positive integer.
    """
    dsn = {"POSTGRES_DSN": "postgresql://svc@db/svc"}
    assert MemoryConfig.fromEnvironment(dsn).maxWaitingPerOrg == 100_000
    seven = MemoryConfig.fromEnvironment({**dsn, "SVC_MEMORY_MAX_WAITING_PER_ORG": "7"})
    assert seven.maxWaitingPerOrg == 7
    with pytest.raises(ConfigError):
        MemoryConfig.fromEnvironment({**dsn, "SVC_MEMORY_MAX_WAITING_PER_ORG": "0"})
