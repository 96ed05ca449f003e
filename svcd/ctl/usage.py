"""
svcctl usage (decisions D12, D14): the sums of an organization's ledger rows
over a span, grouped by day, model, agent, token or kind, as JSON or CSV;
the same sums as GetUsage, from the same query.
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable
from typing import Any

from svcd.auth.store import Store
from svcd.auth.store.ledger import USAGE_GROUPINGS
from svcd.auth.usage import BadUsage, parseMoment, reportCSV, reportDocument, reportSpan
from svcd.ctl.commandline import requireAgent, uuidArgument


def _moment(what: str) -> Callable[[str], str]:
    """
    A report's bound, checked as the command line is read and kept as
    given (L{reportSpan} reads it again with the other bound).
    """

    def check(text: str) -> str:
        if not text.isascii():
            # strptime reads other scripts' digits (a fullwidth 2025):
            # refused here, worded as parseMoment words any bad bound.
            raise argparse.ArgumentTypeError(
                f"{what} must be a date (YYYY-MM-DD) or an RFC 3339 time such as"
                f" 2025-06-01T00:00:00Z, got {text!r}"
            )
        try:
            parseMoment(text, what)
        except BadUsage as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    return check


def addCommands(commands: Any) -> None:
    """
    Add C{svcctl usage} to svcctl's subcommands.
    """
    usage = commands.add_parser("usage", help="usage sums from the ledger")
    usage.add_argument("--org", required=True, type=uuidArgument("--org"))
    usage.add_argument(
        "--agent", type=uuidArgument("--agent"), help="one agent of the organization"
    )
    usage.add_argument(
        "--since",
        type=_moment("--since"),
        metavar="DATE",
        help="YYYY-MM-DD or RFC 3339; default the start of the current month (UTC)",
    )
    usage.add_argument(
        "--until",
        type=_moment("--until"),
        metavar="DATE",
        help="exclusive; YYYY-MM-DD or RFC 3339; default the start of the next month (UTC)",
    )
    usage.add_argument("--by", choices=tuple(USAGE_GROUPINGS), default="day")
    usage.add_argument("--format", choices=("json", "csv"), default="json")


def run(store: Store, arguments: argparse.Namespace) -> dict[str, Any] | str:
    """
    svcctl usage (decisions D12): the same sums as GetUsage, from the same
    query.
    """
    since, until = reportSpan(arguments.since, arguments.until, datetime.datetime.now(datetime.UTC))
    requireAgent(store, arguments.org, arguments.agent)
    sums = store.usageSums(arguments.org, arguments.agent, since, until, arguments.by)
    if arguments.format == "csv":
        return reportCSV(sums)
    return reportDocument(arguments.org, since, until, arguments.by, sums)
