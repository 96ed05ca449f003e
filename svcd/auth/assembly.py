"""
svc-auth assembled once: what its twistd plugin runs and what the tests
start are wired here, and only here.

Two layers, because svc-auth runs two ways:

 - L{assembleAuth}: the parts beneath the ports (the connection pool, the
   store, the caches and tables, the authority, the change hub and its
   listener, the servicer, the gRPC bounds and interceptors), wired with
   no reactor. C{RunningAuthService} of C{tests/authservice.py} serves them
   from a grpcio server it starts and stops itself, synchronously.
 - L{assembleAuthDaemon}: those parts as Twisted services under a parent
   (the database, gRPC, and the operations port of
   L{svcd.common.opsweb}), which is what C{twistd -n svc-auth} runs.

What only a real process does (logging, signals, the heap settled at
start, systemd's notification, the collector's metrics) stays in
L{svcd.auth.tap}.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import grpc
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry, Histogram
from psycopg_pool import ConnectionPool
from twisted.application.service import IService
from twisted.python.threadpool import ThreadPool

from svcd.auth.authority import Authority
from svcd.auth.cache import ValidationCache
from svcd.auth.callers import DENIED_DETAILS, INTERNAL_METHODS, SERVICE, DenialLog
from svcd.auth.config import AuthConfig
from svcd.auth.feed import FEED_METHOD, ChangeHub, Snapshots
from svcd.auth.grpcservice import AuthMetrics, AuthServicer, GrpcServerService
from svcd.auth.limits import BudgetsTable, LimitsTable, MemorySettingsTable
from svcd.auth.listener import ChangeListener
from svcd.auth.store import Store
from svcd.auth.store.base import connectionPool
from svcd.auth.web import AuthOperationsWeb, OperationsSite
from svcd.common.databasedaemon import grpcCheck, operationsPort, postgresCheck
from svcd.common.databaseservice import DatabaseService
from svcd.common.grpcadmission import Bounds, Lane
from svcd.common.internalcallers import InternalCallersInterceptor, InternalSubjects
from svcd.common.metrics import BUCKETS
from svcd.common.tracing import ServerTracingInterceptor

# Change feed streams one peer may hold at once: its live stream, and the
# old one of a reconnecting proxy that may linger a moment.
FEED_STREAMS_PER_PEER = 2


@attrs.frozen
class AuthParts:
    """
    svc-auth beneath its ports; nothing started, nothing bound.

    @ivar bounds: the admission bounds the gRPC server is built with.
    @ivar interceptors: run around every admitted gRPC call, outermost
        first.
    """

    settings: AuthConfig
    registry: CollectorRegistry
    pool: ConnectionPool
    store: Store
    cache: ValidationCache
    limits: LimitsTable
    budgets: BudgetsTable
    memorySettings: MemorySettingsTable
    authority: Authority
    hub: ChangeHub
    listener: ChangeListener
    servicer: AuthServicer
    bounds: Bounds
    interceptors: tuple[grpc.ServerInterceptor, ...]


def assembleAuth(
    settings: AuthConfig,
    registry: CollectorRegistry,
    *,
    tracer: Tracer | None = None,
    logCalls: bool = False,
    wallClock: Callable[[], float] = time.time,
    coldWait: float = 0.25,
    feedStreamsPerPeer: int = FEED_STREAMS_PER_PEER,
    reconnectDelay: float = 1.0,
    beatInterval: float = 0.1,
) -> AuthParts:
    """
    Wire svc-auth's parts from C{settings}, its metrics on C{registry}.

    The keyword arguments after C{logCalls} are the tests' overrides; the
    daemon takes their defaults.

    @param tracer: makes a span of each gRPC call; without one, calls get
        no span (and no tracing interceptor).
    @param logCalls: log one DEBUG line per gRPC call.
    @param wallClock: the time tokens' expiry is judged by.
    @param coldWait: how long a validation waits for one of the
        C{settings.verifyConcurrency} slots of secret verification.
    @param feedStreamsPerPeer: change feed streams one peer may hold.
    @param reconnectDelay: the change listener's pause before it
        reconnects to PostgreSQL.
    @param beatInterval: how often the change listener sends itself a beat
        through PostgreSQL.
    """
    queryDuration = Histogram(
        "svc_db_query_duration_seconds",
        "Time of one database transaction, by operation",
        ["operation"],
        buckets=BUCKETS,
        registry=registry,
    )
    pool = connectionPool(
        settings.postgresDSN,
        minimum=settings.databasePoolMinimum,
        maximum=settings.databasePoolMaximum,
        statementTimeout=settings.statementTimeout,
        applicationName=settings.serviceName,
    )
    store = Store(pool.connection, queryDuration, dropDeadConnections=pool.check)
    cache = ValidationCache(time.monotonic)
    limits = LimitsTable(time.monotonic)
    budgets = BudgetsTable(time.monotonic)
    memorySettings = MemorySettingsTable(time.monotonic)
    authority = Authority(
        store,
        cache,
        wallClock,
        coldSlots=settings.verifyConcurrency,
        coldWait=coldWait,
        limits=limits,
        budgets=budgets,
        memorySettings=memorySettings,
    )
    hub = ChangeHub(time.monotonic, maxStreams=settings.feedStreams)
    listener = ChangeListener(
        settings.postgresDSN,
        cache,
        hub,
        limits,
        budgets,
        reconnectDelay=reconnectDelay,
        beatInterval=beatInterval,
        memorySettings=memorySettings,
    )
    servicer = AuthServicer(
        authority,
        AuthMetrics(registry),
        hub,
        Snapshots(store.knownTokenIDs, time.monotonic),
        limits,
        budgets,
        memorySettings,
    )
    interceptors: list[grpc.ServerInterceptor] = []
    if settings.internalSubjects is not None:
        # Before tracing: a denied call gets no span of its own.
        interceptors.append(
            InternalCallersInterceptor(
                InternalSubjects(settings.internalSubjects),
                DenialLog(registry),
                answered=servicer.metrics.answered,
                methods=INTERNAL_METHODS,
                service=SERVICE,
                details=DENIED_DETAILS,
            )
        )
    if tracer is not None:
        interceptors.append(ServerTracingInterceptor(tracer, logCalls=logCalls))
    # Each change feed stream holds a thread for as long as its proxy is
    # connected: a lane of its own, beside the calls' bounds.
    bounds = Bounds.standard(settings.grpcWorkers, settings.grpcMaxCallsPerPeer).withLane(
        FEED_METHOD, Lane("feed", total=settings.feedStreams, perPeer=feedStreamsPerPeer)
    )
    return AuthParts(
        settings=settings,
        registry=registry,
        pool=pool,
        store=store,
        cache=cache,
        limits=limits,
        budgets=budgets,
        memorySettings=memorySettings,
        authority=authority,
        hub=hub,
        listener=listener,
        servicer=servicer,
        bounds=bounds,
        interceptors=tuple(interceptors),
    )


@attrs.frozen
class AuthDaemon:
    """
    svc-auth as Twisted services: the database, gRPC and the operations
    port, in the order they start (and the reverse of the order they stop:
    the HTTP port closes, then gRPC calls drain, then the pool closes).
    """

    parts: AuthParts
    database: DatabaseService
    grpc: GrpcServerService
    web: AuthOperationsWeb
    http: IService

    @property
    def services(self) -> tuple[IService, ...]:
        return (self.database, self.grpc, self.http)

    def setServiceParent(self, parent: Any) -> None:
        """
        Add each service to C{parent}, in order: a parent that stops its
        children one at a time (L{svcd.common.logs.LoggingRootService})
        then stops them in the order of the class docstring.
        """
        for service in self.services:
            service.setServiceParent(parent)


def assembleAuthDaemon(
    reactor: Any,
    settings: AuthConfig,
    registry: CollectorRegistry,
    *,
    tracer: Tracer | None = None,
    logCalls: bool = False,
) -> AuthDaemon:
    """
    svc-auth's service tree: L{assembleAuth}'s parts served by a
    L{DatabaseService}, a L{GrpcServerService} and the operations port
    (/health; /ready checking postgres and grpc; /metrics of C{registry}).
    """
    parts = assembleAuth(settings, registry, tracer=tracer, logCalls=logCalls)
    threads = ThreadPool(minthreads=1, maxthreads=4, name="svc-auth-db")
    database = DatabaseService(reactor, parts.pool, parts.listener, threads)
    grpcService = GrpcServerService(
        reactor,
        parts.servicer,
        settings.grpcHost,
        settings.grpcPort,
        bounds=parts.bounds,
        gracePeriod=settings.shutdownTimeout,
        tls=settings.tls,
        interceptors=parts.interceptors,
    )
    web = AuthOperationsWeb(
        reactor,
        [
            postgresCheck(reactor, threads, parts.store.ping),
            grpcCheck(reactor, settings.grpcHost, grpcService),
        ],
        registry,
        docsBase=settings.errorDocsBase,
    )
    http = operationsPort(
        reactor, settings.host, settings.port, OperationsSite(web.resource(), reactor=reactor)
    )
    return AuthDaemon(parts, database, grpcService, web, http)
