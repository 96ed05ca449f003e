"""
The renewal of an observation's lease in svc-worker (decisions D13; issue
33), on a L{task.Clock}: renewed every third of the lease while the
observation is in hand, given up the moment svc-memory says another claim
holds it (the work cancelled, nothing released), retried when svc-memory
does not answer, and renewed before a step that stores when the periodic
renewal is late. The same behaviour with real daemons is in
tests/test_worker_e2e.py.
"""

from __future__ import annotations

from typing import Any, cast

import attrs
import pytest
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher

from svcd.memoryclient.errors import MemoryNotFound, MemoryUnavailable
from svcd.pb.memory.v1 import memory_pb2
from svcd.worker.lease import LeaseLost, LeaseUnrenewable, ObservationLease
from svcd.worker.loop import ObservationLoop
from svcd.worker.metrics import LOST, WorkerMetrics
from svcd.worker.processor import Observation

ORG = "0190c0de-0000-7000-8000-000000000001"
AGENT = "0190c0de-0000-7000-8000-000000000002"
TOKEN = "0190c0de-0000-7000-8000-0000000000aa"


@attrs.define
class ScriptedMemory:
    """
    svc-memory's observation calls as the test scripts them: each renewal
    answers the next of C{renewals} (True, False, or an exception), or
    renewed when none is left; every call is recorded.
    """

    renewals: list[Any] = attrs.Factory(list)
    calls: list[tuple[str, tuple[Any, ...]]] = attrs.Factory(list)
    claimable: list[memory_pb2.ClaimedObservation] = attrs.Factory(list)

    def renewObservationLease(self, *arguments: Any) -> Deferred[Any]:
        self.calls.append(("renew", arguments))
        answer = self.renewals.pop(0) if self.renewals else True
        if isinstance(answer, Exception):
            return fail(answer)
        return succeed(memory_pb2.RenewObservationLeaseResponse(renewed=answer))

    def claimObservations(self, *arguments: Any) -> Deferred[Any]:
        self.calls.append(("claim", arguments))
        claimed, self.claimable = self.claimable, []
        return succeed(memory_pb2.ClaimObservationsResponse(observations=claimed))

    def releaseObservation(self, *arguments: Any) -> Deferred[Any]:
        self.calls.append(("release", arguments))
        return succeed(memory_pb2.ReleaseObservationResponse(released=True))

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [arguments for called, arguments in self.calls if called == name]


def claimed(observationID: str, requestID: str) -> memory_pb2.ClaimedObservation:
    """
    An observation of the test's agent as svc-memory's claim answers it.
    """
    return memory_pb2.ClaimedObservation(
        id=observationID,
        scope=memory_pb2.Scope(org_id=ORG, agent_id=AGENT),
        request_id=requestID,
        lease_token=TOKEN,
    )


def leaseOf(memory: ScriptedMemory, clock: Clock, **callbacks: Any) -> ObservationLease:
    return ObservationLease(
        memory,  # type: ignore[arg-type]
        clock,
        "worker-1",
        ORG,
        "obs-1",
        TOKEN,
        30.0,
        clock.seconds(),
        **callbacks,
    )


def test_renewedEveryThirdOfTheLeaseUntilStopped() -> None:
    """
    Kept alive, the lease is renewed every 10 s of a 30 s lease (its
    owner, token and seconds named), and its end by the worker's
    reckoning moves to 30 s after each renewal was sent; stopped, it is
    renewed no more.
    """
    clock, memory = Clock(), ScriptedMemory()
    lease = leaseOf(memory, clock)
    lease.keepAlive()
    clock.advance(9.9)
    assert memory.named("renew") == []
    clock.advance(0.1)
    assert memory.named("renew") == [(ORG, "obs-1", "worker-1", TOKEN, 30.0)]
    assert lease.endsAt == 40.0
    clock.pump([10.0] * 5)
    assert len(memory.named("renew")) == 6 and lease.renewals == 6
    assert lease.remaining() == 30.0
    lease.stop()
    clock.advance(100.0)
    assert len(memory.named("renew")) == 6 and not clock.getDelayedCalls()


@pytest.mark.parametrize("refusal", [False, MemoryNotFound(None, "gone")])
def test_aRefusedRenewalLosesTheLease(refusal: Any) -> None:
    """
    A renewal svc-memory refuses (another claim took the lease, or the
    observation is gone) marks the lease lost and tells the loop once;
    nothing is renewed after, and a step's hold raises L{LeaseLost}.
    """
    clock, memory = Clock(), ScriptedMemory([refusal])
    lost: list[bool] = []
    lease = leaseOf(memory, clock, onLost=lambda: lost.append(True))
    lease.keepAlive()
    clock.advance(10.0)
    assert lease.lost and lost == [True]
    clock.advance(100.0)
    assert len(memory.named("renew")) == 1
    with pytest.raises(LeaseLost):
        hold(lease)


def test_anUnansweredRenewalIsRetriedThenGivenUp() -> None:
    """
    A renewal svc-memory does not answer is tried again within a second;
    one answered in time keeps the lease. When none is answered before
    the lease runs out by the reckoning, the loop is told it is
    unrenewable (and no renewal follows).
    """
    clock, memory = Clock(), ScriptedMemory([MemoryUnavailable(None, "down")])
    unrenewable: list[bool] = []
    lease = leaseOf(memory, clock, onUnrenewable=lambda: unrenewable.append(True))
    lease.keepAlive()
    clock.advance(10.0)
    clock.advance(1.0)
    assert len(memory.named("renew")) == 2 and lease.endsAt == 41.0
    memory.renewals = [MemoryUnavailable(None, "down")] * 100
    clock.pump([1.0] * 60)
    assert lease.unrenewable and unrenewable == [True]
    count = len(memory.named("renew"))
    clock.advance(100.0)
    assert len(memory.named("renew")) == count and not lease.lost


def test_aStepRenewsFirstWhenThePeriodicRenewalIsLate() -> None:
    """
    With at least half the lease left a step goes on without a call; with
    less (the worker was paused past its renewals), it renews first, and
    is refused (L{LeaseUnrenewable}) when svc-memory does not answer, or
    L{LeaseLost} when another claim holds the lease.
    """
    clock, memory = Clock(), ScriptedMemory()
    lease = leaseOf(memory, clock)
    clock.advance(15.0)
    hold(lease)
    assert memory.named("renew") == []
    clock.advance(0.1)
    hold(lease)
    assert len(memory.named("renew")) == 1 and lease.remaining() == 30.0
    clock.advance(20.0)
    memory.renewals = [MemoryUnavailable(None, "down")]
    with pytest.raises(LeaseUnrenewable):
        hold(lease)
    memory.renewals = [False]
    with pytest.raises(LeaseLost):
        hold(lease)


def hold(lease: ObservationLease) -> None:
    """
    Run C{lease.hold()} to its end (the scripted calls answer at once).
    """
    done = Deferred.fromCoroutine(lease.hold())
    failures: list[Any] = []
    done.addErrback(failures.append)
    if failures:
        failures[0].raiseException()


@attrs.define
class SlowProcessor:
    """
    A processor whose every observation waits until cancelled; records
    whether it was cancelled.
    """

    cancelled: list[str] = attrs.Factory(list)

    async def process(self, observation: Observation, lease: ObservationLease) -> str:
        waiting: Deferred[str] = Deferred()
        try:
            return await waiting
        except CancelledError:
            self.cancelled.append(observation.observationID)
            raise


def test_theLoopCutsAnObservationWhoseLeaseWasLost() -> None:
    """
    An observation in hand longer than its lease is renewed by the loop
    (never cut at the lease's end); once a renewal is refused its work is
    cancelled at once, it is neither released nor completed, and its
    outcome is C{lost}.
    """
    clock = Clock()
    memory = ScriptedMemory(renewals=[True] * 5 + [False])
    memory.claimable = [claimed("obs-1", "req-1")]
    processor = SlowProcessor()
    metrics = WorkerMetrics()
    loop = ObservationLoop(
        memory,  # type: ignore[arg-type]
        processor,  # type: ignore[arg-type]
        metrics,
        clock,
        "worker-1",
        lease=30.0,
        maxAttempts=3,
        concurrency=1,
        pollInterval=1.0,
        ready=lambda: True,
    )
    loop.start()
    assert loop.inHand == 1
    clock.pump([10.0] * 5)
    assert loop.inHand == 1 and processor.cancelled == []
    assert len(memory.named("renew")) == 5
    assert metrics.leaseRenewals._value.get() == 5
    clock.advance(10.0)
    assert processor.cancelled == ["obs-1"] and loop.inHand == 0
    assert memory.named("release") == []
    assert metrics.observations.labels(LOST)._value.get() == 1
    assert metrics.leaseRenewals._value.get() == 5
    stopped = loop.stop(1.0)
    clock.advance(1.0)
    assert stopped.called


@attrs.define
class ClaimAnsweredLater(ScriptedMemory):
    """
    svc-memory whose first claim answers only when the test says (or is
    cancelled, recorded).
    """

    claim: Deferred[Any] | None = None
    claimCancelled: bool = False

    def claimObservations(self, *arguments: Any) -> Deferred[Any]:
        self.calls.append(("claim", arguments))
        if self.claim is None:

            def cancelled(_: object) -> None:
                self.claimCancelled = True

            self.claim = Deferred(cancelled)
            return self.claim
        return succeed(memory_pb2.ClaimObservationsResponse())


def fired(deferred: Deferred[Any]) -> bool:
    return deferred.called


def cancelled(memory: ClaimAnsweredLater) -> bool:
    return memory.claimCancelled


def loopOf(memory: ScriptedMemory, clock: Clock) -> ObservationLoop:
    return ObservationLoop(
        memory,  # type: ignore[arg-type]
        SlowProcessor(),  # type: ignore[arg-type]
        WorkerMetrics(),
        clock,
        "worker-1",
        lease=30.0,
        maxAttempts=3,
        concurrency=4,
        pollInterval=1.0,
        ready=lambda: True,
    )


def test_aStopLetsAClaimUnderWayEndAndHandsBackWhatItLeased() -> None:
    """
    SIGTERM while a claim is under way: the claim is not cancelled (svc-
    memory leases what it claims whatever the worker does); once it
    answers, what it leased is released at once, never processed, and the
    stop ends without waiting for any lease to run out.
    """
    clock = Clock()
    memory = ClaimAnsweredLater()
    loop = loopOf(memory, clock)
    loop.start()
    assert memory.claim is not None
    stopped = loop.stop(10.0)
    clock.advance(1.0)
    assert not fired(stopped) and not memory.claimCancelled
    memory.claim.callback(
        memory_pb2.ClaimObservationsResponse(observations=[claimed("obs-1", "req-1")])
    )
    assert [arguments[1] for arguments in memory.named("release")] == ["obs-1"]
    assert stopped.called and loop.inHand == 0
    assert len(memory.named("claim")) == 1


def test_aStopCancelsAClaimThatTakesHalfItsTime() -> None:
    """
    A claim not answered within half the stop's time is cancelled (what it
    may have leased returns when its lease ends) and the stop ends then.
    """
    clock = Clock()
    memory = ClaimAnsweredLater()
    loop = loopOf(memory, clock)
    loop.start()
    stopped = loop.stop(10.0)
    clock.advance(4.9)
    assert not fired(stopped) and not cancelled(memory)
    clock.advance(0.1)
    assert cancelled(memory) and stopped.called
    assert memory.named("release") == []


def test_aStopReleasesWhatDidNotFinishWithinItsTime() -> None:
    """
    Observations in hand get half the stop's time to finish, then are
    cancelled and released; a release not answered by the end of the
    stop's time is given up (it returns when its lease ends), so the stop
    never outlasts its time.
    """
    clock = Clock()

    @attrs.define
    class ReleaseNeverAnswered(ScriptedMemory):
        def releaseObservation(self, *arguments: Any) -> Deferred[Any]:
            self.calls.append(("release", arguments))
            return Deferred()

    memory = ReleaseNeverAnswered()
    memory.claimable = [claimed(f"obs-{n}", f"req-{n}") for n in range(2)]
    loop = loopOf(memory, clock)
    loop.start()
    assert loop.inHand == 2
    stopped = loop.stop(10.0)
    clock.advance(4.9)
    assert memory.named("release") == []
    clock.advance(0.1)
    assert sorted(arguments[1] for arguments in memory.named("release")) == ["obs-0", "obs-1"]
    assert not fired(stopped)
    clock.advance(5.0)
    assert stopped.called


def test_aReleaseOfAnObservationNoLongerQueuedIsNoWarning() -> None:
    """
    Handing back an observation svc-memory no longer holds (stored by a
    call whose answer came after the stop's time, or dropped meanwhile)
    is said as such at info, not warned as a release that failed.
    """
    clock = Clock()

    @attrs.define
    class AlreadyGone(ScriptedMemory):
        def releaseObservation(self, *arguments: Any) -> Deferred[Any]:
            self.calls.append(("release", arguments))
            return fail(MemoryNotFound(None, "no such id"))

    memory = AlreadyGone()
    memory.claimable = [claimed("obs-1", "req-1")]
    events: list[dict[str, Any]] = []
    observer = cast(ILogObserver, events.append)
    globalLogPublisher.addObserver(observer)
    try:
        loop = loopOf(memory, clock)
        loop.start()
        stopped = loop.stop(2.0)
        clock.advance(1.0)
        assert stopped.called and loop.inHand == 0
    finally:
        globalLogPublisher.removeObserver(observer)
    lines = [
        event
        for event in events
        if event.get("observation_id") == "obs-1" and event["log_level"] > LogLevel.debug
    ]
    assert [(line["log_level"], "no longer queued" in formatEvent(line)) for line in lines] == [
        (LogLevel.info, True)
    ]
