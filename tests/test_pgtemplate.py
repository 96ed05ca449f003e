"""
Tests for the suite's cheap databases: clusters in memory
(L{svcd.devkit.pgfiles}) and migrated databases copied from a template
(L{svcd.devkit.pgtemplate}).
"""

from __future__ import annotations

import os
import subprocess
from importlib.abc import Traversable
from pathlib import Path

import psycopg
import pytest

from svcd.common import migrations
from svcd.common.migrations import migrate
from svcd.devkit import pgfiles, pgtemplate
from svcd.devkit.pgtemplate import TEMPLATE_PREFIX, migratedDatabase, templateName
from svcd.devkit.postgres import PostgresServer, findPostgresBinaries


def _schema(dsn: str) -> str:
    """
    The schema of the database at C{dsn} as pg_dump prints it, privileges
    and owners included.
    """
    result = subprocess.run(
        [str(findPostgresBinaries() / "pg_dump"), "--schema-only", dsn],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    # pg_dump fences its output with a random key (\restrict): not schema.
    return "\n".join(
        line
        for line in result.stdout.splitlines()
        if not line.startswith(("\\restrict", "\\unrestrict"))
    )


def _templates(server: PostgresServer) -> list[str]:
    with server.connect() as connection:
        rows = connection.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s ORDER BY datname",
            (f"{TEMPLATE_PREFIX}%",),
        ).fetchall()
    return [row[0] for row in rows]


def test_aCopyIsWhatMigrateLeaves(postgresServer: PostgresServer) -> None:
    """
    A database copied from the template has the schema, privileges and
    applied migrations of an empty database migrated in full.
    """
    migrated = postgresServer.createDatabase("pgtemplate_migrated")
    try:
        migrate(migrated)
        copied = migratedDatabase(postgresServer, "pgtemplate_copied")
        try:
            assert _schema(copied) == _schema(migrated)
            assert migrate(copied) == []
            query = "SELECT name FROM svc_schema_migrations ORDER BY name"
            with psycopg.connect(migrated) as one, psycopg.connect(copied) as other:
                assert one.execute(query).fetchall() == other.execute(query).fetchall()
        finally:
            postgresServer.dropDatabase("pgtemplate_copied")
    finally:
        postgresServer.dropDatabase("pgtemplate_migrated")


def test_migratedDSNIsACopy(
    databaseDSN: str, migratedDSN: str, postgresServer: PostgresServer
) -> None:
    """
    A test asking for migratedDSN gets a database of its own, already
    migrated; the template stays out of its reach.
    """
    assert migratedDSN == databaseDSN
    assert migrate(migratedDSN) == []
    assert _templates(postgresServer) == [templateName()]
    with pytest.raises(psycopg.OperationalError, match="not currently accepting"):
        psycopg.connect(postgresServer.superuserDSN(templateName())).close()


def test_databaseDSNAloneIsEmpty(databaseDSN: str) -> None:
    """
    Without migratedDSN, databaseDSN stays empty: the tests of the
    migrations themselves migrate it step by step.
    """
    with psycopg.connect(databaseDSN) as connection:
        assert connection.execute("SELECT to_regclass('svc_schema_migrations')").fetchone() == (
            None,
        )


def test_changedMigrationsMakeANewTemplate(
    privatePostgres: PostgresServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """
    The template is named by the migrations' content: a changed migration
    makes a new one, whose copies have the change, and the older template
    is dropped.
    """
    first = templateName()
    migratedDatabase(privatePostgres, "before")
    assert _templates(privatePostgres) == [first]

    files = migrations.migrationFiles()
    extra = tmp_path / "9999_extra.sql"
    extra.write_text("CREATE TABLE pgtemplate_extra (id int);\n")
    changed: list[Traversable] = [*files, extra]
    monkeypatch.setattr(migrations, "migrationFiles", lambda: changed)
    monkeypatch.setattr(pgtemplate, "migrationFiles", lambda: changed)
    second = templateName()
    assert second != first

    dsn = migratedDatabase(privatePostgres, "after")
    assert _templates(privatePostgres) == [second]
    with psycopg.connect(dsn) as connection:
        assert connection.execute("SELECT to_regclass('pgtemplate_extra')").fetchone() == (
            "pgtemplate_extra",
        )
    with psycopg.connect(privatePostgres.superuserDSN("before")) as connection:
        assert connection.execute("SELECT to_regclass('pgtemplate_extra')").fetchone() == (None,)


def test_clusterInMemory(postgresServer: PostgresServer) -> None:
    """
    The suite's cluster lives on the tmpfs when it has room, and its
    databases are copied file by file there.
    """
    if not pgfiles.hasRoom(pgfiles.MEMORY_DIRECTORY):
        pytest.skip(f"{pgfiles.MEMORY_DIRECTORY} has less than 2 GB free")
    assert postgresServer.inMemory
    assert postgresServer.dataDirectory.resolve().is_relative_to(pgfiles.MEMORY_DIRECTORY.resolve())


def test_abandonedClustersAreRemoved(tmp_path: Path) -> None:
    """
    removeAbandoned takes a directory whose maker exited and leaves one
    whose maker lives, one without an owner file (the kept initdb), and
    anything not named as ours.
    """
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    (tmp_path / "svc-postgres-dead").mkdir()
    (tmp_path / "svc-postgres-dead" / pgfiles.OWNER_FILE).write_text(f"{dead}\n")
    (tmp_path / "svc-postgres-alive").mkdir()
    (tmp_path / "svc-postgres-alive" / pgfiles.OWNER_FILE).write_text(f"{os.getpid()}\n")
    (tmp_path / "svc-postgres-initdb-0123").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / pgfiles.OWNER_FILE).write_text(f"{dead}\n")
    pgfiles.removeAbandoned(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "other",
        "svc-postgres-alive",
        "svc-postgres-initdb-0123",
    ]
