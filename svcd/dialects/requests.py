"""
Request bodies between the dialects, field by field: a chat completions
body for an Anthropic provider (L{anthropicRequestOf}), a Messages body for
an OpenAI-compatible one (L{chatRequestOf}). The conversation itself is
L{svcd.dialects.turns}'.

Every field either has its counterpart, or has none and is refused
(L{Untranslatable}, naming it), so that nothing a client asked for is
silently dropped; a field set to the value that means "nothing asked" (C{n}
of 1, C{logprobs} false, penalties of 0, a C{text} response format,
C{thinking} disabled ...) asks nothing and is accepted. A C{null} is an
absent field, as the edge's checks count it.

The few hints dropped on purpose, which change no answer: C{cache_control}
(top level and on blocks), an image's C{detail},
C{stream_options.include_obfuscation}; and C{stream_options.include_usage},
which is the stream translator's business (L{wantsUsage}), not the
provider's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from svcd.dialects.errors import Untranslatable
from svcd.dialects.shapes import (
    TO_ANTHROPIC,
    TO_OPENAI,
    array,
    boolean,
    integer,
    isInteger,
    isNumber,
    mapping,
    number,
    only,
    text,
)
from svcd.dialects.turns import anthropicTurnsOf, chatMessagesOf

# OpenAI's fields that, at these values, ask for nothing Anthropic lacks.
_NEUTRAL: dict[str, Callable[[object], bool]] = {
    "n": lambda value: isInteger(value) and value == 1,
    "logprobs": lambda value: value is False,
    "frequency_penalty": lambda value: isNumber(value) and value == 0,
    "presence_penalty": lambda value: isNumber(value) and value == 0,
    "logit_bias": lambda value: value == {},
    "response_format": lambda value: value == {"type": "text"},
    "modalities": lambda value: value == ["text"],
    "store": lambda value: value is False,
    "metadata": lambda value: value == {},
}

# Anthropic's tool choices by OpenAI's, and back.
_CHOICES_TO_ANTHROPIC = {"auto": "auto", "none": "none", "required": "any"}
_CHOICES_TO_OPENAI = {value: key for key, value in _CHOICES_TO_ANTHROPIC.items()}


def wantsUsage(chat: Mapping[str, Any]) -> bool:
    """
    Whether a chat completions client asked for the usage chunk at the end
    of its stream (C{stream_options.include_usage}).
    """
    options = chat.get("stream_options")
    return isinstance(options, Mapping) and options.get("include_usage") is True


# Chat completions to Messages.


def anthropicRequestOf(chat: Mapping[str, Any], *, defaultMaxTokens: int) -> dict[str, Any]:
    """
    The Messages body for a chat completions body. Anthropic requires an
    output cap: without C{max_completion_tokens} or C{max_tokens}, it is
    C{defaultMaxTokens} (the one a budget assumed, decisions D12 amended,
    or the model's C{max_output_tokens}).

    @raise Untranslatable: a field with no counterpart, or of the wrong
        shape.
    """
    for key, value in chat.items():
        if value is None or key in _TO_ANTHROPIC:
            continue
        neutral = _NEUTRAL.get(key)
        if neutral is None or not neutral(value):
            raise Untranslatable(key, TO_ANTHROPIC)
    system, messages = anthropicTurnsOf(chat.get("messages"))
    body: dict[str, Any] = {
        "model": text(chat.get("model"), "model"),
        "max_tokens": _outputCap(chat, defaultMaxTokens),
        "messages": messages,
    }
    if system is not None:
        body["system"] = system
    for name in ("temperature", "top_p"):
        if chat.get(name) is not None:
            body[name] = number(chat[name], name)
    # OpenAI's temperatures go to 2, Anthropic's to 1: one above has no
    # counterpart (scaling it would be a guess at what the client meant).
    if body.get("temperature", 0) > 1:
        raise Untranslatable("temperature", "must be at most 1 for Anthropic's models")
    stop = chat.get("stop")
    if isinstance(stop, str):
        body["stop_sequences"] = [stop]
    elif stop is not None:
        sequences = [text(each, f"stop[{index}]") for index, each in enumerate(array(stop, "stop"))]
        if sequences:
            body["stop_sequences"] = sequences
    if chat.get("stream") is not None:
        body["stream"] = boolean(chat["stream"], "stream")
    if chat.get("stream_options") is not None:
        options = mapping(chat["stream_options"], "stream_options")
        only(options, ("include_usage", "include_obfuscation"), "stream_options", TO_ANTHROPIC)
    tools = chat.get("tools")
    if tools is not None:
        converted = [
            _anthropicTool(tool, f"tools[{index}]")
            for index, tool in enumerate(array(tools, "tools"))
        ]
        if converted:
            body["tools"] = converted
    choice = _anthropicToolChoice(chat, hasTools="tools" in body)
    if choice is not None:
        body["tool_choice"] = choice
    userID = _userOf(chat)
    if userID is not None:
        body["metadata"] = {"user_id": userID}
    return body


_TO_ANTHROPIC = frozenset(
    {
        "model",
        "messages",
        "max_completion_tokens",
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "user",
        "safety_identifier",
    }
)


def _outputCap(chat: Mapping[str, Any], default: int) -> int:
    # max_completion_tokens is the newer name; max_tokens the older, which
    # OpenAI keeps for the models that had it.
    for name in ("max_completion_tokens", "max_tokens"):
        if chat.get(name) is not None:
            return integer(chat[name], name)
    return default


def _anthropicTool(tool: object, path: str) -> dict[str, Any]:
    tool = mapping(tool, path)
    if tool.get("type") != "function":
        raise Untranslatable(path + ".type", TO_ANTHROPIC)
    only(tool, ("type", "function"), path, TO_ANTHROPIC)
    function = mapping(tool.get("function"), path + ".function")
    where = path + ".function"
    only(function, ("name", "description", "parameters", "strict"), where, TO_ANTHROPIC)
    converted: dict[str, Any] = {"name": text(function.get("name"), where + ".name")}
    if function.get("description") is not None:
        converted["description"] = text(function["description"], where + ".description")
    parameters = function.get("parameters")
    # Anthropic requires a schema; OpenAI's default is a function without
    # parameters.
    converted["input_schema"] = (
        dict(mapping(parameters, where + ".parameters"))
        if parameters is not None
        else {"type": "object", "properties": {}}
    )
    if function.get("strict") is not None:
        converted["strict"] = boolean(function["strict"], where + ".strict")
    return converted


def _anthropicToolChoice(chat: Mapping[str, Any], *, hasTools: bool) -> dict[str, Any] | None:
    """
    Anthropic's C{tool_choice}, which also carries OpenAI's
    C{parallel_tool_calls} (as C{disable_parallel_tool_use}, its opposite).
    """
    choice = chat.get("tool_choice")
    parallel = chat.get("parallel_tool_calls")
    if parallel is not None:
        parallel = boolean(parallel, "parallel_tool_calls")
    converted: dict[str, Any]
    if choice is None:
        # parallel_tool_calls alone means something only with tools.
        if parallel is None or not hasTools:
            return None
        converted = {"type": "auto"}
    elif isinstance(choice, str):
        if choice not in _CHOICES_TO_ANTHROPIC:
            raise Untranslatable("tool_choice", "must be auto, none, required or a function")
        converted = {"type": _CHOICES_TO_ANTHROPIC[choice]}
    else:
        named = mapping(choice, "tool_choice")
        if named.get("type") != "function":
            raise Untranslatable("tool_choice.type", TO_ANTHROPIC)
        only(named, ("type", "function"), "tool_choice", TO_ANTHROPIC)
        function = mapping(named.get("function"), "tool_choice.function")
        only(function, ("name",), "tool_choice.function", TO_ANTHROPIC)
        converted = {
            "type": "tool",
            "name": text(function.get("name"), "tool_choice.function.name"),
        }
    if parallel is not None and converted["type"] != "none":
        converted["disable_parallel_tool_use"] = not parallel
    return converted


def _userOf(chat: Mapping[str, Any]) -> str | None:
    # safety_identifier is the newer name of what user says: who the end
    # user is, for abuse detection, as Anthropic's metadata.user_id.
    user = chat.get("user")
    safety = chat.get("safety_identifier")
    if user is not None:
        user = text(user, "user")
    if safety is not None:
        safety = text(safety, "safety_identifier")
        if user is not None and safety != user:
            raise Untranslatable("safety_identifier", "must equal user when both are given")
        return safety
    return user


# Messages to chat completions.


_TO_OPENAI = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "temperature",
        "top_p",
        "stop_sequences",
        "stream",
        "tools",
        "tool_choice",
        "metadata",
        "cache_control",
        "thinking",
    }
)


def chatRequestOf(
    body: Mapping[str, Any], *, capField: str = "max_completion_tokens"
) -> dict[str, Any]:
    """
    The chat completions body for a Messages body. The output cap goes
    under C{capField}, the model's (C{max_tokens} for providers that know
    only the older name). A stream asks for its usage, from which the
    stream translator makes C{message_delta}'s.

    @raise Untranslatable: a field with no counterpart (C{top_k}, thinking
        enabled, Anthropic's server tools ...), or of the wrong shape.
    """
    only(body, _TO_OPENAI, "", TO_OPENAI)
    thinking = body.get("thinking")
    if thinking is not None and mapping(thinking, "thinking").get("type") != "disabled":
        raise Untranslatable("thinking", TO_OPENAI)
    chat: dict[str, Any] = {
        "model": text(body.get("model"), "model"),
        "messages": chatMessagesOf(body.get("system"), body.get("messages")),
        capField: integer(body.get("max_tokens"), "max_tokens"),
    }
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = number(body[name], name)
    stops = body.get("stop_sequences")
    if stops is not None:
        sequences = [
            text(each, f"stop_sequences[{index}]")
            for index, each in enumerate(array(stops, "stop_sequences"))
        ]
        if sequences:
            chat["stop"] = sequences
    if body.get("stream") is not None:
        chat["stream"] = boolean(body["stream"], "stream")
        if chat["stream"]:
            chat["stream_options"] = {"include_usage": True}
    tools = body.get("tools")
    if tools is not None:
        converted = [
            _openAITool(tool, f"tools[{index}]") for index, tool in enumerate(array(tools, "tools"))
        ]
        if converted:
            chat["tools"] = converted
    if body.get("tool_choice") is not None:
        chat.update(_openAIToolChoice(body["tool_choice"]))
    metadata = body.get("metadata")
    if metadata is not None:
        metadata = mapping(metadata, "metadata")
        only(metadata, ("user_id",), "metadata", TO_OPENAI)
        if metadata.get("user_id") is not None:
            chat["user"] = text(metadata["user_id"], "metadata.user_id")
    return chat


def _openAITool(tool: object, path: str) -> dict[str, Any]:
    tool = mapping(tool, path)
    # Anthropic's server tools (web search, code execution, bash ...) have a
    # type of their own; a client tool has none, or "custom".
    if tool.get("type") not in (None, "custom"):
        raise Untranslatable(path + ".type", TO_OPENAI)
    only(
        tool,
        ("type", "name", "description", "input_schema", "strict", "cache_control"),
        path,
        TO_OPENAI,
    )
    function: dict[str, Any] = {"name": text(tool.get("name"), path + ".name")}
    if tool.get("description") is not None:
        function["description"] = text(tool["description"], path + ".description")
    function["parameters"] = dict(mapping(tool.get("input_schema"), path + ".input_schema"))
    if tool.get("strict") is not None:
        function["strict"] = boolean(tool["strict"], path + ".strict")
    return {"type": "function", "function": function}


def _openAIToolChoice(choice: object) -> dict[str, Any]:
    choice = mapping(choice, "tool_choice")
    kind = choice.get("type")
    converted: dict[str, Any]
    if kind == "tool":
        only(choice, ("type", "name", "disable_parallel_tool_use"), "tool_choice", TO_OPENAI)
        name = text(choice.get("name"), "tool_choice.name")
        converted = {"tool_choice": {"type": "function", "function": {"name": name}}}
    elif kind in _CHOICES_TO_OPENAI:
        only(choice, ("type", "disable_parallel_tool_use"), "tool_choice", TO_OPENAI)
        converted = {"tool_choice": _CHOICES_TO_OPENAI[kind]}
    else:
        raise Untranslatable("tool_choice.type", "must be auto, any, tool or none")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None:
        disable = boolean(disable, "tool_choice.disable_parallel_tool_use")
        converted["parallel_tool_calls"] = not disable
    return converted
