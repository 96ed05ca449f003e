"""
The tokens a provider counted for one answer (L{Usage}, decisions D12):
read from its answer by the providers' client, settled against a
reservation by the limits, counted in a ledger row's charge.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Usage:
    """
    Tokens the upstream counted for one answer.

    C{promptTokens} is every input token: those neither read from nor
    written to the provider's cache, C{cachedTokens} (the reads) and
    C{cacheWriteTokens} (the writes, decisions D14), each priced apart
    (L{svcd.metering.prices.Price.cost}).
    """

    promptTokens: int
    completionTokens: int
    # Parts of those (decisions D12): the prompt's tokens served from the
    # provider's cache, the answer's reasoning tokens.
    cachedTokens: int = 0
    reasoningTokens: int = 0
    cacheWriteTokens: int = 0
