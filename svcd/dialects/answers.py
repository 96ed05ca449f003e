"""
Whole answers between the dialects: an Anthropic message as a chat
completion (L{chatCompletionOf}), a chat completion as an Anthropic
message (L{anthropicMessageOf}).

  - the text ⇄ the text: Anthropic's text blocks joined as the one string
    of OpenAI's message (a chat completion has no blocks); OpenAI's text,
    and its C{refusal}, as a text block;
  - tool calls ⇄ C{tool_use} blocks, ids kept, arguments string ⇄ input
    object (arguments that are not a JSON object, a model's mistake,
    reach an Anthropic client under
    L{svcd.dialects.turns.INVALID_ARGUMENTS_KEY}, and go back as they
    were);
  - finish reasons ⇄ stop reasons (L{finishReasonOf}, L{stopReasonOf});
    the stop sequence that ended an answer ⇄ the choice's C{stop_reason}
    (vLLM's field for it; OpenAI itself does not say which one matched,
    so its C{stop} is C{end_turn});
  - ids and model names kept as the provider gave them; C{created}, which
    Anthropic's message lacks, given by the caller;
  - usage: L{svcd.dialects.usage}.

Blocks with no counterpart in a chat completion (C{thinking}, server
tools' blocks, which a translated request cannot have asked for) are left
out of it; only the first choice of a chat completion is answered (a
translated request asks for one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from svcd.dialects.errors import BadAnswer, Untranslatable
from svcd.dialects.shapes import array, mapping, text
from svcd.dialects.turns import answerInputOf, argumentsOf
from svcd.dialects.usage import (
    TokenUsage,
    anthropicUsage,
    openAIUsage,
    usageOfAnthropic,
    usageOfOpenAI,
)

_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
_STOP_REASONS = {
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


def finishReasonOf(stopReason: object) -> str:
    """
    OpenAI's finish reason for Anthropic's stop reason.
    """
    return _FINISH_REASONS.get(stopReason, "stop") if isinstance(stopReason, str) else "stop"


def stopReasonOf(
    finishReason: object, matched: object = None, *, calledTools: bool = False
) -> tuple[str, str | None]:
    """
    Anthropic's stop reason and stop sequence for OpenAI's finish reason
    and the stop sequence that matched (a choice's C{stop_reason}, when a
    string). An answer with tool calls whose provider said C{stop} stopped
    for its tools: Anthropic's clients run tools on C{tool_use} only.
    """
    if isinstance(finishReason, str) and finishReason in _STOP_REASONS:
        return _STOP_REASONS[finishReason], None
    if calledTools:
        return "tool_use", None
    if finishReason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def chatCompletionOf(message: Mapping[str, Any], *, created: int) -> dict[str, Any]:
    """
    The chat completion of an Anthropic message.

    @raise BadAnswer: C{message} is not of Anthropic's shape.
    """
    try:
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for index, block in enumerate(array(message.get("content"), "content")):
            path = f"content[{index}]"
            block = mapping(block, path)
            kind = block.get("type")
            if kind == "text":
                texts.append(text(block.get("text"), path + ".text"))
            elif kind == "tool_use":
                calls.append(
                    {
                        "id": text(block.get("id"), path + ".id"),
                        "type": "function",
                        "function": {
                            "name": text(block.get("name"), path + ".name"),
                            "arguments": argumentsOf(mapping(block.get("input"), path + ".input")),
                        },
                    }
                )
        answerID = text(message.get("id"), "id")
        model = text(message.get("model"), "model")
    except Untranslatable as fault:
        raise BadAnswer(str(fault)) from None
    stopReason = message.get("stop_reason")
    choice: dict[str, Any] = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": "".join(texts) if texts or not calls else None,
            "refusal": None,
        },
        "finish_reason": finishReasonOf(stopReason),
        "logprobs": None,
    }
    if calls:
        choice["message"]["tool_calls"] = calls
    matched = message.get("stop_sequence")
    if stopReason == "stop_sequence" and isinstance(matched, str):
        choice["stop_reason"] = matched
    completion: dict[str, Any] = {
        "id": answerID,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    usage = usageOfAnthropic(message.get("usage"))
    if usage is not None:
        completion["usage"] = openAIUsage(usage)
    return completion


def anthropicMessageOf(completion: Mapping[str, Any]) -> dict[str, Any]:
    """
    The Anthropic message of a chat completion (its first choice).

    @raise BadAnswer: C{completion} is not of OpenAI's shape.
    """
    try:
        choices = array(completion.get("choices"), "choices")
        if not choices:
            raise Untranslatable("choices", "must hold a choice")
        choice = mapping(choices[0], "choices[0]")
        message = mapping(choice.get("message"), "choices[0].message")
        blocks = _textBlocksOf(message)
        calls = message.get("tool_calls")
        for index, call in enumerate(array(calls, "tool_calls") if calls else ()):
            path = f"choices[0].message.tool_calls[{index}]"
            call = mapping(call, path)
            function = mapping(call.get("function"), path + ".function")
            blocks.append(
                {
                    "type": "tool_use",
                    "id": text(call.get("id"), path + ".id"),
                    "name": text(function.get("name"), path + ".function.name"),
                    "input": answerInputOf(
                        text(function.get("arguments"), path + ".function.arguments")
                    ),
                }
            )
        answerID = text(completion.get("id"), "id")
        model = text(completion.get("model"), "model")
    except Untranslatable as fault:
        raise BadAnswer(str(fault)) from None
    stopReason, stopSequence = stopReasonOf(
        choice.get("finish_reason"), choice.get("stop_reason"), calledTools=bool(calls)
    )
    if isinstance(message.get("refusal"), str) and message["refusal"]:
        stopReason = "refusal"
    usage = usageOfOpenAI(completion.get("usage")) or TokenUsage()
    return {
        "id": answerID,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stopReason,
        "stop_sequence": stopSequence,
        "usage": anthropicUsage(usage),
    }


def _textBlocksOf(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """
    The text of an OpenAI message as text blocks: its content (a string,
    or text parts from providers that answer with parts) and its refusal.
    Anthropic refuses empty text blocks in a later request, so there are
    none.
    """
    blocks: list[dict[str, Any]] = []
    content = message.get("content")
    if isinstance(content, str):
        pieces = [content]
    elif content is None:
        pieces = []
    else:
        pieces = []
        for index, part in enumerate(array(content, "choices[0].message.content")):
            part = mapping(part, f"choices[0].message.content[{index}]")
            if part.get("type") == "text":
                pieces.append(text(part.get("text"), f"choices[0].message.content[{index}].text"))
    refusal = message.get("refusal")
    if isinstance(refusal, str):
        pieces.append(refusal)
    blocks.extend({"type": "text", "text": piece} for piece in pieces if piece)
    return blocks
