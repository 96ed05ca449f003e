"""
svc-auth's change feed as a daemon holds it (decisions D8): the stream of
every token and agent change that lets svc-proxy answer validations from
memory, and of the limits rows, budgets and memory settings (D11, D12,
D13) that svc-proxy and svc-worker admit their provider calls by; and the
judge of whether what it told may be trusted right now.

Here, beside the connection to svc-auth, rather than in svc-proxy, so that
svc-worker (decisions D13) learns limits and budgets by the very code the
proxy does: a worker passes no consumer of token changes, only the limit
book (L{ChangeFeed}'s C{consumer} is then L{IGNORE_TOKENS}).

The stream is a grpcio server-streaming call, whose messages can only be
read by blocking on an iterator, so it is read on a thread of its own
(never the reactor's); each message is handed to the reactor thread with
C{callFromThread}, in order, and applied there to the consumer (the
validation cache). The snapshot that begins a stream is turned into a
L{KnownTokens} filter on that thread too, so a million ids cost the
reactor nothing but the hand-over.

Trust: the feed is I{live} while a session (a stream whose snapshot has
arrived) is open, its last message was read at most C{maxAge} (500 ms)
ago, and the reactor is not far behind in applying what was read.
svc-auth sends a heartbeat about every 100 ms, and a heartbeat promises
that every change committed before it came before it (L{svcd.auth.feed}),
so a feed that speaks is a feed that has told us everything up to a
moment ago. When the feed is not live, every request is validated over
gRPC exactly as in Phase 1.

Two clocks, on purpose. Silence is judged by when the feed's thread read
the last message: a stalled svc-auth or link is noticed in 500 ms however
busy the reactor is. What was read is applied on the reactor thread, in
order, at the start of its next iteration, so a revocation read before a
request arrived reaches that request's check unless both fall in the same
iteration. A proxy under heavy load runs long iterations (hundreds of
requests each); judging the feed by when messages were applied would make
it distrust a healthy feed and send all its traffic to svc-auth just when
it can least afford it. Only a reactor more than C{maxLag} (one second)
behind in applying the feed's messages stops trusting it.

Outages are logged once each: a warning when a live feed is lost or goes
silent, one line when it is back; the attempts in between are not logged.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import attrs
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from svcd.authclient.knowntokens import KnownTokens
from svcd.common.clocks import Clock
from svcd.limits.book import BookRow, BudgetRow, LimitBook, LimitsRow, MemorySettingsRow
from svcd.limits.records import (
    BUDGET_PERIODS,
    OBSERVE_MODES,
    OBSERVE_OFF,
    OBSERVE_ON,
    Budget,
    Limits,
    MemorySettings,
)
from svcd.pb.auth.v1 import auth_pb2

# How old the last message may be for the feed to count as live (D8).
MAX_AGE = 0.5

# The feed is not trusted while the last message applied was read longer
# ago than this: the reactor is that far behind.
MAX_LAG = 1.0

# The messages the limit book takes (decisions D11, D12, D13).
_BOOK_KINDS = ("limits_changed", "budget_changed", "memory_settings_changed")

# Waits between attempts to open the stream: quick at first (a restarted
# svc-auth is back in moments), never longer than a second.
RETRY_DELAYS = (0.1, 0.2, 0.5, 1.0)


class FeedNotLive(Exception):
    """
    The feed stopped being live while a caller waited for it.
    """


class FeedConsumer(Protocol):
    """
    What the feed tells, on the reactor thread, in the order svc-auth sent
    it.
    """

    def feedStarted(self, known: KnownTokens) -> None:
        """
        A new session began with this snapshot: whatever was remembered
        before may have missed changes.
        """

    def tokenChanged(self, tokenID: bytes) -> None:
        """
        A token was created, revoked or changed (its 16-byte id).
        """

    def agentChanged(self, agentID: bytes) -> None:
        """
        An agent was created or changed status (its 16-byte id).
        """


@attrs.frozen
class FeedMeaning:
    """
    What a live feed, and a feed that is not, mean to the daemon that holds
    it: the words of its log lines when the feed comes and goes.
    """

    live: str
    down: str


VALIDATIONS = FeedMeaning("validating from memory", "validating every request over gRPC")


class _IgnoreTokens:
    """
    The consumer of a daemon that validates no token (svc-worker): the
    snapshot's ids and the changes of tokens and agents are dropped.
    """

    def feedStarted(self, known: KnownTokens) -> None:
        pass

    def tokenChanged(self, tokenID: bytes) -> None:
        pass

    def agentChanged(self, agentID: bytes) -> None:
        pass


IGNORE_TOKENS: FeedConsumer = _IgnoreTokens()


class FeedCall(Protocol):
    """
    The part of a grpcio streaming call the feed uses.
    """

    def __iter__(self) -> Iterator[auth_pb2.Change]: ...

    def cancel(self) -> bool: ...


def _describe(error: BaseException) -> str:
    """
    A gRPC status name for a failed call, with its details when it has
    some ("UNAVAILABLE: svc-auth is stopping"), else the exception's type.
    """
    code = getattr(error, "code", None)
    name = getattr(code(), "name", None) if callable(code) else None
    if not name:
        return type(error).__name__
    details = getattr(error, "details", None)
    text = details() if callable(details) else None
    return f"{name}: {text}" if text else str(name)


class _Session:
    """
    One attempt at the stream, as its reading thread sees it.
    """

    began = False


class ChangeFeed:
    """
    Keeps svc-auth's change feed open and says whether it is live.

    @param openStream: starts a WatchChanges call; called on the feed's
        thread, again after every end or failure.
    @param consumer: told of each session and change, on the reactor
        thread.
    @param reactor: for C{callFromThread}.
    @param clock: the time source of C{live}, on both threads (its
        C{seconds} must be safe to call from any thread, as the reactor's
        is).
    @param limitBook: filled with the limits rows, budgets and memory
        settings the feed carries.
    @param threadName: the name of the thread that reads the stream.
    @param meaning: what the feed's coming and going means to the daemon,
        in its log lines (svc-proxy's validations by default).
    """

    log = Logger()

    def __init__(
        self,
        openStream: Callable[[], FeedCall],
        consumer: FeedConsumer,
        reactor: IReactorFromThreads,
        clock: Clock,
        maxAge: float = MAX_AGE,
        maxLag: float = MAX_LAG,
        retryDelays: Sequence[float] = RETRY_DELAYS,
        limitBook: LimitBook | None = None,
        threadName: str = "svc-proxy-change-feed",
        meaning: FeedMeaning | None = None,
    ) -> None:
        self._openStream = openStream
        self._consumer = consumer
        self._threadName = threadName
        self._meaning = meaning if meaning is not None else VALIDATIONS
        # Decisions D11, D12 and D13: the limits rows, budgets and memory
        # settings the feed carries.
        self._limitBook = limitBook
        self._reactor = reactor
        self._clock = clock
        self._maxAge = maxAge
        self._maxLag = maxLag
        self._retryDelays = tuple(retryDelays)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._call: FeedCall | None = None
        self._thread: threading.Thread | None = None
        # Reactor thread only:
        self._inSession = False
        # When the feed's thread read the last message (written by that
        # thread), and when the last message applied had been read.
        self._lastRead = float("-inf")
        self._lastApplied = float("-inf")
        self._wasLive = False
        self._everLive = False
        self._noFeed = False
        self._downSince: float | None = None
        self._failedAttempts = 0
        # Callers waiting for heartbeats, by the heartbeat count they wait
        # for (see afterHeartbeats).
        self._heartbeats = 0
        self._waiting: dict[int, list[Deferred[None]]] = {}
        self._watchdog = LoopingCall(self._watch)
        self._watchdog.clock = clock  # type: ignore[assignment]

    # Lifecycle, on the reactor thread.

    def start(self) -> None:
        """
        Open the feed on a thread of its own, and watch its liveness.
        """
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=self._threadName, daemon=True)
        self._thread.start()
        self._watchdog.start(self._maxAge / 2, now=False)

    def stop(self) -> None:
        """
        Close the feed; its thread ends at once (the call is cancelled).
        """
        self._stopping.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._watchdog.running:
            self._watchdog.stop()
        self._inSession = False
        self._failWaiters()

    def live(self) -> bool:
        """
        May the cache be trusted now? (See the module docstring.)
        """
        now = self._clock.seconds()
        return (
            self._inSession
            and now - self._lastRead <= self._maxAge
            and now - self._lastApplied <= self._maxLag
        )

    def settled(self) -> bool:
        """
        Has the feed's first snapshot arrived, or has svc-auth answered that
        it has no feed (UNIMPLEMENTED, an svc-auth of Phase 1)? What a
        starting proxy waits for before it listens.
        """
        return self._everLive or self._noFeed

    def afterHeartbeats(self, count: int) -> Deferred[None]:
        """
        A Deferred that fires once C{count} more heartbeats have been
        applied, or fails with L{FeedNotLive} as soon as the feed is not
        live. Cancelling it withdraws the caller.

        Why: a heartbeat vouches for the changes committed before its beat
        was sent, and a beat in flight when a change was committed may
        come back after it; the second heartbeat from now vouches for
        everything committed before now (the listener sends its next beat
        only after the previous one came back and a pause of 100 ms). So a
        token id unknown now, and still unknown two heartbeats later, was
        not created before this call.
        """
        if not self.live():
            return fail(FeedNotLive())
        target = self._heartbeats + count
        waiters = self._waiting.setdefault(target, [])

        def withdraw(waiter: Deferred[None]) -> None:
            waiting = self._waiting.get(target)
            if waiting is not None and waiter in waiting:
                waiting.remove(waiter)

        waiter: Deferred[None] = Deferred(withdraw)
        waiters.append(waiter)
        return waiter

    def _releaseWaiters(self) -> None:
        ready = self._waiting.pop(self._heartbeats, ())
        for waiter in ready:
            if not waiter.called:
                waiter.callback(None)

    def _failWaiters(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for waiters in waiting.values():
            for waiter in waiters:
                if not waiter.called:
                    waiter.errback(FeedNotLive())

    # The feed's thread.

    def _run(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            reason = "ended"
            session = _Session()
            try:
                call = self._openStream()
                with self._lock:
                    self._call = call
                if self._stopping.is_set():
                    call.cancel()
                    return
                self._follow(call, session)
            except Exception as error:
                # Any end of the stream is an outage.
                reason = _describe(error)
            finally:
                with self._lock:
                    self._call = None
            if session.began:
                # A stream that served ends (svc-auth stopping, say): the
                # next attempt, perhaps on another replica, starts quick.
                failures = 0
            if self._stopping.is_set():
                return
            self._reactor.callFromThread(self._lost, reason)
            delay = self._retryDelays[min(failures, len(self._retryDelays) - 1)]
            failures += 1
            self._stopping.wait(delay)

    def _follow(self, call: FeedCall, session: _Session) -> None:
        """
        Read one stream until it ends, noting in C{session} when its
        snapshot arrived.
        """
        chunks: list[bytes] | None = []
        limitRows: list[BookRow] = []
        for change in call:
            receivedAt = self._lastRead = self._clock.seconds()
            kind = change.WhichOneof("kind")
            if chunks is not None:
                if kind == "known_token_ids":
                    chunks.append(change.known_token_ids)
                elif kind in _BOOK_KINDS:
                    row = rowOf(change)
                    if row is not None:
                        limitRows.append(row)
                elif kind == "snapshot_complete":
                    known = KnownTokens(change.snapshot_complete.token_count)
                    for chunk in chunks:
                        known.addPacked(chunk)
                    chunks = None
                    session.began = True
                    self._reactor.callFromThread(self._started, known, limitRows, receivedAt)
                # Changes cannot come before the snapshot's end; anything
                # else there is ignored.
                continue
            if kind == "heartbeat":
                self._reactor.callFromThread(self._heard, receivedAt)
            elif kind == "token_changed":
                self._reactor.callFromThread(self._tokenChanged, change.token_changed, receivedAt)
            elif kind == "agent_changed":
                self._reactor.callFromThread(self._agentChanged, change.agent_changed, receivedAt)
            elif kind in _BOOK_KINDS:
                row = rowOf(change)
                if row is not None:
                    self._reactor.callFromThread(self._limitsChanged, row, receivedAt)

    # The reactor thread.

    def _started(self, known: KnownTokens, limitRows: list[BookRow], receivedAt: float) -> None:
        if self._stopping.is_set():
            return
        self._consumer.feedStarted(known)
        if self._limitBook is not None:
            self._limitBook.replace(limitRows)
        self._inSession = True
        self._touched(receivedAt)
        if self._downSince is not None and self._everLive:
            self.log.info(
                "Change feed from svc-auth is back after {seconds} s and {attempts} attempts;"
                " {consequence} again ({known_tokens} known token ids)",
                seconds=round(self._clock.seconds() - self._downSince, 3),
                attempts=self._failedAttempts + 1,
                known_tokens=len(known),
                consequence=self._meaning.live,
            )
        elif not self._everLive:
            self.log.info(
                "Change feed from svc-auth is live; {consequence} ({known_tokens} known token ids)",
                known_tokens=len(known),
                consequence=self._meaning.live,
            )
        self._everLive = True
        self._wasLive = True
        self._downSince = None
        self._failedAttempts = 0

    def _heard(self, receivedAt: float) -> None:
        self._touched(receivedAt)
        self._heartbeats += 1
        self._releaseWaiters()

    def _touched(self, receivedAt: float) -> None:
        """
        A message read at C{receivedAt} is applied now.
        """
        self._lastApplied = receivedAt

    def _tokenChanged(self, tokenID: bytes, receivedAt: float) -> None:
        if self._inSession:
            self._consumer.tokenChanged(tokenID)
            self._touched(receivedAt)

    def _agentChanged(self, agentID: bytes, receivedAt: float) -> None:
        if self._inSession:
            self._consumer.agentChanged(agentID)
            self._touched(receivedAt)

    def _limitsChanged(self, row: BookRow, receivedAt: float) -> None:
        if self._inSession:
            if self._limitBook is not None:
                self._limitBook.changed(row)
            self._touched(receivedAt)

    def _lost(self, reason: str) -> None:
        self._inSession = False
        if reason.partition(":")[0] == "UNIMPLEMENTED":
            self._noFeed = True
        self._failWaiters()
        if self._downSince is None:
            self._downSince = self._clock.seconds()
            self._failedAttempts = 0
            if self._everLive:
                self.log.warn(
                    "Change feed from svc-auth lost ({reason}); {consequence} until it is back",
                    reason=reason,
                    consequence=self._meaning.down,
                )
        else:
            self._failedAttempts += 1
        self._wasLive = False

    def _watch(self) -> None:
        """
        Log a feed that went silent without ending (and its return).
        """
        live = self.live()
        if not live:
            self._failWaiters()
        if self._wasLive and not live and self._inSession:
            self._downSince = self._clock.seconds()
            self._failedAttempts = 0
            self.log.warn(
                "Change feed from svc-auth is silent (nothing for {max_age} s); {consequence}"
                " until it speaks again",
                max_age=self._maxAge,
                consequence=self._meaning.down,
            )
        elif live and not self._wasLive and self._downSince is not None:
            self.log.info(
                "Change feed from svc-auth speaks again after {seconds} s; {consequence} again",
                seconds=round(self._clock.seconds() - self._downSince, 3),
                consequence=self._meaning.live,
            )
            self._downSince = None
        self._wasLive = live


def rowOf(change: auth_pb2.Change) -> BookRow | None:
    """
    A C{limits_changed}, C{budget_changed} or C{memory_settings_changed}
    message as a row of the book.
    """
    if change.HasField("limits_changed"):
        return limitsRowOf(change.limits_changed)
    if change.HasField("memory_settings_changed"):
        return memorySettingsRowOf(change.memory_settings_changed)
    return budgetRowOf(change.budget_changed)


def memorySettingsRowOf(change: auth_pb2.MemorySettingsChanged) -> MemorySettingsRow | None:
    """
    A C{memory_settings_changed} message as a row of the book; None when
    its ids are not 16 bytes.
    """
    ids = _idsOf(change.org_id, change.agent_id)
    if ids is None:
        return None
    settings = memorySettingsFromProto(change.settings) if change.HasField("settings") else None
    return MemorySettingsRow(*ids, settings)


def memorySettingsFromProto(settings: auth_pb2.MemorySettings) -> MemorySettings:
    """
    Memory settings off the wire: a switch absent there inherits. The
    observe mode is C{observe_mode}; an svc-auth of the previous release
    sends only the switch C{observe}, whose true is C{on} (decisions D13
    amended: never the old meaning, which observed requests without a
    subject too). A mode this proxy does not know is C{off}: observing
    less than asked is the safe mistake.
    """
    mode = settings.observe_mode
    observe: str | None
    if mode:
        observe = mode if mode in OBSERVE_MODES else OBSERVE_OFF
    elif settings.HasField("observe"):
        observe = OBSERVE_ON if settings.observe else OBSERVE_OFF
    else:
        observe = None
    return MemorySettings(
        recall=settings.recall if settings.HasField("recall") else None,
        observe=observe,
        version=settings.version,
    )


def budgetRowOf(change: auth_pb2.BudgetChanged) -> BudgetRow | None:
    """
    A C{budget_changed} message as a budget row; None when its ids are not
    16 bytes.
    """
    ids = _idsOf(change.org_id, change.agent_id)
    if ids is None:
        return None
    budget = budgetFromProto(change.budget) if change.HasField("budget") else None
    return BudgetRow(*ids, budget)


def budgetFromProto(budget: auth_pb2.Budget) -> Budget | None:
    """
    A budget off the wire; None when it is not one the proxy can apply (a
    period it does not know, or nothing to spend), which is never taken as
    a budget of zero.
    """
    if budget.period not in BUDGET_PERIODS or budget.nano_usd <= 0:
        return None
    return Budget(nanoUSD=budget.nano_usd, period=budget.period, version=budget.version)


def _idsOf(orgID: bytes, agentID: bytes) -> tuple[str, str | None] | None:
    if len(orgID) != 16 or len(agentID) not in (0, 16):
        return None
    return str(uuid.UUID(bytes=orgID)), str(uuid.UUID(bytes=agentID)) if agentID else None


def limitsRowOf(change: auth_pb2.LimitsChanged) -> LimitsRow | None:
    """
    A C{limits_changed} message as a row; None when its ids are not 16
    bytes (never trusted halfway).
    """
    ids = _idsOf(change.org_id, change.agent_id)
    if ids is None:
        return None
    limits = limitsFromProto(change.limits) if change.HasField("limits") else None
    return LimitsRow(*ids, limits)


def limitsFromProto(row: auth_pb2.Limits) -> Limits:
    """
    A limits row off the wire. An unset value is absent there; a value
    that is not positive is taken as unset too (never as a limit of zero
    that would refuse everything).
    """
    return Limits(
        rpm=_positive(row, "rpm"),
        tpm=_positive(row, "tpm"),
        maxOutputTokens=_positive(row, "max_output_tokens"),
        version=row.version,
    )


def _positive(row: auth_pb2.Limits, name: str) -> int | None:
    if not row.HasField(name):
        return None
    value: int = getattr(row, name)
    return value if value > 0 else None


def openChangeFeed(channel: Any) -> FeedCall:
    """
    Start a WatchChanges call on C{channel} (no deadline: it lasts as long
    as the proxy runs).
    """
    watch = channel.unary_stream(
        "/svc.auth.v1.AuthService/WatchChanges",
        request_serializer=auth_pb2.WatchChangesRequest.SerializeToString,
        response_deserializer=auth_pb2.Change.FromString,
        _registered_method=True,
    )
    call: FeedCall = watch(auth_pb2.WatchChangesRequest())
    return call
