"""
The change feed of svc-auth (decisions D8, D11, D12, D13): every token,
agent, limits, budget and memory settings change, and heartbeats,
streamed to each svc-proxy that validates from memory.

Where the news comes from: the change listener (L{svcd.auth.listener})
hears PostgreSQL's notifications of every token, agent and limits change,
those made with svcctl straight in the database included, and tells the
L{ChangeHub}, which hands each change to every open stream. A limits,
budget or memory settings change goes out as the row itself, re-read by
the listener when it heard of the change (or as its absence, when it was
cleared). The listener
also sends itself a I{beat} through PostgreSQL's notification queue about
ten times a second; PostgreSQL delivers notifications in commit order, so
when a beat comes back, every change committed before it was sent has
already been heard and handed on. Only then does the hub send a
heartbeat. A heartbeat is therefore a promise, not a sign of life: "you
have every change committed until a moment ago". A proxy that stops
getting them stops trusting its cache after 500 ms.

When the listener loses its connection, changes may be missed until it is
back: the hub ends every stream (UNAVAILABLE) and refuses new ones until
the listener listens again. When svc-auth stops, the hub ends every stream
at once, as the gRPC server begins its stop, and refuses new ones
(L{ChangeHub.stop}): a stream is a call that never ends by itself, and
left open it would hold the gRPC server's stop for its whole grace period
while its proxy stayed on a replica that is leaving. A new stream starts
with a snapshot of the token ids that may be accepted and of every limits
row, budget and memory settings row (from svc-auth's tables,
L{svcd.auth.limits}), all read
after the stream was registered, so that every change applied before the
read is in the snapshot and every later one arrives as a change. (A
change applied between the registration and the read comes twice: in the
snapshot and after it, in order, which is harmless.)

Threads: the listener's thread calls the C{listener*}, C{*Changed} and
C{heartbeat} methods; each stream runs in a grpcio server thread, blocked
on its own bounded queue. Nothing here touches the reactor.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator

from twisted.logger import Logger

from svcd.auth.limits import budgetChange, limitsChange, memorySettingsChange
from svcd.auth.store.budgets import BudgetRecord
from svcd.auth.store.limits import LimitsRecord
from svcd.auth.store.memorysettings import MemorySettingsRecord
from svcd.pb.auth.v1 import auth_pb2

# The feed's gRPC method, which the server's bounds give a lane of its own.
FEED_METHOD = "/svc.auth.v1.AuthService/WatchChanges"

# A stream's queue holds at most this many messages: a proxy that cannot
# keep up (hundreds of changes a second piling up) is cut off and starts
# over with a snapshot, rather than making svc-auth hold an unbounded
# backlog for it.
DEFAULT_QUEUE_SIZE = 10_000

# Token ids per message of the snapshot: 16 bytes each, so 256 KiB, well
# under gRPC's 4 MiB message limit.
SNAPSHOT_CHUNK_IDS = 16_384

_HEARTBEAT = auth_pb2.Change(heartbeat=auth_pb2.Heartbeat())

# Why the streams of a stopping svc-auth end (their status is UNAVAILABLE).
STOPPING = "svc-auth is stopping"


class FeedUnavailable(Exception):
    """
    The listener is not hearing PostgreSQL, so changes could be missed: no
    stream is served until it is back.
    """


class TooManyStreams(Exception):
    """
    The configured number of feed streams are open already.
    """


class FeedEnded:
    """
    The marker a stream's queue ends with, and why.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason


class FeedStream:
    """
    One open stream: the changes waiting to be sent to its proxy.

    @ivar openedAt: the monotonic time it was registered with the hub;
        a snapshot read that began at or after it is complete for it.
    """

    def __init__(self, openedAt: float, size: int) -> None:
        self.openedAt = openedAt
        self._queue: queue.Queue[auth_pb2.Change | FeedEnded] = queue.Queue(maxsize=size)
        self._ended = False

    def offer(self, change: auth_pb2.Change) -> bool:
        """
        Queue C{change} without blocking; False when the queue is full (the
        stream is then ended by the hub).
        """
        try:
            self._queue.put_nowait(change)
        except queue.Full:
            return False
        return True

    def end(self, reason: str) -> None:
        """
        End the stream after what is queued; the marker always fits, since
        an ended stream takes nothing more.
        """
        if self._ended:
            return
        self._ended = True
        while True:
            try:
                self._queue.put_nowait(FeedEnded(reason))
                return
            except queue.Full:
                # Make room: what is dropped would never be sent anyway.
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass

    def next(self, timeout: float) -> auth_pb2.Change | FeedEnded | None:
        """
        The next message, the end marker, or None when nothing came within
        C{timeout} seconds.
        """
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None


class ChangeHub:
    """
    Hands the listener's news to every open L{FeedStream}.

    @param monotonic: a monotonic clock in seconds.
    @param maxStreams: how many streams may be open at once.
    """

    log = Logger()

    def __init__(
        self,
        monotonic: Callable[[], float],
        maxStreams: int = 64,
        queueSize: int = DEFAULT_QUEUE_SIZE,
    ) -> None:
        self._monotonic = monotonic
        self._maxStreams = maxStreams
        self._queueSize = queueSize
        self._lock = threading.Lock()
        self._streams: set[FeedStream] = set()
        self._listening = False
        self._stopping = False

    # The listener's side.

    def listenerUp(self) -> None:
        """
        The listener listens (again): streams may open.
        """
        with self._lock:
            self._listening = True

    def listenerDown(self) -> None:
        """
        The listener lost PostgreSQL: end every stream, refuse new ones.
        """
        with self._lock:
            self._listening = False
            streams, self._streams = self._streams, set()
        for stream in streams:
            stream.end("svc-auth lost its connection to PostgreSQL's notifications")

    def tokenChanged(self, tokenID: uuid.UUID) -> None:
        self._broadcast(auth_pb2.Change(token_changed=tokenID.bytes))

    def agentChanged(self, agentID: uuid.UUID) -> None:
        self._broadcast(auth_pb2.Change(agent_changed=agentID.bytes))

    def limitsChanged(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None, row: LimitsRecord | None
    ) -> None:
        """
        The limits row of C{(orgID, agentID)} is now C{row} (None: cleared).
        """
        self._broadcast(limitsChange(orgID, agentID, row))

    def budgetChanged(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None, row: BudgetRecord | None
    ) -> None:
        """
        The budget of C{(orgID, agentID)} is now C{row} (None: cleared).
        """
        self._broadcast(budgetChange(orgID, agentID, row))

    def memorySettingsChanged(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None, row: MemorySettingsRecord | None
    ) -> None:
        """
        The memory settings of C{(orgID, agentID)} are now C{row} (None:
        there is no row).
        """
        self._broadcast(memorySettingsChange(orgID, agentID, row))

    def heartbeat(self) -> None:
        """
        Every change committed before the beat just heard was handed on.
        """
        self._broadcast(_HEARTBEAT)

    def _broadcast(self, change: auth_pb2.Change) -> None:
        with self._lock:
            streams = tuple(self._streams)
        behind = [stream for stream in streams if not stream.offer(change)]
        if behind:
            with self._lock:
                self._streams.difference_update(behind)
            for stream in behind:
                stream.end("the proxy fell too far behind the change feed")
            self.log.warn(
                "Ended {count} change feed stream(s) whose proxy fell behind", count=len(behind)
            )

    # svc-auth's stop.

    def stop(self) -> int:
        """
        svc-auth is stopping: end every stream now and refuse new ones, so
        that the proxies follow another replica's feed (or validate over
        gRPC) instead of holding this one's stop for its whole grace
        period. Returns how many streams were ended.
        """
        with self._lock:
            self._stopping = True
            streams, self._streams = self._streams, set()
        for stream in streams:
            stream.end(STOPPING)
        return len(streams)

    # The streams' side.

    def open(self) -> FeedStream:
        """
        Register a new stream.

        @raise FeedUnavailable: the listener is not listening, or svc-auth
            is stopping.
        @raise TooManyStreams: C{maxStreams} are open.
        """
        with self._lock:
            if self._stopping:
                raise FeedUnavailable(STOPPING)
            if not self._listening:
                raise FeedUnavailable("svc-auth is not hearing PostgreSQL's notifications")
            if len(self._streams) >= self._maxStreams:
                raise TooManyStreams(f"at most {self._maxStreams} change feed streams at once")
            stream = FeedStream(self._monotonic(), self._queueSize)
            self._streams.add(stream)
            return stream

    def close(self, stream: FeedStream) -> None:
        """
        Forget C{stream} (its proxy went away or its call ended).
        """
        with self._lock:
            self._streams.discard(stream)

    def openStreams(self) -> int:
        with self._lock:
            return len(self._streams)


class Snapshots:
    """
    Reads of the token ids that may be accepted, shared by the streams that
    open at about the same time.

    A stream needs a snapshot read that began after it registered with the
    hub (see the module docstring). When many proxies reconnect at once
    (svc-auth just restarted), the reads are serialized and every stream
    that registered before the latest read began takes that one, so a
    burst costs one or two reads, not one per proxy.

    @param read: the blocking read, C{Store.knownTokenIDs}.
    """

    def __init__(self, read: Callable[[], bytes], monotonic: Callable[[], float]) -> None:
        self._read = read
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._latest: tuple[float, bytes] | None = None

    def since(self, moment: float) -> bytes:
        """
        The concatenated 16-byte token ids of a read that began at or after
        C{moment}.
        """
        with self._lock:
            latest = self._latest
            if latest is not None and latest[0] >= moment:
                return latest[1]
            began = self._monotonic()
            ids = self._read()
            self._latest = (began, ids)
            return ids


def snapshotMessages(
    ids: bytes,
    limits: Iterable[LimitsRecord] = (),
    budgets: Iterable[BudgetRecord] = (),
    memorySettings: Iterable[MemorySettingsRecord] = (),
) -> Iterator[auth_pb2.Change]:
    """
    The start of a stream: C{ids} in chunks, then every limits row, every
    budget and every memory settings row, then the snapshot's end.
    """
    chunk = 16 * SNAPSHOT_CHUNK_IDS
    for offset in range(0, len(ids), chunk):
        yield auth_pb2.Change(known_token_ids=ids[offset : offset + chunk])
    for row in limits:
        yield limitsChange(row.orgID, row.agentID, row)
    for budget in budgets:
        yield budgetChange(budget.orgID, budget.agentID, budget)
    for settings in memorySettings:
        yield memorySettingsChange(settings.orgID, settings.agentID, settings)
    yield auth_pb2.Change(snapshot_complete=auth_pb2.SnapshotComplete(token_count=len(ids) // 16))
