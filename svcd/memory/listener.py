"""
svc-memory's change listener: one thread with its own PostgreSQL
connection, LISTENing on svc_memory_changes (sql/0009_memory.sql), keeping
the replica's caches, of vectors (L{svcd.memory.vectors.VectorCache}) and
of records (L{svcd.memory.recordcache.RecordCache}), current with what
every replica, and svcctl, adds, changes and deletes.

Built like svc-auth's (L{svcd.auth.listener}): it tells the cache when it
starts and stops hearing changes (the cache keeps nothing while it does
not), and about every C{beatInterval} seconds it sends itself a beat on
the channel; a connection whose beats stop coming back is presumed dead
and made anew.

A notification names a memory and its scope, never its content. Only a
change of a scope this replica caches (or is loading) in either cache is
read: the rows of one packet of notifications in one query per
organization, in that organization's context, as svc_memory_app, each
row with its vector and its record (L{svcd.memory.store.CachedRow}). The
records are applied first: a memory is never ranked by the vectors before
its record is there to answer with.

A replica's own writes wait for their changes to be applied here before
they are answered (read your writes): the writer sends a sync marker,
C{sync:<nonce>}, after its commit, and since PostgreSQL delivers
notifications in commit order, once the marker is heard every change of
the write has been applied (L{svcd.memory.search.Searcher.settle}).

It also counts, every C{waitingInterval} seconds, the observations
waiting for the worker (svc_memory_observations_waiting), forgets
processed observations older than C{doneRetention}
(sql/0014_observations_done.sql) and deletes observations failed for good
longer ago than C{failedRetention} (sql/0017_forgetting.sql): queries that
need a connection and a thread, which this one has.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable

import psycopg

from svcd.common.ids import parseUUID
from svcd.common.listening import BeatsStopped, ListeningThread
from svcd.memory.recordcache import RecordCache
from svcd.memory.records import MemoryRecord
from svcd.memory.store import APPLICATION_ROLE, CachedRow, MemoryStore, StoreUnavailable
from svcd.memory.vectors import VectorCache

CHANNEL = "svc_memory_changes"

Triple = tuple[uuid.UUID, uuid.UUID, str]


def parsePayload(payload: str) -> tuple[str, Triple, uuid.UUID] | None:
    """
    C{<op>:<org_id>:<agent_id>:<id>:<subject>} as its parts, or None when
    it is not one (the subject comes last: it may hold colons).
    """
    parts = payload.split(":", 4)
    if len(parts) != 5 or parts[0] not in ("insert", "update", "delete"):
        return None
    orgID, agentID, memoryID = (parseUUID(each) for each in parts[1:4])
    if orgID is None or agentID is None or memoryID is None:
        return None
    return parts[0], (orgID, agentID, parts[4]), memoryID


class MemoryListener(ListeningThread[MemoryStore]):
    """
    @param records: the cache of records kept current beside the vectors,
        if any.
    @param waiting: told the count of waiting observations now and then.
    @param doneRetention: how long, in seconds, a processed observation's
        request id is remembered (SVC_MEMORY_DONE_RETENTION); None: not
        pruned here.
    @param failedRetention: how long, in seconds, an observation failed for
        good is kept (SVC_MEMORY_FAILED_RETENTION); None: not pruned here.
    """

    channel = CHANNEL
    role = APPLICATION_ROLE
    applicationName = "svc-memory-listener"
    threadName = "svc-memory-change-listener"
    lostWarning = (
        "Memory change listener lost its database connection ({error});"
        " searches read PostgreSQL until it is back"
    )
    failures = (*ListeningThread.failures, StoreUnavailable)

    def __init__(
        self,
        dsn: str,
        cache: VectorCache,
        waiting: Callable[[int], None] = lambda count: None,
        records: RecordCache | None = None,
        reconnectDelay: float = 1.0,
        beatInterval: float = 0.25,
        beatTimeout: float = 5.0,
        waitingInterval: float = 5.0,
        doneRetention: float | None = None,
        failedRetention: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(dsn, reconnectDelay)
        self._cache = cache
        self._records = records
        self._waiting = waiting
        self._beatInterval = beatInterval
        self._beatTimeout = beatTimeout
        self._waitingInterval = waitingInterval
        self._doneRetention = doneRetention
        self._failedRetention = failedRetention
        self._monotonic = monotonic

    def _begin(self, connection: psycopg.Connection[object]) -> MemoryStore:
        # After LISTEN: every change committed from now on is heard, so the
        # caches may keep what they load.
        self._cache.listening()
        if self._records is not None:
            self._records.listening()
        self.log.info("Listening for memory changes")
        return MemoryStore(lambda: contextlib.nullcontext(connection))

    def _lost(self) -> None:
        self._cache.notListening()
        if self._records is not None:
            self._records.notListening()

    def _watches(self, triple: Triple) -> bool:
        return self._cache.watches(*triple) or (
            self._records is not None and self._records.watches(*triple)
        )

    def _drain(self, connection: psycopg.Connection[object], store: MemoryStore) -> None:
        """
        Beat, count the waiting observations now and then, and apply each
        packet of notifications, until asked to stop or the connection
        fails. (See L{svcd.auth.listener.ChangeListener._drain} for why
        each C{notifies()} call is read whole before anything is queried.)
        """
        nonce = uuid.uuid4().hex
        number = 0
        lastBack = nextBeat = nextCount = self._monotonic()
        while not self._stopping.is_set():
            now = self._monotonic()
            if now >= nextBeat:
                number += 1
                nextBeat = now + self._beatInterval
                connection.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"beat:{nonce}:{number}"))
            if now >= nextCount:
                nextCount = now + self._waitingInterval
                self._waiting(store.observationsWaiting())
                if self._doneRetention is not None:
                    store.pruneDone(self._doneRetention)
                if self._failedRetention is not None:
                    store.pruneFailed(self._failedRetention)
            wait = max(0.0, min(nextBeat, nextCount) - self._monotonic())
            changes: list[tuple[str, Triple, uuid.UUID]] = []
            syncs: list[str] = []
            for notification in list(connection.notifies(timeout=wait, stop_after=1)):
                payload = notification.payload
                if payload.startswith("sync:"):
                    syncs.append(payload[len("sync:") :])
                    continue
                if payload.startswith("beat:"):
                    if payload.startswith(f"beat:{nonce}:"):
                        lastBack = self._monotonic()
                    continue
                parsed = parsePayload(payload)
                if parsed is None:
                    self.log.warn("Ignoring a malformed memory change notification")
                    continue
                changes.append(parsed)
            if changes:
                self._apply(changes, store)
            # After the changes heard before them, which are applied now.
            for sync in syncs:
                self._cache.heardSync(sync)
            if self._monotonic() - lastBack > self._beatTimeout:
                raise BeatsStopped(f"no beat came back for {self._beatTimeout}s")

    def _apply(self, changes: list[tuple[str, Triple, uuid.UUID]], store: MemoryStore) -> None:
        """
        Hand one packet's changes of watched scopes to the caches, each
        memory as it is now: a deleted one as gone (ids are never used
        again), an added or changed one read anew (gone if deleted since).
        The records first, then the vectors (see the module's docstring).
        """
        watched = [each for each in changes if self._watches(each[1])]
        if not watched:
            return
        deleted = {memoryID for operation, _, memoryID in watched if operation == "delete"}
        toRead: dict[uuid.UUID, set[uuid.UUID]] = {}
        for _, triple, memoryID in watched:
            if memoryID not in deleted:
                toRead.setdefault(triple[0], set()).add(memoryID)
        rows: dict[uuid.UUID, CachedRow] = {}
        for orgID, memoryIDs in toRead.items():
            rows.update(store.rowsForCache(orgID, memoryIDs))
        if self._records is not None:
            self._records.apply(
                [
                    (triple, memoryID, None if memoryID in deleted else _recordOf(rows, memoryID))
                    for _, triple, memoryID in watched
                ]
            )
        self._cache.apply(
            [
                (triple, memoryID, None if memoryID in deleted else rows.get(memoryID))
                for _, triple, memoryID in watched
            ]
        )


def _recordOf(rows: dict[uuid.UUID, CachedRow], memoryID: uuid.UUID) -> MemoryRecord | None:
    row = rows.get(memoryID)
    return None if row is None else row.record
