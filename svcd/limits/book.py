"""
The limits rows of every organization and agent, as this proxy knows them
(decisions D11), with their budgets (decisions D12) and memory settings
(decisions D13).

Where they come from: with the validation cache on, svc-auth's change feed
sends every row at the start of a stream and each set, change or clear
after it, so the book is exact within a second, under load, whatever the
requests. While the feed is not live (or the cache is off, so there is no
feed), every request is validated over gRPC (D8), and each answer carries
its organization's row (ValidateToken) or its agent's (ValidateAgent): the
book learns from those instead. It never learns from an answer while the
feed is live, so an answer read before a change cannot undo it.

What applies to a request: its organization's row (whose C{rpm} wins over
the environment's C{SVC_RATE_LIMIT_ORG_OVERRIDES} and
C{SVC_RATE_LIMIT_DEFAULT_RPM}) and its agent's row, on top (L{Applicable});
and whether memory is recalled for it and how it is observed
(L{LimitBook.memoryFor}): its agent's setting, else its organization's,
else off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import attrs

from svcd.limits.records import (
    OBSERVE_ALL,
    OBSERVE_OFF,
    OBSERVE_ON,
    Budget,
    Limits,
    MemorySettings,
)


@attrs.frozen
class LimitsRow:
    """
    One limits row as the feed carries it: C{agentID} None for the
    organization's own; C{limits} None when it was cleared.
    """

    orgID: str
    agentID: str | None
    limits: Limits | None


@attrs.frozen
class BudgetRow:
    """
    One budget as the feed carries it (decisions D12): C{agentID} None for
    the organization's own; C{budget} None when it was cleared.
    """

    orgID: str
    agentID: str | None
    budget: Budget | None


@attrs.frozen
class MemorySettingsRow:
    """
    The memory settings of an organization or agent as the feed carries
    them (decisions D13): C{agentID} None for the organization's own;
    C{settings} None when there is no row.
    """

    orgID: str
    agentID: str | None
    settings: MemorySettings | None


# What the feed fills the book with.
BookRow = LimitsRow | BudgetRow | MemorySettingsRow


@attrs.frozen
class Applicable:
    """
    The rows and budgets that apply to one request.
    """

    org: Limits | None
    agent: Limits | None
    orgBudget: Budget | None = None
    agentBudget: Budget | None = None

    @property
    def tokenLimited(self) -> bool:
        """
        Whether a token limit applies (then forwarded requests reserve).
        """
        return any(row is not None and row.tpm is not None for row in (self.org, self.agent))

    @property
    def budgeted(self) -> bool:
        """
        Whether a budget applies (then forwarded requests reserve their
        worst-case cost, and a model without a price is refused).
        """
        return self.orgBudget is not None or self.agentBudget is not None

    @property
    def maxOutputTokens(self) -> int | None:
        """
        The output cap assumed when the request names none: the agent's,
        else its organization's (the model's comes after, in the edge).
        """
        for row in (self.agent, self.org):
            if row is not None and row.maxOutputTokens is not None:
                return row.maxOutputTokens
        return None


NO_LIMITS = Applicable(None, None)

# memoryFor's answers, (recall, observe mode), made once and indexed by the
# switch and the mode, so that a lookup makes no tuple.
MEMORY_OFF = (False, OBSERVE_OFF)
_MEMORY_ANSWERS = (
    {OBSERVE_OFF: MEMORY_OFF, OBSERVE_ON: (False, OBSERVE_ON), OBSERVE_ALL: (False, OBSERVE_ALL)},
    {
        OBSERVE_OFF: (True, OBSERVE_OFF),
        OBSERVE_ON: (True, OBSERVE_ON),
        OBSERVE_ALL: (True, OBSERVE_ALL),
    },
)
_Key = TypeVar("_Key", str, tuple[str, str])
_Value = TypeVar("_Value", Limits, Budget, MemorySettings)


def _never() -> bool:
    return False


class LimitBook:
    """
    The limits rows, budgets and memory settings known to this proxy, by
    organization and by (organization, agent); read on every request, so
    a lookup is at most four dict gets (none while the book is empty).

    @ivar feedLive: whether the change feed is live now (then answers are
        not learned from); without a feed, never.
    """

    def __init__(self) -> None:
        self._orgs: dict[str, Limits] = {}
        self._agents: dict[tuple[str, str], Limits] = {}
        self._orgBudgets: dict[str, Budget] = {}
        self._agentBudgets: dict[tuple[str, str], Budget] = {}
        # Decisions D13: by organization, and by organization then agent
        # (no tuple key to make for a lookup). Only rows that set something.
        self._orgMemory: dict[str, MemorySettings] = {}
        self._agentMemory: dict[str, dict[str, MemorySettings]] = {}
        self.feedLive: Callable[[], bool] = _never

    def applicable(self, orgID: str, agentID: str | None) -> Applicable:
        """
        The rows and budgets of C{orgID} and of its agent C{agentID}.
        """
        if not (self._orgs or self._agents or self._orgBudgets or self._agentBudgets):
            return NO_LIMITS
        key = (orgID, agentID) if agentID is not None else None
        org = self._orgs.get(orgID)
        agent = self._agents.get(key) if key is not None else None
        orgBudget = self._orgBudgets.get(orgID)
        agentBudget = self._agentBudgets.get(key) if key is not None else None
        if org is None and agent is None and orgBudget is None and agentBudget is None:
            return NO_LIMITS
        return Applicable(org, agent, orgBudget, agentBudget)

    def memoryFor(self, orgID: str, agentID: str | None) -> tuple[bool, str]:
        """
        Whether memory is recalled for a request of C{orgID} and its agent
        C{agentID}, and how it is observed (decisions D13, and D13 amended
        "Whose words"), as C{(recall, observe)}, C{observe} one of
        L{OBSERVE_MODES}: each the agent's setting, else its
        organization's, else off. Read on every chat request: while no
        organization has a setting, one truth test; otherwise at most
        four dict gets, and never an allocation.
        """
        if not (self._orgMemory or self._agentMemory):
            return MEMORY_OFF
        recall = False
        observe = OBSERVE_OFF
        org = self._orgMemory.get(orgID)
        if org is not None:
            recall = org.recall is True
            if org.observe is not None:
                observe = org.observe
        if agentID is not None:
            agents = self._agentMemory.get(orgID)
            agent = agents.get(agentID) if agents is not None else None
            if agent is not None:
                if agent.recall is not None:
                    recall = agent.recall
                if agent.observe is not None:
                    observe = agent.observe
        return _MEMORY_ANSWERS[recall][observe]

    def __len__(self) -> int:
        return (
            len(self._orgs)
            + len(self._agents)
            + len(self._orgBudgets)
            + len(self._agentBudgets)
            + len(self._orgMemory)
            + sum(len(agents) for agents in self._agentMemory.values())
        )

    # From the change feed.

    def replace(self, rows: Iterable[BookRow]) -> None:
        """
        A feed session began with these rows, budgets and memory settings:
        they are all there is.
        """
        orgs: dict[str, Limits] = {}
        agents: dict[tuple[str, str], Limits] = {}
        orgBudgets: dict[str, Budget] = {}
        agentBudgets: dict[tuple[str, str], Budget] = {}
        orgMemory: dict[str, MemorySettings] = {}
        agentMemory: dict[str, dict[str, MemorySettings]] = {}
        for row in rows:
            if isinstance(row, LimitsRow):
                _set(orgs, agents, row.orgID, row.agentID, row.limits)
            elif isinstance(row, BudgetRow):
                _set(orgBudgets, agentBudgets, row.orgID, row.agentID, row.budget)
            else:
                _setMemory(orgMemory, agentMemory, row.orgID, row.agentID, row.settings)
        self._orgs, self._agents = orgs, agents
        self._orgBudgets, self._agentBudgets = orgBudgets, agentBudgets
        self._orgMemory, self._agentMemory = orgMemory, agentMemory

    def changed(self, row: BookRow) -> None:
        """
        One row, budget or memory settings row was set, changed or cleared.
        """
        if isinstance(row, LimitsRow):
            _set(self._orgs, self._agents, row.orgID, row.agentID, row.limits)
        elif isinstance(row, BudgetRow):
            _set(self._orgBudgets, self._agentBudgets, row.orgID, row.agentID, row.budget)
        else:
            _setMemory(self._orgMemory, self._agentMemory, row.orgID, row.agentID, row.settings)

    # From validation answers.

    def learnOrg(
        self,
        orgID: str,
        limits: Limits | None,
        budget: Budget | None = None,
        memory: MemorySettings | None = None,
    ) -> None:
        """
        ValidateToken answered with these of C{orgID} (None: it has none);
        taken only while the feed is not live.
        """
        if not self.feedLive():
            _put(self._orgs, orgID, limits)
            _put(self._orgBudgets, orgID, budget)
            _setMemory(self._orgMemory, self._agentMemory, orgID, None, memory)

    def learnAgent(
        self,
        orgID: str,
        agentID: str,
        limits: Limits | None,
        budget: Budget | None = None,
        memory: MemorySettings | None = None,
    ) -> None:
        """
        ValidateAgent answered with these of C{agentID}; taken only while
        the feed is not live.
        """
        if not self.feedLive():
            _put(self._agents, (orgID, agentID), limits)
            _put(self._agentBudgets, (orgID, agentID), budget)
            _setMemory(self._orgMemory, self._agentMemory, orgID, agentID, memory)


def _set(
    orgs: dict[str, _Value],
    agents: dict[tuple[str, str], _Value],
    orgID: str,
    agentID: str | None,
    value: _Value | None,
) -> None:
    if agentID is None:
        _put(orgs, orgID, value)
    else:
        _put(agents, (orgID, agentID), value)


def _put(rows: dict[_Key, _Value], key: _Key, value: _Value | None) -> None:
    if value is None:
        rows.pop(key, None)
    else:
        rows[key] = value


def _setMemory(
    orgs: dict[str, MemorySettings],
    agents: dict[str, dict[str, MemorySettings]],
    orgID: str,
    agentID: str | None,
    settings: MemorySettings | None,
) -> None:
    """
    Keep C{settings} of C{(orgID, agentID)}, or forget them when they set
    nothing (no row, or both inherit: the same answer for every lookup,
    and an empty book keeps L{LimitBook.memoryFor}'s shortcut).
    """
    if settings is not None and settings.recall is None and settings.observe is None:
        settings = None
    if agentID is None:
        _put(orgs, orgID, settings)
        return
    ofOrg = agents.get(orgID)
    if settings is not None:
        if ofOrg is None:
            ofOrg = agents[orgID] = {}
        ofOrg[agentID] = settings
    elif ofOrg is not None:
        ofOrg.pop(agentID, None)
        if not ofOrg:
            del agents[orgID]
