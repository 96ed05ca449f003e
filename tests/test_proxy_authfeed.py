"""
The proxy's end of svc-auth's change feed (svcd/authclient/feed.py): when
it is live, what reaches the cache, reconnection and its logging. First
with scripted streams, a task.Clock and a reactor whose callFromThread
queue the test pumps; then against a real grpcio svc-auth and PostgreSQL.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import attrs
import grpc
import pytest
import pytest_twisted
from authfixtures import makeTenant
from authservice import RunningAuthService
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import Clock, deferLater
from twisted.logger import ILogObserver, Logger, LogLevel
from zope.interface import implementer

from svcd.auth.store import Store
from svcd.authclient.feed import ChangeFeed, FeedNotLive, openChangeFeed
from svcd.authclient.knowntokens import KnownTokens
from svcd.pb.auth.v1 import auth_pb2


class ScriptedCall:
    """
    A streaming call whose messages the test sends; C{fail} ends it with
    an error, C{cancel} as grpcio's does.
    """

    def __init__(self) -> None:
        self._messages: queue.Queue[auth_pb2.Change | Exception] = queue.Queue()
        self.cancelled = False

    def send(self, change: auth_pb2.Change) -> None:
        self._messages.put(change)

    def fail(self, error: Exception) -> None:
        self._messages.put(error)

    def cancel(self) -> bool:
        self.cancelled = True
        self._messages.put(RuntimeError("cancelled"))
        return True

    def __iter__(self) -> Iterator[auth_pb2.Change]:
        while True:
            item = self._messages.get(timeout=30)
            if isinstance(item, Exception):
                raise item
            yield item


@implementer(IReactorFromThreads)
class PumpedReactor:
    """
    callFromThread queues the call; the test runs them on its own thread
    (standing for the reactor's) with L{pumpUntil}.
    """

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[Callable[..., object], tuple[Any, ...]]] = queue.Queue()

    def callFromThread(self, callable: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        self.calls.put((callable, args))

    def pumpUntil(self, condition: Callable[[], bool], limit: float = 5.0) -> None:
        deadline = time.monotonic() + limit
        while not condition():
            remaining = deadline - time.monotonic()
            assert remaining > 0, "condition not met in time"
            try:
                function, args = self.calls.get(timeout=min(remaining, 0.1))
            except queue.Empty:
                continue
            function(*args)


@attrs.define
class RecordingConsumer:
    started: list[KnownTokens] = attrs.field(factory=list)
    changes: list[tuple[str, bytes]] = attrs.field(factory=list)

    def feedStarted(self, known: KnownTokens) -> None:
        self.started.append(known)

    def tokenChanged(self, tokenID: bytes) -> None:
        self.changes.append(("token", tokenID))

    def agentChanged(self, agentID: bytes) -> None:
        self.changes.append(("agent", agentID))


@attrs.define
class FeedHarness:
    feed: ChangeFeed
    clock: Clock
    reactor: PumpedReactor
    consumer: RecordingConsumer
    calls: queue.Queue[ScriptedCall]
    events: list[dict[str, Any]]

    def nextCall(self) -> ScriptedCall:
        return self.calls.get(timeout=5)

    def logged(self, level: LogLevel) -> list[str]:
        return [event["log_format"] for event in self.events if event["log_level"] == level]


def snapshot(call: ScriptedCall, *ids: bytes) -> None:
    call.send(auth_pb2.Change(known_token_ids=b"".join(ids)))
    call.send(auth_pb2.Change(snapshot_complete=auth_pb2.SnapshotComplete(token_count=len(ids))))


HEARTBEAT = auth_pb2.Change(heartbeat=auth_pb2.Heartbeat())


@pytest.fixture
def harness() -> Iterator[FeedHarness]:
    clock = Clock()
    clock.advance(500)
    reactor = PumpedReactor()
    consumer = RecordingConsumer()
    calls: queue.Queue[ScriptedCall] = queue.Queue()

    def openStream() -> ScriptedCall:
        call = ScriptedCall()
        calls.put(call)
        return call

    events: list[dict[str, Any]] = []
    feed = ChangeFeed(openStream, consumer, reactor, clock, retryDelays=(0.01,))
    feed.log = Logger(observer=cast(ILogObserver, events.append))
    feed.start()
    yield FeedHarness(feed, clock, reactor, consumer, calls, events)
    feed.stop()


def test_liveOnlyOnceTheSnapshotHasArrived(harness: FeedHarness) -> None:
    """
    The feed is not live until its stream's snapshot is complete; then the
    consumer gets the known ids, and the feed is live.
    """
    call = harness.nextCall()
    assert not harness.feed.live()
    known = uuid.uuid4().bytes
    call.send(auth_pb2.Change(known_token_ids=known))
    snapshot(call, uuid.uuid4().bytes)
    harness.reactor.pumpUntil(lambda: bool(harness.consumer.started))
    assert known in harness.consumer.started[0]
    assert harness.feed.live()
    assert harness.logged(LogLevel.info)


def test_liveWhileTheLastMessageIsAtMostHalfASecondOld(harness: FeedHarness) -> None:
    """
    Trust lasts 500 ms after the last message: a heartbeat or a change
    renews it, silence ends it, and the silence is logged once (and the
    return once).
    """
    call = harness.nextCall()
    snapshot(call)
    harness.reactor.pumpUntil(lambda: bool(harness.consumer.started))
    harness.clock.advance(0.5)
    assert harness.feed.live()
    harness.clock.advance(0.01)
    assert not harness.feed.live()
    harness.clock.advance(1.0)  # the watchdog notices, once
    harness.clock.advance(1.0)
    assert len(harness.logged(LogLevel.warn)) == 1
    call.send(HEARTBEAT)
    harness.reactor.pumpUntil(harness.feed.live)
    harness.clock.advance(0.25)
    assert any("again" in line for line in harness.logged(LogLevel.info))
    tokenID = uuid.uuid4().bytes
    harness.clock.advance(0.3)
    call.send(auth_pb2.Change(token_changed=tokenID))
    harness.reactor.pumpUntil(lambda: bool(harness.consumer.changes))
    harness.clock.advance(0.4)
    assert harness.feed.live()


def test_aBusyReactorDoesNotMakeAHealthyFeedLookOld(harness: FeedHarness) -> None:
    """
    Silence is judged by when the feed's thread read the last message, so
    a reactor running late (messages waiting for it) still trusts a feed
    that keeps speaking; but not once it is more than a second behind in
    applying them.
    """
    call = harness.nextCall()
    snapshot(call)
    harness.reactor.pumpUntil(harness.feed.live)
    queued = harness.reactor.calls.qsize()
    for _ in range(3):
        harness.clock.advance(0.3)
        call.send(HEARTBEAT)
        queued += 1
        waitUntilQueued(harness.reactor, queued)
    # 0.9 s since the last message applied, 0 since the last one read.
    assert harness.feed.live()
    harness.reactor.pumpUntil(harness.reactor.calls.empty)
    assert harness.feed.live()
    queued = 0
    for _ in range(4):
        harness.clock.advance(0.3)
        call.send(HEARTBEAT)
        queued += 1
        waitUntilQueued(harness.reactor, queued)
    # Still speaking, but nothing applied for 1.2 s.
    assert not harness.feed.live()
    harness.reactor.pumpUntil(harness.reactor.calls.empty)
    assert harness.feed.live()
    harness.clock.advance(0.51)
    assert not harness.feed.live()


def waitUntilQueued(reactor: PumpedReactor, count: int = 1) -> None:
    """
    Wait until C{count} calls wait for the reactor (the feed's thread has
    read that many messages).
    """
    deadline = time.monotonic() + 5
    while reactor.calls.qsize() < count:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_changesReachTheConsumerInOrder(harness: FeedHarness) -> None:
    """
    Token and agent changes after the snapshot reach the consumer in the
    order sent.
    """
    call = harness.nextCall()
    snapshot(call)
    sent = [("token", uuid.uuid4().bytes), ("agent", uuid.uuid4().bytes)] * 3
    for kind, identifier in sent:
        if kind == "token":
            call.send(auth_pb2.Change(token_changed=identifier))
        else:
            call.send(auth_pb2.Change(agent_changed=identifier))
    harness.reactor.pumpUntil(lambda: len(harness.consumer.changes) == len(sent))
    assert harness.consumer.changes == sent


def test_aLostStreamIsNotLiveAtOnceAndIsOpenedAgain(harness: FeedHarness) -> None:
    """
    A stream that ends makes the feed not live at once (not 500 ms later);
    the feed opens a new one, and the new session's snapshot starts over.
    The outage is logged once, however many attempts it takes, and so is
    the return.
    """
    call = harness.nextCall()
    snapshot(call)
    harness.reactor.pumpUntil(harness.feed.live)
    call.fail(RuntimeError("connection reset"))
    harness.reactor.pumpUntil(lambda: not harness.feed.live())
    for _ in range(3):
        harness.nextCall().fail(RuntimeError("svc-auth unavailable"))
    again = harness.nextCall()
    harness.reactor.pumpUntil(lambda: len(harness.logged(LogLevel.warn)) >= 1)
    snapshot(again)
    harness.reactor.pumpUntil(lambda: len(harness.consumer.started) == 2)
    assert harness.feed.live()
    assert len(harness.logged(LogLevel.warn)) == 1
    assert any("back after" in line for line in harness.logged(LogLevel.info))


class Unimplemented(Exception):
    """
    What grpcio raises when svc-auth has no WatchChanges.
    """

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNIMPLEMENTED


def test_settledOnceTheFirstSnapshotArrives(harness: FeedHarness) -> None:
    """
    What a starting proxy waits for: the feed is settled once its first
    snapshot has arrived, and stays settled when the stream is lost.
    """
    call = harness.nextCall()
    call.send(HEARTBEAT)
    assert not harness.feed.settled()
    snapshot(call)
    harness.reactor.pumpUntil(harness.feed.settled)
    call.fail(RuntimeError("reset"))
    harness.reactor.pumpUntil(lambda: not harness.feed.live())
    assert harness.feed.settled()


def test_settledWhenSvcAuthHasNoFeed(harness: FeedHarness) -> None:
    """
    An svc-auth without a change feed (UNIMPLEMENTED) is nothing to wait
    for; an svc-auth that fails otherwise is.
    """
    harness.nextCall().fail(RuntimeError("connection refused"))
    harness.reactor.pumpUntil(lambda: harness.calls.qsize() > 0)
    harness.reactor.pumpUntil(lambda: harness.reactor.calls.empty())
    assert not harness.feed.settled()
    harness.nextCall().fail(Unimplemented())
    harness.reactor.pumpUntil(harness.feed.settled)


def test_aStreamThatServedIsFollowedAtOnce() -> None:
    """
    After a stream that had begun its session ends (its svc-auth stopping,
    say), the next attempt comes after the first, shortest delay, however
    many attempts failed before it.
    """
    clock = Clock()
    calls: queue.Queue[ScriptedCall] = queue.Queue()

    def openStream() -> ScriptedCall:
        call = ScriptedCall()
        calls.put(call)
        return call

    reactor = PumpedReactor()
    feed = ChangeFeed(openStream, RecordingConsumer(), reactor, clock, retryDelays=(0.01, 60.0))
    feed.log = Logger(observer=cast(ILogObserver, lambda event: None))
    feed.start()
    try:
        calls.get(timeout=5).fail(RuntimeError("connection refused"))
        served = calls.get(timeout=5)
        snapshot(served)
        reactor.pumpUntil(feed.live)
        served.fail(RuntimeError("svc-auth is stopping"))
        assert calls.get(timeout=5) is not None
    finally:
        feed.stop()


def test_afterHeartbeatsWaitsForThatManyHeartbeats(harness: FeedHarness) -> None:
    """
    afterHeartbeats(2) fires on the second heartbeat from now, not on a
    change; it fails at once when the feed is not live, as soon as the
    stream is lost, or once the feed has been silent too long.
    """
    call = harness.nextCall()
    snapshot(call)
    harness.reactor.pumpUntil(harness.feed.live)
    waiting = harness.feed.afterHeartbeats(2)
    call.send(auth_pb2.Change(token_changed=uuid.uuid4().bytes))
    call.send(HEARTBEAT)
    harness.reactor.pumpUntil(lambda: bool(harness.consumer.changes))
    harness.reactor.pumpUntil(lambda: harness.reactor.calls.empty())
    assert not waiting.called
    call.send(HEARTBEAT)
    harness.reactor.pumpUntil(lambda: waiting.called)

    silent = harness.feed.afterHeartbeats(1)
    failures: list[Any] = []
    silent.addErrback(failures.append)
    harness.clock.advance(1.0)
    assert failures and failures[0].check(FeedNotLive)
    refused: list[Any] = []
    harness.feed.afterHeartbeats(1).addErrback(refused.append)
    assert refused

    call.send(HEARTBEAT)
    harness.reactor.pumpUntil(harness.feed.live)
    lost: list[Any] = []
    harness.feed.afterHeartbeats(1).addErrback(lost.append)
    call.fail(RuntimeError("reset"))
    harness.reactor.pumpUntil(lambda: bool(lost))
    assert lost[0].check(FeedNotLive)


def test_stopCancelsTheStream(harness: FeedHarness) -> None:
    """
    Stopping cancels the call in progress and the feed is no longer live.
    """
    call = harness.nextCall()
    snapshot(call)
    harness.reactor.pumpUntil(harness.feed.live)
    harness.feed.stop()
    assert call.cancelled
    assert not harness.feed.live()


async def waitFor(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    from twisted.internet import reactor

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not true within {seconds} s"
        await deferLater(reactor, 0.02, lambda: None)


@pytest_twisted.ensureDeferred
async def test_aRealFeedFromSvcAuth(authService: RunningAuthService, owner: Store) -> None:
    """
    Against a real svc-auth, on the real reactor: the feed goes live with a
    snapshot holding the existing token, and a token created afterwards
    (straight in PostgreSQL, as svcctl does) and an agent's change reach the
    consumer within a second each.
    """
    from twisted.internet import reactor

    tenant = makeTenant(owner)
    consumer = RecordingConsumer()
    feed = ChangeFeed(
        lambda: openChangeFeed(authService.channel), consumer, IReactorFromThreads(reactor), reactor
    )
    feed.start()
    try:
        await waitFor(lambda: bool(consumer.started))
        assert tenant.tokenID.bytes in consumer.started[0]
        assert feed.live()
        newcomer = makeTenant(owner, "newcomer")
        await waitFor(lambda: ("token", newcomer.tokenID.bytes) in consumer.changes, 1.0)
        owner.setAgentStatus(tenant.agentID, "paused")
        await waitFor(lambda: ("agent", tenant.agentID.bytes) in consumer.changes, 1.0)
        await waitFor(feed.live, 1.0)
    finally:
        feed.stop()
