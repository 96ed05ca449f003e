"""
The embeddings body rules of decisions D13 one by one (each refusal with
its field error), D10's JSON rules as the chat body has them, and as
properties: a valid body always parses, and no input makes the parser fail
with anything but an ApiError. That nothing refused is forwarded is
tests/test_proxy_embeddings.py's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from svcd.common.errors import ApiError, ErrorCode
from svcd.limits.reservation import inputsEstimate
from svcd.proxy.http.embeddingsbody import (
    MAX_ESTIMATED_TOKENS,
    MAX_INPUTS,
    parseEmbeddingsBody,
)


def encode(document: Any) -> bytes:
    return json.dumps(document).encode()


def fieldErrors(body: bytes) -> list[tuple[str, str]]:
    with pytest.raises(ApiError) as caught:
        parseEmbeddingsBody(body)
    assert caught.value.code is ErrorCode.VALIDATION_ERROR
    return [(error.field, error.code.value) for error in caught.value.fieldErrors]


def valid(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {"model": "embed", "input": "hello there"}
    document.update(overrides)
    return document


def test_aStringInput() -> None:
    """
    model and a string input are enough; the input is one string, and the
    optional fields are None.
    """
    request = parseEmbeddingsBody(encode(valid()))
    assert (request.model, request.inputs) == ("embed", ("hello there",))
    assert (request.encodingFormat, request.dimensions) == (None, None)
    assert request.document == valid()


def test_anArrayInputAndEveryOptionalField() -> None:
    """
    An array of strings keeps its order; encoding_format, dimensions and
    user are read; unknown keys are kept for the provider; null optional
    fields count as absent.
    """
    document = valid(
        input=["a", "b c", "é"],
        encoding_format="base64",
        dimensions=256,
        user="end-user-7",
        extra={"kept": True},
    )
    request = parseEmbeddingsBody(encode(document))
    assert request.inputs == ("a", "b c", "é")
    assert (request.encodingFormat, request.dimensions) == ("base64", 256)
    assert request.document == document
    request = parseEmbeddingsBody(encode(valid(encoding_format=None, dimensions=None, user=None)))
    assert (request.encodingFormat, request.dimensions) == (None, None)
    assert parseEmbeddingsBody(encode(valid(encoding_format="float"))).encodingFormat == "float"


def test_theReprHoldsNoInput() -> None:
    """
    An input never shows in the request's repr (which could reach a log).
    """
    request = parseEmbeddingsBody(encode(valid(input=["secret words"])))
    assert "secret" not in repr(request)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"\xff\xfe{}",
        b'{"model": "m", "input": "x", "dimensions": NaN}',
        b'{"model": "m", "input": "x", "dimensions": 1e999999}',
        b'{"model": "m", "input": "\\ud800"}',
        b'{"model": "m", "input": ["ok", "\\udfff"]}',
        b'{"model": "m", "input": "x", "\\ud800": 1}',
    ],
)
def test_invalidJSON(body: bytes) -> None:
    """
    D10 as for chat: not UTF-8 JSON, a number that is not finite, a lone
    surrogate anywhere (an input, an unknown key): 400 INVALID_JSON.
    """
    with pytest.raises(ApiError) as caught:
        parseEmbeddingsBody(body)
    assert caught.value.code is ErrorCode.INVALID_JSON


@pytest.mark.parametrize("document", [[], "input", 3, None])
def test_notAnObject(document: Any) -> None:
    """
    JSON that is not an object: VALIDATION_ERROR on body.
    """
    assert fieldErrors(encode(document)) == [("body", "INVALID_FORMAT")]


@pytest.mark.parametrize(
    "model, code",
    [(None, "REQUIRED"), (3, "INVALID_FORMAT"), (["m"], "INVALID_FORMAT"), ("m" * 257, "TOO_LONG")],
)
def test_model(model: Any, code: str) -> None:
    """
    model: required, a string, at most 256 characters, as for chat.
    """
    assert fieldErrors(encode(valid(model=model))) == [("model", code)]


@pytest.mark.parametrize(
    "value, errors",
    [
        (None, [("input", "REQUIRED")]),
        ("", [("input", "REQUIRED")]),
        ([], [("input", "REQUIRED")]),
        (3, [("input", "INVALID_FORMAT")]),
        (True, [("input", "INVALID_FORMAT")]),
        ({"text": "x"}, [("input", "INVALID_FORMAT")]),
        (["a", ""], [("input[1]", "REQUIRED")]),
        (["a", 3, None, ["b"]], [(f"input[{n}]", "INVALID_FORMAT") for n in (1, 2, 3)]),
        ([[]], [("input[0]", "INVALID_FORMAT")]),
        (["", "x", ""], [("input[0]", "REQUIRED"), ("input[2]", "REQUIRED")]),
    ],
    ids=[
        "missing",
        "empty string",
        "empty array",
        "number",
        "boolean",
        "object",
        "an empty string among them",
        "not strings among them",
        "an empty array in it",
        "two empty strings",
    ],
)
def test_input(value: Any, errors: list[tuple[str, str]]) -> None:
    """
    input: a string or an array of strings, none empty; each fault of an
    array named by its index.
    """
    document = valid(input=value)
    if value is None:
        del document["input"]
    assert fieldErrors(encode(document)) == errors


@pytest.mark.parametrize("tokens", [[1, 2, 3], [0], [[1, 2], [3]], [[5]], [[1], []]], ids=str)
def test_tokenArraysAreRefusedWithAClearError(tokens: Any) -> None:
    """
    Token arrays (integers, or arrays of integers), which OpenAI takes,
    are refused on input with a message that says so and what to send
    instead.
    """
    with pytest.raises(ApiError) as caught:
        parseEmbeddingsBody(encode(valid(input=tokens)))
    [error] = caught.value.fieldErrors
    assert (error.field, error.code.value) == ("input", "INVALID_FORMAT")
    assert "token arrays" in error.message and "text" in error.message


def test_atMost2048Inputs() -> None:
    """
    2,048 inputs are taken; 2,049 are TOO_MANY, and their items are not
    looked at (no list of thousands of errors).
    """
    assert len(parseEmbeddingsBody(encode(valid(input=["x"] * MAX_INPUTS))).inputs) == 2048
    assert fieldErrors(encode(valid(input=[""] * (MAX_INPUTS + 1)))) == [("input", "TOO_MANY")]


def test_theEstimateIsBoundedAt300000Tokens() -> None:
    """
    The inputs' estimate (D11's bytes / 3, rounded up, per input) may be
    300,000 tokens and no more: past it, TOO_LONG on input. Multi-byte
    characters count their bytes, and each input is rounded up on its own.
    """
    atLimit = ["abc" * 1000] * 300
    assert inputsEstimate(atLimit) == MAX_ESTIMATED_TOKENS
    assert parseEmbeddingsBody(encode(valid(input=atLimit))).inputs == tuple(atLimit)
    assert fieldErrors(encode(valid(input=[*atLimit, "a"]))) == [("input", "TOO_LONG")]
    # "é" is 2 bytes: 150,001 of them are 300,002 bytes, 100,001 tokens...
    assert inputsEstimate(["é" * 150_001]) == 100_001
    # ...and three single bytes in three inputs are three tokens, not one.
    assert inputsEstimate(["a", "b", "c"]) == 3
    assert fieldErrors(encode(valid(input="é" * 450_001))) == [("input", "TOO_LONG")]


@pytest.mark.parametrize("value", ["FLOAT", "binary", "", 1, True, ["float"]])
def test_encodingFormat(value: Any) -> None:
    """
    encoding_format: float or base64, nothing else.
    """
    assert fieldErrors(encode(valid(encoding_format=value))) == [
        ("encoding_format", "INVALID_ENUM")
    ]


@pytest.mark.parametrize("value", [0, -1, 1.5, 2.0, "256", True, [256]])
def test_dimensions(value: Any) -> None:
    """
    dimensions: a positive integer (not a float, not a boolean).
    """
    assert fieldErrors(encode(valid(dimensions=value))) == [("dimensions", "INVALID_FORMAT")]


@pytest.mark.parametrize("value", [1, True, ["u"], {"id": "u"}])
def test_user(value: Any) -> None:
    """
    user: a string.
    """
    assert fieldErrors(encode(valid(user=value))) == [("user", "INVALID_FORMAT")]


def test_allErrorsTogether() -> None:
    """
    Every failed rule is reported at once, in the order of the fields.
    """
    document = {"model": 1, "input": ["", 2], "encoding_format": "hex", "dimensions": 0, "user": 5}
    assert fieldErrors(encode(document)) == [
        ("model", "INVALID_FORMAT"),
        ("input[0]", "REQUIRED"),
        ("input[1]", "INVALID_FORMAT"),
        ("encoding_format", "INVALID_ENUM"),
        ("dimensions", "INVALID_FORMAT"),
        ("user", "INVALID_FORMAT"),
    ]


_TEXT = st.text(min_size=1, max_size=40).filter(lambda text: text.isprintable())


@settings(max_examples=200, deadline=None)
@given(
    model=st.text(min_size=1, max_size=256),
    inputs=st.one_of(_TEXT, st.lists(_TEXT, min_size=1, max_size=20)),
    encoding=st.sampled_from([None, "float", "base64"]),
    dimensions=st.one_of(st.none(), st.integers(min_value=1, max_value=10**6)),
)
def test_validBodiesParse(
    model: str, inputs: str | list[str], encoding: str | None, dimensions: int | None
) -> None:
    """
    Any body within the rules parses, its inputs as sent.
    """
    document: dict[str, Any] = {"model": model, "input": inputs}
    if encoding is not None:
        document["encoding_format"] = encoding
    if dimensions is not None:
        document["dimensions"] = dimensions
    request = parseEmbeddingsBody(json.dumps(document).encode())
    assert request.inputs == ((inputs,) if isinstance(inputs, str) else tuple(inputs))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    body=st.one_of(
        st.binary(max_size=200),
        _JSON.map(lambda value: json.dumps(value).encode()),
        st.dictionaries(st.sampled_from(["model", "input", "dimensions", "user"]), _JSON).map(
            lambda value: json.dumps(value).encode()
        ),
    )
)
def test_onlyApiErrors(body: bytes) -> None:
    """
    Whatever the body, the parser answers or raises ApiError, never
    anything else.
    """
    try:
        parseEmbeddingsBody(body)
    except ApiError:
        pass
