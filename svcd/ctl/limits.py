"""
svcctl limits set|show|clear (decisions D11): the limits of an
organization or of one of its agents.
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from svcd.auth.store import Store
from svcd.auth.store.limits import LARGEST_LIMIT, LIMIT_FIELDS, LimitsRecord
from svcd.ctl.commandline import CommandError, Parser, formatID, requireAgent, uuidArgument


def _limit(text: str) -> int | None:
    """
    The value of a limit flag: a positive integer that a bigint holds, or
    C{none} (None) to unset it. (argparse names the flag in its message.)
    """
    digits = text.strip()
    if digits.lower() == "none":
        return None
    if digits.isascii() and digits.isdigit() and 0 < int(digits) <= LARGEST_LIMIT:
        return int(digits)
    raise argparse.ArgumentTypeError(
        f"must be a positive integer up to {LARGEST_LIMIT}, or none; got {text!r}"
    )


def addCommands(commands: Any) -> None:
    """
    Add C{svcctl limits} to svcctl's subcommands.
    """
    limits = commands.add_parser(
        "limits", help="limits of an organization or of one of its agents"
    ).add_subparsers(dest="action", required=True, parser_class=Parser)
    limitsSet = limits.add_parser(
        "set",
        help="set limits (the others stay as they are; none unsets one)",
    )
    limitsShow = limits.add_parser("show", help="show limits")
    limitsClear = limits.add_parser("clear", help="remove the row of limits")
    for each in (limitsSet, limitsShow, limitsClear):
        each.add_argument("--org", required=True, type=uuidArgument("--org"))
        each.add_argument(
            "--agent",
            type=uuidArgument("--agent"),
            help="an agent of the organization; without it, the organization's own row",
        )
    meanings = {
        "rpm": "requests per calendar minute",
        "tpm": "tokens per calendar minute",
        "max_output_tokens": "the output cap assumed when a request names none",
    }
    for field in LIMIT_FIELDS:
        limitsSet.add_argument(
            "--" + field.replace("_", "-"),
            dest=field,
            type=_limit,
            help=meanings[field],
            # Absent from the namespace unless given: "not given" keeps the
            # value, "none" unsets it.
            default=argparse.SUPPRESS,
            metavar="N|none",
        )


def run(store: Store, arguments: argparse.Namespace) -> dict[str, Any]:
    """
    svcctl limits set|show|clear (decisions D11).
    """
    orgID, agentID = arguments.org, arguments.agent
    changes = {field: getattr(arguments, field) for field in LIMIT_FIELDS if field in arguments}
    if arguments.action == "set" and not changes:
        raise CommandError("nothing to set: give --rpm, --tpm or --max-output-tokens")
    requireAgent(store, orgID, agentID)
    if arguments.action == "set":
        return _limitsDocument(orgID, agentID, store.setLimits(orgID, agentID, changes))
    if arguments.action == "show":
        return _limitsDocument(orgID, agentID, store.limits(orgID, agentID))
    cleared = store.clearLimits(orgID, agentID)
    return {**_limitsDocument(orgID, agentID, cleared), "cleared": cleared is not None}


def _limitsDocument(
    orgID: uuid.UUID, agentID: uuid.UUID | None, row: LimitsRecord | None
) -> dict[str, Any]:
    """
    A limits row as svcctl prints it: unset values null, and every value
    and the version null when there is no row.
    """
    return {
        "org_id": str(orgID),
        "agent_id": formatID(agentID),
        "rpm": None if row is None else row.rpm,
        "tpm": None if row is None else row.tpm,
        "max_output_tokens": None if row is None else row.maxOutputTokens,
        "version": None if row is None else row.version,
    }
