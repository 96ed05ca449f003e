"""
Exact vector search over a replica's cache of scopes (decisions D13).

What is cached. A I{scope key} is an organization, agent, subject, the
embedding model and the number of dimensions: a search compares a query
only with the memories that model made at that size. Each cached scope is
a L{ScopeVectors}: one contiguous float32 matrix of the memories' vectors,
each row scaled to length 1, beside their ids (two uint64 columns) and
creation times (int64 microseconds). A search is then one BLAS
matrix-vector product (the cosine similarity of every memory at once),
one partition for the top k and one small sort: no approximate index, so
recall is 1.0, and the time depends on the scope's size alone, never on
other tenants' data.

Bounded. L{VectorCache} holds scopes up to C{maxBytes} (SVC_MEMORY_CACHE_MB),
least recently searched out first, loaded from PostgreSQL on a miss. Its
bytes are the arrays' own (L{ScopeVectors.nbytes}): 4 per dimension, 41
per memory for the id, the time, the liveness flag and the vector's
digest and twin (L{svcd.memory.exact}), the spare rows
kept for growth (at most one in 16) and rows of forgotten memories not
yet compacted away (at most one in 16), plus a fixed amount per scope.

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

Threads and locks. Searches run on grpcio's threads, the listener on its
own, and neither waits for the other:

 - writers (the listener, a load being installed) hold the cache's lock,
   one at a time, for the time of a few row copies; they never change a
   row a search may be reading. A memory added goes into a spare row past
   the end and becomes visible when the scope's I{view} (arrays and row
   count, one immutable object) is replaced; a memory changed or deleted
   has its row marked dead (one byte) and its vector overwritten with
   zeros at once (decisions D13, amended: not at the next compaction),
   and a changed one is added anew. Growing or compacting makes new
   arrays and a new view.
 - a search takes the cache's lock only to find the scope, then reads the
   view it found without any lock: numpy's product releases the GIL, so
   searches of several scopes, or of one, run on several cores, and a
   search never stalls a notification (nor the reverse). A search that
   raced a delete may rank the deleted memory; the memories are then read
   from PostgreSQL by id, in the scope, and a deleted one is not there.
"""

from __future__ import annotations

import collections
import math
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar, cast

import attrs
import numpy
import numpy.typing

from svcd.memory.exact import (
    Digests,
    Indices,
    bestTied,
    digestOf,
    digestsOf,
    exactOfTwins,
    exactScores,
    handTwinOn,
    twinAmong,
    twinsOf,
)
from svcd.memory.exact import normalised as normalised
from svcd.memory.exact import normalisedRows as normalisedRows
from svcd.memory.followed import FollowedCache
from svcd.memory.ranking import MIN_BLOCK_ROWS as MIN_BLOCK_ROWS
from svcd.memory.ranking import Hit as Hit
from svcd.memory.ranking import Ranking as Ranking
from svcd.memory.ranking import parallelProduct as parallelProduct
from svcd.memory.ranking import rankingOf as rankingOf
from svcd.memory.store.cacheloads import CachedRow, ScopeRows

Floats = numpy.typing.NDArray[numpy.float32]

# What a scope costs besides its arrays (the Python objects around them).
SCOPE_OVERHEAD_BYTES = 1024
# Bytes of one memory besides its vector: two uint64 halves of the id, an
# int64 creation time, a bool, and its vector's digest and twin
# (svcd.memory.exact).
ROW_EXTRA_BYTES = 8 + 8 + 8 + 1 + 8 + 8


Triple = tuple[uuid.UUID, uuid.UUID, str]

_NEVER = numpy.float32(-numpy.inf)
# How far apart, per dimension, the float32 products of two unit vectors
# with a query may rank them wrongly: each is within about n * 2**-24 of
# its exact value (float32's unit roundoff, any order of summation), so
# two are within twice that of their exact order; 2**-22 leaves room.
_PRODUCT_ROUNDING = 2.0**-22
# Up to this many candidates of a search are ordered as tuples in Python;
# more (scores tied at the k-th) by numpy (L{svcd.memory.exact.bestTied}).
_ORDERED_IN_PYTHON = 64


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
    An entry of the cache: a scope's vectors (L{ScopeVectors}) or its text
    index (L{svcd.memory.text.ScopeText}).
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


def _split(memoryID: uuid.UUID) -> tuple[int, int]:
    value = memoryID.int
    return value >> 64, value & 0xFFFF_FFFF_FFFF_FFFF


@attrs.frozen
class _View:
    """
    What a search reads of a scope: arrays and how many of their rows are
    filled. Never changed once published, except that a row may be marked
    dead in C{alive}.
    """

    matrix: Floats
    high: numpy.typing.NDArray[numpy.uint64]
    low: numpy.typing.NDArray[numpy.uint64]
    created: numpy.typing.NDArray[numpy.int64]
    alive: numpy.typing.NDArray[numpy.bool_]
    digests: Digests
    twins: Indices
    count: int
    dead: int

    @property
    def capacity(self) -> int:
        return int(self.matrix.shape[0])


def _emptyView(capacity: int, dimensions: int) -> _View:
    return _View(
        matrix=numpy.empty((capacity, dimensions), dtype=numpy.float32),
        high=numpy.empty(capacity, dtype=numpy.uint64),
        low=numpy.empty(capacity, dtype=numpy.uint64),
        created=numpy.empty(capacity, dtype=numpy.int64),
        alive=numpy.zeros(capacity, dtype=numpy.bool_),
        digests=numpy.zeros(capacity, dtype=numpy.int64),
        twins=numpy.zeros(capacity, dtype=numpy.intp),
        count=0,
        dead=0,
    )


def _roomFor(rows: int) -> int:
    """
    The capacity to allocate for C{rows} rows: one spare in 16, so growth
    copies rarely and the spare rows cost at most 1/16 of the cache.
    """
    return rows + rows // 16 + 1


class ScopeVectors:
    """
    The vectors of one scope key. L{search} may run on any thread at any
    time; the other methods are called under L{VectorCache}'s lock.
    """

    def __init__(self, dimensions: int, view: _View) -> None:
        self.dimensions = dimensions
        self._view = view

    @classmethod
    def fromRows(cls, dimensions: int, rows: ScopeRows) -> ScopeVectors:
        """
        A scope loaded from PostgreSQL: vectors normalised in one pass.
        """
        count = rows.count
        view = _emptyView(_roomFor(count), dimensions)
        if count:
            matrix = numpy.frombuffer(rows.vectors, dtype="<f4").reshape(count, dimensions)
            view.matrix[:count] = normalisedRows(matrix)
            ids = numpy.frombuffer(rows.ids, dtype=">u8").reshape(count, 2)
            view.high[:count] = ids[:, 0]
            view.low[:count] = ids[:, 1]
            view.created[:count] = numpy.asarray(rows.createdMicros, dtype=numpy.int64)
            view.alive[:count] = True
            view.digests[:count] = digestsOf(view.matrix[:count])
            view.twins[:count] = twinsOf(view.matrix[:count], view.digests[:count])
        return cls(dimensions, attrs.evolve(view, count=count))

    @property
    def count(self) -> int:
        """
        The memories it holds (live rows).
        """
        view = self._view
        return view.count - view.dead

    @property
    def nbytes(self) -> int:
        view = self._view
        arrays = (
            view.matrix,
            view.high,
            view.low,
            view.created,
            view.alive,
            view.digests,
            view.twins,
        )
        return sum(int(each.nbytes) for each in arrays) + SCOPE_OVERHEAD_BYTES

    def search(
        self,
        query: Floats,
        k: int,
        minScore: float | None = None,
        product: Callable[[Floats, Floats], Floats] | None = None,
    ) -> list[Hit]:
        """
        L{rank}'s memories as L{Hit}s.
        """
        return self.rank(query, k, minScore, product).hits()

    def rank(
        self,
        query: Floats,
        k: int,
        minScore: float | None = None,
        product: Callable[[Floats, Floats], Floats] | None = None,
    ) -> Ranking:
        """
        The C{k} memories most similar to C{query} (normalised), best
        first; ties (equal scores) newest first, then by id, descending.
        Every memory whose score reaches the k-th is considered before the
        cut, so ties at the edge are broken by age, never by position.

        @param product: computes C{matrix @ query} (L{parallelProduct}
            splits a large one over threads); numpy's own by default.
        """
        view = self._view
        count = view.count
        if count == 0 or k < 1:
            return Ranking([], [], [])
        matrix = view.matrix[:count]
        scores = matrix @ query if product is None else product(matrix, query)
        # A forgotten memory's row ranks below every score (-1 at least),
        # and is dropped below. Always masked, never only when the view
        # counts dead rows: a row is marked dead in the arrays before the
        # view that counts it is published, and this view may be older.
        scores = numpy.where(view.alive[:count], scores, _NEVER)
        if count > k:
            # The k-th largest score; every row within the product's
            # rounding of it is a candidate: BLAS sums a row in an order
            # that depends on where the row sits (the same vector scores a
            # few ulps apart at two places), so the candidates are scored
            # again below, the same way wherever they sit.
            threshold = numpy.partition(scores, count - k)[count - k]
            margin = query.shape[0] * _PRODUCT_ROUNDING
            candidates = numpy.flatnonzero((scores >= threshold - margin) & view.alive[:count])
        else:
            candidates = numpy.flatnonzero(view.alive[:count])
        if len(candidates) <= _ORDERED_IN_PYTHON:
            exact = exactScores(matrix, candidates, query)
            # The few candidates (k, unless scores tie at the edge) ordered
            # in Python, which for a dozen rows is quicker than numpy's
            # sorts and their fancy indexing: best first, then newest, then
            # by id, all descending.
            rows = sorted(
                zip(
                    exact.tolist(),
                    view.created[candidates].tolist(),
                    view.high[candidates].tolist(),
                    view.low[candidates].tolist(),
                    strict=True,
                ),
                reverse=True,
            )[:k]
        else:
            # Many candidates: rows of equal vectors, scored once (their
            # twins), then ordered by numpy.
            exact = exactOfTwins(matrix, view.twins[:count], candidates, query)
            rows = bestTied(
                exact,
                view.created[candidates],
                view.high[candidates],
                view.low[candidates],
                k,
            )
        # The k best, then those at or above the floor: the same as the k
        # best of those at or above it.
        floor = -math.inf if minScore is None else float(numpy.float32(minScore))
        kept = [row for row in rows if row[0] >= floor]
        return Ranking(
            [(high << 64) | low for _, _, high, low in kept],
            [score for score, _, _, _ in kept],
            [created for _, created, _, _ in kept],
        )

    # Writers, under the cache's lock.

    def applyChange(self, memoryID: uuid.UUID, row: CachedRow | None) -> None:
        if row is None:
            self.remove([memoryID])
        else:
            self.upsert(memoryID, row.createdMicros, normalised(row.vector))

    def _find(self, memoryID: uuid.UUID) -> int | None:
        view = self._view
        high, low = _split(memoryID)
        count = view.count
        found = numpy.flatnonzero(
            (view.high[:count] == numpy.uint64(high))
            & (view.low[:count] == numpy.uint64(low))
            & view.alive[:count]
        )
        return int(found[0]) if found.size else None

    def remove(self, memoryIDs: Iterable[uuid.UUID]) -> int:
        """
        Mark the rows of these memories dead; how many were here.
        """
        removed = 0
        for memoryID in memoryIDs:
            row = self._find(memoryID)
            if row is not None:
                self._view.alive[row] = False
                # Rows of the same bits that took this one as their twin
                # (svcd.memory.exact) take the first of them instead,
                # before the bits go: a twin is where their scores come
                # from.
                handTwinOn(self._view.twins[: self._view.count], row)
                # Overwritten at once (D13 amended), not left in the
                # arrays until a compaction: a search reading this view
                # masks the row as dead, and one that read it alive before
                # scores it 0 and finds no record in PostgreSQL.
                self._view.matrix[row] = 0.0
                self._view = attrs.evolve(self._view, dead=self._view.dead + 1)
                removed += 1
        if removed:
            self._compactIfWasteful()
        return removed

    def upsert(self, memoryID: uuid.UUID, createdMicros: int, vector: Floats) -> None:
        """
        Hold this memory with this (normalised) vector: its old row, if
        any, marked dead, and a new row appended.
        """
        self.remove([memoryID])
        view = self._view
        if view.count == view.capacity:
            view = self._copied(view, _roomFor(view.count - view.dead + 1))
        row = view.count
        high, low = _split(memoryID)
        view.twins[row] = twinAmong(
            view.matrix[:row], view.digests[:row], view.twins[:row], vector, row
        )
        view.digests[row] = digestOf(vector)
        view.matrix[row] = vector
        view.high[row] = high
        view.low[row] = low
        view.created[row] = createdMicros
        view.alive[row] = True
        # Published last: a search sees the row only once it is written.
        self._view = attrs.evolve(view, count=row + 1)

    def memoryKeys(self) -> list[int]:
        view = self._view
        live = numpy.flatnonzero(view.alive[: view.count])
        return [
            (high << 64) | low
            for high, low in zip(view.high[live].tolist(), view.low[live].tolist(), strict=True)
        ]

    def _compactIfWasteful(self) -> None:
        view = self._view
        if view.dead > max(16, (view.count - view.dead) // 16):
            self._view = self._copied(view, _roomFor(view.count - view.dead))

    def _copied(self, view: _View, capacity: int) -> _View:
        """
        The live rows of C{view} in new arrays of C{capacity} rows, in
        their order; the old arrays stay as they are for searches still
        reading them.
        """
        live = numpy.flatnonzero(view.alive[: view.count])
        fresh = _emptyView(max(capacity, live.size), self.dimensions)
        size = int(live.size)
        fresh.matrix[:size] = view.matrix[live]
        fresh.high[:size] = view.high[live]
        fresh.low[:size] = view.low[live]
        fresh.created[:size] = view.created[live]
        fresh.alive[:size] = True
        fresh.digests[:size] = view.digests[live]
        fresh.twins[:size] = twinsOf(fresh.matrix[:size], fresh.digests[:size])
        return attrs.evolve(fresh, count=size, dead=0)


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
