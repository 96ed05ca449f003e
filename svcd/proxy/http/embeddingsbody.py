"""
Parsing and validating the body of POST /v1/embeddings (decisions D13),
in OpenAI's shape: C{{"model", "input", "encoding_format"?, "dimensions"?,
"user"?}}. As for a chat body, every failed rule is collected so the client
sees all of them in one VALIDATION_ERROR, and the JSON itself follows the
rules of every body of the edge (decisions D10,
L{svcd.proxy.http.chatbody.parseJSONObject}).

C{input} is a string, or an array of 1 to L{MAX_INPUTS} strings, none of
them empty. OpenAI also takes token arrays (an array of integers, or an
array of such arrays); the gateway does not. The token ids of one
tokenizer mean nothing to a fallback of another, the estimate a limit or
a budget reserves is made from text (decisions D11), and a text of the
ids can be sent as well: a token array is refused with a field error that
says so, on C{input}, and nothing is forwarded.

The inputs' estimate is D11's rule per input (its UTF-8 bytes divided by
3, rounded up), summed; past L{MAX_ESTIMATED_TOKENS} (OpenAI's limit on
one request's inputs) the request is refused on C{input}, TOO_LONG.

Unknown keys are kept and forwarded, as the chat body's are.
"""

from __future__ import annotations

from typing import Any

import attrs

from svcd.common.errors import FieldError, FieldErrorCode, validationError
from svcd.limits.reservation import inputsEstimate
from svcd.proxy.http.chatbody import checkModel, isInteger, parseJSONObject

# OpenAI's bounds on one embeddings request: its inputs, and their tokens.
MAX_INPUTS = 2048
MAX_ESTIMATED_TOKENS = 300_000
ENCODING_FORMATS = ("float", "base64")

_REQUIRED = FieldErrorCode.REQUIRED
_FORMAT = FieldErrorCode.INVALID_FORMAT
_INPUT_RULE = "must be a string or an array of strings"


@attrs.frozen
class EmbeddingsRequest:
    """
    The metadata of a valid embeddings body; the inputs themselves are
    kept for the provider and for the estimate, never logged.

    @ivar inputs: the input as a list (one string for a string input).
    @ivar encodingFormat: C{"float"}, C{"base64"} or None when not named
        (the provider's default, float for OpenAI).
    @ivar document: the whole JSON object as the client sent it, unknown
        keys included: what is forwarded.
    """

    model: str
    inputs: tuple[str, ...] = attrs.field(repr=False)
    encodingFormat: str | None = None
    dimensions: int | None = None
    document: dict[str, Any] = attrs.field(factory=dict, repr=False)


def _isTokenArray(value: list[Any]) -> bool:
    """
    Whether C{value} is a token array as OpenAI takes one: integers, or
    arrays of integers.
    """
    return all(
        isInteger(item) or (isinstance(item, list) and all(isInteger(each) for each in item))
        for item in value
    ) and any(isInteger(item) or item for item in value)


def _checkInput(value: object, errors: list[FieldError]) -> tuple[str, ...]:
    """
    The inputs of C{input}, every fault of it appended to C{errors} (then
    the inputs are empty).
    """
    if value is None:
        errors.append(FieldError("input", _REQUIRED, "is required"))
        return ()
    if isinstance(value, str):
        if not value:
            errors.append(FieldError("input", _REQUIRED, "must not be an empty string"))
            return ()
        return (value,)
    if not isinstance(value, list):
        errors.append(FieldError("input", _FORMAT, _INPUT_RULE))
        return ()
    if not value:
        errors.append(FieldError("input", _REQUIRED, "must hold at least one string"))
        return ()
    if len(value) > MAX_INPUTS:
        # The items are not checked: that could list thousands of errors.
        errors.append(
            FieldError("input", FieldErrorCode.TOO_MANY, f"must hold at most {MAX_INPUTS} strings")
        )
        return ()
    if _isTokenArray(value):
        errors.append(
            FieldError(
                "input",
                _FORMAT,
                _INPUT_RULE + "; token arrays (arrays of integers) are not accepted,"
                " send the text instead",
            )
        )
        return ()
    before = len(errors)
    for index, item in enumerate(value):
        if not isinstance(item, str):
            errors.append(FieldError(f"input[{index}]", _FORMAT, "must be a string"))
        elif not item:
            errors.append(FieldError(f"input[{index}]", _REQUIRED, "must not be an empty string"))
    return tuple(value) if len(errors) == before else ()


def parseEmbeddingsBody(body: bytes) -> EmbeddingsRequest:
    """
    Parse and validate an embeddings body.

    A JSON C{null} counts as a missing field.

    @raise ApiError: 400 INVALID_JSON when the body is not UTF-8 JSON, or
        holds a number that is not finite or a lone surrogate (decisions
        D10); 400 VALIDATION_ERROR listing every failed rule otherwise.
    """
    document = parseJSONObject(body)
    errors: list[FieldError] = []
    checkModel(document, errors)
    inputs = _checkInput(document.get("input"), errors)
    if inputs and inputsEstimate(inputs) > MAX_ESTIMATED_TOKENS:
        errors.append(
            FieldError(
                "input",
                FieldErrorCode.TOO_LONG,
                f"must be at most {MAX_ESTIMATED_TOKENS:,} tokens in all (estimated as"
                " the UTF-8 bytes of each string divided by 3)",
            )
        )
    encodingFormat = document.get("encoding_format")
    if encodingFormat is not None and encodingFormat not in ENCODING_FORMATS:
        errors.append(
            FieldError(
                "encoding_format",
                FieldErrorCode.INVALID_ENUM,
                "must be one of " + ", ".join(ENCODING_FORMATS),
            )
        )
    dimensions = document.get("dimensions")
    if dimensions is not None:
        if not isInteger(dimensions):
            errors.append(FieldError("dimensions", _FORMAT, "must be an integer"))
        elif dimensions < 1:
            errors.append(FieldError("dimensions", _FORMAT, "must be at least 1"))
    user = document.get("user")
    if user is not None and not isinstance(user, str):
        errors.append(FieldError("user", _FORMAT, "must be a string"))
    if errors:
        raise validationError(errors)
    model = document["model"]
    assert isinstance(model, str)
    return EmbeddingsRequest(
        model=model,
        inputs=inputs,
        encodingFormat=encodingFormat,
        dimensions=dimensions,
        document=document,
    )
