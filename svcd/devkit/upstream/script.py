"""
The grammar of C{model} (the package's manual, "The grammar of C{model}",
says what each directive does): L{parseScript} reads a model into the
L{Script} that an answer plays out.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

# Retry-After of a plain status:429.
DEFAULT_RETRY_AFTER = 7

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
        "error-mid-stream",
        "tool-call",
    }
)
_DELIVERY_DIRECTIVES = frozenset(
    {
        "slow",
        "hold",
        "gap",
        "no-usage",
        "usage",
        "usage-at-cap",
        "usage-over-cap",
        "cache",
        "vectors",
    }
)
# The status of error-mid-stream without one: Anthropic's overloaded_error,
# the error its streams most often end with.
DEFAULT_STREAM_ERROR = 529
# A tool's name, as Anthropic's API allows it (OpenAI's is alike).
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The arguments of the embeddings' directive vectors:<how>.
VECTOR_FAULTS = frozenset({"short", "long", "huge", "nan", "infinity"})
DIRECTIVES = _ANSWER_KINDS | _DELIVERY_DIRECTIVES


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
    @ivar count: the argument of C{events}, C{bytes}, C{status} or
        C{error-mid-stream} (its status).
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
    @ivar cache: the (reads, writes) of C{cache:<reads>:<writes>}: how many
        of the prompt's tokens were read from the cache and written to it
        (L{cacheParts}); L{None} when not given.
    @ivar vectors: the argument of C{vectors:<how>}, or L{None}.
    @ivar tool: the tool a C{tool-call} answer calls: the name it gave, or
        the one the request offers (L{svcd.devkit.upstream.content.toolNameOf});
        L{None} before that is known.
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
    cache: tuple[int, int] | None = None
    vectors: str | None = None
    tool: str | None = None


def _number(directive: str, text: str, low: int, high: int) -> int:
    if not re.fullmatch(r"\d{1,9}", text) or not low <= int(text) <= high:
        raise ScriptError(f"{directive} takes a whole number from {low} to {high}, not {text!r}")
    return int(text)


def parseScript(model: str) -> Script:
    """
    The script a model names (see the package's manual for the grammar).

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
        elif name == "cache":
            if len(arguments) != 2:
                raise ScriptError("cache takes cache:<reads>:<writes>")
            reads, writes = (_number(name, each, 0, 1_000_000_000) for each in arguments)
            fields["cache"] = (reads, writes)
        elif name == "error-mid-stream":
            if len(arguments) > 1:
                raise ScriptError(
                    "error-mid-stream takes at most a status: error-mid-stream:<code>"
                )
            fields["kind"] = name
            fields["count"] = (
                _number(name, arguments[0], 400, 599) if arguments else DEFAULT_STREAM_ERROR
            )
        elif name == "tool-call":
            if len(arguments) > 1 or (arguments and not _TOOL_NAME.fullmatch(arguments[0])):
                raise ScriptError(
                    "tool-call takes at most a tool's name (letters, digits, _ and -):"
                    " tool-call:<name>"
                )
            fields["kind"] = name
            fields["tool"] = arguments[0] if arguments else None
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
    if "cache" in fields and (fields.get("usage") is False or len(fields.get("counts", ())) == 4):
        raise ScriptError("cache contradicts no-usage, and usage's own <cached> count")
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


def cacheParts(script: Script, prompt: int) -> tuple[int, int]:
    """
    The (reads, writes) of a prompt of C{prompt} tokens: C{cache}'s, or
    C{usage}'s C{<cached>} as reads, each at most what is left of the
    prompt (reads first), so that C{usage-at-cap+cache:0:999999999} makes
    the whole prompt cache writes.
    """
    if script.cache is not None:
        reads, writes = script.cache
    elif script.counts is not None and len(script.counts) == 4:
        reads, writes = script.counts[2], 0
    else:
        reads, writes = 0, 0
    reads = min(reads, prompt)
    return reads, min(writes, prompt - reads)
