"""
Token counts in either dialect, and the one record the ledger takes from
both (L{TokenUsage}).

Anthropic counts a prompt in three parts that do not overlap:
C{input_tokens} (neither read from nor written to the cache),
C{cache_read_input_tokens} and C{cache_creation_input_tokens}; OpenAI
counts the whole prompt (C{prompt_tokens}) with the part read from the
cache inside it (C{prompt_tokens_details.cached_tokens}) and, where a
provider says so, the part written to it
(C{prompt_tokens_details.cache_write_tokens}). The record keeps the three
parts apart, so that each is priced at its own rate (decisions D12): the
sums and differences between the shapes are made here only.

A provider's counts are not trusted to be sane: a count that is not a
non-negative integer is taken as absent, and parts are never more than
their whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs


@attrs.frozen
class TokenUsage:
    """
    The tokens of one answer: the prompt in three parts that do not
    overlap, the output, and the reasoning part of the output (when an
    OpenAI-shaped provider tells it).
    """

    inputTokens: int = 0
    cacheReadTokens: int = 0
    cacheWriteTokens: int = 0
    outputTokens: int = 0
    reasoningTokens: int = 0

    @property
    def promptTokens(self) -> int:
        return self.inputTokens + self.cacheReadTokens + self.cacheWriteTokens

    @property
    def completionTokens(self) -> int:
        return self.outputTokens


_NO_TOKENS = TokenUsage()


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def usageOfAnthropic(usage: object, *, before: TokenUsage | None = None) -> TokenUsage | None:
    """
    The counts of Anthropic's C{usage} (of a message, a C{message_start}
    event or a C{message_delta} event), or C{None} when it holds none.

    A C{message_delta}'s counts are totals so far, each optional but
    C{output_tokens}: those it leaves out keep their value in C{before}
    (the counts of C{message_start}), as Anthropic's SDK does.
    """
    if not isinstance(usage, Mapping):
        return None
    # Read on every Anthropic answer and usage event (issue 46's
    # benchmark): the record is built at once, not evolved from a
    # mapping of the counts.
    inputTokens = _count(usage.get("input_tokens"))
    cacheRead = _count(usage.get("cache_read_input_tokens"))
    cacheWrite = _count(usage.get("cache_creation_input_tokens"))
    output = _count(usage.get("output_tokens"))
    if inputTokens is None and cacheRead is None and cacheWrite is None and output is None:
        return None
    base = before if before is not None else _NO_TOKENS
    return TokenUsage(
        inputTokens=base.inputTokens if inputTokens is None else inputTokens,
        cacheReadTokens=base.cacheReadTokens if cacheRead is None else cacheRead,
        cacheWriteTokens=base.cacheWriteTokens if cacheWrite is None else cacheWrite,
        outputTokens=base.outputTokens if output is None else output,
        reasoningTokens=base.reasoningTokens,
    )


def usageOfOpenAI(usage: object) -> TokenUsage | None:
    """
    The counts of OpenAI's C{usage}, or C{None} when it has no prompt and
    completion counts.
    """
    if not isinstance(usage, Mapping):
        return None
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens"))
    if prompt is None or completion is None:
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, Mapping):
        details = {}
    cacheRead = min(_count(details.get("cached_tokens")) or 0, prompt)
    cacheWrite = min(_count(details.get("cache_write_tokens")) or 0, prompt - cacheRead)
    outputDetails = usage.get("completion_tokens_details")
    if not isinstance(outputDetails, Mapping):
        outputDetails = {}
    reasoning = min(_count(outputDetails.get("reasoning_tokens")) or 0, completion)
    return TokenUsage(
        inputTokens=prompt - cacheRead - cacheWrite,
        cacheReadTokens=cacheRead,
        cacheWriteTokens=cacheWrite,
        outputTokens=completion,
        reasoningTokens=reasoning,
    )


def openAIUsage(usage: TokenUsage) -> dict[str, Any]:
    """
    C{usage} in OpenAI's shape: the whole prompt, its cache reads and
    writes among its details.
    """
    shaped: dict[str, Any] = {
        "prompt_tokens": usage.promptTokens,
        "completion_tokens": usage.completionTokens,
        "total_tokens": usage.promptTokens + usage.completionTokens,
        "prompt_tokens_details": {
            "cached_tokens": usage.cacheReadTokens,
            "cache_write_tokens": usage.cacheWriteTokens,
        },
    }
    if usage.reasoningTokens:
        shaped["completion_tokens_details"] = {"reasoning_tokens": usage.reasoningTokens}
    return shaped


def anthropicUsage(usage: TokenUsage) -> dict[str, Any]:
    """
    C{usage} in Anthropic's shape, the prompt in its three parts.
    """
    return {
        "input_tokens": usage.inputTokens,
        "cache_creation_input_tokens": usage.cacheWriteTokens,
        "cache_read_input_tokens": usage.cacheReadTokens,
        "output_tokens": usage.outputTokens,
    }


@attrs.define
class StreamUsage:
    """
    The counts of an Anthropic stream as its events pass (a stream relayed
    as given, or one being translated): C{message_start}'s, then each
    C{message_delta}'s totals over them.
    """

    usage: TokenUsage | None = None

    def observe(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message")
            if isinstance(message, Mapping):
                self.usage = usageOfAnthropic(message.get("usage"))
        elif kind == "message_delta":
            self.usage = usageOfAnthropic(event.get("usage"), before=self.usage) or self.usage
