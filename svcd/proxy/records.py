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
    # Decisions D12: the worst-case cost (nano-dollars) held against the
    # budgets' counters.
    costKeys: tuple[str, ...] = ()
    cost: int = 0
    # Decisions D12, amended: the ledger row's key (the gateway's UUID v7),
    # under which each budget counter holds this reservation as a member
    # of its own, so that a lost settlement is released and a recorded row
    # is not counted twice (L{svcd.proxy.limits.limiter}). None: a
    # per-key delta, as before.
    ledgerID: str | None = None


# The periods a budget may have (decisions D12).
BUDGET_PERIODS = ("day", "month")


@attrs.frozen
class Budget:
    """
    A budget of an organization or of one of its agents (decisions D12):
    at most C{nanoUSD} nano-dollars in a calendar C{period} (C{"day"} or
    C{"month"}, UTC).
    """

    nanoUSD: int
    period: str
    version: int = 0
