"""
What svc-memory stores and the rules a memory obeys (decisions D13), as
plain values shared by the store, the servicer, the client and svcctl.

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

# A memory's content: 1 to this many characters once trimmed.
MAX_CONTENT_CHARACTERS = 4000
# Its metadata: a JSON object of at most this many bytes, written compactly.
MAX_METADATA_BYTES = 4096
# A subject: empty (the default) or 1 to 128 of these characters, as the
# proxy's X-SVC-Memory-Subject header.
SUBJECT_PATTERN = re.compile(r"[A-Za-z0-9._:@-]{0,128}")
MAX_MODEL_CHARACTERS = 200
MAX_DIMENSIONS = 16384
MAX_REQUEST_ID_CHARACTERS = 200
# An observation (decisions D13): the user's messages after the last
# assistant message and the answer, each at most 16 KiB.
MAX_OBSERVED_MESSAGES = 64
MAX_OBSERVED_MESSAGE_BYTES = 16 * 1024
OBSERVED_ROLES = ("user", "assistant")
# Where a memory came from: a caller of the API, or svc-worker.
API = "api"

# The details of svc-memory's PERMISSION_DENIED for a memory of another
# organization, agent or subject: how its clients tell that refusal (403)
# from a caller's certificate not admitted (a fault of the deployment).
FORBIDDEN_DETAILS = "the id belongs to another organization, agent or subject"
# The details of svc-memory's NOT_FOUND for an observation that a deletion
# of its scope or agent took (decisions D13, amended): how svc-worker tells
# it from one dropped by an operator (svcd/memory/forgetting.py).
FORGOTTEN_DETAILS = "the observation was forgotten"
EXTRACTED = "extracted"
SOURCES = (API, EXTRACTED)
# The problem of an embedding whose length is not that of the scope's other
# vectors of its model (decisions D13 amended, "Vectors never mix"):
# svc-memory's INVALID_ARGUMENT on the field "embedding", which svc-proxy
# answers 502 UPSTREAM_ERROR (a provider made the vector), never 400.
OTHER_LENGTH = "is not the length of the scope's other vectors of its model"
MAX_REASON_CHARACTERS = 500


class InvalidMemory(ValueError):
    """
    A value a memory (or a call about memories) cannot take; C{field}
    names it, the message says why without quoting it (it may be content).
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


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
class Scope:
    """
    Whose memories: an organization, one of its agents, and a subject
    within the agent ("" by default). Nothing of one scope is ever shown to
    another.
    """

    orgID: uuid.UUID
    agentID: uuid.UUID
    subject: str = attrs.field(default="", repr=False)


@attrs.frozen
class Embedding:
    """
    A vector and the model that made it; C{vector} is its float32
    components, little-endian (as the table and an OpenAI base64 embedding
    hold them).
    """

    model: str
    vector: bytes = attrs.field(repr=False)

    @property
    def dimensions(self) -> int:
        return len(self.vector) // 4


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
class ObservedMessage:
    role: str
    content: str = attrs.field(repr=False)


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


# QueuedObservation.refused of an observation past its organization's
# SVC_MEMORY_MAX_WAITING_PER_ORG waiting (decisions D13, amended).
QUEUE_FULL = "queue_full"


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


def checkEmbedding(model: str, vector: bytes) -> Embedding:
    """
    @raise InvalidMemory: no model, a vector that is not whole float32
        components, has none, too many, a component that is not finite,
        or is all zeros (it has no direction to compare).
    """
    _checkShape(model, vector)
    # Imported here, not at the top: svcctl reads this module for its
    # memory commands, and numpy would add a fifth of a second to every
    # svcctl command (the daemon has it imported long before).
    import numpy

    # One sum of squares in float64 tells both: it is not finite exactly
    # when a component is not (a float32's square cannot overflow a
    # float64, nor can 16,384 of them), and zero exactly when all are.
    components = numpy.frombuffer(vector, dtype="<f4").astype(numpy.float64)
    _checkSquares(float(components @ components))
    return Embedding(model, bytes(vector))


def checkQuery(model: str, vector: bytes) -> Query:
    """
    A search's query, by L{checkEmbedding}'s rules, scaled to length 1:
    the sum of squares that checks it is the one that scales it, so a
    search passes over its query once, not once to check it and again to
    scale it (a tenth of a search of 1,000 memories).

    @raise InvalidMemory: as L{checkEmbedding}.
    """
    _checkShape(model, vector)
    import numpy

    wide = numpy.frombuffer(vector, dtype="<f4").astype(numpy.float64)
    # Summed as normalisedRows sums a row (pairwise, in float64), divided
    # in float64 and rounded to float32 as it is: the same bits as a
    # cached row of the same vector, so that a memory searched by its own
    # vector scores what it always did.
    squares = float((wide * wide).sum())
    _checkSquares(squares)
    wide /= math.sqrt(squares)
    return Query(model, wide.astype(numpy.float32))


def _checkShape(model: str, vector: bytes) -> None:
    if not model or len(model) > MAX_MODEL_CHARACTERS or "\x00" in model:
        raise InvalidMemory("embedding.model", "must be 1 to 200 characters")
    if not vector or len(vector) % 4:
        raise InvalidMemory("embedding.vector", "must be float32 components (4 bytes each)")
    if len(vector) // 4 > MAX_DIMENSIONS:
        raise InvalidMemory("embedding.vector", f"must have at most {MAX_DIMENSIONS} components")


def _checkSquares(squares: float) -> None:
    if not math.isfinite(squares):
        raise InvalidMemory("embedding.vector", "must have finite components")
    if squares == 0.0:
        raise InvalidMemory("embedding.vector", "must not be all zeros")


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
