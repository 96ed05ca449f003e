"""
The change listener: one dedicated thread with its own PostgreSQL
connection, LISTENing on svc_auth_changes, dropping cache entries as
tokens and agents change (sql/0003_change_notifications.sql,
sql/0004_change_feed.sql), keeping the table of limits current
(sql/0005_limits.sql, L{svcd.auth.limits}), of budgets
(sql/0006_usage.sql) and of memory settings (sql/0010_memory_settings.sql)
and handing every change to the change feed (L{svcd.auth.feed.ChangeHub}).

It reports its state to the cache and the tables of rows:
while it is connected, cached entries and the tables are trusted; while
it is not, they live at most one second. So losing the listener costs
speed, never correctness. Each time it starts listening it loads every
whole table again, since changes may have been missed while it was not.

Beats: about every C{beatInterval} seconds the listener sends a
notification to itself on the same channel (C{beat:<nonce>:<n>}).
PostgreSQL delivers a listening session's notifications in commit order,
so when a beat comes back every change committed before it has been
heard: that is what the feed's heartbeat promises, and it is sent only
for a beat that came back within C{beatLag} seconds. A connection whose
beats stop coming back (a peer that vanished without closing, which TCP
keepalives would notice only after many seconds) is given up after
C{beatTimeout} seconds and made anew. Other replicas hear these beats
too and ignore them.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable

import psycopg

from svcd.auth.cache import ValidationCache
from svcd.auth.feed import ChangeHub
from svcd.auth.limits import BudgetsTable, LimitsTable, MemorySettingsTable
from svcd.auth.store import Store
from svcd.auth.store.base import APPLICATION_ROLE
from svcd.common.ids import parseUUID
from svcd.common.listening import BeatsStopped, ListeningThread
from svcd.common.pgtransactions import StoreUnavailable

CHANNEL = "svc_auth_changes"


class ChangeListener(ListeningThread[Store]):
    """
    @param hub: the change feed to hand changes and heartbeats to, if any.
    @param limits: the table of limits to load and keep current, if any.
    @param budgets: the table of budgets to load and keep current, if any.
    @param memorySettings: the table of memory settings to load and keep
        current, if any.
    @param reconnectDelay: seconds between attempts while the database is
        unreachable.
    @param beatInterval: seconds between beats; also how often the thread
        wakes to notice a stop request.
    @param monotonic: a monotonic clock in seconds.
    """

    channel = CHANNEL
    # Rows are read on this connection, as the role that row-level
    # security applies to (decisions D7).
    role = APPLICATION_ROLE
    applicationName = "svc-auth-listener"
    threadName = "svc-auth-change-listener"
    lostWarning = (
        "Change listener lost its database connection ({error}); "
        "cached validations now expire after one second"
    )
    failures = (*ListeningThread.failures, StoreUnavailable)

    def __init__(
        self,
        dsn: str,
        cache: ValidationCache,
        hub: ChangeHub | None = None,
        limits: LimitsTable | None = None,
        budgets: BudgetsTable | None = None,
        reconnectDelay: float = 1.0,
        beatInterval: float = 0.1,
        beatLag: float = 0.25,
        beatTimeout: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
        memorySettings: MemorySettingsTable | None = None,
    ) -> None:
        super().__init__(dsn, reconnectDelay)
        self._cache = cache
        self._hub = hub
        self._limits = limits
        self._budgets = budgets
        self._memorySettings = memorySettings
        self._beatInterval = beatInterval
        self._beatLag = beatLag
        self._beatTimeout = beatTimeout
        self._monotonic = monotonic

    def _begin(self, connection: psycopg.Connection[object]) -> Store:
        store = Store(lambda: contextlib.nullcontext(connection))
        # After LISTEN: a change committed from now on is both announced
        # and maybe in these reads, never in neither.
        # Each load answered is news of the connection for the watchdog:
        # only a server that stopped answering is cut off.
        if self._limits is not None:
            self._limits.replace(store.allLimits())
            self._heard()
        if self._budgets is not None:
            self._budgets.replace(store.allBudgets())
            self._heard()
        if self._memorySettings is not None:
            self._memorySettings.replace(store.allMemorySettings())
            self._heard()
        self._cache.listening()
        if self._hub is not None:
            self._hub.listenerUp()
        self.log.info("Listening for token, agent, limits, budget and memory settings changes")
        return store

    def _lost(self) -> None:
        if self._limits is not None:
            self._limits.notCurrent()
        if self._budgets is not None:
            self._budgets.notCurrent()
        if self._memorySettings is not None:
            self._memorySettings.notCurrent()
        self._cache.notListening()
        if self._hub is not None:
            self._hub.listenerDown()

    def _drain(self, connection: psycopg.Connection[object], store: Store) -> None:
        """
        Send a beat every C{beatInterval} seconds and apply each
        notification, in the order PostgreSQL delivers them, until asked to
        stop or the connection fails.

        A limits notification needs a query on this very connection, which
        cannot run while psycopg's C{notifies()} generator is open (it holds
        the connection's lock), and a generator left early loses the rest
        of the packet it was yielding. So each C{notifies()} call returns
        after the first packet and is read whole; its notifications are
        applied after it, in order, and a beat heard after a change is
        still handled after it. Notifications that arrive meanwhile wait in
        psycopg's backlog for the next call.
        """
        nonce = uuid.uuid4().hex
        sent: dict[int, float] = {}
        number = 0
        lastBack = nextBeat = self._monotonic()
        while not self._stopping.is_set():
            now = self._monotonic()
            if now >= nextBeat:
                number += 1
                sent[number] = now
                nextBeat = now + self._beatInterval
                connection.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"beat:{nonce}:{number}"))
                self._stayOnTarget(connection)
            wait = max(0.0, nextBeat - self._monotonic())
            for notification in list(connection.notifies(timeout=wait, stop_after=1)):
                payload = notification.payload
                if payload.startswith("beat:"):
                    if self._beatCameBack(payload, nonce, sent):
                        lastBack = self._monotonic()
                        self._heard()
                    continue
                self._apply(payload, store)
            if self._monotonic() - lastBack > self._beatTimeout:
                raise BeatsStopped(f"no beat came back for {self._beatTimeout}s")

    def _beatCameBack(self, payload: str, nonce: str, sent: dict[int, float]) -> bool:
        """
        Handle a beat; True when it is one of ours, in which case every
        change committed before it was sent has been applied.
        """
        parts = payload.split(":")
        if len(parts) != 3 or parts[1] != nonce or not parts[2].isdigit():
            return False
        numberText = parts[2]
        number = int(numberText)
        sentAt = sent.pop(number, None)
        # Beats come back in order: older ones still waiting never will.
        for older in [each for each in sent if each < number]:
            del sent[older]
        if sentAt is None:
            return False
        if self._hub is not None and self._monotonic() - sentAt <= self._beatLag:
            self._hub.heartbeat()
        return True

    def _apply(self, payload: str, store: Store) -> None:
        kind, _, identifier = payload.partition(":")
        if kind in ("limits", "budget", "memory_settings"):
            self._applyRow(kind, identifier, store)
            return
        parsed: uuid.UUID | None = parseUUID(identifier)
        if parsed is None:
            self.log.warn("Ignoring a malformed change notification")
            return
        if kind == "token":
            self._cache.forgetToken(parsed)
            if self._hub is not None:
                self._hub.tokenChanged(parsed)
        elif kind == "agent":
            self._cache.forgetAgent(parsed)
            if self._hub is not None:
                self._hub.agentChanged(parsed)

    def _applyRow(self, kind: str, identifiers: str, store: Store) -> None:
        """
        A limits row, a budget or a memory settings row changed
        (C{<org_id>:<agent_id or empty>}):
        re-read it, put it in its table, then hand it to the feed, so that a
        stream that starts from the table meanwhile misses nothing.

        A failed read raises L{StoreUnavailable}, which ends this session:
        the next one loads the whole tables again.
        """
        orgText, _, agentText = identifiers.partition(":")
        orgID = parseUUID(orgText)
        agentID = parseUUID(agentText) if agentText else None
        if orgID is None or (agentText and agentID is None):
            self.log.warn("Ignoring a malformed change notification")
            return
        if kind == "limits":
            if self._limits is None and self._hub is None:
                return
            row = store.limits(orgID, agentID)
            if self._limits is not None:
                self._limits.put(orgID, agentID, row)
            if self._hub is not None:
                self._hub.limitsChanged(orgID, agentID, row)
            return
        if kind == "memory_settings":
            if self._memorySettings is None and self._hub is None:
                return
            settings = store.memorySettings(orgID, agentID)
            if self._memorySettings is not None:
                self._memorySettings.put(orgID, agentID, settings)
            if self._hub is not None:
                self._hub.memorySettingsChanged(orgID, agentID, settings)
            return
        if self._budgets is None and self._hub is None:
            return
        budget = store.budget(orgID, agentID)
        if self._budgets is not None:
            self._budgets.put(orgID, agentID, budget)
        if self._hub is not None:
            self._hub.budgetChanged(orgID, agentID, budget)
