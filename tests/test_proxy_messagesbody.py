"""
A Messages body as the steps shared with chat completions read it
(decisions D14, svcd/proxy/http/messagesbody.py): its conversation as chat
messages (what D11's estimate, a recall's query and an observation read),
recall's memories in C{system}, and an answer's text gathered from
Anthropic's shapes for observation (svcd/proxy/observe.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from svcd.common.errors import ApiError
from svcd.limits.reservation import promptEstimate
from svcd.proxy.http.messagesbody import (
    MessagesRequest,
    chatMessagesOf,
    parseMessagesRequest,
    withMemories,
)
from svcd.proxy.observe import AnswerText, completionText, observedUserTexts
from svcd.proxy.recall import Recalled, memoryMessage, recallQuery

TOOL = {"name": "weather", "input_schema": {"type": "object"}}
AGENT_LOOP: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Lyon?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Lyon"}},
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny, 21C"}],
    },
]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 10, "messages": AGENT_LOOP, **fields}


def test_conversationAsChatMessages() -> None:
    """
    The system prompt (string or text blocks) and the tools' definitions
    are system messages; a turn's texts (an assistant's tool inputs as
    JSON) one message of its role; its tool results a tool message before
    it.
    """
    document = body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        tools=[TOOL],
        messages=[
            *AGENT_LOOP,
            {"role": "assistant", "content": "It is sunny."},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "content": [{"type": "text", "text": "ok"}],
                    },
                    {"type": "text", "text": "Thanks!"},
                    {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                ],
            },
        ],
    )
    assert chatMessagesOf(document) == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "system", "content": json.dumps([TOOL], separators=(",", ":"))},
        {"role": "user", "content": "What is the weather in Lyon?"},
        {"role": "assistant", "content": 'Let me look.\n{"city":"Lyon"}'},
        {"role": "tool", "content": "sunny, 21C"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "tool", "content": "ok"},
        {"role": "user", "content": "Thanks!"},
    ]


def test_recallAndObservationReadWhatTheUserWrote() -> None:
    """
    A recall's query is the last turn the user wrote, not a tool's output
    (decisions D13); an observation's user turn after the last assistant
    turn holds no tool result either.
    """
    messages = chatMessagesOf(body())
    assert recallQuery(messages) == "What is the weather in Lyon?"
    assert observedUserTexts(messages) == []
    asked = chatMessagesOf(
        body(
            messages=[
                *AGENT_LOOP,
                {"role": "user", "content": [{"type": "text", "text": "And Paris?"}]},
            ]
        )
    )
    assert recallQuery(asked) == "And Paris?"
    assert observedUserTexts(asked) == ["And Paris?"]


def test_parseKeepsTheDocument() -> None:
    """
    The parsed request keeps the client's object (unknown keys too) and its
    chat messages; a bad one is refused with every rule.
    """
    raw = body(stream=True, x_unknown={"k": [1]})
    parsed = parseMessagesRequest(json.dumps(raw).encode())
    assert parsed.document == raw
    assert (parsed.model, parsed.maxTokens, parsed.stream) == ("m", 10, True)
    assert (parsed.maxCompletionTokens, parsed.choices) == (None, 1)
    assert parsed.messages == chatMessagesOf(raw)
    counted = parseMessagesRequest(
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}', countTokens=True
    )
    assert counted.maxTokens is None
    with pytest.raises(ApiError) as refused:
        parseMessagesRequest(b'{"model": "m", "messages": []}')
    assert [each.field for each in refused.value.fieldErrors] == ["max_tokens", "messages"]


MEMORY = {"role": "system", "content": "notes\n<memories>\n{}\n</memories>"}
MEMORY_BLOCK = {"type": "text", "text": MEMORY["content"]}


@pytest.mark.parametrize(
    ("system", "expected"),
    [
        (None, [MEMORY_BLOCK]),
        ("", [MEMORY_BLOCK]),
        ("Be brief.", [{"type": "text", "text": "Be brief."}, MEMORY_BLOCK]),
        (
            [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}],
            [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}, MEMORY_BLOCK],
        ),
    ],
)
def test_memoriesAfterTheClientsSystem(system: object, expected: list[Any]) -> None:
    """
    Decisions D14: recall's block is a text block of system, after the
    client's own (a string system prompt made a block first); every other
    key kept, the client's object untouched; the estimate counts it.
    """
    raw = body() if system is None else body(system=system)
    request = parseMessagesRequest(json.dumps(raw).encode())
    before = json.dumps(request.document)
    recalled = withMemories(request, MEMORY)
    assert recalled.document["system"] == expected
    assert {key: value for key, value in recalled.document.items() if key != "system"} == {
        key: value for key, value in raw.items() if key != "system"
    }
    assert json.dumps(request.document) == before
    assert promptEstimate(recalled.messages) > promptEstimate(request.messages)
    assert recallQuery(recalled.messages) == recallQuery(request.messages)


def test_memoryBlockWithinItsBound() -> None:
    """
    The bytes a recalled block adds to a forwarded Messages body stay
    within what a budget's worst case reserves for it
    (L{svcd.proxy.recall.extraBodyBytes}), whatever the system prompt.
    """
    from svcd.proxy.recall import extraBodyBytes

    memories = [Recalled("x" * 200 + '"<&>\u2028', "2024-01-01") for _ in range(20)]
    message, _ = memoryMessage(memories, 500)
    assert message is not None
    for system in (None, "S", [{"type": "text", "text": "S"}]):
        raw = body() if system is None else body(system=system)
        request = parseMessagesRequest(json.dumps(raw).encode())
        sent = json.dumps(withMemories(request, message).document, separators=(",", ":"))
        plain = json.dumps(raw, separators=(",", ":"))
        assert len(sent.encode()) - len(plain.encode()) <= extraBodyBytes(500)


def test_answerTextOfAnthropicStream() -> None:
    """
    A stream's text for observation is gathered from Anthropic's
    content_block_delta text deltas (decisions D14), as from chat chunks;
    tool input deltas and other events add nothing.
    """
    gathered = AnswerText()
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "m", "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": "It is "},
        },
        {"type": "ping"},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": "sunny."},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": "{}"},
        },
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 3},
        },
    ]
    for event in events:
        gathered.addData(json.dumps(event).encode())
    assert gathered.text() == "It is sunny."


def test_completionTextOfAnthropicMessage() -> None:
    """
    A whole answer's text: an Anthropic message's text blocks (tool use
    left out), as a chat completion's first choice.
    """
    message = {
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t", "name": "w", "input": {}},
            {"type": "text", "text": "Done."},
        ],
    }
    assert completionText(message) == "Let me look.\nDone."
    assert completionText({"type": "message", "content": []}) == ""


def test_requestIsAReservationBody() -> None:
    """
    The parsed request is what the reservation reads of a chat body
    (L{svcd.limits.reservation.ChatBody}): no second cap, one choice.
    """
    request: MessagesRequest = parseMessagesRequest(json.dumps(body()).encode())
    assert promptEstimate(request.messages) == promptEstimate(chatMessagesOf(body()))
