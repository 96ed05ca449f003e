"""
svc-auth's organizations and agents (decisions D2): created by svcctl,
an agent's status changed, and an agent looked up within one
organization.
"""

from __future__ import annotations

import uuid
from typing import Any

import attrs

from svcd.auth.store.base import StoreBase, oneRow, optionalRow
from svcd.common.pgtransactions import Cursor

AGENT_STATUSES = ("active", "paused", "suspended", "archived")


@attrs.frozen
class AgentRecord:
    agentID: uuid.UUID
    orgID: uuid.UUID
    status: str
    name: str | None


_AGENT_COLUMNS = "agent_id, org_id, status, name"


def _agent(row: dict[str, Any]) -> AgentRecord:
    return AgentRecord(
        agentID=row["agent_id"], orgID=row["org_id"], status=row["status"], name=row["name"]
    )


class OrganizationsStore(StoreBase):
    """
    The organizations and agents tables.
    """

    def agentInOrganization(self, orgID: uuid.UUID, agentID: uuid.UUID) -> AgentRecord | None:
        """
        An agent as seen from one organization: None when it does not exist
        or belongs to another organization. Row-level security hides other
        organizations' agents from svc-auth; the condition on org_id does it
        for svcctl, which acts as the schema owner and sees every row.
        """

        def query(cursor: Cursor) -> AgentRecord | None:
            cursor.execute(
                f"SELECT {_AGENT_COLUMNS} FROM agents WHERE agent_id = %s AND org_id = %s",
                (agentID, orgID),
            )
            return optionalRow(_agent, cursor.fetchone())

        return self._run("agent_lookup", query, orgID=orgID)

    def organizationExists(self, orgID: uuid.UUID) -> bool:
        def query(cursor: Cursor) -> bool:
            cursor.execute("SELECT 1 FROM organizations WHERE org_id = %s", (orgID,))
            return cursor.fetchone() is not None

        return self._run("org_lookup", query, orgID=orgID)

    def createOrganization(self, name: str) -> uuid.UUID:
        orgID = uuid.uuid4()
        self._run(
            "org_create",
            lambda cursor: cursor.execute(
                "INSERT INTO organizations (org_id, name) VALUES (%s, %s)", (orgID, name)
            ),
            orgID=orgID,
        )
        return orgID

    def createAgent(
        self, orgID: uuid.UUID, name: str | None, status: str = "active"
    ) -> AgentRecord:
        agentID = uuid.uuid4()

        def insert(cursor: Cursor) -> AgentRecord:
            cursor.execute(
                "INSERT INTO agents (agent_id, org_id, name, status) VALUES (%s, %s, %s, %s)"
                f" RETURNING {_AGENT_COLUMNS}",
                (agentID, orgID, name, status),
            )
            return _agent(oneRow(cursor.fetchone()))

        return self._run("agent_create", insert, orgID=orgID)

    def setAgentStatus(
        self, agentID: uuid.UUID, status: str, orgID: uuid.UUID | None = None
    ) -> AgentRecord | None:
        """
        Change an agent's status; None when no visible agent has that id.
        Without C{orgID} only the schema owner (svcctl) sees any agent.
        """

        def update(cursor: Cursor) -> AgentRecord | None:
            cursor.execute(
                "UPDATE agents SET status = %s, updated_at = now() WHERE agent_id = %s"
                f" RETURNING {_AGENT_COLUMNS}",
                (status, agentID),
            )
            return optionalRow(_agent, cursor.fetchone())

        return self._run("agent_set_status", update, orgID=orgID)
