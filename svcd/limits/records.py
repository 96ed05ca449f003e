"""
The shapes of limits and budgets (decisions D11, D12): the rows the limit
book holds (L{Limits}, L{Budget}, and the memory settings of decisions
D13, L{MemorySettings}) and what an admitted request reserved
(L{Reservation}).

A leaf module on purpose: it imports nothing of the gateway, so the
change feed that fills the book and the edge that settles a reservation
can name these shapes without importing the limiter.
"""

from __future__ import annotations

import attrs


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
    # is not counted twice (L{svcd.limits.limiter}). None: a
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


# Decisions D13 amended, "Whose words": what a chat completion's answer is
# observed for. on: only a request that names a subject
# (X-SVC-Memory-Subject); all: one that names none too, into the agent's
# shared subject ""; off: none.
OBSERVE_ON = "on"
OBSERVE_ALL = "all"
OBSERVE_OFF = "off"
OBSERVE_MODES = (OBSERVE_ON, OBSERVE_ALL, OBSERVE_OFF)


@attrs.frozen
class MemorySettings:
    """
    The memory settings of an organization or of one of its agents
    (decisions D13): C{recall} True (on), False (off) or None (inherit:
    an agent's from its organization's, an organization's from the
    default, off); C{observe} one of L{OBSERVE_MODES} or None (inherit,
    likewise).
    """

    recall: bool | None = None
    observe: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(OBSERVE_MODES))
    )
    version: int = 0
