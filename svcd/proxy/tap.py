"""
C{twistd -n svc-proxy}: the options and service maker of the proxy.

All configuration comes from the environment (spec section 8, decisions
D1). A missing or bad variable stops the daemon before anything starts,
with one line on stderr naming the variable and exit status 1; so does a
port that cannot be bound (L{LoggingRootService}). A stop by SIGTERM or
SIGINT that completes its graceful shutdown exits 0.

The only module of svc-proxy that imports the global reactor; everything
else is handed its reactor or clock.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Mapping
from typing import NoReturn

from prometheus_client import CollectorRegistry
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import LogLevel
from twisted.python import usage

from svcd.common.config import ConfigError
from svcd.common.gcmetrics import watchCollector
from svcd.common.lifecycle import exitZeroOnStopSignals, settleHeapWhenRunning
from svcd.common.logs import LoggingRootService, daemonLogWriter, logSettings, makeObserver
from svcd.common.tracing import TracingConfig, TracingService, tracerProvider
from svcd.common.twistedprivate import TwistedIncompatible, requireTwistedInternals
from svcd.ledger.journalfile import JournalError
from svcd.ledger.outbox import UsageJournal, UsageOutbox
from svcd.limits.book import LimitBook
from svcd.limits.limiter import RedisRateLimiter, makeRateLimiter
from svcd.providers.upstream import Forwarder
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.site import ProtocolErrors, ProxySite
from svcd.proxy.listening import ProxyPort
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.service import ClosableAuthClient, Dependency, ProxyService
from svcd.proxy.validation.cache import CachingAuthClient, ValidationCache
from svcd.proxy.validation.client import AuthClient, GrpcAuthClient, authChannel
from svcd.proxy.validation.feed import ChangeFeed


class Options(usage.Options):
    """
    svc-proxy takes no command-line options: see the SVC_* variables.
    """

    synopsis = "[options]  (configured by SVC_* environment variables)"
    longdesc = (
        "The public HTTP edge of the svc gateway. Required: SVC_AUTH_GRPC_ADDR. "
        "See the README for every variable."
    )

    config: ProxyConfig
    tracing: TracingConfig
    logFormat: str
    logLevel: LogLevel

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call, unused-ignore]
        self._environ = os.environ if environ is None else environ

    def postOptions(self) -> None:
        """
        Read the environment; on a bad value print one line and exit 1
        (a UsageError would make twistd print its whole help first).
        """
        try:
            requireTwistedInternals()
        except TwistedIncompatible as error:
            sys.stderr.write(f"svc-proxy: {error}\n")
            sys.stderr.flush()
            raise SystemExit(1) from None
        try:
            self.config = ProxyConfig.fromEnvironment(self._environ)
            self.tracing = TracingConfig.fromEnvironment(self._environ, "svc-proxy")
            self.logFormat, self.logLevel = logSettings(self._environ)
        except ConfigError as error:
            sys.stderr.write(f"svc-proxy: configuration error: {error}\n")
            sys.stderr.flush()
            raise SystemExit(1) from None


def makeService(options: Options) -> LoggingRootService:
    """
    Build the service tree of svc-proxy.
    """
    from twisted.internet import reactor

    config = options.config
    twistdOptions = getattr(options, "parent", None)
    writer = daemonLogWriter(twistdOptions)
    observer = makeObserver(
        options.logFormat, options.logLevel, writer, service=options.tracing.serviceName
    )
    root = LoggingRootService(
        observer, daemonName="svc-proxy", level=options.logLevel, writer=writer, clock=reactor
    )

    # The root stops its children last first: the tracing service, added
    # first, flushes the spans of the requests the proxy service drained.
    provider = tracerProvider(options.tracing)
    tracing = TracingService(IReactorFromThreads(reactor), reactor, provider, options.tracing)
    tracing.setServiceParent(root)  # type: ignore[no-untyped-call, unused-ignore]
    tracer = provider.get_tracer("svcd.proxy")

    metrics = ProxyMetrics(CollectorRegistry())
    watchCollector(metrics.registry)
    # Decisions D11: the limits rows, from the change feed, or from the
    # validation answers while there is no live feed.
    limitBook = LimitBook()
    grpcAuth = GrpcAuthClient(
        functools.partial(authChannel, config),
        IReactorFromThreads(reactor),
        reactor,
        config.validateTimeout,
        metrics,
        tracer=tracer,
        maxInFlight=config.authMaxInFlight,
        queueTimeout=config.authQueueTimeout,
        limitBook=limitBook,
    )
    auth: AuthClient = grpcAuth
    service: ClosableAuthClient = grpcAuth
    # What the proxy waits for before it listens (SVC_START_TIMEOUT).
    dependencies = [Dependency("the gRPC channel to svc-auth", grpcAuth.channelReady)]
    if config.authCacheSize:
        # Decisions D8: validations from memory while svc-auth's change
        # feed is live; SVC_AUTH_CACHE_SIZE=0 leaves the Phase 1 client.
        cache = ValidationCache(
            reactor,
            time.time,
            config.authCacheSize,
            config.authCacheTTL,
            config.authWrongSecretsPerSecond,
        )
        feed = ChangeFeed(
            grpcAuth.openChangeFeed,
            cache,
            IReactorFromThreads(reactor),
            reactor,
            limitBook=limitBook,
        )
        limitBook.feedLive = feed.live
        metrics.watchFeed(feed.live)
        auth = service = CachingAuthClient(grpcAuth, cache, feed, metrics)
        dependencies.append(Dependency("the change feed's first snapshot", feed.settled))
    limiter = makeRateLimiter(
        reactor,
        reactor,
        config.redis,
        config.defaultRPM,
        config.orgRPM,
        metrics.ratelimitCircuitOpen,
        limitBook,
        grpcAuth.getSpend,
        timeout=config.redisTimeout,
        unchecked=metrics.uncheckedAdmissions,
        lease=config.budgetLease,
        recordGrace=config.budgetRecordGrace,
        reconcileInterval=config.budgetReconcileInterval,
    )
    if isinstance(limiter, RedisRateLimiter):
        dependencies.append(Dependency("Redis", limiter.connected))
    forwarder = None
    outbox = None
    if config.providers is not None:
        forwarder = Forwarder(
            reactor, reactor, tuple(config.providers.providers.values()), metrics, tracer
        )
        # Decisions D12: each forwarded request's usage row waits here until
        # svc-auth has committed it. Nothing forwarded, no ledger.
        journal = None
        if config.usageJournal:
            journal = UsageJournal(config.usageJournal)
            try:
                # One process per journal (D12, amended): a second proxy
                # naming it stops here, in one line, before anything starts.
                journal.hold()
            except JournalError as error:
                _cannotStart(str(error))
        outbox = UsageOutbox(
            grpcAuth,
            reactor,
            metrics,
            maxRows=config.usageOutboxMax,
            journal=journal,
            # The limiter learns which reservations' spend is in the ledger
            # (decisions D12, amended); a limiter without the method (before
            # the limiter's change is merged) is told nothing.
            onRecorded=limiter.recorded,
        )
    edge = ProxyEdge(config, auth, limiter, metrics, reactor, tracer, forwarder, ledger=outbox)
    site = ProxySite(
        edge.resource(),
        config.maxRequestBodyBytes,
        reactor,
        maxBufferedBodyBytes=config.maxBufferedBodyBytes,
        bodyWanted=edge.bodyWanted,
        protocolErrors=ProtocolErrors(metrics.protocolErrors, reactor),
    )
    ProxyService(
        ProxyPort(reactor, config.host, config.port, config.reusePort),
        edge,
        site,
        service,
        limiter,
        reactor,
        config.shutdownTimeout,
        forwarder,
        startTimeout=config.startTimeout,
        dependencies=dependencies,
        ledger=outbox,
    ).setServiceParent(root)  # type: ignore[no-untyped-call, unused-ignore]
    exitZeroOnStopSignals(reactor)
    settleHeapWhenRunning(reactor)
    return root


def _cannotStart(reason: str) -> NoReturn:
    """
    Stop a daemon being built: one line on stderr, exit status 1 (as
    L{Options.postOptions} does for a bad variable).
    """
    stderr = sys.__stderr__ or sys.stderr
    stderr.write(f"svc-proxy: cannot start: {reason}\n")
    stderr.flush()
    raise SystemExit(1)
