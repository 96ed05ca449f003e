"""
OpenAI's dialect of the scripted model server: its error body (which the
C{openai} SDK reads), its chat completion (a C{chat.completion}, or
C{chat.completion.chunk} events) and its embeddings list, each played out
by L{svcd.devkit.upstream.delivery.Answer}.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator

from twisted.internet.interfaces import IReactorTime
from twisted.web.server import Request

from svcd.devkit.upstream.content import embeddingOf
from svcd.devkit.upstream.delivery import Answer, RequestRecord
from svcd.devkit.upstream.script import Script, cacheParts


def errorBody(message: str, type: str, code: str | None, param: str | None = None) -> bytes:
    """
    An error in OpenAI's shape, which the C{openai} SDK reads into its
    exceptions' C{message}, C{type} and C{code}.
    """
    error = {"message": message, "type": type, "param": param, "code": code}
    return json.dumps({"error": error}).encode()


# The type and code OpenAI gives the errors of each status, roughly: the SDK
# chooses its exception class by status alone, so these are for realism.
ERROR_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "unsupported_country_region_territory"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("requests", "rate_limit_exceeded"),
}


class ChatCompletionAnswer(Answer):
    """
    The answer to one chat completion request, played out as its script
    says: a C{chat.completion}, or C{chat.completion.chunk} events and
    C{data: [DONE]}.
    """

    def _errorOf(self, status: int, message: str) -> dict[str, object]:
        errorType, code = ERROR_KINDS.get(
            status, ("server_error" if status >= 500 else "invalid_request_error", None)
        )
        return {"message": message, "type": errorType, "param": None, "code": code}

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
        streamOptions = self._body.get("stream_options")
        self._includeUsage = (
            script.usage
            and isinstance(streamOptions, dict)
            and streamOptions.get("include_usage") is True
        )
        self._completionID = f"chatcmpl-scripted-{answerNumber}"
        self._created = int(reactor.seconds())

    def _answerError(self) -> None:
        status = self._script.count
        self._startAnswer(status, b"application/json")
        if self._script.retryAfter is not None:
            self._request.setHeader(b"retry-after", str(self._script.retryAfter).encode())
        message = f"Scripted error {status} for model {self._model!r}."
        body = json.dumps({"error": self._errorOf(status, message)}).encode()
        self._request.setHeader(b"content-length", b"%d" % len(body))
        self._request.write(body)
        self._request.finish()

    def _usage(self, content: str, promptTokens: int) -> dict[str, object]:
        counts = self._script.counts
        if counts is None:
            completionTokens = len(content.split())
        else:
            promptTokens, completionTokens = counts[0], counts[1]
        usage: dict[str, object] = {
            "prompt_tokens": promptTokens,
            "completion_tokens": completionTokens,
            "total_tokens": promptTokens + completionTokens,
        }
        if self._script.cache is not None:
            reads, writes = cacheParts(self._script, promptTokens)
            usage["prompt_tokens_details"] = {
                "cached_tokens": reads,
                "cache_write_tokens": writes,
                "audio_tokens": 0,
            }
        if counts is not None and len(counts) == 4:
            usage["prompt_tokens_details"] = {"cached_tokens": counts[2], "audio_tokens": 0}
            usage["completion_tokens_details"] = {
                "reasoning_tokens": counts[3],
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            }
        return usage

    def _answerWhole(self) -> None:
        deltas, promptTokens = self._content()
        content = "".join(deltas)
        message: dict[str, object] = {"role": "assistant", "content": content, "refusal": None}
        finishReason = "stop"
        call = self._toolCall()
        if call is not None:
            # The words of the arguments are the completion's tokens.
            content = call.arguments
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ]
            finishReason = "tool_calls"
        completion: dict[str, object] = {
            "id": self._completionID,
            "object": "chat.completion",
            "created": self._created,
            "model": self._model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finishReason,
                }
            ],
            "system_fingerprint": None,
        }
        if self._script.usage:
            completion["usage"] = self._usage(content, promptTokens)
        answer = json.dumps(completion).encode()
        self._startAnswer(200, b"application/json")
        if self._script.kind != "never-ending":
            self._request.setHeader(b"content-length", b"%d" % len(answer))
        self._afterHold(lambda: self._writeWhole(answer))

    def _chunk(self, delta: dict[str, object], finishReason: str | None = None) -> bytes:
        chunk: dict[str, object] = {
            "id": self._completionID,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "system_fingerprint": None,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finishReason}
            ],
        }
        if self._includeUsage:
            chunk["usage"] = None
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def _streamEvents(self, deltas: Iterable[str], promptTokens: int) -> Iterator[bytes]:
        call = self._toolCall()
        content = []
        if call is None:
            yield self._chunk({"role": "assistant", "content": ""})
            for delta in deltas:
                content.append(delta)
                yield self._chunk({"content": delta})
            yield self._chunk({}, finishReason="stop")
        else:
            # OpenAI's first chunk of a tool call names it; its arguments
            # follow in pieces.
            function = {"name": call.name, "arguments": ""}
            first = {"index": 0, "id": call.id, "type": "function", "function": function}
            yield self._chunk({"role": "assistant", "content": None, "tool_calls": [first]})
            for piece in call.pieces():
                content.append(piece)
                arguments = {"index": 0, "function": {"arguments": piece}}
                yield self._chunk({"tool_calls": [arguments]})
            yield self._chunk({}, finishReason="tool_calls")
        if self._includeUsage:
            usage = {
                "id": self._completionID,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
                "system_fingerprint": None,
                "choices": [],
                "usage": self._usage("".join(content), promptTokens),
            }
            yield b"data: " + json.dumps(usage).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _streamError(self) -> bytes:
        # What OpenAI sends when a stream fails after it began.
        status = self._script.count
        message = f"Scripted error {status} mid-stream for model {self._model!r}."
        return b"data: " + json.dumps({"error": self._errorOf(status, message)}).encode() + b"\n\n"


class EmbeddingsAnswer(ChatCompletionAnswer):
    """
    The answer to one embeddings request: the script's delivery (and
    faults) as for a non-streaming chat completion, the whole answer an
    embeddings list (see "Embeddings" in the package's manual).
    """

    def __init__(
        self,
        reactor: IReactorTime,
        clock: Callable[[], float],
        request: Request,
        record: RequestRecord,
        script: Script,
        answerNumber: int,
        inputs: list[str],
        dimensions: int,
        encoding: str,
    ) -> None:
        super().__init__(reactor, clock, request, record, script, answerNumber)
        # Embeddings never stream, whatever the request says.
        self._stream = False
        self._includeUsage = False
        self._inputs = inputs
        self._dimensions = dimensions
        self._encoding = encoding

    def _answerWhole(self) -> None:
        data = []
        for index, text in enumerate(self._inputs):
            data.append({"object": "embedding", "index": index, "embedding": self._vector(text)})
        answer: dict[str, object] = {"object": "list", "data": data, "model": self._model}
        if self._script.usage:
            counts = self._script.counts
            prompt = (
                counts[0] if counts is not None else sum(len(text.split()) for text in self._inputs)
            )
            answer["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt}
        encoded = json.dumps(answer).encode()
        self._startAnswer(200, b"application/json")
        if self._script.kind != "never-ending":
            self._request.setHeader(b"content-length", b"%d" % len(encoded))
        self._afterHold(lambda: self._writeWhole(encoded))

    def _vector(self, text: str) -> object:
        """
        The vector of C{text} as the request's encoding gives it, or as the
        script's C{vectors:<how>} spoils it (see "Embeddings").
        """
        how = self._script.vectors
        dimensions = self._dimensions + {"short": -1, "long": 1}.get(how or "", 0)
        values, packed = embeddingOf(text, max(dimensions, 1))
        if how in ("huge", "nan"):
            # Numbers whatever the encoding asked: a provider that ignored it.
            return [1e39 if how == "huge" else math.nan, *values[1:]]
        if how == "infinity":
            if self._encoding != "base64":
                return [math.inf, *values[1:]]
            packed = struct.pack("<f", math.inf) + packed[4:]
        return base64.b64encode(packed).decode("ascii") if self._encoding == "base64" else values
