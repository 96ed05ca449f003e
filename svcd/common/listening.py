"""
The connection loop of a change listener: a thread of its own with its own
PostgreSQL connection, LISTENing on one channel for as long as the daemon
runs, made anew whenever the connection fails.

svc-auth's listener (L{svcd.auth.listener}) and svc-memory's
(L{svcd.memory.listener}) differ in what they load when they connect and
in what a notification does, and in nothing else: both connect with TCP
keepalives (a silently dead peer is noticed within about ten seconds),
read as the role that row-level security applies to, bound every
statement, LISTEN before loading anything (a change committed from then on
is announced, and maybe also in the load, never in neither), give up a
connection whose beats stop coming back (L{BeatsStopped}), and retry
every C{reconnectDelay} seconds while the database is unreachable. Any
exception, expected or not, ends a connection the same way: the thread
never dies of one, and whatever was trusted is not any more. That
loop is here once; each listener says what it does once connected
(L{ListeningThread._begin}, L{ListeningThread._drain}) and once not
(L{ListeningThread._lost}).

After a failover (decisions D16) a listener must listen on the new
primary: notifications are the server's own, so one still connected to
the old primary, fenced by being made read-only, would go on hearing its
own beats and none of the changes written on the new one. So with a DSN
whose C{target_session_attrs} asks for a server taking writes, a listener
gives its connection up as soon as the server is off that target
(L{ListeningThread._stayOnTarget}, checked at every beat), and libpq finds
the new primary for the next one; what was missed in between is loaded
again, as after any lost connection.

A server that stops answering without closing (a stalled or frozen
process, whose kernel still acknowledges every packet, so that neither
keepalives nor tcp_user_timeout fire) would hold the thread in a read for
ever, and with it whatever the listener vouches for (svc-auth's cache
trusts its entries while listening). A watchdog thread cuts such a
connection (shuts its socket down, which ends the read with an error)
once none of the listener's beats has come back for L{BLOCKED_LIMIT}
seconds, and the loop connects anew, to the new primary after a failover
(libpq's connect_timeout, 3 s, passes over the silent one).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from typing import ClassVar, Generic, TypeVar

import psycopg
from twisted.logger import Logger

from svcd.common.pgtransactions import offTarget, sessionTarget, withTCPSettings

# No read of a listener's may hold up its notifications and beats for long.
STATEMENT_TIMEOUT_MS = 5_000

# How long a connection may go without answering (a beat back, a load
# done) before the watchdog cuts it: longer than any listener's own limit
# (svc-auth's 5 s, svc-memory's 1 s lease), which a thread that is not
# blocked applies itself, and than any one statement (STATEMENT_TIMEOUT_MS).
BLOCKED_LIMIT = 10.0

SessionT = TypeVar("SessionT")


class BeatsStopped(Exception):
    """
    None of the listener's own beats came back for too long: the
    connection is presumed dead.
    """


class ServerOffTarget(Exception):
    """
    The listener's server no longer takes writes, as the DSN asks
    (L{svcd.common.pgtransactions.offTarget}): writes now go elsewhere.
    """


class ListeningThread(Generic[SessionT]):
    """
    A listener's thread and connection loop.

    @cvar channel: the channel LISTENed on.
    @cvar role: the role its reads run as (row-level security's).
    @cvar applicationName: its connection's name in pg_stat_activity.
    @cvar threadName: its thread's name.
    @cvar lostWarning: logged once per episode of failures, with
        C{{error}}, the failure's type.
    @cvar failures: the failures expected of a connection, logged by
        their type alone: the database's errors and L{BeatsStopped}, and
        whatever a listener's store raises when a read fails. Any other
        exception ends a connection the same way (and is logged with
        where it was raised).
    """

    log = Logger()

    channel: ClassVar[str]
    role: ClassVar[str]
    applicationName: ClassVar[str]
    threadName: ClassVar[str]
    lostWarning: ClassVar[str]
    failures: ClassVar[tuple[type[Exception], ...]] = (
        psycopg.Error,
        BeatsStopped,
        ServerOffTarget,
    )

    def __init__(self, dsn: str, reconnectDelay: float) -> None:
        self._dsn = withTCPSettings(dsn)
        self._target = sessionTarget(dsn)
        self._reconnectDelay = reconnectDelay
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        # The socket of the connection in use and when a beat last came
        # back on it, under the lock (the watchdog reads them).
        self._watchLock = threading.Lock()
        self._socket: int | None = None
        self._lastHeard = 0.0

    def start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=self.threadName, daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(
            target=self._watch, name=f"{self.threadName}-watchdog", daemon=True
        )
        self._watchdog.start()

    def stop(self, timeout: float = 2.0) -> None:
        """
        Ask the thread to finish and wait for it (blocking; call from a
        thread or at shutdown).
        """
        self._stopping.set()
        for thread in (self._thread, self._watchdog):
            if thread is not None:
                thread.join(timeout)
        self._thread = self._watchdog = None

    def _heard(self) -> None:
        """
        The connection answered (one of the listener's beats came back, or
        a load finished): the watchdog leaves it for L{BLOCKED_LIMIT} more
        seconds.
        """
        with self._watchLock:
            self._lastHeard = time.monotonic()

    def _watching(self, connection: psycopg.Connection[object] | None) -> None:
        with self._watchLock:
            self._socket = None if connection is None else connection.pgconn.socket
            self._lastHeard = time.monotonic()

    def _watch(self, interval: float = 0.5) -> None:
        """
        The watchdog: cut the connection once no beat has come back on it
        for L{BLOCKED_LIMIT} seconds. The socket is duplicated under the
        lock, while it is surely the connection's (the listener forgets it
        under the lock before closing it), so that the shutdown can never
        reach another socket that took its number since.
        """
        while not self._stopping.wait(interval):
            with self._watchLock:
                if self._socket is None or time.monotonic() - self._lastHeard < BLOCKED_LIMIT:
                    continue
                duplicate = os.dup(self._socket)
                self._socket = None
            self.log.warn(
                "Change listener heard nothing back for {limit} s; cutting its connection",
                limit=BLOCKED_LIMIT,
            )
            with socket.socket(fileno=duplicate) as cut:
                try:
                    cut.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _run(self) -> None:
        """
        Listen until stopped, whatever fails: any exception, the
        database's or an unexpected one (a bug, a cache's), ends the
        connection the same way, the caches told (L{_lost}) and the
        connection made anew after C{reconnectDelay}; the thread never
        dies of it. One warning per I{episode} of failures (from the first
        to the next time listening begins), not one per attempt.
        """
        failing = False
        while not self._stopping.is_set():
            try:
                with psycopg.connect(
                    self._dsn,
                    autocommit=True,
                    connect_timeout=3,
                    application_name=self.applicationName,
                ) as connection:
                    self._watching(connection)
                    try:
                        connection.execute(f"SET ROLE {self.role}")
                        self._stayOnTarget(connection)
                        connection.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
                        connection.execute(f"LISTEN {self.channel}")
                        session = self._begin(connection)
                        self._heard()
                        failing = False
                        self._drain(connection, session)
                    finally:
                        self._watching(None)
            except Exception as error:
                self._lostSafely()
                if not failing:
                    failing = True
                    if isinstance(error, self.failures):
                        self.log.warn(self.lostWarning, error=type(error).__name__)
                    else:
                        # Unexpected (a bug): where it was raised, for whoever
                        # fixes it, but never its message, which may quote
                        # what it was handling (a row, a payload).
                        self.log.error(
                            self.lostWarning, error=type(error).__name__, where=_where(error)
                        )
                self._stopping.wait(self._reconnectDelay)
        self._lostSafely()

    def _lostSafely(self) -> None:
        try:
            self._lost()
        except Exception:
            self.log.failure("A change listener could not empty its caches")

    def _stayOnTarget(self, connection: psycopg.Connection[object]) -> None:
        """
        Give the connection up if its server is off the DSN's target: a
        listener calls this after each beat, whose answer brings the
        server's parameters up to date.

        @raise ServerOffTarget: it is.
        """
        if offTarget(connection, self._target):
            raise ServerOffTarget("the server no longer takes writes")

    def _begin(self, connection: psycopg.Connection[object]) -> SessionT:
        """
        Listening has begun on C{connection}: load what must be loaded
        whole, say so, and return what L{_drain} reads with.
        """
        raise NotImplementedError

    def _drain(self, connection: psycopg.Connection[object], session: SessionT) -> None:
        """
        Beat and apply notifications until C{_stopping} is set (return) or
        the connection fails (raise one of the errors L{_run} retries
        after).
        """
        raise NotImplementedError

    def _lost(self) -> None:
        """
        Not listening (any more, or yet): whatever was trusted because
        changes were heard must not be any longer.
        """
        raise NotImplementedError


def _where(error: BaseException) -> str:
    """
    The file and line an exception was raised at, innermost frame.
    """
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "unknown"
    return f"{frames[-1].filename}:{frames[-1].lineno}"
