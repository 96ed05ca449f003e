"""
What a request learns on its way through svc-proxy, in shapes every stage
may share: who calls (L{TokenInfo}, L{AgentInfo}, from validation) and what
its provider answered (L{Usage}, L{UpstreamRecord}, from forwarding).

A leaf module on purpose: it imports nothing of the proxy, so the edge's
request context can name these shapes without importing the auth client
or the forwarder, and each stage stays importable (and testable) alone.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class TokenInfo:
    """
    What ValidateToken vouches for; C{orgID} is a canonical lowercase UUID.
    """

    orgID: str
    permissions: int
    agentID: str | None = None
    userID: str | None = None
    tokenID: str | None = None
    expiresAt: str | None = None


@attrs.frozen
class AgentInfo:
    """
    The verified agent record the proxy keeps for a request (spec 2).
    """

    agentID: str
    orgID: str
    status: str


@attrs.frozen
class Usage:
    """
    Tokens the upstream counted for one answer.
    """

    promptTokens: int
    completionTokens: int


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


@attrs.frozen
class Limits:
    """
    One limits row of an organization or of one of its agents (decisions
    D11): each value a positive integer, or None when unset.
    """

    rpm: int | None = None
    tpm: int | None = None
    maxOutputTokens: int | None = None
    version: int = 0


@attrs.frozen
class Reservation:
    """
    The tokens an admitted request reserved (decisions D11), and the
    counters that hold them until it is settled.
    """

    keys: tuple[str, ...]
    tokens: int
