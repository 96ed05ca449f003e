"""
A request's own say over memory (decisions D13), read in one place: the
C{X-SVC-Memory} header (C{off} is its one value) with the organization's
and agent's settings, and C{X-SVC-Memory-Subject} (whose memories within
the agent). The memory routes (L{svcd.proxy.http.routes.memories}), a
chat completion's recall (L{svcd.proxy.recall}) and its observation
(L{svcd.proxy.observe}) read them alike.

Below the edge: it imports nothing of L{svcd.proxy.http}, so that recall
and observation, which the request context carries, never climb back to
the edge.
"""

from __future__ import annotations

import re

from twisted.web.server import Request

from svcd.common.errors import FieldError, FieldErrorCode, validationError
from svcd.limits.book import MEMORY_OFF, LimitBook

# Decisions D13: a request's own say over memory; "off" is its one value.
MEMORY_HEADER = "X-SVC-Memory"
_MEMORY_HEADER = MEMORY_HEADER.encode("ascii")

# Decisions D13: whose memories within the agent (an end user the agent
# serves); absent, the agent's own ("").
MEMORY_SUBJECT_HEADER = "X-SVC-Memory-Subject"
_MEMORY_SUBJECT_HEADER = MEMORY_SUBJECT_HEADER.encode("ascii")
_SUBJECT = re.compile(rb"[A-Za-z0-9._:@-]{1,128}")


def memorySubject(request: Request) -> str:
    """
    The memory subject of a request (decisions D13): the header
    C{X-SVC-Memory-Subject}, 1 to 128 characters of C{A-Za-z0-9._:@-}, or
    "" without it. The memory routes and a chat completion's recall read
    it alike.

    @raise ApiError: 400 VALIDATION_ERROR naming the header for any other
        value (empty, too long, another character, the header twice).
    """
    values = request.requestHeaders.getRawHeaders(_MEMORY_SUBJECT_HEADER)
    if values is None:
        return ""
    if len(values) != 1 or _SUBJECT.fullmatch(values[0]) is None:
        raise validationError(
            [
                FieldError(
                    MEMORY_SUBJECT_HEADER,
                    FieldErrorCode.INVALID_FORMAT,
                    "must be 1 to 128 characters of A-Z, a-z, 0-9 and . _ : @ -",
                )
            ]
        )
    return values[0].decode("ascii")


def memoryOff(request: Request) -> bool:
    """
    Whether the request turned memory off for itself with C{X-SVC-Memory:
    off} (decisions D13). C{off} (in any case, with surrounding spaces)
    is the header's one value: a request cannot turn on what its
    organization and agent have off.

    @raise ApiError: 400 VALIDATION_ERROR naming the header for any other
        value, an empty one, or the header given twice.
    """
    values = request.requestHeaders.getRawHeaders(_MEMORY_HEADER)
    if values is None:
        return False
    if len(values) == 1 and values[0].strip().lower() == b"off":
        return True
    raise validationError(
        [FieldError(MEMORY_HEADER, FieldErrorCode.INVALID_ENUM, "must be off when given")]
    )


def requestMemory(
    request: Request, book: LimitBook, orgID: str, agentID: str | None
) -> tuple[bool, str]:
    """
    Whether memory is recalled for this request and how it is observed,
    as C{(recall, observe mode)}: both off when the request says
    C{X-SVC-Memory: off}, else its agent's and organization's settings
    (L{LimitBook.memoryFor}).

    @raise ApiError: 400 VALIDATION_ERROR for a bad C{X-SVC-Memory}
        (L{memoryOff}), checked first, so that a request with a bad header
        is refused whatever the settings.
    """
    if memoryOff(request):
        return MEMORY_OFF
    return book.memoryFor(orgID, agentID)


def chatMemory(
    request: Request, book: LimitBook, orgID: str, agentID: str | None
) -> tuple[bool, str, str]:
    """
    What a chat completion's memory headers and its settings say, as
    C{(recall, observe mode, subject)}: L{requestMemory}, then
    L{memorySubject}, in that order, so that a bad C{X-SVC-Memory} is the
    refusal whatever the subject says. The recall's plan and the
    observation's read them so, whatever their settings turn out to be.

    @raise ApiError: 400 VALIDATION_ERROR for a bad C{X-SVC-Memory} or
        C{X-SVC-Memory-Subject}.
    """
    recall, observe = requestMemory(request, book, orgID, agentID)
    return recall, observe, memorySubject(request)
