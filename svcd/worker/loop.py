"""
svc-worker's loop (decisions D13): claim due observations from svc-memory
under a lease, process a bounded number at once, and hand back what could
not be finished.

  - At most C{concurrency} observations are in hand at once; a claim asks
    for as many as there are free places (at most 100), so nothing claimed
    waits in the worker while its lease runs.
  - A claim that finds nothing due, or fails, is tried again after
    C{pollInterval}; one that filled every place is followed by the next as
    soon as a place is free.
  - Nothing is claimed while C{ready} says no: while svc-auth's change feed
    is not live the worker does not know the limits and budgets it must
    admit its calls by (it has no validation answers to learn them from,
    as the proxy has), nor while the ledger's outbox is full.
  - Each observation's lease is renewed while it is processed
    (L{svcd.worker.lease}): a model slower than the lease is waited for.
    A renewal refused (another claim took the lease) cuts the observation
    at once: its calls cancelled, nothing stored, nothing released, its
    outcome C{lost}. A lease svc-memory could not renew before it ran out
    cuts it too, released with no attempt counted (svc-memory's fault,
    not the observation's), so that two workers never process one
    observation at once.
  - Released: a L{Deferral} waits its C{retryAfter} with no attempt
    counted; a L{FailedAttempt} waits 1 s doubled per attempt, at most
    5 min, and is kept as failed at C{maxAttempts} (or at once when no
    attempt can mend it).
  - L{ObservationLoop.stop} (SIGTERM) claims nothing more, lets a claim
    under way end (what it leased is handed back at once) and what is in
    hand finish, for half the time it is given, then cancels the rest and
    releases it, due at once and with no attempt counted, within the rest
    of that time.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

from twisted.internet.defer import CancelledError, Deferred, DeferredList, TimeoutError
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.ids import uuid7Text
from svcd.common.logthrottle import ThrottledWarning
from svcd.memoryclient.client import MemoryClient
from svcd.memoryclient.errors import MemoryCallFailed, MemoryNotFound
from svcd.worker.config import MAX_CLAIM
from svcd.worker.lease import LeaseLost, LeaseUnrenewable, ObservationLease
from svcd.worker.metrics import DEFERRED, FAILED, LOST, RELEASED, RETRY, WorkerMetrics
from svcd.worker.processor import (
    BUSY_DEFERRAL,
    Deferral,
    FailedAttempt,
    Observation,
    ObservationProcessor,
)

# A failed attempt's backoff (decisions D13): 1 s doubled per attempt.
FIRST_BACKOFF = 1.0
LAST_BACKOFF = 300.0
# A starting worker waits for the change feed's first snapshot; only a
# wait longer than this is worth a warning.
START_GRACE = 5.0


def backoff(attempts: int) -> float:
    """
    The wait after an observation's C{attempts}-th failed attempt: 1 s,
    2 s, 4 s ... at most 5 min.
    """
    # 2**9 s is past the last already: a larger power is never needed
    # (and 2**1024 is no float).
    return min(FIRST_BACKOFF * float(2 ** min(max(attempts - 1, 0), 16)), LAST_BACKOFF)


def leaseOwner(serviceName: str) -> str:
    """
    The name this process holds its leases under: the host, the process
    and a random part, so that a restarted worker (same host and perhaps
    the same pid) never takes a dead one's leases for its own.
    """
    return f"{serviceName}@{socket.gethostname()}:{os.getpid()}:{uuid7Text()[-12:]}"[:200]


class ObservationLoop:
    """
    Claims and processes observations (see the module docstring).

    @param ready: whether the worker may claim now (the change feed is live,
        the ledger has room).
    """

    log = Logger()

    def __init__(
        self,
        memory: MemoryClient,
        processor: ObservationProcessor,
        metrics: WorkerMetrics,
        clock: Clock,
        owner: str,
        *,
        lease: float,
        maxAttempts: int,
        concurrency: int,
        pollInterval: float,
        ready: Callable[[], bool],
    ) -> None:
        self._memory = memory
        self._processor = processor
        self._metrics = metrics
        self._clock = clock
        self.owner = owner
        self._lease = lease
        self._maxAttempts = maxAttempts
        self._concurrency = concurrency
        self._pollInterval = pollInterval
        self._ready = ready
        self._running = False
        self._startedAt = 0.0
        self._wake: Deferred[None] | None = None
        self._sleep: IDelayedCall | None = None
        self._done: Deferred[None] | None = None
        # Observations in hand: the Deferred of each one's processing.
        self._inHand: dict[str, Deferred[str]] = {}
        self._handling: dict[str, Deferred[None]] = {}
        # Fired when the last observation in hand ends (a stop waits).
        self._emptied: Deferred[None] | None = None
        # The last claim: None before the first, else its error (or "").
        self.lastClaimError: str | None = None
        self._claimFailing = ThrottledWarning(self.log, clock, 30.0)
        self._notReady = ThrottledWarning(self.log, clock, 30.0)
        metrics.inFlight.set_function(lambda: len(self._handling))

    @property
    def inHand(self) -> int:
        return len(self._handling)

    def start(self) -> None:
        self._running = True
        self._startedAt = self._clock.seconds()
        self._done = Deferred.fromCoroutine(self._run())
        self._done.addErrback(lambda failure: self.log.failure("svc-worker's loop failed", failure))

    async def _run(self) -> None:
        while self._running:
            free = self._concurrency - len(self._handling)
            if free <= 0:
                await self._pause(None)
                continue
            if not self._ready():
                if self._clock.seconds() - self._startedAt >= START_GRACE:
                    self._notReady.warn(
                        "Not claiming observations: svc-auth's change feed is not live"
                        " (limits and budgets unknown) or the ledger's outbox is full"
                    )
                await self._pause(self._pollInterval)
                continue
            claimedAt = self._clock.seconds()
            claimed = await self._claim(min(free, MAX_CLAIM))
            if self._stopRequested():
                # Stopped while the claim was under way: hand them back.
                for observation in claimed:
                    self._handle(observation, claimedAt, start=False)
                break
            for observation in claimed:
                self._handle(observation, claimedAt)
            if len(claimed) < min(free, MAX_CLAIM):
                await self._pause(self._pollInterval)

    def _stopRequested(self) -> bool:
        """
        Has L{stop} been called (while the loop awaited)?
        """
        return not self._running

    async def _claim(self, limit: int) -> list[Observation]:
        try:
            answer = await self._memory.claimObservations(self.owner, limit, self._lease)
        except CancelledError:
            return []
        except MemoryCallFailed as error:
            self.lastClaimError = str(error)
            self._claimFailing.warn(
                "Claiming observations from svc-memory failed ({error}); trying again",
                error=str(error),
            )
            return []
        self.lastClaimError = ""
        return [Observation.fromClaim(each) for each in answer.observations]

    async def _pause(self, seconds: float | None) -> None:
        """
        Wait C{seconds} (None: until an observation ends), or until woken.
        """
        wake: Deferred[None] = Deferred()
        self._wake = wake
        if seconds is not None:
            self._sleep = self._clock.callLater(seconds, self._wakeUp)
        try:
            await wake
        finally:
            if self._sleep is not None and self._sleep.active():
                self._sleep.cancel()
            self._sleep = None

    def _wakeUp(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None and not wake.called:
            wake.callback(None)

    # One observation.

    def _handle(self, observation: Observation, claimedAt: float, start: bool = True) -> None:
        began = time.perf_counter()
        identifier = observation.observationID
        lease = ObservationLease(
            self._memory,
            self._clock,
            self.owner,
            observation.orgID,
            identifier,
            observation.leaseToken,
            self._lease,
            claimedAt,
            onLost=lambda: self._cut(identifier),
            onUnrenewable=lambda: self._cut(identifier),
            onRenewed=self._metrics.renewed,
        )
        if start:
            work = Deferred.fromCoroutine(self._processor.process(observation, lease))
            lease.keepAlive()
        else:
            work = Deferred()
            work.cancel()
        self._inHand[identifier] = work
        handling = Deferred.fromCoroutine(self._finish(observation, lease, work, began))
        if not handling.called:
            # Ended already when its release was answered (or failed) at
            # once: then _finish has counted it and it is in hand no more.
            self._handling[identifier] = handling

    def _cut(self, observationID: str) -> None:
        """
        Cancel an observation's work: its lease was lost or ran out.
        """
        work = self._inHand.get(observationID)
        if work is not None:
            work.cancel()

    async def _finish(
        self,
        observation: Observation,
        lease: ObservationLease,
        work: Deferred[str],
        began: float,
    ) -> None:
        outcome = RELEASED
        try:
            try:
                outcome = await work
            except LeaseLost:
                outcome = LOST
            except LeaseUnrenewable as unrenewable:
                outcome = DEFERRED
                await self._release(
                    observation,
                    lease,
                    BUSY_DEFERRAL,
                    False,
                    False,
                    f"the lease could not be renewed ({unrenewable})",
                )
            except Deferral as deferral:
                outcome = DEFERRED
                await self._release(
                    observation, lease, deferral.retryAfter, False, False, deferral.reason
                )
            except FailedAttempt as failed:
                outcome = await self._failed(observation, lease, failed.reason, failed.final)
            except CancelledError:
                if lease.lost:
                    outcome = LOST
                elif lease.unrenewable:
                    outcome = DEFERRED
                    await self._release(
                        observation,
                        lease,
                        BUSY_DEFERRAL,
                        False,
                        False,
                        "the lease ran out: svc-memory did not answer its renewal",
                    )
                else:
                    outcome = RELEASED
                    await self._release(
                        observation, lease, 0.0, False, False, "handed back at a stop"
                    )
            except Exception:
                self.log.failure(
                    "Fault processing observation {observation_id}",
                    observation_id=observation.observationID,
                    org_id=observation.orgID,
                )
                outcome = await self._failed(
                    observation, lease, "internal error of svc-worker", False
                )
        finally:
            lease.stop()
            del self._inHand[observation.observationID]
            self._handling.pop(observation.observationID, None)
            self._metrics.observed(outcome, time.perf_counter() - began)
            self.log.debug(
                "Observation {observation_id} {outcome}",
                observation_id=observation.observationID,
                org_id=observation.orgID,
                request_id=observation.requestID,
                outcome=outcome,
            )
            self._wakeUp()
            if not self._handling and self._emptied is not None:
                emptied, self._emptied = self._emptied, None
                emptied.callback(None)

    async def _failed(
        self,
        observation: Observation,
        lease: ObservationLease,
        reason: str,
        final: bool,
        retryAfter: float = 0.0,
    ) -> str:
        attempts = observation.attempts + 1
        failed = final or attempts >= self._maxAttempts
        wait = max(backoff(attempts), retryAfter)
        await self._release(observation, lease, wait, True, failed, reason)
        if failed:
            self.log.warn(
                "Observation {observation_id} failed after {attempts} attempt(s): {reason}",
                observation_id=observation.observationID,
                org_id=observation.orgID,
                attempts=attempts,
                reason=reason,
            )
            return FAILED
        return RETRY

    async def _release(
        self,
        observation: Observation,
        lease: ObservationLease,
        retryAfter: float,
        countAttempt: bool,
        failed: bool,
        reason: str,
    ) -> None:
        """
        Hand the observation back to svc-memory. When that fails, its lease
        runs out and it is claimed again (as if this attempt never was).
        """
        try:
            await self._memory.releaseObservation(
                observation.orgID,
                observation.observationID,
                self.owner,
                retryAfter,
                countAttempt,
                failed,
                reason[:500],
                lease.token,
            )
        except MemoryNotFound:
            # Gone from the queue: completed after all (a store committed
            # whose answer came too late), or dropped or purged meanwhile.
            self.log.info(
                "Observation {observation_id} was no longer queued when it was handed back"
                " (stored by a call whose answer came late, or dropped meanwhile)",
                observation_id=observation.observationID,
                org_id=observation.orgID,
            )
        except MemoryCallFailed as error:
            self.log.warn(
                "Observation {observation_id} could not be released ({error}); it returns"
                " when its lease ends",
                observation_id=observation.observationID,
                org_id=observation.orgID,
                error=str(error),
            )

    # Stopping.

    def stop(self, timeout: float) -> Deferred[None]:
        """
        Claim nothing more; let a claim under way end (what it leased is
        handed back at once) and the observations in hand finish, for half
        of C{timeout}; then cancel the rest and release them, for what is
        left of C{timeout}.

        @return: fires once every observation is completed or released (or
            its release failed, or the time is up: what is still leased then
            returns when its lease ends).
        """
        self._running = False
        self._wakeUp()
        return Deferred.fromCoroutine(self._stop(timeout))

    async def _stop(self, seconds: float) -> None:
        clock = asReactorTime(self._clock)
        began = self._clock.seconds()

        def left(until: float) -> float:
            return max(until - (self._clock.seconds() - began), 0.0)

        if self._done is not None:
            # A claim under way leases its observations in svc-memory
            # whatever is done here: the loop hands them back once it
            # answers. Cancelled only when it takes the whole time (what
            # it leased then returns when its lease ends).
            try:
                await timeoutDeferred(self._done, seconds / 2, clock)
            except TimeoutError:
                self.log.warn(
                    "Stopping: a claim of observations was not answered in time; what it"
                    " leased returns when its lease ends"
                )
        if not self._handling:
            return
        finishing = left(seconds / 2)
        self.log.info(
            "Stopping: {count} observation(s) in hand get {seconds} s to finish",
            count=len(self._handling),
            seconds=round(finishing, 3),
        )
        emptied: Deferred[None] = Deferred()
        self._emptied = emptied
        try:
            await timeoutDeferred(emptied, finishing, clock)
            return
        except TimeoutError:
            self._emptied = None
        unfinished = list(self._inHand.values())
        self.log.info("Releasing {count} unfinished observation(s)", count=len(unfinished))
        for work in unfinished:
            work.cancel()
        releasing = DeferredList(list(self._handling.values()), consumeErrors=True)
        try:
            await timeoutDeferred(releasing, left(seconds), clock)
        except TimeoutError:
            self.log.warn(
                "Stopping: {count} observation(s) not released in time; they return when"
                " their leases end",
                count=len(self._handling),
            )
