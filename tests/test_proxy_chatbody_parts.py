"""
The chat body's content parts (decisions D14): for a model of an Anthropic
provider, whose body the gateway translates, a message's content may be
text parts and base64 images, and an assistant's tool calls may come
without content; every other body keeps spec 4.1's string content
(tests/test_proxy_chatbody.py, unchanged).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from svcd.common.errors import ApiError
from svcd.proxy.http.chatbody import MAX_CONTENT_BYTES, parseChatBody

# A PNG of one pixel.
IMAGE = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def body(*messages: dict[str, Any]) -> bytes:
    return json.dumps({"model": "m", "messages": list(messages)}).encode()


def fieldErrors(raw: bytes, parts: bool = True) -> list[tuple[str, str]]:
    with pytest.raises(ApiError) as caught:
        parseChatBody(raw, parts=parts)
    return [(error.field, error.code.value) for error in caught.value.fieldErrors]


def test_partsAccepted() -> None:
    """
    Text parts, image parts of a base64 data: URL (with a detail), and an
    assistant's tool calls without content (null or absent) parse.
    """
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        {"role": "assistant", "tool_calls": [CALL]},
    ]
    chat = parseChatBody(body(*messages), parts=True)
    assert chat.messages == messages


def test_partsRefusedByDefault() -> None:
    """
    Without parts (any model but an Anthropic provider's), content is a
    string, as it always was.
    """
    assert fieldErrors(
        body({"role": "user", "content": [{"type": "text", "text": "x"}]}), False
    ) == [("messages[0].content", "INVALID_FORMAT")]
    assert fieldErrors(body({"role": "assistant", "tool_calls": [CALL]}), False) == [
        ("messages[0].content", "REQUIRED")
    ]


@pytest.mark.parametrize(
    ("message", "errors"),
    [
        ({"role": "user"}, [("messages[0].content", "REQUIRED")]),
        ({"role": "assistant", "content": None}, [("messages[0].content", "REQUIRED")]),
        ({"role": "assistant", "tool_calls": []}, [("messages[0].content", "REQUIRED")]),
        ({"role": "tool", "tool_calls": [CALL]}, [("messages[0].content", "REQUIRED")]),
        ({"role": "user", "content": 5}, [("messages[0].content", "INVALID_FORMAT")]),
        ({"role": "user", "content": []}, [("messages[0].content", "REQUIRED")]),
        ({"role": "user", "content": ["x"]}, [("messages[0].content[0]", "INVALID_FORMAT")]),
        (
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
            [("messages[0].content[0]", "INVALID_FORMAT")],
        ),
        (
            {"role": "user", "content": [{"type": "text", "text": 3}]},
            [("messages[0].content[0].text", "INVALID_FORMAT")],
        ),
        (
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
                ],
            },
            [("messages[0].content[0].image_url.url", "INVALID_FORMAT")],
        ),
        (
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/tiff;base64,AA=="}}
                ],
            },
            [("messages[0].content[0].image_url.url", "INVALID_FORMAT")],
        ),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": "data:x"}]},
            [("messages[0].content[0].image_url.url", "INVALID_FORMAT")],
        ),
        (
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a" * (MAX_CONTENT_BYTES // 2 + 1)},
                    {"type": "text", "text": "a" * (MAX_CONTENT_BYTES // 2)},
                ],
            },
            [("messages[0].content", "TOO_LONG")],
        ),
    ],
)
def test_partFaults(message: dict[str, Any], errors: list[tuple[str, str]]) -> None:
    """
    Each part that cannot be sent is named, with every other rule's
    fault at once.
    """
    assert fieldErrors(body(message)) == errors
