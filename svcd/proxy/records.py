"""
Who calls svc-proxy, in shapes every stage may share: what validation
learns of the caller (L{TokenInfo}, L{AgentInfo}). What a provider answered
lives in L{svcd.providers.records}, limits and budgets in
L{svcd.limits.records}, beside the packages that fill them.

A leaf module on purpose: it imports nothing of the proxy, so the edge's
request context can name these shapes without importing the auth client,
and each stage stays importable (and testable) alone.
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
