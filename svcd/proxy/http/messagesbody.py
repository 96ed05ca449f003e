"""
The body of POST /v1/messages and POST /v1/messages/count_tokens
(decisions D14), in Anthropic's shape: its JSON by the rules of every body
of the edge (decisions D10, L{svcd.proxy.http.chatbody.parseJSONObject}),
its shape by L{svcd.dialects.checks} (every failed rule in one 400
VALIDATION_ERROR, as a chat body's), unknown keys kept and forwarded.

What the steps shared with chat completions read of it (D11's estimate, a
recall's query, an observation's user turn) they read of chat messages
(L{svcd.proxy.http.context.Conversation}); so the parsed request also holds
its conversation as chat messages (L{chatMessagesOf}), text only, made
once:

  - the system prompt (a string, or its text blocks joined) is a
    C{system} message, and the tools' definitions another (their JSON:
    they are prompt tokens as much as the messages are);
  - a turn's text blocks (and an assistant's thinking and tool inputs)
    are one message of the turn's role, its tool results (their text) a
    C{tool} message before it, as chat completions put them: so that a
    recall's query is the last turn the user wrote, not a tool's output,
    and an observation's user turn holds only what the user said.

Recall's memories go into C{system}, as a text block after the client's
own (L{withMemories}; decisions D14, "Memory").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from svcd.dialects.checks import parseMessagesBody
from svcd.proxy.http.chatbody import parseJSONObject


@attrs.frozen
class MessagesRequest:
    """
    A valid Messages body: what the gateway reads of it, and the whole
    object to forward; the conversation is never logged.

    @ivar maxTokens: its C{max_tokens}; None for count_tokens, which has
        none.
    @ivar messages: the conversation as chat messages (L{chatMessagesOf}).
    """

    model: str
    maxTokens: int | None
    stream: bool = False
    document: dict[str, Any] = attrs.field(factory=dict, repr=False)
    messages: list[dict[str, Any]] = attrs.field(factory=list, repr=False)

    # What a chat body has and a Messages body has not (the reservation's
    # L{svcd.limits.reservation.ChatBody}): a second cap, and choices.
    maxCompletionTokens: None = None
    choices: int = 1


def parseMessagesRequest(body: bytes, *, countTokens: bool = False) -> MessagesRequest:
    """
    Parse and check a Messages body (C{countTokens}: a count_tokens body,
    without C{max_tokens}).

    @raise ApiError: 400 INVALID_JSON (decisions D10), or 400
        VALIDATION_ERROR listing every failed rule.
    """
    document = parseJSONObject(body)
    checked = parseMessagesBody(document, countTokens=countTokens)
    return MessagesRequest(
        model=checked.model,
        maxTokens=checked.maxTokens,
        stream=checked.stream,
        document=document,
        messages=chatMessagesOf(document),
    )


def _texts(content: object) -> str:
    """
    The text of a string or of blocks (their text blocks joined).
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(
        block["text"]
        for block in content
        if isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
    )


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def chatMessagesOf(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """
    A valid Messages body's conversation as chat messages of text (see the
    module's docstring).
    """
    messages: list[dict[str, Any]] = []
    system = _texts(document.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    tools = document.get("tools")
    if tools:
        messages.append({"role": "system", "content": _json(tools)})
    for turn in document.get("messages") or ():
        role, content = turn["role"], turn["content"]
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        texts: list[str] = []
        results: list[str] = []
        for block in content:
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "thinking" and isinstance(block.get("thinking"), str):
                texts.append(block["thinking"])
            elif kind == "tool_use":
                texts.append(_json(block.get("input")))
            elif kind == "tool_result":
                results.append(_texts(block.get("content")))
        if results:
            messages.append({"role": "tool", "content": "\n".join(results)})
        if texts or not results:
            messages.append({"role": role, "content": "\n".join(texts)})
    return messages


def withMemories(request: MessagesRequest, message: Mapping[str, str]) -> MessagesRequest:
    """
    C{request} with recall's message of memories (decisions D13) as a text
    block of C{system}, after the client's own (decisions D14): a string
    system prompt becomes its text block first.
    """
    text = message["content"]
    system = request.document.get("system")
    blocks: list[Any]
    if isinstance(system, list):
        blocks = list(system)
    elif isinstance(system, str) and system:
        blocks = [{"type": "text", "text": system}]
    else:
        blocks = []
    blocks.append({"type": "text", "text": text})
    document = {**request.document, "system": blocks}
    # Where among the chat messages changes nothing that reads them (the
    # estimate, a recall's query, an observation's user turn).
    messages = [{"role": "system", "content": text}, *request.messages]
    return attrs.evolve(request, document=document, messages=messages)
