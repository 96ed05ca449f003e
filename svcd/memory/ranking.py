"""
A ranking of a scope's memories, as vector search
(L{svcd.memory.vectors}) and text search (L{svcd.memory.text}) make it,
and the product that scores a scope's vectors, split over cores when the
scope is large (its candidates' exact scores and order:
L{svcd.memory.exact}).
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
    executor: Executor,
    workers: int,
    threshold: int,
    minBlockRows: int = MIN_BLOCK_ROWS,
    dimensions: int | None = None,
) -> Callable[[Floats, Floats], Floats]:
    """
    C{matrix @ query}, split into blocks of rows computed at once (one on
    the calling thread) when the matrix has C{threshold} rows or more: as
    many blocks as C{workers}, but none under C{minBlockRows}. numpy
    releases the GIL in the product, so the blocks run on several cores;
    BLAS itself runs one thread per call in svc-memory (svcd/memory/tap.py).
    Below the threshold one product is quicker than handing work to
    threads, and so is a block too small to be worth its hand-off.

    @param dimensions: if given, C{threshold} and C{minBlockRows} count
        rows of this many dimensions, and a matrix of fewer needs as many
        more rows: what pays for the split is the matrix's bytes (beyond a
        core's cache), never its rows. 10,000 rows of 64 dimensions are
        2.5 MB, and split they cost a search the hand-off (issue 44).
    """

    def product(matrix: Floats, query: Floats) -> Floats:
        rows = int(matrix.shape[0])
        least, blockRows = threshold, minBlockRows
        if dimensions is not None:
            wide = max(1, int(matrix.shape[1]))
            least = -(-threshold * dimensions // wide)
            blockRows = -(-minBlockRows * dimensions // wide)
        blocks = min(workers, rows // max(1, blockRows))
        if blocks < 2 or rows < least:
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
