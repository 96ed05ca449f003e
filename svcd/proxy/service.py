"""
The service tree of svc-proxy: the HTTP listener plus the auth client,
rate limiter and forwarder it depends on, started and stopped in order.

Start: the port is bound where twistd binds ports, then the proxy connects
to svc-auth and Redis and waits until they answer (at most
SVC_START_TIMEOUT) before it listens, so that its first request is served
as well as its thousandth. A worker that shares its port with others
(SVC_REUSE_PORT) gets no connection before that: the kernel gives them to
the workers that listen.

Stop: the listener closes, every open connection is drained by the site
(L{svcd.proxy.http.site.ProxySite.drain}: each answer from now on says
C{Connection: close}, idle keep-alive connections are closed once their
client is quiet), and only once the last client connection has closed (or
SVC_SHUTDOWN_TIMEOUT has passed and they are closed by force) do the gRPC
channel, the Redis connection and the providers' pool close (and the
channel to svc-memory, when memory is on: made at start, but never waited
for, since memory never fails a request that does not use it). No request is
ever answered 503 because the proxy itself is stopping.

The usage ledger (decisions D12), when there is one: its journal is read
at start, before the proxy listens, and the rows a previous run left
unacknowledged are queued first. At stop, once the last client connection
has closed (so no request is left to record), the rows still waiting are
sent, for at most SVC_SHUTDOWN_TIMEOUT more, before the gRPC channel
closes; what svc-auth has not acknowledged by then stays in the journal.

The observations of chat completions (decisions D13), when memory is on,
go the same way to svc-memory, from their own outbox and journal
(SVC_MEMORY_JOURNAL): read at start before the proxy listens, flushed at
stop beside the usage rows (at once, within the same bound) before the
channel to svc-memory closes; what svc-memory has not acknowledged stays
in the memory journal and is sent at the next start (one sent twice is
stored once: svc-memory queues one per request id, and the worker's
deduplication updates the memories of one processed already).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, maybeDeferred
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.lifecycle import notifySystemd, stopWithFailure
from svcd.ledger.journalfile import JournalError
from svcd.ledger.words import OutboxWords
from svcd.limits.limiter import RateLimiter
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.site import ProxySite

# How often a starting proxy looks whether its dependencies are ready.
READY_POLL_SECONDS = 0.02

# After connections were closed by force at the shutdown timeout, how long
# the stop waits for the reactor to finish closing them.
FORCED_CLOSE_SECONDS = 1.0


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


class ClosableLedger(Protocol):
    """
    The lifecycle part of the usage outbox, or of the observations'
    (L{svcd.ledger.outbox.Outbox}).
    """

    words: OutboxWords

    @property
    def waiting(self) -> int: ...

    def start(self) -> None: ...

    def flush(self, timeout: float) -> Deferred[int]: ...

    def settle(self, timeout: float) -> Deferred[None]: ...

    def close(self) -> int: ...


class ClosableMemoryClient(Protocol):
    """
    The lifecycle part of the client of svc-memory
    (L{svcd.memoryclient.client.MemoryClient}).
    """

    def start(self) -> None: ...

    def close(self) -> None: ...


class ServerPort(Protocol):
    """
    Where the proxy listens, bound before it listens
    (L{svcd.proxy.listening.ProxyPort}).
    """

    def bind(self) -> None: ...

    def listen(self, protocolFactory: IProtocolFactory, waited: float) -> IListeningPort: ...

    def close(self) -> None: ...


@attrs.frozen
class Dependency:
    """
    Something the proxy waits for before it listens: C{name} says what, for
    the log, and C{ready} whether it is ready now.
    """

    name: str
    ready: Callable[[], bool]


class ProxyService(Service):
    """
    Listens for HTTP while running, once its dependencies are ready (see
    the module docstring).

    @param clock: the reactor, or a L{twisted.internet.task.Clock} in
        tests: the time of the start and of the stop, and the reactor to
        stop should listening fail once the proxy has started.
    @param journalThreads: the memory journal's one thread, where its
        rewrites copy and fsync (L{svcd.ledger.compactions}): started and
        stopped with the proxy.
    @param dependencies: what to wait for before listening, for at most
        C{startTimeout} seconds; past that the proxy listens anyway (auth
        then fails closed and rate limits open, until they are up) and
        says what it was still waiting for.
    """

    log = Logger()

    def __init__(
        self,
        port: ServerPort,
        edge: ProxyEdge,
        site: ProxySite,
        auth: ClosableAuthClient,
        limiter: RateLimiter,
        clock: Any,
        shutdownTimeout: float,
        forwarder: ClosableForwarder | None = None,
        startTimeout: float = 5.0,
        dependencies: Sequence[Dependency] = (),
        ledger: ClosableLedger | None = None,
        memory: ClosableMemoryClient | None = None,
        observations: ClosableLedger | None = None,
        journalThreads: ThreadPool | None = None,
    ) -> None:
        self._port = port
        self._edge = edge
        self.site = site
        self._auth = auth
        self._limiter = limiter
        self._clock: Clock = clock
        self._reactor = clock
        self._shutdownTimeout = shutdownTimeout
        self._forwarder = forwarder
        self._startTimeout = startTimeout
        self._dependencies = tuple(dependencies)
        self._ledger = ledger
        self._memory = memory
        self._observations = observations
        self._journalThreads = journalThreads
        self._starting: Deferred[None] | None = None
        self._listening: IListeningPort | None = None
        self._waitingForPort: list[Deferred[IListeningPort]] = []

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        # A port that cannot be bound stops the daemon here, with one line
        # (LoggingRootService), instead of being logged while it runs
        # without listening.
        self._port.bind()

    def startService(self) -> None:
        super().startService()
        self._port.bind()
        self._auth.start()
        if self._memory is not None:
            # Not a dependency: the proxy listens and is ready without it.
            self._memory.start()
        self._limiter.start()
        if self._journalThreads is not None:
            self._journalThreads.start()
        for outbox in (self._ledger, self._observations):
            if outbox is None:
                continue
            try:
                # Before listening: the rows a previous run left go first.
                outbox.start()
            except JournalError as error:
                self.log.critical("Cannot start: {reason}", reason=str(error))
                stopWithFailure(self._reactor, f"svc-proxy: cannot start: {error}")
                return
        self._starting = Deferred.fromCoroutine(self._listenWhenReady())
        self._starting.addErrback(self._startFailed)

    def whenListening(self) -> Deferred[IListeningPort]:
        """
        A Deferred that fires with the listening port once the proxy
        listens.
        """
        waiting: Deferred[IListeningPort] = Deferred()
        if self._listening is not None:
            waiting.callback(self._listening)
        else:
            self._waitingForPort.append(waiting)
        return waiting

    async def _listenWhenReady(self) -> None:
        began = self._clock.seconds()
        deadline = began + self._startTimeout
        while True:
            missing = [each.name for each in self._dependencies if not each.ready()]
            now = self._clock.seconds()
            if not missing or now >= deadline:
                break
            await deferLater(
                asReactorTime(self._clock), min(READY_POLL_SECONDS, deadline - now), lambda: None
            )
        if missing:
            self.log.warn(
                "svc-proxy still waits for {missing} after {timeout} s; listening anyway:"
                " auth fails closed (503) until svc-auth answers, rate limits fail open"
                " until Redis does",
                missing=", ".join(missing),
                timeout=self._startTimeout,
            )
        port = self._listening = self._port.listen(self.site, now - began)
        # A unit of Type=notify (etc/systemd) is started only now.
        notifySystemd("READY=1")
        waiting, self._waitingForPort = self._waitingForPort, []
        for each in waiting:
            each.callback(port)

    def _startFailed(self, failure: Failure) -> None:
        if failure.check(CancelledError):
            # Stopped while waiting for its dependencies.
            return
        # Listening failed although binding succeeded: another process took
        # the address meanwhile. This daemon cannot serve.
        self.log.critical("Cannot start: {reason}", reason=str(failure.value))
        stopWithFailure(self._reactor, f"svc-proxy: cannot start: {failure.value}")

    def stopService(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        super().stopService()
        starting = self._starting
        if starting is not None and not starting.called:
            # Stopped while waiting for its dependencies: it never listens.
            starting.cancel()
        self._port.close()
        # Every answer from now on says Connection: close, also on a
        # connection accepted in this reactor turn.
        self.site.drain()
        if self._listening is not None:
            # Connections the kernel queued for this socket but it had not
            # accepted are reset as it closes, unless net.ipv4.tcp_migrate_req
            # hands them to another worker of the port.
            await maybeDeferred(self._listening.stopListening)
        await self._drain()
        # Both at once, each within the shutdown timeout: a stop waits for
        # the slower, not for the sum.
        flushes = [
            Deferred.fromCoroutine(self._flushLedger(each))
            for each in (self._ledger, self._observations)
            if each is not None
        ]
        for flushing in flushes:
            await flushing
        if self._journalThreads is not None:
            # Idle by now (a copy past its bound was abandoned, and stops
            # at its next chunk).
            self._journalThreads.stop()
        self._auth.close()
        if self._memory is not None:
            self._memory.close()
        await self._limiter.stop()
        if self._forwarder is not None:
            await self._forwarder.close()
        self.log.info("svc-proxy stopped")

    async def _flushLedger(self, ledger: ClosableLedger) -> None:
        """
        Send the rows (or observations) still waiting while the channel to
        their daemon is open, for at most the shutdown timeout;
        L{ClosableLedger.close} says what is left.
        """
        if ledger.waiting:
            self.log.info(
                "Sending {rows} {records} to {peer} before stopping",
                **ledger.words.fields(),
                rows=ledger.waiting,
            )
            await ledger.flush(self._shutdownTimeout)
        # The memory journal's rewrite in its thread, then its last one,
        # so that nothing acknowledged is left in it.
        await ledger.settle(self._shutdownTimeout)
        ledger.close()

    async def _drain(self) -> None:
        """
        Wait until every client connection has closed and no request is
        being answered; past the shutdown timeout, close what is left.
        """
        clock = asReactorTime(self._clock)

        async def drained() -> None:
            await self.site.whenDrained()
            await self._edge.whenIdle()

        try:
            await timeoutDeferred(Deferred.fromCoroutine(drained()), self._shutdownTimeout, clock)
            return
        except TimeoutError:
            pass
        closed, busy = self.site.closeConnections()
        if busy or self._edge.requestsInFlight:
            self.log.warn(
                "Requests still in flight after {timeout} s; closing anyway"
                " ({connections} connection(s) closed, {busy} of them answering)",
                timeout=self._shutdownTimeout,
                connections=closed,
                busy=busy,
            )
        else:
            self.log.warn(
                "{connections} idle connection(s) still open after {timeout} s; closed",
                timeout=self._shutdownTimeout,
                connections=closed,
            )
        try:
            await timeoutDeferred(self.site.whenDrained(), FORCED_CLOSE_SECONDS, clock)
        except TimeoutError:
            pass
