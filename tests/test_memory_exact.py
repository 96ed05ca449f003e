"""
Rows of equal vectors scored once (svcd/memory/exact.py, issue 44): each
row's twin (the first row of its bits) as a scope is loaded, grown one
memory at a time and compacted, digests shared by unequal bits never
making twins, and a search of many tied candidates scoring each twin
once and ranking as if it had scored every row.
"""

from __future__ import annotations

import uuid

import numpy
import numpy.typing
import pytest
from memoryfixtures import vectorBytes

from svcd.memory import exact
from svcd.memory.exact import exactOfTwins, exactScores, normalised, twinAmong, twinsOf
from svcd.memory.store.cacheloads import ScopeRows
from svcd.memory.vectors import ScopeVectors


def loaded(vectors: list[list[float]]) -> tuple[ScopeVectors, list[uuid.UUID]]:
    ids = [uuid.uuid4() for _ in vectors]
    rows = ScopeRows(
        ids=b"".join(each.bytes for each in ids),
        createdMicros=list(range(len(vectors))),
        vectors=b"".join(vectorBytes(each) for each in vectors),
    )
    return ScopeVectors.fromRows(len(vectors[0]), rows), ids


def twins(scope: ScopeVectors) -> list[int]:
    view = scope._view
    result: list[int] = view.twins[: view.count].tolist()
    return result


def test_aLoadedScopesTwinsAreTheFirstRowsOfTheirBits() -> None:
    scope, _ = loaded([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [1.0, 1.0]])
    # [2, 0] is [1, 0] once normalised: the same bits.
    assert twins(scope) == [0, 1, 0, 1, 0, 5]


def test_aMemoryAddedFindsItsTwin() -> None:
    scope, _ = loaded([[1.0, 0.0], [0.0, 1.0]])
    scope.upsert(uuid.uuid4(), 10, normalised(vectorBytes([0.0, 3.0])))
    scope.upsert(uuid.uuid4(), 11, normalised(vectorBytes([1.0, 2.0])))
    scope.upsert(uuid.uuid4(), 12, normalised(vectorBytes([1.0, 2.0])))
    assert twins(scope) == [0, 1, 1, 3, 3]


def test_twinsAfterCompactionAreRowsOfTheNewArrays() -> None:
    """
    Compaction drops dead rows, a twin among them: the rows that named it
    name their first live row of the same bits in the new arrays.
    """
    scope, ids = loaded([[1.0, 0.0]] * 40 + [[0.0, 1.0]] * 40)
    scope.remove(ids[:20] + ids[40:60])
    view = scope._view
    assert view.count == 40 and view.dead == 0
    assert twins(scope) == [0] * 20 + [20] * 20


def test_aSharedDigestOfUnequalBitsMakesNoTwins() -> None:
    matrix = numpy.stack(
        [normalised(vectorBytes(each)) for each in ([1.0, 0.0], [0.0, 1.0], [1.0, 0.0])]
    )
    digests = numpy.zeros(3, dtype=numpy.int64)
    assert twinsOf(matrix, digests).tolist() == [0, 1, 0]
    added = normalised(vectorBytes([0.0, 1.0]))
    # Row 0's digest, forced onto a vector of other bits.
    assert twinAmong(matrix[:1], digests[:1], numpy.zeros(1, dtype=numpy.intp), added, 1) == 1


def test_eachTwinIsScoredOnce() -> None:
    generator = numpy.random.default_rng(5)
    distinct = [generator.standard_normal(16).tolist() for _ in range(3)]
    scope, _ = loaded([distinct[row % 3] for row in range(300)])
    view = scope._view
    matrix = view.matrix[: view.count]
    query = normalised(vectorBytes(generator.standard_normal(16).tolist()))
    scored: list[int] = []

    def counting(
        matrix: numpy.typing.NDArray[numpy.float32],
        candidates: numpy.typing.NDArray[numpy.intp],
        query: numpy.typing.NDArray[numpy.float32],
    ) -> numpy.typing.NDArray[numpy.float64]:
        scored.append(len(candidates))
        return exactScores(matrix, candidates, query)

    candidates = numpy.arange(1, 300, dtype=numpy.intp)
    found = exactOfTwins(matrix, view.twins[: view.count], candidates, query, counting)
    assert scored == [3]
    assert found.tolist() == exactScores(matrix, candidates, query).tolist()


def test_aSearchOfManyTiedCandidatesScoresTwinsOnly(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    1,000 memories of one vector, some loaded and some added: a search
    scores one row again, not 1,000, and ranks newest first.
    """
    same = numpy.random.default_rng(3).standard_normal(64).tolist()
    scope, ids = loaded([same] * 600)
    for number in range(400):
        memoryID = uuid.uuid4()
        ids.append(memoryID)
        scope.upsert(memoryID, 600 + number, normalised(vectorBytes(same)))
    scored: list[int] = []
    original = exact.exactScores

    def counting(
        matrix: numpy.typing.NDArray[numpy.float32],
        candidates: numpy.typing.NDArray[numpy.intp],
        query: numpy.typing.NDArray[numpy.float32],
    ) -> numpy.typing.NDArray[numpy.float64]:
        scored.append(len(candidates))
        return original(matrix, candidates, query)

    monkeypatch.setattr(exact, "exactScores", counting)
    hits = scope.search(normalised(vectorBytes(same)), 5)
    assert scored == [1]
    assert [hit.memoryID for hit in hits] == ids[::-1][:5]
    assert len({hit.score for hit in hits}) == 1


def test_aForgottenTwinHandsItsPlaceOn() -> None:
    """
    A forgotten memory's vector is zeroed at once (D13 amended); rows that
    took it as their twin take another row of their bits first, so that a
    search of many tied candidates still scores them by their own bits,
    not by the zeros (which scored every copy 0, below a worse memory).
    """
    same = [1.0, 2.0, 3.0]
    worse = [3.0, 2.0, -1.0]
    vectors = [same] * 80 + [worse]
    ids = [uuid.uuid4() for _ in vectors]
    rows = ScopeRows(
        ids=b"".join(each.bytes for each in ids),
        createdMicros=list(range(len(vectors))),
        vectors=b"".join(vectorBytes(each) for each in vectors),
    )
    scope = ScopeVectors.fromRows(3, rows)
    assert scope.remove([ids[0]]) == 1
    query = normalised(vectorBytes(same))
    hits = scope.search(query, 80)
    assert [hit.memoryID for hit in hits] == [*reversed(ids[1:80]), ids[80]]
    assert len({hit.score for hit in hits[:79]}) == 1
    assert hits[0].score == pytest.approx(1.0)
