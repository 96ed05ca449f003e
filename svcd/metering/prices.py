"""
Prices and costs (decisions D12), in integers only.

A model's price in the providers file is in US dollars per million tokens,
written as decimal strings: C{price = { input = "2.50", output = "10.00",
cached_input = "1.25" }} (C{cached_input} defaults to C{input}). Each is
read exactly, digit by digit, into nano-dollars per million tokens (at
most 9 decimals: a nano-dollar per million tokens is the finest price
there is); never through a float.

A request's cost is C{(prompt - cached) * input + cached * cached_input +
completion * output}, with C{cached} the part of the prompt the provider
served from its cache (C{usage.prompt_tokens_details.cached_tokens}) and
the reasoning tokens inside C{completion}. Summed in nano-dollars per
million tokens, then divided by a million once, rounding half up, so a
request is never more than half a nano-dollar off.

Each price has a version: the first 16 hex digits of the SHA-256 of its
canonical form (every price in nano-dollars per million, C{cached_input}
made explicit), kept by every ledger row, so a report can tell which
price a row was billed at.
"""

from __future__ import annotations

import hashlib

import attrs

from svcd.common.money import MAX_DOLLARS, NANO_PER_DOLLAR, BadDollars, formatDollars, parseDollars

TOKENS_PER_PRICE = 10**6

# A price that is not a decimal string of dollars with at most 9 decimals,
# or past MAX_DOLLARS (the reading itself lives in svcd.common.money, which
# svc-auth's budgets share).
BadPrice = BadDollars

__all__ = [
    "MAX_DOLLARS",
    "NANO_PER_DOLLAR",
    "TOKENS_PER_PRICE",
    "BadPrice",
    "Price",
    "formatDollars",
    "parseDollars",
]


@attrs.frozen
class Price:
    """
    A model's price, each in nano-dollars per million tokens.
    """

    input: int
    output: int
    cachedInput: int
    version: str = attrs.field(init=False)

    @version.default
    def _version(self) -> str:
        canonical = f"input={self.input};cached_input={self.cachedInput};output={self.output}"
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:16]

    def cost(self, prompt: int, cached: int, completion: int) -> int:
        """
        The cost in nano-dollars of an answer of these tokens.
        """
        cached = min(max(cached, 0), prompt)
        perMillion = (
            (prompt - cached) * self.input + cached * self.cachedInput + completion * self.output
        )
        return (perMillion + TOKENS_PER_PRICE // 2) // TOKENS_PER_PRICE

    def worstCase(self, prompt: int, completion: int) -> int:
        """
        The most a request of C{prompt} tokens (none of them cached) and at
        most C{completion} tokens of answer can cost: what a budget
        reserves at admission.
        """
        perMillion = prompt * max(self.input, self.cachedInput) + completion * self.output
        return (perMillion + TOKENS_PER_PRICE // 2) // TOKENS_PER_PRICE
