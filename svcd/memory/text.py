"""
Text search of one scope (decisions D13, "Hybrid search"): the words of
its memories, an exact Okapi BM25 ranking over them, and the
reciprocal-rank fusion of two rankings.

Words: L{svcd.memory.words}, one definition for memories and queries
alike.

BM25, exactly as D13 states it, over the memories of one organization,
agent and subject (every embedding model's: the words do not depend on
it): for each distinct word of the query held by n of the scope's N
memories, idf = ln(1 + (N - n + 0.5) / (n + 0.5)), and a memory of
length dl (its words, repeats counted) holding the word tf times gains
idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl)), with k1 =
1.2, b = 0.75 and avgdl the scope's mean length. A word repeated in the
query counts once. Memories sharing no word with the query are not
ranked. Ties, as in vector search, newest first, then by id, descending.

The index (L{ScopeText}) keeps what that needs, current as memories are
added, changed and deleted: per memory its id, creation time and length;
per word its document frequency; and the postings (which memories hold a
word, how often) in compressed sparse rows built in one pass of numpy,
plus a small dictionary of the postings of memories added since the last
build. A deleted or changed memory's row is only marked dead (its words'
frequencies are decremented at once, so every statistic stays exact);
when dead rows or added ones pass one in 16 of the scope, the index is
built again from its live rows, compactly. A search reads the postings of
the query's few words only: its cost grows with how many memories hold
them, not with the scope.

Threads. Each scope has a lock held by a search while it scores (well
under a millisecond for 10,000 memories) and by a change while it is
applied: a search sees a change whole or not at all, and the change
listener waits at most one search of one scope.
"""

from __future__ import annotations

import math
import sys
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import cast

import attrs
import numpy
import numpy.typing

from svcd.memory.ranking import Hit, Ranking, rankingOf
from svcd.memory.store.cacheloads import CachedRow, ScopeTexts
from svcd.memory.vectorcache import SCOPE_OVERHEAD_BYTES
from svcd.memory.words import queryWords, words

K1 = 1.2
B = 0.75
# Reciprocal-rank fusion: each ranking's first FUSED_DEPTH memories, each
# scoring 1 / (RRF_CONSTANT + rank), rank counted from 1.
RRF_CONSTANT = 60
FUSED_DEPTH = 100


# An estimate of what the vocabulary costs per word besides the word's own
# string: its dictionary slot and entry and its id (an int object), and
# its entries in the frequency and offset arrays.
_WORD_OVERHEAD_BYTES = 100
# An estimate of what a memory added since the last build costs in the
# dictionaries that hold it until the next (per memory, and per word).
_PENDING_ROW_BYTES = 200
_PENDING_POSTING_BYTES = 80

Ints = numpy.typing.NDArray[numpy.int32]


@attrs.frozen
class TextKey:
    """
    The cache's key of a scope's text index: every memory of the
    organization, agent and subject, whichever model embedded it.
    """

    orgID: uuid.UUID
    agentID: uuid.UUID
    subject: str = attrs.field(repr=False)

    @property
    def triple(self) -> tuple[uuid.UUID, uuid.UUID, str]:
        return (self.orgID, self.agentID, self.subject)

    def holds(self, row: CachedRow) -> bool:
        return True


def idf(documents: int, holding: int) -> float:
    return math.log(1.0 + (documents - holding + 0.5) / (holding + 0.5))


def _counted(
    text: str,
    vocabulary: dict[str, int],
    fresh: list[str] | None = None,
    byID: list[str | None] | None = None,
) -> tuple[Ints, Ints, int]:
    """
    A memory's distinct words as ids (new words added to C{vocabulary},
    and to C{fresh} when given), how often each comes, and its length.

    @param byID: the words by id, when the vocabulary may have lost some
        (a new word's id is then past the last one, appended to it).
    """
    tally: dict[int, int] = {}
    length = 0
    for word in words(text):
        termID = vocabulary.get(word)
        if termID is None:
            if byID is None:
                termID = vocabulary[word] = len(vocabulary)
            else:
                termID = vocabulary[word] = len(byID)
                byID.append(word)
            if fresh is not None:
                fresh.append(word)
        tally[termID] = tally.get(termID, 0) + 1
        length += 1
    terms = numpy.fromiter(tally.keys(), dtype=numpy.int32, count=len(tally))
    counts = numpy.fromiter(tally.values(), dtype=numpy.int32, count=len(tally))
    return terms, counts, length


@attrs.frozen
class _Built:
    """
    The postings of the rows present at the last build, both ways: by word
    (C{offsets}, C{rows}, C{counts}: word t's rows are
    C{rows[offsets[t]:offsets[t + 1]]}) and by row (C{rowOffsets},
    C{terms}, C{termCounts}), the second for deleting a row and for the
    next build.
    """

    offsets: numpy.typing.NDArray[numpy.int64]
    rows: Ints
    counts: Ints
    rowOffsets: numpy.typing.NDArray[numpy.int64]
    terms: Ints
    termCounts: Ints

    @property
    def nbytes(self) -> int:
        arrays = (
            self.offsets,
            self.rows,
            self.counts,
            self.rowOffsets,
            self.terms,
            self.termCounts,
        )
        return sum(int(each.nbytes) for each in arrays)


def _build(
    rowTerms: Sequence[tuple[Ints, Ints]], vocabularySize: int
) -> tuple[_Built, numpy.typing.NDArray[numpy.int32]]:
    """
    The postings of rows 0.. with these words and counts, and each word's
    document frequency.
    """
    lengths = numpy.fromiter(
        (each[0].size for each in rowTerms), dtype=numpy.int64, count=len(rowTerms)
    )
    rowOffsets = numpy.zeros(len(rowTerms) + 1, dtype=numpy.int64)
    numpy.cumsum(lengths, out=rowOffsets[1:])
    if rowTerms:
        terms = numpy.concatenate([each[0] for each in rowTerms]).astype(numpy.int32)
        termCounts = numpy.concatenate([each[1] for each in rowTerms]).astype(numpy.int32)
    else:
        terms = numpy.empty(0, dtype=numpy.int32)
        termCounts = numpy.empty(0, dtype=numpy.int32)
    owners = numpy.repeat(numpy.arange(len(rowTerms), dtype=numpy.int32), lengths)
    # Stable: within a word, rows stay in order.
    order = numpy.argsort(terms, kind="stable")
    frequency = numpy.bincount(terms, minlength=vocabularySize).astype(numpy.int32)
    offsets = numpy.zeros(vocabularySize + 1, dtype=numpy.int64)
    numpy.cumsum(frequency, out=offsets[1:])
    built = _Built(
        offsets=offsets,
        rows=owners[order],
        counts=termCounts[order],
        rowOffsets=rowOffsets,
        terms=terms,
        termCounts=termCounts,
    )
    return built, frequency


class ScopeText:
    """
    The BM25 index of one scope's memories. L{search} may run on any
    thread; changes (L{upsert}, L{remove}, L{applyChange}) come under the
    cache's lock; each holds the scope's own lock while it works.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._vocabulary: dict[str, int] = {}
        # The words by id; None where a word left the vocabulary since the
        # last build (no memory holds it any more).
        self._words: list[str | None] = []
        self._vocabularyBytes = 0
        self._frequency = numpy.zeros(0, dtype=numpy.int32)
        # Rows: the built ones first, then those added since.
        self._high = numpy.empty(0, dtype=numpy.uint64)
        self._low = numpy.empty(0, dtype=numpy.uint64)
        self._created = numpy.empty(0, dtype=numpy.int64)
        self._lengths = numpy.empty(0, dtype=numpy.int32)
        self._alive = numpy.zeros(0, dtype=numpy.bool_)
        self._count = 0
        self._dead = 0
        self._totalLength = 0
        self._built, _ = _build([], 0)
        self._builtRows = 0
        # Rows added since the build: their words, and their postings by
        # word.
        self._pendingTerms: dict[int, tuple[Ints, Ints]] = {}
        self._pendingPostings: dict[int, list[tuple[int, int]]] = {}
        self._pendingPostingCount = 0

    @classmethod
    def fromRows(cls, rows: ScopeTexts) -> ScopeText:
        """
        A scope loaded from PostgreSQL, built in one pass.
        """
        scope = cls()
        ids = numpy.frombuffer(rows.ids, dtype=">u8").reshape(rows.count, 2)
        with scope._lock:
            scope._rebuild(
                [
                    (
                        int(ids[index, 0]),
                        int(ids[index, 1]),
                        rows.createdMicros[index],
                        content,
                    )
                    for index, content in enumerate(rows.contents)
                ]
            )
        return scope

    @property
    def count(self) -> int:
        """
        The memories it holds (live rows).
        """
        return self._count - self._dead

    @property
    def nbytes(self) -> int:
        """
        What the index holds, in bytes: its arrays' own, and estimates for
        its dictionaries (the vocabulary's words, the rows by id, the rows
        added since the last build).
        """
        arrays = (self._frequency, self._high, self._low, self._created, self._lengths, self._alive)
        return (
            sum(int(each.nbytes) for each in arrays)
            + self._built.nbytes
            + self._vocabularyBytes
            + len(self._pendingTerms) * _PENDING_ROW_BYTES
            + self._pendingPostingCount * _PENDING_POSTING_BYTES
            + SCOPE_OVERHEAD_BYTES
        )

    def search(self, text: str, k: int) -> list[Hit]:
        """
        L{rank}'s memories as L{Hit}s.
        """
        return self.rank(text, k).hits()

    def rank(self, text: str, k: int) -> Ranking:
        """
        The C{k} memories of the scope that best match C{text} by BM25,
        best first, ties newest first; none sharing no word with it.
        """
        query = queryWords(text)
        if k < 1 or not query:
            return Ranking([], [], [])
        with self._lock:
            count = self._count
            live = self._count - self._dead
            if live == 0:
                return Ranking([], [], [])
            averageLength = self._totalLength / live
            scores = numpy.zeros(count, dtype=numpy.float64)
            matched = numpy.zeros(count, dtype=numpy.bool_)
            for word in query:
                termID = self._vocabulary.get(word)
                if termID is None or self._frequency[termID] == 0:
                    continue
                rows, counts = self._postings(termID)
                keep = self._alive[rows]
                rows, counts = rows[keep], counts[keep].astype(numpy.float64)
                weight = idf(live, int(self._frequency[termID]))
                lengths = self._lengths[rows].astype(numpy.float64)
                # The expression of the module's docstring, in its order.
                scores[rows] += (
                    weight
                    * (counts * (K1 + 1))
                    / (counts + K1 * (1 - B + B * lengths / averageLength))
                )
                matched[rows] = True
            candidates = numpy.flatnonzero(matched)
            if candidates.size > k:
                chosen = scores[candidates]
                threshold = numpy.partition(chosen, chosen.size - k)[chosen.size - k]
                candidates = candidates[chosen >= threshold]
            order = numpy.lexsort(
                (
                    self._low[candidates],
                    self._high[candidates],
                    self._created[candidates],
                    scores[candidates],
                )
            )[::-1][:k]
            picked = candidates[order]
            return rankingOf(
                self._high[picked], self._low[picked], self._created[picked], scores[picked]
            )

    def _postings(self, termID: int) -> tuple[Ints, Ints]:
        built = self._built
        rows: Ints
        counts: Ints
        if termID + 1 < built.offsets.size:
            start, end = int(built.offsets[termID]), int(built.offsets[termID + 1])
            rows, counts = built.rows[start:end], built.counts[start:end]
        else:
            rows = counts = numpy.empty(0, dtype=numpy.int32)
        pending = self._pendingPostings.get(termID)
        if pending:
            added = numpy.asarray(pending, dtype=numpy.int32).reshape(-1, 2)
            rows = numpy.concatenate((rows, added[:, 0]))
            counts = numpy.concatenate((counts, added[:, 1]))
        return rows, counts

    # Changes, under the cache's lock.

    def applyChange(self, memoryID: uuid.UUID, row: CachedRow | None) -> None:
        """
        What the change listener heard of one memory: gone (None), or as
        it now is.
        """
        if row is None:
            self.remove([memoryID])
        else:
            self.upsert(memoryID, row.createdMicros, row.content)

    def remove(self, memoryIDs: Iterable[uuid.UUID]) -> int:
        """
        Forget these memories; how many were here.
        """
        removed = 0
        with self._lock:
            for memoryID in memoryIDs:
                if self._forget(memoryID):
                    removed += 1
            if removed:
                self._rebuildIfWasteful()
        return removed

    def upsert(self, memoryID: uuid.UUID, createdMicros: int, content: str) -> None:
        """
        Hold this memory with this content (in place of what it held).
        """
        with self._lock:
            self._forget(memoryID)
            terms, counts, length = self._countedNew(content)
            if self._count == self._alive.size:
                self._grow(self._count + self._count // 16 + 16)
            row = self._count
            value = memoryID.int
            self._high[row] = value >> 64
            self._low[row] = value & 0xFFFF_FFFF_FFFF_FFFF
            self._created[row] = createdMicros
            self._lengths[row] = length
            self._alive[row] = True
            self._count += 1
            self._totalLength += length
            self._frequency[terms] += 1
            self._pendingTerms[row] = (terms, counts)
            for termID, times in zip(terms.tolist(), counts.tolist(), strict=True):
                self._pendingPostings.setdefault(termID, []).append((row, times))
            self._pendingPostingCount += int(terms.size)
            self._rebuildIfWasteful()

    def memoryKeys(self) -> list[int]:
        """
        The ids, as 128-bit ints, of the memories it holds.
        """
        with self._lock:
            live = numpy.flatnonzero(self._alive[: self._count])
            return [
                (high << 64) | low
                for high, low in zip(
                    self._high[live].tolist(), self._low[live].tolist(), strict=True
                )
            ]

    def _countedNew(self, content: str) -> tuple[Ints, Ints, int]:
        fresh: list[str] = []
        terms, counts, length = _counted(content, self._vocabulary, fresh, self._words)
        if fresh:
            for word in fresh:
                self._vocabularyBytes += sys.getsizeof(word) + _WORD_OVERHEAD_BYTES
            grown = numpy.zeros(len(self._words), dtype=numpy.int32)
            grown[: self._frequency.size] = self._frequency
            self._frequency = grown
        return terms, counts, length

    def _find(self, memoryID: uuid.UUID) -> int | None:
        value = memoryID.int
        count = self._count
        found = numpy.flatnonzero(
            (self._high[:count] == numpy.uint64(value >> 64))
            & (self._low[:count] == numpy.uint64(value & 0xFFFF_FFFF_FFFF_FFFF))
            & self._alive[:count]
        )
        return int(found[0]) if found.size else None

    def _forget(self, memoryID: uuid.UUID) -> bool:
        row = self._find(memoryID)
        if row is None:
            return False
        terms, _ = self._termsOf(row)
        self._frequency[terms] -= 1
        # A word no memory holds any more leaves the vocabulary at once
        # (decisions D13, amended: a forgotten memory's copy is not kept
        # until the next build); its id stays unused until then.
        for termID in terms[self._frequency[terms] == 0].tolist():
            word = self._words[termID]
            if word is not None:
                del self._vocabulary[word]
                self._words[termID] = None
                self._vocabularyBytes -= sys.getsizeof(word) + _WORD_OVERHEAD_BYTES
        self._alive[row] = False
        self._dead += 1
        self._totalLength -= int(self._lengths[row])
        return True

    def _termsOf(self, row: int) -> tuple[Ints, Ints]:
        if row < self._builtRows:
            built = self._built
            start, end = int(built.rowOffsets[row]), int(built.rowOffsets[row + 1])
            return built.terms[start:end], built.termCounts[start:end]
        return self._pendingTerms[row]

    def _grow(self, capacity: int) -> None:
        def grown(
            array: numpy.typing.NDArray[numpy.generic],
        ) -> numpy.typing.NDArray[numpy.generic]:
            fresh = numpy.zeros(capacity, dtype=array.dtype)
            fresh[: self._count] = array[: self._count]
            return fresh

        self._high = grown(self._high)  # type: ignore[assignment]
        self._low = grown(self._low)  # type: ignore[assignment]
        self._created = grown(self._created)  # type: ignore[assignment]
        self._lengths = grown(self._lengths)  # type: ignore[assignment]
        self._alive = grown(self._alive)  # type: ignore[assignment]

    def _rebuildIfWasteful(self) -> None:
        live = self._count - self._dead
        pending = self._count - self._builtRows
        if max(self._dead, pending) > max(64, live // 16):
            self._rebuild(
                [
                    (
                        int(self._high[row]),
                        int(self._low[row]),
                        int(self._created[row]),
                        self._termsOf(row),
                    )
                    for row in numpy.flatnonzero(self._alive[: self._count]).tolist()
                ]
            )

    def _rebuild(self, rows: Sequence[tuple[int, int, int, str | tuple[Ints, Ints]]]) -> None:
        """
        Build the index anew from these live rows, each with its content
        or its words already counted (then renumbered: words no memory
        holds any more leave the vocabulary).
        """
        vocabulary: dict[str, int] = {}
        counted: list[tuple[Ints, Ints]] = []
        lengths: list[int] = []
        renumber: Ints | None = None
        if rows and not isinstance(rows[0][3], str):
            # Words already counted: keep those still held, renumbered in
            # their old order.
            held = numpy.flatnonzero(self._frequency > 0)
            renumber = numpy.full(self._frequency.size, -1, dtype=numpy.int32)
            renumber[held] = numpy.arange(held.size, dtype=numpy.int32)
            byID = self._words
            vocabulary = {
                cast(str, byID[int(old)]): index for index, old in enumerate(held.tolist())
            }
        for _, _, _, source in rows:
            if isinstance(source, str):
                terms, counts, length = _counted(source, vocabulary)
            else:
                assert renumber is not None
                terms, counts = renumber[source[0]], source[1]
                length = int(counts.sum())
            counted.append((terms, counts))
            lengths.append(length)
        size = len(rows)
        capacity = size + size // 16 + 16
        self._vocabulary = vocabulary
        self._words = list(vocabulary)
        self._vocabularyBytes = sum(
            sys.getsizeof(word) + _WORD_OVERHEAD_BYTES for word in vocabulary
        )
        self._built, self._frequency = _build(counted, len(vocabulary))
        self._builtRows = size
        self._high = numpy.zeros(capacity, dtype=numpy.uint64)
        self._low = numpy.zeros(capacity, dtype=numpy.uint64)
        self._created = numpy.zeros(capacity, dtype=numpy.int64)
        self._lengths = numpy.zeros(capacity, dtype=numpy.int32)
        self._alive = numpy.zeros(capacity, dtype=numpy.bool_)
        if size:
            self._high[:size] = numpy.fromiter((each[0] for each in rows), numpy.uint64, size)
            self._low[:size] = numpy.fromiter((each[1] for each in rows), numpy.uint64, size)
            self._created[:size] = numpy.fromiter((each[2] for each in rows), numpy.int64, size)
            self._lengths[:size] = numpy.asarray(lengths, dtype=numpy.int32)
            self._alive[:size] = True
        self._count = size
        self._dead = 0
        self._totalLength = sum(lengths)
        self._pendingTerms = {}
        self._pendingPostings = {}
        self._pendingPostingCount = 0


def fuse(rankings: Sequence[Ranking], k: int) -> Ranking:
    """
    Reciprocal-rank fusion (decisions D13): each memory scores the sum,
    over the rankings, of 1 / (RRF_CONSTANT + its rank there), its rank
    counted from 1 among each ranking's first FUSED_DEPTH; the C{k} best,
    ties newest first, then by id, descending.
    """
    scores: dict[int, float] = {}
    created: dict[int, int] = {}
    for ranking in rankings:
        depth = min(FUSED_DEPTH, len(ranking.keys))
        for rank, key, moment in zip(
            range(1, depth + 1), ranking.keys[:depth], ranking.createdMicros[:depth], strict=True
        ):
            scores[key] = scores.get(key, 0.0) + 1.0 / (RRF_CONSTANT + rank)
            created[key] = moment
    best = sorted(scores, key=lambda key: (scores[key], created[key], key), reverse=True)[:k]
    return Ranking(best, [scores[key] for key in best], [created[key] for key in best])
