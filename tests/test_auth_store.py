"""
The schema, its migrations and row-level security, checked in PostgreSQL
itself.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest
from authfixtures import makeTenant, secretOf

from svcd.auth.store import Store
from svcd.auth.store.base import APPLICATION_ROLE
from svcd.common.migrations import migrate, migrationFiles
from svcd.common.pgtransactions import StoreRejected

TENANT_TABLES = ("organizations", "users", "agents", "tokens", "limits", "memory_settings")


def test_migrateIsIdempotent(databaseDSN: str) -> None:
    """
    The first run applies every migration in order; the second applies
    nothing and changes nothing.
    """
    names = [each.name for each in migrationFiles()]
    assert names == sorted(names) and len(names) >= 5
    assert migrate(databaseDSN) == names
    assert migrate(databaseDSN) == []
    with psycopg.connect(databaseDSN) as connection:
        recorded = [
            row[0]
            for row in connection.execute(
                "SELECT name FROM svc_schema_migrations ORDER BY name"
            ).fetchall()
        ]
    assert recorded == names


def test_rowLevelSecurityIsEnabledAndForced(migratedDSN: str) -> None:
    """
    Every tenant table has row-level security enabled and forced, so it
    binds the tables' owner too.
    """
    with psycopg.connect(migratedDSN) as connection:
        rows = connection.execute(
            "SELECT relname, relrowsecurity, relforcerowsecurity FROM pg_class"
            " WHERE relname = ANY(%s)",
            (list(TENANT_TABLES),),
        ).fetchall()
    assert sorted(rows) == sorted((table, True, True) for table in TENANT_TABLES)


def asApplication(
    dsn: str, orgID: uuid.UUID | None = None, tokenID: uuid.UUID | None = None
) -> psycopg.Connection[tuple[object, ...]]:
    """
    A connection that acts exactly as svc-auth's pool does (SET ROLE
    svc_auth_app) in one organization's context, although the DSN names a
    superuser.
    """
    connection = psycopg.connect(dsn, autocommit=False)
    superuser = connection.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    assert superuser.fetchone() == (True,)
    connection.execute(f"SET ROLE {APPLICATION_ROLE}")
    connection.execute(
        "SELECT set_config('svc.org_id', %s, true), set_config('svc.token_id', %s, true)",
        (str(orgID) if orgID else "", str(tokenID) if tokenID else ""),
    )
    return connection


def test_organizationContextCannotReadAnotherOrganizationsRows(
    migratedDSN: str, owner: Store
) -> None:
    """
    In org A's context, queries that ask for org B's agents and tokens by
    id, or for everything, return only A's rows; without a context they
    return nothing; and A's context cannot write rows into B.
    """
    tenantA = makeTenant(owner, "a")
    tenantB = makeTenant(owner, "b")
    with asApplication(migratedDSN, orgID=tenantA.orgID) as connection:
        assert connection.execute(
            "SELECT count(*) FROM agents WHERE agent_id = %s", (tenantB.agentID,)
        ).fetchone() == (0,)
        assert connection.execute(
            "SELECT count(*) FROM tokens WHERE token_id = %s", (tenantB.tokenID,)
        ).fetchone() == (0,)
        assert connection.execute("SELECT DISTINCT org_id FROM agents").fetchall() == [
            (tenantA.orgID,)
        ]
        assert connection.execute("SELECT DISTINCT org_id FROM tokens").fetchall() == [
            (tenantA.orgID,)
        ]
        assert connection.execute("SELECT org_id FROM organizations").fetchall() == [
            (tenantA.orgID,)
        ]
        updated = connection.execute(
            "UPDATE agents SET status = 'paused' WHERE agent_id = %s", (tenantB.agentID,)
        )
        assert updated.rowcount == 0
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute(
                "INSERT INTO agents (agent_id, org_id, status) VALUES (%s, %s, 'active')",
                (uuid.uuid4(), tenantB.orgID),
            )
    with asApplication(migratedDSN) as connection:
        for table in TENANT_TABLES:
            assert connection.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,)


def test_tokenLookupContextShowsExactlyOneToken(migratedDSN: str, owner: Store) -> None:
    """
    The authentication lookup context (svc.token_id) shows the one token
    it names and nothing else: no other token, no agent, no organization.
    """
    tenantA = makeTenant(owner, "a")
    tenantB = makeTenant(owner, "b")
    with asApplication(migratedDSN, tokenID=tenantA.tokenID) as connection:
        assert connection.execute("SELECT token_id FROM tokens").fetchall() == [(tenantA.tokenID,)]
        assert connection.execute("SELECT count(*) FROM agents").fetchone() == (0,)
        assert connection.execute("SELECT count(*) FROM organizations").fetchone() == (0,)
        revoked = connection.execute(
            "UPDATE tokens SET revoked_at = now() WHERE token_id = %s", (tenantA.tokenID,)
        )
        assert revoked.rowcount == 0
    assert tenantB.tokenID != tenantA.tokenID


def test_applicationRoleCannotEscapeRowLevelSecurity(migratedDSN: str) -> None:
    """
    The role svc-auth acts as is no superuser, cannot bypass row-level
    security, and owns none of the tables.
    """
    with psycopg.connect(migratedDSN) as connection:
        role = connection.execute(
            "SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = %s",
            (APPLICATION_ROLE,),
        ).fetchone()
        owners = connection.execute(
            "SELECT DISTINCT tableowner FROM pg_tables WHERE tablename = ANY(%s)",
            (list(TENANT_TABLES),),
        ).fetchall()
    assert role == (False, False)
    assert (APPLICATION_ROLE,) not in owners


def test_tokenSecretsAreStoredOnlyAsArgon2idHashes(migratedDSN: str, owner: Store) -> None:
    """
    The tokens table holds an argon2id hash, never the secret.
    """
    tenant = makeTenant(owner)
    secret = secretOf(tenant.token)
    with psycopg.connect(migratedDSN) as connection:
        stored = connection.execute(
            "SELECT secret_hash FROM tokens WHERE token_id = %s", (tenant.tokenID,)
        ).fetchone()
    assert stored is not None
    assert str(stored[0]).startswith("$argon2id$")
    assert secret not in str(stored[0])


def test_organizationContextCannotReadOrWriteAnotherOrganizationsLimits(
    migratedDSN: str, owner: Store
) -> None:
    """
    In org A's context, svc_auth_app sees A's limits rows (its own and its
    agent's) and none of B's, asked by id or not at all; it cannot write
    any limits row (svcctl, the owner, writes them); the one function that
    reads every row gives ids and numbers only.
    """
    tenantA = makeTenant(owner, "a")
    tenantB = makeTenant(owner, "b")
    owner.setLimits(tenantA.orgID, None, {"rpm": 1})
    owner.setLimits(tenantA.orgID, tenantA.agentID, {"tpm": 2})
    owner.setLimits(tenantB.orgID, None, {"rpm": 3})
    owner.setLimits(tenantB.orgID, tenantB.agentID, {"tpm": 4})
    with asApplication(migratedDSN, orgID=tenantA.orgID) as connection:
        seen = connection.execute("SELECT org_id, agent_id FROM limits").fetchall()
        assert sorted(seen, key=str) == sorted(
            [(tenantA.orgID, None), (tenantA.orgID, tenantA.agentID)], key=str
        )
        assert connection.execute(
            "SELECT count(*) FROM limits WHERE org_id = %s OR agent_id = %s",
            (tenantB.orgID, tenantB.agentID),
        ).fetchone() == (0,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute("UPDATE limits SET rpm = 100 WHERE org_id = %s", (tenantA.orgID,))
    with asApplication(migratedDSN, orgID=tenantA.orgID) as connection:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute("DELETE FROM limits")
    with asApplication(migratedDSN) as connection:
        everything = connection.execute("SELECT * FROM svc_limits_rows()")
        columns = [column.name for column in everything.description or ()]
        assert columns == ["org_id", "agent_id", "rpm", "tpm", "max_output_tokens", "version"]
        assert len(everything.fetchall()) == 4
    assert owner.limits(tenantB.orgID) is not None


def test_limitsRowsAreOnePerOrganizationAndAgentOfItsOwn(migratedDSN: str, owner: Store) -> None:
    """
    The table itself keeps its rules, whoever writes: values are positive
    or null, one row per organization and per agent, an agent only with
    its own organization (the store reports that as StoreRejected), and
    every insert and update takes a new, larger version.
    """
    tenantA = makeTenant(owner, "a")
    tenantB = makeTenant(owner, "b")
    with pytest.raises(StoreRejected):
        owner.setLimits(tenantA.orgID, tenantB.agentID, {"rpm": 5})
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        for value in (0, -1):
            with pytest.raises(psycopg.errors.CheckViolation):
                connection.execute(
                    "INSERT INTO limits (org_id, tpm) VALUES (%s, %s)", (tenantA.orgID, value)
                )
        connection.execute("INSERT INTO limits (org_id) VALUES (%s)", (tenantA.orgID,))
        with pytest.raises(psycopg.errors.UniqueViolation):
            connection.execute("INSERT INTO limits (org_id) VALUES (%s)", (tenantA.orgID,))
        connection.execute(
            "INSERT INTO limits (org_id, agent_id) VALUES (%s, %s)",
            (tenantA.orgID, tenantA.agentID),
        )
        with pytest.raises(psycopg.errors.UniqueViolation):
            connection.execute(
                "INSERT INTO limits (org_id, agent_id) VALUES (%s, %s)",
                (tenantA.orgID, tenantA.agentID),
            )
        before = owner.limits(tenantA.orgID)
        assert before is not None and before.rpm is None
        connection.execute(
            "UPDATE limits SET rpm = 9, version = 1 WHERE org_id = %s AND agent_id IS NULL",
            (tenantA.orgID,),
        )
    after = owner.limits(tenantA.orgID)
    assert after is not None and after.rpm == 9 and after.version > before.version
    unchanged = owner.setLimits(tenantA.orgID, None, {})
    assert unchanged.rpm == 9 and unchanged.version > after.version


def test_everyLimitsChangeIsAnnounced(migratedDSN: str, owner: Store) -> None:
    """
    Each insert, update and delete of a limits row is announced on
    svc_auth_changes as limits:<org_id>:<agent_id or empty>.
    """
    tenant = makeTenant(owner)
    with psycopg.connect(migratedDSN, autocommit=True) as listening:
        listening.execute("LISTEN svc_auth_changes")
        owner.setLimits(tenant.orgID, None, {"rpm": 5})
        owner.setLimits(tenant.orgID, None, {"tpm": 6})
        owner.setLimits(tenant.orgID, tenant.agentID, {"rpm": 1})
        owner.clearLimits(tenant.orgID, tenant.agentID)
        owner.clearLimits(tenant.orgID)
        owner.clearLimits(tenant.orgID)
        payloads = [
            each.payload
            for each in listening.notifies(timeout=5.0, stop_after=5)
            if each.payload.startswith("limits:")
        ]
    org, agent = f"limits:{tenant.orgID}:", f"limits:{tenant.orgID}:{tenant.agentID}"
    assert payloads == [org, org, agent, agent, org]


def test_aDatabaseRestartCostsNoCallerAnAnswer(privatePostgres: object) -> None:
    """
    PostgreSQL restarted under a pool holding several idle connections:
    every one of them is dead, and the first call after the restart still
    answers (the pool drops its dead connections before the one retry),
    where a retry on the next dead connection would fail a caller of a
    database that is up.
    """
    from svcd.auth.store.base import connectionPool
    from svcd.devkit.postgres import PostgresServer

    assert isinstance(privatePostgres, PostgresServer)
    dsn = privatePostgres.createDatabase("restart")
    migrate(dsn)
    pool = connectionPool(
        dsn, minimum=4, maximum=4, statementTimeout=5.0, applicationName="restart-test"
    )
    pool.open(wait=True, timeout=10.0)
    try:
        store = Store(pool.connection, dropDeadConnections=pool.check)
        store.ping()
        assert pool.get_stats()["pool_available"] == 4
        privatePostgres.stop()
        privatePostgres.start()
        for _ in range(3):
            store.ping()
    finally:
        pool.close()


def test_withoutDroppingDeadConnectionsTheRetryFindsAnother(privatePostgres: object) -> None:
    """
    The counterpart of the test above, so that it cannot pass for a
    reason of its own: the same restart, with the store retrying on the
    pool's next idle connection only, fails the first call.
    """
    from svcd.auth.store.base import connectionPool
    from svcd.common.pgtransactions import StoreUnavailable
    from svcd.devkit.postgres import PostgresServer

    assert isinstance(privatePostgres, PostgresServer)
    dsn = privatePostgres.createDatabase("restart")
    migrate(dsn)
    pool = connectionPool(
        dsn, minimum=4, maximum=4, statementTimeout=5.0, applicationName="restart-test"
    )
    pool.open(wait=True, timeout=10.0)
    try:
        store = Store(pool.connection)
        store.ping()
        privatePostgres.stop()
        privatePostgres.start()
        with pytest.raises(StoreUnavailable):
            store.ping()
    finally:
        pool.close()
