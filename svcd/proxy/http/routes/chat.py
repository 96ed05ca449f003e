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

from svcd.providers.operations import CHAT_COMPLETIONS
from svcd.proxy.http.chatbody import ChatRequest, parseChatBody
from svcd.proxy.http.routes.conversation import ClientDialect
from svcd.proxy.recall import assemble


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


CHAT = ClientDialect(CHAT_COMPLETIONS, parseChatBody, _withMemories, "Chat completion", _errorEvent)
