"""
A real svc-memory MemoryService on a loopback port, for tests: the parts
of L{svcd.memory.assembly.assembleMemory}, exactly as the daemon wires
them, served by a grpcio server started and stopped synchronously, minus
twistd and the reactor. Two of them on one database are two replicas.
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from svcd.common.grpcserver import ServerTLS
from svcd.memory.assembly import assembleMemory
from svcd.memory.config import MemoryConfig
from svcd.memory.grpcservice import SERVICE_NAME, buildServer
from svcd.pb.memory.v1 import memory_pb2_grpc


class RunningMemoryService:
    """
    Start with L{start}, stop with L{stop}; C{stub} is a blocking client
    on its own channel.
    """

    def __init__(
        self,
        dsn: str,
        *,
        maxPerScope: int = 10_000,
        cacheBytes: int = 64 * 1024 * 1024,
        workers: int = 8,
        perPeer: int = 8,
        listen: bool = True,
        doneRetention: float = 3600.0,
        failedRetention: float = 7 * 24 * 3600.0,
        tls: ServerTLS | None = None,
        internalSubjects: frozenset[str] | None = None,
        workerSubjects: frozenset[str] | None = None,
        maxWaitingPerOrg: int = 100_000,
    ) -> None:
        """
        @param tls: the server's TLS (with a client CA: mutual TLS, and then
            C{internalSubjects} and C{workerSubjects}, the names of the
            certificates that may call the proxies' methods and the
            workers', as svc-memory's configuration requires).
        """
        settings = MemoryConfig(
            postgresDSN=dsn,
            grpcHost="127.0.0.1",
            grpcPort=0,
            grpcWorkers=workers,
            grpcMaxCallsPerPeer=perPeer,
            databasePoolMinimum=1,
            databasePoolMaximum=4,
            serviceName="svc-memory-test",
            maxPerScope=maxPerScope,
            cacheBytes=cacheBytes,
            doneRetention=doneRetention,
            failedRetention=failedRetention,
            tls=tls,
            internalSubjects=internalSubjects,
            workerSubjects=workerSubjects,
            maxWaitingPerOrg=maxWaitingPerOrg,
        )
        # The daemon's assembly with the tests' timings: a quick
        # reconnection and beat, and the waiting count every 0.1 s.
        self.parts = parts = assembleMemory(
            settings,
            CollectorRegistry(),
            reconnectDelay=0.2,
            beatInterval=0.05,
            waitingInterval=0.1,
        )
        self.registry = parts.registry
        self.store = parts.store
        self.cache = parts.cache
        self._listen = listen
        self.server, self.health, self.port = buildServer(
            parts.servicer,
            settings.grpcHost,
            settings.grpcPort,
            parts.bounds,
            tls=tls,
            interceptors=parts.interceptors,
        )
        self.address = f"127.0.0.1:{self.port}"
        # With TLS the test makes its own channels, with its certificates.
        self.channel = grpc.insecure_channel(self.address)
        self.stub = memory_pb2_grpc.MemoryServiceStub(self.channel)

    def start(self) -> "RunningMemoryService":
        self.parts.pool.open(wait=False)
        if self._listen:
            self.parts.listener.start()
            deadline = time.monotonic() + 10
            while not self.cache.isListening() and time.monotonic() < deadline:
                time.sleep(0.01)
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(0).wait(5)
        self.parts.listener.stop()
        self.parts.pool.close(timeout=5)
