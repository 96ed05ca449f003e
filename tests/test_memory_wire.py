"""
What svc-memory's search path does per call, made cheaper, held to what
it replaced: a Search answer merged from cached encodings, or written as
bytes, equals one built from the records' fields (svcd/memory/wire.py);
the embedding's check by one sum of squares accepts and refuses exactly
the vectors the two passes (finiteness, then the norm) did, and a query's
check scales it to the very bits a cached row of it has
(svcd/memoryclient/records.py, svcd/memory/records.py).
"""

from __future__ import annotations

import datetime
import math
import uuid

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memoryfixtures import memoryRecords

from svcd.memory.exact import normalised
from svcd.memory.records import MemoryRecord, checkQuery
from svcd.memory.wire import encodedMemory, memoryMessage, searchAnswer, searchResponse
from svcd.memoryclient.records import InvalidMemory, checkEmbedding
from svcd.pb.memory.v1 import memory_pb2

records = memoryRecords


# No deadline: the machine's load, not the code, decides how long an
# example takes.
@settings(deadline=None)
@given(
    st.lists(
        st.tuples(records, st.floats(-1, 1, width=32)),
        max_size=12,
    )
)
def test_anAnswerMergedFromEncodingsIsTheAnswerBuiltFromRecords(
    results: list[tuple[MemoryRecord, float]],
) -> None:
    """
    The same message, and the same bytes, as building each ScoredMemory
    from the record's fields.
    """
    built = memory_pb2.SearchResponse(
        results=[
            memory_pb2.ScoredMemory(memory=memoryMessage(record), score=score)
            for record, score in results
        ]
    )
    merged = searchResponse([(encodedMemory(record), score) for record, score in results])
    assert merged == built
    assert merged.SerializeToString() == built.SerializeToString()
    written = searchAnswer([(encodedMemory(record), score) for record, score in results])
    assert written == built.SerializeToString()


def test_anAnswerWrittenAsBytesHoldsEveryScoreAndLength() -> None:
    """
    Scores of zero (either sign) and a memory whose encoding needs a
    three-byte length (past 16 KiB: 4,000 four-byte characters and the
    largest metadata) come out as protobuf writes them, and parse back.
    """
    base = MemoryRecord(
        memoryID=uuid.uuid4(),
        orgID=uuid.uuid4(),
        agentID=uuid.uuid4(),
        subject="",
        content="\U0001f375" * 4000,
        metadata='{"k":"' + "x" * 4080 + '"}',
        source="api",
        sourceRequestID=None,
        embeddingModel="emb",
        dimensions=768,
        createdAt=datetime.datetime(2026, 11, 27, tzinfo=datetime.UTC),
        updatedAt=datetime.datetime(2026, 11, 27, tzinfo=datetime.UTC),
    )
    assert len(encodedMemory(base)) > 2**14
    results = [(base, 0.0), (base, -0.0), (base, 0.5), (base, -1.0), (base, 1e-40)]
    built = memory_pb2.SearchResponse(
        results=[
            memory_pb2.ScoredMemory(memory=memoryMessage(record), score=score)
            for record, score in results
        ]
    )
    written = searchAnswer([(encodedMemory(record), score) for record, score in results])
    assert written == built.SerializeToString()
    parsed = memory_pb2.SearchResponse.FromString(written)
    assert [each.score for each in parsed.results] == [0.0, -0.0, 0.5, -1.0, pytest.approx(1e-40)]
    assert all(each.memory.content == base.content for each in parsed.results)


def twoPasses(vector: bytes) -> str | None:
    """
    The rule as it was: every component finite, then a norm that is
    neither zero nor infinite; None when accepted, else the complaint.
    """
    components = numpy.frombuffer(vector, dtype="<f4")
    if not bool(numpy.isfinite(components).all()):
        return "finite"
    norm = float(numpy.linalg.norm(components.astype(numpy.float64)))
    if norm == 0.0 or not math.isfinite(norm):
        return "zeros"
    return None


components = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 3.4e38, -3.4e38, 1e-45]),
)


@settings(deadline=None)
@given(st.lists(components, min_size=1, max_size=40), st.integers(0, 2))
def test_theEmbeddingCheckRefusesWhatTheTwoPassesRefused(values: list[float], zeros: int) -> None:
    """
    NaN or infinite components are refused as not finite, vectors of
    zeros (signed or not) as having no direction, everything else
    accepted, largest float32 values included.
    """
    vector = numpy.asarray(values + [0.0] * zeros, dtype="<f4").tobytes()
    expected = twoPasses(vector)
    if expected is None:
        assert checkEmbedding("m", vector).vector == vector
        return
    with pytest.raises(InvalidMemory) as refused:
        checkEmbedding("m", vector)
    assert ("finite" in str(refused.value)) == (expected == "finite")
    assert ("zeros" in str(refused.value)) == (expected == "zeros")


@settings(deadline=None)
@given(st.lists(components, min_size=1, max_size=40), st.integers(0, 2))
def test_aQueryIsCheckedAsAnEmbeddingAndScaledAsACachedRow(values: list[float], zeros: int) -> None:
    """
    checkQuery refuses what checkEmbedding refuses, with the same words,
    and scales what it accepts to exactly the bits L{normalised} gives a
    cached row of the same vector: a memory searched by its own vector
    scores as it did when the query was scaled apart from its check.
    """
    vector = numpy.asarray(values + [0.0] * zeros, dtype="<f4").tobytes()
    try:
        checkEmbedding("m", vector)
    except InvalidMemory as refusedEmbedding:
        with pytest.raises(InvalidMemory) as refusedQuery:
            checkQuery("m", vector)
        assert str(refusedQuery.value) == str(refusedEmbedding)
        return
    query = checkQuery("m", vector)
    assert query.model == "m" and query.dimensions == len(vector) // 4
    assert query.unit.dtype == numpy.float32
    assert query.unit.tobytes() == normalised(vector).tobytes()


def test_largestVectorsAreAccepted() -> None:
    """
    16,384 components of the largest float32 do not overflow the sum of
    squares.
    """
    vector = numpy.full(16_384, 3.4e38, dtype="<f4").tobytes()
    assert checkEmbedding("m", vector).dimensions == 16_384
    # Scaled to length 1, not to zeros (its length passes float32's range).
    unit = checkQuery("m", vector).unit
    assert unit.tobytes() == normalised(vector).tobytes()
    assert float(unit.astype(numpy.float64) @ unit.astype(numpy.float64)) == pytest.approx(1.0)
