"""
Anthropic's dialect of the scripted model server: its error body (which
the C{anthropic} SDK reads), its message (whole, or as the server-sent
events Anthropic streams, in Anthropic's order) and its token count, each
played out by L{svcd.devkit.upstream.delivery.Answer}. See "Anthropic's
Messages API" in the package's manual.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.web.server import Request

from svcd.devkit.upstream.content import anthropicEchoContent
from svcd.devkit.upstream.delivery import Answer, RequestRecord
from svcd.devkit.upstream.script import Script, cacheParts
from svcd.dialects.streams import eventBytes
from svcd.dialects.usage import TokenUsage

# Anthropic's error types by status; any other 4xx is an
# invalid_request_error, any other 5xx an api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def errorTypeOf(status: int) -> str:
    """
    Anthropic's error type for an answer of C{status}.
    """
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def errorDocument(errorType: str, message: str, requestID: str) -> dict[str, Any]:
    """
    An error in Anthropic's shape, as an answer's body or a stream's
    C{error} event: C{{"type": "error", "error": {"type", "message"},
    "request_id"}}.
    """
    return {
        "type": "error",
        "error": {"type": errorType, "message": message},
        "request_id": requestID,
    }


def errorBody(status: int, message: str, requestID: str) -> bytes:
    """
    The body of an error answer of C{status} in Anthropic's shape.
    """
    return _json(errorDocument(errorTypeOf(status), message, requestID))


def _json(document: object) -> bytes:
    # Compact, as Anthropic writes its answers.
    return json.dumps(document, separators=(",", ":")).encode()


def _words(text: str) -> list[str]:
    # An answer's stream deltas: one per word, with the space after it.
    return re.findall(r"\S+\s*", text)


class MessageAnswer(Answer):
    """
    The answer to one Messages request, played out as its script says: a
    C{message}, or Anthropic's events (C{message_start}, per content
    block C{content_block_start}, C{ping} after the first, its deltas and
    C{content_block_stop}, then C{message_delta} and C{message_stop}).
    """

    OPENING_EVENTS = 3
    REQUEST_ID_HEADER = b"request-id"
    STREAM_CONTENT_TYPE = b"text/event-stream; charset=utf-8"
    TOOL_ID_PREFIX = "toolu_scripted_"

    def __init__(
        self,
        reactor: IReactorTime,
        clock: Callable[[], float],
        request: Request,
        record: RequestRecord,
        script: Script,
        answerNumber: int,
    ) -> None:
        super().__init__(reactor, clock, request, record, script)
        self._messageID = f"msg_scripted_{answerNumber}"
        self._requestID = f"req_scripted_{record.number}"

    def _echo(self) -> tuple[str, int]:
        return anthropicEchoContent(self._body)

    def _answerError(self) -> None:
        status = self._script.count
        self._startAnswer(status, b"application/json")
        if self._script.retryAfter is not None:
            self._request.setHeader(b"retry-after", str(self._script.retryAfter).encode())
        message = f"Scripted error {status} for model {self._model!r}."
        body = errorBody(status, message, self._requestID)
        self._request.setHeader(b"content-length", b"%d" % len(body))
        self._request.write(body)
        self._request.finish()

    # What the answer says

    def _stopped(self, deltas: list[str]) -> tuple[list[str], str, str | None]:
        """
        The echo's deltas as Anthropic ends an answer: cut before the first
        of the request's C{stop_sequences} it holds (C{stop_sequence}), or
        after C{max_tokens} words, a word a token (C{max_tokens}); else
        whole (C{end_turn}). Other kinds of answer are never cut.
        """
        if self._script.kind not in ("echo", "tool-call"):
            return deltas, "end_turn", None
        content = "".join(deltas)
        maxTokens = self._body.get("max_tokens")
        limit = len(content)
        if isinstance(maxTokens, int) and 0 <= maxTokens < len(deltas):
            limit = len("".join(deltas[:maxTokens]))
        found: tuple[int, str] | None = None
        sequences = self._body.get("stop_sequences")
        for sequence in sequences if isinstance(sequences, list) else []:
            if isinstance(sequence, str) and sequence:
                at = content.find(sequence)
                if at >= 0 and at < limit and (found is None or at < found[0]):
                    found = (at, sequence)
        if found is not None:
            return _words(content[: found[0]]), "stop_sequence", found[1]
        if limit < len(content):
            return _words(content[:limit]), "max_tokens", None
        return deltas, "end_turn", None

    def _usage(self, outputText: str, promptTokens: int) -> TokenUsage:
        counts = self._script.counts
        if counts is None:
            outputTokens = len(outputText.split())
        else:
            promptTokens, outputTokens = counts[0], counts[1]
        reads, writes = cacheParts(self._script, promptTokens)
        return TokenUsage(
            inputTokens=promptTokens - reads - writes,
            cacheReadTokens=reads,
            cacheWriteTokens=writes,
            outputTokens=outputTokens,
        )

    def _startOutputTokens(self) -> int:
        # Anthropic's message_start counts the first output token or so.
        counts = self._script.counts
        return 1 if counts is None else min(1, counts[1])

    @staticmethod
    def _usageDocument(usage: TokenUsage, outputTokens: int) -> dict[str, Any]:
        """
        Anthropic's usage, in its order, with the cache writes' breakdown
        by lifetime (all of them the default five minutes).
        """
        return {
            "input_tokens": usage.inputTokens,
            "cache_creation_input_tokens": usage.cacheWriteTokens,
            "cache_read_input_tokens": usage.cacheReadTokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": usage.cacheWriteTokens,
                "ephemeral_1h_input_tokens": 0,
            },
            "output_tokens": outputTokens,
            "service_tier": "standard",
        }

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self._messageID,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
        }

    def _answerWhole(self) -> None:
        deltas, promptTokens = self._content()
        call = self._toolCall()
        if call is None:
            deltas, stopReason, stopSequence = self._stopped(deltas)
            text = "".join(deltas)
            block: dict[str, Any] = {"type": "text", "text": text}
        else:
            text = call.arguments
            stopReason, stopSequence = "tool_use", None
            block = {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        message = self._message([block])
        message["stop_reason"] = stopReason
        message["stop_sequence"] = stopSequence
        if self._script.usage:
            usage = self._usage(text, promptTokens)
            message["usage"] = self._usageDocument(usage, usage.outputTokens)
        answer = _json(message)
        self._startAnswer(200, b"application/json")
        if self._script.kind != "never-ending":
            self._request.setHeader(b"content-length", b"%d" % len(answer))
        self._afterHold(lambda: self._writeWhole(answer))

    # The stream

    def _streamEvents(self, deltas: Iterable[str], promptTokens: int) -> Iterator[bytes]:
        call = self._toolCall()
        stopSequence: str | None = None
        if call is not None:
            stopReason = "tool_use"
        elif isinstance(deltas, list):
            deltas, stopReason, stopSequence = self._stopped(deltas)
        else:
            stopReason = "end_turn"
        usage = self._usage("", promptTokens)
        message = self._message([])
        if self._script.usage:
            message["usage"] = self._usageDocument(usage, self._startOutputTokens())
        yield self._event({"type": "message_start", "message": message})
        sent: list[str] = []
        if call is None:
            block: dict[str, Any] = {"type": "text", "text": ""}
            pieces: Iterable[str] = deltas
            delta = {"type": "text_delta"}
            key = "text"
        else:
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            # Anthropic's first input_json_delta is empty.
            pieces = ["", *call.pieces()]
            delta = {"type": "input_json_delta"}
            key = "partial_json"
        yield self._event({"type": "content_block_start", "index": 0, "content_block": block})
        yield self._event({"type": "ping"})
        for piece in pieces:
            sent.append(piece)
            yield self._event(
                {"type": "content_block_delta", "index": 0, "delta": delta | {key: piece}}
            )
        yield self._event({"type": "content_block_stop", "index": 0})
        ending: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": stopReason, "stop_sequence": stopSequence},
        }
        if self._script.usage:
            ending["usage"] = {"output_tokens": self._usage("".join(sent), 0).outputTokens}
        yield self._event(ending)
        yield self._event({"type": "message_stop"})

    @staticmethod
    def _event(event: Mapping[str, Any]) -> bytes:
        return eventBytes(event)

    def _streamError(self) -> bytes:
        status = self._script.count
        message = f"Scripted error {status} mid-stream for model {self._model!r}."
        return eventBytes(errorDocument(errorTypeOf(status), message, self._requestID))

    def _notJSONEvents(self) -> list[bytes]:
        return [b"event: message_start\ndata: this is not JSON\n\n"]


class CountTokensAnswer(MessageAnswer):
    """
    The answer to one C{count_tokens} request: C{{"input_tokens": N}},
    delivered (and failing) as a whole message would be.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        clock: Callable[[], float],
        request: Request,
        record: RequestRecord,
        script: Script,
        answerNumber: int,
    ) -> None:
        super().__init__(reactor, clock, request, record, script, answerNumber)
        # A count never streams, whatever the request says.
        self._stream = False

    def _answerWhole(self) -> None:
        counts = self._script.counts
        inputTokens = counts[0] if counts is not None else self._echo()[1]
        answer = _json({"input_tokens": inputTokens})
        self._startAnswer(200, b"application/json")
        if self._script.kind != "never-ending":
            self._request.setHeader(b"content-length", b"%d" % len(answer))
        self._afterHold(lambda: self._writeWhole(answer))
