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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import psycopg
from prometheus_client import Histogram
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

T = TypeVar("T")

ConnectionSource = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]
Cursor = psycopg.Cursor[dict[str, Any]]


def connectionPool(
    dsn: str,
    *,
    role: str,
    minimum: int,
    maximum: int,
    statementTimeout: float,
    applicationName: str,
) -> ConnectionPool:
    """
    A daemon's pool of autocommit connections, not yet opened.

    Every connection acts as C{role}, the role row-level security applies
    to, whatever role the DSN logs in as (decisions D7); and no statement
    runs longer than C{statementTimeout}, since a caller with a 50 ms
    deadline has long given up by then.

    @param role: a role name of the schema (a constant, never the
        caller's text).
    """
    statementTimeoutMs = int(statementTimeout * 1000)

    def configure(connection: psycopg.Connection[Any]) -> None:
        connection.execute(f"SET ROLE {role}")
        connection.execute(f"SET statement_timeout = {statementTimeoutMs}")

    return ConnectionPool(
        dsn,
        min_size=minimum,
        max_size=maximum,
        kwargs={"autocommit": True, "connect_timeout": 3, "application_name": applicationName},
        configure=configure,
        # A caller waits at most this long for a free connection.
        timeout=2.0,
        name=applicationName,
        open=False,
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
    (C{dropDeadConnections}).

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
