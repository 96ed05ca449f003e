"""
How many tokens a chat completion reserves at admission (decisions D11).

A token limit must hold before the answer exists, so the request reserves
its worst case when it is admitted and is settled to the provider's usage
when the answer ends. The worst case is the prompt's estimate plus the
output cap:

  - the prompt: the UTF-8 bytes of every message's content, divided by 3
    and rounded up, plus 4 tokens per message (a tokenizer's typical ratio
    for English is 4 bytes per token; 3 errs on the side of reserving
    more, and the 4 per message stand for the role and framing);
  - the output cap: the request's C{max_completion_tokens}, else its
    C{max_tokens}, else the agent's or organization's C{max_output_tokens},
    else the model's in the providers file, else L{DEFAULT_OUTPUT_CAP}.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from svcd.proxy.limits.book import Applicable

DEFAULT_OUTPUT_CAP = 4096
TOKENS_PER_MESSAGE = 4
BYTES_PER_TOKEN = 3


def promptEstimate(messages: Sequence[Mapping[str, Any]]) -> int:
    """
    The prompt's tokens, estimated from its messages' contents.
    """
    contentBytes = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            contentBytes += len(content.encode("utf-8", "surrogatepass"))
    return -(-contentBytes // BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE * len(messages)


def _requested(document: Mapping[str, Any], name: str) -> int | None:
    value = document.get(name)
    # A boolean is an int in Python, never a token count.
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def outputCap(document: Mapping[str, Any], applicable: Applicable, modelCap: int | None) -> int:
    """
    The most tokens the answer may have, as far as the gateway can know.
    """
    for cap in (
        _requested(document, "max_completion_tokens"),
        _requested(document, "max_tokens"),
        applicable.maxOutputTokens,
        modelCap,
    ):
        if cap is not None:
            return cap
    return DEFAULT_OUTPUT_CAP
