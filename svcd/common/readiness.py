"""
The readiness report of spec 4.2, shared by svc-proxy and svc-auth.

Checkers run in parallel, each under its own timeout (500 ms by default),
and the whole report under an overall budget (750 ms), so /ready answers
in bounded time even when a dependency hangs.

L{SharedReadiness} is what every daemon's C{GET /ready} answers from: one
run of the checks at a time, shared by every probe for L{READY_MAX_AGE}
(decisions D10), so a flood of anonymous probes is not a flood of calls to
the dependencies.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred, DeferredList, TimeoutError, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.recent import RecentResult

PER_CHECK_TIMEOUT = 0.5
OVERALL_BUDGET = 0.75
# Decisions D10: /ready answers from a check at most this many seconds old,
# one check at a time shared by every concurrent probe.
READY_MAX_AGE = 0.25


class CheckFailed(Exception):
    """
    A checker's own verdict that its dependency is not usable; the message
    is shown in the report, so it must hold no secret.
    """


@attrs.frozen
class Check:
    """
    A named readiness checker: C{probe} returns a Deferred that fires when
    the dependency is usable and fails otherwise.
    """

    name: str
    probe: Callable[[], Deferred[Any]]
    critical: bool = True


def _failureMessage(failure: Failure, timeout: float) -> str:
    if failure.check(TimeoutError):
        return f"timed out after {int(timeout * 1000)} ms"
    if failure.check(CheckFailed):
        return str(failure.value)
    # An unexpected exception: its text may quote configuration, so only
    # its type is shown.
    return f"check failed: {type(failure.value).__name__}"


async def readinessReport(
    checks: Sequence[Check],
    clock: IReactorTime,
    perCheckTimeout: float = PER_CHECK_TIMEOUT,
    overallBudget: float = OVERALL_BUDGET,
) -> tuple[int, dict[str, Any]]:
    """
    Run every check in parallel and build the HTTP status and body of
    GET /ready.
    """
    results: dict[str, dict[str, Any]] = {}
    started = clock.seconds()

    def runOne(check: Check) -> Deferred[None]:
        begun = clock.seconds()

        def record(outcome: object) -> None:
            entry: dict[str, Any] = {
                "status": "ok",
                "latency_ms": round((clock.seconds() - begun) * 1000, 3),
            }
            if isinstance(outcome, Failure):
                entry["status"] = "failed"
                entry["message"] = _failureMessage(outcome, perCheckTimeout)
            results[check.name] = entry

        attempt = timeoutDeferred(maybeDeferred(check.probe), perCheckTimeout, clock)
        attempt.addBoth(record)
        return attempt

    everything = DeferredList([runOne(check) for check in checks], consumeErrors=True)
    try:
        await timeoutDeferred(everything, overallBudget, clock)
    except TimeoutError:
        # Checks still running past the budget are reported failed below.
        pass
    for check in checks:
        if check.name not in results:
            results[check.name] = {
                "status": "failed",
                "latency_ms": round((clock.seconds() - started) * 1000, 3),
                "message": f"no answer within the {int(overallBudget * 1000)} ms budget",
            }

    criticalFailed = any(
        results[check.name]["status"] != "ok" for check in checks if check.critical
    )
    advisoryFailed = any(
        results[check.name]["status"] != "ok" for check in checks if not check.critical
    )
    if criticalFailed:
        return 503, {"status": "unhealthy", "checks": results}
    if advisoryFailed:
        return 200, {"status": "degraded", "checks": results}
    return 200, {"status": "ok", "checks": results}


def compactJSON(document: object) -> bytes:
    """
    C{document} as compact JSON, non-ASCII characters escaped: the body of
    svc-auth's reports.
    """
    return json.dumps(document, separators=(",", ":")).encode("utf-8")


class SharedReadiness:
    """
    The readiness report of C{checks}, made by one run of the checks at a
    time and shared by every caller for C{maxAge} seconds from the run's
    start (decisions D10; L{RecentResult} says how).

    The body is encoded once per run, not once per probe: a flood of probes
    costs neither checks nor encoding.

    @param clock: the timeouts of the checks and the age of a report.
    @param encode: turns the report into the body (the proxy's escapes no
        character, svc-auth's every non-ASCII one: each keeps its own).
    """

    def __init__(
        self,
        checks: Sequence[Check],
        clock: Clock,
        maxAge: float = READY_MAX_AGE,
        encode: Callable[[object], bytes] = compactJSON,
    ) -> None:
        self._checks = tuple(checks)
        self._clock = clock
        self._encode = encode
        self._recent: RecentResult[tuple[int, bytes]] = RecentResult(self._run, clock, maxAge)

    @property
    def calls(self) -> int:
        """
        How many runs of the checks were made.
        """
        return self._recent.calls

    def get(self) -> Deferred[tuple[int, bytes]]:
        """
        The HTTP status and body of C{GET /ready}, from the run in flight
        or a recent one, else from a new run.
        """
        return self._recent.get()

    def _run(self) -> Deferred[tuple[int, bytes]]:
        async def run() -> tuple[int, bytes]:
            status, body = await readinessReport(self._checks, asReactorTime(self._clock))
            return status, self._encode(body)

        return Deferred.fromCoroutine(run())
