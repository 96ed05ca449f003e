"""
svc-auth's tables of limits (decisions D11), of budgets (decisions D12)
and of memory settings (decisions D13): every limits row, every budget
and every memory settings row of every organization, in memory, so that
each ValidateToken and ValidateAgent answer carries its organization's or
agent's rows as they are now, and each change feed stream can start with
every row, without a query. Each is a L{RowTable}: rows keyed by
(organization, agent or None).

How they stay current: the change listener (L{svcd.auth.listener}) loads
each whole table each time it starts listening (again: notifications may
have been missed while it was not), and on each notification of a limits
row (sql/0005_limits.sql), a budget (sql/0006_usage.sql) or a memory
settings row (sql/0010_memory_settings.sql) re-reads that row and puts it
here before handing it to the change feed. While the listener is not listening, the
table vouches for nothing: a lookup says so, and the caller reads the row
from the database, which is then remembered for at most C{untrustedTTL}
seconds (as L{svcd.auth.cache} does for tokens), so that a change still
shows within one second.

Threads: the listener's thread writes, grpcio's server threads read; one
lock guards everything, held for a few dict operations only.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from svcd.auth.store.budgets import BudgetRecord
from svcd.auth.store.limits import LimitsRecord
from svcd.auth.store.memorysettings import OBSERVE_OFF, MemorySettingsRecord
from svcd.pb.auth.v1 import auth_pb2

Key = tuple[uuid.UUID, uuid.UUID | None]


class _Row(Protocol):
    @property
    def orgID(self) -> uuid.UUID: ...

    @property
    def agentID(self) -> uuid.UUID | None: ...


R = TypeVar("R", bound=_Row)


class RowTable(Generic[R]):
    """
    Every row of one kind (limits, budgets, memory settings), by (organization, agent or
    None).

    @param monotonic: a monotonic clock in seconds.
    @param untrustedTTL: how long a row read while the table is not
        current may be used.
    @param maximumRemembered: how many such rows are kept at most.
    """

    def __init__(
        self,
        monotonic: Callable[[], float],
        untrustedTTL: float = 1.0,
        maximumRemembered: int = 100_000,
    ) -> None:
        self._monotonic = monotonic
        self._untrustedTTL = untrustedTTL
        self._maximumRemembered = maximumRemembered
        self._lock = threading.Lock()
        self._rows: dict[Key, R] = {}
        self._current = False
        # Rows read from the database while not current, with when the
        # read began.
        self._remembered: OrderedDict[Key, tuple[R | None, float]] = OrderedDict()

    # The listener's side.

    def replace(self, rows: Iterable[R]) -> None:
        """
        The whole table, just read after the listener began listening: from
        now on every change is announced, so the table is current.
        """
        table = {(row.orgID, row.agentID): row for row in rows}
        with self._lock:
            self._rows = table
            self._current = True
            self._remembered.clear()

    def put(self, orgID: uuid.UUID, agentID: uuid.UUID | None, row: R | None) -> None:
        """
        The row of C{(orgID, agentID)} as just re-read; None when there is
        none (it was cleared).
        """
        with self._lock:
            if row is None:
                self._rows.pop((orgID, agentID), None)
            else:
                self._rows[(orgID, agentID)] = row

    def notCurrent(self) -> None:
        """
        The listener stopped listening: changes may now be missed.
        """
        with self._lock:
            self._current = False
            self._remembered.clear()

    # The readers' side.

    def isCurrent(self) -> bool:
        with self._lock:
            return self._current

    def rows(self) -> list[R]:
        """
        A copy of every row (the start of a change feed stream, which is
        served only while the table is current).
        """
        with self._lock:
            return list(self._rows.values())

    def lookup(self, orgID: uuid.UUID, agentID: uuid.UUID | None) -> tuple[bool, R | None]:
        """
        Whether the table can answer for the row of C{(orgID, agentID)},
        and the row (None: there is none). When it cannot, read the row
        from the database and L{remember} it.
        """
        key = (orgID, agentID)
        with self._lock:
            if self._current:
                return True, self._rows.get(key)
            remembered = self._remembered.get(key)
            if remembered is None:
                return False, None
            row, readAt = remembered
            if self._monotonic() - readAt >= self._untrustedTTL:
                del self._remembered[key]
                return False, None
            self._remembered.move_to_end(key)
            return True, row

    def now(self) -> float:
        """
        Take before a database read whose row is then passed to
        L{remember}.
        """
        return self._monotonic()

    def remember(
        self,
        orgID: uuid.UUID,
        agentID: uuid.UUID | None,
        row: R | None,
        readAt: float,
    ) -> None:
        """
        Keep a row read from the database while the table was not current,
        for at most C{untrustedTTL} seconds after C{readAt}.
        """
        key = (orgID, agentID)
        with self._lock:
            if self._current:
                return
            self._remembered[key] = (row, readAt)
            self._remembered.move_to_end(key)
            while len(self._remembered) > self._maximumRemembered:
                self._remembered.popitem(last=False)


class LimitsTable(RowTable[LimitsRecord]):
    """
    Every limits row (decisions D11).
    """


class BudgetsTable(RowTable[BudgetRecord]):
    """
    Every budget (decisions D12).
    """


class MemorySettingsTable(RowTable[MemorySettingsRecord]):
    """
    Every memory settings row (decisions D13).
    """


def limitsMessage(row: LimitsRecord) -> auth_pb2.Limits:
    """
    A row as the gRPC API carries it: unset values absent.
    """
    message = auth_pb2.Limits(version=row.version)
    if row.rpm is not None:
        message.rpm = row.rpm
    if row.tpm is not None:
        message.tpm = row.tpm
    if row.maxOutputTokens is not None:
        message.max_output_tokens = row.maxOutputTokens
    return message


def limitsChange(
    orgID: uuid.UUID, agentID: uuid.UUID | None, row: LimitsRecord | None
) -> auth_pb2.Change:
    """
    The change feed's message for the row of C{(orgID, agentID)}: the row,
    or none when it was cleared.
    """
    changed = auth_pb2.LimitsChanged(
        org_id=orgID.bytes, agent_id=agentID.bytes if agentID is not None else b""
    )
    if row is not None:
        changed.limits.CopyFrom(limitsMessage(row))
    return auth_pb2.Change(limits_changed=changed)


def budgetMessage(row: BudgetRecord) -> auth_pb2.Budget:
    """
    A budget as the gRPC API carries it.
    """
    return auth_pb2.Budget(nano_usd=row.nanoUSD, period=row.period, version=row.version)


def budgetChange(
    orgID: uuid.UUID, agentID: uuid.UUID | None, row: BudgetRecord | None
) -> auth_pb2.Change:
    """
    The change feed's message for the budget of C{(orgID, agentID)}: the
    budget, or none when it was cleared.
    """
    changed = auth_pb2.BudgetChanged(
        org_id=orgID.bytes, agent_id=agentID.bytes if agentID is not None else b""
    )
    if row is not None:
        changed.budget.CopyFrom(budgetMessage(row))
    return auth_pb2.Change(budget_changed=changed)


def memorySettingsMessage(row: MemorySettingsRecord) -> auth_pb2.MemorySettings:
    """
    A memory settings row as the gRPC API carries it: a switch that
    inherits absent. observe goes as C{observe_mode} (empty: inherit)
    and, for proxies of the previous release, as the switch C{observe},
    true for C{on} and C{all}: such a proxy observes subject-less requests
    too, as it did, until it is upgraded.
    """
    message = auth_pb2.MemorySettings(version=row.version)
    if row.recall is not None:
        message.recall = row.recall
    if row.observe is not None:
        message.observe_mode = row.observe
        message.observe = row.observe != OBSERVE_OFF
    return message


def memorySettingsChange(
    orgID: uuid.UUID, agentID: uuid.UUID | None, row: MemorySettingsRecord | None
) -> auth_pb2.Change:
    """
    The change feed's message for the memory settings of C{(orgID,
    agentID)}: the row, or none when there is none.
    """
    changed = auth_pb2.MemorySettingsChanged(
        org_id=orgID.bytes, agent_id=agentID.bytes if agentID is not None else b""
    )
    if row is not None:
        changed.settings.CopyFrom(memorySettingsMessage(row))
    return auth_pb2.Change(memory_settings_changed=changed)
