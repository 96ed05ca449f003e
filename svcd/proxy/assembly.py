"""
svc-proxy assembled once: what its twistd plugin runs and what the tests
start are wired here, and only here.

L{assembleProxy} turns a L{ProxyConfig} into the proxy's service and the
parts behind it: the client of svc-auth (with its validation cache and
change feed), the limiter, the forwarder and the usage outbox, the edge,
the site and the port. The tap adds what only a real process does
(logging, tracing's export, the collector's metrics, the stop signals,
the heap settled at start); a test passes what it fakes (an auth client,
Redis counters in memory, shorter timers of the site) as arguments and
gets the same wiring around them.
"""

from __future__ import annotations

import functools
import time
from random import Random
from typing import Any

import attrs
from opentelemetry.trace import Tracer
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool

from svcd.authclient.channel import authChannel
from svcd.authclient.connection import AuthConnection
from svcd.authclient.feed import ChangeFeed
from svcd.common.config import GrpcTLS
from svcd.ledger.journal import Journal
from svcd.ledger.journalfile import holdJournalLock
from svcd.ledger.outbox import Outbox, UsageSender
from svcd.ledger.sender import LedgerSender
from svcd.limits.book import LimitBook
from svcd.limits.limiter import RateLimiter, RedisRateLimiter, makeRateLimiter
from svcd.limits.link import RedisCounters
from svcd.memoryclient.channel import ClientTLS, memoryChannel
from svcd.memoryclient.client import DEFAULT_TIMEOUT, MemoryClient
from svcd.providers.genai import GenAIMetrics
from svcd.providers.routing import Router
from svcd.providers.upstream import Forwarder
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.site import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT,
    ProtocolErrors,
    ProxySite,
)
from svcd.proxy.listening import ProxyPort
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.observe import ObservationOutboxMetrics, Observer, observationOutbox
from svcd.proxy.service import ClosableAuthClient, Dependency, ProxyService
from svcd.proxy.validation.cache import CachingAuthClient, LifecycleAuthClient, ValidationCache
from svcd.proxy.validation.client import AuthClient, GrpcAuthClient


@attrs.frozen
class ProxyDaemon:
    """
    svc-proxy assembled, not started: C{service} is what a parent starts
    and stops; the rest are its parts, for the tests to reach.

    @ivar auth: the auth client the edge asks (the caching one, when
        there is a validation cache).
    @ivar outbox: the usage outbox, when the proxy forwards.
    @ivar memory: the client of svc-memory, when memory is on (decisions
        D13).
    @ivar observations: the outbox of chat completions' observations for
        svc-memory, when memory is on (decisions D13).
    """

    service: ProxyService
    edge: ProxyEdge
    site: ProxySite
    auth: AuthClient
    limiter: RateLimiter
    limitBook: LimitBook
    metrics: ProxyMetrics
    forwarder: Forwarder | None
    outbox: Outbox | None
    memory: MemoryClient | None = None
    observations: Outbox | None = None


def assembleProxy(
    config: ProxyConfig,
    reactor: Any,
    *,
    metrics: ProxyMetrics | None = None,
    tracer: Tracer | None = None,
    genai: GenAIMetrics | None = None,
    auth: LifecycleAuthClient | None = None,
    sender: UsageSender | None = None,
    counters: RedisCounters | None = None,
    memory: MemoryClient | None = None,
    idleTimeout: float | None = DEFAULT_IDLE_TIMEOUT,
    requestTimeout: float | None = DEFAULT_REQUEST_TIMEOUT,
) -> ProxyDaemon:
    """
    Wire svc-proxy for C{config}: it listens on C{config.host} and
    C{config.port} once started.

    The daemon passes C{metrics}, C{tracer} and C{genai} only; the other
    keyword arguments are the tests' overrides.

    @param metrics: where the proxy counts; by default, metrics on a
        registry of their own.
    @param tracer: makes the server span of each request and the client
        span of each forwarded one; by default, spans that record nothing.
    @param genai: the GenAI histograms of the calls to providers (decisions
        D15), recorded while a meter is bound to them; by default none.
    @param auth: answers validations and is started and closed with the
        proxy, in place of the gRPC client of svc-auth and its cache and
        change feed (and the proxy waits for none of them before it
        listens).
    @param sender: where usage rows go, in place of the ledger's sender
        on the connection to svc-auth (required with C{auth} when
        C{config.providers} is set).
    @param counters: the limiter's counters, in place of a connection to
        C{config.redis} (and the proxy does not wait for Redis before it
        listens).
    @param memory: the client of svc-memory, in place of one on a channel
        to C{config.memoryGrpcAddr}; used only when memory is on
        (C{config.memory}).
    @param idleTimeout: seconds a quiet connection is kept.
    @param requestTimeout: seconds a request may take to arrive.

    @raise svcd.ledger.journalfile.JournalError: when the usage journal or
        the memory journal is held by another process.
    """
    if metrics is None:
        metrics = ProxyMetrics()
    # Decisions D11: the limits rows, from the change feed, or from the
    # validation answers while there is no live feed.
    limitBook = LimitBook()
    # What the proxy waits for before it listens (SVC_START_TIMEOUT).
    dependencies: list[Dependency] = []
    grpcAuth: GrpcAuthClient | None = None
    # The ledger's calls, on the same connection as the validations.
    ledgerSender: LedgerSender | None = None
    client: AuthClient
    service: ClosableAuthClient
    if auth is None:
        # The one channel to svc-auth and its slots, shared by the
        # validations, the change feed and the ledger's sender; started and
        # closed with the validation client.
        connection = AuthConnection(
            functools.partial(authChannel, config.authGrpcAddr, config.authTLS),
            IReactorFromThreads(reactor),
            reactor,
            tracer=tracer,
            maxInFlight=config.authMaxInFlight,
            queueTimeout=config.authQueueTimeout,
        )
        grpcAuth = GrpcAuthClient(connection, config.validateTimeout, metrics, limitBook=limitBook)
        ledgerSender = LedgerSender(connection)
        client, service = _authClient(config, reactor, grpcAuth, metrics, limitBook, dependencies)
    else:
        client = service = auth
    spend = None if ledgerSender is None else ledgerSender.getSpend
    limiter: RateLimiter
    if counters is None:
        limiter = makeRateLimiter(
            reactor,
            reactor,
            config.redis,
            config.defaultRPM,
            config.orgRPM,
            metrics.ratelimitCircuitOpen,
            limitBook,
            spend,
            timeout=config.redisTimeout,
            unchecked=metrics.uncheckedAdmissions,
            lease=config.budgetLease,
            recordGrace=config.budgetRecordGrace,
            reconcileInterval=config.budgetReconcileInterval,
        )
        if isinstance(limiter, RedisRateLimiter):
            dependencies.append(Dependency("Redis", limiter.connected))
    else:
        limiter = RedisRateLimiter(
            counters,
            reactor,
            config.defaultRPM,
            config.orgRPM,
            circuitOpen=metrics.ratelimitCircuitOpen,
            book=limitBook,
            spend=spend,
            timeout=config.redisTimeout,
            unchecked=metrics.uncheckedAdmissions,
            lease=config.budgetLease,
            recordGrace=config.budgetRecordGrace,
            reconcileInterval=config.budgetReconcileInterval,
        )
    forwarder = None
    outbox = None
    if config.providers is not None:
        # Decisions D15: the deployments' routing state of this proxy.
        router = Router(reactor, Random())
        forwarder = Forwarder(
            reactor,
            reactor,
            tuple(config.providers.providers.values()),
            metrics,
            tracer,
            router,
            genai,
        )
        if sender is None:
            if ledgerSender is None:
                raise ValueError("a proxy that forwards with a given auth client needs a sender")
            sender = ledgerSender
        # Decisions D12: each forwarded request's usage row waits here until
        # svc-auth has committed it. Nothing forwarded, no ledger.
        journal = None
        if config.usageJournal:
            journal = Journal(config.usageJournal)
            # One process per journal (D12, amended): a second proxy naming
            # it stops here, before anything starts.
            journal.hold()
        outbox = Outbox(
            sender,
            reactor,
            metrics,
            maxRows=config.usageOutboxMax,
            journal=journal,
            # The limiter learns which reservations' spend is in the ledger
            # (decisions D12, amended).
            onRecorded=limiter.recorded,
        )
    # Decisions D13: svc-memory, when memory is on. Its channel is made at
    # start (after twistd forks), as svc-auth's is; the proxy waits for it
    # neither to listen nor to be ready: memory never fails a request that
    # does not use it.
    if config.memory is None:
        memory = None
    elif memory is None:
        assert config.memoryGrpcAddr is not None
        memory = MemoryClient(
            functools.partial(memoryChannel, config.memoryGrpcAddr, _clientTLS(config.memoryTLS)),
            IReactorFromThreads(reactor),
            DEFAULT_TIMEOUT,
            maxInFlight=config.memoryMaxInFlight,
            clock=reactor,
        )
    # Decisions D13: the observations of chat completions leave for
    # svc-memory the way usage rows leave for svc-auth, from an outbox of
    # their own (SVC_MEMORY_JOURNAL), held by one process as the usage
    # journal is.
    observations = None
    observer = None
    journalThreads = None
    if memory is not None and forwarder is not None:
        observationMetrics = ObservationOutboxMetrics(metrics.registry)
        inThread = None
        if config.memoryJournal:
            # The memory journal's rewrites copy and fsync in a thread of
            # their own, one at a time, never on the reactor's (decisions
            # D13, amended): started and stopped with the service.
            journalThreads = ThreadPool(minthreads=1, maxthreads=1, name="svc-proxy-memory-journal")
            inThread = functools.partial(deferToThreadPool, reactor, journalThreads)
        observations = observationOutbox(
            memory.queueObservations,
            reactor,
            observationMetrics,
            journalPath=config.memoryJournal,
            maxObservations=config.memoryOutboxMax,
            maxBytes=config.memoryOutboxBytes,
            inThread=inThread,
        )
        if config.memoryJournal:
            holdJournalLock(config.memoryJournal, "memory journal")
        observer = Observer(observations, limitBook, observationMetrics, reactor)
    edge = ProxyEdge(
        config,
        client,
        limiter,
        metrics,
        reactor,
        tracer,
        forwarder,
        ledger=outbox,
        memory=memory,
        limitBook=limitBook,
        observer=observer,
    )
    site = ProxySite(
        edge.resource(),
        config.maxRequestBodyBytes,
        reactor,
        timeout=idleTimeout,
        requestTimeout=requestTimeout,
        maxBufferedBodyBytes=config.maxBufferedBodyBytes,
        bodyWanted=edge.bodyWanted,
        protocolErrors=ProtocolErrors(metrics.protocolErrors, reactor),
    )
    proxy = ProxyService(
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
        memory=memory,
        observations=observations,
        journalThreads=journalThreads,
    )
    return ProxyDaemon(
        service=proxy,
        edge=edge,
        site=site,
        auth=client,
        limiter=limiter,
        limitBook=limitBook,
        metrics=metrics,
        forwarder=forwarder,
        outbox=outbox,
        memory=memory,
        observations=observations,
    )


def _clientTLS(tls: GrpcTLS | None) -> ClientTLS | None:
    """
    The memory client's TLS of C{SVC_MEMORY_GRPC_TLS_*}.
    """
    if tls is None:
        return None
    return ClientTLS(tls.rootCertificates, tls.certificateChain, tls.privateKey)


def _authClient(
    config: ProxyConfig,
    reactor: Any,
    grpcAuth: GrpcAuthClient,
    metrics: ProxyMetrics,
    limitBook: LimitBook,
    dependencies: list[Dependency],
) -> tuple[AuthClient, ClosableAuthClient]:
    """
    The auth client the edge asks and the one the service starts and
    closes: C{grpcAuth} itself, or the caching client in front of it with
    its change feed (decisions D8; SVC_AUTH_CACHE_SIZE=0 leaves the Phase
    1 client). Appends what the proxy waits for to C{dependencies}.
    """
    dependencies.append(Dependency("the gRPC channel to svc-auth", grpcAuth.channelReady))
    if not config.authCacheSize:
        return grpcAuth, grpcAuth
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
    caching = CachingAuthClient(grpcAuth, cache, feed, metrics)
    dependencies.append(Dependency("the change feed's first snapshot", feed.settled))
    return caching, caching
