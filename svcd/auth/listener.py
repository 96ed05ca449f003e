"""
The change listener: one dedicated thread with its own PostgreSQL
connection, LISTENing on svc_auth_changes, dropping cache entries as
tokens and agents change (sql/0003_change_notifications.sql,
sql/0004_change_feed.sql) and handing every change to the change feed
(L{svcd.auth.feed.ChangeHub}).

It reports its state to the cache: while it is connected, cached entries
are trusted; while it is not, they live at most one second. So losing the
listener costs speed, never correctness.

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

import threading
import time
import uuid
from collections.abc import Callable

import psycopg
from twisted.logger import Logger

from svcd.auth.cache import ValidationCache
from svcd.auth.feed import ChangeHub
from svcd.common.ids import parseUUID

CHANNEL = "svc_auth_changes"


class _BeatsStopped(Exception):
    """
    No beat came back for too long: the connection is presumed dead.
    """


class ChangeListener:
    """
    @param hub: the change feed to hand changes and heartbeats to, if any.
    @param reconnectDelay: seconds between attempts while the database is
        unreachable.
    @param beatInterval: seconds between beats; also how often the thread
        wakes to notice a stop request.
    @param monotonic: a monotonic clock in seconds.
    """

    log = Logger()

    def __init__(
        self,
        dsn: str,
        cache: ValidationCache,
        hub: ChangeHub | None = None,
        reconnectDelay: float = 1.0,
        beatInterval: float = 0.1,
        beatLag: float = 0.25,
        beatTimeout: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dsn = dsn
        self._cache = cache
        self._hub = hub
        self._reconnectDelay = reconnectDelay
        self._beatInterval = beatInterval
        self._beatLag = beatLag
        self._beatTimeout = beatTimeout
        self._monotonic = monotonic
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._run, name="svc-auth-change-listener", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """
        Ask the thread to finish and wait for it (blocking; call from a
        thread or at shutdown).
        """
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        connectedBefore = False
        while not self._stopping.is_set():
            try:
                with psycopg.connect(
                    self._dsn,
                    autocommit=True,
                    connect_timeout=3,
                    application_name="svc-auth-listener",
                    # Notice a silently dead peer within about 10 seconds.
                    keepalives=1,
                    keepalives_idle=5,
                    keepalives_interval=2,
                    keepalives_count=3,
                ) as connection:
                    connection.execute(f"LISTEN {CHANNEL}")
                    self._cache.listening()
                    if self._hub is not None:
                        self._hub.listenerUp()
                    self.log.info("Listening for token and agent changes")
                    connectedBefore = True
                    self._drain(connection)
            except (psycopg.Error, _BeatsStopped) as error:
                self._lost()
                if connectedBefore:
                    self.log.warn(
                        "Change listener lost its database connection ({error}); "
                        "cached validations now expire after one second",
                        error=type(error).__name__,
                    )
                    connectedBefore = False
                self._stopping.wait(self._reconnectDelay)
        self._lost()

    def _lost(self) -> None:
        self._cache.notListening()
        if self._hub is not None:
            self._hub.listenerDown()

    def _drain(self, connection: psycopg.Connection[object]) -> None:
        nonce = uuid.uuid4().hex
        sent: dict[int, float] = {}
        number = 0
        lastBack = self._monotonic()
        while not self._stopping.is_set():
            number += 1
            sent[number] = self._monotonic()
            connection.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"beat:{nonce}:{number}"))
            for notification in connection.notifies(timeout=self._beatInterval):
                payload = notification.payload
                if payload.startswith("beat:"):
                    if self._beatCameBack(payload, nonce, sent):
                        lastBack = self._monotonic()
                    continue
                self._apply(payload)
            if self._monotonic() - lastBack > self._beatTimeout:
                raise _BeatsStopped(f"no beat came back for {self._beatTimeout}s")

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

    def _apply(self, payload: str) -> None:
        kind, _, identifier = payload.partition(":")
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
