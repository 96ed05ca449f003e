"""
A daemon's transactions in PostgreSQL, run one way for svc-auth's and
svc-memory's stores (and svcctl's, over one plain connection): the pool of
connections that act as the role row-level security applies to, one
transaction per call that first names its tenant, and the three errors a
store raises for whatever the database answered.

Every call blocks and so runs off the reactor thread: in grpcio's server
threads, in the HTTP side's dedicated database thread pool, in a change
listener's thread, or in svcctl. The tenant is set with C{set_config(...,
true)}, transaction-local, so a pooled connection never carries one
request's tenant into the next (sql/0002_row_level_security.sql).

A DSN may name several servers (libpq's C{host=a,b}, or
C{postgresql://a:5432,b:5432/svc}) with C{target_session_attrs=read-write}
(decisions D16): libpq then connects to the one that takes writes. What is
left to the daemon is not to keep a connection to a server that stopped
being that one (L{DaemonPool}, L{offTarget}), and to try the servers again
soon after a failover rather than after a long backoff
(L{RECONNECT_TIMEOUT}).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import psycopg
from prometheus_client import Histogram
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

T = TypeVar("T")

ConnectionSource = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]
Cursor = psycopg.Cursor[dict[str, Any]]

# How long the pool keeps trying to replace a lost connection, backing off
# (1 s, 2 s, ...), before it gives up on that attempt; a caller who then
# finds no connection makes it try again at once. psycopg_pool's default,
# five minutes, lets the backoff grow to a minute: a failover that took
# 30 s would cost another 30 s or more of answers after the new primary
# took writes. With 5 s no two attempts are more than 2 s apart while
# anyone is waiting for a connection.
RECONNECT_TIMEOUT = 5.0

# TCP settings of every connection of a daemon's (its pool's and its
# change listener's), unless the DSN sets them: a server that vanished
# without closing its connections (a machine powered off, a network cut
# during a failover) is noticed in about ten seconds, idle (keepalives)
# or in the middle of a statement (tcp_user_timeout, in ms, Linux), rather
# than after the kernel's retransmissions give up some fifteen minutes
# later, with a thread and a connection held meanwhile.
TCP_SETTINGS: Mapping[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}

# The values of target_session_attrs that ask for a server taking writes
# (libpq's "primary" is one not in recovery; "read-write" is one whose new
# transactions are not read-only either).
_WRITABLE_TARGETS = ("read-write", "primary")


def sessionTarget(dsn: str) -> str:
    """
    The C{target_session_attrs} a DSN asks for (libpq's default, C{any},
    when it names none); the DSN must be valid.
    """
    return str(psycopg.conninfo.conninfo_to_dict(dsn).get("target_session_attrs") or "any")


def withTCPSettings(dsn: str) -> str:
    """
    C{dsn} with L{TCP_SETTINGS} added, but those it sets itself (the
    keyword arguments of C{psycopg.connect} would override the DSN's).
    """
    given = psycopg.conninfo.conninfo_to_dict(dsn)
    missing = {name: value for name, value in TCP_SETTINGS.items() if name not in given}
    return psycopg.conninfo.make_conninfo(dsn, **missing)


def offTarget(connection: psycopg.Connection[Any], target: str) -> bool:
    """
    Whether the server of an open C{connection} is no longer what the
    DSN's C{target_session_attrs} (C{target}) asked of it when libpq
    connected: it has gone into recovery, or (for C{read-write}) its new
    transactions are read-only, so that writes would fail there with
    SQLSTATE 25006 while the new primary takes them elsewhere.

    Read from the parameters the server reports (PostgreSQL 14 and later
    report both, updated with the answer to any statement), so it costs
    no round trip; an older server reports neither and is taken as it was
    when connecting. Always False for a DSN that asks for any server.
    """
    if target not in _WRITABLE_TARGETS or connection.closed:
        return False
    status = connection.info.parameter_status
    if status("in_hot_standby") == "on":
        return True
    return target == "read-write" and status("default_transaction_read_only") == "on"


class DaemonPool(ConnectionPool):
    """
    A daemon's pool, which lets no connection go back into it once its
    server is off the DSN's target (L{offTarget}): a primary that answered
    read-only (a failover, a primary fenced by making it read-only) is
    left, and its other idle connections are closed too (psycopg_pool's
    C{drain}: the ones in use are closed as they come back), so that libpq
    finds the server that takes writes for the next ones.

    @param target: the DSN's C{target_session_attrs} (L{sessionTarget}).
    @param monotonic: the clock of L{DRAIN_INTERVAL}.
    """

    # At most one drain this often: callers that were using connections to
    # the old server when it turned read-only come back one by one, and
    # the drain already closed theirs (psycopg_pool closes what comes back
    # after a drain); a second drain would close the new ones.
    DRAIN_INTERVAL = 1.0

    def __init__(
        self,
        dsn: str,
        *,
        target: str,
        monotonic: Callable[[], float] = time.monotonic,
        **options: Any,
    ) -> None:
        super().__init__(dsn, **options)
        self._target = target
        self._monotonic = monotonic
        self._drainLock = threading.Lock()
        self._drainedAt = float("-inf")

    def putconn(self, conn: psycopg.Connection[Any]) -> None:
        if offTarget(conn, self._target):
            # Closed, psycopg_pool replaces it with a new connection rather
            # than keep it.
            conn.close()
            self._drainOnce()
        super().putconn(conn)

    def _drainOnce(self) -> None:
        with self._drainLock:
            now = self._monotonic()
            if now - self._drainedAt < self.DRAIN_INTERVAL:
                return
            self._drainedAt = now
        # Imported here: svcctl imports this module and loads no Twisted
        # (tests/floorselection.py); only a daemon's pool ever drains.
        from twisted.logger import Logger

        Logger(namespace=__name__).warn(
            "A PostgreSQL server no longer takes writes (target_session_attrs={target}):"
            " its connections are closed, new ones go to the server that does",
            target=self._target,
        )
        self.drain()


def connectionPool(
    dsn: str,
    *,
    role: str,
    minimum: int,
    maximum: int,
    statementTimeout: float,
    applicationName: str,
) -> DaemonPool:
    """
    A daemon's pool of autocommit connections, not yet opened.

    Every connection acts as C{role}, the role row-level security applies
    to, whatever role the DSN logs in as (decisions D7); and no statement
    runs longer than C{statementTimeout}, since a caller with a 50 ms
    deadline has long given up by then. A connection whose server left
    the DSN's target is not kept (L{DaemonPool}); a lost one is tried
    again for L{RECONNECT_TIMEOUT} at most, then whenever a caller waits.

    @param role: a role name of the schema (a constant, never the
        caller's text).
    """
    statementTimeoutMs = int(statementTimeout * 1000)

    def configure(connection: psycopg.Connection[Any]) -> None:
        connection.execute(f"SET ROLE {role}")
        connection.execute(f"SET statement_timeout = {statementTimeoutMs}")

    return DaemonPool(
        withTCPSettings(dsn),
        target=sessionTarget(dsn),
        min_size=minimum,
        max_size=maximum,
        kwargs={
            "autocommit": True,
            "connect_timeout": 3,
            "application_name": applicationName,
        },
        configure=configure,
        # A caller waits at most this long for a free connection.
        timeout=2.0,
        name=applicationName,
        open=False,
        reconnect_timeout=RECONNECT_TIMEOUT,
    )


class StoreUnavailable(Exception):
    """
    The database could not answer; the message is safe to show operators
    (it never quotes the DSN).
    """


class StoreRejected(Exception):
    """
    The database refused a change (a constraint such as a foreign key);
    the caller checked what it could, so this is the caller's mistake.
    """


class StoreValueRefused(Exception):
    """
    A value could not be stored or compared at all (psycopg's DataError: a
    NUL byte or a lone surrogate in a string, a number or a time out of
    range). The database is fine; the value is the caller's mistake.
    """


def runTransaction(
    connections: ConnectionSource,
    operation: str,
    body: Callable[[Cursor], T],
    context: Sequence[tuple[str, str]],
    *,
    queryDuration: Histogram | None = None,
    dropDeadConnections: Callable[[], None] | None = None,
    binary: bool = False,
) -> T:
    """
    Run C{body} in one transaction whose first statement sets C{context}
    (settings such as C{svc.org_id}, which the row-level security policies
    read; local to the transaction), for svc-auth's and svc-memory's
    stores alike; its time observed in C{queryDuration} by C{operation}.

    A pooled connection may have died since its last use (a database
    restart); that shows on the first statement, before C{body} has done
    anything, and only then the transaction is tried once more on a fresh
    connection, once the pool has dropped its other dead ones
    (C{dropDeadConnections}). Nothing is tried again once C{body} has
    begun: the connection may have died with the commit sent, and whether
    it was applied is for the caller's idempotent retry to settle (svc-
    proxy's ledger journal sends a batch again until it is acknowledged;
    svc-auth records each row once by its key). Nor after a server
    answered read-only (SQLSTATE 25006, a failover under way): that
    connection is not kept (L{DaemonPool}), and the caller is answered
    UNAVAILABLE at once rather than after a wait for the new primary.

    @raise StoreRejected: a constraint refused a write.
    @raise StoreValueRefused: the database cannot hold a value.
    @raise StoreUnavailable: any other failure of the database or the pool.
    """
    settings = ", ".join("set_config(%s, %s, true)" for _ in context)
    parameters = [each for pair in context for each in pair]
    started = time.perf_counter()
    try:
        for attempt in (1, 2):
            bodyStarted = False
            try:
                with connections() as connection, connection.transaction():
                    cursor = connection.cursor(row_factory=dict_row, binary=binary)
                    cursor.execute(f"SELECT {settings}", parameters)
                    bodyStarted = True
                    return body(cursor)
            except psycopg.OperationalError:
                if bodyStarted or attempt == 2:
                    raise
                if dropDeadConnections is not None:
                    # The other idle connections most likely died with
                    # this one: without this, the retry takes the next of
                    # them and the caller is answered UNAVAILABLE by a
                    # database that is up.
                    dropDeadConnections()
        raise AssertionError("unreachable")
    except psycopg.IntegrityError as error:
        raise StoreRejected(f"the database refused {operation}: {type(error).__name__}") from error
    except (psycopg.DataError, UnicodeEncodeError) as error:
        # Class 22 of SQLSTATE, or psycopg refusing to send the value (NUL
        # in text, a lone surrogate): never a sign of an outage.
        raise StoreValueRefused(
            f"the database cannot hold a value of {operation}: {type(error).__name__}"
        ) from error
    except psycopg.Error as error:
        raise StoreUnavailable(
            f"database error during {operation}: {type(error).__name__}"
        ) from error
    except PoolTimeout as error:
        raise StoreUnavailable(f"no database connection for {operation}") from error
    finally:
        if queryDuration is not None:
            queryDuration.labels(operation=operation).observe(time.perf_counter() - started)
