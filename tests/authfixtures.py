"""
Fixtures for tests that need svc-auth: a migrated database, tenants made as
svcctl makes them, and a running AuthService. Loaded for every test module
by tests/conftest.py (pytest_plugins).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import attrs
import psycopg
import pytest
from authservice import RunningAuthService, SettableClock

from svcd.auth.authority import issueToken
from svcd.auth.store import Store
from svcd.common.migrations import migrate
from svcd.common.pat import parseToken
from svcd.common.permissions import Permission


def ownerStore(dsn: str) -> tuple[Store, psycopg.Connection[object]]:
    """
    A store acting as the schema owner, as svcctl does.
    """
    connection = psycopg.connect(dsn, autocommit=True)
    return Store(lambda: contextlib.nullcontext(connection)), connection


@attrs.frozen
class Tenant:
    orgID: uuid.UUID
    agentID: uuid.UUID
    token: str
    tokenID: uuid.UUID


def makeTenant(
    store: Store,
    name: str = "acme",
    permissions: int = int(Permission.ProxyChatCompletion),
    agentStatus: str = "active",
    bindAgent: bool = False,
) -> Tenant:
    orgID = store.createOrganization(name)
    agent = store.createAgent(orgID, f"{name}-agent", agentStatus)
    token, record = issueToken(
        store,
        orgID=orgID,
        permissions=permissions,
        agentID=agent.agentID if bindAgent else None,
    )
    return Tenant(orgID, agent.agentID, token, record.tokenID)


@pytest.fixture
def migratedDSN(databaseDSN: str) -> str:
    """
    C{databaseDSN}, migrated. Asked for, C{databaseDSN} is already a copy
    of the migrated template (tests/conftest.py): migrate then checks that
    nothing is left to do, as svcctl migrate does on every start.
    """
    migrate(databaseDSN)
    return databaseDSN


@pytest.fixture
def owner(migratedDSN: str) -> Iterator[Store]:
    store, connection = ownerStore(migratedDSN)
    yield store
    connection.close()


@pytest.fixture
def clock() -> SettableClock:
    return SettableClock()


@pytest.fixture
def authService(migratedDSN: str, clock: SettableClock) -> Iterator[RunningAuthService]:
    service = RunningAuthService(migratedDSN, wallClock=clock).start()
    yield service
    service.stop()


def secretOf(token: str) -> str:
    """
    The secret part of a PAT. (Not C{token.rsplit("_", 1)}: base64url
    secrets contain underscores themselves.)
    """
    parsed = parseToken(token)
    assert parsed is not None, "not a well-formed token"
    return parsed.secret
