"""
What a request asks of a provider (an L{Operation}), and how it is carried
to a provider of each C{api} (decisions D14): a L{Leg} per provider api
says the path, the body sent, how the answer and its stream come back in
the client's dialect, and where the usage is.

The client's dialect is the operation's: L{CHAT_COMPLETIONS} (OpenAI's
chat completions, decisions D9), L{MESSAGES} (Anthropic's Messages API,
D14), L{COUNT_TOKENS} (Anthropic's, to Anthropic providers only) and
L{EMBEDDINGS} (D13, to OpenAI-compatible providers only). The provider's
is its C{api}; per attempt (fallbacks may mix providers of both kinds):

  ===============  ===========  ==========================================
  client           provider     carried
  ===============  ===========  ==========================================
  chat completion  openai       as given: C{/chat/completions}, the body
                                as the client sent it (model replaced,
                                the cap a budget assumed under the
                                model's C{cap_field}), answer and stream
                                relayed as given (decisions D9)
  chat completion  anthropic    translated: C{/messages},
                                L{svcd.dialects.requests.anthropicRequestOf},
                                the answer by
                                L{svcd.dialects.answers.chatCompletionOf},
                                the stream event by event
                                (L{svcd.providers.passages})
  messages         anthropic    as given: C{/messages}, the body as the
                                client sent it (model replaced, a cap
                                under C{max_tokens}), answer and stream
                                relayed as given
  messages         openai       translated: C{/chat/completions},
                                L{svcd.dialects.requests.chatRequestOf},
                                the answer by
                                L{svcd.dialects.answers.anthropicMessageOf},
                                the stream event by event
  ===============  ===========  ==========================================

A request that cannot be translated for its model (a field with no
counterpart) is refused before anything is sent (L{Operation.refusal}:
400 VALIDATION_ERROR naming the field); a fallback that cannot take it is
not tried (L{Operation.sendable}).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from svcd.common.errors import ApiError
from svcd.dialects.answers import anthropicMessageOf, chatCompletionOf
from svcd.dialects.errors import BadAnswer, Untranslatable
from svcd.dialects.requests import anthropicRequestOf, chatRequestOf
from svcd.dialects.usage import usageOfAnthropic
from svcd.metering.bodies import attemptBody, embeddingsBody
from svcd.metering.models import ANTHROPIC, OPENAI, Model, Provider
from svcd.metering.usage import Usage
from svcd.providers.passages import (
    Exchange,
    anthropicAsGiven,
    chatOfAnthropic,
    messagesOfOpenAI,
    usageOfTokens,
)
from svcd.providers.relay import Passage, embeddingUsageOf, usageOf

# Decisions D14: the version of Anthropic's API sent when the client named
# none (a client of chat completions never does: its body is translated
# for this version).
ANTHROPIC_VERSION = "2023-06-01"
# Decisions D11: the output cap assumed for a request that names none, when
# the model's entry gives none either; Anthropic requires one in every
# request (svcd.limits.reservation's DEFAULT_OUTPUT_CAP, which this
# package may not import).
DEFAULT_ANTHROPIC_CAP = 4096

# Each leg's gen_ai.operation.name (OpenTelemetry's GenAI conventions,
# svcd.providers.genai): its well-known values, and for Anthropic's token
# counting, which they leave open, a name of our own.
CHAT_NAME = "chat"
EMBEDDINGS_NAME = "embeddings"
COUNT_TOKENS_NAME = "count_tokens"

BodyMaker = Callable[[Mapping[str, Any], Model, "int | None"], bytes]


@attrs.frozen
class Translated:
    """
    A whole answer as the client gets it, and its usage for the ledger.

    @ivar document: the answer in the client's dialect, or None when the
        provider's is sent as given (same dialect).
    """

    document: dict[str, Any] | None
    usage: Usage | None


AnswerReader = Callable[[object, Exchange], Translated]
PassageMaker = Callable[[Exchange, Model], Passage]


@attrs.frozen
class Leg:
    """
    How an operation is carried to providers of one C{api}.

    @ivar path: appended to the provider's base URL.
    @ivar body: the body sent to a model for the client's object, with the
        output cap a budget assumed (or None); raises L{Untranslatable} for
        a request that cannot be sent to it.
    @ivar answer: a whole answer's parsed JSON, in the client's dialect,
        and its usage; raises L{svcd.dialects.errors.BadAnswer} for one
        that is not of the provider's dialect.
    @ivar passage: what relays a stream when it is not OpenAI's relayed as
        given (None: L{svcd.providers.relay.StreamRelay}'s own way).
    @ivar translated: whether the client's and the provider's dialects
        differ (a body that may fail to translate).
    @ivar genAIOperation: its C{gen_ai.operation.name} on spans and
        metrics.
    """

    path: str
    body: BodyMaker
    answer: AnswerReader
    passage: PassageMaker | None = None
    translated: bool = False
    genAIOperation: str = CHAT_NAME


@attrs.frozen
class Operation:
    """
    What a request asks of a provider, in the client's dialect, and how it
    is carried to a provider of each C{api} (its L{Leg}s).

    @ivar name: the client's operation, for logs and tests.
    @ivar streams: whether C{"stream": true} asks for a stream.
    @ivar legs: by provider C{api}; a provider whose api has none cannot
        serve the operation (its attempts are not tried).
    """

    name: str
    streams: bool
    legs: Mapping[str, Leg]

    def leg(self, provider: Provider) -> Leg | None:
        return self.legs.get(provider.api)

    def body(
        self, document: Mapping[str, Any], model: Model, outputCap: int | None = None
    ) -> bytes:
        """
        The body sent to C{model} for the client's object C{document}.

        @raise Untranslatable: C{model}'s provider cannot be sent it.
        """
        leg = self.leg(model.provider)
        if leg is None:
            raise Untranslatable("model", f"is not served by {self.name}")
        return leg.body(document, model, outputCap)

    def sendable(
        self, document: Mapping[str, Any], model: Model, outputCap: int | None = None
    ) -> bytes | None:
        """
        L{body}, or None when C{model} cannot be sent the request (it is
        never tried): what a budget's worst case measures (decisions D12
        amended, D14: the body actually sent, translated or not).
        """
        try:
            return self.body(document, model, outputCap)
        except Untranslatable:
            return None

    def refusal(self, document: Mapping[str, Any], model: Model) -> ApiError | None:
        """
        The 400 VALIDATION_ERROR of a request that cannot be sent to the
        model it named (decisions D14: a field with no counterpart in its
        provider's dialect, named), or None. Checked before anything is
        sent; the model's fallbacks that cannot take it are skipped.
        """
        leg = self.leg(model.provider)
        if leg is not None and not leg.translated:
            return None
        try:
            self.body(document, model, None)
        except Untranslatable as untranslatable:
            return untranslatable.apiError()
        return None


def anthropicUsageOf(document: object) -> Usage | None:
    """
    The usage of an Anthropic message (its C{usage}), or None.
    """
    if not isinstance(document, dict):
        return None
    tokens = usageOfAnthropic(document.get("usage"))
    return usageOfTokens(tokens) if tokens is not None else None


def _dumps(document: Mapping[str, Any]) -> bytes:
    """
    C{document} as compact UTF-8 JSON; a lone surrogate (JSON's escape of
    one, which a client or a provider may send) has no UTF-8 form, and such
    a document is written with every non-ASCII character escaped instead:
    the same JSON, never an exception on the request's path.
    """
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(document, separators=(",", ":")).encode("ascii")


def _sentCap(outputCap: int, model: Model) -> int:
    return min(outputCap, model.outputCeiling)


# Bodies.


def anthropicBodyOfChat(
    document: Mapping[str, Any], model: Model, outputCap: int | None = None
) -> bytes:
    """
    The Messages body of a chat completion (decisions D14). Anthropic
    requires an output cap: the client's, else the one a budget assumed
    (C{outputCap}), else the model's C{max_output_tokens}, else D11's
    default.
    """
    if outputCap is not None:
        default = _sentCap(outputCap, model)
    elif model.maxOutputTokens is not None:
        default = model.maxOutputTokens
    else:
        default = DEFAULT_ANTHROPIC_CAP
    body = anthropicRequestOf(document, defaultMaxTokens=default)
    body["model"] = model.upstreamModel
    return _dumps(body)


def anthropicBodyOfMessages(
    document: Mapping[str, Any], model: Model, outputCap: int | None = None
) -> bytes:
    """
    A Messages body for an Anthropic provider (decisions D14): as the
    client sent it, C{model} replaced by its C{upstream_model}, and with
    C{outputCap} that cap under C{max_tokens}.
    """
    outgoing = dict(document)
    outgoing["model"] = model.upstreamModel
    if outputCap is not None:
        outgoing["max_tokens"] = _sentCap(outputCap, model)
    return _dumps(outgoing)


def countTokensBody(
    document: Mapping[str, Any], model: Model, outputCap: int | None = None
) -> bytes:
    """
    A count_tokens body for an Anthropic provider: as the client sent it,
    C{model} replaced (it counts, so no cap).
    """
    outgoing = dict(document)
    outgoing["model"] = model.upstreamModel
    return _dumps(outgoing)


def chatBodyOfMessages(
    document: Mapping[str, Any], model: Model, outputCap: int | None = None
) -> bytes:
    """
    The chat completions body of a Messages body (decisions D14), for an
    OpenAI-compatible provider: the cap under the model's C{cap_field}, a
    stream asking for its usage.
    """
    chat = chatRequestOf(document, capField=model.capField)
    chat["model"] = model.upstreamModel
    if outputCap is not None:
        chat[model.capField] = _sentCap(outputCap, model)
    return _dumps(chat)


# Answers.


def _asGivenOpenAI(parsed: object, exchange: Exchange) -> Translated:
    return Translated(None, usageOf(parsed))


def _asGivenEmbeddings(parsed: object, exchange: Exchange) -> Translated:
    return Translated(None, embeddingUsageOf(parsed))


def _asGivenAnthropic(parsed: object, exchange: Exchange) -> Translated:
    return Translated(None, anthropicUsageOf(parsed))


def _noUsage(parsed: object, exchange: Exchange) -> Translated:
    # Counting tokens costs nothing (decisions D14: no ledger row).
    return Translated(None, None)


def _chatOfAnthropic(parsed: object, exchange: Exchange) -> Translated:
    if not isinstance(parsed, dict):
        raise BadAnswer("an answer that is not an object")
    return Translated(chatCompletionOf(parsed, created=exchange.created), anthropicUsageOf(parsed))


def _messageOfOpenAI(parsed: object, exchange: Exchange) -> Translated:
    if not isinstance(parsed, dict):
        raise BadAnswer("an answer that is not an object")
    return Translated(anthropicMessageOf(parsed), usageOf(parsed))


CHAT_COMPLETIONS = Operation(
    "chat completions",
    streams=True,
    legs={
        OPENAI: Leg("/chat/completions", attemptBody, _asGivenOpenAI),
        ANTHROPIC: Leg(
            "/messages",
            anthropicBodyOfChat,
            _chatOfAnthropic,
            chatOfAnthropic,
            translated=True,
        ),
    },
)
MESSAGES = Operation(
    "messages",
    streams=True,
    legs={
        ANTHROPIC: Leg("/messages", anthropicBodyOfMessages, _asGivenAnthropic, anthropicAsGiven),
        OPENAI: Leg(
            "/chat/completions",
            chatBodyOfMessages,
            _messageOfOpenAI,
            messagesOfOpenAI,
            translated=True,
        ),
    },
)
COUNT_TOKENS = Operation(
    "count_tokens",
    streams=False,
    legs={
        ANTHROPIC: Leg(
            "/messages/count_tokens", countTokensBody, _noUsage, genAIOperation=COUNT_TOKENS_NAME
        )
    },
)
EMBEDDINGS = Operation(
    "embeddings",
    streams=False,
    legs={
        OPENAI: Leg(
            "/embeddings", embeddingsBody, _asGivenEmbeddings, genAIOperation=EMBEDDINGS_NAME
        )
    },
)
