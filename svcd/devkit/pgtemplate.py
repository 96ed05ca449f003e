"""
Migrated databases made by copying a template (L{migratedDatabase}): the
tests make hundreds of databases that all start as sql/ leaves an empty
one, and running the twenty migrations into each cost the server about
85 ms of CPU and the client 12 ms, where copying a database migrated once
costs the server about 20 ms (a cluster in memory, STRATEGY FILE_COPY).

The template is made once per cluster and named by the migrations'
content (L{templateName}), so a change to sql/ makes a new one; the
cluster's templates of older migrations are dropped then. A copy is
exactly what L{migrate} leaves in an empty database on that cluster: the
same objects, owned by the superuser that migrated them, the same rows in
svc_schema_migrations (their applied_at is the template's), and the roles
the migrations make are the cluster's anyway.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from psycopg import Connection, errors, sql

from svcd.common.migrations import migrate, migrationFiles
from svcd.devkit.postgres import PostgresServer

# The prefix of a template's name; what follows is L{templateName}'s digest.
TEMPLATE_PREFIX = "svc_template_"


def templateName() -> str:
    """
    The name of the template migrated by the migrations as they are now:
    a digest of their names and contents.
    """
    digest = hashlib.sha256()
    for migration in migrationFiles():
        digest.update(migration.name.encode("utf-8") + b"\0")
        digest.update(migration.read_bytes() + b"\0")
    return TEMPLATE_PREFIX + digest.hexdigest()[:16]


def migratedDatabase(server: PostgresServer, name: str) -> str:
    """
    Create the database C{name} on the running C{server} as a copy of the
    migrated template, which is made first if the cluster has none of the
    current migrations; return a DSN that connects to it.
    """
    template = templateName()
    with server.connect() as connection:
        exists = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (template,)
        ).fetchone()
    if exists is None:
        _makeTemplate(server, template)
    return server.createDatabase(name, template=template)


def _makeTemplate(server: PostgresServer, template: str) -> None:
    """
    Migrate a new database and rename it to C{template}: the rename is
    atomic, so a copy never starts from a half-migrated template, and of two
    processes making it at once the second finds the name taken and drops
    its own.
    """
    building = f"{TEMPLATE_PREFIX}building_{secrets.token_hex(6)}"
    server.createDatabase(building)
    with server.connect() as connection:
        try:
            migrate(server.superuserDSN(building))
            # Nobody may connect to a template (a copy needs it alone), and
            # marked a template it is not dropped by mistake.
            connection.execute(
                sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false IS_TEMPLATE true").format(
                    sql.Identifier(building)
                )
            )
            connection.execute(
                sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
                    sql.Identifier(building), sql.Identifier(template)
                )
            )
        except errors.DuplicateDatabase:
            pass
        else:
            building = template
            older = connection.execute(
                "SELECT datname FROM pg_database WHERE datname ~ %s AND datname <> %s",
                (f"^{TEMPLATE_PREFIX}[0-9a-f]{{16}}$", template),
            ).fetchall()
            for (name,) in older:
                _dropTemplate(connection, name)
        finally:
            if building != template:
                _dropTemplate(connection, building)


def _dropTemplate(connection: Connection[tuple[Any, ...]], name: str) -> None:
    """
    Drop the template C{name} (or the database that was to become one).
    """
    connection.execute(
        sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE false").format(sql.Identifier(name))
    )
    connection.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
