"""
Parsing and validating what the memory routes read (decisions D13): the
bodies of C{POST /v1/memories}, C{PATCH /v1/memories/{id}} and C{POST
/v1/memories/search}, the query of C{GET /v1/memories}, a memory id in a
path. As for a chat body, every failed rule is collected so that the
client sees all of them in one VALIDATION_ERROR, the JSON follows the
rules of every body of the edge (decisions D10,
L{svcd.proxy.http.chatbody.parseJSONObject}), and a JSON C{null} counts
as a missing field.

A memory's rules are svc-memory's own (L{svcd.memoryclient.records}: content
1 to 4,000 characters once trimmed, metadata a JSON object of at most 4
KiB written compactly), checked here before anything is embedded, so that
a refused memory costs no provider call.

C{{"messages"}} on C{POST /v1/memories} is a conversation to learn from
(an observation for svc-worker): chat messages in OpenAI's shape, whose
text is kept for the roles C{user} and C{assistant} (a string content, or
the C{text} parts of an array joined by newlines), the others skipped as
instructions rather than facts; at least one user message with text, at
most 64 kept, each at most 16 KiB.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from svcd.common.errors import FieldError, FieldErrorCode, validationError
from svcd.common.ids import canonicalUUID
from svcd.memoryclient.records import (
    MAX_CONTENT_CHARACTERS,
    MAX_METADATA_BYTES,
    MAX_OBSERVED_MESSAGE_BYTES,
    MAX_OBSERVED_MESSAGES,
    OBSERVED_ROLES,
    ObservedMessage,
)
from svcd.proxy.http.chatbody import isInteger, parseJSONObject

# A search: how many memories at most, by default and at most; its query's
# length (a recall's query is a message's first 8,000 characters too).
DEFAULT_K = 5
MAX_K = 50
MAX_QUERY_CHARACTERS = 8000
# A list: its page's size, by default and at most.
DEFAULT_LIMIT = 20
MAX_LIMIT = 100
# The roles of a conversation's messages: those whose text an observation
# keeps (OBSERVED_ROLES), and those skipped.
SKIPPED_ROLES = ("system", "developer", "tool", "function")
# How a search ranks (decisions D13, "Hybrid search"), the first the default.
SEARCH_MODES = ("vector", "text", "hybrid")

_REQUIRED = FieldErrorCode.REQUIRED
_FORMAT = FieldErrorCode.INVALID_FORMAT
_TOO_LONG = FieldErrorCode.TOO_LONG


@attrs.frozen
class NewMemory:
    """
    A memory to store: its content trimmed, its metadata's compact JSON.
    """

    content: str = attrs.field(repr=False)
    metadataJSON: str = attrs.field(repr=False)


@attrs.frozen
class Conversation:
    """
    A conversation to learn from: the messages an observation keeps.
    """

    messages: tuple[ObservedMessage, ...] = attrs.field(repr=False)


@attrs.frozen
class MemoryChange:
    """
    What C{PATCH} changes: the new content (trimmed) and/or metadata, None
    for what stays.
    """

    content: str | None = attrs.field(repr=False)
    metadataJSON: str | None = attrs.field(repr=False)


@attrs.frozen
class MemorySearch:
    """
    A search: C{minScore} is kept in vector mode only (decisions D13: in
    text and hybrid modes it is accepted and ignored, their scores being
    no cosine similarities).
    """

    query: str = attrs.field(repr=False)
    k: int = DEFAULT_K
    minScore: float | None = None
    mode: str = SEARCH_MODES[0]


@attrs.frozen
class MemoryPage:
    """
    Which page of a list: at most C{limit} memories after the memory
    C{after} (None: from the newest).
    """

    limit: int = DEFAULT_LIMIT
    after: str | None = None


def _content(value: object, errors: list[FieldError]) -> str | None:
    """
    C{content} trimmed, or None after appending its fault to C{errors}.
    """
    if not isinstance(value, str):
        errors.append(FieldError("content", _FORMAT, "must be a string"))
        return None
    trimmed = value.strip()
    if not trimmed:
        errors.append(FieldError("content", _REQUIRED, "must not be empty"))
        return None
    if len(trimmed) > MAX_CONTENT_CHARACTERS:
        errors.append(
            FieldError(
                "content", _TOO_LONG, f"must be at most {MAX_CONTENT_CHARACTERS:,} characters"
            )
        )
        return None
    if "\x00" in trimmed:
        errors.append(FieldError("content", _FORMAT, "must not contain NUL characters"))
        return None
    return trimmed


def _metadata(value: object, errors: list[FieldError]) -> str | None:
    """
    C{metadata}'s compact JSON, or None after appending its fault.
    """
    if not isinstance(value, dict):
        errors.append(FieldError("metadata", _FORMAT, "must be a JSON object"))
        return None
    compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if len(compact.encode("utf-8", "surrogatepass")) > MAX_METADATA_BYTES:
        errors.append(
            FieldError(
                "metadata", _TOO_LONG, f"must be at most {MAX_METADATA_BYTES:,} bytes as JSON"
            )
        )
        return None
    if "\\u0000" in compact:
        errors.append(FieldError("metadata", _FORMAT, "must not contain NUL characters"))
        return None
    return compact


def _messageText(content: object) -> str | None:
    """
    The text of a message's content: a string, or the text parts of an
    array joined by newlines; None when it is neither.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict):
            return None
        if part.get("type") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
    return "\n".join(texts)


def _conversation(value: object, errors: list[FieldError]) -> tuple[ObservedMessage, ...]:
    if not isinstance(value, list):
        errors.append(FieldError("messages", _FORMAT, "must be an array of messages"))
        return ()
    if not value:
        errors.append(FieldError("messages", _REQUIRED, "must hold at least one message"))
        return ()
    if len(value) > 4 * MAX_OBSERVED_MESSAGES:
        # The items are not checked: that could list hundreds of errors.
        errors.append(
            FieldError(
                "messages",
                FieldErrorCode.TOO_MANY,
                f"must hold at most {MAX_OBSERVED_MESSAGES} user and assistant messages",
            )
        )
        return ()
    before = len(errors)
    kept: list[ObservedMessage] = []
    for index, message in enumerate(value):
        path = f"messages[{index}]"
        if not isinstance(message, dict):
            errors.append(FieldError(path, _FORMAT, "must be an object"))
            continue
        role = message.get("role")
        if role not in OBSERVED_ROLES and role not in SKIPPED_ROLES:
            errors.append(
                FieldError(
                    f"{path}.role",
                    FieldErrorCode.INVALID_ENUM,
                    "must be one of " + ", ".join((*OBSERVED_ROLES, *SKIPPED_ROLES)),
                )
            )
            continue
        if role in SKIPPED_ROLES:
            continue
        text = _messageText(message.get("content"))
        if text is None:
            errors.append(
                FieldError(
                    f"{path}.content", _FORMAT, "must be a string or an array of content parts"
                )
            )
        elif len(text.encode("utf-8", "surrogatepass")) > MAX_OBSERVED_MESSAGE_BYTES:
            errors.append(
                FieldError(
                    f"{path}.content",
                    _TOO_LONG,
                    f"must be at most {MAX_OBSERVED_MESSAGE_BYTES:,} bytes of text",
                )
            )
        elif "\x00" in text:
            errors.append(FieldError(f"{path}.content", _FORMAT, "must not contain NUL characters"))
        elif text.strip():
            kept.append(ObservedMessage(str(role), text))
    if len(errors) != before:
        return ()
    if len(kept) > MAX_OBSERVED_MESSAGES:
        errors.append(
            FieldError(
                "messages",
                FieldErrorCode.TOO_MANY,
                f"must hold at most {MAX_OBSERVED_MESSAGES} user and assistant messages",
            )
        )
        return ()
    if not any(message.role == "user" for message in kept):
        errors.append(
            FieldError("messages", _REQUIRED, "must hold at least one user message with text")
        )
        return ()
    return tuple(kept)


def parseAddBody(body: bytes) -> NewMemory | Conversation:
    """
    The body of C{POST /v1/memories}: C{{"content", "metadata"?}}, a
    memory, or C{{"messages"}}, a conversation to learn from (not both).

    @raise ApiError: 400 INVALID_JSON or VALIDATION_ERROR.
    """
    document = parseJSONObject(body)
    errors: list[FieldError] = []
    content = document.get("content")
    messages = document.get("messages")
    metadata = document.get("metadata")
    if messages is not None:
        if content is not None:
            errors.append(
                FieldError("messages", _FORMAT, "must not be given with content: send one")
            )
        if metadata is not None:
            errors.append(
                FieldError("metadata", _FORMAT, "is taken with content, not with messages")
            )
        kept = _conversation(messages, errors)
        if errors:
            raise validationError(errors)
        return Conversation(kept)
    if content is None:
        errors.append(FieldError("content", _REQUIRED, "is required (or messages)"))
    else:
        content = _content(content, errors)
    metadataJSON = "{}" if metadata is None else _metadata(metadata, errors)
    if errors:
        raise validationError(errors)
    assert isinstance(content, str) and metadataJSON is not None
    return NewMemory(content, metadataJSON)


def parsePatchBody(body: bytes) -> MemoryChange:
    """
    The body of C{PATCH /v1/memories/{id}}: C{{"content"?, "metadata"?}},
    at least one of them.

    @raise ApiError: 400 INVALID_JSON or VALIDATION_ERROR.
    """
    document = parseJSONObject(body)
    errors: list[FieldError] = []
    content = document.get("content")
    metadata = document.get("metadata")
    if content is None and metadata is None:
        errors.append(FieldError("content", _REQUIRED, "content or metadata is required"))
        raise validationError(errors)
    newContent = _content(content, errors) if content is not None else None
    metadataJSON = _metadata(metadata, errors) if metadata is not None else None
    if errors:
        raise validationError(errors)
    return MemoryChange(newContent, metadataJSON)


def _isNumber(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parseSearchBody(body: bytes) -> MemorySearch:
    """
    The body of C{POST /v1/memories/search}: C{{"query", "k"?: 1..50
    (default 5), "min_score"?: -1..1, "mode"?: "vector" | "text" |
    "hybrid"}}.

    @raise ApiError: 400 INVALID_JSON or VALIDATION_ERROR.
    """
    document = parseJSONObject(body)
    errors: list[FieldError] = []
    query = document.get("query")
    if query is None:
        errors.append(FieldError("query", _REQUIRED, "is required"))
    elif not isinstance(query, str):
        errors.append(FieldError("query", _FORMAT, "must be a string"))
    elif not query.strip():
        errors.append(FieldError("query", _REQUIRED, "must not be empty"))
    elif len(query) > MAX_QUERY_CHARACTERS:
        errors.append(
            FieldError("query", _TOO_LONG, f"must be at most {MAX_QUERY_CHARACTERS:,} characters")
        )
    k = document.get("k")
    if k is None:
        k = DEFAULT_K
    elif not isInteger(k):
        errors.append(FieldError("k", _FORMAT, "must be an integer"))
    elif not 1 <= k <= MAX_K:
        errors.append(FieldError("k", FieldErrorCode.TOO_MANY, f"must be 1 to {MAX_K}"))
    minScore = document.get("min_score")
    if minScore is not None and (not _isNumber(minScore) or not -1 <= minScore <= 1):
        errors.append(FieldError("min_score", _FORMAT, "must be a number from -1 to 1"))
    mode = document.get("mode")
    if mode is None:
        mode = SEARCH_MODES[0]
    elif mode not in SEARCH_MODES:
        errors.append(
            FieldError(
                "mode", FieldErrorCode.INVALID_ENUM, "must be one of " + ", ".join(SEARCH_MODES)
            )
        )
    if errors:
        raise validationError(errors)
    assert isinstance(query, str) and isinstance(k, int) and isinstance(mode, str)
    if mode != "vector":
        minScore = None
    return MemorySearch(query, k, float(minScore) if minScore is not None else None, mode)


def parseMemoryID(text: str) -> str:
    """
    A memory id of a path, canonical (a UUID, lower case).

    @raise ApiError: 400 VALIDATION_ERROR on C{id} when it is not a UUID.
    """
    memoryID = canonicalUUID(text)
    if memoryID is None:
        raise validationError([FieldError("id", _FORMAT, "must be a UUID")])
    return memoryID


def parseListQuery(args: Mapping[bytes, Sequence[bytes]]) -> MemoryPage:
    """
    The query of C{GET /v1/memories}: C{limit} (1 to 100, default 20) and
    C{after} (a memory id); other parameters are ignored.

    @raise ApiError: 400 VALIDATION_ERROR naming each bad parameter.
    """
    errors: list[FieldError] = []
    limit = DEFAULT_LIMIT
    after = None
    limits = args.get(b"limit")
    if limits is not None:
        text = limits[0] if len(limits) == 1 else b""
        if not (text.isdigit() and len(text) <= 4 and 1 <= int(text) <= MAX_LIMIT):
            errors.append(FieldError("limit", _FORMAT, f"must be an integer from 1 to {MAX_LIMIT}"))
        else:
            limit = int(text)
    afters = args.get(b"after")
    if afters is not None:
        value = afters[0].decode("latin-1") if len(afters) == 1 else ""
        after = canonicalUUID(value) if value.isascii() else None
        if after is None:
            errors.append(FieldError("after", _FORMAT, "must be a memory id"))
    if errors:
        raise validationError(errors)
    return MemoryPage(limit, after)


def memoryJSON(memory: Any) -> dict[str, Any]:
    """
    A memory as the routes answer it (decisions D13), from svc-memory's
    message: never its vector, nor the model that made it.
    """
    return {
        "id": memory.id,
        "object": "memory",
        "agent_id": memory.agent_id,
        "subject": memory.subject,
        "content": memory.content,
        "metadata": json.loads(memory.metadata_json) if memory.metadata_json else {},
        "source": memory.source,
        "created_at": memory.created_at,
        "updated_at": memory.updated_at,
    }
