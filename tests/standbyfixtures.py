"""
The harness of the PostgreSQL failover tests (decisions D16): a primary and
a streaming standby (L{svcd.devkit.pgstandby.StreamingPair}) with a
migrated database, and the ledger rows the tests write and look for.
"""

from __future__ import annotations

import contextlib
import datetime
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
from waiting import waitUntil

from svcd.auth.store.ledger import UsageRecord
from svcd.common.ids import uuid7Text
from svcd.common.migrations import migrate
from svcd.devkit.pgstandby import StreamingPair
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.servers import MissingBinaries

DATABASE = "failover"


@attrs.frozen
class MigratedPair:
    """
    A running pair whose primary holds the migrated database C{DATABASE}
    (streamed to the standby), and the DSNs naming it on both servers.
    """

    pair: StreamingPair

    def dsn(self, first: str = "primary") -> str:
        """
        The DSN of both servers with target_session_attrs=read-write,
        C{first} ("primary" or "standby") named first.
        """
        dsn = self.pair.dsn(DATABASE)
        if first == "standby":
            primary, standby = (f"127.0.0.1:{each.port}" for each in self.servers)
            dsn = dsn.replace(f"{primary},{standby}", f"{standby},{primary}")
        return dsn

    @property
    def servers(self) -> tuple[PostgresServer, PostgresServer]:
        return self.pair.primary, self.pair.standby

    def only(self, server: PostgresServer) -> str:
        """
        The DSN of the database on C{server} alone.
        """
        return server.superuserDSN(DATABASE)


@contextlib.contextmanager
def migratedPair(directory: Path) -> Iterator[MigratedPair]:
    """
    A L{MigratedPair} under C{directory}, destroyed afterwards; the test
    is skipped, with the reason in one line, where pg_basebackup or the
    server programs are not installed.
    """
    try:
        pair = StreamingPair.start(directory, inMemory=True)
    except MissingBinaries as error:
        pytest.skip(f"a PostgreSQL standby needs the server programs: {error}")
    try:
        pair.primary.createDatabase(DATABASE)
        migrate(pair.dsn(DATABASE))
        yield MigratedPair(pair)
    finally:
        pair.destroy()


def fence(server: PostgresServer) -> None:
    """
    Make C{server} a fenced old primary, as a failover manager may leave
    one that it could not stop: up, read-only, and (its standby promoted
    away) waiting for no synchronous standby.
    """
    server.alterSystem({"default_transaction_read_only": "on", "synchronous_standby_names": ""})

    def reloaded() -> bool:
        # A new backend is forked by a postmaster that has read the file
        # again, and that signalled every existing backend before.
        with server.connect() as connection:
            row = connection.execute("SHOW default_transaction_read_only").fetchone()
        return row is not None and row[0] == "on"

    waitUntil(reloaded, 10.0)


def usageRecord(orgID: uuid.UUID, **changes: Any) -> UsageRecord:
    """
    A valid ledger row of C{orgID}, with a key of its own.
    """
    fields: dict[str, Any] = {
        "ledgerID": uuid7Text(),
        "requestID": str(uuid.uuid4()),
        "orgID": orgID,
        "agentID": None,
        "tokenID": None,
        "modelRequested": "fast",
        "model": "fast",
        "provider": "local",
        "upstreamModel": "llama",
        "stream": False,
        "outcome": "ok",
        "promptTokens": 100,
        "cachedTokens": 0,
        "completionTokens": 50,
        "reasoningTokens": 0,
        "tokensFrom": "provider",
        "costNanoUSD": 1_000,
        "priceVersion": "v1",
        "startedAt": datetime.datetime(2026, 6, 1, tzinfo=datetime.UTC),
        "durationUS": 1,
    }
    fields.update(changes)
    return UsageRecord(**fields)


def ledgerRequestIDs(dsn: str) -> set[str]:
    """
    The request ids of every ledger row, read as the schema owner.
    """
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as connection:
        rows = connection.execute("SELECT request_id FROM usage_ledger").fetchall()
    return {str(row[0]) for row in rows}


def isPrimary(dsn: str) -> bool:
    """
    Whether the one server of C{dsn} answers and is not in recovery (a
    fenced old primary, read-only, is not in recovery either).
    """
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as connection:
            row = connection.execute("SELECT pg_is_in_recovery()").fetchone()
    except psycopg.OperationalError:
        return False
    return row is not None and not row[0]


def applicationsOn(dsn: str, name: str) -> int:
    """
    How many connections named C{name} (application_name) the one server
    of C{dsn} has.
    """
    with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as connection:
        row = connection.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchone()
    return 0 if row is None else int(row[0])
