"""
The change listener: one dedicated thread with its own PostgreSQL
connection, LISTENing on svc_auth_changes and dropping cache entries as
tokens and agents change (sql/0003_change_notifications.sql).

It reports its state to the cache: while it is connected, cached entries
are trusted; while it is not, they live at most one second. So losing the
listener costs speed, never correctness.
"""

from __future__ import annotations

import threading
import uuid

import psycopg
from twisted.logger import Logger

from svcd.auth.cache import ValidationCache
from svcd.common.ids import parseUUID

CHANNEL = "svc_auth_changes"


class ChangeListener:
    """
    @param reconnectDelay: seconds between attempts while the database is
        unreachable.
    @param pollInterval: how often the thread wakes to notice a stop
        request.
    """

    log = Logger()

    def __init__(
        self,
        dsn: str,
        cache: ValidationCache,
        reconnectDelay: float = 1.0,
        pollInterval: float = 0.25,
    ) -> None:
        self._dsn = dsn
        self._cache = cache
        self._reconnectDelay = reconnectDelay
        self._pollInterval = pollInterval
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
                    self.log.info("Listening for token and agent changes")
                    connectedBefore = True
                    self._drain(connection)
            except psycopg.Error as error:
                self._cache.notListening()
                if connectedBefore:
                    self.log.warn(
                        "Change listener lost its database connection ({error}); "
                        "cached validations now expire after one second",
                        error=type(error).__name__,
                    )
                    connectedBefore = False
                self._stopping.wait(self._reconnectDelay)
        self._cache.notListening()

    def _drain(self, connection: psycopg.Connection[object]) -> None:
        while not self._stopping.is_set():
            for notification in connection.notifies(timeout=self._pollInterval):
                self._apply(notification.payload)

    def _apply(self, payload: str) -> None:
        kind, _, identifier = payload.partition(":")
        parsed: uuid.UUID | None = parseUUID(identifier)
        if parsed is None:
            self.log.warn("Ignoring a malformed change notification")
            return
        if kind == "token":
            self._cache.forgetToken(parsed)
        elif kind == "agent":
            self._cache.forgetAgent(parsed)
