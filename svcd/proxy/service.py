"""
The service tree of svc-proxy: the HTTP listener plus the auth client and
rate limiter it depends on, started and stopped in order.
"""

from __future__ import annotations

from typing import Protocol

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.logger import Logger

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.site import ProxySite
from svcd.proxy.limits.limiter import RateLimiter


class ClosableAuthClient(Protocol):
    """
    The lifecycle part of the auth client.
    """

    def start(self) -> None: ...

    def close(self) -> None: ...


class ClosableForwarder(Protocol):
    """
    The lifecycle part of the forwarder: its pooled connections close at
    the end.
    """

    def close(self) -> Deferred[None]: ...


class ProxyService(MultiService):
    """
    Listens for HTTP while running. Stopping stops listening first, lets
    requests in flight finish (at most C{shutdownTimeout} seconds), then
    closes the gRPC channel, the Redis connection and the providers'
    pooled connections.
    """

    log = Logger()

    def __init__(
        self,
        endpoint: IStreamServerEndpoint,
        edge: ProxyEdge,
        site: ProxySite,
        auth: ClosableAuthClient,
        limiter: RateLimiter,
        clock: Clock,
        shutdownTimeout: float,
        forwarder: ClosableForwarder | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call, unused-ignore]
        self._edge = edge
        self._auth = auth
        self._limiter = limiter
        self._clock = clock
        self._shutdownTimeout = shutdownTimeout
        self._forwarder = forwarder
        self.listener = StreamServerEndpointService(endpoint, site)  # type: ignore[no-untyped-call, unused-ignore]
        # A port that cannot be bound fails startService instead of being
        # logged while the daemon runs without listening.
        self.listener._raiseSynchronously = True
        self.listener.setServiceParent(self)  # type: ignore[no-untyped-call, unused-ignore]

    def startService(self) -> None:
        self._auth.start()
        self._limiter.start()
        super().startService()  # type: ignore[no-untyped-call, unused-ignore]

    def stopService(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        await super().stopService()  # type: ignore[no-untyped-call, unused-ignore]
        try:
            await timeoutDeferred(
                self._edge.whenIdle(), self._shutdownTimeout, asReactorTime(self._clock)
            )
        except TimeoutError:
            self.log.warn(
                "Requests still in flight after {timeout} s; closing anyway",
                timeout=self._shutdownTimeout,
            )
        self._auth.close()
        await self._limiter.stop()
        if self._forwarder is not None:
            await self._forwarder.close()
        self.log.info("svc-proxy stopped")
