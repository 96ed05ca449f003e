"""
A scripted OpenAI-compatible upstream for the tests: a real HTTP server on a
loopback port that answers C{POST .../chat/completions} the way a provider
does (JSON answers, chunked server-sent events, OpenAI-shaped errors), or
misbehaves in exactly the way a test asks for.

Why a separate process: the end-to-end tests drive the gateway with blocking
clients (the C{openai} SDK, urllib) from the test thread while the daemons
run as processes; an upstream running on the test's own reactor would not
answer while the test thread blocks. Run it as::

    python -m svcd.testing.upstream --port 0 --port-file PATH [--api-key KEY]
        [--embedding-dimensions N]

It listens on 127.0.0.1 only, writes its ports to C{PATH} once listening
(JSON: C{{"port": API port, "controlPort": control port}}), logs nothing but
errors (on stderr) and stops on SIGTERM. L{ScriptedUpstream} runs it for a
test; tests/upstreamfixtures.py wraps that in the C{scriptedUpstream}
fixture.

Routes of the API port
======================

  - C{POST <any prefix>/chat/completions}: the scripted answer, chosen by
    the request body's C{model} (the grammar below). The prefix is free, so
    one server can stand for several providers: C{/v1/chat/completions} and
    C{/other/v1/chat/completions} behave alike, and the request log tells
    them apart by C{path}.
  - C{POST <any prefix>/embeddings}: OpenAI's embeddings answer (decisions
    D13; see "Embeddings" below), with the same grammar of C{model}.
  - C{GET <any prefix>/models}: the OpenAI list shape, naming a few models
    of the grammar.
  - Anything else: 404 (or 405 for a known path with another method) with
    an OpenAI-shaped error.

With C{--api-key KEY}, every API request whose C{Authorization} is not
C{Bearer KEY} gets 401 C{invalid_api_key}, before any script runs.

Every answer carries C{x-request-id: req_scripted_<n>}, as OpenAI's do, so a
test can check that the gateway does not pass the upstream's id on.

The grammar of C{model}
=======================

A model is one or more directives joined by C{+}, such as C{slow:300},
C{gap:50+events:20} or C{slow:200+status:503}. A model whose parts are not
all directives of this list (C{gpt-4o}, C{llama-3.1-8b}) is plain C{echo},
so a gateway forwarding real model names gets normal answers. A directive
of the list with a bad argument answers 400 saying what is wrong.

What the answer I{is} (at most one of these; C{echo} when none):

  - C{echo}: a normal answer whose content describes the request:
    C{"Scripted answer to <m> messages; the last has <c> characters."}.
    Non-streaming: a C{chat.completion} JSON with C{usage}. With
    C{"stream": true}: C{chat.completion.chunk} events, a first one with
    C{delta.role = "assistant"} and empty content, one content delta per
    word of the answer (their concatenation is the non-streaming content),
    a final one with C{finish_reason = "stop"}, then, only when the request
    has C{stream_options.include_usage: true}, a usage chunk with
    C{choices: []} (and C{"usage": null} on every other chunk, as OpenAI
    does), then C{data: [DONE]}. Usage: C{prompt_tokens} is the number of
    whitespace-separated words in the text of all messages,
    C{completion_tokens} the number of words of the answer.
  - C{status:<code>}: answers C{<code>} (400..599) with an OpenAI error
    body C{{"error": {"message", "type", "param", "code"}}}; the message is
    C{"Scripted error <code> for model '<model>'."}. C{status:429} also
    sends C{Retry-After: 7}; C{status:429:<seconds>} sends that value
    instead, or no Retry-After when it is 0.
  - C{close-mid-stream}: a stream of the role event and two content
    events, then the connection is closed with no terminating chunk (and
    no C{[DONE]}). Non-streaming: the headers with the full
    C{Content-Length} and half of the body, then the close. The close is a
    FIN once what was written has been sent, not a reset: a reset may make
    the reader's kernel drop data it has received and not yet read, and
    the test could not know whether the events arrived.
  - C{reset}: the connection is aborted (a TCP reset) before anything is
    answered.
  - C{never-ending}: a stream whose content events keep coming every
    100 ms (or C{gap}) forever. Non-streaming: 200 headers, then a body
    of JSON whitespace, one byte every 100 ms, forever (bytes keep coming,
    the answer never completes).
  - C{stall-stream}: the headers and the role event, then nothing, the
    connection held open. Non-streaming: the headers with the full
    C{Content-Length} and half of the body, then nothing.
  - C{events:<n>}: C{n} content events of about 300 bytes each, as fast as
    the connection takes them: the server is a push producer, so when the
    reader stops reading it stops writing once its kernel and transport
    buffers are full (about 64 KiB of its own plus the loopback socket
    buffers, which can hold megabytes). C{eventsSent} in the request log
    counts what was written so far, for backpressure tests.
    Non-streaming: one answer with the same content.
  - C{bytes:<n>}: an answer whose content is C{n} characters (the body is a
    little longer). Streaming: that content in deltas of 256 characters.
  - C{not-json}: 200 with C{Content-Type: application/json} and a body
    that is not JSON. Streaming: 200 C{text/event-stream} whose one event is
    C{data: this is not JSON}, then C{data: [DONE]}.

How it is delivered (any of these, with any of the above):

  - C{slow:<ms>}: wait that long before anything (headers, error, abort).
  - C{hold:<ms>}: send the 200 headers at once, then wait that long before
    the body or the first event, as a provider does that answers at once
    and then thinks (C{status}, C{reset} and C{not-json} ignore it).
  - C{gap:<ms>}: stream events that far apart (the first comes at once).
  - C{no-usage}: no C{usage} in the answer, and no usage chunk in a
    stream even when asked, as some providers do.
  - C{usage:<prompt>:<completion>}: the answer's usage says these counts
    instead of the echo's word counts (the content stays the echo's), as
    providers that give no details do (vLLM, for one).
    C{usage:<prompt>:<completion>:<cached>:<reasoning>} adds OpenAI's
    details: C{prompt_tokens_details.cached_tokens} (part of the prompt)
    and C{completion_tokens_details.reasoning_tokens} (part of the
    completion).
  - C{usage-at-cap}: the answer's usage says the most tokens the request
    allows, as the worst provider a budget must survive would (decisions
    D12, amended): C{prompt_tokens} is the request body's length in bytes
    (a byte-level tokenizer makes at most one token of a byte),
    C{completion_tokens} the request's output cap (C{max_completion_tokens}
    or C{max_tokens}, the larger when both are given) times its C{n}
    (default 1). A request without a cap (or with one that is not a whole
    number of at least 1) is answered 400, so a test can see that no cap
    was sent. The content stays the echo's.
  - C{usage-over-cap} (or C{usage-over-cap:<factor>}, 2 to 1000): as
    C{usage-at-cap}, with C{completion_tokens} that many times (default 2)
    more than the request allows: a provider that ignored its cap.

Extraction
==========

svc-worker's extraction request (decisions D13: C{"response_format":
{"type": "json_object"}}, the project's extraction prompt as the first
message, the conversation as JSON in the second) is answered, for C{echo},
with the content C{{"memories": [...]}}: each sentence of the user's turns
that says something of the user (it has a word of the first person
singular: I, me, my, ...) and is no question, in order, at most 20
(L{extractionContent}). The other kinds answer as usual (C{bytes:10} gives
an answer whose content is not the JSON asked for).

Embeddings
==========

C{POST .../embeddings} answers C{{"object": "list", "data": [{"object":
"embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens",
"total_tokens"}}}, one vector per input (C{input}: a string or an array
of strings; anything else is a 400), in order. The vectors are
deterministic and texts that share words are near: a hashed bag of words
(L{embeddingOf}: each word, lower-cased, adds +1 or -1 at a place of the
vector chosen by its hash), L2-normalised, so the cosine of two texts
grows with the words they share and is about 0 for texts that share none.
Their length is the request's C{dimensions} when it names one (1 to
L{MAX_EMBEDDING_DIMENSIONS}), else the server's C{--embedding-dimensions}
(default L{DEFAULT_EMBEDDING_DIMENSIONS}). C{"encoding_format": "base64"}
gives each vector as the base64 of its little-endian float32 values, as
OpenAI does; C{"float"} (the default) as numbers, the same float32 values.
C{prompt_tokens} is the number of whitespace-separated words of all the
inputs.

The directives of C{model} apply as they do to a non-streaming chat
completion (C{status}, C{reset}, C{slow}, C{hold}, C{not-json},
C{close-mid-stream}, C{stall-stream}, C{never-ending}, C{no-usage}, and
C{usage:<prompt>:<completion>}, whose prompt is the answer's
C{prompt_tokens}), except C{events} and C{bytes} (a 400). C{usage-at-cap}
makes C{prompt_tokens} the request body's length in bytes, the most a
byte-level tokenizer could count (an embedding has no cap), and
C{usage-over-cap:<factor>} that many times more. C{"stream": true} is
ignored: embeddings never stream.

C{vectors:<how>} (embeddings only; a chat completion naming it is a 400)
answers vectors a provider should never send: C{short} and C{long}, one
value fewer or more than the length asked for; C{huge}, the first value
1e39 (beyond float32) and C{nan}, the first value C{NaN}, both written as
JSON numbers whatever C{encoding_format} asked (a provider that ignored
it); C{infinity}, the first value an infinity (float32's in base64, else
the JSON token C{Infinity}).

Routes of the control port
==========================

The control routes live on a port of their own so that the tests' own
queries never show up in the connection counts or the request log.

  - C{GET /_upstream/requests}: the request log, a JSON list, oldest first,
    of every request the API port received. Each entry: C{number} (1, 2,
    ...), C{method}, C{path}, C{query}, C{headers} (C{[name, value]} pairs,
    names in lower case), C{body} (the parsed JSON, or null), C{bodyText}
    (the body as text when it is not JSON, else null), C{bodyLength},
    C{clientPort} (the peer's port: requests with the same value while it
    was open shared one connection), C{arrived} and C{ended} (monotonic
    times, see below; C{ended} is null while the answer is under way),
    C{outcome} (null while under way; C{"finished"} when the whole answer
    was written, C{"clientGone"} when the connection was lost before that,
    C{"aborted"} when the script closed or reset it), C{status} (the status
    answered, null before the headers) and C{eventsSent} (stream events
    written so far, C{[DONE]} included; 0 for answers that are no stream).
  - C{DELETE /_upstream/requests}: empties the log (numbering goes on).
  - C{GET /_upstream/connections}: C{{"open": n, "accepted": n}}, the TCP
    connections of the API port open now and accepted since the start.

The times are C{time.monotonic()} of the server process: on Linux that is
C{CLOCK_MONOTONIC}, one clock for every process of the machine, so a test
can compare them with its own C{time.monotonic()} (such as the time its
client went away against the C{ended} of the upstream request).
"""

# Runs this module as a child process with an argument list we build, and
# talks HTTP to it on loopback only.
# ruff: noqa: S603, S310

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

import attrs
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.interfaces import (
    IDelayedCall,
    IListeningPort,
    IPushProducer,
    IReactorTCP,
    IReactorTime,
    ITCPTransport,
)
from twisted.internet.task import react
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web.http import Request as HTTPRequest
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site
from zope.interface import implementer

LOOPBACK = "127.0.0.1"

# Retry-After of a plain status:429.
DEFAULT_RETRY_AFTER = 7

# The event interval of never-ending when no gap is given.
NEVER_ENDING_INTERVAL = 0.1

# Without a gap, a stream writes this many events per turn of the reactor,
# so that a fast stream does not keep the reactor from everything else
# (such as noticing that the reader went away).
EVENTS_PER_TURN = 64

# The size of one events:<n> content delta, and of a bytes:<n> stream delta.
EVENT_CONTENT_SIZE = 300
BYTES_DELTA_SIZE = 256

# The vector length of an embeddings answer when the request names none,
# and the longest one a request may ask for.
DEFAULT_EMBEDDING_DIMENSIONS = 64
MAX_EMBEDDING_DIMENSIONS = 4096

# How long ScriptedUpstream waits for the process to listen, and to stop.
# Generous: a loaded machine can take seconds to import Twisted.
DEFAULT_START_TIMEOUT = 60.0
DEFAULT_STOP_TIMEOUT = 10.0

_ANSWER_KINDS = frozenset(
    {
        "echo",
        "status",
        "close-mid-stream",
        "reset",
        "never-ending",
        "stall-stream",
        "events",
        "bytes",
        "not-json",
    }
)
_DELIVERY_DIRECTIVES = frozenset(
    {"slow", "hold", "gap", "no-usage", "usage", "usage-at-cap", "usage-over-cap", "vectors"}
)
# The arguments of the embeddings' directive vectors:<how>.
VECTOR_FAULTS = frozenset({"short", "long", "huge", "nan", "infinity"})
DIRECTIVES = _ANSWER_KINDS | _DELIVERY_DIRECTIVES

_NOT_JSON = b"this is not JSON"


class ScriptError(ValueError):
    """
    A model names directives of the grammar with arguments that make no
    sense; the message says which.
    """


@attrs.frozen
class Script:
    """
    What one request asked for, parsed from its model by L{parseScript}.

    @ivar kind: one of the answer kinds of the grammar (C{"echo"} ...).
    @ivar count: the argument of C{events}, C{bytes} or C{status}.
    @ivar retryAfter: the Retry-After of a 429, or L{None} for none.
    @ivar delay: seconds to wait before anything.
    @ivar hold: seconds between the headers and the body.
    @ivar gap: seconds between stream events, or L{None} when not given.
    @ivar usage: whether the answer carries usage.
    @ivar counts: the usage's (prompt, completion) counts, then optionally
        (cached, reasoning) details, instead of the echo's; L{None} for
        the echo's.
    @ivar capFactor: with C{usage-at-cap} (1) or C{usage-over-cap} (its
        factor), the usage is taken from the request (L{capUsage}) and
        the completion multiplied by this; 0 otherwise.
    """

    kind: str = "echo"
    count: int = 0
    retryAfter: int | None = None
    delay: float = 0.0
    hold: float = 0.0
    gap: float | None = None
    usage: bool = True
    counts: tuple[int, ...] | None = None
    capFactor: int = 0
    vectors: str | None = None


def _number(directive: str, text: str, low: int, high: int) -> int:
    if not re.fullmatch(r"\d{1,9}", text) or not low <= int(text) <= high:
        raise ScriptError(f"{directive} takes a whole number from {low} to {high}, not {text!r}")
    return int(text)


def parseScript(model: str) -> Script:
    """
    The script a model names (see the module's docstring for the grammar).

    @raise ScriptError: when the directives are known but wrongly used.
    """
    parts = model.split("+")
    names = [part.split(":", 1)[0] for part in parts]
    if not all(name in DIRECTIVES for name in names):
        return Script()
    kinds = [name for name in names if name in _ANSWER_KINDS]
    if len(kinds) > 1:
        raise ScriptError(f"at most one of {sorted(_ANSWER_KINDS)} per model, not {kinds}")
    fields: dict[str, Any] = {}
    seen: set[str] = set()
    for part, name in zip(parts, names, strict=True):
        arguments = part.split(":")[1:]
        if name in seen:
            raise ScriptError(f"{name} given twice")
        seen.add(name)
        if name in (
            "echo",
            "close-mid-stream",
            "reset",
            "never-ending",
            "stall-stream",
            "not-json",
        ):
            if arguments:
                raise ScriptError(f"{name} takes no argument")
            fields["kind"] = name
        elif name == "no-usage":
            if arguments:
                raise ScriptError("no-usage takes no argument")
            fields["usage"] = False
        elif name == "usage":
            if len(arguments) not in (2, 4):
                raise ScriptError(
                    "usage takes usage:<prompt>:<completion>"
                    " or usage:<prompt>:<completion>:<cached>:<reasoning>"
                )
            counts = tuple(_number(name, each, 0, 1_000_000_000) for each in arguments)
            if len(counts) == 4 and (counts[2] > counts[0] or counts[3] > counts[1]):
                raise ScriptError(
                    "usage: cached tokens are part of the prompt, reasoning of the completion"
                )
            fields["counts"] = counts
        elif name == "usage-at-cap":
            if arguments:
                raise ScriptError("usage-at-cap takes no argument")
            fields["capFactor"] = 1
        elif name == "usage-over-cap":
            if len(arguments) > 1:
                raise ScriptError("usage-over-cap takes at most a factor: usage-over-cap:<factor>")
            fields["capFactor"] = _number(name, arguments[0], 2, 1000) if arguments else 2
        elif name == "vectors":
            if len(arguments) != 1 or arguments[0] not in VECTOR_FAULTS:
                raise ScriptError(f"vectors takes one of {sorted(VECTOR_FAULTS)}: vectors:<how>")
            fields["vectors"] = arguments[0]
        elif name in ("slow", "hold", "gap"):
            if len(arguments) != 1:
                raise ScriptError(f"{name} takes milliseconds: {name}:<ms>")
            milliseconds = _number(name, arguments[0], 0, 3_600_000)
            fields["delay" if name == "slow" else name] = milliseconds / 1000
        elif name in ("events", "bytes"):
            if len(arguments) != 1:
                raise ScriptError(f"{name} takes a count: {name}:<n>")
            fields["kind"] = name
            fields["count"] = _number(name, arguments[0], 0, 1_000_000_000)
        else:  # status
            if len(arguments) not in (1, 2):
                raise ScriptError("status takes a code: status:<code> or status:429:<seconds>")
            code = _number("status", arguments[0], 400, 599)
            fields["kind"] = name
            fields["count"] = code
            if len(arguments) == 2:
                if code != 429:
                    raise ScriptError("only status:429 takes a Retry-After")
                seconds = _number("Retry-After", arguments[1], 0, 86_400)
                fields["retryAfter"] = seconds or None
            elif code == 429:
                fields["retryAfter"] = DEFAULT_RETRY_AFTER
    if "counts" in fields and fields.get("usage") is False:
        raise ScriptError("usage and no-usage contradict each other")
    capped = [name for name in names if name in ("usage", "usage-at-cap", "usage-over-cap")]
    if len(capped) > 1 or (capped and fields.get("usage") is False):
        raise ScriptError(f"at most one of usage, usage-at-cap, usage-over-cap, no-usage: {names}")
    return Script(**fields)


def _requestCount(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ScriptError(f"{key} must be a whole number of at least 1, not {value!r}")
    return value


def capUsage(body: dict[str, Any], bodyLength: int, factor: int) -> tuple[int, int]:
    """
    The (prompt, completion) usage of C{usage-at-cap} (C{factor} 1) or
    C{usage-over-cap}: the body's bytes, and its cap times its C{n} times
    C{factor}.

    @raise ScriptError: when the request names no cap.
    """
    caps = [
        cap
        for cap in (
            _requestCount(body, "max_completion_tokens"),
            _requestCount(body, "max_tokens"),
        )
        if cap is not None
    ]
    if not caps:
        raise ScriptError("the request has neither max_completion_tokens nor max_tokens")
    choices = _requestCount(body, "n") or 1
    return bodyLength, max(caps) * choices * factor


def _errorBody(message: str, type: str, code: str | None, param: str | None = None) -> bytes:
    """
    An error in OpenAI's shape, which the C{openai} SDK reads into its
    exceptions' C{message}, C{type} and C{code}.
    """
    error = {"message": message, "type": type, "param": param, "code": code}
    return json.dumps({"error": error}).encode()


# The type and code OpenAI gives the errors of each status, roughly: the SDK
# chooses its exception class by status alone, so these are for realism.
_ERROR_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "unsupported_country_region_territory"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("requests", "rate_limit_exceeded"),
}


def _setStatus(request: Request, status: int) -> None:
    """
    Set the status with its standard phrase: Twisted knows none for some
    codes (429 would go out as "Unknown Status").
    """
    try:
        phrase = HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        phrase = b"Scripted Status"
    request.setResponseCode(status, phrase)


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


@attrs.define
class RequestRecord:
    """
    One request of the log, updated while its answer goes on.
    """

    number: int
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: object
    bodyText: str | None
    bodyLength: int
    clientPort: int | None
    arrived: float
    ended: float | None = None
    outcome: str | None = None
    status: int | None = None
    eventsSent: int = 0

    def asJSON(self) -> dict[str, object]:
        return attrs.asdict(self, recurse=False) | {
            "headers": [list(header) for header in self.headers]
        }


@implementer(IPushProducer)
class _StreamPlayer:
    """
    Writes a sequence of events to a request, C{gap} seconds apart or (gap
    0) as fast as the connection takes them, then calls C{onEnd}.

    Registered as the request's push producer: while the transport's buffer
    is full it is paused and writes nothing, which is what lets a test see
    the gateway's backpressure in C{eventsSent}.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        write: Callable[[bytes], None],
        events: Iterator[bytes],
        gap: float,
        onEnd: Callable[[], None],
    ) -> None:
        self._reactor = reactor
        self._write = write
        self._events = events
        self._gap = gap
        self._onEnd = onEnd
        self._paused = False
        self._stopped = False
        self._next: IDelayedCall | None = None

    def start(self) -> None:
        self._writeSome()

    def _writeSome(self) -> None:
        self._next = None
        budget = 1 if self._gap > 0 else EVENTS_PER_TURN
        while budget > 0 and not self._paused and not self._stopped:
            event = next(self._events, None)
            if event is None:
                self._stopped = True
                self._onEnd()
                return
            self._write(event)
            budget -= 1
        self._scheduleNext(self._gap)

    def _scheduleNext(self, delay: float) -> None:
        if self._next is None and not self._paused and not self._stopped:
            self._next = self._reactor.callLater(delay, self._writeSome)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._scheduleNext(0)

    def stopProducing(self) -> None:
        self._stopped = True
        if self._next is not None and self._next.active():
            self._next.cancel()
        self._next = None


class _Answer:
    """
    The answer to one chat completion request, played out as its script
    says, and the bookkeeping of its record.
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
        self._reactor = reactor
        self._clock = clock
        self._request = request
        self._record = record
        self._script = script
        body = record.body if isinstance(record.body, dict) else {}
        self._body = body
        self._model = str(body.get("model", ""))
        self._stream = body.get("stream") is True
        streamOptions = body.get("stream_options")
        self._includeUsage = (
            script.usage
            and isinstance(streamOptions, dict)
            and streamOptions.get("include_usage") is True
        )
        self._completionID = f"chatcmpl-scripted-{answerNumber}"
        self._created = int(reactor.seconds())
        self._pending: IDelayedCall | None = None
        self._player: _StreamPlayer | None = None
        self._closing = False
        self._gone = False
        request.notifyFinish().addErrback(self._lost)

    # Bookkeeping

    def _lost(self, reason: Failure) -> None:
        """
        The connection went away before the answer finished: stop playing
        the script, and correct the record's outcome when the script itself
        closed the connection. (The record's time and outcome were set by
        L{UpstreamResource}, whose notification comes first.)
        """
        self._gone = True
        if self._closing:
            self._record.outcome = "aborted"
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        if self._player is not None:
            self._player.stopProducing()

    def _reset(self) -> None:
        """
        Abort the connection: a TCP reset, whatever is still unsent lost.
        """
        self._closing = True
        ITCPTransport(self._request.transport).abortConnection()

    def _close(self) -> None:
        """
        Close the connection once everything written so far is sent, with
        the answer unfinished (no terminating chunk).
        """
        self._closing = True
        if self._player is not None:
            self._request.unregisterProducer()
        self._request.loseConnection()

    # Playing the script

    def start(self) -> None:
        if self._script.delay > 0:
            self._pending = self._reactor.callLater(self._script.delay, self._answer)
        else:
            self._answer()

    def _answer(self) -> None:
        self._pending = None
        if self._gone:
            return
        kind = self._script.kind
        if kind == "reset":
            self._reset()
        elif kind == "status":
            self._answerError()
        elif kind == "not-json":
            self._answerNotJSON()
        elif self._stream:
            self._answerStream()
        else:
            self._answerWhole()

    def _startAnswer(self, status: int, contentType: bytes) -> None:
        _setStatus(self._request, status)
        self._request.setHeader(b"content-type", contentType)
        self._request.setHeader(b"x-request-id", b"req_scripted_%d" % self._record.number)
        self._record.status = status

    def _answerError(self) -> None:
        status = self._script.count
        errorType, code = _ERROR_KINDS.get(
            status, ("server_error" if status >= 500 else "invalid_request_error", None)
        )
        self._startAnswer(status, b"application/json")
        if self._script.retryAfter is not None:
            self._request.setHeader(b"retry-after", str(self._script.retryAfter).encode())
        message = f"Scripted error {status} for model {self._model!r}."
        body = _errorBody(message, errorType, code)
        self._request.setHeader(b"content-length", b"%d" % len(body))
        self._request.write(body)
        self._request.finish()

    def _answerNotJSON(self) -> None:
        if self._stream:
            self._startAnswer(200, b"text/event-stream")
            self._writeEvent(b"data: " + _NOT_JSON + b"\n\n")
            self._writeEvent(b"data: [DONE]\n\n")
        else:
            self._startAnswer(200, b"application/json")
            self._request.write(_NOT_JSON)
        self._request.finish()

    def _content(self) -> tuple[list[str], int]:
        """
        The answer's content as its stream deltas, and the prompt tokens.
        """
        content, promptTokens = echoContent(self._body)
        kind, count = self._script.kind, self._script.count
        if kind == "events":
            filler = "x" * (EVENT_CONTENT_SIZE - 14)
            return [f"event {index:06d} {filler} " for index in range(count)], promptTokens
        if kind == "bytes":
            text = "y" * count
            size = BYTES_DELTA_SIZE
            return [text[start : start + size] for start in range(0, count, size)], promptTokens
        extracted = extractionContent(self._body)
        if extracted is not None:
            return [extracted], promptTokens
        return re.findall(r"\S+\s*", content), promptTokens

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
        completion: dict[str, object] = {
            "id": self._completionID,
            "object": "chat.completion",
            "created": self._created,
            "model": self._model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content, "refusal": None},
                    "logprobs": None,
                    "finish_reason": "stop",
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

    def _writeWhole(self, answer: bytes) -> None:
        kind = self._script.kind
        if kind == "never-ending":
            # JSON allows any amount of leading whitespace: bytes keep
            # coming and the document never completes.
            self._play(itertools.repeat(b" "), self._script.gap or NEVER_ENDING_INTERVAL, None)
            return
        if kind in ("close-mid-stream", "stall-stream"):
            self._request.write(answer[: len(answer) // 2])
            if kind == "close-mid-stream":
                self._close()
            return
        self._request.write(answer)
        self._request.finish()

    def _chunk(self, delta: dict[str, str], finishReason: str | None = None) -> bytes:
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
        yield self._chunk({"role": "assistant", "content": ""})
        content = []
        for delta in deltas:
            content.append(delta)
            yield self._chunk({"content": delta})
        yield self._chunk({}, finishReason="stop")
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

    def _answerStream(self) -> None:
        self._startAnswer(200, b"text/event-stream")
        self._request.setHeader(b"cache-control", b"no-cache")
        self._afterHold(self._writeStream)

    def _afterHold(self, writeBody: Callable[[], None]) -> None:
        """
        Write the body now, or with C{hold}, send the headers now and the
        body once the hold is over.
        """
        if self._script.hold <= 0:
            writeBody()
            return
        self._request.write(b"")

        def afterHold() -> None:
            self._pending = None
            if not self._gone:
                writeBody()

        self._pending = self._reactor.callLater(self._script.hold, afterHold)

    def _writeStream(self) -> None:
        deltas, promptTokens = self._content()
        kind = self._script.kind
        gap = self._script.gap or 0.0
        events: Iterator[bytes]
        if kind == "never-ending":
            ticks = (f"tick{index} " for index in itertools.count())
            events = self._streamEvents(ticks, promptTokens)
            self._play(events, self._script.gap or NEVER_ENDING_INTERVAL, None)
        elif kind == "close-mid-stream":
            events = itertools.islice(self._streamEvents(deltas, promptTokens), 3)
            self._play(events, gap, self._close)
        elif kind == "stall-stream":
            events = itertools.islice(self._streamEvents(deltas, promptTokens), 1)
            self._play(events, gap, lambda: None)
        else:
            self._play(self._streamEvents(deltas, promptTokens), gap, self._finishStream)

    def _finishStream(self) -> None:
        self._request.unregisterProducer()
        self._request.finish()

    def _writeEvent(self, event: bytes) -> None:
        self._record.eventsSent += 1
        self._request.write(event)

    def _play(self, events: Iterator[bytes], gap: float, onEnd: Callable[[], None] | None) -> None:
        """
        Write C{events} through a L{_StreamPlayer}, then C{onEnd} (never,
        when L{None}: the events do not end).
        """
        write = self._writeEvent if self._stream else self._request.write
        self._player = _StreamPlayer(self._reactor, write, events, gap, onEnd or (lambda: None))
        self._request.registerProducer(self._player, True)
        self._player.start()


class _EmbeddingsAnswer(_Answer):
    """
    The answer to one embeddings request: the script's delivery (and
    faults) as for a non-streaming chat completion, the whole answer an
    embeddings list (see "Embeddings" in the module's docstring).
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


class UpstreamResource(Resource):
    """
    The API port's one resource: chat completions, embeddings and models
    under any prefix, every request recorded.
    """

    isLeaf = True

    def __init__(
        self,
        reactor: IReactorTime,
        clock: Callable[[], float],
        apiKey: str | None,
        embeddingDimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
    ) -> None:
        super().__init__()
        self._reactor = reactor
        self._clock = clock
        self._apiKey = apiKey
        self._embeddingDimensions = embeddingDimensions
        self.records: list[RequestRecord] = []
        self._numbers = itertools.count(1)

    def render(self, request: Request) -> bytes | int:
        record = self._record(request)
        path = request.path
        if path.endswith((b"/chat/completions", b"/embeddings")):
            allowed = b"POST"
        elif path.endswith(b"/models"):
            allowed = b"GET"
        else:
            return self._error(request, record, 404, f"Unknown path {record.path}.", "unknown_url")
        if request.method != allowed:
            request.setHeader(b"allow", allowed)
            return self._error(request, record, 405, f"Use {allowed.decode()} here.", None)
        if self._apiKey is not None:
            expected = f"Bearer {self._apiKey}".encode()
            if request.getHeader(b"authorization") != expected:
                return self._error(
                    request, record, 401, "Incorrect API key provided.", "invalid_api_key"
                )
        if allowed == b"GET":
            return self._models(request, record)
        if path.endswith(b"/embeddings"):
            return self._embeddings(request, record)
        return self._chatCompletion(request, record)

    def _record(self, request: Request) -> RequestRecord:
        raw = request.content.read() if request.content is not None else b""
        body: object = None
        bodyText: str | None = None
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            bodyText = raw.decode("utf-8", errors="replace")
        peer = request.getClientAddress()
        record = RequestRecord(
            number=next(self._numbers),
            method=request.method.decode("ascii", errors="replace"),
            path=request.path.decode("utf-8", errors="replace"),
            query=request.uri.partition(b"?")[2].decode("utf-8", errors="replace"),
            headers=[
                (name.decode("latin-1").lower(), value.decode("latin-1"))
                for name, values in request.requestHeaders.getAllRawHeaders()
                for value in values
            ],
            body=body,
            bodyText=bodyText,
            bodyLength=len(raw),
            clientPort=getattr(peer, "port", None),
            arrived=self._clock(),
        )
        self.records.append(record)

        def ended(result: Failure | None) -> None:
            record.ended = self._clock()
            record.outcome = "clientGone" if isinstance(result, Failure) else "finished"

        request.notifyFinish().addBoth(ended)
        return record

    def _error(
        self,
        request: Request,
        record: RequestRecord,
        status: int,
        message: str,
        code: str | None,
    ) -> bytes:
        _setStatus(request, status)
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"x-request-id", b"req_scripted_%d" % record.number)
        record.status = status
        return _errorBody(message, "invalid_request_error", code)

    def _models(self, request: Request, record: RequestRecord) -> bytes:
        names = ["echo", "slow:500", "status:429", "close-mid-stream", "never-ending"]
        models = [
            {"id": name, "object": "model", "created": 0, "owned_by": "svc-tests"} for name in names
        ]
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"x-request-id", b"req_scripted_%d" % record.number)
        record.status = 200
        return json.dumps({"object": "list", "data": models}).encode()

    def _chatCompletion(self, request: Request, record: RequestRecord) -> bytes | int:
        if not isinstance(record.body, dict):
            message = "We could not parse the JSON body of your request."
            return self._error(request, record, 400, message, None)
        model = record.body.get("model")
        if not isinstance(model, str):
            return self._error(request, record, 400, "You must provide a model parameter.", None)
        try:
            script = parseScript(model)
            if script.vectors is not None:
                raise ScriptError("vectors is for embeddings")
            if script.capFactor:
                counts = capUsage(record.body, record.bodyLength, script.capFactor)
                script = attrs.evolve(script, counts=counts)
        except ScriptError as error:
            return self._error(request, record, 400, f"Bad script {model!r}: {error}", None)
        answer = _Answer(self._reactor, self._clock, request, record, script, record.number)
        answer.start()
        return NOT_DONE_YET

    def _embeddings(self, request: Request, record: RequestRecord) -> bytes | int:
        body = record.body
        if not isinstance(body, dict):
            message = "We could not parse the JSON body of your request."
            return self._error(request, record, 400, message, None)
        model = body.get("model")
        if not isinstance(model, str):
            return self._error(request, record, 400, "You must provide a model parameter.", None)
        try:
            script = parseScript(model)
            if script.kind in ("events", "bytes"):
                raise ScriptError(f"{script.kind} is for chat completions")
            if script.capFactor:
                counts = (record.bodyLength * script.capFactor, 0)
                script = attrs.evolve(script, counts=counts)
            inputs = _embeddingInputs(body.get("input"))
            dimensions = _embeddingDimensions(body.get("dimensions"), self._embeddingDimensions)
            encoding = body.get("encoding_format") or "float"
            if encoding not in ("float", "base64"):
                raise ScriptError(f"encoding_format must be float or base64, not {encoding!r}")
        except ScriptError as error:
            return self._error(request, record, 400, f"Bad request for {model!r}: {error}", None)
        answer = _EmbeddingsAnswer(
            self._reactor,
            self._clock,
            request,
            record,
            script,
            record.number,
            inputs,
            dimensions,
            encoding,
        )
        answer.start()
        return NOT_DONE_YET


def _embeddingInputs(value: object) -> list[str]:
    """
    The inputs of an embeddings request: a string, or an array of strings.

    @raise ScriptError: for anything else (token arrays included).
    """
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return list(value)
    raise ScriptError("input must be a string or a non-empty array of strings")


def _embeddingDimensions(value: object, default: int) -> int:
    if value is None:
        return default
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 1 <= value <= MAX_EMBEDDING_DIMENSIONS
    ):
        raise ScriptError(
            f"dimensions must be a whole number from 1 to {MAX_EMBEDDING_DIMENSIONS}, not {value!r}"
        )
    return value


class ControlResource(Resource):
    """
    The control port's resource: the request log and connection counts.
    """

    isLeaf = True

    def __init__(self, upstream: UpstreamResource, connections: CountingFactory) -> None:
        super().__init__()
        self._upstream = upstream
        self._connections = connections

    def render(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        route = (request.method, request.path)
        if route == (b"GET", b"/_upstream/requests"):
            return json.dumps([record.asJSON() for record in self._upstream.records]).encode()
        if route == (b"DELETE", b"/_upstream/requests"):
            self._upstream.records.clear()
            return b"{}"
        if route == (b"GET", b"/_upstream/connections"):
            counts = {
                "open": len(self._connections.protocols),
                "accepted": self._connections.accepted,
            }
            return json.dumps(counts).encode()
        request.setResponseCode(404)
        return _errorBody("No such control route.", "invalid_request_error", None)


class CountingFactory(WrappingFactory):
    """
    Wraps the API port's site to count its connections: C{protocols} holds
    the open ones, C{accepted} counts every one since the start.
    """

    noisy = False

    def __init__(self, wrappedFactory: Site) -> None:
        super().__init__(wrappedFactory)
        self.accepted = 0

    def registerProtocol(self, p: ProtocolWrapper) -> None:
        self.accepted += 1
        super().registerProtocol(p)


class QuietSite(Site):
    """
    A site that writes no access log: the server logs nothing but errors.
    """

    noisy = False

    def log(self, request: HTTPRequest) -> None:
        pass


def _portOf(listening: IListeningPort) -> int:
    address = listening.getHost()
    assert isinstance(address, IPv4Address)
    return address.port


async def serve(
    reactor: IReactorTCP,
    clock: Callable[[], float],
    port: int,
    controlPort: int,
    portFile: Path,
    apiKey: str | None,
    embeddingDimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
) -> None:
    """
    Listen on 127.0.0.1 (API and control ports), write the ports to
    C{portFile} (atomically: a reader never sees half of it), and run until
    the reactor stops.
    """
    upstream = UpstreamResource(IReactorTime(reactor), clock, apiKey, embeddingDimensions)
    apiFactory = CountingFactory(QuietSite(upstream))
    control = QuietSite(ControlResource(upstream, apiFactory))
    # listenTCP rather than an endpoint: endpoints import TLS, which would
    # double the time this process takes to start. (Twisted's annotation of
    # listenTCP wants a factory generic in its protocol, which neither
    # WrappingFactory nor Site is.)
    listening = reactor.listenTCP(port, apiFactory, interface=LOOPBACK)  # type: ignore[arg-type]
    controlListening = reactor.listenTCP(
        controlPort,
        control,  # type: ignore[arg-type]
        interface=LOOPBACK,
    )
    ports = {"port": _portOf(listening), "controlPort": _portOf(controlListening)}
    temporary = portFile.with_name(portFile.name + ".tmp")
    temporary.write_text(json.dumps(ports))
    os.replace(temporary, portFile)
    await Deferred()


def main(argv: Sequence[str] | None = None) -> None:
    """
    The command line: C{python -m svcd.testing.upstream --port 0
    --port-file PATH [--control-port 0] [--api-key KEY]
    [--embedding-dimensions N]}.
    """
    parser = argparse.ArgumentParser(
        prog="python -m svcd.testing.upstream",
        description="A scripted OpenAI-compatible upstream for the tests.",
    )
    parser.add_argument("--port", type=int, default=0, help="API port (0: any free one)")
    parser.add_argument("--control-port", type=int, default=0, help="control port (0: any)")
    parser.add_argument("--port-file", type=Path, required=True, help="where to write the ports")
    parser.add_argument("--api-key", default=None, help="the key expected as Bearer token")
    parser.add_argument(
        "--embedding-dimensions",
        type=int,
        choices=range(1, MAX_EMBEDDING_DIMENSIONS + 1),
        default=DEFAULT_EMBEDDING_DIMENSIONS,
        metavar="N",
        help="the length of embeddings when a request names none"
        f" (default {DEFAULT_EMBEDDING_DIMENSIONS})",
    )
    arguments = parser.parse_args(argv)
    errorsOnly = LogLevelFilterPredicate(defaultLogLevel=LogLevel.error)
    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(textFileLogObserver(sys.stderr), [errorsOnly])],
        redirectStandardIO=False,
    )

    # react imports the global reactor, when called: this is the process's
    # entry point, the one place that may (as svcd/*/tap.py do for twistd).
    react(
        lambda reactor: ensureDeferred(
            serve(
                reactor,
                time.monotonic,
                arguments.port,
                arguments.control_port,
                arguments.port_file,
                arguments.api_key,
                arguments.embedding_dimensions,
            )
        )
    )


# The client side, for the tests.


@attrs.frozen
class RecordedRequest:
    """
    One entry of the scripted upstream's request log (the module's
    docstring says what each field holds).
    """

    number: int
    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: Any
    bodyText: str | None
    bodyLength: int
    clientPort: int | None
    arrived: float
    ended: float | None
    outcome: str | None
    status: int | None
    eventsSent: int

    @classmethod
    def fromJSON(cls, entry: dict[str, Any]) -> RecordedRequest:
        headers = tuple((name, value) for name, value in entry["headers"])
        return cls(**(entry | {"headers": headers}))

    def header(self, name: str) -> str | None:
        """
        The value of header C{name} (any case), the first when repeated, or
        L{None} when the request had none.
        """
        values = self.headerValues(name)
        return values[0] if values else None

    def headerValues(self, name: str) -> list[str]:
        return [value for header, value in self.headers if header == name.lower()]


@attrs.frozen
class ConnectionCounts:
    """
    The API port's TCP connections: open now, and accepted since the start.
    """

    open: int
    accepted: int


class UpstreamError(Exception):
    """
    The scripted upstream could not be started, or did not answer its
    control port; the message says why, with the end of its stderr.
    """


# Scripted upstreams started and not yet stopped, for the exit handler.
_running: set[ScriptedUpstream] = set()


@atexit.register
def _stopEverything() -> None:
    """
    Stop every scripted upstream this process started and did not stop,
    so that an interrupted test run leaves no server behind.
    """
    for upstream in list(_running):
        with contextlib.suppress(Exception):
            upstream.stop()
    _running.clear()


class ScriptedUpstream:
    """
    The scripted upstream run as a child process with the current
    interpreter, and a blocking client of its control port.

    Usage::

        upstream = ScriptedUpstream(tmp_path).start()
        client = openai.OpenAI(base_url=upstream.baseURL, api_key="x")
        ...
        assert upstream.requests()[0].body["model"] == "echo"
        upstream.stop()
    """

    def __init__(
        self,
        baseDirectory: Path | None = None,
        apiKey: str | None = None,
        embeddingDimensions: int | None = None,
    ) -> None:
        """
        @param baseDirectory: where the port file and C{upstream.log} (the
            process's stderr) go; a new temporary directory when L{None}.
        @param apiKey: when given, the key every API request must carry as
            C{Authorization: Bearer <key>}.
        @param embeddingDimensions: the length of embeddings when a request
            names none; L{DEFAULT_EMBEDDING_DIMENSIONS} when L{None}.
        """
        self.embeddingDimensions = embeddingDimensions
        if baseDirectory is None:
            baseDirectory = Path(tempfile.mkdtemp(prefix="scripted-upstream-"))
        self.baseDirectory = Path(os.path.abspath(baseDirectory))
        self.apiKey = apiKey
        self._process: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._controlPort: int | None = None

    @property
    def logFile(self) -> Path:
        return self.baseDirectory / "upstream.log"

    @property
    def _portFile(self) -> Path:
        return self.baseDirectory / "upstream.ports"

    @property
    def port(self) -> int:
        """
        The API port.

        @raise UpstreamError: when the server is not started.
        """
        if self._port is None:
            raise UpstreamError("the scripted upstream is not started")
        return self._port

    @property
    def host(self) -> str:
        return LOOPBACK

    @property
    def baseURL(self) -> str:
        """
        The base URL to configure as a provider's C{base_url}, or to give
        the C{openai} SDK: C{http://127.0.0.1:<port>/v1}.
        """
        return self.baseURLUnder("")

    def baseURLUnder(self, prefix: str) -> str:
        """
        A base URL under another prefix on the same server, such as
        C{http://127.0.0.1:<port>/other/v1} for C{prefix="other"}: a second
        provider whose requests the log tells apart by C{path}.
        """
        prefix = prefix.strip("/")
        return f"http://{LOOPBACK}:{self.port}{'/' + prefix if prefix else ''}/v1"

    @property
    def isRunning(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> ScriptedUpstream:
        """
        Start the server and return once it listens.

        @raise UpstreamError: when it exits or writes no port file within
            C{timeout}.
        """
        if self.isRunning:
            return self
        self.baseDirectory.mkdir(parents=True, exist_ok=True)
        self._portFile.unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            "svcd.testing.upstream",
            "--port",
            "0",
            "--port-file",
            str(self._portFile),
        ]
        if self.apiKey is not None:
            command += ["--api-key", self.apiKey]
        if self.embeddingDimensions is not None:
            command += ["--embedding-dimensions", str(self.embeddingDimensions)]
        with self.logFile.open("ab") as log:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                cwd=self.baseDirectory,
            )
        _running.add(self)
        process = self._process
        deadline = time.monotonic() + timeout
        while not self._portFile.exists():
            if process.poll() is not None or time.monotonic() >= deadline:
                self.stop()
                raise UpstreamError(
                    f"the scripted upstream did not start within {timeout:.0f} s; "
                    f"its stderr ({self.logFile}):\n{self.output()}"
                )
            time.sleep(0.02)
        ports = json.loads(self._portFile.read_text())
        self._port, self._controlPort = ports["port"], ports["controlPort"]
        return self

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
        """
        Stop the server (SIGTERM, then SIGKILL after C{timeout}) and wait
        until it has exited.
        """
        _running.discard(self)
        process = self._process
        self._process = None
        self._port = self._controlPort = None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def output(self) -> str:
        """
        What the server wrote on stderr: nothing unless something failed.
        """
        return self.logFile.read_text(errors="replace") if self.logFile.exists() else ""

    def _control(self, method: str, path: str) -> Any:
        if self._controlPort is None:
            raise UpstreamError("the scripted upstream is not started")
        request = urllib.request.Request(
            f"http://{LOOPBACK}:{self._controlPort}{path}", method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=10.0) as answer:
                return json.loads(answer.read())
        except OSError as error:
            raise UpstreamError(f"{method} {path} failed: {error}\n{self.output()}") from error

    def requests(self) -> list[RecordedRequest]:
        """
        Every request the API port received since the start or the last
        L{clearRequests}, oldest first, as they stand now.
        """
        return [
            RecordedRequest.fromJSON(entry) for entry in self._control("GET", "/_upstream/requests")
        ]

    def clearRequests(self) -> None:
        self._control("DELETE", "/_upstream/requests")

    def connections(self) -> ConnectionCounts:
        counts = self._control("GET", "/_upstream/connections")
        return ConnectionCounts(open=counts["open"], accepted=counts["accepted"])

    def waitForRequests(
        self,
        condition: Callable[[list[RecordedRequest]], bool],
        timeout: float = 5.0,
    ) -> list[RecordedRequest]:
        """
        Poll the request log until C{condition} holds for it, and return it.

        @raise AssertionError: when it does not hold within C{timeout}; the
            message shows the log as it last was.
        """
        deadline = time.monotonic() + timeout
        while True:
            requests = self.requests()
            if condition(requests):
                return requests
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"the upstream's request log did not reach the expected state within "
                    f"{timeout} s: {requests}"
                )
            time.sleep(0.02)

    def waitUntilEnded(self, count: int = 1, timeout: float = 5.0) -> list[RecordedRequest]:
        """
        Wait until the log holds at least C{count} requests and every one
        has ended (finished, its client gone, or aborted); return the log.
        """
        return self.waitForRequests(
            lambda requests: (
                len(requests) >= count and all(request.ended is not None for request in requests)
            ),
            timeout,
        )


# The length of memoryProvidersFile's embedding model's vectors: the
# upstream that serves it must be started with it (embeddingDimensions),
# since a vector of another length than the model's declared dimensions is
# the provider's fault (decisions D13 amended).
MEMORY_EMBEDDING_DIMENSIONS = 256

MEMORY_PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[models]]
name = "extractor"
provider = "scripted"
upstream_model = "{extractor}"
price = {{ input = "1.00", output = "2.00" }}

[[models]]
name = "embedder"
provider = "scripted"
upstream_model = "{embedder}"
kind = "embedding"
dimensions = {dimensions}
price = {{ input = "0.02" }}

[memory]
embedding_model = "embedder"
{extraction}
dedupe_score = 0.92
"""


def memoryProvidersFile(
    path: Path,
    upstream: ScriptedUpstream,
    extractor: str = "echo",
    extraction: bool = True,
    embedder: str = "echo",
) -> Path:
    """
    A providers file of priced scripted models for memory (svc-worker's
    tests and bench/worker_drain.py): an embedding model of 256 dimensions
    (L{MEMORY_EMBEDDING_DIMENSIONS}, which C{upstream} must have been
    started with) answering as C{embedder} and, unless C{extraction} is
    false, an extraction model answering as C{extractor} (scripts of this
    module).

    256 and not fewer: the scripted embedding is a hashed bag of words, and
    the tests' facts share most of their words ("My fact number 0 is
    <id>-0."). In 64 dimensions two such facts of different requests came
    out at or above C{dedupe_score} by hash collisions about once in 5,000
    sets of 16 facts, and the worker rightly merged them, failing a test by
    chance; in 256 the highest similarity in 50,000 sets was 0.87. Such a
    collision is between the two requests' ids, whose words both of a
    request's facts share, so it often merged both facts of one request
    into the other's at once (3 of the 5 pairs of requests that came out
    that near in 30,000 sets of 8 at 64 dimensions, both facts at one
    score): what the earlier failure of test_sigtermFinishesWhatItHolds
    left (both facts of one observation missing, the other's there once).
    """
    path.write_text(
        MEMORY_PROVIDERS.format(
            base=upstream.baseURL,
            dimensions=MEMORY_EMBEDDING_DIMENSIONS,
            extractor=extractor,
            embedder=embedder,
            extraction='extraction_model = "extractor"' if extraction else "",
        )
    )
    return path


if __name__ == "__main__":
    main()
