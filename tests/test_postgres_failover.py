"""
PostgreSQL with several hosts (decisions D16), below the daemons: the DSN
forms svc-auth and svc-memory read, and their pool and change listener
over a real primary and its streaming standby (tests/standbyfixtures.py),
through a crash of the primary and through a primary fenced by being made
read-only while the standby is promoted. The daemons themselves, with a
proxy, are tests/test_gateway_pgfailover.py.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from authfixtures import makeTenant, ownerStore
from standbyfixtures import (
    MigratedPair,
    applicationsOn,
    fence,
    isPrimary,
    ledgerRequestIDs,
    migratedPair,
    usageRecord,
)
from waiting import waitUntil

from svcd.auth.cache import ValidationCache
from svcd.auth.config import AuthConfig
from svcd.auth.listener import ChangeListener
from svcd.auth.store import Store
from svcd.auth.store.base import connectionPool
from svcd.common import pgtransactions
from svcd.common.config import ConfigError
from svcd.common.pgtransactions import StoreUnavailable, sessionTarget, withTCPSettings
from svcd.memory.config import MemoryConfig

# How long the tests give a pool or a listener to find the new primary
# once it takes writes: the pool tries again at most 2 s apart
# (pgtransactions.RECONNECT_TIMEOUT) and a caller waits 2 s for a
# connection; the rest is slack for a loaded machine.
FOLLOWS_WITHIN = 10.0


@pytest.mark.parametrize(
    "dsn",
    [
        "host=db1.example,db2.example port=5432,5433 dbname=svc user=svc"
        " target_session_attrs=read-write",
        "postgresql://svc:secret@db1.example:5432,db2.example:5433/svc"
        "?target_session_attrs=read-write",
        "postgresql://svc@db1.example,db2.example/svc?target_session_attrs=primary",
    ],
)
def test_bothFormsOfSeveralHostsAreRead(dsn: str) -> None:
    """
    libpq's key/value form (C{host=a,b port=p1,p2}) and its URI form
    (C{postgresql://a:p1,b:p2/db}) are read by both daemons, the DSN kept
    as written, and the pool and listener find what it asks for.
    """
    for read in (AuthConfig.fromEnvironment, MemoryConfig.fromEnvironment):
        assert read({"POSTGRES_DSN": dsn}).postgresDSN == dsn
    assert sessionTarget(dsn) in ("read-write", "primary")


@pytest.mark.parametrize(
    ("dsn", "problem"),
    [
        ("host=a,b,c port=1,2 dbname=svc", "names 3 host(s) but 2 ports"),
        ("host=a,b dbname=svc target_session_attrs=standby", "target_session_attrs=standby"),
        ("postgresql://a,b/svc?target_session_attrs=prefer-standby", "prefer-standby"),
        ("host=a dbname=svc target_session_attrs=read-only", "takes no writes"),
        ("host=a,b dbname=svc target_session_attrs=s3cret", "libpq does not know"),
    ],
)
def test_aDSNThatCannotFindAWritableServerIsRefused(dsn: str, problem: str) -> None:
    """
    A DSN libpq could never write through is refused at the start, never
    quoting the DSN's own text beyond a known target.
    """
    for read in (AuthConfig.fromEnvironment, MemoryConfig.fromEnvironment):
        with pytest.raises(ConfigError) as raised:
            read({"POSTGRES_DSN": dsn})
        assert raised.value.variable == "POSTGRES_DSN"
        assert problem in raised.value.problem
        assert "s3cret" not in str(raised.value)


def test_theDSNsOwnTCPSettingsWin() -> None:
    """
    The daemon's keepalives and tcp_user_timeout apply unless the DSN sets
    its own, which psycopg's keyword arguments would otherwise override;
    the URI form of several hosts comes out as the same servers.
    """
    plain = conninfo_to_dict(withTCPSettings("host=a dbname=svc"))
    assert {name: int(str(plain[name])) for name in pgtransactions.TCP_SETTINGS} == dict(
        pgtransactions.TCP_SETTINGS
    )
    mine = conninfo_to_dict(
        withTCPSettings(
            "postgresql://svc@a:1,b:2/svc?keepalives_idle=30&tcp_user_timeout=0"
            "&target_session_attrs=read-write"
        )
    )
    assert (mine["keepalives_idle"], mine["tcp_user_timeout"], mine["keepalives"]) == (
        "30",
        "0",
        "1",
    )
    assert (mine["host"], mine["port"], mine["target_session_attrs"]) == (
        "a,b",
        "1,2",
        "read-write",
    )
    assert sessionTarget("host=a dbname=svc") == "any"


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[MigratedPair]:
    with migratedPair(tmp_path) as running:
        yield running


@contextlib.contextmanager
def appStore(dsn: str, size: int = 3) -> Iterator[Store]:
    """
    svc-auth's store on its pool, as the daemon has it.
    """
    pool = connectionPool(
        dsn, minimum=size, maximum=size, statementTimeout=5.0, applicationName="failover-test"
    )
    pool.open(wait=True, timeout=10.0)
    try:
        yield Store(pool.connection, dropDeadConnections=pool.check)
    finally:
        pool.close(timeout=5.0)


def recordsOnce(store: Store, orgID: uuid.UUID) -> bool:
    try:
        store.recordUsage([usageRecord(orgID)])
    except StoreUnavailable:
        return False
    return True


def test_theStoreFollowsACrashAndPromotion(pair: MigratedPair) -> None:
    """
    With the standby named first, the pool still writes on the primary;
    the primary killed and the standby promoted, the same pool writes on
    the new primary within seconds, every row it acknowledged before is
    there (the standby is synchronous), and a batch sent again, as the
    proxy's journal sends what was not acknowledged, is recorded once.
    """
    primary, standby = pair.servers
    owner, connection = ownerStore(pair.dsn())
    tenant = makeTenant(owner, "acme")
    connection.close()
    with appStore(pair.dsn(first="standby")) as store:
        before = [usageRecord(tenant.orgID) for _ in range(5)]
        assert store.recordUsage(before).recorded == 5
        assert {row.requestID for row in before} <= ledgerRequestIDs(pair.only(primary))
        pair.pair.failOver()
        promoted = time.monotonic()
        took = waitUntil(lambda: recordsOnce(store, tenant.orgID), FOLLOWS_WITHIN, 0.05)
        print(f"\nthe pool wrote on the new primary {took:.2f} s after the promotion")
        assert {row.requestID for row in before} <= ledgerRequestIDs(pair.only(standby))
        again = store.recordUsage(before)
        assert (again.recorded, again.duplicates) == (0, 5)
        assert time.monotonic() - promoted < FOLLOWS_WITHIN


def test_aPrimaryMadeReadOnlyIsLeft(pair: MigratedPair) -> None:
    """
    A primary fenced by making it read-only while the standby is promoted
    keeps the pool's connections open: the first write on one of them is
    refused (SQLSTATE 25006, answered UNAVAILABLE), and that connection and
    the pool's other ones to that server are dropped, so that the next
    writes, within seconds, land on the new primary.
    """
    primary, standby = pair.servers
    owner, connection = ownerStore(pair.dsn())
    tenant = makeTenant(owner, "acme")
    connection.close()
    with appStore(pair.dsn()) as store:
        assert recordsOnce(store, tenant.orgID)
        fence(primary)
        standby.promote()
        failures = 0
        while not recordsOnce(store, tenant.orgID):
            failures += 1
            assert failures < 20, "the pool kept its connections to the read-only server"
        assert isPrimary(pair.only(primary))  # still up: it was fenced, not killed
        waitUntil(lambda: applicationsOn(pair.only(primary), "failover-test") == 0, 5.0)
        waitUntil(lambda: applicationsOn(pair.only(standby), "failover-test") == 3, 5.0)


def test_withoutLeavingTheReadOnlyServerWritesKeepFailing(
    pair: MigratedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    The counterpart of the test above, so that it cannot pass for a
    reason of its own: a pool that keeps connections to a server gone
    read-only goes on failing writes there.
    """
    monkeypatch.setattr(pgtransactions, "offTarget", lambda connection, target: False)
    primary, standby = pair.servers
    owner, connection = ownerStore(pair.dsn())
    tenant = makeTenant(owner, "acme")
    connection.close()
    with appStore(pair.dsn()) as store:
        assert recordsOnce(store, tenant.orgID)
        fence(primary)
        standby.promote()
        assert not any(recordsOnce(store, tenant.orgID) for _ in range(10))


@pytest.mark.parametrize("fenced", [True, False])
def test_theChangeListenerMovesToTheNewPrimary(pair: MigratedPair, fenced: bool) -> None:
    """
    svc-auth's change listener, on the primary, listens on the new one
    within seconds of the promotion, whether the old one was killed or
    fenced read-only (notifications are a server's own: one left on the
    old primary would hear none of the changes written on the new one).
    """
    primary, standby = pair.servers
    listener = ChangeListener(pair.dsn(), ValidationCache(time.monotonic), reconnectDelay=0.2)
    listener.start()
    try:
        waitUntil(lambda: applicationsOn(pair.only(primary), "svc-auth-listener") == 1, 10.0)
        if fenced:
            fence(primary)
            standby.promote()
        else:
            pair.pair.failOver()
        took = waitUntil(
            lambda: applicationsOn(pair.only(standby), "svc-auth-listener") == 1,
            FOLLOWS_WITHIN,
        )
        print(f"\nthe listener listened on the new primary {took:.2f} s after the promotion")
        if fenced:
            waitUntil(lambda: applicationsOn(pair.only(primary), "svc-auth-listener") == 0, 5.0)
    finally:
        listener.stop()


def test_aListenerKeptOnTheFencedPrimaryWouldStay(
    pair: MigratedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    The counterpart of the fenced case above: without the check of the
    server at each beat, the listener stays on the read-only old primary,
    hearing its own beats and nothing written on the new one.
    """
    monkeypatch.setattr("svcd.common.listening.offTarget", lambda connection, target: False)
    primary, standby = pair.servers
    listener = ChangeListener(pair.dsn(), ValidationCache(time.monotonic), reconnectDelay=0.2)
    listener.start()
    try:
        waitUntil(lambda: applicationsOn(pair.only(primary), "svc-auth-listener") == 1, 10.0)
        fence(primary)
        standby.promote()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert applicationsOn(pair.only(standby), "svc-auth-listener") == 0
            time.sleep(0.2)
        assert applicationsOn(pair.only(primary), "svc-auth-listener") == 1
    finally:
        listener.stop()


def test_aDSNWithoutATargetMayChooseTheStandby(pair: MigratedPair) -> None:
    """
    Why the target is needed: without target_session_attrs, libpq takes
    the first server that answers, here the standby named first, where
    every write fails.
    """
    dsn = pair.dsn(first="standby").replace("?target_session_attrs=read-write", "")
    with psycopg.connect(dsn, autocommit=True) as connection:
        row = connection.execute("SELECT pg_is_in_recovery()").fetchone()
    assert row is not None and row[0] is True
