"""
The shape rules of a /v1/messages body (svcd.dialects.checks), one by
one, as the chat body's are checked (decisions D4: every failed rule at
once, by dotted path); and as properties: a body of Anthropic's shape is
accepted, and no JSON makes the checks fail with anything but field
errors.
"""

from __future__ import annotations

from typing import Any

import pytest
from dialectstrategies import anthropicRequests
from hypothesis import given, settings
from hypothesis import strategies as st

from svcd.common.errors import ApiError, ErrorCode
from svcd.dialects.checks import (
    MAX_BLOCKS,
    MAX_CONTENT_BYTES,
    MAX_MESSAGES,
    MessagesRequest,
    messagesBodyErrors,
    parseMessagesBody,
)


def valid(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "model": "claude",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    document.update(overrides)
    return document


def problems(document: dict[str, Any], *, countTokens: bool = False) -> list[tuple[str, str]]:
    return [
        (error.field, error.code.value)
        for error in messagesBodyErrors(document, countTokens=countTokens)
    ]


def test_minimal() -> None:
    """
    model, max_tokens and messages are enough; stream defaults to false;
    unknown fields are the provider's to judge.
    """
    document = valid(anthropic_new_field={"x": 1})
    assert parseMessagesBody(document) == MessagesRequest(
        model="claude", maxTokens=64, document=document
    )
    assert parseMessagesBody(valid(stream=True)).stream is True


def test_countTokensHasNoCap() -> None:
    """
    count_tokens needs no max_tokens (a given one is still checked).
    """
    document = valid()
    del document["max_tokens"]
    assert parseMessagesBody(document, countTokens=True).maxTokens is None
    assert problems(document) == [("max_tokens", "REQUIRED")]
    assert problems(valid(max_tokens="1"), countTokens=True) == [("max_tokens", "INVALID_FORMAT")]


def test_allProblemsAtOnce() -> None:
    """
    Every failed rule is listed, in the order of the fields, in one 400
    VALIDATION_ERROR.
    """
    document = {"model": 5, "max_tokens": 0, "messages": [], "stream": "yes"}
    with pytest.raises(ApiError) as caught:
        parseMessagesBody(document)
    assert caught.value.code is ErrorCode.VALIDATION_ERROR
    assert [(error.field, error.code.value) for error in caught.value.fieldErrors] == [
        ("model", "INVALID_FORMAT"),
        ("max_tokens", "INVALID_FORMAT"),
        ("messages", "REQUIRED"),
        ("stream", "INVALID_FORMAT"),
    ]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"model": None}, [("model", "REQUIRED")]),
        ({"model": "m" * 257}, [("model", "TOO_LONG")]),
        ({"max_tokens": None}, [("max_tokens", "REQUIRED")]),
        ({"max_tokens": True}, [("max_tokens", "INVALID_FORMAT")]),
        ({"max_tokens": 1.5}, [("max_tokens", "INVALID_FORMAT")]),
        ({"max_tokens": -3}, [("max_tokens", "INVALID_FORMAT")]),
        ({"messages": None}, [("messages", "REQUIRED")]),
        ({"messages": {}}, [("messages", "INVALID_FORMAT")]),
        ({"messages": ["x"]}, [("messages[0]", "INVALID_FORMAT")]),
        ({"messages": [{"content": "x"}]}, [("messages[0].role", "REQUIRED")]),
        (
            {"messages": [{"role": "system", "content": "x"}]},
            [("messages[0].role", "INVALID_ENUM")],
        ),
        ({"messages": [{"role": "user"}]}, [("messages[0].content", "REQUIRED")]),
        (
            {"messages": [{"role": "user", "content": 3}]},
            [("messages[0].content", "INVALID_FORMAT")],
        ),
        ({"system": 3}, [("system", "INVALID_FORMAT")]),
        ({"system": [{"type": "image"}]}, [("system[0]", "INVALID_FORMAT")]),
        ({"system": [{"type": "text"}]}, [("system[0].text", "REQUIRED")]),
        ({"stop_sequences": "END"}, [("stop_sequences", "INVALID_FORMAT")]),
        ({"stop_sequences": ["a", 1]}, [("stop_sequences", "INVALID_FORMAT")]),
        ({"temperature": "hot"}, [("temperature", "INVALID_FORMAT")]),
        ({"top_p": False}, [("top_p", "INVALID_FORMAT")]),
        ({"top_k": -1}, [("top_k", "INVALID_FORMAT")]),
        ({"top_k": 1.0}, [("top_k", "INVALID_FORMAT")]),
        ({"tools": {}}, [("tools", "INVALID_FORMAT")]),
        ({"tools": [{"input_schema": {}}]}, [("tools[0].name", "REQUIRED")]),
        ({"tools": [{"name": "t"}]}, [("tools[0].input_schema", "REQUIRED")]),
        (
            {"tools": [{"name": "t", "input_schema": []}]},
            [("tools[0].input_schema", "INVALID_FORMAT")],
        ),
        ({"tool_choice": "auto"}, [("tool_choice", "INVALID_FORMAT")]),
        ({"tool_choice": {"type": "sometimes"}}, [("tool_choice.type", "INVALID_ENUM")]),
        ({"tool_choice": {"type": "tool"}}, [("tool_choice.name", "REQUIRED")]),
        (
            {"tool_choice": {"type": "any", "disable_parallel_tool_use": 1}},
            [("tool_choice.disable_parallel_tool_use", "INVALID_FORMAT")],
        ),
        ({"metadata": []}, [("metadata", "INVALID_FORMAT")]),
        ({"metadata": {"user_id": 5}}, [("metadata.user_id", "INVALID_FORMAT")]),
        ({"thinking": "on"}, [("thinking", "INVALID_FORMAT")]),
        ({"thinking": {"budget_tokens": 1024}}, [("thinking.type", "REQUIRED")]),
    ],
)
def test_fieldRules(overrides: dict[str, Any], expected: list[tuple[str, str]]) -> None:
    """
    Each field's rule, by its dotted path and code; a null is absent.
    """
    assert problems(valid(**overrides)) == expected


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ("text", [("messages[0].content[0]", "INVALID_FORMAT")]),
        ({}, [("messages[0].content[0].type", "REQUIRED")]),
        ({"type": 1}, [("messages[0].content[0].type", "INVALID_FORMAT")]),
        ({"type": "text"}, [("messages[0].content[0].text", "REQUIRED")]),
        ({"type": "image"}, [("messages[0].content[0].source", "INVALID_FORMAT")]),
        (
            {"type": "image", "source": {"type": "base64"}},
            [
                ("messages[0].content[0].source.media_type", "REQUIRED"),
                ("messages[0].content[0].source.data", "REQUIRED"),
            ],
        ),
        (
            {"type": "image", "source": {"type": "url", "url": 1}},
            [("messages[0].content[0].source.url", "INVALID_FORMAT")],
        ),
        ({"type": "image", "source": {}}, [("messages[0].content[0].source.type", "REQUIRED")]),
        (
            {"type": "tool_use", "input": []},
            [
                ("messages[0].content[0].id", "REQUIRED"),
                ("messages[0].content[0].name", "REQUIRED"),
                ("messages[0].content[0].input", "INVALID_FORMAT"),
            ],
        ),
        (
            {"type": "tool_result", "content": 4, "is_error": "no"},
            [
                ("messages[0].content[0].tool_use_id", "REQUIRED"),
                ("messages[0].content[0].content", "INVALID_FORMAT"),
                ("messages[0].content[0].is_error", "INVALID_FORMAT"),
            ],
        ),
        (
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}]},
            [("messages[0].content[0].content[0].text", "REQUIRED")],
        ),
        ({"type": "tool_result", "tool_use_id": "t"}, []),
        ({"type": "image", "source": {"type": "file", "file_id": "f"}}, []),
        ({"type": "document", "source": {"type": "text", "data": "x"}}, []),
        ({"type": "thinking", "thinking": "x", "signature": "s"}, []),
    ],
)
def test_blockRules(block: object, expected: list[tuple[str, str]]) -> None:
    """
    The blocks the gateway knows are checked for their fields; others are
    the provider's to judge.
    """
    assert problems(valid(messages=[{"role": "user", "content": [block]}])) == expected


def test_bounds() -> None:
    """
    The chat body's bounds: 1000 turns, 100 KiB of UTF-8 per text (turn
    content, text block, tool result, system), and as many blocks; items
    past a bound are not checked one by one.
    """
    over = "é" * (MAX_CONTENT_BYTES // 2 + 1)
    assert problems(valid(messages=[{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1))) == [
        ("messages", "TOO_MANY")
    ]
    assert problems(valid(messages=[{"role": "user", "content": over}])) == [
        ("messages[0].content", "TOO_LONG")
    ]
    assert problems(valid(messages=[{"role": "user", "content": "a" * MAX_CONTENT_BYTES}])) == []
    assert problems(
        valid(messages=[{"role": "user", "content": [{"type": "text", "text": over}]}])
    ) == [("messages[0].content[0].text", "TOO_LONG")]
    assert problems(valid(system=over)) == [("system", "TOO_LONG")]
    result = {"type": "tool_result", "tool_use_id": "t", "content": over}
    assert problems(valid(messages=[{"role": "user", "content": [result]}])) == [
        ("messages[0].content[0].content", "TOO_LONG")
    ]
    blocks = [{"type": "text"}] * (MAX_BLOCKS + 1)
    assert problems(valid(messages=[{"role": "user", "content": blocks}])) == [
        ("messages[0].content", "TOO_MANY")
    ]


@settings(max_examples=200, deadline=None)
@given(anthropicRequests())
def test_anthropicShapedBodiesPass(body: dict[str, Any]) -> None:
    """
    A body of Anthropic's shape passes the checks.
    """
    assert messagesBodyErrors(body) == []


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)
_FIELDS = (
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "metadata",
    "thinking",
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(_FIELDS), _json, max_size=6),
    st.lists(st.dictionaries(st.sampled_from(["role", "content"]), _json)),
)
def test_anyJSONGivesFieldErrorsOnly(
    document: dict[str, Any], messages: list[dict[str, Any]]
) -> None:
    """
    No JSON object makes the checks fail with anything but field errors,
    each with a path that starts with a field of the body.
    """
    if messages:
        document["messages"] = messages
    for error in messagesBodyErrors(document):
        assert error.field.split(".")[0].split("[")[0] in _FIELDS
