"""
Applying the ordered SQL migrations of sql/ (decisions D7).

Each file runs once, in name order, recorded in svc_schema_migrations.
One transaction holds a whole run, so a failed migration leaves nothing
half applied, and an advisory lock makes concurrent runs (two replicas
starting at once) wait for each other instead of racing.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

import psycopg

# An arbitrary constant naming "svc migrations" for pg_advisory_xact_lock.
_MIGRATION_LOCK = 0x5EC_A17_0001


def migrationFiles() -> list[Traversable]:
    """
    The migrations in order: svcd/sql/ of an installed package (setup.py
    copies them there), else sql/ of the checkout.
    """
    installed = resources.files("svcd") / "sql"
    if installed.is_dir():
        directory: Traversable = installed
    else:
        directory = Path(__file__).resolve().parents[2] / "sql"
    files = [each for each in directory.iterdir() if each.name.endswith(".sql")]
    if not files:
        raise FileNotFoundError(f"no migrations found in {directory}")
    return sorted(files, key=lambda each: each.name)


def _pending(connection: psycopg.Connection[object], through: str | None) -> Iterator[Traversable]:
    applied = {
        row[0]  # type: ignore[index]
        for row in connection.execute("SELECT name FROM svc_schema_migrations").fetchall()
    }
    for migration in migrationFiles():
        if through is not None and migration.name > through:
            return
        if migration.name not in applied:
            yield migration


def migrate(dsn: str, through: str | None = None) -> list[str]:
    """
    Apply every migration not yet applied; return the names applied now
    (empty on a second run).

    @param through: the name of the last migration to apply, for tests
        that need a database as an older release left it (a migration
        must work on the data that release wrote); None for all.
    """
    appliedNow: list[str] = []
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as connection:
        with connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            connection.execute(
                "CREATE TABLE IF NOT EXISTS svc_schema_migrations ("
                " name text PRIMARY KEY,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            for migration in list(_pending(connection, through)):
                connection.execute(migration.read_text(encoding="utf-8").encode("utf-8"))
                connection.execute(
                    "INSERT INTO svc_schema_migrations (name) VALUES (%s)", (migration.name,)
                )
                appliedNow.append(migration.name)
    return appliedNow
