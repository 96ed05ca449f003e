"""
svcctl: the operator's command line (decisions D2).

It talks to PostgreSQL directly, with POSTGRES_DSN or --dsn, because the
first organization, agent and token cannot be made through an API that
needs a token. It acts as the schema owner (the role that ran svcctl
migrate), which row-level security lets see every organization.

Every command prints exactly one JSON document on stdout and exits 0 (or,
for svcctl usage --format csv, the report's rows as CSV); on failure it
prints one line on stderr and exits non-zero: 2 for a command line it
cannot take (a bad date, amount or UUID), 1 for anything else (an unknown
organization, the database).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import psycopg

from svcd.auth.migrations import migrate
from svcd.auth.store import (
    AGENT_STATUSES,
    BUDGET_PERIODS,
    LARGEST_LIMIT,
    LIMIT_FIELDS,
    MEMORY_SETTINGS,
    OBSERVE_MODES,
    USAGE_GROUPINGS,
    BudgetRecord,
    LimitsRecord,
    MemorySettingsRecord,
    Store,
    StoreRejected,
    StoreUnavailable,
    StoreValueRefused,
    TokenRecord,
)
from svcd.auth.usage import BadUsage, parseMoment, reportCSV, reportDocument, reportSpan
from svcd.common.errors import rfc3339
from svcd.common.ids import parseUUID
from svcd.common.money import BadDollars, formatDollars, parseDollars
from svcd.common.permissions import Permission, parsePermissions
from svcd.memory.ctl import MemoryCommandError, addMemoryCommands, runMemory


class CommandError(Exception):
    """
    A failure to report on one stderr line.
    """


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def _uuid(what: str) -> Callable[[str], uuid.UUID]:
    def parse(text: str) -> uuid.UUID:
        parsed = parseUUID(text.strip().lower())
        if parsed is None:
            raise argparse.ArgumentTypeError(f"{what} must be a UUID, got {text!r}")
        return parsed

    return parse


def _permissions(text: str) -> int:
    try:
        return parsePermissions(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds(text: str) -> int:
    # ASCII digits only: int() also reads other scripts' digits (fullwidth "60", U+FF16 U+FF10).
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return int(text)


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


# A memory setting as svcctl takes and prints it, and as the table holds
# it (None: inherit).
_SWITCHES: dict[str, bool | None] = {"on": True, "off": False, "inherit": None}


def _switch(text: str) -> bool | None:
    """
    The value of --recall or --observe. (argparse names the flag in its
    message.)
    """
    try:
        return _SWITCHES[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"must be on, off or inherit; got {text!r}") from None


def _switchName(value: bool | None) -> str:
    return "inherit" if value is None else "on" if value else "off"


# --observe (decisions D13 amended, "Whose words"): a mode, or inherit.
_OBSERVE_VALUES: dict[str, str | None] = {**{mode: mode for mode in OBSERVE_MODES}, "inherit": None}


def _observeMode(text: str) -> str | None:
    """
    The value of --observe: on (requests that name a subject), all (those
    that name none too, into the agent's shared subject), off or inherit.
    """
    try:
        return _OBSERVE_VALUES[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"must be on, all, off or inherit; got {text!r}") from None


def _observeName(value: str | None) -> str:
    return "inherit" if value is None else value


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


def buildParser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="svcctl",
        description="Operate the svc gateway's database: migrations, organizations, "
        "agents, tokens, limits, budgets, usage, memories and memory settings. Prints one "
        "JSON document on stdout.",
    )
    parser.add_argument(
        "--dsn",
        help="PostgreSQL connection string of the schema owner (default: $POSTGRES_DSN)",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    commands.add_parser("migrate", help="apply pending migrations (safe to repeat)")

    org = commands.add_parser("org", help="organizations").add_subparsers(
        dest="action", required=True, parser_class=_Parser
    )
    orgCreate = org.add_parser("create", help="create an organization")
    orgCreate.add_argument("--name", required=True)

    agent = commands.add_parser("agent", help="agents").add_subparsers(
        dest="action", required=True, parser_class=_Parser
    )
    agentCreate = agent.add_parser("create", help="create an agent")
    agentCreate.add_argument("--org", required=True, type=_uuid("--org"))
    agentCreate.add_argument("--name")
    agentCreate.add_argument("--status", default="active", choices=AGENT_STATUSES)
    agentStatus = agent.add_parser("set-status", help="change an agent's status")
    agentStatus.add_argument("agent_id", type=_uuid("AGENT_ID"))
    agentStatus.add_argument("status", choices=AGENT_STATUSES)

    token = commands.add_parser("token", help="personal access tokens").add_subparsers(
        dest="action", required=True, parser_class=_Parser
    )
    tokenCreate = token.add_parser("create", help="issue a token (printed once)")
    tokenCreate.add_argument("--org", required=True, type=_uuid("--org"))
    tokenCreate.add_argument("--agent", type=_uuid("--agent"))
    tokenCreate.add_argument(
        "--permissions",
        type=_permissions,
        default=int(Permission.ProxyChatCompletion),
        help="comma-separated names (ProxyChatCompletion, TokenCreate, TokenRevoke, "
        "TokenList, UsageRead) or an integer bitmap; default ProxyChatCompletion",
    )
    tokenCreate.add_argument("--expires-in", type=_seconds, metavar="SECONDS")
    tokenCreate.add_argument("--name")
    tokenRevoke = token.add_parser("revoke", help="revoke a token")
    tokenRevoke.add_argument("token_id", type=_uuid("TOKEN_ID"))
    tokenList = token.add_parser("list", help="list an organization's tokens, never a secret")
    tokenList.add_argument("--org", required=True, type=_uuid("--org"))

    limits = commands.add_parser(
        "limits", help="limits of an organization or of one of its agents"
    ).add_subparsers(dest="action", required=True, parser_class=_Parser)
    limitsSet = limits.add_parser(
        "set",
        help="set limits (the others stay as they are; none unsets one)",
    )
    limitsShow = limits.add_parser("show", help="show limits")
    limitsClear = limits.add_parser("clear", help="remove the row of limits")
    for each in (limitsSet, limitsShow, limitsClear):
        each.add_argument("--org", required=True, type=_uuid("--org"))
        each.add_argument(
            "--agent",
            type=_uuid("--agent"),
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

    budget = commands.add_parser(
        "budget", help="budgets of an organization or of one of its agents"
    ).add_subparsers(dest="action", required=True, parser_class=_Parser)
    budgetSet = budget.add_parser("set", help="set (or replace) a budget")
    budgetShow = budget.add_parser("show", help="show a budget")
    budgetClear = budget.add_parser("clear", help="remove a budget")
    for each in (budgetSet, budgetShow, budgetClear):
        each.add_argument("--org", required=True, type=_uuid("--org"))
        each.add_argument(
            "--agent",
            type=_uuid("--agent"),
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

    usage = commands.add_parser("usage", help="usage sums from the ledger")
    usage.add_argument("--org", required=True, type=_uuid("--org"))
    usage.add_argument("--agent", type=_uuid("--agent"), help="one agent of the organization")
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

    _addMemorySettings(addMemoryCommands(commands, _Parser, _uuid))
    return parser


def _addMemorySettings(memory: Any) -> None:
    """
    Add C{svcctl memory settings} (decisions D13) to the subcommands of
    C{svcctl memory}.
    """
    settings = memory.add_parser(
        "settings",
        help="show or set whether memory is recalled and observed for an organization "
        "or one of its agents",
    )
    settings.add_argument("--org", required=True, type=_uuid("--org"))
    settings.add_argument(
        "--agent",
        type=_uuid("--agent"),
        help="an agent of the organization, whose settings win over its organization's; "
        "without it, the organization's own",
    )
    inherit = " (inherit: the organization's, for an agent; off, for an organization)"
    settings.add_argument(
        "--recall",
        dest="recall",
        type=_switch,
        help="memories recalled into the prompts of chat completions" + inherit,
        # Absent from the namespace unless given: not given keeps it.
        default=argparse.SUPPRESS,
        metavar="on|off|inherit",
    )
    settings.add_argument(
        "--observe",
        dest="observe",
        type=_observeMode,
        help="answered exchanges kept to make memories from: on, only of requests that "
        "name a subject (X-SVC-Memory-Subject); all, of those that name none too, into "
        "the agent's shared subject (an agent that serves one user); off" + inherit,
        default=argparse.SUPPRESS,
        metavar="on|all|off|inherit",
    )


def _timestamp(moment: datetime.datetime | None) -> str | None:
    return None if moment is None else rfc3339(moment)


def _id(value: uuid.UUID | None) -> str | None:
    return None if value is None else str(value)


def _listed(record: TokenRecord) -> dict[str, Any]:
    return {
        "token_id": str(record.tokenID),
        "name": record.name,
        "agent_id": _id(record.agentID),
        "permissions": record.permissions,
        "expires_at": _timestamp(record.expiresAt),
        "revoked": record.revokedAt is not None,
        "created_at": _timestamp(record.createdAt),
    }


def run(arguments: argparse.Namespace, dsn: str) -> dict[str, Any] | str:
    """
    Carry out one parsed command and return the JSON document to print (or
    the text, for svcctl usage --format csv).
    """
    if arguments.command == "migrate":
        return {"applied": migrate(dsn)}

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as connection:
        store = Store(lambda: contextlib.nullcontext(connection))
        command = (arguments.command, getattr(arguments, "action", None))

        if command == ("org", "create"):
            name = arguments.name.strip()
            if not name or len(name) > 200:
                raise CommandError("--name must be 1 to 200 characters")
            return {"org_id": str(store.createOrganization(name)), "name": name}

        if command == ("agent", "create"):
            _requireOrganization(store, arguments.org)
            agent = store.createAgent(arguments.org, arguments.name, arguments.status)
            return {
                "agent_id": str(agent.agentID),
                "org_id": str(agent.orgID),
                "status": agent.status,
            }

        if command == ("agent", "set-status"):
            changed = store.setAgentStatus(arguments.agent_id, arguments.status)
            if changed is None:
                raise CommandError(f"no agent {arguments.agent_id}")
            return {
                "agent_id": str(changed.agentID),
                "org_id": str(changed.orgID),
                "status": changed.status,
            }

        if command == ("token", "create"):
            _requireOrganization(store, arguments.org)
            if arguments.agent is not None:
                if store.agentInOrganization(arguments.org, arguments.agent) is None:
                    raise CommandError(
                        f"no agent {arguments.agent} in organization {arguments.org}"
                    )
            expiresAt = None
            if arguments.expires_in is not None:
                expiresAt = datetime.datetime.fromtimestamp(
                    time.time() + arguments.expires_in, datetime.UTC
                ).replace(microsecond=0)
            # Imported for this command only: argon2 and the validation
            # machinery are a quarter of a second of every svcctl start.
            from svcd.auth.authority import issueToken

            token, record = issueToken(
                store,
                orgID=arguments.org,
                permissions=arguments.permissions,
                agentID=arguments.agent,
                name=arguments.name,
                expiresAt=expiresAt,
            )
            return {
                "token": token,
                "token_id": str(record.tokenID),
                "org_id": str(record.orgID),
                "agent_id": _id(record.agentID),
                "permissions": record.permissions,
                "expires_at": _timestamp(record.expiresAt),
            }

        if command == ("token", "revoke"):
            revoked = store.revokeToken(arguments.token_id)
            if revoked is None:
                raise CommandError(f"no token {arguments.token_id}")
            return {"token_id": str(revoked.tokenID), "revoked": True}

        if command == ("token", "list"):
            _requireOrganization(store, arguments.org)
            return {"tokens": [_listed(each) for each in store.listTokens(arguments.org)]}

        if arguments.command == "limits":
            return _limits(store, arguments)

        if arguments.command == "budget":
            return _budget(store, arguments)

        if arguments.command == "usage":
            return _usage(store, arguments)

        if command == ("memory", "settings"):
            return _memorySettings(store, arguments)

        if arguments.command == "memory":
            return runMemory(
                arguments, connection, lambda orgID, agentID: _requireAgent(store, orgID, agentID)
            )

    raise CommandError(f"unknown command {command}")


def _limits(store: Store, arguments: argparse.Namespace) -> dict[str, Any]:
    """
    svcctl limits set|show|clear (decisions D11).
    """
    orgID, agentID = arguments.org, arguments.agent
    changes = {field: getattr(arguments, field) for field in LIMIT_FIELDS if field in arguments}
    if arguments.action == "set" and not changes:
        raise CommandError("nothing to set: give --rpm, --tpm or --max-output-tokens")
    _requireAgent(store, orgID, agentID)
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
        "agent_id": _id(agentID),
        "rpm": None if row is None else row.rpm,
        "tpm": None if row is None else row.tpm,
        "max_output_tokens": None if row is None else row.maxOutputTokens,
        "version": None if row is None else row.version,
    }


def _requireAgent(store: Store, orgID: uuid.UUID, agentID: uuid.UUID | None) -> None:
    _requireOrganization(store, orgID)
    if agentID is not None and store.agentInOrganization(orgID, agentID) is None:
        # The same words for an unknown agent and another organization's.
        raise CommandError(f"no agent {agentID} in organization {orgID}")


def _budget(store: Store, arguments: argparse.Namespace) -> dict[str, Any]:
    """
    svcctl budget set|show|clear (decisions D12).
    """
    orgID, agentID = arguments.org, arguments.agent
    _requireAgent(store, orgID, agentID)
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
        "agent_id": _id(agentID),
        "usd": None if row is None else formatDollars(row.nanoUSD),
        "nano_usd": None if row is None else row.nanoUSD,
        "period": None if row is None else row.period,
        "version": None if row is None else row.version,
    }


def _memorySettings(store: Store, arguments: argparse.Namespace) -> dict[str, Any]:
    """
    svcctl memory settings (decisions D13): set what is given, then print
    the row as stored; with nothing given, only print it.
    """
    orgID, agentID = arguments.org, arguments.agent
    changes = {field: getattr(arguments, field) for field in MEMORY_SETTINGS if field in arguments}
    _requireAgent(store, orgID, agentID)
    if changes:
        row: MemorySettingsRecord | None = store.setMemorySettings(orgID, agentID, changes)
    else:
        row = store.memorySettings(orgID, agentID)
    return {
        "org_id": str(orgID),
        "agent_id": _id(agentID),
        "recall": _switchName(None if row is None else row.recall),
        "observe": _observeName(None if row is None else row.observe),
        "version": None if row is None else row.version,
    }


def _usage(store: Store, arguments: argparse.Namespace) -> dict[str, Any] | str:
    """
    svcctl usage (decisions D12): the same sums as GetUsage, from the same
    query.
    """
    since, until = reportSpan(arguments.since, arguments.until, datetime.datetime.now(datetime.UTC))
    _requireAgent(store, arguments.org, arguments.agent)
    sums = store.usageSums(arguments.org, arguments.agent, since, until, arguments.by)
    if arguments.format == "csv":
        return reportCSV(sums)
    return reportDocument(arguments.org, since, until, arguments.by, sums)


def _requireOrganization(store: Store, orgID: uuid.UUID) -> None:
    if not store.organizationExists(orgID):
        raise CommandError(f"no organization {orgID}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = buildParser()
    arguments = parser.parse_args(argv)
    dsn = arguments.dsn or os.environ.get("POSTGRES_DSN", "").strip()
    if not dsn:
        sys.stderr.write("svcctl: error: POSTGRES_DSN is not set and --dsn was not given\n")
        return 2
    try:
        document = run(arguments, dsn)
    except BadUsage as error:
        # A command line the parser could not check alone (since after
        # until): the operator's mistake, as argparse's are.
        sys.stderr.write(f"svcctl: error: {error}\n")
        return 2
    except (CommandError, MemoryCommandError) as error:
        sys.stderr.write(f"svcctl: error: {error}\n")
        return 1
    except (StoreUnavailable, StoreRejected, StoreValueRefused) as error:
        sys.stderr.write(f"svcctl: error: {error}\n")
        return 1
    except psycopg.Error as error:
        # The first line of PostgreSQL's message (no DSN, no password).
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        sys.stderr.write(f"svcctl: error: database: {type(error).__name__}: {message}\n")
        return 1
    except OSError as error:
        sys.stderr.write(f"svcctl: error: {error}\n")
        return 1
    if isinstance(document, str):
        sys.stdout.write(document)
    else:
        sys.stdout.write(json.dumps(document) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
