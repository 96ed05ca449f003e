"""
svc-memory's change listener: one thread with its own PostgreSQL
connection, LISTENing on svc_memory_changes (sql/0009_memory.sql), keeping
the replica's caches, of vectors (L{svcd.memory.vectorcache.VectorCache}) and
of records (L{svcd.memory.recordcache.RecordCache}), current with what
every replica, and svcctl, adds, changes and deletes.

Built like svc-auth's (L{svcd.auth.listener}): it tells the caches when
it starts and stops hearing changes (they keep nothing while it does
not), and every C{beatInterval} seconds (0.2) it sends itself a beat on
the channel. A beat that comes back renews the caches' lease until its
sending time plus C{lease} (one second, L{svcd.memory.followed}); a
connection whose beats stop coming back is given up when the lease runs
out, and made anew. Decisions D13, amended: "a replica that cannot
listen says so": any failure (the database's, a bug's) empties the
caches and makes /ready 503 (L{svcd.memory.assembly.listenerCheck}) until
it listens again, and a silent connection is noticed within the second,
by the lease, even while this thread is blocked.

Why beats and a lease rather than TCP keepalives alone: keepalives notice
a dead peer in seconds (5 + 3 x 2 here, never under one without tuning
the kernel's granularity), not a live server that stopped answering (a
frozen process, a full disk), and not this thread stuck in a read; a beat
is one NOTIFY of about 50 bytes on the connection every 0.2 s (a few
microseconds of the server per beat, five a second per replica), and the
lease is read by the caches themselves, so the second holds whatever the
thread does.

A notification names a memory by its organization, agent and id, never
its subject nor its content (sql/0019_notify_ids.sql: subjects are
personal data). Only a change of an agent this replica caches (or is
loading) a scope of, in either cache, is read: the rows of one packet of
notifications in one transaction, one query per organization in that
organization's context, as svc_memory_app, each row with its subject, its
vector and its record (L{svcd.memory.store.cacheloads.CachedRow}). A
deleted memory's scope is the one the caches hold its id in (their index
of homes). The records are applied first: a memory is never ranked by the
vectors before its record is there to answer with.

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

import collections
import contextlib
import time
import uuid
from collections.abc import Callable

import psycopg

from svcd.common.ids import parseUUID
from svcd.common.listening import BeatsStopped, ListeningThread
from svcd.memory.followed import LEASE_SECONDS, FollowedCache
from svcd.memory.recordcache import RecordCache
from svcd.memory.store import MemoryStore
from svcd.memory.store.base import APPLICATION_ROLE, StoreUnavailable
from svcd.memory.vectorcache import VectorCache

CHANNEL = "svc_memory_changes"

# A change as a notification names it: the operation, the memory's
# organization, agent and id.
Change = tuple[str, uuid.UUID, uuid.UUID, uuid.UUID]


def parsePayload(payload: str) -> Change | None:
    """
    C{<op>:<org_id>:<agent_id>:<id>} as its parts (sql/0019_notify_ids.sql),
    or None when it is not one. A payload of an earlier release's trigger
    (sql/0009_memory.sql), which added C{:<subject>}, is read the same way,
    its subject ignored: a replica of this release may run before the
    migration.
    """
    parts = payload.split(":", 4)
    if len(parts) not in (4, 5) or parts[0] not in ("insert", "update", "delete"):
        return None
    orgID, agentID, memoryID = (parseUUID(each) for each in parts[1:4])
    if orgID is None or agentID is None or memoryID is None:
        return None
    return parts[0], orgID, agentID, memoryID


class MemoryListener(ListeningThread[MemoryStore]):
    """
    @param records: the cache of records kept current beside the vectors,
        if any.
    @param waiting: told the count of waiting observations now and then.
    @param beatInterval: how often, in seconds, a beat is sent.
    @param lease: how long, in seconds from its sending, a beat that came
        back vouches for the caches (L{svcd.memory.followed}); a
        connection none of whose beats came back for that long is given
        up.
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
        "Memory change listener failed ({error}); its caches are emptied and"
        " /ready answers 503 until it listens again; searches read PostgreSQL"
    )
    failures = (*ListeningThread.failures, StoreUnavailable)

    def __init__(
        self,
        dsn: str,
        cache: VectorCache,
        waiting: Callable[[int], None] = lambda count: None,
        records: RecordCache | None = None,
        reconnectDelay: float = 1.0,
        beatInterval: float = 0.2,
        lease: float = LEASE_SECONDS,
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
        self._lease = lease
        self._waitingInterval = waitingInterval
        self._doneRetention = doneRetention
        self._failedRetention = failedRetention
        self._monotonic = monotonic

    def _caches(self) -> list[FollowedCache]:
        return [self._cache] if self._records is None else [self._cache, self._records]

    def _begin(self, connection: psycopg.Connection[object]) -> MemoryStore:
        # After LISTEN: every change committed from now on is heard, so the
        # caches may keep what they load, for one lease unless a beat
        # comes back.
        until = self._monotonic() + self._lease
        for cache in self._caches():
            cache.listening(until)
        self.log.info("Listening for memory changes")
        return MemoryStore(lambda: contextlib.nullcontext(connection))

    def _lost(self) -> None:
        for cache in self._caches():
            cache.notListening()

    def _watchesAgent(self, orgID: uuid.UUID, agentID: uuid.UUID) -> bool:
        return self._cache.watchesAgent(orgID, agentID) or (
            self._records is not None and self._records.watchesAgent(orgID, agentID)
        )

    def _drain(self, connection: psycopg.Connection[object], store: MemoryStore) -> None:
        """
        Beat, count the waiting observations now and then, and apply each
        packet of notifications, until asked to stop or the connection
        fails. (See L{svcd.auth.listener.ChangeListener._drain} for why
        each C{notifies()} call is read whole before anything is queried.)

        Each beat's sending time is kept until it comes back: the caches'
        lease is then renewed until that time plus C{lease}, after the
        changes heard before it were applied. No wait outlasts the lease:
        a connection whose beats stop coming back is given up when the
        lease runs out (L{BeatsStopped}).
        """
        nonce = uuid.uuid4().hex
        number = 0
        sent: dict[int, float] = {}
        now = self._monotonic()
        until = now + self._lease
        nextBeat = nextCount = now
        while not self._stopping.is_set():
            now = self._monotonic()
            if now >= until:
                raise BeatsStopped(f"no beat came back within {self._lease}s")
            if now >= nextBeat:
                number += 1
                nextBeat = now + self._beatInterval
                sent[number] = now
                connection.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"beat:{nonce}:{number}"))
                self._stayOnTarget(connection)
            if now >= nextCount:
                nextCount = now + self._waitingInterval
                self._waiting(store.observationsWaiting())
                if self._doneRetention is not None:
                    store.pruneDone(self._doneRetention)
                if self._failedRetention is not None:
                    store.pruneFailed(self._failedRetention)
            wait = max(0.0, min(nextBeat, nextCount, until) - self._monotonic())
            changes: list[Change] = []
            syncs: list[str] = []
            back: float | None = None
            for notification in list(connection.notifies(timeout=wait, stop_after=1)):
                payload = notification.payload
                if payload.startswith("sync:"):
                    syncs.append(payload[len("sync:") :])
                    continue
                if payload.startswith("beat:"):
                    if payload.startswith(f"beat:{nonce}:"):
                        beat = _beatNumber(payload)
                        if beat in sent:
                            back = sent[beat]
                            for earlier in [each for each in sent if each <= beat]:
                                del sent[earlier]
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
            if back is not None:
                self._heard()
                until = back + self._lease
                for cache in self._caches():
                    cache.heard(until)

    def _apply(self, changes: list[Change], store: MemoryStore) -> None:
        """
        Hand one packet's changes of watched agents to the caches, each
        memory as it is now: a deleted one as gone (ids are never used
        again), an added or changed one read anew (gone if deleted since),
        its subject read with it (a notification names none). The records
        first, then the vectors (see the module's docstring).
        """
        # The rows this replica inserted, as it wrote them: taken for
        # every insert heard, watched or not, so none is left behind.
        written = {
            memoryID: row
            for operation, _, _, memoryID in changes
            if operation == "insert"
            for row in (self._cache.takeWritten(memoryID),)
            if row is not None
        }
        watched = [each for each in changes if self._watchesAgent(each[1], each[2])]
        if not watched:
            return
        # A row written here is as it is now unless the packet names it
        # again (a change since its insert): then it is read.
        named = collections.Counter(memoryID for _, _, _, memoryID in watched)
        toRead: dict[uuid.UUID, set[uuid.UUID]] = {}
        for operation, orgID, _, memoryID in watched:
            if operation == "delete":
                continue
            if memoryID in written and named[memoryID] == 1:
                continue
            toRead.setdefault(orgID, set()).add(memoryID)
        rows = store.rowsForCacheByOrganization(toRead) if toRead else {}
        for memoryID, row in written.items():
            if named[memoryID] == 1:
                rows[memoryID] = row
        # A deletion is applied as one (a memory whose subject changed is
        # announced deleted, then updated: it leaves its old scope first).
        now = [
            (orgID, agentID, memoryID, None if operation == "delete" else rows.get(memoryID))
            for operation, orgID, agentID, memoryID in watched
        ]
        if self._records is not None:
            self._records.applyHeard(
                [
                    (orgID, agentID, memoryID, None if row is None else row.record)
                    for orgID, agentID, memoryID, row in now
                ]
            )
        self._cache.applyHeard(now)


def _beatNumber(payload: str) -> int:
    try:
        return int(payload.rsplit(":", 1)[1])
    except ValueError:
        return -1
