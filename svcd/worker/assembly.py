"""
svc-worker assembled once (decisions D13): what its twistd plugin runs and
what the tests start are wired here, and only here.

The worker holds no database connection. It works through:

  - svc-memory's gRPC (L{svcd.memoryclient.client}): claims, memories, completions
    and releases;
  - svc-auth's gRPC, on one connection (L{svcd.authclient}): the change
    feed that tells it every limits row, budget and memory setting (as it
    tells the proxies), and the ledger's sender (RecordUsage for its rows,
    GetSpend for its budgets' counters);
  - Redis, for the limits' and budgets' counters it shares with the
    proxies (L{svcd.limits.limiter}), so that a worker's calls and the
    clients' requests are counted together;
  - the providers of the providers file's C{[memory]} table
    (L{svcd.providers.upstream}, L{svcd.metered.embedder}).

L{assembleWorker} returns the parts and the service that starts and stops
them in order; the tap adds what only a real process does.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry
from twisted.application import strports
from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import quoteStringArgument
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

from svcd.authclient.channel import authChannel
from svcd.authclient.connection import AuthConnection
from svcd.authclient.feed import IGNORE_TOKENS, ChangeFeed, FeedMeaning, openChangeFeed
from svcd.common.config import GrpcTLS
from svcd.common.opsweb import OperationsSite, OperationsWeb
from svcd.common.readiness import Check, CheckFailed
from svcd.ledger.journal import Journal
from svcd.ledger.outbox import Outbox
from svcd.ledger.sender import LedgerSender
from svcd.limits.admission import Admission
from svcd.limits.book import LimitBook
from svcd.limits.limiter import RateLimiter, makeRateLimiter
from svcd.memoryclient.channel import ClientTLS, memoryChannel
from svcd.memoryclient.client import MemoryClient
from svcd.metered.embedder import Embedder
from svcd.providers.genai import GenAIMetrics
from svcd.providers.upstream import Forwarder
from svcd.worker.config import WorkerConfig
from svcd.worker.loop import ObservationLoop, leaseOwner
from svcd.worker.metrics import WorkerMetrics
from svcd.worker.processor import ObservationProcessor

# What the change feed's coming and going means to the worker (its log).
_FEED_MEANING = FeedMeaning(
    "claiming observations (limits and budgets known)",
    "claiming no observation (limits and budgets unknown)",
)
# The stop's share of SVC_SHUTDOWN_TIMEOUT left to send the ledger's rows,
# at least.
_FLUSH_SHARE = 0.25


@attrs.frozen
class WorkerParts:
    """
    svc-worker's parts, for the tests to reach.
    """

    config: WorkerConfig
    metrics: WorkerMetrics
    connection: AuthConnection
    feed: ChangeFeed
    limitBook: LimitBook
    limiter: RateLimiter
    outbox: Outbox
    forwarder: Forwarder
    memory: MemoryClient
    loop: ObservationLoop


class WorkerService(Service):
    """
    Starts the links, then the loop; stops the loop first (its claims
    finished or released), then sends the ledger's rows, then closes the
    links.
    """

    log = Logger()

    def __init__(self, parts: WorkerParts, timeout: float) -> None:
        self.parts = parts
        self._timeout = timeout

    def startService(self) -> None:
        super().startService()
        parts = self.parts
        parts.connection.start()
        parts.memory.start()
        parts.feed.start()
        parts.limiter.start()
        # Rows a killed worker left in its journal go first.
        parts.outbox.start()
        parts.loop.start()
        self.log.info(
            "svc-worker started as {owner}: up to {concurrency} observations at once,"
            " leases of {lease} s",
            owner=parts.loop.owner,
            concurrency=parts.config.concurrency,
            lease=parts.config.lease,
        )

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        parts = self.parts
        clock: Any = parts.connection.clock
        began = clock.seconds()
        await parts.loop.stop(self._timeout * (1 - _FLUSH_SHARE))
        left = max(self._timeout - (clock.seconds() - began), self._timeout * _FLUSH_SHARE)
        unsent = await parts.outbox.flush(left)
        if unsent:
            self.log.warn("{rows} usage row(s) not sent to svc-auth at stop", rows=unsent)
        parts.outbox.close()
        parts.feed.stop()
        await parts.limiter.stop()
        await parts.forwarder.close()
        parts.memory.close()
        parts.connection.close()
        self.log.info("svc-worker stopped")


def _clientTLS(tls: GrpcTLS | None) -> ClientTLS | None:
    if tls is None:
        return None
    return ClientTLS(tls.rootCertificates, tls.certificateChain, tls.privateKey)


def assembleWorker(
    config: WorkerConfig,
    reactor: Any,
    *,
    metrics: WorkerMetrics | None = None,
    tracer: Tracer | None = None,
    genai: GenAIMetrics | None = None,
) -> WorkerParts:
    """
    Wire svc-worker's parts for C{config}; nothing is started.

    @param genai: the GenAI histograms of its calls to providers (decisions
        D15), recorded while a meter is bound to them.

    @raise svcd.ledger.journalfile.JournalError: when the usage journal is
        held by another process.
    """
    if metrics is None:
        metrics = WorkerMetrics()
    threads = IReactorFromThreads(reactor)
    limitBook = LimitBook()
    connection = AuthConnection(
        functools.partial(authChannel, config.authGrpcAddr, config.authTLS),
        threads,
        reactor,
        tracer=tracer,
    )
    feed = ChangeFeed(
        lambda: openChangeFeed(connection.startedChannel()),
        IGNORE_TOKENS,
        threads,
        reactor,
        limitBook=limitBook,
        threadName="svc-worker-change-feed",
        meaning=_FEED_MEANING,
    )
    # The book's rows come from the feed alone: the worker makes no
    # validation whose answers could tell it more.
    limitBook.feedLive = feed.live
    metrics.watchFeed(feed.live)
    sender = LedgerSender(connection)
    limiter = makeRateLimiter(
        reactor,
        reactor,
        config.redis,
        # Requests are never counted by the worker (countRequest=False).
        1,
        {},
        metrics.ratelimitCircuitOpen,
        limitBook,
        sender.getSpend,
        timeout=config.redisTimeout,
        unchecked=metrics.uncheckedAdmissions,
        lease=config.budgetLease,
        recordGrace=config.budgetRecordGrace,
        reconcileInterval=config.budgetReconcileInterval,
    )
    journal = None
    if config.usageJournal:
        journal = Journal(config.usageJournal)
        journal.hold()
    outbox = Outbox(
        sender,
        reactor,
        metrics,
        maxRows=config.usageOutboxMax,
        journal=journal,
        onRecorded=limiter.recorded,
    )
    admission = Admission(limiter, metrics, reactor)
    providers = config.providers
    forwarder = Forwarder(
        reactor, reactor, tuple(providers.providers.values()), metrics, tracer, genai=genai
    )
    embedder = Embedder(providers, forwarder, admission, outbox, reactor)
    memory = MemoryClient(
        functools.partial(memoryChannel, config.memoryGrpcAddr, _clientTLS(config.memoryTLS)),
        threads,
        config.memoryTimeout,
        maxInFlight=config.memoryMaxInFlight,
        clock=reactor,
    )
    owner = leaseOwner(config.serviceName)
    processor = ObservationProcessor(
        owner, memory, providers, forwarder, embedder, admission, outbox, metrics, reactor
    )
    loop = ObservationLoop(
        memory,
        processor,
        metrics,
        reactor,
        owner,
        lease=config.lease,
        maxAttempts=config.maxAttempts,
        concurrency=config.concurrency,
        pollInterval=config.pollInterval,
        ready=lambda: feed.live() and outbox.hasRoom(),
    )
    return WorkerParts(
        config=config,
        metrics=metrics,
        connection=connection,
        feed=feed,
        limitBook=limitBook,
        limiter=limiter,
        outbox=outbox,
        forwarder=forwarder,
        memory=memory,
        loop=loop,
    )


def assembleWorkerDaemon(
    reactor: Any,
    config: WorkerConfig,
    registry: CollectorRegistry,
    *,
    tracer: Tracer | None = None,
    genai: GenAIMetrics | None = None,
) -> MultiService:
    """
    svc-worker's service tree: the worker, then its operations port
    (/health, /ready, /metrics on SVC_PORT). /ready checks the change
    feed (limits and budgets known: no claim without it), svc-memory (the
    last claim was answered) and Redis (not critical: without it limits
    fail open, as on the proxies).
    """
    parts = assembleWorker(
        config, reactor, metrics=WorkerMetrics(registry), tracer=tracer, genai=genai
    )
    root = MultiService()
    WorkerService(parts, config.shutdownTimeout).setServiceParent(root)

    def feedCheck() -> Deferred[None]:
        if not parts.feed.live():
            return fail(CheckFailed("svc-auth's change feed is not live: limits unknown"))
        return succeed(None)

    def memoryCheck() -> Deferred[None]:
        error = parts.loop.lastClaimError
        if error is None:
            return fail(CheckFailed("no claim answered yet"))
        if error:
            return fail(CheckFailed(f"the last claim failed: {error}"))
        return succeed(None)

    web = OperationsWeb(
        reactor,
        [
            Check("auth_feed", feedCheck),
            Check("memory", memoryCheck),
            Check("redis", parts.limiter.checkReady, critical=False),
        ],
        registry,
        docsBase=config.errorDocsBase,
    )
    kind = "tcp6" if ":" in config.host else "tcp"
    http: IService = strports.service(
        f"{kind}:port={config.port}:interface={quoteStringArgument(config.host)}",
        WorkerOperationsSite(web.resource(), reactor=reactor),
        reactor=reactor,
    )
    http.setServiceParent(root)
    return root


class WorkerOperationsSite(OperationsSite):
    """
    The site of svc-worker's HTTP port; its DEBUG lines carry the namespace
    C{svcd.worker.assembly.WorkerOperationsSite}.
    """
