"""
The limits table (decisions D11): an organization's own row and its
agents', each value a positive integer or unset.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from svcd.auth.store.base import StoreBase, oneRow, optionalRow, rowIs
from svcd.common.pgtransactions import Cursor


@attrs.frozen
class LimitsRecord:
    """
    One row of the limits table (decisions D11): an organization's own
    (C{agentID} None) or one of its agents'. Each value is a positive
    integer, or None when unset; C{version} grows with every change of any
    row.
    """

    orgID: uuid.UUID
    agentID: uuid.UUID | None
    rpm: int | None
    tpm: int | None
    maxOutputTokens: int | None
    version: int


# The settable values of a limits row: svcctl's names and the columns'.
LIMIT_FIELDS = ("rpm", "tpm", "max_output_tokens")
# The largest value a limit can hold (bigint).
LARGEST_LIMIT = 2**63 - 1

_LIMITS_COLUMNS = "org_id, agent_id, rpm, tpm, max_output_tokens, version"


def _limits(row: dict[str, Any]) -> LimitsRecord:
    return LimitsRecord(
        orgID=row["org_id"],
        agentID=row["agent_id"],
        rpm=row["rpm"],
        tpm=row["tpm"],
        maxOutputTokens=row["max_output_tokens"],
        version=row["version"],
    )


class LimitsStore(StoreBase):
    """
    The limits rows (sql/0005_limits.sql).
    """

    def allLimits(self) -> list[LimitsRecord]:
        """
        Every limits row of every organization (sql/0005_limits.sql):
        svc-auth's table of limits is loaded from this.
        """

        def query(cursor: Cursor) -> list[LimitsRecord]:
            cursor.execute(f"SELECT {_LIMITS_COLUMNS} FROM svc_limits_rows()")
            return [_limits(row) for row in cursor.fetchall()]

        return self._run("limits_all", query)

    def limits(self, orgID: uuid.UUID, agentID: uuid.UUID | None = None) -> LimitsRecord | None:
        """
        The limits row of an organization (C{agentID} None) or of one of its
        agents, read in the organization's context; None when there is none.
        """

        condition, parameters = rowIs(orgID, agentID)

        def query(cursor: Cursor) -> LimitsRecord | None:
            cursor.execute(f"SELECT {_LIMITS_COLUMNS} FROM limits WHERE {condition}", parameters)
            return optionalRow(_limits, cursor.fetchone())

        return self._run("limits_lookup", query, orgID=orgID)

    def setLimits(
        self,
        orgID: uuid.UUID,
        agentID: uuid.UUID | None,
        changes: Mapping[str, int | None],
    ) -> LimitsRecord:
        """
        Create or change the limits row of an organization (C{agentID}
        None) or of one of its agents, in the organization's context.

        @param changes: the values to change, by L{LIMIT_FIELDS} name, each
            a positive integer or None to unset it; the others stay as they
            are (unset, for a new row). The row's version is taken anew even
            when nothing changes.
        @raise StoreRejected: the agent is not one of this organization's
            (or the organization does not exist).
        """
        unknown = set(changes) - set(LIMIT_FIELDS)
        if unknown:
            raise ValueError(f"not limits: {sorted(unknown)}")
        # Column names come from LIMIT_FIELDS only, never from the caller.
        updates = ", ".join(
            f"{field} = CASE WHEN %({field}_given)s THEN EXCLUDED.{field} ELSE limits.{field} END"
            for field in LIMIT_FIELDS
        )
        target = "(org_id) WHERE agent_id IS NULL"
        if agentID is not None:
            target = "(org_id, agent_id) WHERE agent_id IS NOT NULL"
        parameters: dict[str, Any] = {"org_id": orgID, "agent_id": agentID}
        for field in LIMIT_FIELDS:
            parameters[field] = changes.get(field)
            parameters[f"{field}_given"] = field in changes

        def upsert(cursor: Cursor) -> LimitsRecord:
            cursor.execute(
                "INSERT INTO limits (org_id, agent_id, rpm, tpm, max_output_tokens)"
                " VALUES (%(org_id)s, %(agent_id)s, %(rpm)s, %(tpm)s, %(max_output_tokens)s)"
                f" ON CONFLICT {target} DO UPDATE SET {updates}"
                f" RETURNING {_LIMITS_COLUMNS}",
                parameters,
            )
            return _limits(oneRow(cursor.fetchone()))

        return self._run("limits_set", upsert, orgID=orgID)

    def clearLimits(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None = None
    ) -> LimitsRecord | None:
        """
        Remove the limits row of an organization (C{agentID} None) or of one
        of its agents; the row as it was, or None when there was none.
        """

        condition, parameters = rowIs(orgID, agentID)

        def delete(cursor: Cursor) -> LimitsRecord | None:
            cursor.execute(
                f"DELETE FROM limits WHERE {condition} RETURNING {_LIMITS_COLUMNS}", parameters
            )
            return optionalRow(_limits, cursor.fetchone())

        return self._run("limits_clear", delete, orgID=orgID)
