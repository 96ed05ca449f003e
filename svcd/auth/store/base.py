"""
What each of svc-auth's stores (L{svcd.auth.store}) is built on: the role
its connections act as, its pool, one transaction per call in the
caller's tenant context (L{svcd.common.pgtransactions.runTransaction}),
and the small helpers its queries share.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import Histogram
from psycopg_pool import ConnectionPool

from svcd.common import pgtransactions
from svcd.common.pgtransactions import ConnectionSource, Cursor, StoreUnavailable, runTransaction

T = TypeVar("T")

APPLICATION_ROLE = "svc_auth_app"


def connectionPool(
    dsn: str,
    *,
    minimum: int,
    maximum: int,
    statementTimeout: float,
    applicationName: str,
) -> ConnectionPool:
    """
    svc-auth's pool of autocommit connections, not yet opened
    (L{pgtransactions.connectionPool}): every connection acts as
    svc_auth_app, the role row-level security applies to.
    """
    return pgtransactions.connectionPool(
        dsn,
        role=APPLICATION_ROLE,
        minimum=minimum,
        maximum=maximum,
        statementTimeout=statementTimeout,
        applicationName=applicationName,
    )


def rowIs(orgID: uuid.UUID, agentID: uuid.UUID | None) -> tuple[str, tuple[uuid.UUID, ...]]:
    """
    The condition naming the row of an organization (C{agentID} None) or of
    one of its agents in limits or budgets, written so that each kind of
    row is found through its own unique index.
    """
    if agentID is None:
        return "org_id = %s AND agent_id IS NULL", (orgID,)
    return "org_id = %s AND agent_id = %s", (orgID, agentID)


R = TypeVar("R")


def optionalRow(convert: Callable[[dict[str, Any]], R], row: dict[str, Any] | None) -> R | None:
    return None if row is None else convert(row)


def oneRow(row: dict[str, Any] | None) -> dict[str, Any]:
    if row is None:
        raise StoreUnavailable("a RETURNING clause returned no row")
    return row


class StoreBase:
    """
    The tenant-scoped queries of svc-auth over a source of connections:
    what each store of a domain extends.

    @param connections: returns a context manager yielding an autocommit
        connection; a psycopg_pool pool's C{connection} method for the
        daemon, one plain connection for svcctl.
    @param queryDuration: svc_db_query_duration_seconds, labelled by
        operation, or None.
    @param dropDeadConnections: called when a connection is found dead
        before a transaction has done anything (a database restart); the
        pool's C{check}, which replaces every idle connection that died
        with it, so that the retry does not take another dead one.
    """

    def __init__(
        self,
        connections: ConnectionSource,
        queryDuration: Histogram | None = None,
        dropDeadConnections: Callable[[], None] | None = None,
    ) -> None:
        self._connections = connections
        self._queryDuration = queryDuration
        self._dropDeadConnections = dropDeadConnections

    def _run(
        self,
        operation: str,
        body: Callable[[Cursor], T],
        *,
        orgID: uuid.UUID | None = None,
        lookupTokenID: uuid.UUID | None = None,
    ) -> T:
        """
        Run C{body} in one transaction in the given tenant context
        (L{runTransaction}).
        """
        return runTransaction(
            self._connections,
            operation,
            body,
            (
                ("svc.org_id", str(orgID) if orgID else ""),
                ("svc.token_id", str(lookupTokenID) if lookupTokenID else ""),
            ),
            queryDuration=self._queryDuration,
            dropDeadConnections=self._dropDeadConnections,
        )

    def ping(self) -> None:
        """
        A trivial round trip through the pool, for readiness.
        """
        self._run("ping", lambda cursor: cursor.execute("SELECT 1"))
