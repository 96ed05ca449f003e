"""
What a provider's answer leaves behind: the tokens it counted (L{Usage})
and what the access log says of the call (L{UpstreamRecord}).

A leaf module on purpose: it imports nothing of the gateway, so the
ledger's rows, the proxy's request context and the metrics of any daemon
can name these shapes without importing the client that fills them.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Usage:
    """
    Tokens the upstream counted for one answer.
    """

    promptTokens: int
    completionTokens: int
    # Parts of those (decisions D12): the prompt's tokens served from the
    # provider's cache, the answer's reasoning tokens.
    cachedTokens: int = 0
    reasoningTokens: int = 0


@attrs.define
class UpstreamRecord:
    """
    What the access log says of the forwarding: filled as it goes.
    """

    provider: str | None = None
    model: str | None = None
    upstreamModel: str | None = None
    upstreamMilliseconds: float | None = None
    usage: Usage | None = None
    # A stream the provider broke (or a fault of ours ended) after the
    # client had its first bytes: the answer ended with an error event,
    # not as it should (decisions D12's outcome upstream_error).
    brokenMidStream: bool = False
