"""
What a provider's answer leaves behind for the access log
(L{UpstreamRecord}): where it went, how long it took, and the tokens it
counted (L{svcd.metering.usage.Usage}).

A leaf module on purpose: it imports nothing of the gateway but the
floor's values, so the proxy's request context and the metered call can
name this shape without importing the client that fills it.
"""

from __future__ import annotations

import attrs

from svcd.metering.usage import Usage


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
    # Decisions D14: the last attempt's Anthropic provider said it was
    # overloaded (its 529, or an overloaded_error): a client of Anthropic's
    # dialect is told overloaded_error rather than api_error.
    overloaded: bool = False
    # Decisions D15: the deployment of the last try (its name among its
    # model's deployments), and how many tries the request made.
    deployment: str | None = None
    tries: int = 0
