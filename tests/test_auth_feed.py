"""
svc-auth's change feed (decisions D8, svcd/auth/feed.py): the snapshot of
known token ids, every token and agent change (made through gRPC or straight
in PostgreSQL, as svcctl does), heartbeats, and the end of every stream when
the listener loses PostgreSQL; against a real grpcio server and a real
PostgreSQL. The hub's and the snapshots' own rules are unit-tested below.
"""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import pytest_twisted
from authfixtures import makeTenant, ownerStore
from authhelpers import FeedReader, StreamFailed, document, svcctl
from authservice import RunningAuthService
from prometheus_client import CollectorRegistry
from twisted.internet.interfaces import IReactorThreads
from waiting import waitUntil

from svcd.auth.authority import issueToken
from svcd.auth.feed import (
    SNAPSHOT_CHUNK_IDS,
    STOPPING,
    ChangeHub,
    FeedEnded,
    FeedUnavailable,
    Snapshots,
    TooManyStreams,
    snapshotMessages,
)
from svcd.auth.grpcservice import AuthMetrics, AuthServicer, GrpcServerService
from svcd.auth.limits import limitsChange
from svcd.auth.store import Store
from svcd.auth.store.limits import LimitsRecord
from svcd.common.grpcadmission import Bounds
from svcd.common.migrations import migrate
from svcd.devkit.postgres import PostgresServer
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc


@pytest.fixture
def reader(authService: RunningAuthService) -> Iterator[FeedReader]:
    feed = FeedReader(authService)
    yield feed
    feed.close()


def test_streamStartsWithEveryAcceptableTokenID(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    A stream begins with the ids of every token that may be accepted, in
    every organization, and none of a revoked or an expired token (they
    would be refused anyway); the snapshot's end says how many ids it held.
    """
    first = makeTenant(owner, "a")
    second = makeTenant(owner, "b")
    revoked = makeTenant(owner, "c")
    owner.revokeToken(revoked.tokenID)
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1)
    _, expired = issueToken(owner, orgID=first.orgID, permissions=1, expiresAt=past)
    future = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    _, expiring = issueToken(owner, orgID=first.orgID, permissions=1, expiresAt=future)

    feed = FeedReader(authService)
    try:
        known = feed.snapshot()
        assert known == {first.tokenID, second.tokenID, expiring.tokenID}
        assert expired.tokenID not in known
    finally:
        feed.close()


def test_changesMadeInPostgreSQLArriveWithinOneSecond(
    authService: RunningAuthService, owner: Store, reader: FeedReader
) -> None:
    """
    A token created, a token revoked and an agent's status changed straight
    in PostgreSQL (as svcctl does) each reach an open stream within one
    second, after its snapshot.
    """
    tenant = makeTenant(owner)
    reader.snapshot()

    _, created = issueToken(owner, orgID=tenant.orgID, permissions=1)
    reader.waitFor("token_changed", created.tokenID.bytes)
    owner.revokeToken(tenant.tokenID)
    reader.waitFor("token_changed", tenant.tokenID.bytes)
    owner.setAgentStatus(tenant.agentID, "suspended")
    reader.waitFor("agent_changed", tenant.agentID.bytes)
    agent = owner.createAgent(tenant.orgID, "new")
    reader.waitFor("agent_changed", agent.agentID.bytes)


def test_changesMadeThroughGrpcArriveToo(
    authService: RunningAuthService, owner: Store, reader: FeedReader
) -> None:
    """
    CreateToken and RevokeToken through the gRPC API reach the stream as
    changes of their token.
    """
    admin = makeTenant(owner, permissions=1 | 2 | 4)
    reader.snapshot()
    answer = authService.call(
        "CreateToken", auth_pb2.CreateTokenRequest(name="x", permissions=1), bearer=admin.token
    )
    createdID = uuid.UUID(answer.info.token_id)
    reader.waitFor("token_changed", createdID.bytes)
    authService.call(
        "RevokeToken", auth_pb2.RevokeTokenRequest(token_id=str(createdID)), bearer=admin.token
    )
    reader.waitFor("token_changed", createdID.bytes)


def test_heartbeatsFollowTheSnapshot(reader: FeedReader) -> None:
    """
    After the snapshot, heartbeats keep coming, each well within the 250 ms
    that decisions D8 allow between them (the listener beats every 50 ms
    here, every 100 ms in the daemon).
    """
    reader.snapshot()
    reader.waitFor("heartbeat", limit=2.0)
    gaps = [reader.waitFor("heartbeat", limit=1.0) for _ in range(20)]
    # A single slow gap on a busy machine is not the property; the median
    # is.
    assert sorted(gaps)[len(gaps) // 2] < 0.25, gaps


def test_aChangeComesBeforeTheHeartbeatsThatFollowIt(
    authService: RunningAuthService, owner: Store, reader: FeedReader
) -> None:
    """
    Heartbeats vouch for every change committed before them: once the
    commit of a change has returned, the change arrives before the
    heartbeats of beats sent after it (PostgreSQL delivers notifications
    in commit order and the listener sends a heartbeat only for its own
    beat coming back).
    """
    tenant = makeTenant(owner)
    reader.snapshot()
    reader.waitFor("heartbeat", limit=2.0)
    owner.revokeToken(tenant.tokenID)
    # Beats already in flight at the commit may still come back first, a
    # few at most; a heartbeat from a timer would not wait for the change
    # at all.
    heartbeats = 0
    while True:
        change = reader.next()
        assert isinstance(change, auth_pb2.Change), change
        kind = change.WhichOneof("kind")
        if kind == "token_changed":
            assert change.token_changed == tenant.tokenID.bytes
            break
        if kind == "heartbeat":
            heartbeats += 1
    assert heartbeats <= 5


def test_streamsEndWhenPostgreSQLGoesAndStartOverWhenItIsBack(
    privatePostgres: PostgresServer,
) -> None:
    """
    When the listener loses PostgreSQL (a restart), every open stream ends
    with UNAVAILABLE, since changes could now be missed, and new ones are
    refused until the listener listens again; then a new stream starts
    with a fresh snapshot that holds what was created meanwhile.
    """
    dsn = privatePostgres.createDatabase("feed")
    migrate(dsn)
    service = RunningAuthService(dsn).start()
    try:
        reader = FeedReader(service)
        # The stream is registered once its snapshot is read: a token made
        # before that may be in the snapshot only, never a token_changed
        # (seen once on a loaded machine: no token_changed within 5 s).
        reader.snapshot()
        store, connection = ownerStore(dsn)
        first = makeTenant(store, "a")
        connection.close()
        reader.waitFor("token_changed", first.tokenID.bytes, limit=5.0)
        privatePostgres.stop()
        ended = reader.next(limit=10.0)
        while isinstance(ended, auth_pb2.Change):
            ended = reader.next(limit=10.0)
        assert isinstance(ended, grpc.RpcError)
        assert ended.code() == grpc.StatusCode.UNAVAILABLE
        refused = FeedReader(service)
        outcome = refused.next(limit=10.0)
        assert isinstance(outcome, grpc.RpcError)
        assert outcome.code() == grpc.StatusCode.UNAVAILABLE

        privatePostgres.start()
        store, connection = ownerStore(dsn)
        second = makeTenant(store, "b")
        connection.close()

        def streamServes() -> bool:
            feed = FeedReader(service)
            try:
                return feed.snapshot() == {first.tokenID, second.tokenID}
            except StreamFailed:
                return False
            finally:
                feed.close()

        waitUntil(streamServes, limit=15.0, interval=0.2)
    finally:
        service.stop()


# Limits (decisions D11)


def limitsRowOf(printed: dict[str, Any]) -> auth_pb2.LimitsChanged:
    """
    The feed's message for a row as svcctl printed it (cleared: no limits).
    """
    changed = auth_pb2.LimitsChanged(
        org_id=uuid.UUID(printed["org_id"]).bytes,
        agent_id=uuid.UUID(printed["agent_id"]).bytes if printed["agent_id"] else b"",
    )
    if not printed.get("cleared"):
        changed.limits.version = printed["version"]
        for field in ("rpm", "tpm", "max_output_tokens"):
            if printed[field] is not None:
                setattr(changed.limits, field, printed[field])
    return changed


def test_streamStartsWithEveryLimitsRow(authService: RunningAuthService, owner: Store) -> None:
    """
    After the token ids and before snapshot_complete, a stream carries
    every limits row of every organization, unset values absent; a
    cleared row is not among them.
    """
    first = makeTenant(owner, "a")
    second = makeTenant(owner, "b")
    org = owner.setLimits(first.orgID, None, {"rpm": 60, "tpm": 1000})
    agent = owner.setLimits(first.orgID, first.agentID, {"max_output_tokens": 256})
    other = owner.setLimits(second.orgID, None, {"rpm": 5})
    owner.setLimits(second.orgID, second.agentID, {"rpm": 1})
    owner.clearLimits(second.orgID, second.agentID)

    def snapshotHasThem() -> bool:
        feed = FeedReader(authService)
        try:
            known = feed.snapshot()
            assert known == {first.tokenID, second.tokenID}
            # The listener may still be applying the last changes.
            return feed.limits == {
                (first.orgID.bytes, b""): auth_pb2.Limits(rpm=60, tpm=1000, version=org.version),
                (first.orgID.bytes, first.agentID.bytes): auth_pb2.Limits(
                    max_output_tokens=256, version=agent.version
                ),
                (second.orgID.bytes, b""): auth_pb2.Limits(rpm=5, version=other.version),
            }
        finally:
            feed.close()

    waitUntil(snapshotHasThem, limit=1.0, interval=0.05)


def test_limitsChangesMadeWithSvcctlArriveWithinOneSecond(
    authService: RunningAuthService, owner: Store, reader: FeedReader, migratedDSN: str
) -> None:
    """
    A row set, changed and cleared with svcctl, the organization's and an
    agent's, reaches an open stream within one second each, as the row
    now is (a cleared row without limits).
    """
    tenant = makeTenant(owner)
    reader.snapshot()
    org, agent = str(tenant.orgID), str(tenant.agentID)
    for arguments in [
        ("set", "--org", org, "--rpm", "100"),
        ("set", "--org", org, "--tpm", "5000", "--rpm", "none"),
        ("set", "--org", org, "--agent", agent, "--max-output-tokens", "64"),
        ("clear", "--org", org, "--agent", agent),
        ("clear", "--org", org),
    ]:
        printed = document(svcctl(migratedDSN, "limits", *arguments))
        reader.waitFor("limits_changed", limitsRowOf(printed), limit=1.0)


def test_aLimitsChangeComesBeforeTheHeartbeatsThatFollowIt(
    authService: RunningAuthService, owner: Store, reader: FeedReader
) -> None:
    """
    Heartbeats vouch for limits changes too: once a change's commit has
    returned, the row arrives before the heartbeats of beats sent after it
    (the listener re-reads the row before it handles the next
    notification).
    """
    tenant = makeTenant(owner)
    reader.snapshot()
    reader.waitFor("heartbeat", limit=2.0)
    row = owner.setLimits(tenant.orgID, tenant.agentID, {"tpm": 42})
    heartbeats = 0
    while True:
        change = reader.next()
        assert isinstance(change, auth_pb2.Change), change
        kind = change.WhichOneof("kind")
        if kind == "limits_changed":
            assert change.limits_changed == auth_pb2.LimitsChanged(
                org_id=tenant.orgID.bytes,
                agent_id=tenant.agentID.bytes,
                limits=auth_pb2.Limits(tpm=42, version=row.version),
            )
            break
        if kind == "heartbeat":
            heartbeats += 1
    # Beats already in flight at the commit may come back first, a few at
    # most (as for tokens).
    assert heartbeats <= 5


# The hub and the snapshots alone.


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hubRefusesStreamsWhileNotListeningAndBeyondItsLimit() -> None:
    """
    No stream opens before the listener listens, nor past C{maxStreams};
    a closed stream frees its place.
    """
    hub = ChangeHub(FakeMonotonic(), maxStreams=2)
    with pytest.raises(FeedUnavailable):
        hub.open()
    hub.listenerUp()
    first = hub.open()
    hub.open()
    with pytest.raises(TooManyStreams):
        hub.open()
    hub.close(first)
    hub.open()
    assert hub.openStreams() == 2


def test_hubEndsEveryStreamWhenTheListenerGoes() -> None:
    """
    Losing the listener ends every stream after what it had queued, and
    the hub forgets them.
    """
    hub = ChangeHub(FakeMonotonic())
    hub.listenerUp()
    stream = hub.open()
    tokenID = uuid.uuid4()
    hub.tokenChanged(tokenID)
    hub.listenerDown()
    change = stream.next(timeout=1)
    assert isinstance(change, auth_pb2.Change)
    assert change.token_changed == tokenID.bytes
    assert isinstance(stream.next(timeout=1), FeedEnded)
    assert hub.openStreams() == 0
    with pytest.raises(FeedUnavailable):
        hub.open()


def test_hubStopEndsEveryStreamAtOnce() -> None:
    """
    When svc-auth stops, the hub ends every stream at once, saying why, and
    opens no new one, even if the listener is heard again.
    """
    hub = ChangeHub(FakeMonotonic())
    hub.listenerUp()
    streams = [hub.open(), hub.open()]
    assert hub.stop() == 2
    for stream in streams:
        ended = stream.next(timeout=1)
        assert isinstance(ended, FeedEnded) and ended.reason == STOPPING
    hub.listenerUp()
    with pytest.raises(FeedUnavailable, match=STOPPING):
        hub.open()
    assert hub.openStreams() == 0


@pytest_twisted.ensureDeferred
async def test_aStoppingServerEndsItsFeedsAtOnce(authService: RunningAuthService) -> None:
    """
    The gRPC service of svc-auth ends its change feed streams as its stop
    begins (UNAVAILABLE, "svc-auth is stopping"), so that the stop does
    not wait for its grace period (10 s here) while a proxy is attached.
    """
    from twisted.internet import reactor

    servicer = AuthServicer(
        authService.authority,
        AuthMetrics(CollectorRegistry()),
        authService.hub,
        Snapshots(authService.store.knownTokenIDs, time.monotonic),
    )
    service = GrpcServerService(
        IReactorThreads(reactor), servicer, "127.0.0.1", 0, Bounds.standard(8, 32), gracePeriod=10.0
    )
    service.privilegedStartService()
    service.startService()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        call: Any = auth_pb2_grpc.AuthServiceStub(channel).WatchChanges(
            auth_pb2.WatchChangesRequest(), timeout=60
        )
        assert next(call).WhichOneof("kind") in ("known_token_ids", "snapshot_complete")
        began = time.monotonic()
        await service.stopService()
        assert time.monotonic() - began < 2.0
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ended.value.details() == STOPPING
    finally:
        channel.close()


def test_aStreamThatFallsBehindIsEndedNotBuffered() -> None:
    """
    A stream whose queue is full is ended (its proxy starts over with a
    snapshot) instead of holding an unbounded backlog; the others go on.
    """
    hub = ChangeHub(FakeMonotonic(), queueSize=3)
    hub.listenerUp()
    slow = hub.open()
    for _ in range(3):
        hub.heartbeat()
    fast = hub.open()
    hub.heartbeat()
    assert hub.openStreams() == 1
    received = []
    while True:
        item = slow.next(timeout=1)
        received.append(item)
        if isinstance(item, FeedEnded):
            break
    assert isinstance(received[-1], FeedEnded)
    assert len(received) <= 3
    change = fast.next(timeout=1)
    assert isinstance(change, auth_pb2.Change)
    assert change.WhichOneof("kind") == "heartbeat"


def test_streamsOpenedBeforeAReadShareIt() -> None:
    """
    A snapshot read that began after a stream registered serves it; a
    stream registered after that read began gets a read of its own.
    """
    clock = FakeMonotonic()
    reads: list[float] = []

    def read() -> bytes:
        reads.append(clock.now)
        clock.now += 1.0
        return uuid.uuid4().bytes

    snapshots = Snapshots(read, clock)
    first = snapshots.since(100.0)
    assert snapshots.since(100.0) == first
    assert snapshots.since(99.0) == first
    second = snapshots.since(100.5)
    assert second != first
    assert reads == [100.0, 101.0]


def test_snapshotMessagesChunkTheIDs() -> None:
    """
    The ids go in chunks small enough for gRPC's message limit, whole ids
    only, and the end carries their count.
    """
    ids = b"".join(uuid.uuid4().bytes for _ in range(SNAPSHOT_CHUNK_IDS + 5))
    messages = list(snapshotMessages(ids))
    assert [len(each.known_token_ids) for each in messages[:-1]] == [
        16 * SNAPSHOT_CHUNK_IDS,
        16 * 5,
    ]
    assert b"".join(each.known_token_ids for each in messages[:-1]) == ids
    assert messages[-1].snapshot_complete.token_count == SNAPSHOT_CHUNK_IDS + 5
    assert [each.WhichOneof("kind") for each in snapshotMessages(b"")] == ["snapshot_complete"]


def test_snapshotMessagesSendLimitsRowsBeforeTheEnd() -> None:
    """
    Every limits row comes after the token ids and before the snapshot's
    end, one message each.
    """
    ids = uuid.uuid4().bytes
    rows = [
        LimitsRecord(uuid.uuid4(), None, 1, None, None, 1),
        LimitsRecord(uuid.uuid4(), uuid.uuid4(), None, 2, None, 2),
    ]
    messages = list(snapshotMessages(ids, rows))
    assert [each.WhichOneof("kind") for each in messages] == [
        "known_token_ids",
        "limits_changed",
        "limits_changed",
        "snapshot_complete",
    ]
    assert messages[1].limits_changed == limitsChange(rows[0].orgID, None, rows[0]).limits_changed
    assert rows[1].agentID is not None
    assert messages[2].limits_changed.agent_id == rows[1].agentID.bytes
    assert messages[-1].snapshot_complete.token_count == 1


def test_hubSendsLimitsChangesToEveryStream() -> None:
    """
    A limits change goes to every open stream as the row, or as its
    absence when cleared.
    """
    hub = ChangeHub(FakeMonotonic())
    hub.listenerUp()
    streams = [hub.open(), hub.open()]
    org = uuid.uuid4()
    row = LimitsRecord(org, None, 3, None, None, 7)
    hub.limitsChanged(org, None, row)
    hub.limitsChanged(org, None, None)
    for stream in streams:
        first, second = stream.next(timeout=1), stream.next(timeout=1)
        assert first == limitsChange(org, None, row)
        assert isinstance(second, auth_pb2.Change)
        assert not second.limits_changed.HasField("limits")
