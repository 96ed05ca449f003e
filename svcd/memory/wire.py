"""
A memory as MemoryService sends it (svc.memory.v1.Memory), built in one
place for every method that answers memories, and kept encoded by the
replica's cache of records (L{svcd.memory.recordcache}): a Search answer is
then assembled from bytes, without a Python object or a formatted time per
field of each hit.
"""

from __future__ import annotations

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
