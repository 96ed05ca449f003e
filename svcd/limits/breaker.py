"""
A circuit breaker: after a dependency fails, stop asking it for a while,
then let one request find out whether it is back (decisions D10).

The rate limiter fails open (D5), but failing open was not cheap: while
Redis was frozen (SIGSTOP) for 5 s every request waited the whole 100 ms
Redis deadline, and the proxy's throughput fell from about 700 to 75
requests/s. With the breaker, one failure costs one deadline; for the
next second requests skip Redis, then one request tries it (the I{trial})
while the others go on skipping it. The trial's success closes the
circuit; its failure opens it for another second.

The states, with C{openSeconds} of C{clock}::

    closed --a call fails--> open --openSeconds later--> half-open
    half-open --first permit() is the trial--> (trial in flight)
    trial succeeds --> closed;  trial fails --> open again

The breaker only keeps state; its user makes the call, reports how it
ended, and logs and counts the transitions that L{CircuitBreaker.failed}
and L{CircuitBreaker.succeeded} report.
"""

from __future__ import annotations

import enum

from svcd.common.clocks import Clock


class Permit(enum.Enum):
    """
    Leave to make one call: an ordinary call while the circuit is closed,
    or the one trial of a half-open circuit.
    """

    ORDINARY = "ordinary"
    TRIAL = "trial"


class CircuitBreaker:
    """
    Skip a dependency for C{openSeconds} after it fails, then let one call
    try it (see the module docstring).

    Only the trial's outcome decides a half-open circuit. Outcomes of
    ordinary calls that were made before the circuit opened and end after
    it are ignored: the circuit is already open, and they predate what the
    trial will find out.
    """

    def __init__(self, clock: Clock, openSeconds: float = 1.0) -> None:
        self._clock = clock
        self._openSeconds = openSeconds
        self._open = False
        self._retryAt = 0.0
        self._trialInFlight = False

    @property
    def isOpen(self) -> bool:
        """
        Whether calls are being skipped (open or half-open).
        """
        return self._open

    def permit(self) -> Permit | None:
        """
        Leave to make a call now, or L{None}: skip the dependency.
        """
        if not self._open:
            return Permit.ORDINARY
        if self._trialInFlight or self._clock.seconds() < self._retryAt:
            return None
        self._trialInFlight = True
        return Permit.TRIAL

    def succeeded(self, permit: Permit) -> bool:
        """
        The call made with C{permit} succeeded.

        @return: whether this closed the circuit.
        """
        if permit is not Permit.TRIAL:
            return False
        self._trialInFlight = False
        self._open = False
        return True

    def failed(self, permit: Permit) -> bool:
        """
        The call made with C{permit} failed or missed its deadline.

        @return: whether this opened a closed circuit (a failed trial keeps
            it open for another C{openSeconds} and returns C{False}).
        """
        if permit is Permit.TRIAL:
            self._trialInFlight = False
            self._retryAt = self._clock.seconds() + self._openSeconds
            return False
        if self._open:
            return False
        self._open = True
        self._retryAt = self._clock.seconds() + self._openSeconds
        return True

    def retryNow(self) -> None:
        """
        What the open circuit waits for came sooner than its timer: a new
        connection (the master a Sentinel failover promoted,
        L{svcd.limits.sentinellink}). The next call is the trial, at once,
        rather than up to C{openSeconds} later: a failover's failures
        opened the circuit just before the new master was found.
        """
        if self._open:
            self._retryAt = min(self._retryAt, self._clock.seconds())

    def abandoned(self, permit: Permit) -> None:
        """
        The call made with C{permit} ended without an outcome (its request
        was cancelled): a trial's place goes to the next request.
        """
        if permit is Permit.TRIAL:
            self._trialInFlight = False
