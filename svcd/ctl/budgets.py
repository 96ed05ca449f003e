"""
svcctl budget set|show|clear (decisions D12): the budget of an
organization or of one of its agents, in exact dollars.
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from svcd.auth.store import Store
from svcd.auth.store.budgets import BUDGET_PERIODS, BudgetRecord
from svcd.common.money import BadDollars, formatDollars, parseDollars
from svcd.ctl.commandline import Parser, formatID, requireAgent, uuidArgument

# The largest budget svcctl sets, in dollars: 9 * 10^15 nano-dollars, just
# under 2**53, up to which the proxies' admission script (Lua, whose
# numbers are doubles) compares and counts a budget's spend exactly.
MAXIMUM_BUDGET_DOLLARS = 9_000_000


def _budgetAmount(text: str) -> int:
    """
    The value of --usd: a decimal string of dollars, read exactly into
    nano-dollars (never through a float), more than zero.
    """
    try:
        nano = parseDollars(text.strip(), maximum=MAXIMUM_BUDGET_DOLLARS)
    except BadDollars as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if nano <= 0:
        raise argparse.ArgumentTypeError(f"must be more than zero dollars, got {text!r}")
    return nano


def addCommands(commands: Any) -> None:
    """
    Add C{svcctl budget} to svcctl's subcommands.
    """
    budget = commands.add_parser(
        "budget", help="budgets of an organization or of one of its agents"
    ).add_subparsers(dest="action", required=True, parser_class=Parser)
    budgetSet = budget.add_parser("set", help="set (or replace) a budget")
    budgetShow = budget.add_parser("show", help="show a budget")
    budgetClear = budget.add_parser("clear", help="remove a budget")
    for each in (budgetSet, budgetShow, budgetClear):
        each.add_argument("--org", required=True, type=uuidArgument("--org"))
        each.add_argument(
            "--agent",
            type=uuidArgument("--agent"),
            help="an agent of the organization; without it, the organization's own budget",
        )
    budgetSet.add_argument(
        "--usd",
        required=True,
        type=_budgetAmount,
        metavar="AMOUNT",
        help='the most a period may cost, in US dollars ("250", "0.50")',
    )
    budgetSet.add_argument(
        "--period",
        required=True,
        choices=BUDGET_PERIODS,
        help="a calendar day or month, UTC",
    )


def run(store: Store, arguments: argparse.Namespace) -> dict[str, Any]:
    """
    svcctl budget set|show|clear (decisions D12).
    """
    orgID, agentID = arguments.org, arguments.agent
    requireAgent(store, orgID, agentID)
    if arguments.action == "set":
        row = store.setBudget(orgID, agentID, arguments.usd, arguments.period)
        return _budgetDocument(orgID, agentID, row)
    if arguments.action == "show":
        return _budgetDocument(orgID, agentID, store.budget(orgID, agentID))
    cleared = store.clearBudget(orgID, agentID)
    return {**_budgetDocument(orgID, agentID, cleared), "cleared": cleared is not None}


def _budgetDocument(
    orgID: uuid.UUID, agentID: uuid.UUID | None, row: BudgetRecord | None
) -> dict[str, Any]:
    """
    A budget as svcctl prints it: the amount both as exact dollars and as
    nano-dollars; every value null when there is none.
    """
    return {
        "org_id": str(orgID),
        "agent_id": formatID(agentID),
        "usd": None if row is None else formatDollars(row.nanoUSD),
        "nano_usd": None if row is None else row.nanoUSD,
        "period": None if row is None else row.period,
        "version": None if row is None else row.version,
    }
