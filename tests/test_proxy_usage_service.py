"""
The usage outbox in svc-proxy's start and stop (decisions D12, issue 25):
the journal is replayed before the proxy listens; at stop the rows waiting
are sent after the client connections have drained and before the gRPC
channel closes, for at most the shutdown timeout.
"""

from __future__ import annotations

from typing import Any

import attrs
from proxydoubles import FakeAuthClient, MemoryCounters
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from svcd.ledger.words import USAGE_WORDS, OutboxWords
from svcd.limits.limiter import RedisRateLimiter
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.site import ProxySite
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.service import ProxyService


@attrs.define
class Events:
    happened: list[str] = attrs.field(factory=list)


@attrs.define
class Port:
    events: Events

    def bind(self) -> None:
        pass

    def listen(self, protocolFactory: Any, waited: float) -> Any:
        self.events.happened.append("listen")
        return Listening()

    def close(self) -> None:
        pass


class Listening:
    def stopListening(self) -> None:
        pass


class Auth(FakeAuthClient):
    def __init__(self, events: Events) -> None:
        super().__init__()
        self.events = events

    def close(self) -> None:
        self.events.happened.append("channel closed")


@attrs.define
class Ledger:
    events: Events
    waiting: int = 3
    flushing: list[tuple[float, Deferred[int]]] = attrs.field(factory=list)
    name: str = "ledger"
    words: OutboxWords = USAGE_WORDS

    def start(self) -> None:
        self.events.happened.append("journal replayed" if self.name == "ledger" else self.name)

    def flush(self, timeout: float) -> Deferred[int]:
        self.events.happened.append("flush" if self.name == "ledger" else f"{self.name} flush")
        flushed: Deferred[int] = Deferred()
        self.flushing.append((timeout, flushed))
        return flushed

    def settle(self, timeout: float) -> Deferred[None]:
        return succeed(None)

    def close(self) -> int:
        self.events.happened.append(f"{self.name} closed")
        return self.waiting


class Memory:
    def __init__(self, events: Events) -> None:
        self.events = events

    def start(self) -> None:
        pass

    def close(self) -> None:
        self.events.happened.append("memory channel closed")


def service(
    events: Events,
    ledger: Ledger,
    clock: Clock,
    observations: Ledger | None = None,
    journalThreads: Any = None,
) -> ProxyService:
    auth = Auth(events)
    limiter = RedisRateLimiter(MemoryCounters(), clock, 60)
    edge = ProxyEdge(
        ProxyConfig(authGrpcAddr="auth.test:9091"), auth, limiter, ProxyMetrics(), clock
    )
    return ProxyService(
        Port(events),
        edge,
        ProxySite(edge.resource(), 1000, clock),
        auth,
        limiter,
        clock,
        shutdownTimeout=7.0,
        ledger=ledger,
        memory=Memory(events) if observations is not None else None,
        observations=observations,
        journalThreads=journalThreads,
    )


def test_journalReplayedBeforeListening() -> None:
    events, clock = Events(), Clock()
    proxy = service(events, Ledger(events), clock)
    proxy.startService()
    clock.advance(0.1)
    assert events.happened == ["journal replayed", "listen"]


def test_rowsSentBeforeTheChannelCloses() -> None:
    """
    The stop flushes the outbox, bounded by the shutdown timeout, and only
    once that is over closes the ledger, then the channel to svc-auth.
    """
    events, clock = Events(), Clock()
    ledger = Ledger(events)
    proxy = service(events, ledger, clock)
    proxy.startService()
    clock.advance(0.1)
    stopped = proxy.stopService()
    clock.advance(0.1)
    [(timeout, flushed)] = ledger.flushing
    assert timeout == 7.0
    assert events.happened[-1] == "flush" and not stopped.called
    flushed.callback(0)
    clock.advance(0.1)
    assert events.happened[-3:] == ["flush", "ledger closed", "channel closed"]
    assert stopped.called


def test_nothingWaitingNoFlush() -> None:
    events, clock = Events(), Clock()
    proxy = service(events, Ledger(events, waiting=0), clock)
    proxy.startService()
    proxy.stopService()
    clock.advance(0.1)
    assert "flush" not in events.happened
    assert events.happened[-2:] == ["ledger closed", "channel closed"]


def test_observationsStartBeforeListeningAndFlushBesideTheRows() -> None:
    """
    Decisions D13: the observations' outbox is read at start before the
    proxy listens; at stop it is flushed at the same time as the usage
    rows (each within the shutdown timeout, so the stop waits for the
    slower, not the sum), and the channel to svc-memory closes only after
    both are over.
    """
    events, clock = Events(), Clock()
    ledger = Ledger(events)
    observations = Ledger(events, waiting=2, name="observations")
    proxy = service(events, ledger, clock, observations)
    proxy.startService()
    clock.advance(0.1)
    assert events.happened == ["journal replayed", "observations", "listen"]
    stopped = proxy.stopService()
    clock.advance(0.1)
    assert events.happened[-2:] == ["flush", "observations flush"]
    [(timeout, observed)] = observations.flushing
    assert timeout == 7.0
    observed.callback(0)
    clock.advance(0.1)
    assert "memory channel closed" not in events.happened and not stopped.called
    [(_, flushed)] = ledger.flushing
    flushed.callback(0)
    clock.advance(0.1)
    assert events.happened[-4:] == [
        "observations closed",
        "ledger closed",
        "channel closed",
        "memory channel closed",
    ]
    assert stopped.called


@attrs.define
class SettlingLedger(Ledger):
    """
    An observation outbox whose journal's rewrite in its thread ends when
    the test says.
    """

    settling: list[tuple[float, Deferred[None]]] = attrs.field(factory=list)

    def settle(self, timeout: float) -> Deferred[None]:
        self.events.happened.append(f"{self.name} settle")
        settled: Deferred[None] = Deferred()
        self.settling.append((timeout, settled))
        return settled


class Threads:
    """
    The memory journal's thread pool, as the service starts and stops it.
    """

    def __init__(self, events: Events) -> None:
        self.events = events

    def start(self) -> None:
        self.events.happened.append("journal thread started")

    def stop(self) -> None:
        self.events.happened.append("journal thread stopped")


def test_aStopLetsTheMemoryJournalsRewriteEndBeforeItCloses() -> None:
    """
    Decisions D13, amended: the memory journal's rewrites copy in a
    thread of their own, started before the journal is read and stopped
    last. A stop, once the observations are flushed (or none wait), lets
    the rewrite in the thread end and the last one be made
    (L{Outbox.settle}, bounded by the shutdown timeout) before the
    outbox closes, so that nothing acknowledged is left in the journal.
    """
    events, clock = Events(), Clock()
    ledger = Ledger(events, waiting=0)
    observations = SettlingLedger(events, waiting=0, name="observations")
    proxy = service(events, ledger, clock, observations, Threads(events))
    proxy.startService()
    clock.advance(0.1)
    assert events.happened[:2] == ["journal thread started", "journal replayed"]
    stopped = proxy.stopService()
    clock.advance(0.1)
    assert events.happened[-1] == "observations settle"
    assert "observations closed" not in events.happened
    [(timeout, settled)] = observations.settling
    assert timeout == 7.0
    settled.callback(None)
    clock.advance(0.1)
    assert events.happened[-5:] == [
        "observations settle",
        "observations closed",
        "journal thread stopped",
        "channel closed",
        "memory channel closed",
    ]
    assert stopped.called
