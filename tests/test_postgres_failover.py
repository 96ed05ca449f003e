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
from authfixtures import makeTenant, ownerStore
from psycopg.conninfo import conninfo_to_dict
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
from svcd.common import listening as listeningModule
from svcd.common import pgtransactions
from svcd.common.config import ConfigError
from svcd.common.listening import BLOCKED_LIMIT
from svcd.common.migrations import migrate
from svcd.common.pgtransactions import StoreUnavailable, sessionTarget, withTCPSettings
from svcd.devkit.postgres import PostgresServer
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


# How long the database is away in the test below: with psycopg_pool's
# own backoff an attempt is made about 15 s after the loss (1, 2, 4, 8 s
# apart, 10% jitter) and the next about 31 s after it, at least 5 s after
# the server is back even on a machine where it takes 5 s to start.
OUTAGE = 18.0


def test_aLostConnectionIsTriedAgainSoonAfterALongOutage(privatePostgres: PostgresServer) -> None:
    """
    After an outage of several seconds (a failover manager's), the pool
    answers within about 2 s of the server taking connections again, not
    when its backoff next allows (RECONNECT_TIMEOUT; with psycopg_pool's
    five minutes, this test measured 9.8 s; with 5 s, 0.1 s).
    """
    dsn = privatePostgres.createDatabase("outage")
    migrate(dsn)
    with appStore(dsn, size=2) as store:
        store.ping()
        privatePostgres.stop()
        started = time.monotonic()
        # Callers go on asking meanwhile, as the daemons' would.
        while time.monotonic() - started < OUTAGE:
            with contextlib.suppress(StoreUnavailable):
                store.ping()
        privatePostgres.start()
        took = waitUntil(lambda: pings(store), 30.0, 0.05)
    print(f"\nthe pool answered {took:.2f} s after the server was back")
    assert took < 4.5


def pings(store: Store) -> bool:
    try:
        store.ping()
    except StoreUnavailable:
        return False
    return True


@contextlib.contextmanager
def listening(dsn: str, cache: ValidationCache | None = None) -> Iterator[ChangeListener]:
    """
    svc-auth's change listener on C{dsn}, started, with the tests' quick
    reconnection.
    """
    listener = ChangeListener(dsn, cache or ValidationCache(time.monotonic), reconnectDelay=0.2)
    listener.start()
    try:
        yield listener
    finally:
        listener.stop()


LISTENER = "svc-auth-listener"


def test_aListenerBlockedOnASilentServerIsCutOff(privatePostgres: PostgresServer) -> None:
    """
    A server that stops answering without closing (frozen: its kernel
    still acknowledges, so no TCP timeout fires) holds svc-auth's
    listener in its next beat, where it cannot notice that beats stopped
    coming back; while it is held its cache trusts its entries. The
    watchdog cuts the connection once no beat came back for
    BLOCKED_LIMIT seconds: the cache stops trusting, and once the server
    answers again the listener listens again.
    """
    dsn = privatePostgres.createDatabase("silent")
    migrate(dsn)
    cache = ValidationCache(time.monotonic)
    with listening(dsn, cache):
        waitUntil(cache.isListening, 10.0)
        privatePostgres.freeze()
        try:
            took = waitUntil(lambda: not cache.isListening(), BLOCKED_LIMIT + 5.0, 0.05)
        finally:
            privatePostgres.thaw()
        print(f"\nthe listener stopped vouching {took:.2f} s after the server froze")
        assert took > BLOCKED_LIMIT - 2.0  # its own 5 s limit could not apply
        waitUntil(cache.isListening, 15.0)


def test_theStoreAndListenerFollowACrashAndPromotion(pair: MigratedPair) -> None:
    """
    With the standby named first, the pool and the change listener still
    connect to the primary (without target_session_attrs libpq would take
    the standby). The primary killed and the standby promoted, the same
    pool writes on the new primary and the same listener listens there
    within seconds; every row acknowledged before is there (the standby
    is synchronous), and a batch sent again, as the proxy's journal sends
    what was not acknowledged, is recorded once.
    """
    primary, standby = pair.servers
    untargeted = pair.dsn(first="standby").replace("?target_session_attrs=read-write", "")

    def takesTheStandby() -> bool:
        # libpq goes on to the next host when the first refuses a
        # connection, which a standby just made may still do (a floor run
        # of the suite landed on the primary once): wait until it takes
        # the standby, which it then must.
        with psycopg.connect(untargeted, autocommit=True) as chosen:
            row = chosen.execute("SELECT pg_is_in_recovery()").fetchone()
        return row is not None and row[0] is True

    waitUntil(takesTheStandby, 15.0, 0.1)
    owner, connection = ownerStore(pair.dsn())
    tenant = makeTenant(owner, "acme")
    connection.close()
    with appStore(pair.dsn(first="standby")) as store, listening(pair.dsn(first="standby")):
        waitUntil(lambda: applicationsOn(pair.only(primary), LISTENER) == 1, 10.0)
        before = [usageRecord(tenant.orgID) for _ in range(5)]
        assert store.recordUsage(before).recorded == 5
        assert {row.requestID for row in before} <= ledgerRequestIDs(pair.only(primary))
        pair.pair.failOver()
        promoted = time.monotonic()
        took = waitUntil(lambda: recordsOnce(store, tenant.orgID), FOLLOWS_WITHIN, 0.05)
        heard = waitUntil(
            lambda: applicationsOn(pair.only(standby), LISTENER) == 1,
            FOLLOWS_WITHIN - (time.monotonic() - promoted),
        )
        print(
            f"\nafter the promotion: the pool wrote on the new primary in {took:.2f} s,"
            f" the listener listened there {heard:.2f} s later"
        )
        assert {row.requestID for row in before} <= ledgerRequestIDs(pair.only(standby))
        again = store.recordUsage(before)
        assert (again.recorded, again.duplicates) == (0, 5)


def fencedFailover(pair: MigratedPair, store: Store, orgID: uuid.UUID) -> int:
    """
    Fence the primary (read-only, up) and promote the standby, with
    C{store}'s pool and a listener on the primary; how many writes failed
    before one succeeded (at most 20 tried).
    """
    primary, standby = pair.servers
    assert recordsOnce(store, orgID)
    waitUntil(lambda: applicationsOn(pair.only(primary), LISTENER) == 1, 10.0)
    fence(primary)
    standby.promote()
    failures = 0
    while not recordsOnce(store, orgID) and failures < 20:
        failures += 1
    return failures


def test_aPrimaryMadeReadOnlyIsLeft(pair: MigratedPair) -> None:
    """
    A primary fenced by making it read-only while the standby is promoted
    keeps the pool's and the listener's connections open. The first write
    on one of the pool's is refused (SQLSTATE 25006, answered UNAVAILABLE),
    and that connection and the pool's other ones to that server are
    dropped, so that the next write lands on the new primary; the listener
    leaves at its next beat (it would hear its own beats there and none of
    the new primary's changes).
    """
    primary, standby = pair.servers
    owner, connection = ownerStore(pair.dsn())
    tenant = makeTenant(owner, "acme")
    connection.close()
    with appStore(pair.dsn()) as store, listening(pair.dsn()):
        failures = fencedFailover(pair, store, tenant.orgID)
        assert 1 <= failures < 20, failures
        assert isPrimary(pair.only(primary))  # still up: it was fenced, not killed
        waitUntil(lambda: applicationsOn(pair.only(primary), "failover-test") == 0, 5.0)
        waitUntil(lambda: applicationsOn(pair.only(standby), "failover-test") == 3, 5.0)
        waitUntil(lambda: applicationsOn(pair.only(standby), LISTENER) == 1, FOLLOWS_WITHIN)
        assert applicationsOn(pair.only(primary), LISTENER) == 0


def test_withoutLeavingTheReadOnlyServerBothStayThere(
    pair: MigratedPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    The counterpart of the test above, so that it cannot pass for a
    reason of its own: a pool and a listener that do not check their
    server stay on the fenced primary, the pool failing every write there.
    """
    monkeypatch.setattr(pgtransactions, "offTarget", lambda connection, target: False)
    monkeypatch.setattr(listeningModule, "offTarget", lambda connection, target: False)
    primary, standby = pair.servers
    owner, connection = ownerStore(pair.dsn())
    tenant = makeTenant(owner, "acme")
    connection.close()
    with appStore(pair.dsn()) as store, listening(pair.dsn()):
        assert fencedFailover(pair, store, tenant.orgID) == 20
        assert applicationsOn(pair.only(primary), LISTENER) == 1
        assert applicationsOn(pair.only(standby), LISTENER) == 0
