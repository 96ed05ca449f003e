"""
The memory settings table (decisions D13): whether an organization's or
an agent's memories are recalled and its exchanges observed; shaped as
limits are (L{svcd.auth.store.limits}).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from svcd.auth.store.base import StoreBase, oneRow, optionalRow, rowIs
from svcd.common.pgtransactions import Cursor


@attrs.frozen
class MemorySettingsRecord:
    """
    The memory settings of an organization (C{agentID} None) or of one of
    its agents (decisions D13): C{recall} True (on), False (off) or None
    (inherit: an agent's from its organization, an organization's from the
    default, off); C{observe} one of L{OBSERVE_MODES} or None (inherit,
    likewise; sql/0016_observe_modes.sql); C{version} grows with every
    change of any row.
    """

    orgID: uuid.UUID
    agentID: uuid.UUID | None
    recall: bool | None
    observe: str | None
    version: int


# The settings of a row: svcctl's names. observe is held in the column
# observe_mode (the boolean observe beside it is the previous release's,
# kept in step by sql/0016_observe_modes.sql).
MEMORY_SETTINGS = ("recall", "observe")
_MEMORY_SETTINGS_COLUMN = {"recall": "recall", "observe": "observe_mode"}

# Decisions D13 amended, "Whose words": observe only requests that name a
# subject, also those that name none (into the subject ""), or none.
OBSERVE_ON = "on"
OBSERVE_ALL = "all"
OBSERVE_OFF = "off"
OBSERVE_MODES = (OBSERVE_ON, OBSERVE_ALL, OBSERVE_OFF)

_MEMORY_SETTINGS_COLUMNS = "org_id, agent_id, recall, observe_mode, version"


def _memorySettings(row: dict[str, Any]) -> MemorySettingsRecord:
    return MemorySettingsRecord(
        orgID=row["org_id"],
        agentID=row["agent_id"],
        recall=row["recall"],
        observe=row["observe_mode"],
        version=row["version"],
    )


class MemorySettingsStore(StoreBase):
    """
    Memory settings (decisions D13, sql/0010_memory_settings.sql), shaped
    as limits are.
    """

    def allMemorySettings(self) -> list[MemorySettingsRecord]:
        """
        Every memory settings row of every organization
        (sql/0010_memory_settings.sql): svc-auth's table of memory settings
        is loaded from this.
        """

        def query(cursor: Cursor) -> list[MemorySettingsRecord]:
            cursor.execute(f"SELECT {_MEMORY_SETTINGS_COLUMNS} FROM svc_memory_settings_rows()")
            return [_memorySettings(row) for row in cursor.fetchall()]

        return self._run("memory_settings_all", query)

    def memorySettings(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None = None
    ) -> MemorySettingsRecord | None:
        """
        The memory settings row of an organization (C{agentID} None) or of
        one of its agents, read in the organization's context; None when
        there is none.
        """
        condition, parameters = rowIs(orgID, agentID)

        def query(cursor: Cursor) -> MemorySettingsRecord | None:
            cursor.execute(
                f"SELECT {_MEMORY_SETTINGS_COLUMNS} FROM memory_settings WHERE {condition}",
                parameters,
            )
            return optionalRow(_memorySettings, cursor.fetchone())

        return self._run("memory_settings_lookup", query, orgID=orgID)

    def setMemorySettings(
        self,
        orgID: uuid.UUID,
        agentID: uuid.UUID | None,
        changes: Mapping[str, bool | str | None],
    ) -> MemorySettingsRecord:
        """
        Create or change the memory settings row of an organization
        (C{agentID} None) or of one of its agents, as L{setLimits} does.

        @param changes: the settings to change, by L{MEMORY_SETTINGS} name:
            C{recall} True (on), False (off) or None (inherit); C{observe}
            one of L{OBSERVE_MODES} or None (inherit). The others stay as
            they are (inherit, for a new row). The row's version is taken
            anew even when nothing changes.
        @raise StoreRejected: the agent is not one of this organization's
            (or the organization does not exist).
        @raise ValueError: a setting not named, or a value it does not take
            (C{observe} True or False among them: what the switch of the
            previous release meant is not what C{on} means now).
        """
        unknown = set(changes) - set(MEMORY_SETTINGS)
        if unknown:
            raise ValueError(f"not memory settings: {sorted(unknown)}")
        if "recall" in changes and not isinstance(changes["recall"], bool | None):
            raise ValueError(f"recall must be True, False or None, got {changes['recall']!r}")
        if "observe" in changes and changes["observe"] not in (*OBSERVE_MODES, None):
            raise ValueError(
                f"observe must be one of {OBSERVE_MODES} or None, got {changes['observe']!r}"
            )
        # Column names come from MEMORY_SETTINGS only, never from the caller.
        updates = ", ".join(
            f"{column} = CASE WHEN %({field}_given)s THEN EXCLUDED.{column}"
            f" ELSE memory_settings.{column} END"
            for field, column in _MEMORY_SETTINGS_COLUMN.items()
        )
        target = "(org_id) WHERE agent_id IS NULL"
        if agentID is not None:
            target = "(org_id, agent_id) WHERE agent_id IS NOT NULL"
        parameters: dict[str, Any] = {"org_id": orgID, "agent_id": agentID}
        for field in MEMORY_SETTINGS:
            parameters[field] = changes.get(field)
            parameters[f"{field}_given"] = field in changes

        def upsert(cursor: Cursor) -> MemorySettingsRecord:
            cursor.execute(
                "INSERT INTO memory_settings (org_id, agent_id, recall, observe_mode)"
                " VALUES (%(org_id)s, %(agent_id)s, %(recall)s, %(observe)s)"
                f" ON CONFLICT {target} DO UPDATE SET {updates}"
                f" RETURNING {_MEMORY_SETTINGS_COLUMNS}",
                parameters,
            )
            return _memorySettings(oneRow(cursor.fetchone()))

        return self._run("memory_settings_set", upsert, orgID=orgID)
