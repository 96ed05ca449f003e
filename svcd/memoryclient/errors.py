"""
Refusals come back as L{MemoryCallFailed} subclasses, one per status of
memory.proto, so that the proxy maps each to its HTTP answer (D13): 404,
403, 409 MEMORY_FULL, 400, and 503 SERVICE_DEGRADED for anything that is
no answer (unreachable, deadline, overloaded).
"""

from __future__ import annotations

import grpc

from svcd.memoryclient.records import FORBIDDEN_DETAILS


class MemoryCallFailed(Exception):
    """
    A call to svc-memory did not answer OK; C{code} is its gRPC status
    (None for a failure without one) and C{details} the server's words.
    """

    def __init__(self, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"{code.name if code else 'no status'}: {details}")
        self.code = code
        self.details = details


class MemoryNotFound(MemoryCallFailed):
    """
    No memory (or observation) has this id (404).
    """


class MemoryForbidden(MemoryCallFailed):
    """
    The id is another organization's, agent's or subject's (403).
    """


class MemoryFull(MemoryCallFailed):
    """
    The scope holds SVC_MEMORY_MAX_PER_SCOPE memories (409 MEMORY_FULL).
    """


class MemoryInvalid(MemoryCallFailed):
    """
    A value svc-memory refused; C{details} names the field (400).
    """


class MemoryUnavailable(MemoryCallFailed):
    """
    No answer: unreachable, past the deadline, overloaded, or its database
    down, or this client's certificate not admitted as an internal caller
    (503 SERVICE_DEGRADED: the deployment's fault, never the caller's).
    """


_FAILURES: dict[grpc.StatusCode, type[MemoryCallFailed]] = {
    grpc.StatusCode.NOT_FOUND: MemoryNotFound,
    grpc.StatusCode.PERMISSION_DENIED: MemoryForbidden,
    grpc.StatusCode.FAILED_PRECONDITION: MemoryFull,
    grpc.StatusCode.INVALID_ARGUMENT: MemoryInvalid,
}


def failureOf(error: BaseException) -> MemoryCallFailed:
    """
    The L{MemoryCallFailed} of a failed call's exception.
    """
    if isinstance(error, grpc.Call):
        return refusalOf(error.code(), error.details() or "")
    return MemoryUnavailable(None, type(error).__name__)


def refusalOf(code: grpc.StatusCode, details: str) -> MemoryCallFailed:
    """
    The L{MemoryCallFailed} of a status and its details.
    """
    if code is grpc.StatusCode.PERMISSION_DENIED and details != FORBIDDEN_DETAILS:
        # svc-memory did not admit this client's certificate
        # (SVC_GRPC_INTERNAL_SUBJECTS): no memory was refused.
        return MemoryUnavailable(code, details)
    return _FAILURES.get(code, MemoryUnavailable)(code, details)
