"""
The operations routes of svc-proxy (spec 4.2): /health, /ready and
/metrics, anonymous and without steps.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from svcd.common.metrics import exposition
from svcd.common.readiness import Check, readinessReport
from svcd.common.recent import RecentResult
from svcd.proxy.http.context import Reply, RequestContext, jsonBody
from svcd.proxy.metrics import ProxyMetrics

_HEALTH_BODY = b'{"status":"ok","checks":{}}'
# Decisions D10: /ready answers from a check at most this many seconds old,
# one check at a time shared by every concurrent probe.
READY_MAX_AGE = 0.25


class OperationsRoutes:
    """
    The handlers of /health, /ready and /metrics.

    @param checks: what /ready checks (svc-auth, Redis).
    @param clock: the time of the checks' timeouts and of their sharing.
    """

    def __init__(self, metrics: ProxyMetrics, checks: tuple[Check, ...], clock: Clock) -> None:
        self._metrics = metrics
        self._checks = checks
        self._clock = clock
        self.readiness = RecentResult(self._checkReadiness, clock, READY_MAX_AGE)

    async def health(self, ctx: RequestContext) -> Reply:
        return Reply(200, _HEALTH_BODY)

    async def ready(self, ctx: RequestContext) -> Reply:
        """
        The readiness report, shared (decisions D10): a flood of anonymous
        probes costs one check of each dependency per L{READY_MAX_AGE}.
        """
        status, body = await self.readiness.get()
        return Reply(status, body)

    def _checkReadiness(self) -> Deferred[tuple[int, bytes]]:
        async def check() -> tuple[int, bytes]:
            status, body = await readinessReport(self._checks, asReactorTime(self._clock))
            return status, jsonBody(body)

        return Deferred.fromCoroutine(check())

    async def metricsPage(self, ctx: RequestContext) -> Reply:
        return Reply(
            200, exposition(self._metrics.registry), contentType=METRICS_CONTENT_TYPE.encode()
        )
