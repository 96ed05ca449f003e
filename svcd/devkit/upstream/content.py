"""
What the scripted model's answers say, whatever the dialect that carries
them: the echo's content (L{echoContent} for a chat completion,
L{anthropicEchoContent} for a Messages request), the tool call of
C{tool-call} (L{toolCallOf}), the memories of svc-worker's extraction
request (L{extractionContent}) and the embedding of a text
(L{embeddingOf}). See "Tool calls", "Extraction" and "Embeddings" in the
package's manual.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct

import attrs

# The vector length of an embeddings answer when the request names none,
# and the longest one a request may ask for.
DEFAULT_EMBEDDING_DIMENSIONS = 64
MAX_EMBEDDING_DIMENSIONS = 4096


def _textOf(content: object) -> str:
    """
    The text of a message's C{content}: a string, or the C{text} of each
    part of a list of content parts (or of Anthropic's content blocks,
    where a C{tool_result} block's text is that of its own C{content}).
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif part.get("type") == "tool_result":
                texts.append(_textOf(part.get("content")))
        return " ".join(texts)
    return ""


def _messagesOf(body: object) -> list[object]:
    messages = body.get("messages") if isinstance(body, dict) else None
    return messages if isinstance(messages, list) else []


def _echoOf(count: int, texts: list[str]) -> tuple[str, int]:
    last = len(texts[-1]) if texts else 0
    content = f"Scripted answer to {count} messages; the last has {last} characters."
    return content, sum(len(text.split()) for text in texts)


def echoContent(body: object) -> tuple[str, int]:
    """
    The content of an C{echo} answer to C{body}, and its prompt tokens.
    """
    messages = _messagesOf(body)
    texts = [_textOf(message.get("content")) for message in messages if isinstance(message, dict)]
    return _echoOf(len(messages), texts)


def anthropicEchoContent(body: object) -> tuple[str, int]:
    """
    The content of an C{echo} answer to a Messages request, and its input
    tokens: as L{echoContent}, with the C{system} prompt (when it has any)
    counted as one more message before the others, so that a conversation
    is echoed alike in both dialects.
    """
    messages = _messagesOf(body)
    texts = [_textOf(message.get("content")) for message in messages if isinstance(message, dict)]
    system = body.get("system") if isinstance(body, dict) else None
    if isinstance(system, (str, list)) and system:
        return _echoOf(len(messages) + 1, [_textOf(system), *texts])
    return _echoOf(len(messages), texts)


@attrs.frozen
class ToolCall:
    """
    The one tool call of a C{tool-call} answer: its id, the tool's name,
    and its arguments as JSON text (an object).
    """

    id: str
    name: str
    arguments: str

    def pieces(self, count: int = 3) -> list[str]:
        """
        The arguments cut in C{count} pieces (fewer when too short), as a
        stream sends them.
        """
        size = -(-len(self.arguments) // count)
        return [
            self.arguments[start : start + size] for start in range(0, len(self.arguments), size)
        ]


def endsWithToolResult(body: object) -> bool:
    """
    Whether the conversation's last turn gives a tool's result: OpenAI's
    C{tool} message, or an Anthropic user turn with a C{tool_result}
    block.
    """
    messages = _messagesOf(body)
    last = messages[-1] if messages else None
    if not isinstance(last, dict):
        return False
    if last.get("role") == "tool":
        return True
    content = last.get("content")
    return isinstance(content, list) and any(
        isinstance(block, dict) and block.get("type") == "tool_result" for block in content
    )


def _toolName(tool: object) -> str | None:
    # OpenAI's {"type": "function", "function": {"name"}} or Anthropic's {"name"}.
    if not isinstance(tool, dict):
        return None
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    return name if isinstance(name, str) and name else None


def toolNameOf(body: object) -> str | None:
    """
    The tool a C{tool-call} answer to C{body} calls when its script names
    none: the one C{tool_choice} names, else the first of C{tools}.
    """
    if not isinstance(body, dict):
        return None
    chosen = _toolName(body.get("tool_choice"))
    if chosen is not None:
        return chosen
    tools = body.get("tools")
    return _toolName(tools[0]) if isinstance(tools, list) and tools else None


def toolCallOf(body: object, name: str, callID: str) -> ToolCall | None:
    """
    The tool call of a C{tool-call} answer to C{body}: tool C{name} with
    the arguments C{{"text": <the text of the last message>}}; or L{None}
    when the last turn is a tool's result, which is answered as C{echo} (an
    agent's loop then ends).
    """
    if endsWithToolResult(body):
        return None
    messages = _messagesOf(body)
    last = messages[-1] if messages else None
    lastText = _textOf(last.get("content")) if isinstance(last, dict) else ""
    return ToolCall(callID, name, json.dumps({"text": lastText}))


# A sentence: text up to its end mark (or the end). A statement about the
# user: one with a word of the first person singular.
_SENTENCE = re.compile(r"[^.!?\n]+[.!?]*")
_FIRST_PERSON = re.compile(r"\b(i|i'm|i've|i'd|i'll|me|my|mine|myself)\b", re.IGNORECASE)


def extractionContent(body: object) -> str | None:
    """
    The answer of the scripted model to svc-worker's extraction request
    (decisions D13: C{response_format} a JSON object, the extraction
    prompt first, the conversation as JSON in the next message), or None
    for any other request: C{{"memories": [...]}} holding each sentence of
    the user's turns that says something of the user (a word of the first
    person singular) and is no question, trimmed, in order, at most 20.
    """
    from svcd.worker.extraction import MAX_MEMORIES, PROMPT_FIRST_LINE

    if not isinstance(body, dict) or body.get("response_format") != {"type": "json_object"}:
        return None
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return None
    first, second = messages[0], messages[1]
    if not (
        isinstance(first, dict)
        and isinstance(first.get("content"), str)
        and first["content"].startswith(PROMPT_FIRST_LINE)
        and isinstance(second, dict)
        and isinstance(second.get("content"), str)
    ):
        return None
    try:
        turns = json.loads(second["content"])["conversation"]
    except (ValueError, KeyError, TypeError):
        return None
    memories: list[str] = []
    for turn in turns if isinstance(turns, list) else []:
        if not isinstance(turn, dict) or turn.get("role") != "user":
            continue
        for sentence in _SENTENCE.findall(str(turn.get("content", ""))):
            sentence = sentence.strip()
            if sentence and not sentence.endswith("?") and _FIRST_PERSON.search(sentence):
                memories.append(sentence)
    return json.dumps({"memories": memories[:MAX_MEMORIES]})


_WORD = re.compile(r"\w+")


def embeddingOf(text: str, dimensions: int) -> tuple[list[float], bytes]:
    """
    The scripted embedding of C{text}: a hashed bag of its words (each
    word, lower-cased, adds +1 or -1 at a place chosen by its BLAKE2b
    hash; a text without a word counts as one word, itself),
    L2-normalised, as float32 values and as their little-endian bytes
    (what C{"encoding_format": "base64"} encodes).
    """
    vector = [0.0] * dimensions
    for word in _WORD.findall(text.lower()) or [text]:
        digest = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        place = int.from_bytes(digest[:4], "little") % dimensions
        vector[place] += 1.0 if digest[4] & 1 else -1.0
    norm = math.sqrt(sum(value * value for value in vector))
    if norm:
        vector = [value / norm for value in vector]
    packed = struct.pack(f"<{dimensions}f", *vector)
    return list(struct.unpack(f"<{dimensions}f", packed)), packed
