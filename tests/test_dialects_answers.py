"""
Whole answers and their usage between the dialects (svcd.dialects.answers
and svcd.dialects.usage): text, tool calls, finish and stop reasons, ids,
models and usage with cache reads and writes, both ways; each answer made
valid by the official SDKs' models; and as properties, an answer there and
back is the answer again.
"""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types import Message
from dialectstrategies import anthropicMessages, openAICompletions
from hypothesis import given, settings
from openai.types.chat import ChatCompletion

from svcd.dialects.answers import (
    anthropicMessageOf,
    chatCompletionOf,
    finishReasonOf,
    stopReasonOf,
)
from svcd.dialects.errors import BadAnswer
from svcd.dialects.turns import INVALID_ARGUMENTS_KEY
from svcd.dialects.usage import (
    StreamUsage,
    TokenUsage,
    anthropicUsage,
    openAIUsage,
    usageOfAnthropic,
    usageOfOpenAI,
)

CREATED = 1_700_000_000


def anthropicAnswer(**fields: Any) -> dict[str, Any]:
    message: dict[str, Any] = {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 3},
    }
    message.update(fields)
    return message


def openAIAnswer(message: dict[str, Any], finish: str = "stop", **fields: Any) -> dict[str, Any]:
    completion: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": CREATED,
        "model": "gpt-x",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "finish_reason": finish,
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    }
    completion.update(fields)
    return completion


def asChat(message: dict[str, Any]) -> dict[str, Any]:
    completion = chatCompletionOf(message, created=CREATED)
    ChatCompletion.model_validate(completion)
    return completion


def asAnthropic(completion: dict[str, Any]) -> dict[str, Any]:
    message = anthropicMessageOf(completion)
    Message.model_validate(message)
    return message


# Anthropic's message as a chat completion.


def test_textAnswerToOpenAI() -> None:
    """
    Text blocks are the message's content, joined; id and model kept;
    created given; end_turn is stop.
    """
    completion = asChat(
        anthropicAnswer(content=[{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}])
    )
    assert completion == {
        "id": "msg_01",
        "object": "chat.completion",
        "created": CREATED,
        "model": "claude-x",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello", "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        },
    }


def test_toolUseAnswerToOpenAI() -> None:
    """
    tool_use blocks are tool calls, ids kept, input as compact JSON;
    thinking blocks are left out; tool_use is tool_calls, and a message of
    calls only has no content.
    """
    completion = asChat(
        anthropicAnswer(
            content=[
                {"type": "thinking", "thinking": "...", "signature": "sig"},
                {
                    "type": "tool_use",
                    "id": "toolu_9",
                    "name": "weather",
                    "input": {"city": "Zürich"},
                },
            ],
            stop_reason="tool_use",
        )
    )
    choice = completion["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {
            "id": "toolu_9",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city":"Zürich"}'},
        }
    ]


@pytest.mark.parametrize(
    ("stop", "finish"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("refusal", "content_filter"),
        ("pause_turn", "stop"),
        ("model_context_window_exceeded", "length"),
        (None, "stop"),
        ("something_new", "stop"),
    ],
)
def test_stopReasonsToFinishReasons(stop: str | None, finish: str) -> None:
    """
    Each stop reason has its finish reason.
    """
    assert finishReasonOf(stop) == finish


def test_stopSequenceToOpenAI() -> None:
    """
    The stop sequence that matched is the choice's stop_reason (vLLM's
    field; OpenAI's SDK keeps it as an extra field).
    """
    completion = asChat(anthropicAnswer(stop_reason="stop_sequence", stop_sequence="###"))
    choice = completion["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "###")
    assert ChatCompletion.model_validate(completion).choices[0].model_extra == {
        "stop_reason": "###"
    }


def test_cacheUsageToOpenAI() -> None:
    """
    The prompt is the three inputs summed; reads are cached_tokens, writes
    cache_write_tokens (both in OpenAI's SDK's model).
    """
    usage = {
        "input_tokens": 5,
        "cache_creation_input_tokens": 1000,
        "cache_read_input_tokens": 20000,
        "output_tokens": 42,
    }
    completion = asChat(anthropicAnswer(usage=usage))
    assert completion["usage"] == {
        "prompt_tokens": 21005,
        "completion_tokens": 42,
        "total_tokens": 21047,
        "prompt_tokens_details": {"cached_tokens": 20000, "cache_write_tokens": 1000},
    }
    details = ChatCompletion.model_validate(completion).usage
    assert details is not None and details.prompt_tokens_details is not None
    assert details.prompt_tokens_details.cache_write_tokens == 1000


@pytest.mark.parametrize(
    "message",
    [
        {"content": "not blocks"},
        {"content": [{"type": "text"}]},
        {"content": [{"type": "tool_use", "id": "t", "name": "n", "input": "x"}]},
        {"id": None},
    ],
)
def test_badAnthropicAnswer(message: dict[str, Any]) -> None:
    """
    An answer not of Anthropic's shape is a BadAnswer (the route's 502),
    never a TypeError.
    """
    with pytest.raises(BadAnswer):
        chatCompletionOf(anthropicAnswer(**message), created=CREATED)


# A chat completion as Anthropic's message.


def test_textAnswerToAnthropic() -> None:
    """
    The content is one text block; stop is end_turn; usage in three parts.
    """
    message = asAnthropic(openAIAnswer({"content": "Hi there", "refusal": None}))
    assert message == {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "model": "gpt-x",
        "content": [{"type": "text", "text": "Hi there"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 3,
        },
    }


def test_toolCallsAnswerToAnthropic() -> None:
    """
    Tool calls are tool_use blocks after the text, ids kept, arguments
    parsed; arguments that are not a JSON object are kept under a key of
    their own (and go back as they were); none at all are an empty input.
    """
    calls = [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "f", "arguments": '{"x": [1, 2]}'},
        },
        {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": '{"x": 1'}},
        {"id": "call_c", "type": "function", "function": {"name": "h", "arguments": ""}},
    ]
    message = asAnthropic(
        openAIAnswer({"content": "Let me see.", "tool_calls": calls}, "tool_calls")
    )
    assert message["content"] == [
        {"type": "text", "text": "Let me see."},
        {"type": "tool_use", "id": "call_a", "name": "f", "input": {"x": [1, 2]}},
        {
            "type": "tool_use",
            "id": "call_b",
            "name": "g",
            "input": {INVALID_ARGUMENTS_KEY: '{"x": 1'},
        },
        {"type": "tool_use", "id": "call_c", "name": "h", "input": {}},
    ]
    assert message["stop_reason"] == "tool_use"
    back = chatCompletionOf(message, created=CREATED)["choices"][0]["message"]["tool_calls"]
    assert [call["function"]["arguments"] for call in back] == ['{"x":[1,2]}', '{"x": 1', "{}"]


@pytest.mark.parametrize(
    ("finish", "matched", "calledTools", "expected"),
    [
        ("stop", None, False, ("end_turn", None)),
        ("stop", "END", False, ("stop_sequence", "END")),
        ("stop", 50256, False, ("end_turn", None)),
        ("length", None, False, ("max_tokens", None)),
        ("length", None, True, ("max_tokens", None)),
        ("tool_calls", None, True, ("tool_use", None)),
        ("function_call", None, False, ("tool_use", None)),
        ("content_filter", None, False, ("refusal", None)),
        ("stop", None, True, ("tool_use", None)),
        (None, None, False, ("end_turn", None)),
    ],
)
def test_finishReasonsToStopReasons(
    finish: str | None, matched: object, calledTools: bool, expected: tuple[str, str | None]
) -> None:
    """
    Each finish reason has its stop reason; a stop with tool calls is
    tool_use (Anthropic's clients run tools on it only).
    """
    assert stopReasonOf(finish, matched, calledTools=calledTools) == expected


def test_refusalToAnthropic() -> None:
    """
    OpenAI's refusal is text, and the stop reason is refusal.
    """
    message = asAnthropic(openAIAnswer({"content": None, "refusal": "I can't help."}))
    assert message["content"] == [{"type": "text", "text": "I can't help."}]
    assert message["stop_reason"] == "refusal"


def test_cacheUsageToAnthropic() -> None:
    """
    cached_tokens are reads, cache_write_tokens writes, the rest of the
    prompt input_tokens; the answer's other choices are not answered.
    """
    usage = {
        "prompt_tokens": 1000,
        "completion_tokens": 7,
        "total_tokens": 1007,
        "prompt_tokens_details": {"cached_tokens": 600, "cache_write_tokens": 300},
    }
    completion = openAIAnswer({"content": "x"}, usage=usage)
    completion["choices"].append({"index": 1, "message": {"role": "assistant", "content": "other"}})
    message = asAnthropic(completion)
    assert message["usage"] == {
        "input_tokens": 100,
        "cache_creation_input_tokens": 300,
        "cache_read_input_tokens": 600,
        "output_tokens": 7,
    }
    assert message["content"] == [{"type": "text", "text": "x"}]


def test_contentPartsAndNoUsage() -> None:
    """
    A provider answering with text parts is read; without usage, the
    counts are zero (the route bills the reservation, decisions D11).
    """
    completion = openAIAnswer(
        {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    del completion["usage"]
    message = asAnthropic(completion)
    assert message["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert message["usage"]["input_tokens"] == 0


@pytest.mark.parametrize(
    "completion",
    [
        {"choices": []},
        {"choices": "x"},
        {"choices": [{"message": "x"}]},
        {"choices": [{"message": {"tool_calls": [{"id": "c", "function": {"name": "f"}}]}}]},
        {"model": 5},
    ],
)
def test_badOpenAIAnswer(completion: dict[str, Any]) -> None:
    """
    An answer not of OpenAI's shape is a BadAnswer, never a TypeError.
    """
    answer = openAIAnswer({"content": "x"})
    answer.update(completion)
    with pytest.raises(BadAnswer):
        anthropicMessageOf(answer)


# Usage records.


def test_usageRecordOfEitherShape() -> None:
    """
    Both shapes give the same record: inputs in three parts, output.
    """
    record = TokenUsage(inputTokens=4, cacheReadTokens=5, cacheWriteTokens=6, outputTokens=7)
    assert usageOfAnthropic(anthropicUsage(record)) == record
    assert usageOfOpenAI(openAIUsage(record)) == record
    assert (record.promptTokens, record.completionTokens) == (15, 7)


def test_insaneCountsAreAbsent() -> None:
    """
    Counts that are not non-negative integers are absent; parts are never
    more than their whole.
    """
    assert usageOfAnthropic({"input_tokens": -1, "output_tokens": True}) is None
    assert usageOfAnthropic("x") is None
    assert usageOfOpenAI({"prompt_tokens": 10}) is None
    usage = usageOfOpenAI(
        {
            "prompt_tokens": 10,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 9},
            "completion_tokens_details": {"reasoning_tokens": 5},
        }
    )
    assert usage == TokenUsage(
        inputTokens=0, cacheReadTokens=8, cacheWriteTokens=2, outputTokens=2, reasoningTokens=2
    )
    assert openAIUsage(usage)["completion_tokens_details"] == {"reasoning_tokens": 2}


def test_streamUsageTotals() -> None:
    """
    A stream's usage is message_start's, with each message_delta's totals
    over it (those it leaves out kept), as Anthropic's SDK accumulates.
    """
    stream = StreamUsage()
    stream.observe(
        {
            "type": "message_start",
            "message": {
                "usage": {
                    "input_tokens": 3,
                    "cache_creation_input_tokens": 100,
                    "cache_read_input_tokens": 0,
                    "output_tokens": 1,
                }
            },
        }
    )
    stream.observe({"type": "content_block_delta", "index": 0, "delta": {}})
    stream.observe({"type": "message_delta", "delta": {}, "usage": {"output_tokens": 30}})
    assert stream.usage == TokenUsage(inputTokens=3, cacheWriteTokens=100, outputTokens=30)
    stream.observe(
        {
            "type": "message_delta",
            "delta": {},
            "usage": {"output_tokens": 31, "cache_read_input_tokens": 9},
        }
    )
    assert stream.usage == TokenUsage(
        inputTokens=3, cacheReadTokens=9, cacheWriteTokens=100, outputTokens=31
    )


# There and back.


@settings(max_examples=300, deadline=None)
@given(anthropicMessages())
def test_anthropicAnswerThereAndBack(message: dict[str, Any]) -> None:
    """
    An Anthropic message that a chat completion can say, made one and
    back, is itself.
    """
    Message.model_validate(message)
    assert asAnthropic(asChat(message)) == message


@settings(max_examples=300, deadline=None)
@given(openAICompletions())
def test_openAIAnswerThereAndBack(completion: dict[str, Any]) -> None:
    """
    A chat completion that an Anthropic message can say, made one and
    back, is itself, whatever its tool calls' arguments.
    """
    ChatCompletion.model_validate(completion)
    assert asChat(asAnthropic(completion)) | {"created": completion["created"]} == completion
