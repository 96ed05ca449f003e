"""
Streams that are not OpenAI's relayed as given (decisions D14): the
L{svcd.providers.relay.Passage}s a relay takes each event through.

  - L{AnthropicAsGiven}: an Anthropic provider's stream to a client of
    C{/v1/messages}, relayed byte for byte; its usage read from
    C{message_start} and C{message_delta};
  - L{ChatOfAnthropic}: an Anthropic provider's stream to a client of chat
    completions, translated event by event
    (L{svcd.dialects.streams.ChatChunkStream}), ended with C{[DONE]};
  - L{MessagesOfOpenAI}: an OpenAI-compatible provider's stream to a
    client of C{/v1/messages}, translated event by event
    (L{svcd.dialects.streams.MessageEventStream}).

Each keeps the stream's usage for the ledger, and turns the provider's own
error event into a L{StreamFault} of kind C{error_event} (before the client's
first byte a fallback may answer; after it, the client's stream ends with
an error event of its dialect, or, relayed as given, with the provider's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from svcd.dialects.errors import (
    BadAnswer,
    UpstreamStreamError,
    anthropicErrorOf,
    apiErrorOfAnthropic,
)
from svcd.dialects.requests import wantsUsage
from svcd.dialects.streams import (
    DONE,
    ChatChunkStream,
    MessageEventStream,
    chunkBytes,
    eventBytes,
)
from svcd.dialects.usage import StreamUsage, TokenUsage
from svcd.metering.models import Model
from svcd.metering.usage import Usage
from svcd.providers.relay import DONE as DONE_DATA
from svcd.providers.relay import StreamFault


@attrs.frozen
class Exchange:
    """
    What the attempts of one request share, for translating its answer:
    the client's object, the request's id, the time its answer is dated
    (and, for its spans, the output cap a budget assumed, if any).
    """

    document: Mapping[str, Any] = attrs.field(repr=False)
    requestID: str
    created: int
    outputCap: int | None = None


def usageOfTokens(usage: TokenUsage) -> Usage:
    """
    The ledger's L{Usage} of either dialect's counts (decisions D14): the
    prompt is every input (uncached, cache reads, cache writes), cached
    tokens the reads.
    """
    return Usage(
        usage.promptTokens,
        usage.completionTokens,
        usage.cacheReadTokens,
        usage.reasoningTokens,
        usage.cacheWriteTokens,
    )


@attrs.define
class _Ledgered:
    """
    The ledger's L{Usage} of a stream's counts, made again only when they
    change: a relay reads a passage's usage after every event, and the
    counts change at one or two of them (their records are frozen, and
    replaced when they change).
    """

    _counted: TokenUsage | None = None
    _usage: Usage | None = None

    def of(self, counted: TokenUsage | None) -> Usage | None:
        if counted is not self._counted:
            self._counted = counted
            self._usage = usageOfTokens(counted) if counted is not None else None
        return self._usage


def _parsed(data: bytes) -> dict[str, Any]:
    try:
        if data[:1] == b"{" and data[1:2] != b"\x00":
            # What json.loads reads these bytes as (it takes them for
            # UTF-8 unless they begin with a BOM or a zero byte), without
            # its guess at the encoding: a translated stream parses every
            # event (issue 46's benchmark).
            document = json.loads(data.decode("utf-8", "surrogatepass"))
        else:
            document = json.loads(data)
    except (ValueError, RecursionError):
        raise StreamFault("invalid", "an event that is not JSON") from None
    if not isinstance(document, dict):
        raise StreamFault("invalid", "an event that is not a JSON object")
    return document


def _providerError(error: UpstreamStreamError, *, relayed: bool = False) -> StreamFault:
    return StreamFault(
        "error_event",
        "the provider's error event",
        error=error.apiError,
        overloaded=error.overloaded,
        relayed=relayed,
    )


def _anthropicError(document: Mapping[str, Any], *, relayed: bool) -> StreamFault:
    found = anthropicErrorOf(document)
    kind, said = found if found is not None else ("api_error", "")
    return _providerError(
        UpstreamStreamError(apiErrorOfAnthropic(kind, said), overloaded=kind == "overloaded_error"),
        relayed=relayed,
    )


@attrs.define
class AnthropicAsGiven:
    """
    An Anthropic provider's stream relayed as given to a client of its
    dialect. Only the events that may carry usage, an error or the end are
    parsed; the rest pass unread.
    """

    _counts: StreamUsage = attrs.field(factory=StreamUsage)
    done: bool = False
    _ledgered: _Ledgered = attrs.field(factory=_Ledgered)

    @property
    def usage(self) -> Usage | None:
        return self._ledgered.of(self._counts.usage)

    def take(self, event: bytes, data: bytes | None) -> list[bytes]:
        if data is None or not (
            b'"usage"' in data or b'"error"' in data or b"message_stop" in data
        ):
            return [event]
        document = _parsed(data)
        kind = document.get("type")
        if kind == "error":
            # Relayed as given once the client has the stream's first
            # bytes; before them, a fault a fallback may answer.
            raise _anthropicError(document, relayed=True)
        self._counts.observe(document)
        if kind == "message_stop":
            self.done = True
        return [event]

    def end(self) -> list[bytes]:
        raise StreamFault("broken", "the stream ended before message_stop")


@attrs.define
class ChatOfAnthropic:
    """
    An Anthropic provider's stream as chat completion chunks, ended with
    C{[DONE]} as OpenAI ends a stream.
    """

    _chunks: ChatChunkStream
    done: bool = False
    _ledgered: _Ledgered = attrs.field(factory=_Ledgered)

    @property
    def usage(self) -> Usage | None:
        return self._ledgered.of(self._chunks.usage)

    def take(self, event: bytes, data: bytes | None) -> list[bytes]:
        if data is None:
            return []
        try:
            chunks = self._chunks.feed(_parsed(data))
        except UpstreamStreamError as error:
            raise _providerError(error) from None
        except BadAnswer as bad:
            raise StreamFault("invalid", str(bad)) from None
        out = [chunkBytes(chunk) for chunk in chunks]
        if self._chunks.finished:
            self.done = True
            out.append(DONE)
        return out

    def end(self) -> list[bytes]:
        raise StreamFault("broken", "the stream ended before message_stop")


@attrs.define
class MessagesOfOpenAI:
    """
    An OpenAI-compatible provider's stream as Anthropic's events.
    """

    _events: MessageEventStream
    done: bool = False
    _ledgered: _Ledgered = attrs.field(factory=_Ledgered)

    @property
    def usage(self) -> Usage | None:
        return self._ledgered.of(self._events.usage)

    def take(self, event: bytes, data: bytes | None) -> list[bytes]:
        if data is None:
            return []
        try:
            if data == DONE_DATA:
                events = self._events.end()
            else:
                events = self._events.feed(_parsed(data))
        except UpstreamStreamError as error:
            raise _providerError(error) from None
        except BadAnswer as bad:
            raise StreamFault("invalid", str(bad)) from None
        self.done = data == DONE_DATA or self._events.finished
        return [eventBytes(each) for each in events]

    def end(self) -> list[bytes]:
        try:
            events = self._events.end()
        except BadAnswer as bad:
            raise StreamFault("invalid", str(bad)) from None
        self.done = True
        return [eventBytes(each) for each in events]


def anthropicAsGiven(exchange: Exchange, model: Model) -> AnthropicAsGiven:
    return AnthropicAsGiven()


def chatOfAnthropic(exchange: Exchange, model: Model) -> ChatOfAnthropic:
    return ChatOfAnthropic(ChatChunkStream(exchange.created, wantsUsage(exchange.document)))


def messagesOfOpenAI(exchange: Exchange, model: Model) -> MessagesOfOpenAI:
    messageID = "msg_" + exchange.requestID.replace("-", "")
    return MessagesOfOpenAI(MessageEventStream(messageID, model.upstreamModel))
