"""
svcctl: the operator's command line (decisions D2).

It talks to PostgreSQL directly, with POSTGRES_DSN or --dsn, because the
first organization, agent and token cannot be made through an API that
needs a token. It acts as the schema owner (the role that ran svcctl
migrate), which row-level security lets see every organization.

Every command prints exactly one JSON document on stdout and exits 0; on
failure it prints one line on stderr and exits non-zero.
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

from svcd.auth.authority import issueToken
from svcd.auth.migrations import migrate
from svcd.auth.store import AGENT_STATUSES, Store, StoreRejected, StoreUnavailable, TokenRecord
from svcd.common.errors import rfc3339
from svcd.common.ids import parseUUID
from svcd.common.permissions import Permission, parsePermissions


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
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return int(text)


def buildParser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="svcctl",
        description="Operate the svc gateway's database: migrations, organizations, "
        "agents and tokens. Prints one JSON document on stdout.",
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
        "TokenList) or an integer bitmap; default ProxyChatCompletion",
    )
    tokenCreate.add_argument("--expires-in", type=_seconds, metavar="SECONDS")
    tokenCreate.add_argument("--name")
    tokenRevoke = token.add_parser("revoke", help="revoke a token")
    tokenRevoke.add_argument("token_id", type=_uuid("TOKEN_ID"))
    tokenList = token.add_parser("list", help="list an organization's tokens, never a secret")
    tokenList.add_argument("--org", required=True, type=_uuid("--org"))
    return parser


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


def run(arguments: argparse.Namespace, dsn: str) -> dict[str, Any]:
    """
    Carry out one parsed command and return the JSON document to print.
    """
    if arguments.command == "migrate":
        return {"applied": migrate(dsn)}

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as connection:
        store = Store(lambda: contextlib.nullcontext(connection))
        command = (arguments.command, arguments.action)

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

    raise CommandError(f"unknown command {command}")


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
    except CommandError as error:
        sys.stderr.write(f"svcctl: error: {error}\n")
        return 1
    except (StoreUnavailable, StoreRejected) as error:
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
    sys.stdout.write(json.dumps(document) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
