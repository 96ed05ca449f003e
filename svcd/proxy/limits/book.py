"""
The limits rows of every organization and agent, as this proxy knows them
(decisions D11).

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
C{SVC_RATE_LIMIT_DEFAULT_RPM}) and its agent's row, on top (L{Applicable}).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import attrs

from svcd.proxy.records import Limits


@attrs.frozen
class LimitsRow:
    """
    One row as the feed carries it: C{agentID} None for the organization's
    own; C{limits} None when it was cleared.
    """

    orgID: str
    agentID: str | None
    limits: Limits | None


@attrs.frozen
class Applicable:
    """
    The rows that apply to one request.
    """

    org: Limits | None
    agent: Limits | None

    @property
    def tokenLimited(self) -> bool:
        """
        Whether a token limit applies (then forwarded requests reserve).
        """
        return any(row is not None and row.tpm is not None for row in (self.org, self.agent))

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
_Key = TypeVar("_Key", str, tuple[str, str])


def _never() -> bool:
    return False


class LimitBook:
    """
    The rows known to this proxy, by organization and by (organization,
    agent); read on every limited request, so a lookup is two dict gets.

    @ivar feedLive: whether the change feed is live now (then answers are
        not learned from); without a feed, never.
    """

    def __init__(self) -> None:
        self._orgs: dict[str, Limits] = {}
        self._agents: dict[tuple[str, str], Limits] = {}
        self.feedLive: Callable[[], bool] = _never

    def applicable(self, orgID: str, agentID: str | None) -> Applicable:
        """
        The rows of C{orgID} and of its agent C{agentID}.
        """
        if not self._orgs and not self._agents:
            return NO_LIMITS
        org = self._orgs.get(orgID)
        agent = self._agents.get((orgID, agentID)) if agentID is not None else None
        if org is None and agent is None:
            return NO_LIMITS
        return Applicable(org, agent)

    def __len__(self) -> int:
        return len(self._orgs) + len(self._agents)

    # From the change feed.

    def replace(self, rows: Iterable[LimitsRow]) -> None:
        """
        A feed session began with these rows: they are every row there is.
        """
        orgs: dict[str, Limits] = {}
        agents: dict[tuple[str, str], Limits] = {}
        for row in rows:
            if row.limits is None:
                continue
            if row.agentID is None:
                orgs[row.orgID] = row.limits
            else:
                agents[(row.orgID, row.agentID)] = row.limits
        self._orgs, self._agents = orgs, agents

    def changed(self, row: LimitsRow) -> None:
        """
        One row was set, changed or cleared.
        """
        if row.agentID is None:
            _put(self._orgs, row.orgID, row.limits)
        else:
            _put(self._agents, (row.orgID, row.agentID), row.limits)

    # From validation answers.

    def learnOrg(self, orgID: str, limits: Limits | None) -> None:
        """
        ValidateToken answered with this row of C{orgID} (None: it has
        none); taken only while the feed is not live.
        """
        if not self.feedLive():
            _put(self._orgs, orgID, limits)

    def learnAgent(self, orgID: str, agentID: str, limits: Limits | None) -> None:
        """
        ValidateAgent answered with this row of C{agentID}; taken only
        while the feed is not live.
        """
        if not self.feedLive():
            _put(self._agents, (orgID, agentID), limits)


def _put(rows: dict[_Key, Limits], key: _Key, limits: Limits | None) -> None:
    if limits is None:
        rows.pop(key, None)
    else:
        rows[key] = limits
