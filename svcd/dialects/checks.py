"""
The shape of a C{/v1/messages} body (and of C{/v1/messages/count_tokens},
which has no C{max_tokens}), checked as the edge checks a chat body
(decisions D4): every failed rule is collected, with a dotted path
(C{messages[3].content[0].text}), so the client sees all of them in one
400 VALIDATION_ERROR. The body is the object the edge parsed by D10's
rules (no infinite number, no lone surrogate).

Only what the gateway reads or must bound is checked, with the chat
body's bounds: the model, the output cap (required, at least 1; its
ceiling is the model's, checked by the edge, decisions D12 amended), at
most 1000 turns of C{user} or C{assistant}, each text at most 100 KiB of
UTF-8, and the types of the fields Anthropic documents. A block type or a
field the gateway does not know is left for the provider to judge: an
Anthropic provider is sent the body as the client wrote it, and a
translation refuses what it cannot carry (L{svcd.dialects.requests}).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from svcd.common.errors import FieldError, FieldErrorCode, validationError
from svcd.dialects.shapes import isInteger, isNumber

# The chat body's bounds (svc-proxy's chat body rules, decisions D4).
MAX_MODEL_CHARACTERS = 256
MAX_MESSAGES = 1000
MAX_CONTENT_BYTES = 100 * 1024
# Content blocks of one turn, or of one tool result: bounded like turns,
# so that one body cannot make a list of a million field errors.
MAX_BLOCKS = 1000
ROLES = ("user", "assistant")
TOOL_CHOICES = ("auto", "any", "tool", "none")

_REQUIRED = FieldErrorCode.REQUIRED
_FORMAT = FieldErrorCode.INVALID_FORMAT


@attrs.frozen
class MessagesRequest:
    """
    What the gateway reads of a valid Messages body; the conversation is
    kept for the provider and never logged.
    """

    model: str
    # None for count_tokens, which has none.
    maxTokens: int | None
    stream: bool = False
    # The whole object as the client sent it, unknown keys included.
    document: dict[str, Any] = attrs.field(factory=dict, repr=False)


def parseMessagesBody(document: dict[str, Any], *, countTokens: bool = False) -> MessagesRequest:
    """
    The request of a valid Messages body.

    @raise ApiError: 400 VALIDATION_ERROR listing every failed rule.
    """
    errors = messagesBodyErrors(document, countTokens=countTokens)
    if errors:
        raise validationError(errors)
    maxTokens = document.get("max_tokens")
    return MessagesRequest(
        model=document["model"],
        maxTokens=maxTokens,
        stream=document.get("stream") is True,
        document=document,
    )


def messagesBodyErrors(
    document: Mapping[str, Any], *, countTokens: bool = False
) -> list[FieldError]:
    """
    Every rule a Messages body fails, in the order of its fields (the
    first one is the first problem); none when it is valid.
    """
    errors: list[FieldError] = []
    _checkModel(document.get("model"), errors)
    maxTokens = document.get("max_tokens")
    if maxTokens is None:
        if not countTokens:
            errors.append(FieldError("max_tokens", _REQUIRED, "is required"))
    elif not isInteger(maxTokens):
        errors.append(FieldError("max_tokens", _FORMAT, "must be an integer"))
    elif maxTokens < 1:
        errors.append(FieldError("max_tokens", _FORMAT, "must be at least 1"))
    _checkMessages(document.get("messages"), errors)
    _checkSystem(document.get("system"), errors)
    stops = document.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(each, str) for each in stops)
    ):
        errors.append(FieldError("stop_sequences", _FORMAT, "must be an array of strings"))
    for name in ("temperature", "top_p"):
        value = document.get(name)
        if value is not None and not isNumber(value):
            errors.append(FieldError(name, _FORMAT, "must be a number"))
    topK = document.get("top_k")
    if topK is not None and not (isInteger(topK) and topK >= 0):
        errors.append(FieldError("top_k", _FORMAT, "must be an integer of at least 0"))
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        errors.append(FieldError("stream", _FORMAT, "must be a boolean"))
    _checkTools(document.get("tools"), errors)
    _checkToolChoice(document.get("tool_choice"), errors)
    metadata = document.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            errors.append(FieldError("metadata", _FORMAT, "must be an object"))
        elif metadata.get("user_id") is not None and not isinstance(metadata["user_id"], str):
            errors.append(FieldError("metadata.user_id", _FORMAT, "must be a string"))
    thinking = document.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict):
            errors.append(FieldError("thinking", _FORMAT, "must be an object"))
        elif not isinstance(thinking.get("type"), str):
            errors.append(FieldError("thinking.type", _REQUIRED, "is required"))
    return errors


def _checkModel(model: object, errors: list[FieldError]) -> None:
    if model is None:
        errors.append(FieldError("model", _REQUIRED, "is required"))
    elif not isinstance(model, str):
        errors.append(FieldError("model", _FORMAT, "must be a string"))
    elif len(model) > MAX_MODEL_CHARACTERS:
        errors.append(
            FieldError(
                "model",
                FieldErrorCode.TOO_LONG,
                f"must be at most {MAX_MODEL_CHARACTERS} characters",
            )
        )


def _tooLong(content: str) -> bool:
    # Cheap bounds first: a character is 1 to 4 bytes of UTF-8.
    if len(content) * 4 <= MAX_CONTENT_BYTES:
        return False
    if len(content) > MAX_CONTENT_BYTES:
        return True
    return len(content.encode("utf-8", "surrogatepass")) > MAX_CONTENT_BYTES


def _checkText(
    value: object, path: str, errors: list[FieldError], *, required: bool = True
) -> None:
    if value is None:
        if required:
            errors.append(FieldError(path, _REQUIRED, "is required"))
    elif not isinstance(value, str):
        errors.append(FieldError(path, _FORMAT, "must be a string"))
    elif _tooLong(value):
        errors.append(
            FieldError(
                path,
                FieldErrorCode.TOO_LONG,
                f"must be at most {MAX_CONTENT_BYTES} bytes of UTF-8",
            )
        )


def _checkString(value: object, path: str, errors: list[FieldError]) -> None:
    if value is None:
        errors.append(FieldError(path, _REQUIRED, "is required"))
    elif not isinstance(value, str):
        errors.append(FieldError(path, _FORMAT, "must be a string"))


def _checkMessages(messages: object, errors: list[FieldError]) -> None:
    if messages is None or (isinstance(messages, list) and not messages):
        errors.append(FieldError("messages", _REQUIRED, "must hold at least one message"))
    elif not isinstance(messages, list):
        errors.append(FieldError("messages", _FORMAT, "must be an array"))
    elif len(messages) > MAX_MESSAGES:
        # The items are not checked: that could list thousands of errors.
        errors.append(
            FieldError(
                "messages", FieldErrorCode.TOO_MANY, f"must hold at most {MAX_MESSAGES} messages"
            )
        )
    else:
        for index, message in enumerate(messages):
            _checkTurn(f"messages[{index}]", message, errors)


def _checkTurn(path: str, message: object, errors: list[FieldError]) -> None:
    if not isinstance(message, dict):
        errors.append(FieldError(path, _FORMAT, "must be an object"))
        return
    role = message.get("role")
    if role is None:
        errors.append(FieldError(path + ".role", _REQUIRED, "is required"))
    elif role not in ROLES:
        errors.append(
            FieldError(
                path + ".role", FieldErrorCode.INVALID_ENUM, "must be one of assistant, user"
            )
        )
    _checkContent(path + ".content", message.get("content"), errors, required=True)


def _checkContent(
    path: str, content: object, errors: list[FieldError], *, required: bool, nested: bool = False
) -> None:
    if isinstance(content, list):
        _checkBlocks(path, content, errors, nested=nested)
    elif content is None or isinstance(content, str):
        _checkText(content, path, errors, required=required)
    else:
        errors.append(FieldError(path, _FORMAT, "must be a string or an array of blocks"))


def _checkBlocks(
    path: str, blocks: list[Any], errors: list[FieldError], *, nested: bool = False
) -> None:
    if len(blocks) > MAX_BLOCKS:
        errors.append(
            FieldError(path, FieldErrorCode.TOO_MANY, f"must hold at most {MAX_BLOCKS} blocks")
        )
        return
    for index, block in enumerate(blocks):
        where = f"{path}[{index}]"
        if not isinstance(block, dict):
            errors.append(FieldError(where, _FORMAT, "must be an object"))
            continue
        kind = block.get("type")
        if kind is None:
            errors.append(FieldError(where + ".type", _REQUIRED, "is required"))
        elif not isinstance(kind, str):
            errors.append(FieldError(where + ".type", _FORMAT, "must be a string"))
        elif kind == "text":
            _checkText(block.get("text"), where + ".text", errors)
        elif kind == "image":
            _checkImage(where + ".source", block.get("source"), errors)
        elif kind == "tool_use" and not nested:
            _checkString(block.get("id"), where + ".id", errors)
            _checkString(block.get("name"), where + ".name", errors)
            if not isinstance(block.get("input"), dict):
                errors.append(FieldError(where + ".input", _FORMAT, "must be an object"))
        elif kind == "tool_result" and not nested:
            _checkToolResult(where, block, errors)


def _checkImage(path: str, source: object, errors: list[FieldError]) -> None:
    if not isinstance(source, dict):
        errors.append(FieldError(path, _FORMAT, "must be an object"))
        return
    kind = source.get("type")
    if kind == "base64":
        _checkString(source.get("media_type"), path + ".media_type", errors)
        _checkString(source.get("data"), path + ".data", errors)
    elif kind == "url":
        _checkString(source.get("url"), path + ".url", errors)
    elif not isinstance(kind, str):
        errors.append(FieldError(path + ".type", _REQUIRED, "is required"))


def _checkToolResult(path: str, block: dict[str, Any], errors: list[FieldError]) -> None:
    _checkString(block.get("tool_use_id"), path + ".tool_use_id", errors)
    _checkContent(path + ".content", block.get("content"), errors, required=False, nested=True)
    isError = block.get("is_error")
    if isError is not None and not isinstance(isError, bool):
        errors.append(FieldError(path + ".is_error", _FORMAT, "must be a boolean"))


def _checkSystem(system: object, errors: list[FieldError]) -> None:
    if system is None:
        return
    if isinstance(system, str):
        _checkText(system, "system", errors)
    elif not isinstance(system, list):
        errors.append(FieldError("system", _FORMAT, "must be a string or an array of text blocks"))
    elif len(system) > MAX_BLOCKS:
        errors.append(
            FieldError("system", FieldErrorCode.TOO_MANY, f"must hold at most {MAX_BLOCKS} blocks")
        )
    else:
        for index, block in enumerate(system):
            where = f"system[{index}]"
            if not isinstance(block, dict) or block.get("type") != "text":
                errors.append(FieldError(where, _FORMAT, "must be a text block"))
            else:
                _checkText(block.get("text"), where + ".text", errors)


def _checkTools(tools: object, errors: list[FieldError]) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        errors.append(FieldError("tools", _FORMAT, "must be an array"))
        return
    if len(tools) > MAX_BLOCKS:
        errors.append(
            FieldError("tools", FieldErrorCode.TOO_MANY, f"must hold at most {MAX_BLOCKS} tools")
        )
        return
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            errors.append(FieldError(where, _FORMAT, "must be an object"))
            continue
        _checkString(tool.get("name"), where + ".name", errors)
        # A client tool has a schema; Anthropic's server tools (a type of
        # their own) do not.
        if tool.get("type") in (None, "custom") and not isinstance(tool.get("input_schema"), dict):
            code = _REQUIRED if tool.get("input_schema") is None else _FORMAT
            errors.append(FieldError(where + ".input_schema", code, "must be an object"))


def _checkToolChoice(choice: object, errors: list[FieldError]) -> None:
    if choice is None:
        return
    if not isinstance(choice, dict):
        errors.append(FieldError("tool_choice", _FORMAT, "must be an object"))
        return
    kind = choice.get("type")
    if kind is None:
        errors.append(FieldError("tool_choice.type", _REQUIRED, "is required"))
    elif kind not in TOOL_CHOICES:
        errors.append(
            FieldError(
                "tool_choice.type",
                FieldErrorCode.INVALID_ENUM,
                "must be one of any, auto, none, tool",
            )
        )
    elif kind == "tool":
        _checkString(choice.get("name"), "tool_choice.name", errors)
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        errors.append(
            FieldError("tool_choice.disable_parallel_tool_use", _FORMAT, "must be a boolean")
        )
