"""
What every method of svc-memory's servicer (L{svcd.memory.grpcservice})
shares: a request's fields read by svc-memory's rules
(L{svcd.memory.records}, L{svcd.memoryclient.records}), a refusal naming
the field (INVALID_ARGUMENT), and the status each failure is answered
with (memory.proto).
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import grpc
from google.protobuf.message import Message
from twisted.logger import Logger

from svcd.memory.records import checkScope, checkUUID
from svcd.memory.store.base import (
    MemoryForbidden,
    MemoryNotFound,
    ObservationForgotten,
    ScopeFull,
    StoreRejected,
    StoreUnavailable,
    StoreValueRefused,
)
from svcd.memoryclient.records import (
    FORBIDDEN_DETAILS,
    FORGOTTEN_DETAILS,
    InvalidMemory,
    Scope,
    checkEmbedding,
)
from svcd.pb.memory.v1 import memory_pb2

# The details of FAILED_PRECONDITION for a full scope (409 MEMORY_FULL).
SCOPE_FULL = "memory scope is full"


class Refusal(Exception):
    """
    A call answered C{code} with C{details}, before or instead of its work.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


def statusOf(method: str, error: Exception, log: Logger) -> tuple[grpc.StatusCode, str]:
    """
    The status and details a method's failure is answered with (see
    memory.proto); an unexpected one is logged on C{log} (the servicer's),
    with its traceback.
    """
    if isinstance(error, Refusal):
        return error.code, str(error)
    if isinstance(error, InvalidMemory):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, ObservationForgotten):
        return grpc.StatusCode.NOT_FOUND, FORGOTTEN_DETAILS
    if isinstance(error, MemoryNotFound):
        return grpc.StatusCode.NOT_FOUND, "no such id"
    if isinstance(error, MemoryForbidden):
        return grpc.StatusCode.PERMISSION_DENIED, FORBIDDEN_DETAILS
    if isinstance(error, ScopeFull):
        return grpc.StatusCode.FAILED_PRECONDITION, SCOPE_FULL
    if isinstance(error, StoreRejected):
        return grpc.StatusCode.INVALID_ARGUMENT, "agent_id: not an agent of the organization"
    if isinstance(error, StoreValueRefused):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, StoreUnavailable):
        log.warn("{method} failed: {problem}", method=method, problem=str(error))
        return grpc.StatusCode.UNAVAILABLE, "database unavailable"
    log.failure("Unexpected failure in {method}", method=method)
    return grpc.StatusCode.INTERNAL, "internal error"


def scopeOf(message: memory_pb2.Scope) -> Scope:
    return _checkedScope(message.org_id, message.agent_id, message.subject)


@functools.lru_cache(maxsize=4096)
def _checkedScope(orgID: str, agentID: str, subject: str) -> Scope:
    """
    L{checkScope}, remembered: a replica serves the same scopes over and
    over, and parsing two UUIDs and a subject was a tenth of a cached
    search's time. A refusal raises, and is not remembered.
    """
    return checkScope(orgID, agentID, subject)


def embeddingOf(request: Message, field: str) -> Any:
    if not request.HasField(field):
        raise InvalidMemory(field, "is required")
    embedding = getattr(request, field)
    return checkEmbedding(embedding.model, embedding.vector)


def bounded(field: str, value: float, lowest: float, highest: float) -> float:
    if not lowest <= value <= highest:
        raise InvalidMemory(field, f"must be from {lowest:g} to {highest:g}")
    return value


def ownerOf(owner: str) -> str:
    if not 1 <= len(owner) <= 200 or not owner.isprintable():
        raise InvalidMemory("owner", "must be 1 to 200 printable characters")
    return owner


def observationOf(orgText: str, idText: str) -> tuple[uuid.UUID, uuid.UUID]:
    return checkUUID("org_id", orgText), checkUUID("id", idText)


def leaseTokenOf(text: str, required: bool) -> uuid.UUID | None:
    """
    A claim's lease token; empty is None (any claim of the owner) where
    it is not C{required}: workers from before tokens name none.
    """
    if not text and not required:
        return None
    return checkUUID("lease_token", text)
