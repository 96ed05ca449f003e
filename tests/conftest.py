"""
Fixtures shared by every test module: private PostgreSQL and Redis servers.

The servers are started by the tests themselves (L{svcd.testing.servers}),
never taken from the machine, so the suite runs the same on a fresh machine
and on one whose own PostgreSQL or Redis holds data we must not touch.

Two kinds of fixture, for two needs:

  - C{databaseDSN} and C{redisURL} give a test a clean database or a
    flushed Redis on servers shared by the whole run: cheap, for tests that
    only read and write.
  - C{privatePostgres} and C{privateRedis} give a test a server of its own,
    which it may stop, freeze and restart to see how the code under test
    copes; never do that to the shared ones.

Servers start lazily: a run that asks for none of these fixtures starts no
server. pytest-twisted installs its reactor itself; nothing here touches it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from svcd.testing.servers import PostgresServer, RedisServer

# Fixtures of svc-auth (migrated databases, tenants, a running AuthService),
# and the scripted OpenAI-compatible upstream.
pytest_plugins = ["authfixtures", "upstreamfixtures", "forwardingfixtures"]


@pytest.fixture(scope="session")
def postgresServer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """
    One private PostgreSQL cluster for the whole run; tests get their own
    database in it through C{databaseDSN}.
    """
    server = PostgresServer.create(tmp_path_factory.mktemp("postgres"))
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture
def databaseDSN(postgresServer: PostgresServer) -> Iterator[str]:
    """
    The DSN of a new, empty database that exists for this test only. It is
    dropped afterwards even if the test left connections open to it.
    """
    with postgresServer.temporaryDatabase() as dsn:
        yield dsn


@pytest.fixture(scope="session")
def redisServer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """
    One private Redis server for the whole run; tests reach it through
    C{redisURL}, which empties it first.
    """
    server = RedisServer.create(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture
def redisURL(redisServer: RedisServer) -> str:
    """
    The URL of the shared Redis server, with every key of the tests before
    this one deleted.
    """
    redisServer.flushAll()
    return redisServer.url


@pytest.fixture
def privatePostgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """
    A running PostgreSQL cluster of this test's own, which it may stop,
    freeze, thaw and start again; it is destroyed afterwards, frozen or not.
    """
    server = PostgresServer.create(tmp_path_factory.mktemp("privatePostgres"))
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture
def privateRedis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """
    A running Redis server of this test's own, which it may stop, freeze,
    thaw and start again (on the same port); destroyed afterwards.
    """
    server = RedisServer.create(tmp_path_factory.mktemp("privateRedis"))
    try:
        server.start()
        yield server
    finally:
        server.destroy()
