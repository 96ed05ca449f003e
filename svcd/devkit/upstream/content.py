"""
What the scripted model's answers say, whatever the dialect that carries
them: the echo's content (L{echoContent}), the memories of svc-worker's
extraction request (L{extractionContent}) and the embedding of a text
(L{embeddingOf}). See "Extraction" and "Embeddings" in the package's
manual.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct

# The vector length of an embeddings answer when the request names none,
# and the longest one a request may ask for.
DEFAULT_EMBEDDING_DIMENSIONS = 64
MAX_EMBEDDING_DIMENSIONS = 4096


def _textOf(content: object) -> str:
    """
    The text of a message's C{content}: a string, or the C{text} of each
    part of a list of content parts.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def echoContent(body: object) -> tuple[str, int]:
    """
    The content of an C{echo} answer to C{body}, and its prompt tokens.
    """
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        messages = []
    texts = [_textOf(message.get("content")) for message in messages if isinstance(message, dict)]
    last = len(texts[-1]) if texts else 0
    content = f"Scripted answer to {len(messages)} messages; the last has {last} characters."
    return content, sum(len(text.split()) for text in texts)


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
