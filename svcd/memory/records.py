"""
What svc-memory stores and the rules a memory obeys (decisions D13), as
plain values shared by the store, the servicer and svcctl; what svc-memory
shares with its clients (a scope, an embedding and a vector's rules, the
bounds of a content, metadata and observation) is
L{svcd.memoryclient.records}.

The rules are checked here, before any SQL, so that a refusal names the
field and says why (INVALID_ARGUMENT); the table's CHECK constraints
(sql/0009_memory.sql) are the backstop, never the first line.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import uuid
from typing import Any

import attrs

from svcd.common.ids import parseUUID
from svcd.memoryclient.records import (
    MAX_CONTENT_CHARACTERS,
    MAX_METADATA_BYTES,
    MAX_OBSERVED_MESSAGE_BYTES,
    MAX_OBSERVED_MESSAGES,
    OBSERVED_ROLES,
    InvalidMemory,
    ObservedMessage,
    Scope,
    checkShape,
    checkSquares,
)

# A subject: empty (the default) or 1 to 128 of these characters, as the
# proxy's X-SVC-Memory-Subject header.
SUBJECT_PATTERN = re.compile(r"[A-Za-z0-9._:@-]{0,128}")
MAX_REQUEST_ID_CHARACTERS = 200
# Where a memory came from: a caller of the API, or svc-worker.
API = "api"
EXTRACTED = "extracted"
SOURCES = (API, EXTRACTED)
# The problem of an embedding whose length is not that of the scope's other
# vectors of its model (decisions D13 amended, "Vectors never mix"):
# svc-memory's INVALID_ARGUMENT on the field "embedding", which svc-proxy
# answers 502 UPSTREAM_ERROR (a provider made the vector), never 400.
OTHER_LENGTH = "is not the length of the scope's other vectors of its model"
MAX_REASON_CHARACTERS = 500


@attrs.frozen
class Query:
    """
    A search's query (L{checkQuery}): the model that made it, and its
    vector scaled to length 1 as a float32 array, which is all a search
    compares. Scaled by the rule of the cached rows
    (L{svcd.memory.exact.normalisedRows}), bit for bit.
    """

    model: str
    unit: Any = attrs.field(eq=False, repr=False)

    @property
    def dimensions(self) -> int:
        return len(self.unit)


@attrs.frozen
class MemoryRecord:
    """
    A stored memory, without its vector (which only search uses).

    @ivar metadata: the JSON object's compact text.
    """

    memoryID: uuid.UUID
    orgID: uuid.UUID
    agentID: uuid.UUID
    subject: str = attrs.field(repr=False)
    content: str = attrs.field(repr=False)
    metadata: str = attrs.field(repr=False)
    source: str
    sourceRequestID: str | None
    embeddingModel: str
    dimensions: int
    createdAt: datetime.datetime
    updatedAt: datetime.datetime


@attrs.frozen
class NewObservation:
    """
    An observation to queue, keyed by C{key} within the organization: the
    proxy's ledger id of the observed request (sql/0015), its request id
    when none is given (a proxy of an earlier release).
    """

    scope: Scope
    requestID: str
    messages: tuple[ObservedMessage, ...] = attrs.field(repr=False)
    key: str = attrs.field(default=attrs.Factory(lambda self: self.requestID, takes_self=True))
    # When the observed answer ended (Observation.ended_at); None: when it
    # is queued (svcd/memory/forgetting.py).
    endedAt: datetime.datetime | None = None


@attrs.frozen
class QueuedObservation:
    """
    What queueing did with one observation: its id, and whether this call
    queued it (False: it was queued already, by an earlier call); or why
    it was not queued, for good (C{refused}, as memory.proto's
    QueuedObservation.refused; no id then).
    """

    requestID: str
    observationID: uuid.UUID | None
    queuedNow: bool
    key: str = attrs.field(default=attrs.Factory(lambda self: self.requestID, takes_self=True))
    refused: str = ""


@attrs.frozen
class ClaimedObservation:
    observationID: uuid.UUID
    scope: Scope
    requestID: str
    messages: tuple[ObservedMessage, ...] = attrs.field(repr=False)
    attempts: int
    leaseExpiresAt: datetime.datetime
    leaseToken: uuid.UUID | None = None


def checkScope(orgID: str, agentID: str, subject: str) -> Scope:
    """
    A scope from a request's texts.

    @raise InvalidMemory: an id that is not a UUID, a subject out of its
        pattern.
    """
    return Scope(checkUUID("org_id", orgID), checkUUID("agent_id", agentID), checkSubject(subject))


def checkUUID(field: str, text: str) -> uuid.UUID:
    parsed = parseUUID(text)
    if parsed is None:
        raise InvalidMemory(field, "must be a UUID")
    return parsed


def checkSubject(subject: str) -> str:
    if SUBJECT_PATTERN.fullmatch(subject) is None:
        raise InvalidMemory(
            "subject", "must be empty or 1 to 128 characters of A-Z a-z 0-9 . _ : @ -"
        )
    return subject


def checkContent(content: str) -> str:
    """
    The content trimmed of surrounding whitespace.

    @raise InvalidMemory: empty once trimmed, longer than 4,000
        characters, or holding a NUL (which PostgreSQL's text cannot).
    """
    trimmed = content.strip()
    if not trimmed:
        raise InvalidMemory("content", "must not be empty")
    if len(trimmed) > MAX_CONTENT_CHARACTERS:
        raise InvalidMemory("content", f"must be at most {MAX_CONTENT_CHARACTERS} characters")
    if "\x00" in trimmed:
        raise InvalidMemory("content", "must not contain NUL characters")
    return trimmed


def checkMetadata(text: str) -> str:
    """
    Metadata as the compact text of a JSON object; the empty text is the
    empty object.

    @raise InvalidMemory: not a JSON object, or over 4 KiB written
        compactly.
    """
    if not text.strip():
        return "{}"
    try:
        value: Any = json.loads(text, parse_constant=_refuseConstant)
    except (ValueError, RecursionError):
        raise InvalidMemory("metadata", "must be a JSON object") from None
    if not isinstance(value, dict):
        raise InvalidMemory("metadata", "must be a JSON object")
    compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if len(compact.encode("utf-8")) > MAX_METADATA_BYTES:
        raise InvalidMemory("metadata", f"must be at most {MAX_METADATA_BYTES} bytes as JSON")
    if "\\u0000" in compact:
        raise InvalidMemory("metadata", "must not contain NUL characters")
    return compact


def _refuseConstant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def checkQuery(model: str, vector: bytes) -> Query:
    """
    A search's query, by the rules of an embedding
    (L{svcd.memoryclient.records.checkEmbedding}), scaled to length 1: the
    sum of squares that checks it is the one that scales it, so a search
    passes over its query once, not once to check it and again to scale it
    (a tenth of a search of 1,000 memories).

    @raise InvalidMemory: as C{checkEmbedding}.
    """
    checkShape(model, vector)
    import numpy

    wide = numpy.frombuffer(vector, dtype="<f4").astype(numpy.float64)
    # Summed as normalisedRows sums a row (pairwise, in float64), divided
    # in float64 and rounded to float32 as it is: the same bits as a
    # cached row of the same vector, so that a memory searched by its own
    # vector scores what it always did.
    squares = float((wide * wide).sum())
    checkSquares(squares)
    wide /= math.sqrt(squares)
    return Query(model, wide.astype(numpy.float32))


def checkRequestID(field: str, text: str, required: bool) -> str | None:
    if not text:
        if required:
            raise InvalidMemory(field, "is required")
        return None
    if len(text) > MAX_REQUEST_ID_CHARACTERS or not text.isprintable():
        raise InvalidMemory(field, "must be 1 to 200 printable characters")
    return text


def checkEndedAt(text: str) -> datetime.datetime | None:
    """
    Observation.ended_at: an RFC 3339 time with its offset (the proxy
    writes UTC, C{Z}); None when empty.

    @raise InvalidMemory: not such a time.
    """
    if not text:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None or len(text) > 40:
        raise InvalidMemory("ended_at", "must be an RFC 3339 time with its offset, or empty")
    return moment


def checkSource(source: str) -> str:
    if source not in SOURCES:
        raise InvalidMemory("source", "must be api or extracted")
    return source


def checkObservedMessages(
    messages: list[tuple[str, str]],
) -> tuple[ObservedMessage, ...]:
    """
    @raise InvalidMemory: none, too many, a role other than user or
        assistant, or a content over 16 KiB (or holding a NUL).
    """
    if not messages:
        raise InvalidMemory("messages", "must hold at least one message")
    if len(messages) > MAX_OBSERVED_MESSAGES:
        raise InvalidMemory("messages", f"must hold at most {MAX_OBSERVED_MESSAGES} messages")
    checked = []
    for index, (role, content) in enumerate(messages):
        if role not in OBSERVED_ROLES:
            raise InvalidMemory(f"messages[{index}].role", "must be user or assistant")
        if len(content.encode("utf-8")) > MAX_OBSERVED_MESSAGE_BYTES:
            raise InvalidMemory(
                f"messages[{index}].content", f"must be at most {MAX_OBSERVED_MESSAGE_BYTES} bytes"
            )
        if "\x00" in content:
            raise InvalidMemory(f"messages[{index}].content", "must not contain NUL characters")
        checked.append(ObservedMessage(role, content))
    return tuple(checked)


def messagesJSON(messages: tuple[ObservedMessage, ...]) -> str:
    return json.dumps(
        [{"role": each.role, "content": each.content} for each in messages],
        separators=(",", ":"),
        ensure_ascii=False,
    )


def messagesFromJSON(value: Any) -> tuple[ObservedMessage, ...]:
    """
    Messages as the table's jsonb holds them (psycopg has parsed it).
    """
    return tuple(ObservedMessage(str(each["role"]), str(each["content"])) for each in value)
