"""
Tests for L{svcd.devkit.servers}, L{svcd.devkit.postgres},
L{svcd.devkit.redis} and the fixtures of conftest.py: the
private servers that every other database or Redis test stands on.
"""

from __future__ import annotations

import os
import pwd
import socket
import time
from pathlib import Path

import psycopg
import pytest

from svcd.devkit import postgres, redis, servers
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import MissingBinaries, ServerError, freePort


def _selectOne(dsn: str) -> object:
    with psycopg.connect(dsn, connect_timeout=5) as connection:
        row = connection.execute("SELECT 1").fetchone()
    assert row is not None
    return row[0]


def _postgresProcesses(server: PostgresServer) -> list[int]:
    pid = server.postmasterPid()
    assert pid is not None
    return [pid, *servers.childProcesses(pid)]


def test_freePortCanBeBound() -> None:
    """
    freePort returns a loopback port that nobody listens on, so a server can
    bind it.
    """
    port = freePort()
    assert 0 < port < 65536
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))


def test_freePortPassesOverAPortItHandedOutAlready(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """
    When the kernel offers a port that freePort handed out before (in this
    process or in another one that still runs, such as a parallel test
    worker), freePort passes it over for the next offer: two servers
    started side by side never get the same port.
    """
    reservations = servers._PortReservations(tmp_path / "ports")
    monkeypatch.setattr(servers, "_reservations", reservations)
    offers = iter([40001, 40001, 40003, 40005, 40007])
    monkeypatch.setattr(servers, "_unusedPort", lambda: next(offers))
    assert freePort() == 40001
    assert freePort() == 40003
    # A live process of someone else's (our parent, say) holds 40005.
    (tmp_path / "ports" / "40005").write_text(str(os.getppid()))
    assert freePort() == 40007


def test_freePortTakesOverReservationsOfEndedProcesses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """
    A reservation of a process that has ended, or one older than the
    reservations' lifetime, holds no longer; a process's own reservations
    are removed when it releases them (at exit).
    """
    reservations = servers._PortReservations(tmp_path / "ports")
    monkeypatch.setattr(servers, "_reservations", reservations)
    directory = tmp_path / "ports"
    directory.mkdir()
    # A process id that no process has: beyond the kernel's maximum.
    (directory / "40001").write_text(str(int(Path("/proc/sys/kernel/pid_max").read_text()) + 1))
    (directory / "40003").write_text(str(os.getppid()))
    old = time.time() - servers._PortReservations.LIFETIME - 60
    os.utime(directory / "40003", (old, old))
    offers = iter([40001, 40003])
    monkeypatch.setattr(servers, "_unusedPort", lambda: next(offers))
    assert freePort() == 40001
    assert freePort() == 40003
    assert (directory / "40001").read_text() == str(os.getpid())
    reservations.releaseAll()
    assert not (directory / "40001").exists()
    assert not (directory / "40003").exists()


def test_freePortIsBelowTheEphemeralRange() -> None:
    """
    With the kernel's ephemeral range where Linux puts it, freePort's ports
    come from below it, where no connect() takes a local port and no bind
    of port 0 lands: only an explicit bind could take one before its owner
    does.
    """
    start = servers._ephemeralStart()
    assert start is not None
    if start - servers._BAND_START < servers._LEAST_BAND:
        pytest.fail(f"this machine's ephemeral range starts at {start}: no band below it")
    ports = [freePort() for _ in range(20)]
    assert all(servers._BAND_START <= port < start for port in ports), ports
    assert len(set(ports)) == len(ports)


def test_aTakenPortOfTheBandIsPassedOver(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    A port of the band that someone has bound is not offered; the next draw
    is.
    """
    with socket.socket() as holder, socket.socket() as other:
        holder.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        taken, free = holder.getsockname()[1], other.getsockname()[1]
        other.close()
        draws = iter([taken, taken, free])
        monkeypatch.setattr(
            servers, "_random", type("Drawn", (), {"randrange": lambda *_: next(draws)})()
        )
        monkeypatch.setattr(servers, "_BAND_START", min(taken, free))
        monkeypatch.setattr(servers, "_LEAST_BAND", 0)
        monkeypatch.setattr(servers, "_ephemeralStart", lambda: max(taken, free) + 1)
        assert servers._unusedPort() == free


def test_noBandMeansTheKernelsPick(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """
    An ephemeral range that leaves too narrow a band below it (or none that
    can be read) leaves the choice to the kernel, as before.
    """
    drawn: list[int] = []

    class Recording:
        def randrange(self, low: int, high: int) -> int:
            drawn.append(low)
            return low

    monkeypatch.setattr(servers, "_random", Recording())
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{servers._BAND_START + 100}\t60999\n")
    monkeypatch.setattr(servers, "_PORT_RANGE", narrow)
    assert servers._ephemeralStart() == servers._BAND_START + 100
    assert 0 < servers._unusedPort() < 65536
    monkeypatch.setattr(servers, "_PORT_RANGE", tmp_path / "missing")
    assert servers._ephemeralStart() is None
    assert 0 < servers._unusedPort() < 65536
    assert drawn == []


def test_postgresStartQueryStopStart(privatePostgres: PostgresServer) -> None:
    """
    A started server answers queries; once stopped it refuses connections;
    started again it answers on the same port.
    """
    dsn = privatePostgres.superuserDSN()
    port = privatePostgres.port
    assert dsn == f"postgresql://postgres@127.0.0.1:{port}/postgres"
    assert _selectOne(dsn) == 1

    privatePostgres.stop()
    assert not privatePostgres.isRunning
    with pytest.raises(psycopg.OperationalError, match=r"(?i)refused"):
        _selectOne(dsn)

    privatePostgres.start()
    assert privatePostgres.port == port
    assert _selectOne(dsn) == 1


def test_postgresSettings(privatePostgres: PostgresServer) -> None:
    """
    The cluster is UTF8, lets the postgres superuser in without a password
    and runs with fsync off, since its data is disposable.
    """
    with privatePostgres.connect() as connection:
        row = connection.execute(
            "SELECT current_user, current_setting('server_encoding'),"
            " current_setting('fsync'), current_setting('listen_addresses')"
        ).fetchone()
    assert row == ("postgres", "UTF8", "off", "127.0.0.1")


def test_postgresListensOnItsOwnSocketDirectory(privatePostgres: PostgresServer) -> None:
    """
    The Unix socket is in the server's own directory, not in the system's
    /var/run/postgresql, so it can't collide with a system server.
    """
    socketFile = privatePostgres.socketDirectory / f".s.PGSQL.{privatePostgres.port}"
    assert socketFile.is_socket()


def test_postgresLogsToBaseDirectory(privatePostgres: PostgresServer) -> None:
    """
    What the server prints goes to postgres.log in the base directory.
    """
    assert privatePostgres.logFile.parent == privatePostgres.baseDirectory
    assert "database system is ready to accept connections" in privatePostgres.logFile.read_text()


def test_postgresFreezeAndThaw(privatePostgres: PostgresServer) -> None:
    """
    A frozen server suspends the postmaster and its children, so a connect
    with a timeout times out instead of failing fast; thawed, it answers
    again.
    """
    processes = _postgresProcesses(privatePostgres)
    assert len(processes) > 1
    privatePostgres.freeze()
    try:
        # A backend that was exiting is gone (None) or stays a zombie ("Z")
        # until the postmaster, now stopped, reaps it; every other process
        # is stopped.
        states = {servers._processState(pid) for pid in processes}
        assert states - {"Z", None} == {"T"}
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError, match=r"(?i)timeout"):
            psycopg.connect(privatePostgres.superuserDSN(), connect_timeout=2)
        assert time.monotonic() - started < 10
    finally:
        privatePostgres.thaw()
    assert _selectOne(privatePostgres.superuserDSN()) == 1


def test_postgresStopWhileFrozen(privatePostgres: PostgresServer) -> None:
    """
    stop() works on a frozen server, and leaves none of its processes
    behind.
    """
    processes = _postgresProcesses(privatePostgres)
    privatePostgres.freeze()
    privatePostgres.stop()
    assert not privatePostgres.isRunning
    assert [pid for pid in processes if servers.processExists(pid)] == []


def test_postgresFreezeStoppedServer(tmp_path: Path) -> None:
    """
    Freezing a server that is not running is an error, not a silent no-op.
    """
    server = PostgresServer.create(tmp_path / "postgres")
    try:
        with pytest.raises(ServerError):
            server.freeze()
    finally:
        server.destroy()


def test_postgresCreateAndDropDatabase(postgresServer: PostgresServer) -> None:
    """
    createDatabase returns the DSN of a new database; dropDatabase drops it
    even while a client is still connected to it.
    """
    dsn = postgresServer.createDatabase("test_servers_create_drop")
    assert dsn.endswith("/test_servers_create_drop")
    leftover = psycopg.connect(dsn)
    try:
        assert leftover.execute("SELECT current_database()").fetchone() == (
            "test_servers_create_drop",
        )
        postgresServer.dropDatabase("test_servers_create_drop")
    finally:
        leftover.close()
    with pytest.raises(psycopg.OperationalError, match="does not exist"):
        _selectOne(dsn)
    postgresServer.dropDatabase("test_servers_create_drop")


def test_postgresReusesExistingCluster(tmp_path: Path) -> None:
    """
    create() on a directory that already holds a cluster reuses it, data
    and all, and may put it on another port: what dev/gateway relies on
    between runs.
    """
    first = PostgresServer.create(tmp_path / "postgres")
    try:
        first.start()
        first.createDatabase("kept")
        first.stop()
        second = PostgresServer.create(tmp_path / "postgres")
        second.start()
        assert _selectOne(second.superuserDSN("kept")) == 1
        second.stop()
    finally:
        first.destroy()


def test_postgresDestroyRemovesEverything(tmp_path: Path) -> None:
    """
    destroy() stops the server and removes its directory, including a
    cluster that lives under /tmp because the postgres user cannot reach
    the base directory.
    """
    server = PostgresServer.create(tmp_path / "postgres")
    server.start()
    processes = _postgresProcesses(server)
    dataDirectory = server.dataDirectory.resolve()
    server.destroy()
    assert not (tmp_path / "postgres").exists()
    assert not dataDirectory.exists()
    assert [pid for pid in processes if servers.processExists(pid)] == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs PostgreSQL as another user")
def test_postgresAsRootRunsAsPostgresUser(privatePostgres: PostgresServer) -> None:
    """
    PostgreSQL refuses to run as root, so as root the server runs as the
    postgres system user.
    """
    pid = privatePostgres.postmasterPid()
    assert pid is not None
    assert os.stat(f"/proc/{pid}").st_uid == pwd.getpwnam("postgres").pw_uid


def test_postgresBinariesMissing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """
    Without PostgreSQL installed, the error says which Debian package to
    install instead of failing somewhere inside initdb.
    """
    monkeypatch.setattr(postgres, "POSTGRES_INSTALL_ROOT", tmp_path / "nowhere")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MissingBinaries, match="apt-get install postgresql"):
        PostgresServer.create(tmp_path / "postgres")


def test_databaseDSNFixture(databaseDSN: str, postgresServer: PostgresServer) -> None:
    """
    databaseDSN is a fresh, empty database in the session's cluster.
    """
    assert databaseDSN.startswith(f"postgresql://postgres@127.0.0.1:{postgresServer.port}/test_")
    with psycopg.connect(databaseDSN) as connection:
        tables = connection.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
        ).fetchone()
        assert tables == (0,)
        connection.execute("CREATE TABLE scratch (id int)")


def test_temporaryDatabaseIsDroppedAfterwards(postgresServer: PostgresServer) -> None:
    """
    temporaryDatabase, on which the databaseDSN fixture is built, gives a
    database of a new name each time and drops it when the block ends, even
    with a client still connected to it.
    """

    def exists(name: str) -> bool:
        with postgresServer.connect() as connection:
            row = connection.execute(
                "SELECT count(*) FROM pg_database WHERE datname = %s", (name,)
            ).fetchone()
        return row == (1,)

    with postgresServer.temporaryDatabase() as first, postgresServer.temporaryDatabase() as second:
        assert first != second
        name = first.rsplit("/", 1)[1]
        assert name.startswith("test_")
        assert exists(name)
        leftover = psycopg.connect(first)
    try:
        assert not exists(name)
        assert leftover.closed or leftover.broken or _connectionIsDead(leftover)
    finally:
        leftover.close()


def _connectionIsDead(connection: psycopg.Connection[tuple[object, ...]]) -> bool:
    try:
        connection.execute("SELECT 1")
    except psycopg.OperationalError:
        return True
    return False


def test_redisStartStopRestartOnSamePort(privateRedis: RedisServer) -> None:
    """
    A started server answers PING; stopped, it refuses connections; started
    again, it answers on the same port and URL.
    """
    url = privateRedis.url
    assert url == f"redis://127.0.0.1:{privateRedis.port}/0"
    assert privateRedis.command("PING") == b"+PONG"

    privateRedis.stop()
    assert not privateRedis.isRunning
    with pytest.raises(ConnectionRefusedError):
        privateRedis.command("PING")

    privateRedis.start()
    assert privateRedis.url == url
    assert privateRedis.ping()


def test_redisFreezeAndThaw(privateRedis: RedisServer) -> None:
    """
    A frozen server accepts connections (the kernel does that) but answers
    nothing, so a command with a timeout times out; thawed, it answers.
    """
    privateRedis.freeze()
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            privateRedis.command("PING", timeout=1)
        assert time.monotonic() - started < 5
    finally:
        privateRedis.thaw()
    assert privateRedis.command("PING") == b"+PONG"


def test_redisStopWhileFrozen(privateRedis: RedisServer) -> None:
    """
    stop() works on a frozen server.
    """
    pid = privateRedis.pid
    assert pid is not None
    privateRedis.freeze()
    privateRedis.stop(timeout=5)
    assert not servers.processExists(pid)


def test_redisKeepsNothingOnDisk(privateRedis: RedisServer) -> None:
    """
    Redis saves no snapshot and no append-only file, so a restart starts
    empty and nothing is written to its directory but the log.
    """
    assert privateRedis.command("SET", "key", "value") == b"+OK"
    privateRedis.stop()
    privateRedis.start()
    assert privateRedis.command("EXISTS", "key") == b":0"
    assert sorted(path.name for path in privateRedis.baseDirectory.iterdir()) == ["redis.log"]


def test_redisPicksAnotherPortWhenChosenPortIsTaken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """
    When the free port chosen for a server is taken before the server binds
    it, the first start chooses another one instead of failing.
    """
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        choices = iter([taken])
        realFreePort = servers.freePort
        monkeypatch.setattr(redis, "freePort", lambda: next(choices, None) or realFreePort())
        server = RedisServer.create(tmp_path / "redis")
        assert server.port == taken
        try:
            server.start()
            assert server.port != taken
            assert server.ping()
        finally:
            server.destroy()


def test_redisExplicitPortIsKept(tmp_path: Path) -> None:
    """
    A port the caller chose is never silently replaced: a taken one is an
    error.
    """
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = RedisServer.create(tmp_path / "redis", port=taken)
        try:
            with pytest.raises(ServerError, match=str(taken)):
                server.start(timeout=10)
        finally:
            server.destroy()


def test_redisBinaryMissing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """
    Without Redis installed, the error names the Debian package to install.
    """
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(redis, "REDIS_SERVER_CANDIDATES", ())
    with pytest.raises(MissingBinaries, match="apt-get install redis-server"):
        RedisServer.create(tmp_path / "redis")


def test_redisURLFixtureFlushes(redisServer: RedisServer, request: pytest.FixtureRequest) -> None:
    """
    redisURL points at the session's server, emptied of what earlier tests
    left there.
    """
    assert redisServer.command("SET", "leftover", "1") == b"+OK"
    url = request.getfixturevalue("redisURL")
    assert url == redisServer.url
    assert redisServer.command("EXISTS", "leftover") == b":0"
