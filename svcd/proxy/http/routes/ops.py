"""
The operations routes of svc-proxy (spec 4.2): /health, /ready and
/metrics, anonymous and without steps.
"""

from __future__ import annotations

from svcd.common.clocks import Clock
from svcd.common.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from svcd.common.metrics import exposition
from svcd.common.readiness import Check, SharedReadiness
from svcd.proxy.http.context import Reply, RequestContext, jsonBody
from svcd.proxy.metrics import ProxyMetrics

_HEALTH_BODY = b'{"status":"ok","checks":{}}'


class OperationsRoutes:
    """
    The handlers of /health, /ready and /metrics.

    @param checks: what /ready checks (svc-auth, Redis).
    @param clock: the time of the checks' timeouts and of their sharing.
    """

    def __init__(self, metrics: ProxyMetrics, checks: tuple[Check, ...], clock: Clock) -> None:
        self._metrics = metrics
        # Decisions D10: one run of the checks per READY_MAX_AGE, shared by
        # every probe, as every daemon's /ready (svcd.common.readiness).
        self.readiness = SharedReadiness(checks, clock, encode=jsonBody)

    async def health(self, ctx: RequestContext) -> Reply:
        return Reply(200, _HEALTH_BODY)

    async def ready(self, ctx: RequestContext) -> Reply:
        """
        The readiness report, shared (decisions D10): a flood of anonymous
        probes costs one check of each dependency per
        L{svcd.common.readiness.READY_MAX_AGE}.
        """
        status, body = await self.readiness.get()
        return Reply(status, body)

    async def metricsPage(self, ctx: RequestContext) -> Reply:
        return Reply(
            200, exposition(self._metrics.registry), contentType=METRICS_CONTENT_TYPE.encode()
        )
