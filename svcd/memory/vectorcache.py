"""
A replica's cache of scopes (decisions D13): their vectors
(L{svcd.memory.vectors.ScopeVectors}, by L{ScopeKey}) and their text
indexes (L{svcd.memory.text.ScopeText}, by L{svcd.memory.text.TextKey}).

Bounded. L{VectorCache} holds scopes up to C{maxBytes} (SVC_MEMORY_CACHE_MB),
least recently searched out first, loaded from PostgreSQL on a miss. Its
bytes are the arrays' own (L{svcd.memory.vectors.ScopeVectors.nbytes}): 4
per dimension, 41 per memory for the id, the time, the liveness flag and
the vector's digest and twin (L{svcd.memory.exact}), the spare rows kept
for growth (at most one in 16) and rows of forgotten memories not yet
compacted away (at most one in 16), plus a fixed amount per scope.

Kept current. The change listener (L{svcd.memory.listener}) hands every
change of a memory of a cached scope to L{VectorCache.apply}, so what any
replica adds, changes or deletes is found, or gone, here within a second.
While the listener is not connected, or its lease has run out
(L{svcd.memory.followed}), nothing is cached (searches read the scope
from PostgreSQL each time): losing it costs speed, never correctness. A
notification names no subject: a deletion is applied to the scope the
cache holds the memory's id in (C{_home}, about 100 bytes per cached
memory, not counted in C{maxBytes}), and to the loads in progress of the
memory's agent.

Writers (the listener, a load being installed) hold the cache's lock; a
search takes it only to find its scope, and reads what it found without
it (L{svcd.memory.vectors}, "Threads and locks").
"""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar, cast

import attrs

from svcd.memory.followed import FollowedCache
from svcd.memory.store.cacheloads import CachedRow

# What a scope costs besides its arrays (the Python objects around them).
SCOPE_OVERHEAD_BYTES = 1024
# Rows this replica wrote whose notifications were never heard (a
# connection lost meanwhile) are dropped past this many.
MAX_WRITTEN_ROWS = 10_000


Triple = tuple[uuid.UUID, uuid.UUID, str]


class CacheKey(Protocol):
    """
    What the cache holds an entry by: a key of one organization, agent and
    subject (its I{triple}) that says which memories of it its entry
    holds.
    """

    @property
    def triple(self) -> Triple: ...

    def holds(self, row: CachedRow) -> bool:
        """
        Whether a memory as it now is belongs in this key's entry.
        """


class CachedScope(Protocol):
    """
    An entry of the cache: a scope's vectors
    (L{svcd.memory.vectors.ScopeVectors}) or its text index
    (L{svcd.memory.text.ScopeText}).
    """

    @property
    def nbytes(self) -> int: ...

    @property
    def count(self) -> int:
        """
        The memories it holds.
        """

    def applyChange(self, memoryID: uuid.UUID, row: CachedRow | None) -> None:
        """
        Hold the memory as it now is (C{row}), or no longer (None).
        """

    def memoryKeys(self) -> list[int]:
        """
        The ids, as 128-bit ints, of the memories it holds.
        """


Entry = TypeVar("Entry", bound=CachedScope)


@attrs.frozen
class ScopeKey:
    orgID: uuid.UUID
    agentID: uuid.UUID
    subject: str = attrs.field(repr=False)
    model: str
    dimensions: int

    @property
    def triple(self) -> Triple:
        return (self.orgID, self.agentID, self.subject)

    def holds(self, row: CachedRow) -> bool:
        return row.model == self.model and row.dimensions == self.dimensions


@attrs.define(eq=False)
class _Load:
    """
    A load of one scope key in progress: the changes heard meanwhile, to
    apply to what it read before it is installed. Compared by identity:
    two loads of one key begun at once are equal in value, and the one
    given up must leave the other in place.
    """

    key: CacheKey
    epoch: int
    changes: list[tuple[uuid.UUID, CachedRow | None]] = attrs.Factory(list)


class CacheMetrics:
    """
    What L{VectorCache} reports: a callable per event (Prometheus
    children, or nothing in tests).
    """

    def __init__(
        self,
        hit: Callable[[], None] = lambda: None,
        miss: Callable[[], None] = lambda: None,
        evicted: Callable[[], None] = lambda: None,
        size: Callable[[int, int], None] = lambda bytes_, scopes: None,
        textSize: Callable[[int], None] = lambda bytes_: None,
    ) -> None:
        self.hit = hit
        self.miss = miss
        self.evicted = evicted
        self.size = size
        # Of the size, the bytes of text indexes (L{VectorCache} only).
        self.textSize = textSize


class VectorCache(FollowedCache):
    """
    Scopes' vectors by L{ScopeKey}, and their text indexes by
    L{svcd.memory.text.TextKey} (decisions D13, "Hybrid search"), at most
    C{maxBytes} of them together, least recently searched out first.
    """

    def __init__(self, maxBytes: int, metrics: CacheMetrics | None = None) -> None:
        self.maxBytes = maxBytes
        self._metrics = metrics or CacheMetrics()
        super().__init__()
        self._scopes: collections.OrderedDict[CacheKey, CachedScope] = collections.OrderedDict()
        self._bytes: dict[CacheKey, int] = {}
        self._byTriple: dict[Triple, set[CacheKey]] = {}
        # How many triples of _byTriple each organization and agent has: a
        # notification names a memory's organization and agent, never its
        # subject (sql/0019_notify_ids.sql).
        self._agents: collections.Counter[tuple[uuid.UUID, uuid.UUID]] = collections.Counter()
        # The triple each cached memory is in, by its id's int: where a
        # deletion, named by id alone, is applied. A superset: a memory
        # removed from one key of a triple may stay listed until the
        # triple leaves the cache.
        self._home: dict[int, Triple] = {}
        self._loads: dict[CacheKey, list[_Load]] = {}
        self._syncs: dict[str, threading.Event] = {}
        # Rows this replica inserted, by id, until the listener hears of
        # them (L{expectWritten}).
        self._written: dict[uuid.UUID, CachedRow] = {}

    @property
    def totalBytes(self) -> int:
        with self._lock:
            return sum(self._bytes.values())

    def scopeCount(self) -> int:
        with self._lock:
            return len(self._scopes)

    def _clear(self) -> None:
        self._scopes.clear()
        self._bytes.clear()
        self._byTriple.clear()
        self._agents.clear()
        self._home.clear()
        self._loads.clear()
        self._written.clear()
        self._reportSize()

    # Searches.

    def lookup(self, key: CacheKey) -> CachedScope | None:
        with self._lock:
            self._expireIfLate()
            scope = self._scopes.get(key)
            if scope is not None:
                self._scopes.move_to_end(key)
        if scope is None:
            self._metrics.miss()
        else:
            self._metrics.hit()
        return scope

    def beginLoad(self, key: CacheKey) -> _Load | None:
        """
        A token for a load of C{key} about to read PostgreSQL, or None
        when nothing may be cached now (the listener is down).
        """
        with self._lock:
            self._expireIfLate()
            if not self._listening:
                return None
            load = _Load(key, self._epoch)
            self._loads.setdefault(key, []).append(load)
            self._link(key)
            return load

    def finishLoad(self, load: _Load | None, loaded: Entry) -> Entry:
        """
        Install what a load read, with the changes heard since it began;
        the scope to search (installed, or just for this search when the
        listener went down meanwhile or it is larger than the whole
        cache).
        """
        if load is None:
            return loaded
        with self._lock:
            pending = self._loads.get(load.key, [])
            if load in pending:
                pending.remove(load)
                if not pending:
                    del self._loads[load.key]
            self._forgetTripleIfUnused(load.key)
            if not self._isCurrent(load.epoch):
                return loaded
            for memoryID, row in load.changes:
                loaded.applyChange(memoryID, row)
            installed = self._scopes.get(load.key)
            if installed is not None:
                # Another search loaded it first, and it has been kept
                # current since (the key says it is of the same kind).
                return cast(Entry, installed)
            size = loaded.nbytes
            if size > self.maxBytes:
                return loaded
            self._scopes[load.key] = loaded
            self._bytes[load.key] = size
            self._link(load.key)
            triple = load.key.triple
            for memoryKey in loaded.memoryKeys():
                self._home[memoryKey] = triple
            self._evictBeyond(self.maxBytes, keep=load.key)
            self._reportSize()
            return loaded

    def abandonLoad(self, load: _Load | None) -> None:
        if load is None:
            return
        with self._lock:
            pending = self._loads.get(load.key, [])
            if load in pending:
                pending.remove(load)
                if not pending:
                    del self._loads[load.key]
            self._forgetTripleIfUnused(load.key)

    def _link(self, key: CacheKey) -> None:
        keys = self._byTriple.get(key.triple)
        if keys is None:
            keys = self._byTriple[key.triple] = set()
            self._agents[key.triple[:2]] += 1
        keys.add(key)

    def _forgetTripleIfUnused(self, key: CacheKey, entry: CachedScope | None = None) -> None:
        """
        Forget C{key} unless it is cached or loading, and its triple when
        it was the triple's last key (with the ids of C{entry}, its
        evicted entry, from the index of homes).
        """
        if key in self._scopes or key in self._loads:
            return
        keys = self._byTriple.get(key.triple)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._byTriple[key.triple]
                agent = key.triple[:2]
                self._agents[agent] -= 1
                if self._agents[agent] <= 0:
                    del self._agents[agent]
                if entry is not None:
                    for memoryKey in entry.memoryKeys():
                        if self._home.get(memoryKey) == key.triple:
                            del self._home[memoryKey]

    def _evictBeyond(self, limit: int, keep: CacheKey | None = None) -> None:
        total = sum(self._bytes.values())
        if total <= limit:
            # Before listing the keys: listing an OrderedDict hashes each
            # one (a ScopeKey's hash is Python's, its UUIDs' too), and this
            # runs after every load and every packet the listener applies,
            # with thousands of scopes cached when many organizations write.
            return
        for key in list(self._scopes):
            if total <= limit:
                return
            if key == keep:
                continue
            total -= self._bytes.pop(key)
            entry = self._scopes.pop(key)
            self._forgetTripleIfUnused(key, entry)
            self._metrics.evicted()

    def _reportSize(self) -> None:
        total = sum(self._bytes.values())
        vectors = sum(size for key, size in self._bytes.items() if isinstance(key, ScopeKey))
        self._metrics.size(total, len(self._scopes))
        self._metrics.textSize(total - vectors)

    # A replica's own writes.

    def expectSync(self, nonce: str) -> threading.Event:
        """
        An event set once the listener hears the sync marker C{nonce}
        (L{svcd.memory.listener}): every change committed before the
        marker was sent has then been applied.
        """
        event = threading.Event()
        with self._lock:
            self._syncs[nonce] = event
        return event

    def expectWritten(self, rows: Sequence[CachedRow]) -> None:
        """
        Rows a transaction of this replica inserted, as the listener would
        read them (L{svcd.memory.store.cacheloads.CachedRow}), given before
        it commits: the listener takes each when it hears of its insert
        (L{takeWritten}) instead of reading it back from PostgreSQL. What
        is never heard (the transaction rolled back, the connection lost)
        is forgotten (L{forgetWritten}), or dropped with the cache's other
        state, or past L{MAX_WRITTEN_ROWS}.
        """
        with self._lock:
            if len(self._written) + len(rows) > MAX_WRITTEN_ROWS:
                self._written.clear()
            for row in rows:
                self._written[row.memoryID] = row

    def forgetWritten(self, memoryIDs: Iterable[uuid.UUID]) -> None:
        with self._lock:
            for memoryID in memoryIDs:
                self._written.pop(memoryID, None)

    def takeWritten(self, memoryID: uuid.UUID) -> CachedRow | None:
        """
        The row this replica inserted as C{memoryID}, if it said so
        (L{expectWritten}); forgotten here either way.
        """
        with self._lock:
            return self._written.pop(memoryID, None)

    def heardSync(self, nonce: str) -> None:
        with self._lock:
            event = self._syncs.pop(nonce, None)
        if event is not None:
            event.set()

    def forgetSync(self, nonce: str) -> None:
        with self._lock:
            self._syncs.pop(nonce, None)

    # The listener's changes.

    def watches(self, orgID: uuid.UUID, agentID: uuid.UUID, subject: str) -> bool:
        """
        Whether a scope key of this organization, agent and subject is
        cached or being loaded: only then is a change worth reading.
        """
        with self._lock:
            self._expireIfLate()
            return (orgID, agentID, subject) in self._byTriple

    def watchesAgent(self, orgID: uuid.UUID, agentID: uuid.UUID) -> bool:
        """
        Whether a scope key of this organization and agent, any subject,
        is cached or being loaded: a notification names no subject, so
        only then is a change worth reading.
        """
        with self._lock:
            self._expireIfLate()
            return (orgID, agentID) in self._agents

    def apply(
        self,
        changes: Sequence[tuple[Triple, uuid.UUID, CachedRow | None]],
    ) -> None:
        """
        Apply changes heard by the listener, in order: each names a
        memory's organization, agent and subject, its id, and its row as
        it is now (None: deleted). A memory leaves every key of its
        subject that does not hold it (L{CacheKey.holds}: the vectors of
        another model or size), and is added or replaced in those that do
        (its model's vectors, and the subject's text index).
        """
        with self._lock:
            self._expireIfLate()
            touched = False
            for triple, memoryID, row in changes:
                touched = self._applyOne(triple, memoryID, row) or touched
            if touched:
                self._evictBeyond(self.maxBytes)
                self._reportSize()

    def applyHeard(
        self,
        changes: Sequence[tuple[uuid.UUID, uuid.UUID, uuid.UUID, CachedRow | None]],
    ) -> None:
        """
        Apply changes heard by the listener, in order, each named as a
        notification names it (sql/0019_notify_ids.sql): a memory's
        organization, agent and id, with its row as it is now (None:
        deleted). The memory leaves the triple it is cached in, when that
        is not its triple now, and every load in progress of the agent
        when it is gone (a load reads ids this cache has not seen yet);
        it is then applied to its triple as L{apply} does.
        """
        with self._lock:
            self._expireIfLate()
            touched = False
            for orgID, agentID, memoryID, row in changes:
                home = self._home.get(memoryID.int)
                now = None if row is None else (orgID, row.agentID, row.subject)
                if home is not None and home != now:
                    touched = self._applyOne(home, memoryID, None) or touched
                if now is not None:
                    touched = self._applyOne(now, memoryID, row) or touched
                    continue
                for key, loads in self._loads.items():
                    if key.triple[:2] == (orgID, agentID) and key.triple != home:
                        for load in loads:
                            load.changes.append((memoryID, None))
            if touched:
                self._evictBeyond(self.maxBytes)
                self._reportSize()

    def _applyOne(self, triple: Triple, memoryID: uuid.UUID, row: CachedRow | None) -> bool:
        """
        L{apply}'s change of one memory of C{triple} (under C{_lock});
        whether a cached scope's size changed.
        """
        keys = self._byTriple.get(triple)
        if not keys:
            return False
        touched = False
        for key in keys:
            change = row if row is not None and key.holds(row) else None
            for load in self._loads.get(key, ()):
                load.changes.append((memoryID, change))
            scope = self._scopes.get(key)
            if scope is not None:
                scope.applyChange(memoryID, change)
                size = scope.nbytes
                if size != self._bytes[key]:
                    self._bytes[key] = size
                    touched = True
        if row is not None:
            # Only where an entry holds it: a load's ids are listed when it
            # is installed (L{finishLoad}).
            if any(key in self._scopes for key in keys):
                self._home[memoryID.int] = triple
        elif self._home.get(memoryID.int) == triple:
            del self._home[memoryID.int]
        return touched
