"""
svcctl token create|revoke|list (decisions D2): personal access tokens,
each secret printed once when it is issued and never again.
"""

from __future__ import annotations

import argparse
import datetime
import time
from typing import Any

from svcd.auth.store import Store
from svcd.auth.store.tokens import TokenRecord
from svcd.common.permissions import Permission, parsePermissions
from svcd.ctl.commandline import (
    CommandError,
    Parser,
    formatID,
    requireOrganization,
    timestamp,
    uuidArgument,
)


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


def addCommands(commands: Any) -> None:
    """
    Add C{svcctl token} to svcctl's subcommands.
    """
    token = commands.add_parser("token", help="personal access tokens").add_subparsers(
        dest="action", required=True, parser_class=Parser
    )
    tokenCreate = token.add_parser("create", help="issue a token (printed once)")
    tokenCreate.add_argument("--org", required=True, type=uuidArgument("--org"))
    tokenCreate.add_argument("--agent", type=uuidArgument("--agent"))
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
    tokenRevoke.add_argument("token_id", type=uuidArgument("TOKEN_ID"))
    tokenList = token.add_parser("list", help="list an organization's tokens, never a secret")
    tokenList.add_argument("--org", required=True, type=uuidArgument("--org"))


def _listed(record: TokenRecord) -> dict[str, Any]:
    return {
        "token_id": str(record.tokenID),
        "name": record.name,
        "agent_id": formatID(record.agentID),
        "permissions": record.permissions,
        "expires_at": timestamp(record.expiresAt),
        "revoked": record.revokedAt is not None,
        "created_at": timestamp(record.createdAt),
    }


def run(store: Store, arguments: argparse.Namespace) -> dict[str, Any]:
    """
    svcctl token create|revoke|list.
    """
    if arguments.action == "create":
        requireOrganization(store, arguments.org)
        if arguments.agent is not None:
            if store.agentInOrganization(arguments.org, arguments.agent) is None:
                raise CommandError(f"no agent {arguments.agent} in organization {arguments.org}")
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
            "agent_id": formatID(record.agentID),
            "permissions": record.permissions,
            "expires_at": timestamp(record.expiresAt),
        }

    if arguments.action == "revoke":
        revoked = store.revokeToken(arguments.token_id)
        if revoked is None:
            raise CommandError(f"no token {arguments.token_id}")
        return {"token_id": str(revoked.tokenID), "revoked": True}

    if arguments.action == "list":
        requireOrganization(store, arguments.org)
        return {"tokens": [_listed(each) for each in store.listTokens(arguments.org)]}

    raise CommandError(f"unknown command {(arguments.command, arguments.action)}")
