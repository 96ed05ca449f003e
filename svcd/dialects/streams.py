"""
Streamed answers between the dialects, one parsed event at a time: each
translator is fed what the provider sent, in order, and returns what to
send the client, so that nothing is held longer than the translation needs
and the route keeps relaying as it reads (decisions D9).

L{ChatChunkStream}: Anthropic's events (C{message_start},
C{content_block_start}, C{content_block_delta} of C{text_delta} or
C{input_json_delta}, C{content_block_stop}, C{message_delta},
C{message_stop}, C{ping}, C{error}) as C{chat.completion.chunk}s:

  - C{message_start} is the first chunk (C{role}, and an empty content, as
    OpenAI's first chunk is);
  - text deltas are content deltas; a C{tool_use} block is a tool call
    (its id, its name, then its arguments as Anthropic streams them, under
    an index counting tool calls); a tool without input gets C{{}} as
    arguments, which OpenAI's clients can parse;
  - C{message_delta} is the chunk with the finish reason; with
    C{include_usage}, C{message_stop} is the usage chunk (no choices), as
    OpenAI ends a stream. C{ping}, and blocks with no counterpart
    (thinking), send nothing.

L{MessageEventStream}: OpenAI's chunks as Anthropic's events, in the order
Anthropic's SDKs accumulate (C{message_start}; per content block its
C{content_block_start}, deltas and C{content_block_stop}; C{message_delta}
with the stop reason and the usage; C{message_stop}):

  - the text is streamed as it comes, in a text block;
  - a tool call's arguments are gathered until the answer's finish
    reason, then sent as one C{input_json_delta} of a JSON object: OpenAI
    streams arguments that a model may get wrong, and Anthropic's SDKs fail
    on a C{tool_use} input that is not a JSON object, mid-stream, where the
    client can do nothing about it (see L{svcd.dialects.answers});
  - the usage, which OpenAI sends last (with C{include_usage}, which the
    route asks of the provider), is in C{message_delta}, whose counts
    Anthropic's SDKs take as totals over those of C{message_start} (zero
    there: OpenAI has not said them yet). C{message_delta} and
    C{message_stop} are sent when both the finish reason and the usage
    have come, or at the end of the provider's stream (L{end}).

Both keep the stream's usage (C{usage}) for the ledger, and raise
L{UpstreamStreamError} for the provider's own error event, L{BadAnswer}
for an event out of its dialect's shape or order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from svcd.common.errors import ApiError, ErrorCode
from svcd.dialects.answers import finishReasonOf, stopReasonOf
from svcd.dialects.errors import (
    BadAnswer,
    UpstreamStreamError,
    anthropicErrorOf,
    apiErrorOfAnthropic,
)
from svcd.dialects.turns import answerInputOf, argumentsOf
from svcd.dialects.usage import (
    StreamUsage,
    TokenUsage,
    anthropicUsage,
    openAIUsage,
    usageOfOpenAI,
)

DONE = b"data: [DONE]\n\n"


# json.dumps with these arguments makes an encoder at each call; a
# translated stream encodes every event (issue 46's benchmark).
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_ASCII_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _json(document: object) -> bytes:
    try:
        return _ENCODER.encode(document).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate, which a provider may send escaped (JSON's
        # "\\ud800"): escaped again, as it came, since UTF-8 cannot
        # carry it.
        return _ASCII_ENCODER.encode(document).encode("ascii")


def chunkBytes(chunk: Mapping[str, Any]) -> bytes:
    """
    A chunk as OpenAI's server-sent event.
    """
    return b"data: " + _json(chunk) + b"\n\n"


def eventBytes(event: Mapping[str, Any]) -> bytes:
    """
    An event as Anthropic's server-sent event: named by its type.
    """
    return b"event: " + str(event["type"]).encode("ascii") + b"\ndata: " + _json(event) + b"\n\n"


_ANSWER_EVENTS = frozenset(
    {
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    }
)


@attrs.define
class _ToolBlock:
    # The tool call's index among OpenAI's tool calls, the input
    # content_block_start gave, and whether any arguments went out.
    call: int
    startInput: Mapping[str, Any]
    sent: bool = False


@attrs.define
class ChatChunkStream:
    """
    Anthropic's events to OpenAI's chunks (see the module's docstring).
    C{created} is the chunks' time (Anthropic's events have none);
    C{includeUsage} what the client's C{stream_options.include_usage} said.
    """

    created: int
    includeUsage: bool
    _id: str | None = None
    _model: str = ""
    # Per Anthropic block index: "text", a tool call, or None (no
    # counterpart: sends nothing).
    _blocks: dict[int, _ToolBlock | str | None] = attrs.field(factory=dict)
    _calls: int = 0
    _usage: StreamUsage = attrs.field(factory=StreamUsage)
    finished: bool = False

    @property
    def usage(self) -> TokenUsage | None:
        return self._usage.usage

    def feed(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        kind = event.get("type")
        if kind == "error":
            found = anthropicErrorOf(event)
            errorType, said = found if found is not None else ("api_error", "")
            raise UpstreamStreamError(
                apiErrorOfAnthropic(errorType, said),
                overloaded=errorType == "overloaded_error",
            )
        if kind == "ping":
            return []
        self._usage.observe(event)
        if kind == "message_start":
            message = event.get("message")
            if not isinstance(message, Mapping) or not isinstance(message.get("id"), str):
                raise BadAnswer("message_start without a message")
            self._id = message["id"]
            model = message.get("model")
            self._model = model if isinstance(model, str) else ""
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind not in _ANSWER_EVENTS:
            # Anthropic may add event types; unknown ones are skipped, as
            # its SDKs skip them.
            return []
        if self._id is None:
            raise BadAnswer(f"{kind} before message_start")
        if kind == "message_delta":
            return self._finish(event)
        if kind == "message_stop":
            return self._stop()
        index = event.get("index")
        if not isinstance(index, int):
            raise BadAnswer(f"{kind} without an index")
        if kind == "content_block_start":
            return self._start(index, event.get("content_block"))
        if kind == "content_block_delta":
            return self._delta(self._blocks.get(index), event.get("delta"))
        block = self._blocks.get(index)
        if isinstance(block, _ToolBlock) and not block.sent:
            return [self._arguments(block, argumentsOf(block.startInput))]
        return []

    def _chunk(self, delta: dict[str, Any], finishReason: str | None = None) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self._model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finishReason}
            ],
        }

    def _start(self, index: int, block: object) -> list[dict[str, Any]]:
        if not isinstance(block, Mapping):
            raise BadAnswer("content_block_start without a block")
        kind = block.get("type")
        if kind == "text":
            self._blocks[index] = "text"
            first = block.get("text")
            return [self._chunk({"content": first})] if isinstance(first, str) and first else []
        if kind != "tool_use":
            self._blocks[index] = None
            return []
        toolID, name = block.get("id"), block.get("name")
        if not isinstance(toolID, str) or not isinstance(name, str):
            raise BadAnswer("tool_use block without its id or name")
        startInput = block.get("input")
        tool = _ToolBlock(self._calls, startInput if isinstance(startInput, Mapping) else {})
        self._calls += 1
        self._blocks[index] = tool
        call = {
            "index": tool.call,
            "id": toolID,
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        return [self._chunk({"tool_calls": [call]})]

    def _delta(self, block: _ToolBlock | str | None, delta: object) -> list[dict[str, Any]]:
        if not isinstance(delta, Mapping):
            raise BadAnswer("content_block_delta without a delta")
        kind = delta.get("type")
        if kind == "text_delta" and block == "text":
            piece = delta.get("text")
            if isinstance(piece, str) and piece:
                return [self._chunk({"content": piece})]
        elif kind == "input_json_delta" and isinstance(block, _ToolBlock):
            piece = delta.get("partial_json")
            if isinstance(piece, str) and piece:
                block.sent = True
                return [self._arguments(block, piece)]
        return []

    def _arguments(self, block: _ToolBlock, piece: str) -> dict[str, Any]:
        return self._chunk(
            {"tool_calls": [{"index": block.call, "function": {"arguments": piece}}]}
        )

    def _finish(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        delta = event.get("delta")
        delta = delta if isinstance(delta, Mapping) else {}
        chunk = self._chunk({}, finishReasonOf(delta.get("stop_reason")))
        matched = delta.get("stop_sequence")
        if delta.get("stop_reason") == "stop_sequence" and isinstance(matched, str):
            chunk["choices"][0]["stop_reason"] = matched
        return [chunk]

    def _stop(self) -> list[dict[str, Any]]:
        self.finished = True
        if not self.includeUsage:
            return []
        chunk = self._chunk({})
        chunk["choices"] = []
        chunk["usage"] = openAIUsage(self.usage or TokenUsage())
        return [chunk]


@attrs.define
class _Call:
    # A tool call of OpenAI's stream, gathered until the finish reason.
    id: str = ""
    name: str = ""
    arguments: list[str] = attrs.field(factory=list)


@attrs.define
class MessageEventStream:
    """
    OpenAI's chunks to Anthropic's events (see the module's docstring).
    C{messageID} and C{model} are used when the provider's chunks have no
    id or model (or the stream has no chunk at all).
    """

    messageID: str
    model: str
    _started: bool = False
    _nextIndex: int = 0
    _textIndex: int | None = None
    _calls: dict[int, _Call] = attrs.field(factory=dict)
    _finishReason: str | None = None
    _matched: str | None = None
    _refused: bool = False
    _flushed: bool = False
    usage: TokenUsage | None = None
    finished: bool = False

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        if self.finished:
            return []
        if chunk.get("error") is not None:
            raise UpstreamStreamError(ApiError(ErrorCode.UPSTREAM_ERROR))
        events = self._begin(chunk)
        usage = usageOfOpenAI(chunk.get("usage"))
        if usage is not None:
            self.usage = usage
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise BadAnswer("a chunk without choices")
        for choice in choices:
            # A translated request asks for one choice.
            if isinstance(choice, Mapping) and choice.get("index", 0) == 0:
                events.extend(self._choice(choice))
        # The usage that ends the answer comes with the finish reason or
        # after it (some providers count in every chunk, before it too).
        if self._flushed and usage is not None:
            events.extend(self._stop())
        return events

    def end(self) -> list[dict[str, Any]]:
        """
        The events that end the answer, once the provider's stream ended
        as it should (C{[DONE]}, or its end after the last chunk).
        """
        if self.finished:
            return []
        events = self._begin({})
        events.extend(self._flush())
        events.extend(self._stop())
        return events

    def _begin(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        if self._started:
            return []
        self._started = True
        answerID, model = chunk.get("id"), chunk.get("model")
        message: dict[str, Any] = {
            "id": answerID if isinstance(answerID, str) and answerID else self.messageID,
            "type": "message",
            "role": "assistant",
            "model": model if isinstance(model, str) and model else self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": anthropicUsage(TokenUsage()),
        }
        return [{"type": "message_start", "message": message}]

    def _choice(self, choice: Mapping[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        delta = choice.get("delta")
        if isinstance(delta, Mapping):
            for name in ("content", "refusal"):
                piece = delta.get(name)
                if isinstance(piece, str) and piece:
                    self._refused = self._refused or name == "refusal"
                    events.extend(self._text(piece))
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                events.extend(self._closeText())
                for position, call in enumerate(calls):
                    self._gather(position, call)
        finishReason = choice.get("finish_reason")
        if isinstance(finishReason, str):
            self._finishReason = finishReason
            matched = choice.get("stop_reason")
            self._matched = matched if isinstance(matched, str) else None
            events.extend(self._flush())
        return events

    def _text(self, piece: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._textIndex is None:
            self._textIndex = self._nextIndex
            self._nextIndex += 1
            events.append(
                {
                    "type": "content_block_start",
                    "index": self._textIndex,
                    "content_block": {"type": "text", "text": ""},
                }
            )
        events.append(
            {
                "type": "content_block_delta",
                "index": self._textIndex,
                "delta": {"type": "text_delta", "text": piece},
            }
        )
        return events

    def _closeText(self) -> list[dict[str, Any]]:
        if self._textIndex is None:
            return []
        index, self._textIndex = self._textIndex, None
        return [{"type": "content_block_stop", "index": index}]

    def _gather(self, position: int, call: object) -> None:
        if not isinstance(call, Mapping):
            raise BadAnswer("a tool call that is not an object")
        index = call.get("index", position)
        if not isinstance(index, int):
            raise BadAnswer("a tool call without an index")
        gathered = self._calls.setdefault(index, _Call())
        if isinstance(call.get("id"), str) and not gathered.id:
            gathered.id = call["id"]
        function = call.get("function")
        if isinstance(function, Mapping):
            name, arguments = function.get("name"), function.get("arguments")
            if isinstance(name, str) and not gathered.name:
                gathered.name = name
            if isinstance(arguments, str):
                gathered.arguments.append(arguments)

    def _flush(self) -> list[dict[str, Any]]:
        """
        Close the text, and send the gathered tool calls, each a whole
        block.
        """
        if self._flushed:
            return []
        self._flushed = True
        events = self._closeText()
        for position in sorted(self._calls):
            call = self._calls[position]
            if not call.id or not call.name:
                raise BadAnswer("a tool call without its id or name")
            index = self._nextIndex
            self._nextIndex += 1
            events.append(
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {
                        "type": "tool_use",
                        "id": call.id,
                        "name": call.name,
                        "input": {},
                    },
                }
            )
            toolInput = answerInputOf("".join(call.arguments))
            if toolInput:
                events.append(
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {
                            "type": "input_json_delta",
                            "partial_json": _json(toolInput).decode("utf-8"),
                        },
                    }
                )
            events.append({"type": "content_block_stop", "index": index})
        return events

    def _stop(self) -> list[dict[str, Any]]:
        self.finished = True
        stopReason, stopSequence = stopReasonOf(
            self._finishReason, self._matched, calledTools=bool(self._calls)
        )
        if self._refused:
            stopReason = "refusal"
        return [
            {
                "type": "message_delta",
                "delta": {"stop_reason": stopReason, "stop_sequence": stopSequence},
                "usage": anthropicUsage(self.usage or TokenUsage()),
            },
            {"type": "message_stop"},
        ]
