"""
What a provider call is charged (decisions D11, D12, D13, D14): the tokens its
ledger row counts, where they came from, and what they cost at its price
(L{Charge}, L{chargeOf}), however the call ended (L{OK},
L{UPSTREAM_ERROR}, L{CLIENT_GONE}).

One rule for every row (a chat completion, an extraction, an embedding),
written once: the row copies it (L{svcd.ledger.rows.usageRow}), and a
chat that recalled memories settles the embedding's charge with its own
(L{svcd.metered.embedder.embeddingCharge}), so that the settlement and
the row can never count the same call differently.
"""

from __future__ import annotations

import attrs

from svcd.metering.prices import Price
from svcd.metering.usage import Usage

# How a call ended (decisions D12): the row's C{outcome}.
OK = "ok"
UPSTREAM_ERROR = "upstream_error"
CLIENT_GONE = "client_gone"
# Where a row's tokens came from: the row's C{tokens_from}.
FROM_PROVIDER = "provider"
FROM_RESERVATION = "reservation"


@attrs.frozen
class Charge:
    """
    The tokens a call's ledger row counts, and their cost.

    @ivar cacheWriteTokens: the prompt's tokens written to the provider's
        cache (decisions D14), part of C{promptTokens} as C{cachedTokens}
        (the reads) are; last, so that rows made before it read the same.
    @ivar tokensFrom: L{FROM_PROVIDER} (its usage, or none after a fault
        before its first byte) or L{FROM_RESERVATION} (the estimate the
        token limits kept).
    @ivar cost: nano-dollars, those tokens at the price (0 without one).
    @ivar priceVersion: the version of that price (empty without one).
    """

    promptTokens: int
    cachedTokens: int
    completionTokens: int
    reasoningTokens: int
    tokensFrom: str
    cost: int
    priceVersion: str
    cacheWriteTokens: int = 0

    @property
    def tokens(self) -> int:
        """
        The tokens a reservation is settled to for this charge.
        """
        return self.promptTokens + self.completionTokens


def chargeOf(
    usage: Usage | None,
    outcome: str,
    estimate: tuple[int, int],
    price: Price | None,
    afterFirstByte: bool = False,
) -> Charge:
    """
    What the row of a call that ended with C{outcome} counts: the
    provider's usage when it came; else, for an answer that failed before
    its first byte, none; else (an answer without usage, a client gone
    before it, a stream that failed C{afterFirstByte}) the reservation's
    C{estimate} (prompt, output cap), as the token limits kept it (D11).
    Its cost is those tokens at C{price}, the price of the model that
    answered.
    """
    if usage is not None:
        prompt, cached = usage.promptTokens, usage.cachedTokens
        completion, reasoning = usage.completionTokens, usage.reasoningTokens
        # The writes, never more than the prompt's tokens that are not
        # reads, as the price counts them (decisions D14).
        written = max(0, min(usage.cacheWriteTokens, prompt - min(max(cached, 0), prompt)))
        tokensFrom = FROM_PROVIDER
    elif outcome == UPSTREAM_ERROR and not afterFirstByte:
        prompt = cached = written = completion = reasoning = 0
        tokensFrom = FROM_PROVIDER
    else:
        (prompt, completion), cached, written, reasoning = estimate, 0, 0, 0
        tokensFrom = FROM_RESERVATION
    return Charge(
        promptTokens=prompt,
        cachedTokens=cached,
        completionTokens=completion,
        reasoningTokens=reasoning,
        tokensFrom=tokensFrom,
        cost=price.cost(prompt, cached, completion, written) if price is not None else 0,
        priceVersion=price.version if price is not None else "",
        cacheWriteTokens=written,
    )
