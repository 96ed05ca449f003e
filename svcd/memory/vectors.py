"""
Exact vector search over one cached scope (decisions D13); the cache that
holds the scopes is L{svcd.memory.vectorcache}.

What is cached. A I{scope key} (L{svcd.memory.vectorcache.ScopeKey}) is
an organization, agent, subject, the embedding model and the number of
dimensions: a search compares a query only with the memories that model
made at that size. Each cached scope is a L{ScopeVectors}: one contiguous
float32 matrix of the memories' vectors, each row scaled to length 1,
beside their ids (two uint64 columns) and creation times (int64
microseconds). A search is then one BLAS
matrix-vector product (the cosine similarity of every memory at once),
one partition for the top k and one small sort: no approximate index, so
recall is 1.0, and the time depends on the scope's size alone, never on
other tenants' data.

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

import math
import uuid
from collections.abc import Callable, Iterable

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
    normalised,
    normalisedRows,
    twinAmong,
    twinsOf,
)
from svcd.memory.ranking import Hit, Ranking
from svcd.memory.store.cacheloads import CachedRow, ScopeRows
from svcd.memory.vectorcache import SCOPE_OVERHEAD_BYTES

Floats = numpy.typing.NDArray[numpy.float32]

# Bytes of one memory besides its vector: two uint64 halves of the id, an
# int64 creation time, a bool, and its vector's digest and twin
# (svcd.memory.exact).
ROW_EXTRA_BYTES = 8 + 8 + 8 + 1 + 8 + 8

_NEVER = numpy.float32(-numpy.inf)
# How far apart, per dimension, the float32 products of two unit vectors
# with a query may rank them wrongly: each is within about n * 2**-24 of
# its exact value (float32's unit roundoff, any order of summation), so
# two are within twice that of their exact order; 2**-22 leaves room.
_PRODUCT_ROUNDING = 2.0**-22
# Up to this many candidates of a search are ordered as tuples in Python;
# more (scores tied at the k-th) by numpy (L{svcd.memory.exact.bestTied}).
_ORDERED_IN_PYTHON = 64


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
    time; the other methods are called under
    L{svcd.memory.vectorcache.VectorCache}'s lock.
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

        @param product: computes C{matrix @ query}
            (L{svcd.memory.ranking.parallelProduct} splits a large one over
            threads); numpy's own by default.
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
                handTwinOn(
                    self._view.twins[: self._view.count], row, self._view.alive[: self._view.count]
                )
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
