"""
svcctl org create, agent create and agent set-status (decisions D2): the
first organization and agent are made here, since the API needs a token
of one.
"""

from __future__ import annotations

import argparse
from typing import Any

from svcd.auth.store import Store
from svcd.auth.store.organizations import AGENT_STATUSES
from svcd.ctl.commandline import CommandError, Parser, requireOrganization, uuidArgument


def addCommands(commands: Any) -> None:
    """
    Add C{svcctl org} and C{svcctl agent} to svcctl's subcommands.
    """
    org = commands.add_parser("org", help="organizations").add_subparsers(
        dest="action", required=True, parser_class=Parser
    )
    orgCreate = org.add_parser("create", help="create an organization")
    orgCreate.add_argument("--name", required=True)

    agent = commands.add_parser("agent", help="agents").add_subparsers(
        dest="action", required=True, parser_class=Parser
    )
    agentCreate = agent.add_parser("create", help="create an agent")
    agentCreate.add_argument("--org", required=True, type=uuidArgument("--org"))
    agentCreate.add_argument("--name")
    agentCreate.add_argument("--status", default="active", choices=AGENT_STATUSES)
    agentStatus = agent.add_parser("set-status", help="change an agent's status")
    agentStatus.add_argument("agent_id", type=uuidArgument("AGENT_ID"))
    agentStatus.add_argument("status", choices=AGENT_STATUSES)


def run(store: Store, arguments: argparse.Namespace) -> dict[str, Any]:
    """
    svcctl org create, agent create and agent set-status.
    """
    command = (arguments.command, arguments.action)

    if command == ("org", "create"):
        name = arguments.name.strip()
        if not name or len(name) > 200:
            raise CommandError("--name must be 1 to 200 characters")
        return {"org_id": str(store.createOrganization(name)), "name": name}

    if command == ("agent", "create"):
        requireOrganization(store, arguments.org)
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

    raise CommandError(f"unknown command {command}")
