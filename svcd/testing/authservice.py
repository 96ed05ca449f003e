"""
A real svc-auth AuthService on a loopback port, for tests: the grpcio
server, a psycopg_pool pool acting as svc_auth_app, the validation cache
and the change listener, exactly as the daemon wires them, minus twistd.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from svcd.auth.admission import Bounds, Lane
from svcd.auth.authority import Authority
from svcd.auth.cache import ValidationCache
from svcd.auth.feed import FEED_METHOD, ChangeHub, Snapshots
from svcd.auth.grpcservice import SERVICE_NAME, AuthMetrics, AuthServicer, buildServer
from svcd.auth.limits import BudgetsTable, LimitsTable
from svcd.auth.listener import ChangeListener
from svcd.auth.store import Store, connectionPool
from svcd.pb.auth.v1 import auth_pb2_grpc


class SettableClock:
    """
    A wall clock that follows real time until a test sets it.
    """

    def __init__(self) -> None:
        self.fixed: float | None = None

    def __call__(self) -> float:
        return time.time() if self.fixed is None else self.fixed


class RunningAuthService:
    """
    Start with L{start}, stop with L{stop}; C{stub} is a blocking client on
    its own channel.
    """

    def __init__(
        self,
        dsn: str,
        *,
        wallClock: Callable[[], float] = time.time,
        coldSlots: int = 4,
        coldWait: float = 0.25,
        listen: bool = True,
        workers: int = 8,
        feedStreams: int = 4,
        perPeer: int = 32,
    ) -> None:
        self.registry = CollectorRegistry()
        self.pool = connectionPool(
            dsn, minimum=1, maximum=4, statementTimeout=2.0, applicationName="svc-auth-test"
        )
        self.store = Store(self.pool.connection)
        self.cache = ValidationCache(time.monotonic)
        self.limits = LimitsTable(time.monotonic)
        self.budgets = BudgetsTable(time.monotonic)
        self.authority = Authority(
            self.store,
            self.cache,
            wallClock,
            coldSlots=coldSlots,
            coldWait=coldWait,
            limits=self.limits,
            budgets=self.budgets,
        )
        self.hub = ChangeHub(time.monotonic, maxStreams=feedStreams)
        self.listener = ChangeListener(
            dsn,
            self.cache,
            self.hub,
            self.limits,
            self.budgets,
            reconnectDelay=0.2,
            beatInterval=0.05,
        )
        self._listen = listen
        self.server, self.health, self.port = buildServer(
            AuthServicer(
                self.authority,
                AuthMetrics(self.registry),
                self.hub,
                Snapshots(self.store.knownTokenIDs, time.monotonic),
                self.limits,
                self.budgets,
            ),
            "127.0.0.1",
            0,
            Bounds.standard(workers, perPeer).withLane(
                FEED_METHOD, Lane("feed", total=feedStreams, perPeer=feedStreams)
            ),
        )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = auth_pb2_grpc.AuthServiceStub(self.channel)

    def start(self) -> "RunningAuthService":
        self.pool.open(wait=False)
        if self._listen:
            self.listener.start()
            deadline = time.monotonic() + 10
            while self.cache._listeningSince is None and time.monotonic() < deadline:
                time.sleep(0.01)
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(0).wait(5)
        self.listener.stop()
        self.pool.close(timeout=5)

    def call(self, method: str, request: Any, bearer: str | None = None) -> Any:
        metadata = () if bearer is None else (("authorization", f"Bearer {bearer}"),)
        return getattr(self.stub, method)(request, metadata=metadata, timeout=10)
