"""
The lease of one observation in svc-worker's hands (decisions D13; issue
33): renewed while the observation is processed, so that a model slower
than C{SVC_WORKER_LEASE} is waited for instead of cut, and given up the
moment another claim holds it, so that nothing is stored twice.

  - A claim's lease ends, by this worker's reckoning, C{seconds} after
    the claim was I{sent} (svc-memory starts it later, never earlier), so
    the reckoning errs early whatever the clocks of the two hosts say.
  - While the observation is in hand the loop renews its lease every
    third of C{seconds} (L{ObservationLease.keepAlive}); a renewal that
    svc-memory did not answer is tried again sooner. A renewal svc-memory
    refuses (another claim holds the lease, or the observation was done,
    dropped or forgotten) marks the lease lost: the loop cancels the work,
    and neither releases nor completes it.
  - Before the step that pays (the embeddings call) the processor asks
    L{ObservationLease.hold}: when less than half the lease is left by the
    reckoning (the periodic renewal is late: the worker was paused,
    svc-memory slow), it renews first and waits for the answer, and a lost
    lease raises L{LeaseLost} there. The step that stores
    (svc-memory's C{StoreObservation}) checks the lease itself, for the
    claim's token, holding the observation's row until it is completed.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from svcd.common.clocks import Clock
from svcd.memoryclient.client import MemoryClient
from svcd.memoryclient.errors import MemoryCallFailed, MemoryNotFound

# The periodic renewal's interval, as a share of the lease.
RENEW_SHARE = 1 / 3
# Below this share of the lease left, a step that pays or stores renews
# first.
HOLD_SHARE = 1 / 2
# A renewal svc-memory did not answer is tried again this often (at most).
RETRY_INTERVAL = 1.0


class LeaseLost(Exception):
    """
    The observation's lease is no longer this claim's: another claim took
    it after it ran out, or it was completed, dropped or forgotten. The
    worker abandons it, storing nothing more, releasing nothing.
    """


class LeaseUnrenewable(Exception):
    """
    svc-memory did not answer a renewal, and too little of the lease is
    left to store anything safely: the observation waits (no attempt
    counted) and returns to the queue when its lease ends.
    """


class ObservationLease:
    """
    The lease of one claimed observation (see the module docstring).

    @param claimedAt: when the claim was sent, by C{clock}.
    @param onLost: called when the periodic renewal finds the lease lost
        (the loop cancels the observation's work).
    @param onUnrenewable: called once when the lease ran out by the
        reckoning with no renewal answered (the loop cuts the work).
    @param onRenewed: called after each renewal (the metric counts it).
    """

    log = Logger()

    def __init__(
        self,
        memory: MemoryClient,
        clock: Clock,
        owner: str,
        orgID: str,
        observationID: str,
        token: str,
        seconds: float,
        claimedAt: float,
        onLost: Callable[[], None] = lambda: None,
        onUnrenewable: Callable[[], None] = lambda: None,
        onRenewed: Callable[[], None] = lambda: None,
    ) -> None:
        self._memory = memory
        self._clock = clock
        self._owner = owner
        self._orgID = orgID
        self._observationID = observationID
        self._token = token
        self.seconds = seconds
        self.endsAt = claimedAt + seconds
        self.lost = False
        self.unrenewable = False
        self.renewals = 0
        self._onLost = onLost
        self._onUnrenewable = onUnrenewable
        self._onRenewed = onRenewed
        self._timer: IDelayedCall | None = None
        self._renewing: Deferred[None] | None = None
        self._stopped = False

    @property
    def token(self) -> str:
        return self._token

    def remaining(self) -> float:
        """
        Seconds left of the lease by this worker's reckoning.
        """
        return self.endsAt - self._clock.seconds()

    # The periodic renewal, while the loop holds the observation.

    def keepAlive(self) -> None:
        """
        Renew every third of the lease until L{stop}.
        """
        self._schedule(self.seconds * RENEW_SHARE)

    def stop(self) -> None:
        """
        The observation is no longer in hand: renew no more.
        """
        self._stopped = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        renewing, self._renewing = self._renewing, None
        if renewing is not None:
            renewing.cancel()

    def _schedule(self, delay: float) -> None:
        if self._stopped or self.lost:
            return
        self._timer = self._clock.callLater(max(delay, 0.0), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._renewing = Deferred.fromCoroutine(self._periodic())

    async def _periodic(self) -> None:
        try:
            await self.renew()
        except LeaseLost:
            # Cancelling the work from here, never from within it (as
            # from a step's hold, which raises instead).
            self._onLost()
            return
        except CancelledError:
            return
        except MemoryCallFailed as error:
            left = self.remaining()
            if left <= 0:
                self.log.warn(
                    "The lease of observation {observation_id} ran out: svc-memory did not"
                    " answer its renewal ({error})",
                    observation_id=self._observationID,
                    org_id=self._orgID,
                    error=str(error),
                )
                self.unrenewable = True
                self._onUnrenewable()
                return
            self._schedule(min(RETRY_INTERVAL, left))
            return
        finally:
            self._renewing = None
        self._schedule(self.seconds * RENEW_SHARE)

    # Renewal.

    async def renew(self) -> None:
        """
        Ask svc-memory for C{seconds} more from now. Two renewals at once
        (the periodic one and a step's) are harmless: each extends.

        @raise LeaseLost: another claim holds it now, or it is gone.
        @raise MemoryCallFailed: svc-memory did not answer (the lease may
            still be this claim's).
        """
        if self.lost:
            raise LeaseLost()
        await self._renewOnce()

    async def _renewOnce(self) -> None:
        sentAt = self._clock.seconds()
        try:
            answer = await self._memory.renewObservationLease(
                self._orgID, self._observationID, self._owner, self._token, self.seconds
            )
        except MemoryNotFound:
            self._lose()
            raise LeaseLost() from None
        if not answer.renewed:
            self._lose()
            raise LeaseLost()
        self.renewals += 1
        self._onRenewed()
        self.endsAt = max(self.endsAt, sentAt + self.seconds)

    def _lose(self) -> None:
        if self.lost:
            return
        self.lost = True
        self.log.info(
            "The lease of observation {observation_id} passed to another claim: abandoned",
            observation_id=self._observationID,
            org_id=self._orgID,
        )

    async def hold(self) -> None:
        """
        Make sure at least half the lease is left before a step that pays
        or stores: renew first when less is.

        @raise LeaseLost: the lease is no longer this claim's.
        @raise LeaseUnrenewable: svc-memory did not answer and less than
            half the lease is left.
        """
        if self.lost:
            raise LeaseLost()
        if self.remaining() >= self.seconds * HOLD_SHARE:
            return
        try:
            await self.renew()
        except MemoryCallFailed as error:
            raise LeaseUnrenewable(str(error)) from None
        if self.remaining() < self.seconds * HOLD_SHARE:
            raise LeaseUnrenewable("the renewal came back too late")
