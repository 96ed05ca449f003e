"""
Fixtures and helpers for tests of svc-memory (decisions D13): a store on a
migrated database, tenants to hold memories, vectors made from numbers,
and a running MemoryService. Loaded for every test module by
tests/conftest.py (pytest_plugins).
"""

from __future__ import annotations

import contextlib
import datetime
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import numpy
import psycopg
import pytest
from authfixtures import Tenant, makeTenant
from hypothesis import strategies as st
from memoryservice import RunningMemoryService

from svcd.auth.store import Store
from svcd.memory.records import MemoryRecord, Query, checkQuery
from svcd.memory.store import MemoryStore
from svcd.memory.store.base import APPLICATION_ROLE, connectionPool
from svcd.memoryclient.records import Embedding, Scope

MODEL = "embed-test"


def vectorBytes(values: Sequence[float]) -> bytes:
    """
    A vector's wire and table form: float32 components, little-endian.
    """
    return numpy.asarray(values, dtype="<f4").tobytes()


def embedding(values: Sequence[float], model: str = MODEL) -> Embedding:
    return Embedding(model, vectorBytes(values))


def query(values: Sequence[float], model: str = MODEL) -> Query:
    return checkQuery(model, vectorBytes(values))


def scopeOf(tenant: Tenant, subject: str = "") -> Scope:
    return Scope(tenant.orgID, tenant.agentID, subject)


def appConnection(dsn: str) -> psycopg.Connection[object]:
    """
    A plain connection acting as svc_memory_app, the role row-level
    security applies to.
    """
    connection = psycopg.connect(dsn, autocommit=True)
    connection.execute(f"SET ROLE {APPLICATION_ROLE}")
    return connection


@contextlib.contextmanager
def storeOn(dsn: str) -> Iterator[MemoryStore]:
    """
    svc-memory's store on a small pool of its own, as the daemon has it
    (its connections named C{memory-test} in pg_stat_activity).
    """
    pool = connectionPool(
        dsn, minimum=1, maximum=8, statementTimeout=5.0, applicationName="memory-test"
    )
    pool.open(wait=True)
    try:
        yield MemoryStore(pool.connection, dropDeadConnections=pool.check)
    finally:
        pool.close(timeout=5)


@pytest.fixture
def memoryStore(migratedDSN: str) -> Iterator[MemoryStore]:
    with storeOn(migratedDSN) as store:
        yield store


@pytest.fixture
def acme(owner: Store) -> Tenant:
    return makeTenant(owner, "acme")


@pytest.fixture
def globex(owner: Store) -> Tenant:
    return makeTenant(owner, "globex")


def secondAgent(owner: Store, tenant: Tenant) -> uuid.UUID:
    return owner.createAgent(tenant.orgID, "second").agentID


@pytest.fixture
def memoryService(migratedDSN: str) -> Iterator[RunningMemoryService]:
    """
    A running MemoryService (one replica) on the test's database.
    """
    service = RunningMemoryService(migratedDSN).start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture
def replicas(migratedDSN: str) -> Iterator[tuple[RunningMemoryService, RunningMemoryService]]:
    """
    Two replicas of svc-memory on one database (two caches, two listeners).
    """
    first = RunningMemoryService(migratedDSN).start()
    second = RunningMemoryService(migratedDSN).start()
    try:
        yield first, second
    finally:
        first.stop()
        second.stop()


def within(seconds: float, condition: Callable[[], bool]) -> float:
    """
    Wait until C{condition} holds, at most C{seconds}; how long it took.
    """
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, f"not within {seconds}s"
        time.sleep(0.01)
    return time.monotonic() - started


# Hypothesis: any memory's record, as the cache of records and the wire
# encode it (tests of svcd.memory.wire's answers written as bytes).
moments = st.datetimes(
    min_value=datetime.datetime(2000, 1, 1), max_value=datetime.datetime(2100, 1, 1)
).map(lambda moment: moment.replace(tzinfo=datetime.UTC))

memoryRecords = st.builds(
    MemoryRecord,
    memoryID=st.uuids(),
    orgID=st.uuids(),
    agentID=st.uuids(),
    subject=st.text("abc:@-", max_size=8),
    content=st.text(min_size=1, max_size=60),
    metadata=st.sampled_from(["{}", '{"a":1}', '{"k":"vé"}']),
    source=st.sampled_from(["api", "extracted"]),
    sourceRequestID=st.one_of(st.none(), st.text("req-0123", min_size=1, max_size=10)),
    embeddingModel=st.text("emb-", min_size=1, max_size=8),
    dimensions=st.integers(1, 4096),
    createdAt=moments,
    updatedAt=moments,
)
