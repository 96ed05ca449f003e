"""
Hypothesis strategies and SDK checks shared by the tests of svcd/dialects:
requests and answers of either dialect made only of fields that have a
counterpart in the other, in the form a round trip gives back (see each
strategy for the form chosen where a dialect has two for one meaning), and
the official SDKs' types to validate what the translations make.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from anthropic.types import RawMessageStreamEvent
from anthropic.types import message_create_params as anthropicParams
from hypothesis import strategies as st
from openai.types.chat import completion_create_params as openAIParams
from pydantic import TypeAdapter

from svcd.dialects.turns import IMAGE_MEDIA_TYPES

ANTHROPIC_REQUEST = TypeAdapter(anthropicParams.MessageCreateParamsNonStreaming)
OPENAI_REQUEST = TypeAdapter(openAIParams.CompletionCreateParamsNonStreaming)
ANTHROPIC_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


def force(value: object) -> object:
    """
    Walk what a pydantic adapter made of a TypedDict: its iterables are
    validated lazily, as they are read.
    """
    if isinstance(value, dict):
        return {key: force(each) for key, each in value.items()}
    if isinstance(value, str | bytes | int | float | bool) or value is None:
        return value
    if isinstance(value, Iterable):
        return [force(each) for each in value]
    return value


def validAnthropicRequest(body: dict[str, Any]) -> None:
    """
    C{body} is a Messages body by Anthropic's SDK's types (which type the
    fields every model takes; temperature, top_p and top_k are not among
    them in this SDK and go unchecked).
    """
    without = {key: value for key, value in body.items() if key != "stream"}
    force(ANTHROPIC_REQUEST.validate_python(without))


def validOpenAIRequest(body: dict[str, Any]) -> None:
    """
    C{body} is a chat completions body by OpenAI's SDK's types.
    """
    without = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    force(OPENAI_REQUEST.validate_python(without))


texts = st.text(max_size=20)
words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
nonEmptyTexts = st.text(min_size=1, max_size=20)
ids = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-",
    min_size=1,
    max_size=24,
)
jsonValues = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3),
    max_leaves=8,
)
jsonObjects = st.dictionaries(texts, jsonValues, max_size=4)
base64Data = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=", max_size=40
)
httpURLs = st.builds(lambda path: "https://images.example/" + path, words)
counts = st.integers(0, 10**7)


def compact(document: object) -> str:
    return json.dumps(document, ensure_ascii=False, separators=(",", ":"))


# Anthropic's requests.


def _textBlock(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


# Anthropic refuses empty text blocks: a request cannot hold one.
anthropicTextBlocks = st.builds(_textBlock, nonEmptyTexts)
anthropicImageBlocks = st.one_of(
    st.builds(
        lambda media, data: {
            "type": "image",
            "source": {"type": "base64", "media_type": media, "data": data},
        },
        st.sampled_from(sorted(IMAGE_MEDIA_TYPES)),
        base64Data,
    ),
    st.builds(lambda url: {"type": "image", "source": {"type": "url", "url": url}}, httpURLs),
)
anthropicToolUses = st.builds(
    lambda toolID, name, toolInput: {
        "type": "tool_use",
        "id": toolID,
        "name": name,
        "input": toolInput,
    },
    ids,
    words,
    jsonObjects,
)
anthropicToolResults = st.builds(
    lambda toolID, content: {"type": "tool_result", "tool_use_id": toolID, "content": content},
    ids,
    texts | st.lists(anthropicTextBlocks, max_size=2),
)


@st.composite
def anthropicUserTurns(draw: st.DrawFn) -> dict[str, Any]:
    """
    A user turn: a string, or blocks with its tool results first.
    """
    if draw(st.booleans()):
        return {"role": "user", "content": draw(texts)}
    results = draw(st.lists(anthropicToolResults, max_size=2))
    rest = draw(
        st.lists(
            anthropicTextBlocks | anthropicImageBlocks, min_size=0 if results else 1, max_size=3
        )
    )
    return {"role": "user", "content": results + rest}


@st.composite
def anthropicAssistantTurns(draw: st.DrawFn) -> dict[str, Any]:
    """
    An assistant turn: a string, or text blocks then tool uses (a chat
    message cannot place its calls among its text).
    """
    if draw(st.booleans()):
        return {"role": "assistant", "content": draw(texts)}
    calls = draw(st.lists(anthropicToolUses, max_size=2))
    text = draw(st.lists(anthropicTextBlocks, min_size=0 if calls else 1, max_size=3))
    return {"role": "assistant", "content": text + calls}


@st.composite
def anthropicConversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    turns = draw(st.integers(1, 5))
    return [
        draw(anthropicUserTurns() if index % 2 == 0 else anthropicAssistantTurns())
        for index in range(turns)
    ]


anthropicTools = st.builds(
    lambda name, description, properties, strict: {
        "name": name,
        "input_schema": {"type": "object", "properties": properties},
        **({"description": description} if description is not None else {}),
        **({"strict": strict} if strict is not None else {}),
    },
    words,
    st.none() | texts,
    st.dictionaries(words, st.just({"type": "string"}), max_size=2),
    st.none() | st.booleans(),
)


@st.composite
def anthropicToolChoices(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["auto", "any", "tool", "none"]))
    choice: dict[str, Any] = {"type": kind}
    if kind == "tool":
        choice["name"] = draw(words)
    if kind != "none" and draw(st.booleans()):
        choice["disable_parallel_tool_use"] = draw(st.booleans())
    return choice


@st.composite
def anthropicRequests(draw: st.DrawFn) -> dict[str, Any]:
    """
    A Messages body of every field that has a counterpart in chat
    completions.
    """
    body: dict[str, Any] = {
        "model": draw(words),
        "max_tokens": draw(st.integers(1, 10**6)),
        "messages": draw(anthropicConversations()),
    }
    optional = {
        "system": texts | st.lists(anthropicTextBlocks, min_size=1, max_size=3),
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0, 1),
        "stop_sequences": st.lists(nonEmptyTexts, min_size=1, max_size=4),
        "stream": st.booleans(),
        "tools": st.lists(anthropicTools, min_size=1, max_size=3),
        "tool_choice": anthropicToolChoices(),
        "metadata": st.builds(lambda user: {"user_id": user}, ids),
    }
    for name, values in optional.items():
        if draw(st.booleans()):
            body[name] = draw(values)
    return body


# OpenAI's requests.


def _part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


openAITextParts = st.builds(_part, texts)
openAIImageParts = st.one_of(
    st.builds(
        lambda media, data: {
            "type": "image_url",
            "image_url": {"url": f"data:{media};base64,{data}"},
        },
        st.sampled_from(sorted(IMAGE_MEDIA_TYPES)),
        base64Data,
    ),
    st.builds(lambda url: {"type": "image_url", "image_url": {"url": url}}, httpURLs),
)
openAIToolCalls = st.builds(
    lambda callID, name, arguments: {
        "id": callID,
        "type": "function",
        "function": {"name": name, "arguments": compact(arguments)},
    },
    ids,
    words,
    jsonObjects,
)


@st.composite
def openAIConversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """
    A conversation: an optional system message first (where Anthropic's
    system prompt is), then user and assistant messages; an assistant's
    tool calls are followed by their tool messages, then perhaps a user
    message. An assistant with tool calls has a string or no content
    (OpenAI's own form).
    """
    messages: list[dict[str, Any]] = []
    content: Any
    if draw(st.booleans()):
        content = draw(texts | st.lists(openAITextParts, min_size=1, max_size=2))
        messages.append({"role": "system", "content": content})
    userContent = texts | st.lists(openAITextParts | openAIImageParts, min_size=1, max_size=3)
    for _ in range(draw(st.integers(1, 3))):
        content = draw(userContent)
        if messages and messages[-1]["role"] == "tool" and _oneText(content):
            content = content[0]["text"]
        messages.append({"role": "user", "content": content})
        calls = draw(st.lists(openAIToolCalls, max_size=2))
        if not calls:
            messages.append({"role": "assistant", "content": draw(texts)})
            continue
        text = draw(st.none() | nonEmptyTexts)
        messages.append({"role": "assistant", "content": text, "tool_calls": calls})
        for call in calls:
            content = draw(texts | st.lists(openAITextParts, max_size=2))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    if messages[-1]["role"] == "tool" and draw(st.booleans()):
        content = draw(userContent)
        if _oneText(content):
            content = content[0]["text"]
        messages.append({"role": "user", "content": content})
    return messages


def _oneText(content: object) -> bool:
    # After tool messages, a user message of one text part reads back as
    # a string: OpenAI's clients write it so.
    return isinstance(content, list) and len(content) == 1 and content[0]["type"] == "text"


openAITools = st.builds(
    lambda name, description, properties, strict: {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": properties},
            **({"description": description} if description is not None else {}),
            **({"strict": strict} if strict is not None else {}),
        },
    },
    words,
    st.none() | texts,
    st.dictionaries(words, st.just({"type": "string"}), max_size=2),
    st.none() | st.booleans(),
)
openAIToolChoices = st.sampled_from(["auto", "none", "required"]) | st.builds(
    lambda name: {"type": "function", "function": {"name": name}}, words
)


@st.composite
def openAIRequests(draw: st.DrawFn) -> dict[str, Any]:
    """
    A chat completions body of every field that has a counterpart in
    Anthropic's Messages API.
    """
    body: dict[str, Any] = {
        "model": draw(words),
        "messages": draw(openAIConversations()),
        "max_completion_tokens": draw(st.integers(1, 10**6)),
    }
    optional = {
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0, 1),
        "stop": st.lists(nonEmptyTexts, min_size=1, max_size=4),
        "tools": st.lists(openAITools, min_size=1, max_size=3),
        "tool_choice": openAIToolChoices,
        "user": ids,
    }
    for name, values in optional.items():
        if draw(st.booleans()):
            body[name] = draw(values)
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
    if body.get("tool_choice") not in (None, "none") and draw(st.booleans()):
        body["parallel_tool_calls"] = draw(st.booleans())
    return body


# Answers.


@st.composite
def anthropicMessages(draw: st.DrawFn) -> dict[str, Any]:
    """
    An Anthropic message as a chat completion can say it: one text block
    at most, first, then tool uses; a stop reason that fits its blocks.
    """
    content: list[dict[str, Any]] = []
    if draw(st.booleans()):
        content.append(_textBlock(draw(nonEmptyTexts)))
    calls = draw(st.lists(anthropicToolUses, max_size=3))
    content.extend(calls)
    stopSequence = None
    if calls:
        stopReason = draw(st.sampled_from(["tool_use", "max_tokens"]))
    else:
        stopReason = draw(st.sampled_from(["end_turn", "max_tokens", "stop_sequence", "refusal"]))
        if stopReason == "stop_sequence":
            stopSequence = draw(nonEmptyTexts)
    return {
        "id": "msg_" + draw(ids),
        "type": "message",
        "role": "assistant",
        "model": draw(words),
        "content": content,
        "stop_reason": stopReason,
        "stop_sequence": stopSequence,
        "usage": {
            "input_tokens": draw(counts),
            "cache_creation_input_tokens": draw(counts),
            "cache_read_input_tokens": draw(counts),
            "output_tokens": draw(counts),
        },
    }


def _notAnObject(text: str) -> bool:
    if not text.strip():
        return False
    try:
        return not isinstance(json.loads(text), dict)
    except ValueError:
        return True


answerArguments = st.builds(compact, jsonObjects) | st.text(max_size=20).filter(_notAnObject)


@st.composite
def openAICompletions(draw: st.DrawFn) -> dict[str, Any]:
    """
    A chat completion as an Anthropic message can say it: a string
    content (or none beside tool calls), a finish reason that fits it, the
    stop sequence that matched (vLLM's C{stop_reason}) only on C{stop}.
    """
    calls = draw(
        st.lists(
            st.builds(
                lambda callID, name, arguments: {
                    "id": callID,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                },
                ids,
                words,
                answerArguments,
            ),
            max_size=3,
        )
    )
    message: dict[str, Any] = {"role": "assistant", "refusal": None}
    choice: dict[str, Any] = {"index": 0, "logprobs": None}
    if calls:
        message["content"] = draw(st.none() | nonEmptyTexts)
        message["tool_calls"] = calls
        choice["finish_reason"] = draw(st.sampled_from(["tool_calls", "length"]))
    else:
        message["content"] = draw(texts)
        choice["finish_reason"] = draw(st.sampled_from(["stop", "length", "content_filter"]))
        if choice["finish_reason"] == "stop" and draw(st.booleans()):
            choice["stop_reason"] = draw(nonEmptyTexts)
    choice["message"] = message
    prompt = draw(counts)
    cached = draw(st.integers(0, prompt))
    written = draw(st.integers(0, prompt - cached))
    completion = draw(counts)
    return {
        "id": "chatcmpl-" + draw(ids),
        "object": "chat.completion",
        "created": draw(st.integers(0, 2**31)),
        "model": draw(words),
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        },
    }
