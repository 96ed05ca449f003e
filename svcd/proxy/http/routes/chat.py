"""
POST /v1/chat/completions (and its alias under /proxy): a route of
conversations (L{svcd.proxy.http.routes.conversation.ConversationRoutes})
in OpenAI's dialect (L{CHAT}): the chat body of decisions D4, recall's
memories as a system message after the leading ones (decisions D13),
errors in the envelope of spec section 7, a broken stream ended by
C{data: {"error": ...}} (decisions D9).
"""

from __future__ import annotations

import attrs

from svcd.metering.models import ANTHROPIC
from svcd.providers.operations import CHAT_COMPLETIONS
from svcd.providers.upstream import ANTHROPIC_BETA_HEADER
from svcd.proxy.http.chatbody import ChatRequest, checkChatDocument, parseJSONObject
from svcd.proxy.http.routes.conversation import ClientDialect, ModelOf
from svcd.proxy.recall import assemble


def _parse(body: bytes, modelOf: ModelOf) -> ChatRequest:
    """
    The request's body, parsed and checked: for a model of an Anthropic
    provider, whose body is translated, with content parts (decisions
    D14, L{checkChatDocument}).
    """
    document = parseJSONObject(body)
    model = modelOf(document.get("model"))
    return checkChatDocument(document, parts=model is not None and model.provider.api == ANTHROPIC)


def _withMemories(chat: ChatRequest, message: dict[str, str]) -> ChatRequest:
    """
    The chat request with recall's message of memories after its leading
    system and developer messages (decisions D13).
    """
    messages = assemble(chat.messages, message)
    document = {**chat.document, "messages": messages}
    return attrs.evolve(chat, messages=messages, document=document)


def _errorEvent(envelope: bytes) -> bytes:
    # Decisions D9: the envelope of spec section 7 as the stream's data.
    return b"data: " + envelope + b"\n\n"


# Decisions D14: of a client of chat completions, an Anthropic provider is
# given its anthropic-beta as it came (a beta of headers alone, such as a
# longer context window, serves it too); never its anthropic-version: its
# body is translated for the gateway's own.
CHAT = ClientDialect(
    CHAT_COMPLETIONS,
    _parse,
    _withMemories,
    "Chat completion",
    _errorEvent,
    (ANTHROPIC_BETA_HEADER,),
)
