"""
twistd plugin body of svc-auth: C{twistd -n svc-auth}.

All configuration comes from the environment (see README.rst); the only
command-line options are twistd's own.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Histogram
from psycopg_pool import ConnectionPool
from twisted.application import strports
from twisted.application.service import IService, Service
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, quoteStringArgument
from twisted.internet.interfaces import IReactorCore, IReactorTCP, IReactorThreads, IReactorTime
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger, LogLevel
from twisted.python import usage
from twisted.python.threadpool import ThreadPool

from svcd.auth.admission import Bounds, Lane
from svcd.auth.authority import Authority
from svcd.auth.cache import ValidationCache
from svcd.auth.callers import DenialLog, InternalCallersInterceptor, InternalSubjects
from svcd.auth.config import AuthConfig
from svcd.auth.feed import FEED_METHOD, ChangeHub, Snapshots
from svcd.auth.grpcservice import AuthMetrics, AuthServicer, GrpcServerService
from svcd.auth.limits import BudgetsTable, LimitsTable
from svcd.auth.listener import ChangeListener
from svcd.auth.store import Store, connectionPool
from svcd.auth.web import AuthOperationsWeb, OperationsSite
from svcd.common.config import ConfigError
from svcd.common.gcmetrics import watchCollector
from svcd.common.lifecycle import exitZeroOnStopSignals, notifySystemd, settleHeapWhenRunning
from svcd.common.logs import LoggingRootService, daemonLogWriter, logSettings, makeObserver
from svcd.common.metrics import BUCKETS, processUpGauge
from svcd.common.readiness import Check, CheckFailed
from svcd.common.tracing import (
    ServerTracingInterceptor,
    TracingConfig,
    TracingService,
    tracerProvider,
)
from svcd.common.twistedprivate import TwistedIncompatible, requireTwistedInternals


class Options(usage.Options):
    """
    svc-auth takes its configuration from the environment, not from
    options; see README.rst for the variables.
    """

    synopsis = "[twistd options] svc-auth"
    longdesc = (
        "Runs the svc auth service: gRPC svc.auth.v1.AuthService on "
        "SVC_GRPC_HOST:SVC_GRPC_PORT (default 127.0.0.1:9091) and /health, "
        "/ready, /metrics on SVC_HOST:SVC_PORT (default 0.0.0.0:8081). "
        "Configuration comes from the environment; POSTGRES_DSN is required."
    )


class DatabaseService(Service):
    """
    Owns the database side: the connection pool, the change listener, and
    the thread pool in which the HTTP side runs its database checks.

    The pool opens without waiting, so svc-auth starts (and /ready says
    why it is not ready) while PostgreSQL is still down.
    """

    log = Logger()

    def __init__(
        self,
        reactor: IReactorThreads,
        pool: ConnectionPool,
        listener: ChangeListener,
        threads: ThreadPool,
    ) -> None:
        self._reactor = reactor
        self._pool = pool
        self._listener = listener
        self.threads = threads

    def startService(self) -> None:
        super().startService()
        self.threads.start()
        self._pool.open(wait=False)
        self._listener.start()

    def stopService(self) -> Deferred[None]:
        super().stopService()

        def close() -> None:
            self._listener.stop()
            self._pool.close(timeout=5.0)

        closing: Deferred[None] = deferToThreadPool(self._reactor, self.threads, close)

        def stopThreads(result: object) -> object:
            self.threads.stop()
            self.log.info("Database pool closed")
            return result

        closing.addBoth(stopThreads)
        return closing


def _tcpCheck(reactor: IReactorTCP, host: str, port: int) -> Deferred[None]:
    """
    Can we open a TCP connection to host:port? (the auth `grpc` check)
    """
    target = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    endpoint = TCP4ClientEndpoint(reactor, target, port, timeout=1)
    factory = Factory.forProtocol(Protocol)
    factory.noisy = False
    connecting = endpoint.connect(factory)

    def connected(protocol: Protocol) -> None:
        assert protocol.transport is not None
        protocol.transport.loseConnection()

    def failed(failure: Any) -> None:
        raise CheckFailed(f"gRPC port {port} is not accepting connections")

    return connecting.addCallbacks(connected, failed)


def buildService(
    reactor: Any,
    settings: AuthConfig,
    rootService: LoggingRootService,
    tracing: TracingConfig | None = None,
    logCalls: bool = False,
) -> None:
    """
    Assemble svc-auth's service tree under C{rootService}: tracing first,
    then the database, gRPC and HTTP, so that a stop (one child at a time,
    in reverse order) first closes the HTTP port, then drains gRPC calls,
    then closes the pool, and last flushes the spans of the drained calls.

    @param logCalls: log one DEBUG line per gRPC call.
    """
    tracing = tracing or TracingConfig(settings.serviceName, settings.environment)
    provider = tracerProvider(tracing)
    TracingService(reactor, reactor, provider, tracing).setServiceParent(rootService)
    interceptor = ServerTracingInterceptor(provider.get_tracer("svcd.auth"), logCalls=logCalls)

    registry = CollectorRegistry(auto_describe=True)
    processUpGauge(registry)
    watchCollector(registry)
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
    authority = Authority(
        store,
        cache,
        time.time,
        coldSlots=settings.verifyConcurrency,
        limits=limits,
        budgets=budgets,
    )
    hub = ChangeHub(time.monotonic, maxStreams=settings.feedStreams)
    listener = ChangeListener(settings.postgresDSN, cache, hub, limits, budgets)
    threads = ThreadPool(minthreads=1, maxthreads=4, name="svc-auth-db")

    database = DatabaseService(reactor, pool, listener, threads)
    database.setServiceParent(rootService)

    servicer = AuthServicer(
        authority,
        AuthMetrics(registry),
        hub,
        Snapshots(store.knownTokenIDs, time.monotonic),
        limits,
        budgets,
    )
    interceptors: list[grpc.ServerInterceptor] = [interceptor]
    if settings.internalSubjects is not None:
        # Before tracing: a denied call gets no span of its own.
        interceptors.insert(
            0,
            InternalCallersInterceptor(
                InternalSubjects(settings.internalSubjects),
                DenialLog(registry),
                answered=servicer.metrics.answered,
            ),
        )
    grpcService = GrpcServerService(
        reactor,
        servicer,
        settings.grpcHost,
        settings.grpcPort,
        # Each change feed stream holds a thread for as long as its proxy
        # is connected: a lane of its own, beside the calls' bounds (a
        # reconnecting proxy's old stream may linger a moment).
        bounds=Bounds.standard(settings.grpcWorkers, settings.grpcMaxCallsPerPeer).withLane(
            FEED_METHOD, Lane("feed", total=settings.feedStreams, perPeer=2)
        ),
        gracePeriod=settings.shutdownTimeout,
        tls=settings.tls,
        interceptors=interceptors,
    )
    grpcService.setServiceParent(rootService)

    def postgresCheck() -> Deferred[None]:
        return deferToThreadPool(reactor, threads, store.ping)

    def grpcCheck() -> Deferred[None]:
        if grpcService.port is None:
            raise CheckFailed("gRPC server is not started")
        return _tcpCheck(reactor, settings.grpcHost, grpcService.port)

    web = AuthOperationsWeb(
        reactor,
        [Check("postgres", postgresCheck), Check("grpc", grpcCheck)],
        registry,
        docsBase=settings.errorDocsBase,
    )
    # strports.service, rather than a StreamServerEndpointService of our
    # own: the service it makes fails the start at once, with the reason,
    # when the port cannot be had (Twisted's public way to ask for that).
    kind = "tcp6" if ":" in settings.host else "tcp"
    http = strports.service(
        f"{kind}:port={settings.port}:interface={quoteStringArgument(settings.host)}",
        OperationsSite(web.app.resource(), reactor=reactor),
        reactor=reactor,
    )
    http.setServiceParent(rootService)


def makeService(options: Options) -> IService:
    """
    Build svc-auth from the environment; a bad or missing variable stops
    here with one line on stderr naming it.
    """
    from twisted.internet import reactor

    try:
        requireTwistedInternals()
    except TwistedIncompatible as error:
        sys.stderr.write(f"svc-auth: {error}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    try:
        settings = AuthConfig.fromEnvironment(os.environ)
        tracing = TracingConfig.fromEnvironment(os.environ, "svc-auth")
        logFormat, level = logSettings(os.environ)
    except ConfigError as error:
        sys.stderr.write(f"svc-auth: configuration error: {error}\n")
        raise SystemExit(1) from None
    twistdOptions = getattr(options, "parent", None)
    assert IReactorCore.providedBy(reactor) and IReactorTime.providedBy(reactor)
    writer = daemonLogWriter(twistdOptions)
    root = LoggingRootService(
        makeObserver(logFormat, level, writer, service=tracing.serviceName),
        daemonName="svc-auth",
        level=level,
        writer=writer,
        clock=reactor,
    )
    buildService(reactor, settings, root, tracing, logCalls=level <= LogLevel.debug)
    exitZeroOnStopSignals(reactor)
    settleHeapWhenRunning(reactor)
    # Both ports serve once the reactor runs: a unit of Type=notify
    # (etc/systemd) is started then.
    reactor.callWhenRunning(notifySystemd, "READY=1")
    return root
