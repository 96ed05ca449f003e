"""
What every store of svc-memory shares (L{svcd.memory.store}): connections
that act as svc_memory_app, one transaction per call in its organization's
context (L{BaseStore._run}), and what a call raises.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import psycopg
from prometheus_client import Histogram
from psycopg_pool import ConnectionPool

from svcd.common import pgtransactions
from svcd.common.pgtransactions import (
    StoreRejected,
    StoreUnavailable,
    StoreValueRefused,
    runTransaction,
)

__all__ = [
    "APPLICATION_ROLE",
    "BaseStore",
    "ConnectionSource",
    "Cursor",
    "MemoryForbidden",
    "MemoryNotFound",
    "ObservationForgotten",
    "ScopeFull",
    "StoreRejected",
    "StoreUnavailable",
    "StoreValueRefused",
    "connectionPool",
    "oneRow",
    "refuse",
]

T = TypeVar("T")

ConnectionSource = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]
Cursor = psycopg.Cursor[dict[str, Any]]

APPLICATION_ROLE = "svc_memory_app"


class MemoryNotFound(Exception):
    """
    No memory (or observation) has this id, in any organization.
    """


class ObservationForgotten(MemoryNotFound):
    """
    The observation is gone, taken by a deletion of its scope or agent
    (svcd/memory/forgetting.py), not dropped by an operator.
    """


class MemoryForbidden(Exception):
    """
    The id exists, but belongs to another organization, agent or subject.
    """


class ScopeFull(Exception):
    """
    The scope holds SVC_MEMORY_MAX_PER_SCOPE memories already.
    """


def connectionPool(
    dsn: str,
    *,
    minimum: int,
    maximum: int,
    statementTimeout: float,
    applicationName: str,
) -> ConnectionPool:
    """
    svc-memory's pool of autocommit connections, not yet opened
    (L{pgtransactions.connectionPool}): each acts as svc_memory_app,
    whatever role the DSN logs in as.
    """
    return pgtransactions.connectionPool(
        dsn,
        role=APPLICATION_ROLE,
        minimum=minimum,
        maximum=maximum,
        statementTimeout=statementTimeout,
        applicationName=applicationName,
    )


class BaseStore:
    """
    What each store of svc-memory (L{svcd.memory.store}) is built on: a
    source of connections that act as svc_memory_app.

    @param connections: returns a context manager yielding an autocommit
        connection; a psycopg_pool pool's C{connection} method for the
        daemon, one plain connection for svcctl and the listener.
    @param queryDuration: svc_db_query_duration_seconds, or None.
    @param dropDeadConnections: the pool's C{check}, called when a
        connection is found dead before a transaction did anything.
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
        orgID: uuid.UUID | None,
        *,
        binary: bool = False,
    ) -> T:
        """
        Run C{body} in one transaction in C{orgID}'s context (None: no
        organization, in which row-level security shows no row), as
        svc-auth's store runs its own (L{runTransaction}).
        """
        return runTransaction(
            self._connections,
            operation,
            body,
            (("svc.org_id", str(orgID) if orgID else ""),),
            queryDuration=self._queryDuration,
            dropDeadConnections=self._dropDeadConnections,
            binary=binary,
        )

    def ping(self) -> None:
        """
        A trivial round trip, for readiness.
        """
        self._run("ping", lambda cursor: cursor.execute("SELECT 1"), None)

    def notifySync(self, nonce: str) -> None:
        """
        Send the sync marker C{nonce} on the change listeners' channel,
        after a write has committed (L{svcd.memory.listener}).
        """
        self._run(
            "memory_sync",
            lambda cursor: cursor.execute(
                "SELECT pg_notify('svc_memory_changes', %s)", (f"sync:{nonce}",)
            ),
            None,
        )


def oneRow(row: dict[str, Any] | None) -> dict[str, Any]:
    if row is None:
        raise StoreUnavailable("a statement that returns a row returned none")
    return row


def refuse(cursor: Cursor, existence: str, identifier: uuid.UUID) -> None:
    """
    Raise why an id was not found in the caller's scope: it exists
    elsewhere (L{MemoryForbidden}) or nowhere (L{MemoryNotFound}).
    """
    cursor.execute(f"SELECT {existence}(%s) AS found", (identifier,))
    if oneRow(cursor.fetchone())["found"]:
        raise MemoryForbidden("the id belongs to another organization, agent or subject")
    raise MemoryNotFound("no such id")
