"""
A memory as MemoryService sends it (svc.memory.v1.Memory), built in one
place for every method that answers memories, and kept encoded by the
replica's cache of records (L{svcd.memory.recordcache}): a Search answer is
then assembled from bytes, without a Python object or a formatted time per
field of each hit.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from svcd.common.errors import rfc3339
from svcd.memory.records import MemoryRecord
from svcd.pb.memory.v1 import memory_pb2


def memoryMessage(record: MemoryRecord) -> memory_pb2.Memory:
    return memory_pb2.Memory(
        id=str(record.memoryID),
        org_id=str(record.orgID),
        agent_id=str(record.agentID),
        subject=record.subject,
        content=record.content,
        metadata_json=record.metadata,
        source=record.source,
        source_request_id=record.sourceRequestID or "",
        created_at=rfc3339(record.createdAt),
        updated_at=rfc3339(record.updatedAt),
        embedding_model=record.embeddingModel,
        dimensions=record.dimensions,
    )


def encodedMemory(record: MemoryRecord) -> bytes:
    """
    The memory's wire encoding: what the cache of records holds.
    """
    encoded: bytes = memoryMessage(record).SerializeToString()
    return encoded


def searchResponse(results: Iterable[tuple[bytes, float]]) -> memory_pb2.SearchResponse:
    """
    A Search answer from encoded memories and their scores, best first.
    Merging an encoding is one parse in protobuf's C code: about a
    seventh of the time of building the message from a record's fields
    (measured: 14 against 73 µs for ten hits).
    """
    response = memory_pb2.SearchResponse()
    for encoded, score in results:
        scored = response.results.add(score=score)
        scored.memory.MergeFromString(encoded)
    return response


def searchAnswer(results: Iterable[tuple[bytes, float]]) -> bytes:
    """
    L{searchResponse}'s bytes, written directly: a SearchResponse is only
    its repeated ScoredMemory (field 1), each a Memory (field 1, the
    cached encoding as it is) and a float score (field 2, left out when
    zero, as protobuf leaves out a proto3 scalar at its default). No
    message is built, parsed or serialized: the encodings are copied
    once, into the answer.
    """
    parts: list[bytes] = []
    for encoded, score in results:
        packed = _FLOAT.pack(score)
        scored = b"\x0a" + _varint(len(encoded)) + encoded
        if packed != _ZERO:
            scored += b"\x15" + packed
        parts.append(b"\x0a" + _varint(len(scored)))
        parts.append(scored)
    return b"".join(parts)


def searchManyAnswer(outcomes: Iterable[tuple[int, bytes | str]]) -> bytes:
    """
    A SearchManyResponse's bytes, written as L{searchAnswer} writes a
    SearchResponse's: each outcome (field 1) is either a search's answer
    as L{searchAnswer} wrote it, its C{response} (field 1, written even
    when empty, so that an answer without hits is still an answer), or a
    status code (field 2) and its details (field 3).
    """
    parts: list[bytes] = []
    for code, answer in outcomes:
        if code == 0:
            assert isinstance(answer, bytes)
            outcome = b"\x0a" + _varint(len(answer)) + answer
        else:
            assert isinstance(answer, str)
            details = answer.encode("utf-8")
            outcome = b"\x10" + _varint(code) + b"\x1a" + _varint(len(details)) + details
        parts.append(b"\x0a" + _varint(len(outcome)))
        parts.append(outcome)
    return b"".join(parts)


_FLOAT = struct.Struct("<f")
_ZERO = bytes(4)


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
