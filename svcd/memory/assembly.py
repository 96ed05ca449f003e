"""
svc-memory assembled once (decisions D13): what its twistd plugin runs and
what the tests start are wired here, and only here, in two layers as
svc-auth's are (L{svcd.auth.assembly}), of the same kit
(L{svcd.common.databasedaemon}, L{svcd.common.grpcadmission},
L{svcd.common.internalcallers}):

 - L{assembleMemory}: the parts beneath the ports (the connection pool,
   the store, the caches of vectors and of records and their listener, the searcher, the
   servicer, the gRPC bounds and interceptors), wired with no reactor.
   C{RunningMemoryService} of C{tests/memoryservice.py} serves them from a
   grpcio server of its own.
 - L{assembleMemoryDaemon}: those parts as Twisted services (the
   database, gRPC, the operations port of L{svcd.common.opsweb}), which
   C{twistd -n svc-memory} runs.
"""

from __future__ import annotations

from typing import Any

import attrs
import grpc
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry
from psycopg_pool import ConnectionPool
from twisted.application.service import IService
from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.threadpool import ThreadPool

from svcd.common.databasedaemon import grpcCheck, operationsPort, postgresCheck
from svcd.common.databaseservice import DatabaseService
from svcd.common.grpcadmission import Bounds
from svcd.common.readiness import Check, CheckFailed
from svcd.common.tracing import ServerTracingInterceptor
from svcd.memory.callers import callerInterceptors
from svcd.memory.config import MemoryConfig
from svcd.memory.grpcservice import METHODS, MemoryGrpcService, MemoryServicer
from svcd.memory.listener import MemoryListener
from svcd.memory.metrics import MemoryMetrics
from svcd.memory.recordcache import RecordCache
from svcd.memory.search import Searcher
from svcd.memory.store import MemoryStore
from svcd.memory.store.base import connectionPool
from svcd.memory.vectorcache import VectorCache
from svcd.memory.web import MemoryOperationsSite, MemoryOperationsWeb


@attrs.frozen
class MemoryParts:
    """
    svc-memory beneath its ports; nothing started, nothing bound.
    """

    settings: MemoryConfig
    registry: CollectorRegistry
    metrics: MemoryMetrics
    pool: ConnectionPool
    store: MemoryStore
    cache: VectorCache
    records: RecordCache
    listener: MemoryListener
    searcher: Searcher
    servicer: MemoryServicer
    bounds: Bounds
    interceptors: tuple[grpc.ServerInterceptor, ...]


def assembleMemory(
    settings: MemoryConfig,
    registry: CollectorRegistry,
    *,
    tracer: Tracer | None = None,
    logCalls: bool = False,
    reconnectDelay: float = 1.0,
    beatInterval: float = 0.2,
    waitingInterval: float = 5.0,
) -> MemoryParts:
    """
    Wire svc-memory's parts from C{settings}, its metrics on C{registry}.
    The keyword arguments after C{logCalls} are the tests' overrides.
    """
    metrics = MemoryMetrics(registry)
    pool = connectionPool(
        settings.postgresDSN,
        minimum=settings.databasePoolMinimum,
        maximum=settings.databasePoolMaximum,
        statementTimeout=settings.statementTimeout,
        applicationName=settings.serviceName,
    )
    store = MemoryStore(pool.connection, metrics.queryDuration, dropDeadConnections=pool.check)
    cache = VectorCache(settings.cacheBytes, metrics.cacheMetrics())
    records = RecordCache(settings.recordCacheBytes, metrics.recordCacheMetrics())
    listener = MemoryListener(
        settings.postgresDSN,
        cache,
        waiting=metrics.observationsWaiting.set,
        records=records,
        reconnectDelay=reconnectDelay,
        beatInterval=beatInterval,
        waitingInterval=waitingInterval,
        doneRetention=settings.doneRetention,
        failedRetention=settings.failedRetention,
    )
    searcher = Searcher(
        store,
        cache,
        metrics.searchSeconds,
        parallelRows=settings.parallelRows,
        records=records,
    )
    servicer = MemoryServicer(
        store, searcher, metrics, settings.maxPerScope, settings.maxWaitingPerOrg
    )
    interceptors: list[grpc.ServerInterceptor] = []
    if settings.internalSubjects is not None:
        # Every method: the worker's for the workers, the others for the
        # proxies (svcd.memory.callers).
        assert settings.workerSubjects is not None
        interceptors.extend(
            callerInterceptors(
                settings.internalSubjects,
                settings.workerSubjects,
                metrics.internalDenied,
                METHODS,
                answered=metrics.answered,
            )
        )
    if tracer is not None:
        interceptors.append(ServerTracingInterceptor(tracer, logCalls=logCalls))
    bounds = Bounds.standard(settings.grpcWorkers, settings.grpcMaxCallsPerPeer)
    return MemoryParts(
        settings=settings,
        registry=registry,
        metrics=metrics,
        pool=pool,
        store=store,
        cache=cache,
        records=records,
        listener=listener,
        searcher=searcher,
        servicer=servicer,
        bounds=bounds,
        interceptors=tuple(interceptors),
    )


def listenerCheck(parts: MemoryParts) -> Check:
    """
    /ready's check of the change listener (decisions D13, amended: "a
    replica that cannot listen says so"): critical, so a replica whose
    listener failed, whatever the cause, or went silent for a second
    answers 503 until it listens again and its caches were emptied after
    it began. Meanwhile its searches are right but read PostgreSQL each
    time; the 503 tells the load balancer to prefer the replicas that
    hear every change.
    """

    def probe() -> Deferred[None]:
        if not (parts.cache.isListening() and parts.records.isListening()):
            return fail(
                CheckFailed("not hearing memory changes: caches emptied, searches read PostgreSQL")
            )
        return succeed(None)

    return Check("listener", probe)


@attrs.frozen
class MemoryDaemon:
    """
    svc-memory as Twisted services, in the order they start (and the
    reverse of the order they stop: the HTTP port closes, then gRPC calls
    drain, then the listener and the pool close).
    """

    parts: MemoryParts
    database: DatabaseService
    grpc: MemoryGrpcService
    web: MemoryOperationsWeb
    http: IService

    @property
    def services(self) -> tuple[IService, ...]:
        return (self.database, self.grpc, self.http)

    def setServiceParent(self, parent: Any) -> None:
        for service in self.services:
            service.setServiceParent(parent)


def assembleMemoryDaemon(
    reactor: Any,
    settings: MemoryConfig,
    registry: CollectorRegistry,
    *,
    tracer: Tracer | None = None,
    logCalls: bool = False,
) -> MemoryDaemon:
    """
    svc-memory's service tree: /ready checks postgres, grpc and listener
    (the cache is current only while it hears changes).
    """
    parts = assembleMemory(settings, registry, tracer=tracer, logCalls=logCalls)
    threads = ThreadPool(minthreads=1, maxthreads=4, name="svc-memory-db")
    database = DatabaseService(reactor, parts.pool, parts.listener, threads)
    grpcService = MemoryGrpcService(
        reactor,
        parts.servicer,
        settings.grpcHost,
        settings.grpcPort,
        bounds=parts.bounds,
        gracePeriod=settings.shutdownTimeout,
        tls=settings.tls,
        interceptors=parts.interceptors,
    )
    web = MemoryOperationsWeb(
        reactor,
        [
            postgresCheck(reactor, threads, parts.store.ping),
            grpcCheck(reactor, settings.grpcHost, grpcService),
            listenerCheck(parts),
        ],
        registry,
        docsBase=settings.errorDocsBase,
    )
    http = operationsPort(
        reactor, settings.host, settings.port, MemoryOperationsSite(web.resource(), reactor=reactor)
    )
    return MemoryDaemon(parts, database, grpcService, web, http)
