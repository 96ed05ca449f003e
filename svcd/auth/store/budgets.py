"""
The budgets table (decisions D12): an organization's own budget and its
agents', each at most an amount of nano-dollars in a calendar day or
month; shaped as limits are (L{svcd.auth.store.limits}).
"""

from __future__ import annotations

import uuid
from typing import Any

import attrs

from svcd.auth.store.base import StoreBase, oneRow, optionalRow, rowIs
from svcd.common.pgtransactions import Cursor


@attrs.frozen
class BudgetRecord:
    """
    One budget (decisions D12): of an organization (C{agentID} None) or of
    one of its agents, at most C{nanoUSD} nano-dollars in a calendar
    C{period} (C{"day"} or C{"month"}, UTC); C{version} grows with every
    change of any budget.
    """

    orgID: uuid.UUID
    agentID: uuid.UUID | None
    nanoUSD: int
    period: str
    version: int


BUDGET_PERIODS = ("day", "month")

_BUDGET_COLUMNS = "org_id, agent_id, nano_usd, period, version"


def _budget(row: dict[str, Any]) -> BudgetRecord:
    return BudgetRecord(
        orgID=row["org_id"],
        agentID=row["agent_id"],
        nanoUSD=row["nano_usd"],
        period=row["period"],
        version=row["version"],
    )


class BudgetsStore(StoreBase):
    """
    Budgets (decisions D12, sql/0006_usage.sql), shaped as limits are.
    """

    def allBudgets(self) -> list[BudgetRecord]:
        """
        Every budget of every organization (sql/0006_usage.sql): svc-auth's
        table of budgets is loaded from this.
        """

        def query(cursor: Cursor) -> list[BudgetRecord]:
            cursor.execute(f"SELECT {_BUDGET_COLUMNS} FROM svc_budget_rows()")
            return [_budget(row) for row in cursor.fetchall()]

        return self._run("budgets_all", query)

    def budget(self, orgID: uuid.UUID, agentID: uuid.UUID | None = None) -> BudgetRecord | None:
        """
        The budget of an organization (C{agentID} None) or of one of its
        agents, read in the organization's context; None when there is none.
        """
        condition, parameters = rowIs(orgID, agentID)

        def query(cursor: Cursor) -> BudgetRecord | None:
            cursor.execute(f"SELECT {_BUDGET_COLUMNS} FROM budgets WHERE {condition}", parameters)
            return optionalRow(_budget, cursor.fetchone())

        return self._run("budget_lookup", query, orgID=orgID)

    def setBudget(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None, nanoUSD: int, period: str
    ) -> BudgetRecord:
        """
        Create or replace the budget of an organization (C{agentID} None) or
        of one of its agents; its version is taken anew.

        @raise StoreRejected: the agent is not one of this organization's
            (or the organization does not exist), or the amount or period
            is not one a budget can have.
        """
        target = "(org_id) WHERE agent_id IS NULL"
        if agentID is not None:
            target = "(org_id, agent_id) WHERE agent_id IS NOT NULL"

        def upsert(cursor: Cursor) -> BudgetRecord:
            cursor.execute(
                "INSERT INTO budgets (org_id, agent_id, nano_usd, period) VALUES (%s, %s, %s, %s)"
                f" ON CONFLICT {target} DO UPDATE"
                " SET nano_usd = EXCLUDED.nano_usd, period = EXCLUDED.period"
                f" RETURNING {_BUDGET_COLUMNS}",
                (orgID, agentID, nanoUSD, period),
            )
            return _budget(oneRow(cursor.fetchone()))

        return self._run("budget_set", upsert, orgID=orgID)

    def clearBudget(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None = None
    ) -> BudgetRecord | None:
        """
        Remove the budget of an organization (C{agentID} None) or of one of
        its agents; the budget as it was, or None when there was none.
        """
        condition, parameters = rowIs(orgID, agentID)

        def delete(cursor: Cursor) -> BudgetRecord | None:
            cursor.execute(
                f"DELETE FROM budgets WHERE {condition} RETURNING {_BUDGET_COLUMNS}", parameters
            )
            return optionalRow(_budget, cursor.fetchone())

        return self._run("budget_clear", delete, orgID=orgID)
