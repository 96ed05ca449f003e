"""
The chat body rules of spec 4.1 and decisions D4, one by one, and as
properties: a valid body always parses, and no input makes the parser fail
with anything but an ApiError.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from svcd.common.errors import ApiError, ErrorCode
from svcd.proxy.http.chatbody import MAX_CHOICES, MAX_CONTENT_BYTES, ROLES, parseChatBody


def encode(document: Any) -> bytes:
    return json.dumps(document).encode()


def fieldErrors(body: bytes) -> list[tuple[str, str]]:
    with pytest.raises(ApiError) as caught:
        parseChatBody(body)
    assert caught.value.code.value == "VALIDATION_ERROR"
    return [(error.field, error.code.value) for error in caught.value.fieldErrors]


def valid(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    document.update(overrides)
    return document


def test_minimal() -> None:
    """
    model and messages are enough; stream defaults to false.
    """
    chat = parseChatBody(encode(valid()))
    assert (chat.model, len(chat.messages), chat.stream) == ("m", 1, False)
    assert chat.temperature is None and chat.maxTokens is None


def test_optionalFieldsAndUnknownKeys() -> None:
    """
    stream, temperature and max_tokens are parsed; unknown keys (top level
    and in messages) are ignored; null optional fields count as absent.
    """
    chat = parseChatBody(
        encode(valid(stream=True, temperature=1, max_tokens=10**12, tools=[], user="u"))
    )
    assert (chat.stream, chat.temperature, chat.maxTokens) == (True, 1.0, 10**12)
    chat = parseChatBody(encode(valid(stream=None, temperature=None, max_tokens=None)))
    assert (chat.stream, chat.temperature, chat.maxTokens) == (False, None, None)
    messages = [{"role": "tool", "content": "", "tool_call_id": "x", "name": "n"}]
    assert parseChatBody(encode(valid(messages=messages))).messages == messages


@pytest.mark.parametrize("role", sorted(ROLES))
def test_everyRole(role: str) -> None:
    """
    The six roles of D4 are accepted.
    """
    parseChatBody(encode(valid(messages=[{"role": role, "content": "x"}])))


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"{'model': 'm'}",
        b"\xff\xfe{}",
        '{"model": "m"}'.encode("utf-16"),
        b'\xef\xbb\xbf{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
        b'{"model": "m", "messages": [], "temperature": NaN}',
        b'{"model": "m", "messages": [], "temperature": Infinity}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "m"} trailing',
    ],
)
def test_invalidJSON(body: bytes) -> None:
    """
    Not UTF-8, not JSON (NaN and Infinity included), or nested past the
    parser's depth: 400 INVALID_JSON.
    """
    with pytest.raises(ApiError) as caught:
        parseChatBody(body)
    assert (caught.value.status, caught.value.code.value) == (400, "INVALID_JSON")


@pytest.mark.parametrize("document", [[], "text", 1, None, True])
def test_notAnObject(document: Any) -> None:
    """
    JSON that is not an object: VALIDATION_ERROR on field body.
    """
    assert fieldErrors(encode(document)) == [("body", "INVALID_FORMAT")]


@pytest.mark.parametrize(
    ("model", "code"),
    [
        (None, "REQUIRED"),
        (1, "INVALID_FORMAT"),
        (["m"], "INVALID_FORMAT"),
        (True, "INVALID_FORMAT"),
        ("x" * 257, "TOO_LONG"),
        ("\u00e9" * 257, "TOO_LONG"),
    ],
)
def test_model(model: Any, code: str) -> None:
    """
    model: required, a string, at most 256 characters.
    """
    document = valid(model=model)
    assert fieldErrors(encode(document)) == [("model", code)]
    del document["model"]
    assert fieldErrors(encode(document)) == [("model", "REQUIRED")]


def test_modelAtTheLimit() -> None:
    """
    256 characters are fine, counted as characters, not bytes.
    """
    parseChatBody(encode(valid(model="x" * 256)))
    parseChatBody(encode(valid(model="\u00e9" * 256)))


@pytest.mark.parametrize(
    ("messages", "code"),
    [
        (None, "REQUIRED"),
        ([], "REQUIRED"),
        ({}, "INVALID_FORMAT"),
        ("hello", "INVALID_FORMAT"),
        ([{"role": "user", "content": "x"}] * 1001, "TOO_MANY"),
    ],
)
def test_messages(messages: Any, code: str) -> None:
    """
    messages: required and non-empty, an array, at most 1000 items.
    """
    assert fieldErrors(encode(valid(messages=messages))) == [("messages", code)]


def test_tooManyMessagesNotChecked() -> None:
    """
    Past 1000 messages the items are not checked one by one.
    """
    assert fieldErrors(encode(valid(messages=[1] * 5000))) == [("messages", "TOO_MANY")]


def test_thousandMessages() -> None:
    """
    Exactly 1000 messages are fine.
    """
    assert (
        len(
            parseChatBody(
                encode(valid(messages=[{"role": "user", "content": "x"}] * 1000))
            ).messages
        )
        == 1000
    )


@pytest.mark.parametrize(
    ("message", "errors"),
    [
        ("text", [("messages[1]", "INVALID_FORMAT")]),
        (["user", "x"], [("messages[1]", "INVALID_FORMAT")]),
        ({"content": "x"}, [("messages[1].role", "REQUIRED")]),
        ({"role": None, "content": "x"}, [("messages[1].role", "REQUIRED")]),
        ({"role": "robot", "content": "x"}, [("messages[1].role", "INVALID_ENUM")]),
        ({"role": "User", "content": "x"}, [("messages[1].role", "INVALID_ENUM")]),
        ({"role": 3, "content": "x"}, [("messages[1].role", "INVALID_ENUM")]),
        ({"role": "user"}, [("messages[1].content", "REQUIRED")]),
        ({"role": "user", "content": 5}, [("messages[1].content", "INVALID_FORMAT")]),
        (
            {"role": "user", "content": [{"type": "text", "text": "x"}]},
            [("messages[1].content", "INVALID_FORMAT")],
        ),
        ({}, [("messages[1].role", "REQUIRED"), ("messages[1].content", "REQUIRED")]),
    ],
)
def test_messageItems(message: Any, errors: list[tuple[str, str]]) -> None:
    """
    Each message is an object with a role of the six and string content,
    reported with its index.
    """
    messages = [{"role": "system", "content": "ok"}, message]
    assert fieldErrors(encode(valid(messages=messages))) == errors


@pytest.mark.parametrize(
    ("content", "tooLong"),
    [
        ("a" * MAX_CONTENT_BYTES, False),
        ("a" * (MAX_CONTENT_BYTES + 1), True),
        ("\u00e9" * (MAX_CONTENT_BYTES // 2), False),
        ("\u00e9" * (MAX_CONTENT_BYTES // 2 + 1), True),
        ("\u20ac" * (MAX_CONTENT_BYTES // 3), False),
        ("\u20ac" * (MAX_CONTENT_BYTES // 3 + 1), True),
        ("\U0001f600" * (MAX_CONTENT_BYTES // 4), False),
        ("\U0001f600" * (MAX_CONTENT_BYTES // 4 + 1), True),
        ("a" * (MAX_CONTENT_BYTES - 2) + "\u00e9", False),
        ("a" * (MAX_CONTENT_BYTES - 1) + "\u00e9", True),
    ],
)
def test_contentUTF8Bytes(content: str, tooLong: bool) -> None:
    """
    Content is limited to 102,400 bytes of UTF-8, not characters.
    """
    body = encode(valid(messages=[{"role": "user", "content": content}]))
    if tooLong:
        assert fieldErrors(body) == [("messages[0].content", "TOO_LONG")]
    else:
        parseChatBody(body)


def test_loneSurrogateRefused() -> None:
    """
    A lone surrogate from a JSON escape cannot be forwarded as UTF-8: 400
    INVALID_JSON (decisions D10), before the length check, at the limit
    or past it. tests/test_hostile_json.py plants it everywhere else.
    """
    body = b'{"model": "m", "messages": [{"role": "user", "content": "%s\\ud800"}]}' % (
        b"a" * (MAX_CONTENT_BYTES - 3)
    )
    for each in (body, body.replace(b"\\ud800", b"a\\ud800")):
        with pytest.raises(ApiError) as raised:
            parseChatBody(each)
        assert raised.value.code == ErrorCode.INVALID_JSON


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "true"),
        ("stream", 1),
        ("temperature", True),
        ("temperature", "0.5"),
        ("temperature", [1]),
        ("max_tokens", 1.5),
        ("max_tokens", 10.0),
        ("max_tokens", False),
        ("max_tokens", "10"),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_completion_tokens", 1.5),
        ("max_completion_tokens", True),
        ("max_completion_tokens", "4096"),
        ("max_completion_tokens", 0),
        ("n", 2.0),
        ("n", True),
        ("n", "2"),
        ("n", 0),
        ("n", -1),
    ],
)
def test_optionalTypes(field: str, value: Any) -> None:
    """
    stream a boolean, temperature a number (booleans are not numbers),
    max_tokens, max_completion_tokens and n integers of at least 1
    (decisions D12, amended: a cap or a count of choices the gateway cannot
    read is one a budget cannot bound).
    """
    assert fieldErrors(encode(valid(**{field: value}))) == [(field, "INVALID_FORMAT")]


def test_capsAndChoicesAreParsed() -> None:
    """
    Both caps and n are kept for the budget's worst case; n defaults to 1
    and may be at most 128 (OpenAI's bound), past which it is TOO_MANY.
    """
    chat = parseChatBody(encode(valid(max_tokens=7, max_completion_tokens=9, n=128)))
    assert (chat.maxTokens, chat.maxCompletionTokens, chat.choices) == (7, 9, 128)
    assert parseChatBody(encode(valid())).choices == 1
    assert parseChatBody(encode(valid(n=None))).choices == 1
    assert fieldErrors(encode(valid(n=129))) == [("n", "TOO_MANY")]


def test_allErrorsTogether() -> None:
    """
    Every failed rule is listed, in body order.
    """
    document = {
        "messages": [{"role": "x"}, 7],
        "stream": 0,
        "temperature": "hot",
        "max_tokens": 0.5,
    }
    assert fieldErrors(encode(document)) == [
        ("model", "REQUIRED"),
        ("messages[0].role", "INVALID_ENUM"),
        ("messages[0].content", "REQUIRED"),
        ("messages[1]", "INVALID_FORMAT"),
        ("stream", "INVALID_FORMAT"),
        ("temperature", "INVALID_FORMAT"),
        ("max_tokens", "INVALID_FORMAT"),
    ]


messagesStrategy = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(sorted(ROLES)), "content": st.text(max_size=50)},
        optional={"name": st.text(max_size=5)},
    ),
    min_size=1,
    max_size=20,
)
validBodies = st.fixed_dictionaries(
    {"model": st.text(max_size=256), "messages": messagesStrategy},
    optional={
        "stream": st.booleans(),
        "temperature": st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False)),
        # Decisions D12, amended: a cap is at least 1 (its ceiling is the
        # model's, checked by the edge); n from 1 to 128, as OpenAI's.
        "max_tokens": st.integers(min_value=1),
        "max_completion_tokens": st.integers(min_value=1),
        "n": st.integers(min_value=1, max_value=MAX_CHOICES),
        "extra": st.text(),
    },
)
jsonValues = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(validBodies)
def test_validBodiesParse(document: dict[str, Any]) -> None:
    """
    Every body within the rules parses, keeping model and messages.
    """
    chat = parseChatBody(encode(document))
    assert chat.model == document["model"]
    assert chat.messages == document["messages"]
    assert chat.maxTokens == document.get("max_tokens")
    assert chat.maxCompletionTokens == document.get("max_completion_tokens")
    assert chat.choices == document.get("n", 1)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        jsonValues.map(encode),
        st.dictionaries(
            st.sampled_from(["model", "messages", "stream", "temperature", "max_tokens"]),
            jsonValues,
        ).map(encode),
    )
)
def test_onlyApiErrors(body: bytes) -> None:
    """
    Whatever the body, the parser answers or raises an ApiError of 400.
    """
    try:
        parseChatBody(body)
    except ApiError as error:
        assert error.status == 400
        assert error.code.value in ("INVALID_JSON", "VALIDATION_ERROR")
