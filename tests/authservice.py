"""
A real svc-auth AuthService on a loopback port, for tests: the parts of
L{svcd.auth.assembly.assembleAuth}, exactly as the daemon wires them,
served by a grpcio server started and stopped synchronously, minus twistd
and the reactor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from svcd.auth.assembly import assembleAuth
from svcd.auth.config import AuthConfig
from svcd.auth.grpcservice import SERVICE_NAME, buildServer
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
        settings = AuthConfig(
            postgresDSN=dsn,
            grpcHost="127.0.0.1",
            grpcPort=0,
            grpcWorkers=workers,
            grpcMaxCallsPerPeer=perPeer,
            feedStreams=feedStreams,
            databasePoolMinimum=1,
            databasePoolMaximum=4,
            statementTimeout=2.0,
            verifyConcurrency=coldSlots,
            serviceName="svc-auth-test",
        )
        # The daemon's assembly, with the tests' timings: a quick
        # reconnection and beat of the listener, and every feed of a test
        # (all from one peer, 127.0.0.1) admitted.
        self.parts = parts = assembleAuth(
            settings,
            CollectorRegistry(),
            wallClock=wallClock,
            coldWait=coldWait,
            feedStreamsPerPeer=feedStreams,
            reconnectDelay=0.2,
            beatInterval=0.05,
        )
        self.registry = parts.registry
        self.pool = parts.pool
        self.store = parts.store
        self.cache = parts.cache
        self.limits = parts.limits
        self.budgets = parts.budgets
        self.memorySettings = parts.memorySettings
        self.authority = parts.authority
        self.hub = parts.hub
        self.listener = parts.listener
        self._listen = listen
        self.server, self.health, self.port = buildServer(
            parts.servicer,
            settings.grpcHost,
            settings.grpcPort,
            parts.bounds,
            interceptors=parts.interceptors,
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
