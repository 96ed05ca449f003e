"""
Parsing and validating the body of POST /v1/chat/completions (spec 4.1,
decisions D4). Every failed rule is collected so the client sees all of
them in one VALIDATION_ERROR.

Only JSON that can be forwarded as standard JSON is accepted (decisions
D10): Python's parser takes C{1e999999} for infinity and C{"\\ud800"} for
a string holding a lone surrogate, neither of which standard JSON (or
UTF-8) can carry on to a provider. Both are refused where the body is
parsed, anywhere in it (keys and unknown keys too), with 400 INVALID_JSON.
The checks are cheap on an ordinary body: a number is checked as it is
parsed (only numbers with a fraction or an exponent are), and the parsed
document is searched for surrogates only when the raw bytes hold a
backslash, without which no escape, and so no surrogate, can be there
(and, in a small body, a C{\\uD800} to C{\\uDFFF} escape).

A message's C{content} is a string (spec 4.1). For a model of an
Anthropic provider (decisions D14), whose body the gateway translates and
so reads whole, it may also be an array of text parts and of image parts
whose URL is a C{data:} URL of a base64 image (Anthropic's base64 image
blocks; the gateway fetches no URL for a provider), and an assistant
message with C{tool_calls} may have no content (as OpenAI's SDKs send the
message of a tool call back): L{checkChatDocument}'s C{parts}. Every other
provider is sent the body as the client wrote it, and keeps the rule it
always had.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

import attrs

from svcd.common.errors import (
    ApiError,
    ErrorCode,
    FieldError,
    FieldErrorCode,
    validationError,
)

MAX_MODEL_CHARACTERS = 256
MAX_MESSAGES = 1000
MAX_CONTENT_BYTES = 100 * 1024
# OpenAI's bound on C{n}, the number of choices asked for.
MAX_CHOICES = 128
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_ROLES_TEXT = "must be one of " + ", ".join(sorted(ROLES))

_REQUIRED = FieldErrorCode.REQUIRED
_FORMAT = FieldErrorCode.INVALID_FORMAT
# Decisions D14: the images a content part may carry, as Anthropic takes
# them in base64 (svcd.dialects.turns.IMAGE_MEDIA_TYPES).
_DATA_URL = re.compile(r"data:image/(?:jpeg|png|gif|webp);base64,[A-Za-z0-9+/]*={0,2}")
_PART_TYPES = "must be a text part or an image_url part"


@attrs.frozen
class ChatRequest:
    """
    The metadata of a valid chat body; the messages themselves are kept
    for the provider call of a later phase and never logged.
    """

    model: str
    messages: list[dict[str, Any]] = attrs.field(repr=False)
    stream: bool = False
    temperature: float | None = None
    maxTokens: int | None = None
    # Decisions D12, amended: the newer output cap, and how many choices
    # the answer has (each up to the cap).
    maxCompletionTokens: int | None = None
    choices: int = 1
    # The whole JSON object as the client sent it, unknown keys included:
    # what is forwarded to a provider (decisions D9).
    document: dict[str, Any] = attrs.field(factory=dict, repr=False)


def _refuseConstant(name: str) -> Any:
    # NaN, Infinity and -Infinity are not JSON.
    raise ValueError(f"{name} is not JSON")


def _finiteFloat(text: str) -> float:
    # Called for each number with a fraction or an exponent only.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("a number too large for a double")
    return value


# An escape that could decode to a surrogate code point.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Up to this size the raw bytes are searched for such an escape before the
# document is walked; past it, the search would cost more than the walk
# (measured: about a millisecond per MiB of text with newlines, each escaped
# newline being a false start, against a few microseconds for the walk over
# a chat body's few long ASCII strings).
_SEARCH_BELOW = 16 * 1024


def _holdsSurrogate(text: str) -> bool:
    # Strict UTF-8 refuses surrogates; measured two to five times faster
    # than a regular expression looking for one.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _holdsLoneSurrogate(document: object) -> bool:
    """
    Whether a string anywhere in C{document}, key or value, holds a
    surrogate code point: the parser joins an escaped pair into one
    character, so any left is a lone one. Iterative: a document may nest
    as deep as the parser allows.

    Its cost follows the number of values, not bytes: an ASCII string is
    passed over without reading it (C{isascii} is a flag of the string),
    and scalars are looked at once, in their container's loop.
    """
    if type(document) is str:
        return not document.isascii() and _holdsSurrogate(document)
    pending = [document]
    while pending:
        container = pending.pop()
        items: Iterable[object]
        if type(container) is dict:
            for key in container:
                if not key.isascii() and _holdsSurrogate(key):
                    return True
            items = container.values()
        elif type(container) is list:
            items = container
        else:
            continue
        for item in items:
            kind = type(item)
            if kind is str:
                if not item.isascii() and _holdsSurrogate(item):
                    return True
            elif kind is dict or kind is list:
                pending.append(item)
    return False


def _contentTooLong(content: str) -> bool:
    # Cheap bounds first: a character is 1 to 4 bytes of UTF-8.
    if len(content) * 4 <= MAX_CONTENT_BYTES:
        return False
    if len(content) > MAX_CONTENT_BYTES:
        return True
    # surrogatepass: lone surrogates were refused with the JSON (decisions
    # D10); should one come through, it counts its 3 bytes, not a 500.
    return len(content.encode("utf-8", "surrogatepass")) > MAX_CONTENT_BYTES


def _isNumber(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parseJSONObject(body: bytes) -> dict[str, Any]:
    """
    The JSON object of a request's body, by the rules every body of the
    edge follows (decisions D10): the chat body's and the embeddings
    body's (L{svcd.proxy.http.embeddingsbody}).

    @raise ApiError: 400 INVALID_JSON when the body is not UTF-8 JSON, or
        holds a number that is not finite or a lone surrogate; 400
        VALIDATION_ERROR on C{body} when it is JSON but not an object.
    """
    try:
        document = json.loads(
            body.decode("utf-8"), parse_constant=_refuseConstant, parse_float=_finiteFloat
        )
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ApiError(ErrorCode.INVALID_JSON) from None
    # Raw surrogate bytes are not UTF-8, so only a \u escape can make a
    # surrogate: without a backslash (a memchr) there is none; a small body
    # is searched for a surrogate escape before the walk (see above).
    if (
        b"\\" in body
        and (len(body) > _SEARCH_BELOW or _SURROGATE_ESCAPE.search(body) is not None)
        and _holdsLoneSurrogate(document)
    ):
        raise ApiError(ErrorCode.INVALID_JSON)
    if not isinstance(document, dict):
        raise validationError([FieldError("body", _FORMAT, "must be a JSON object")])
    return document


def checkModel(document: dict[str, Any], errors: list[FieldError]) -> None:
    """
    The rules of C{model}, which every body that names one follows.
    """
    model = document.get("model")
    if model is None:
        errors.append(FieldError("model", _REQUIRED, "is required"))
    elif not isinstance(model, str):
        errors.append(FieldError("model", _FORMAT, "must be a string"))
    elif len(model) > MAX_MODEL_CHARACTERS:
        errors.append(
            FieldError(
                "model",
                FieldErrorCode.TOO_LONG,
                f"must be at most {MAX_MODEL_CHARACTERS} characters",
            )
        )


def parseChatBody(body: bytes, *, parts: bool = False) -> ChatRequest:
    """
    Parse and validate a chat body.

    A JSON C{null} counts as a missing field.

    @param parts: whether content may be text and image parts (decisions
        D14, L{checkChatDocument}).
    @raise ApiError: 400 INVALID_JSON when the body is not UTF-8 JSON, or
        holds a number that is not finite or a lone surrogate (decisions
        D10); 400 VALIDATION_ERROR listing every failed rule otherwise.
    """
    return checkChatDocument(parseJSONObject(body), parts=parts)


def checkChatDocument(document: dict[str, Any], *, parts: bool = False) -> ChatRequest:
    """
    Validate a chat body's JSON object (L{parseJSONObject}'s).

    @param parts: whether a message's content may be an array of text
        parts and base64 image parts, and an assistant message with
        C{tool_calls} may have none: for a model of an Anthropic provider
        (decisions D14), whose body is translated; else content is a
        string.
    @raise ApiError: 400 VALIDATION_ERROR listing every failed rule.
    """
    errors: list[FieldError] = []
    checkModel(document, errors)
    model = document.get("model")

    messages = document.get("messages")
    if messages is None or (isinstance(messages, list) and not messages):
        errors.append(FieldError("messages", _REQUIRED, "must hold at least one message"))
    elif not isinstance(messages, list):
        errors.append(FieldError("messages", _FORMAT, "must be an array"))
    elif len(messages) > MAX_MESSAGES:
        # The items are not checked: that could list thousands of errors.
        errors.append(
            FieldError(
                "messages",
                FieldErrorCode.TOO_MANY,
                f"must hold at most {MAX_MESSAGES} messages",
            )
        )
    else:
        for index, message in enumerate(messages):
            _checkMessage(index, message, errors, parts)

    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        errors.append(FieldError("stream", _FORMAT, "must be a boolean"))
    temperature = document.get("temperature")
    if temperature is not None and not _isNumber(temperature):
        errors.append(FieldError("temperature", _FORMAT, "must be a number"))
    maxTokens = _checkCap(document, "max_tokens", errors)
    maxCompletionTokens = _checkCap(document, "max_completion_tokens", errors)
    choices = document.get("n")
    if choices is not None:
        if not isInteger(choices):
            errors.append(FieldError("n", _FORMAT, "must be an integer"))
        elif choices < 1:
            errors.append(FieldError("n", _FORMAT, "must be at least 1"))
        elif choices > MAX_CHOICES:
            errors.append(
                FieldError("n", FieldErrorCode.TOO_MANY, f"must be at most {MAX_CHOICES}")
            )

    if errors:
        raise validationError(errors)
    assert isinstance(model, str) and isinstance(messages, list)
    return ChatRequest(
        model=model,
        messages=messages,
        stream=bool(stream),
        temperature=float(temperature) if temperature is not None else None,
        maxTokens=maxTokens,
        maxCompletionTokens=maxCompletionTokens,
        choices=choices if choices is not None else 1,
        document=document,
    )


def isInteger(value: object) -> bool:
    # A boolean is an int in Python, never a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _checkCap(document: dict[str, Any], name: str, errors: list[FieldError]) -> int | None:
    """
    An output cap of the request (C{max_tokens}, C{max_completion_tokens}):
    an integer of at least 1 when given (decisions D12, amended: a cap the
    gateway cannot read is one a budget cannot bound; providers refuse
    the same). Its ceiling depends on the model, checked by the edge.
    """
    value = document.get(name)
    if value is None:
        return None
    if not isInteger(value):
        errors.append(FieldError(name, _FORMAT, "must be an integer"))
        return None
    if value < 1:
        errors.append(FieldError(name, _FORMAT, "must be at least 1"))
        return None
    assert isinstance(value, int)
    return value


def _checkMessage(index: int, message: object, errors: list[FieldError], parts: bool) -> None:
    path = f"messages[{index}]"
    if not isinstance(message, dict):
        errors.append(FieldError(path, _FORMAT, "must be an object"))
        return
    role = message.get("role")
    if role is None:
        errors.append(FieldError(path + ".role", _REQUIRED, "is required"))
    elif not isinstance(role, str) or role not in ROLES:
        errors.append(
            FieldError(
                path + ".role",
                FieldErrorCode.INVALID_ENUM,
                _ROLES_TEXT,
            )
        )
    content = message.get("content")
    if parts and not isinstance(content, str):
        _checkParts(path, message, content, errors)
    elif content is None:
        errors.append(FieldError(path + ".content", _REQUIRED, "is required"))
    elif not isinstance(content, str):
        errors.append(FieldError(path + ".content", _FORMAT, "must be a string"))
    elif _contentTooLong(content):
        errors.append(
            FieldError(
                path + ".content",
                FieldErrorCode.TOO_LONG,
                f"must be at most {MAX_CONTENT_BYTES} bytes of UTF-8",
            )
        )


def _checkParts(
    path: str, message: dict[str, Any], content: object, errors: list[FieldError]
) -> None:
    """
    The content of a message to a model of an Anthropic provider that is
    not a string (decisions D14): none beside an assistant's tool calls,
    else a non-empty array of text parts (their text at most
    L{MAX_CONTENT_BYTES} in all) and image parts of a base64 C{data:} URL.
    """
    where = path + ".content"
    if content is None:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list) or not calls:
            errors.append(FieldError(where, _REQUIRED, "is required"))
        return
    if not isinstance(content, list):
        errors.append(FieldError(where, _FORMAT, "must be a string or an array of parts"))
        return
    if not content:
        errors.append(FieldError(where, _REQUIRED, "must hold at least one part"))
        return
    textBytes = 0
    for number, part in enumerate(content):
        at = f"{where}[{number}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            assert isinstance(part, dict)
            text = part.get("text")
            if not isinstance(text, str):
                errors.append(FieldError(at + ".text", _FORMAT, "must be a string"))
            else:
                textBytes += len(text.encode("utf-8", "surrogatepass"))
        elif kind == "image_url":
            assert isinstance(part, dict)
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else None
            if not isinstance(url, str) or not _DATA_URL.fullmatch(url):
                errors.append(
                    FieldError(
                        at + ".image_url.url",
                        _FORMAT,
                        "must be a data: URL of a base64 JPEG, PNG, GIF or WebP image",
                    )
                )
        else:
            errors.append(FieldError(at, _FORMAT, _PART_TYPES))
    if textBytes > MAX_CONTENT_BYTES:
        errors.append(
            FieldError(
                where,
                FieldErrorCode.TOO_LONG,
                f"must hold at most {MAX_CONTENT_BYTES} bytes of UTF-8 text",
            )
        )
