"""
A ranking of a scope's memories, as vector search
(L{svcd.memory.vectors}) and text search (L{svcd.memory.text}) make it,
the product that scores a scope's vectors, split over cores when the
scope is large, and the exact scores and order of its candidates.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import attrs
import numpy
import numpy.typing

Floats = numpy.typing.NDArray[numpy.float32]


@attrs.frozen
class Hit:
    """
    One memory of a ranking: its id, its score, and its creation time (in
    microseconds), which breaks ties when rankings are fused.
    """

    memoryID: uuid.UUID
    score: float
    createdMicros: int = 0


@attrs.frozen
class Ranking:
    """
    A ranking, best first, as plain lists: each memory's id as a 128-bit
    int, its score and its creation time. What hybrid search fuses: a
    ranking of 100 memories costs no UUID object until the fused few are
    answered (L{hits}); making them was a millisecond of a loaded core.
    """

    keys: list[int]
    scores: list[float]
    createdMicros: list[int]

    @classmethod
    def fromHits(cls, hits: Sequence[Hit]) -> Ranking:
        return cls(
            [hit.memoryID.int for hit in hits],
            [hit.score for hit in hits],
            [hit.createdMicros for hit in hits],
        )

    def hits(self) -> list[Hit]:
        return [
            Hit(uuid.UUID(int=key), score, created)
            for key, score, created in zip(self.keys, self.scores, self.createdMicros, strict=True)
        ]


def rankingOf(
    high: numpy.typing.NDArray[numpy.uint64],
    low: numpy.typing.NDArray[numpy.uint64],
    created: numpy.typing.NDArray[numpy.int64],
    scores: numpy.typing.NDArray[numpy.floating[Any]],
) -> Ranking:
    """
    The ranking of these rows, in their order.
    """
    return Ranking(
        [(first << 64) | second for first, second in zip(high.tolist(), low.tolist(), strict=True)],
        [float(each) for each in scores.tolist()],
        created.tolist(),
    )


# The fewest rows a block of a split product holds: on a machine of many
# cores a scope just past the split's threshold is cut in a few blocks,
# not one per core.
MIN_BLOCK_ROWS = 1_024


def parallelProduct(
    executor: Executor, workers: int, threshold: int, minBlockRows: int = MIN_BLOCK_ROWS
) -> Callable[[Floats, Floats], Floats]:
    """
    C{matrix @ query}, split into blocks of rows computed at once (one on
    the calling thread) when the matrix has C{threshold} rows or more: as
    many blocks as C{workers}, but none under C{minBlockRows}. numpy
    releases the GIL in the product, so the blocks run on several cores;
    BLAS itself runs one thread per call in svc-memory (svcd/memory/tap.py).
    Below the threshold one product is quicker than handing work to
    threads, and so is a block too small to be worth its hand-off.
    """

    def product(matrix: Floats, query: Floats) -> Floats:
        rows = int(matrix.shape[0])
        blocks = min(workers, rows // max(1, minBlockRows))
        if blocks < 2 or rows < threshold:
            whole: Floats = matrix @ query
            return whole
        scores = numpy.empty(rows, dtype=numpy.float32)
        step = -(-rows // blocks)

        def block(start: int) -> None:
            numpy.matmul(matrix[start : start + step], query, out=scores[start : start + step])

        pending = [executor.submit(block, start) for start in range(step, rows, step)]
        block(0)
        for each in pending:
            each.result()
        return scores

    return product


def exactScores(
    matrix: Floats, candidates: numpy.typing.NDArray[numpy.intp], query: Floats
) -> numpy.typing.NDArray[numpy.float64]:
    """
    Each candidate row's score from its exact float64 products, summed in
    the order of its components, one after the other, so that one vector
    scores the same bits at any place, in any scope, in a search of any
    number of candidates and on any replica, and equal vectors tie exactly
    (ties come newest first).

    The products are laid out one component a row (the candidates'
    transpose) and the rows added in turn: numpy adds whole rows, so the
    sum is vectorised across candidates. Summed along each candidate's own
    row instead (pairwise, as numpy reduces a contiguous axis), 10,000
    candidates of 64 components took 13 to 17 ms, against 2.5 to 3 ms
    this way (issue 44: a scope whose vectors all tie makes every row a
    candidate).
    """
    products = numpy.asarray(matrix[candidates].T, dtype=numpy.float64, order="C")
    products *= query.astype(numpy.float64)[:, None]
    scores: numpy.typing.NDArray[numpy.float64] = products.sum(axis=0)
    return scores


def bestTied(
    exact: numpy.typing.NDArray[numpy.float64],
    created: numpy.typing.NDArray[numpy.int64],
    high: numpy.typing.NDArray[numpy.uint64],
    low: numpy.typing.NDArray[numpy.uint64],
    k: int,
) -> list[tuple[float, int, int, int]]:
    """
    The C{k} best of many candidates, in the order L{svcd.memory.vectors.ScopeVectors.rank}
    gives (score, then newest, then id, all descending), by numpy.

    Many candidates means many scores tie at the k-th: a scope of equal
    or near-equal vectors (a fact stored many times over, or a provider
    answering one vector for every text). Ordered as tuples in Python,
    10,000 of them took a search 5 ms more (issue 44). Here those
    scoring above the k-th best are kept, and of those tied at it only
    the newest that can still make the k; the few left are sorted.
    """
    if len(exact) > k:
        kth = numpy.partition(exact, len(exact) - k)[len(exact) - k]
        above = numpy.flatnonzero(exact > kth)
        tied = numpy.flatnonzero(exact == kth)
        wanted = k - len(above)
        if len(tied) > wanted:
            times = created[tied]
            newest = numpy.partition(times, len(times) - wanted)[len(times) - wanted]
            tied = tied[times >= newest]
        kept = numpy.concatenate((above, tied))
        exact, created, high, low = exact[kept], created[kept], high[kept], low[kept]
    # lexsort sorts by its last key first, ascending: reversed, the best,
    # newest and highest come first.
    order = numpy.lexsort((low, high, created, exact))[::-1][:k]
    return list(
        zip(
            exact[order].tolist(),
            created[order].tolist(),
            high[order].tolist(),
            low[order].tolist(),
            strict=True,
        )
    )
