"""
Conversations between the dialects: OpenAI's C{messages} (system,
developer, user, assistant and tool messages) and Anthropic's C{system}
and C{messages} (user and assistant turns of content blocks).

The correspondences:

  - system and developer messages ⇄ C{system}. Anthropic has one system
    prompt before the conversation, so every system or developer message
    is gathered there, in order, wherever it stood; one system message
    holding a string ⇄ C{system} a string, otherwise text blocks (one
    system message of text parts ⇄ the same text blocks);
  - a string content ⇄ a string content, text parts ⇄ text blocks; beside
    tool calls, or after tool results, one text part is a string (as
    OpenAI's clients write it), so that a round trip gives either form back;
  - an image part: a C{data:} URL in base64 ⇄ an image block of a base64
    source (JPEG, PNG, GIF or WebP, what Anthropic takes), an http(s) URL
    ⇄ an image block of a URL source (both sides fetch the URL
    themselves). The part's C{detail} (a resolution hint) has no
    counterpart and is left out;
  - an assistant's C{tool_calls} ⇄ its C{tool_use} blocks (after its text:
    OpenAI's message cannot say where among the text a call stood), ids
    kept; the arguments string ⇄ the input object (L{toolInputOf}: no
    arguments are C{{}}; arguments that are not a JSON object are refused
    in a request, which is the client's to mend, and kept under
    L{INVALID_ARGUMENTS_KEY} in an answer, L{answerInputOf}). An empty
    text beside tool calls is left out: Anthropic refuses empty text
    blocks;
  - tool messages ⇄ C{tool_result} blocks: consecutive tool messages, and
    a user message right after them, make one user turn, its results
    first, as Anthropic requires; the other way, a user turn's results
    become tool messages before the rest of the turn's content.

Left out on the way to OpenAI, because they change no answer's text:
C{cache_control} (a caching hint: OpenAI-compatible providers cache by
themselves), an assistant's C{thinking} and C{redacted_thinking} blocks
(the model's own earlier reasoning, which chat completions take no
input for) and a tool result's C{is_error} (the result's text says what
failed; a tool message has no flag for it). Everything else without a
counterpart is refused, naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from svcd.dialects.errors import Untranslatable
from svcd.dialects.shapes import (
    TO_ANTHROPIC,
    TO_OPENAI,
    array,
    mapping,
    only,
    text,
)

# The media types of images Anthropic takes in base64.
IMAGE_MEDIA_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_DATA_URL = re.compile(r"data:(?P<media>[^;,]+);base64,(?P<data>.*)", re.DOTALL)

# A tool call whose arguments are not a JSON object (a model's mistake in
# an OpenAI-shaped answer) reaches an Anthropic client as this one-key
# input, which must be an object, and goes back to OpenAI as the very
# string it was: the model sees its own call again, as it made it.
INVALID_ARGUMENTS_KEY = "svc_unparsed_arguments"

_TEXT_BLOCK_KEYS = frozenset({"type", "text", "cache_control"})
_IMAGE_BLOCK_KEYS = frozenset({"type", "source", "cache_control"})
_TOOL_USE_KEYS = frozenset({"type", "id", "name", "input", "cache_control"})
_TOOL_RESULT_KEYS = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
_DROPPED_ASSISTANT_BLOCKS = frozenset({"thinking", "redacted_thinking"})


def toolInputOf(arguments: str) -> dict[str, Any] | None:
    """
    The input object of OpenAI's arguments string, or C{None} when it is
    not a JSON object. No arguments at all (an empty string, as some
    providers send for a tool without parameters) are an empty object.
    """
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def answerInputOf(arguments: str) -> dict[str, Any]:
    """
    The input object of a tool call in a provider's answer: its arguments
    when they are a JSON object, else those arguments kept under
    L{INVALID_ARGUMENTS_KEY} (an answer cannot be refused to its client).
    """
    parsed = toolInputOf(arguments)
    return parsed if parsed is not None else {INVALID_ARGUMENTS_KEY: arguments}


def argumentsOf(toolInput: Mapping[str, Any]) -> str:
    """
    OpenAI's arguments string of an input object (compact JSON, as OpenAI
    writes it); the arguments kept by L{answerInputOf} as they were.
    """
    if len(toolInput) == 1 and isinstance(toolInput.get(INVALID_ARGUMENTS_KEY), str):
        return str(toolInput[INVALID_ARGUMENTS_KEY])
    return json.dumps(toolInput, ensure_ascii=False, separators=(",", ":"))


# Anthropic's turns to OpenAI's messages.


def chatMessagesOf(system: object, messages: object) -> list[dict[str, Any]]:
    """
    OpenAI's messages for Anthropic's C{system} (C{None} when absent) and
    C{messages}.
    """
    chat: list[dict[str, Any]] = []
    if isinstance(system, str):
        chat.append({"role": "system", "content": system})
    elif system is not None:
        blocks = array(system, "system")
        if blocks:
            parts = [_textPart(block, f"system[{index}]") for index, block in enumerate(blocks)]
            chat.append({"role": "system", "content": parts})
    for index, turn in enumerate(array(messages, "messages")):
        path = f"messages[{index}]"
        turn = mapping(turn, path)
        only(turn, ("role", "content"), path, TO_OPENAI)
        role = turn.get("role")
        if role == "user":
            chat.extend(_userMessages(turn.get("content"), path + ".content"))
        elif role == "assistant":
            chat.append(_assistantMessage(turn.get("content"), path + ".content"))
        else:
            raise Untranslatable(path + ".role", "must be user or assistant")
    return chat


def _textPart(block: object, path: str) -> dict[str, Any]:
    block = mapping(block, path)
    if block.get("type") != "text":
        raise Untranslatable(path + ".type", "must be text")
    only(block, _TEXT_BLOCK_KEYS, path, TO_OPENAI)
    return {"type": "text", "text": text(block.get("text"), path + ".text")}


def _imagePart(block: Mapping[str, Any], path: str) -> dict[str, Any]:
    only(block, _IMAGE_BLOCK_KEYS, path, TO_OPENAI)
    source = mapping(block.get("source"), path + ".source")
    kind = source.get("type")
    if kind == "base64":
        only(source, ("type", "media_type", "data"), path + ".source", TO_OPENAI)
        media = text(source.get("media_type"), path + ".source.media_type")
        data = text(source.get("data"), path + ".source.data")
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        only(source, ("type", "url"), path + ".source", TO_OPENAI)
        url = text(source.get("url"), path + ".source.url")
    else:
        raise Untranslatable(path + ".source.type", TO_OPENAI)
    return {"type": "image_url", "image_url": {"url": url}}


def _userMessages(content: object, path: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(array(content, path)):
        where = f"{path}[{index}]"
        block = mapping(block, where)
        kind = block.get("type")
        if kind == "tool_result":
            results.append(_toolMessage(block, where))
        elif kind == "text":
            parts.append(_textPart(block, where))
        elif kind == "image":
            parts.append(_imagePart(block, where))
        else:
            raise Untranslatable(where + ".type", TO_OPENAI)
    if parts or not results:
        results.append({"role": "user", "content": _afterTools(parts, results)})
    return results


def _afterTools(parts: list[dict[str, Any]], calls: list[dict[str, Any]]) -> Any:
    """
    The content of a chat message beside tool calls or after tool results:
    one text part is a string, as OpenAI's clients write it (and as the
    other way reads it, so that a round trip gives it back).
    """
    if calls and len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _toolMessage(block: Mapping[str, Any], path: str) -> dict[str, Any]:
    only(block, _TOOL_RESULT_KEYS, path, TO_OPENAI)
    content = block.get("content")
    if content is None:
        content = ""
    elif not isinstance(content, str):
        content = [
            _textPart(each, f"{path}.content[{index}]")
            for index, each in enumerate(array(content, path + ".content"))
        ]
    return {
        "role": "tool",
        "tool_call_id": text(block.get("tool_use_id"), path + ".tool_use_id"),
        "content": content,
    }


def _assistantMessage(content: object, path: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(array(content, path)):
        where = f"{path}[{index}]"
        block = mapping(block, where)
        kind = block.get("type")
        if kind == "text":
            parts.append(_textPart(block, where))
        elif kind == "tool_use":
            only(block, _TOOL_USE_KEYS, where, TO_OPENAI)
            toolInput = mapping(block.get("input"), where + ".input")
            calls.append(
                {
                    "id": text(block.get("id"), where + ".id"),
                    "type": "function",
                    "function": {
                        "name": text(block.get("name"), where + ".name"),
                        "arguments": argumentsOf(toolInput),
                    },
                }
            )
        elif kind not in _DROPPED_ASSISTANT_BLOCKS:
            raise Untranslatable(where + ".type", TO_OPENAI)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": _afterTools(parts, calls) if parts or not calls else None,
    }
    if calls:
        message["tool_calls"] = calls
    return message


# OpenAI's messages to Anthropic's system and turns.


def anthropicTurnsOf(
    messages: object,
) -> tuple[str | list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """
    Anthropic's C{system} (C{None} when there is none) and C{messages} for
    OpenAI's C{messages}.
    """
    system: list[tuple[str, object]] = []
    turns: list[dict[str, Any]] = []
    # The user turn made of tool results, while the next message may still
    # join it.
    results: list[dict[str, Any]] | None = None
    for index, message in enumerate(array(messages, "messages")):
        path = f"messages[{index}]"
        message = mapping(message, path)
        role = message.get("role")
        if role in ("system", "developer"):
            only(message, ("role", "content"), path, TO_ANTHROPIC)
            system.append((path + ".content", message.get("content")))
        elif role == "tool":
            block = _toolResult(message, path)
            if results is None:
                results = [block]
                turns.append({"role": "user", "content": results})
            else:
                results.append(block)
        elif role == "user":
            only(message, ("role", "content"), path, TO_ANTHROPIC)
            content = _userContent(message.get("content"), path + ".content")
            if results is None:
                turns.append({"role": "user", "content": content})
            elif isinstance(content, str):
                results.append({"type": "text", "text": content})
            else:
                results.extend(content)
            results = None
        elif role == "assistant":
            turns.append(_assistantTurn(message, path))
            results = None
        else:
            raise Untranslatable(path + ".role", TO_ANTHROPIC)
    return _systemOf(system), turns


def _systemOf(found: list[tuple[str, object]]) -> str | list[dict[str, Any]] | None:
    if not found:
        return None
    if len(found) == 1 and isinstance(found[0][1], str):
        return found[0][1]
    blocks: list[dict[str, Any]] = []
    for path, content in found:
        if isinstance(content, str):
            if content:
                blocks.append({"type": "text", "text": content})
        else:
            blocks.extend(_textBlocks(content, path))
    return blocks


def _textBlocks(
    content: object, path: str, kinds: tuple[str, ...] = ("text",)
) -> list[dict[str, Any]]:
    """
    Text blocks of text parts (and of an assistant's refusal parts, which
    are its text too).
    """
    blocks = []
    for index, part in enumerate(array(content, path)):
        where = f"{path}[{index}]"
        part = mapping(part, where)
        kind = part.get("type")
        if kind not in kinds:
            raise Untranslatable(where + ".type", "must be " + " or ".join(kinds))
        only(part, ("type", kind), where, TO_ANTHROPIC)
        blocks.append({"type": "text", "text": text(part.get(kind), f"{where}.{kind}")})
    return blocks


def _userContent(content: object, path: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    blocks: list[dict[str, Any]] = []
    for index, part in enumerate(array(content, path)):
        where = f"{path}[{index}]"
        part = mapping(part, where)
        kind = part.get("type")
        if kind == "text":
            only(part, ("type", "text"), where, TO_ANTHROPIC)
            blocks.append({"type": "text", "text": text(part.get("text"), where + ".text")})
        elif kind == "image_url":
            only(part, ("type", "image_url"), where, TO_ANTHROPIC)
            blocks.append(_imageBlock(part.get("image_url"), where + ".image_url"))
        else:
            raise Untranslatable(where + ".type", TO_ANTHROPIC)
    return blocks


def _imageBlock(image: object, path: str) -> dict[str, Any]:
    image = mapping(image, path)
    # detail is a resolution hint, left out (see the module's docstring).
    only(image, ("url", "detail"), path, TO_ANTHROPIC)
    url = text(image.get("url"), path + ".url")
    source: dict[str, Any]
    if url.startswith("data:"):
        match = _DATA_URL.fullmatch(url)
        if match is None or match["media"] not in IMAGE_MEDIA_TYPES:
            raise Untranslatable(
                path + ".url",
                "must be a data: URL in base64 of a JPEG, PNG, GIF or WebP image",
            )
        source = {"type": "base64", "media_type": match["media"], "data": match["data"]}
    elif url.startswith(("https://", "http://")):
        source = {"type": "url", "url": url}
    else:
        raise Untranslatable(path + ".url", "must be an http(s) URL or a data: URL")
    return {"type": "image", "source": source}


def _toolResult(message: Mapping[str, Any], path: str) -> dict[str, Any]:
    only(message, ("role", "content", "tool_call_id"), path, TO_ANTHROPIC)
    content = message.get("content")
    result: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": text(message.get("tool_call_id"), path + ".tool_call_id"),
    }
    if isinstance(content, str):
        result["content"] = content
    else:
        result["content"] = _textBlocks(content, path + ".content")
    return result


def _assistantTurn(message: Mapping[str, Any], path: str) -> dict[str, Any]:
    only(message, ("role", "content", "tool_calls", "refusal"), path, TO_ANTHROPIC)
    content = message.get("content")
    calls = message.get("tool_calls")
    refusal = message.get("refusal")
    if isinstance(content, str) and not calls and refusal is None:
        return {"role": "assistant", "content": content}
    blocks: list[dict[str, Any]] = []
    if isinstance(content, str):
        if content:
            blocks.append({"type": "text", "text": content})
    elif content is not None:
        blocks.extend(_textBlocks(content, path + ".content", ("text", "refusal")))
    elif not calls and refusal is None:
        return {"role": "assistant", "content": ""}
    if refusal is not None:
        blocks.append({"type": "text", "text": text(refusal, path + ".refusal")})
    for index, call in enumerate(array(calls, path + ".tool_calls") if calls else ()):
        blocks.append(_toolUse(call, f"{path}.tool_calls[{index}]"))
    return {"role": "assistant", "content": blocks}


def _toolUse(call: object, path: str) -> dict[str, Any]:
    call = mapping(call, path)
    if call.get("type", "function") != "function":
        raise Untranslatable(path + ".type", TO_ANTHROPIC)
    only(call, ("id", "type", "function"), path, TO_ANTHROPIC)
    function = mapping(call.get("function"), path + ".function")
    only(function, ("name", "arguments"), path + ".function", TO_ANTHROPIC)
    arguments = function.get("arguments")
    toolInput = toolInputOf(text(arguments, path + ".function.arguments"))
    if toolInput is None:
        raise Untranslatable(path + ".function.arguments", "must be a JSON object")
    return {
        "type": "tool_use",
        "id": text(call.get("id"), path + ".id"),
        "name": text(function.get("name"), path + ".function.name"),
        "input": toolInput,
    }
