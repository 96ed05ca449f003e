"""
Prices and costs (decisions D12, D14), in integers only.

A model's price in the providers file is in US dollars per million tokens,
written as decimal strings: C{price = { input = "2.50", output = "10.00",
cached_input = "1.25", cache_write = "3.125" }} (C{cached_input} and
C{cache_write} default to C{input}). Each is read exactly, digit by digit,
into nano-dollars per million tokens (at most 9 decimals: a nano-dollar
per million tokens is the finest price there is); never through a float.

A request's cost is C{(prompt - cached - written) * input + cached *
cached_input + written * cache_write + completion * output}, with
C{cached} the part of the prompt the provider served from its cache
(C{usage.prompt_tokens_details.cached_tokens}, Anthropic's
C{cache_read_input_tokens}), C{written} the part it wrote to its cache
(decisions D14: Anthropic's C{cache_creation_input_tokens}, OpenAI's shape
C{prompt_tokens_details.cache_write_tokens}) and the reasoning tokens
inside C{completion}. Summed in nano-dollars per million tokens, then
divided by a million once, rounding half up, so a request is never more
than half a nano-dollar off.

Each price has a version: the first 16 hex digits of the SHA-256 of its
canonical form (every price in nano-dollars per million, C{cached_input}
made explicit; C{cache_write} only when it is not C{input}, so that every
price written before D14 keeps its version), kept by every ledger row, so
a report can tell which price a row was billed at.
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

    @ivar cacheWrite: the price of a prompt token written to the
        provider's cache (decisions D14); C{input} when not given.
    """

    input: int
    output: int
    cachedInput: int
    cacheWrite: int = attrs.field(default=attrs.Factory(lambda self: self.input, takes_self=True))
    version: str = attrs.field(init=False)

    @version.default
    def _version(self) -> str:
        canonical = f"input={self.input};cached_input={self.cachedInput};output={self.output}"
        if self.cacheWrite != self.input:
            canonical += f";cache_write={self.cacheWrite}"
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:16]

    def cost(self, prompt: int, cached: int, completion: int, cacheWrite: int = 0) -> int:
        """
        The cost in nano-dollars of an answer of these tokens: C{prompt}
        all of them, of which C{cached} read from the provider's cache and
        C{cacheWrite} written to it (neither ever counted past the prompt,
        nor the two together).
        """
        cached = min(max(cached, 0), prompt)
        cacheWrite = min(max(cacheWrite, 0), prompt - cached)
        perMillion = (
            (prompt - cached - cacheWrite) * self.input
            + cached * self.cachedInput
            + cacheWrite * self.cacheWrite
            + completion * self.output
        )
        return (perMillion + TOKENS_PER_PRICE // 2) // TOKENS_PER_PRICE

    def worstCase(self, prompt: int, completion: int) -> int:
        """
        The most a request of C{prompt} tokens and at most C{completion}
        tokens of answer can cost: what a budget reserves at admission.
        Each prompt token may be billed as an input, a cache read or a
        cache write (decisions D14: a provider decides which), so each is
        counted at the dearest of the three.
        """
        perToken = max(self.input, self.cachedInput, self.cacheWrite)
        perMillion = prompt * perToken + completion * self.output
        return (perMillion + TOKENS_PER_PRICE // 2) // TOKENS_PER_PRICE
