"""
A search's exact scores and the order of its candidates (split from
L{svcd.memory.vectors}, which ranks with them).

The product of a scope's matrix with the query only picks the candidates:
BLAS sums a row in an order that depends on where the row sits, so each
candidate is scored again by L{exactScores}, the same bits wherever it
sits. A scope of equal vectors (a fact stored many times over, or a
provider answering one vector for every text) makes every row a
candidate, and scoring 10,000 of them again cost a search about a
millisecond (issue 44). Rows of the very same bits score the same bits,
so each row keeps its I{twin}: the first row of the same bits (itself if
none), found by a digest of its bits when the arrays are made or a row is
added, and checked bit for bit. Only the twins of the candidates are
scored (L{exactOfTwins}).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy
import numpy.typing

Floats = numpy.typing.NDArray[numpy.float32]
Indices = numpy.typing.NDArray[numpy.intp]
Digests = numpy.typing.NDArray[numpy.int64]

# Rows whose twins are checked bit for bit at a time (a block's copy of
# 768 dimensions is 12 MB).
_CHECKED_AT_ONCE = 4_096


def normalisedRows(matrix: Floats) -> Floats:
    """
    Each row of C{matrix} scaled to length 1 (the caller checked they are
    finite and not zero): the squares summed in float64 along the row, the
    division in float64, the result rounded to float32. The length of a
    vector of float32's largest values passes float32's range, so it is
    never rounded to float32 (it would make the vector zeros). One rule for
    a scope loaded whole, a memory heard alone (L{normalised}) and a query
    (L{svcd.memory.records.checkQuery}), so that one vector is the same
    bits every way and equal vectors tie exactly (ties come newest first).
    """
    wide = matrix.astype(numpy.float64)
    norms = numpy.sqrt((wide * wide).sum(axis=1))
    wide /= norms[:, None]
    result: Floats = wide.astype(numpy.float32)
    return result


def normalised(vector: bytes) -> Floats:
    """
    A vector of little-endian float32 bytes as a float32 array of length 1
    (the caller checked it is finite and not zero).
    """
    components = numpy.frombuffer(vector, dtype="<f4").reshape(1, -1)
    result: Floats = normalisedRows(components)[0]
    return result


def digestOf(vector: Floats) -> int:
    """
    A digest of the row's bits: equal bits, equal digests (within one
    process; Python's hash of bytes is seeded per process, and digests
    never leave it). Unequal bits may share a digest: twins are checked.
    """
    return hash(vector.tobytes())


def digestsOf(matrix: Floats) -> Digests:
    return numpy.fromiter((digestOf(row) for row in matrix), dtype=numpy.int64, count=len(matrix))


def twinsOf(matrix: Floats, digests: Digests) -> Indices:
    """
    Each row's twin: the first row of the same bits (the row itself when
    it is the first). Rows of one digest are grouped by a stable sort, so
    a group's first is its lowest row; a row whose bits differ from it
    (a digest shared by unequal bits) is its own twin.
    """
    count = len(digests)
    twins = numpy.arange(count, dtype=numpy.intp)
    if count < 2:
        return twins
    order = numpy.argsort(digests, kind="stable")
    ordered = digests[order]
    starts = numpy.flatnonzero(numpy.concatenate(([True], ordered[1:] != ordered[:-1])))
    sizes = numpy.diff(numpy.concatenate((starts, [count])))
    first = numpy.repeat(order[starts], sizes)
    grouped = numpy.flatnonzero(order != first)
    bits = matrix.view(numpy.uint32)
    for start in range(0, len(grouped), _CHECKED_AT_ONCE):
        block = grouped[start : start + _CHECKED_AT_ONCE]
        rows, firsts = order[block], first[block]
        same = (bits[rows] == bits[firsts]).all(axis=1)
        twins[rows[same]] = firsts[same]
    return twins


def twinAmong(matrix: Floats, digests: Digests, twins: Indices, vector: Floats, row: int) -> int:
    """
    The twin of C{vector}, about to be written at C{row} after the rows
    of C{matrix} (their digests and twins beside): the twin of the first
    row of its digest if that row has its bits, else C{row} itself.
    """
    matches = numpy.flatnonzero(digests == digestOf(vector))
    if matches.size:
        found = int(matches[0])
        if numpy.array_equal(matrix[found].view(numpy.uint32), vector.view(numpy.uint32)):
            return int(twins[found])
    return row


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


def exactOfTwins(
    matrix: Floats,
    twins: Indices,
    candidates: Indices,
    query: Floats,
    scores: Callable[[Floats, Indices, Floats], numpy.typing.NDArray[numpy.float64]] | None = None,
) -> numpy.typing.NDArray[numpy.float64]:
    """
    L{exactScores} of the candidates, each computed once per twin: a row
    has its twin's bits, so its twin's score. C{twins} may name rows that
    are not candidates (or are dead): their bits are still those of the
    rows naming them.
    """
    score = exactScores if scores is None else scores
    chosen = twins[candidates]
    wanted = numpy.zeros(len(matrix), dtype=numpy.bool_)
    wanted[chosen] = True
    distinct = numpy.flatnonzero(wanted)
    if len(distinct) == len(candidates):
        return score(matrix, candidates, query)
    full = numpy.empty(len(matrix), dtype=numpy.float64)
    full[distinct] = score(matrix, distinct, query)
    result: numpy.typing.NDArray[numpy.float64] = full[chosen]
    return result


def handTwinOn(twins: Indices, row: int, alive: numpy.typing.NDArray[numpy.bool_]) -> None:
    """
    Before the bits of C{row} go (its memory forgotten: its vector is
    zeroed at once, decisions D13 amended), the live rows that took it as
    their twin take the first of them instead: they hold the same bits, and
    a twin is where their scores come from. A dead follower is passed over:
    its bits were zeroed when it was forgotten, and a twin of zeroed bits
    would score every live row 0.
    """
    followers = numpy.flatnonzero((twins == row) & alive)
    followers = followers[followers != row]
    if len(followers):
        twins[followers] = followers[0]
