"""
A private PostgreSQL cluster (L{PostgresServer}) for the tests, the
benchmarks and C{dev/gateway}: made with the installed initdb, started and
stopped with pg_ctl, its data disposable (see L{svcd.devkit.servers} for
why private servers).
"""

# Running the installed server programs is this module's purpose; every
# command is a fixed program with arguments we build, never a shell string.
# ruff: noqa: S603

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import psycopg
from psycopg import sql

from svcd.devkit.pgfiles import (
    MEMORY_DIRECTORY,
    OWNER_FILE,
    POSTGRES_SYSTEM_USER,
    copyInitdb,
    giveToPostgresUser,
    hasRoom,
    initdb,
    removeAbandoned,
    runLogged,
)
from svcd.devkit.servers import (
    DEFAULT_TIMEOUT,
    INSTALL_HINT,
    LOOPBACK,
    MissingBinaries,
    ServerError,
    childProcesses,
    freePort,
    logTail,
    processExists,
    running,
    signalProcesses,
    waitUntil,
    waitUntilSuspended,
)

# Where Debian's postgresql packages put the server binaries, one folder per
# major version (/usr/lib/postgresql/15/bin/initdb).
POSTGRES_INSTALL_ROOT = Path("/usr/lib/postgresql")

# A Unix socket path may hold at most 107 bytes (sun_path); PostgreSQL
# refuses to start when "<socket dir>/.s.PGSQL.<port>" is longer.
_MAX_SOCKET_PATH = 100


def _majorVersion(pgCtl: Path) -> int | None:
    try:
        result = subprocess.run(
            [str(pgCtl), "--version"], capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\(PostgreSQL\)\s+(\d+)", result.stdout)
    return int(match.group(1)) if match else None


def findPostgresBinaries(major: int | None = None) -> Path:
    """
    The directory holding initdb, pg_ctl and postgres: the newest of
    Debian's /usr/lib/postgresql/*/bin, else C{pg_config --bindir}, else the
    directory of an initdb on PATH.

    @param major: when given, only binaries of this major version do; an
        existing cluster can only be started by the version that made it.
    @raise MissingBinaries: when no suitable binaries are installed.
    """
    candidates: list[Path] = []
    if POSTGRES_INSTALL_ROOT.is_dir():
        versioned = [
            entry / "bin"
            for entry in POSTGRES_INSTALL_ROOT.iterdir()
            if entry.name.isdigit() or re.fullmatch(r"\d+\.\d+", entry.name)
        ]
        versioned.sort(key=lambda path: [int(part) for part in path.parent.name.split(".")])
        candidates.extend(reversed(versioned))
    pgConfig = shutil.which("pg_config")
    if pgConfig is not None:
        try:
            result = subprocess.run(
                [pgConfig, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            )
            candidates.append(Path(result.stdout.strip()))
        except (OSError, subprocess.SubprocessError):
            pass
    initdbOnPath = shutil.which("initdb")
    if initdbOnPath is not None:
        candidates.append(Path(initdbOnPath).resolve().parent)

    found: list[tuple[Path, int | None]] = []
    for directory in candidates:
        if all(os.access(directory / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres")):
            found.append((directory, _majorVersion(directory / "pg_ctl")))
    if not found:
        raise MissingBinaries(
            "PostgreSQL server binaries (initdb, pg_ctl, postgres) were not found in "
            f"{POSTGRES_INSTALL_ROOT}/*/bin, pg_config --bindir or PATH. "
            + INSTALL_HINT.format(package="postgresql")
        )
    if major is None:
        return found[0][0]
    for directory, version in found:
        if version == major:
            return directory
    versions = ", ".join(str(version) for _, version in found)
    raise MissingBinaries(
        f"This cluster was made by PostgreSQL {major}, but only version(s) {versions} "
        f"are installed. Install postgresql-{major}, or remove the cluster's directory "
        "to make a new one."
    )


def _runAsPrefix() -> list[str]:
    """
    The command prefix that runs PostgreSQL's programs as the right user:
    nothing for an ordinary user, C{runuser -u postgres --} for root.
    """
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(POSTGRES_SYSTEM_USER)
    except KeyError:
        raise MissingBinaries(
            "PostgreSQL refuses to run as root, and there is no "
            f"{POSTGRES_SYSTEM_USER!r} system user to run it as. "
            + INSTALL_HINT.format(package="postgresql")
        ) from None
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    if not os.access(runuser, os.X_OK):
        raise MissingBinaries("runuser (from util-linux) is needed to run PostgreSQL as root.")
    return [runuser, "-u", POSTGRES_SYSTEM_USER, "--"]


def _usableByServer(directory: Path, runAs: list[str]) -> bool:
    """
    Whether the user that runs PostgreSQL can write into C{directory}.

    As root this is a real question: a pytest temporary directory lives
    under /tmp/pytest-of-root, which only root may enter, and so does a
    checkout under /root. Asking the system (C{test -w -a -x} as that user)
    also gets ACLs and mount options right.
    """
    if not runAs:
        return os.access(directory, os.W_OK | os.X_OK)
    result = subprocess.run(
        [*runAs, "test", "-w", str(directory), "-a", "-x", str(directory)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    return result.returncode == 0


class PostgresServer:
    """
    A private PostgreSQL cluster: trust authentication for the C{postgres}
    superuser, listening on 127.0.0.1 only, with fsync off (its data is
    disposable, and speed matters more to tests than durability).

    Layout under C{baseDirectory}::

        postgres.log      everything initdb, pg_ctl and the server print
        cluster/          data/ (PGDATA) and socket/ (the Unix socket)

    C{cluster} is a symbolic link to a directory under /tmp when the user
    that runs PostgreSQL cannot reach C{baseDirectory} (see
    L{_usableByServer}) or when the socket path would be too long.
    """

    host = LOOPBACK

    def __init__(
        self,
        binaries: Path,
        baseDirectory: Path,
        clusterDirectory: Path,
        port: int,
        portChosen: bool,
    ) -> None:
        self._binaries = binaries
        self._baseDirectory = baseDirectory
        self._clusterDirectory = clusterDirectory
        self._port = port
        # A port we chose ourselves may be taken by someone else before the
        # first start; then we may choose another. After that first start
        # the port is the server's identity and never changes.
        self._mayChangePort = portChosen
        self._runAs = _runAsPrefix()
        # In memory, CREATE DATABASE copies files (STRATEGY FILE_COPY): 10
        # to 13 ms of the server's CPU against 33 to 42 ms for WAL_LOG, which
        # logs every block; on ext4 it is the other way round.
        self.inMemory = clusterDirectory.resolve().is_relative_to(MEMORY_DIRECTORY.resolve())

    @classmethod
    def create(
        cls,
        baseDirectory: Path,
        port: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        inMemory: bool = False,
    ) -> PostgresServer:
        """
        Make a new cluster under C{baseDirectory} with initdb, or reuse the
        one already there (as C{dev/gateway} does between runs). The server
        is not started.

        @param port: the TCP port to listen on; a free one when L{None}.
        @param inMemory: put a new cluster's files on the tmpfs
            L{MEMORY_DIRECTORY} (C{baseDirectory/cluster} links there) when
            it has room: the tests make and drop databases by the hundred.
        @raise MissingBinaries: when PostgreSQL is not installed.
        @raise ServerError: when initdb fails.
        """
        baseDirectory = Path(os.path.abspath(baseDirectory))
        baseDirectory.mkdir(parents=True, exist_ok=True)
        clusterLink = baseDirectory / "cluster"
        versionFile = clusterLink / "data" / "PG_VERSION"
        existingMajor: int | None = None
        if versionFile.is_file():
            existingMajor = int(versionFile.read_text().strip().split(".")[0])
        binaries = findPostgresBinaries(existingMajor)
        runAs = _runAsPrefix()
        log = baseDirectory / "postgres.log"

        if existingMajor is not None:
            clusterDirectory = clusterLink.resolve()
        else:
            # Nothing usable: a link left dangling after a reboot emptied
            # /tmp, or the remains of an interrupted initdb.
            _removeCluster(clusterLink)
            clusterDirectory = _makeClusterDirectory(baseDirectory, runAs, inMemory)
            if clusterDirectory.resolve().is_relative_to(MEMORY_DIRECTORY.resolve()):
                copyInitdb(binaries, clusterDirectory, runAs, log, timeout)
            else:
                initdb(binaries, clusterDirectory, runAs, log, timeout)

        return cls(
            binaries,
            baseDirectory,
            clusterDirectory,
            port if port is not None else freePort(),
            portChosen=port is None,
        )

    @property
    def port(self) -> int:
        """
        The TCP port the server listens on, on 127.0.0.1.
        """
        return self._port

    @property
    def baseDirectory(self) -> Path:
        return self._baseDirectory

    @property
    def dataDirectory(self) -> Path:
        return self._clusterDirectory / "data"

    @property
    def socketDirectory(self) -> Path:
        return self._clusterDirectory / "socket"

    @property
    def logFile(self) -> Path:
        return self._baseDirectory / "postgres.log"

    def superuserDSN(self, dbname: str = "postgres") -> str:
        """
        A libpq URI that connects as the superuser to C{dbname}.
        """
        return f"postgresql://postgres@{self.host}:{self._port}/{quote(dbname, safe='')}"

    def _pgCtl(
        self, *arguments: str, timeout: float, output: IO[bytes] | int = subprocess.DEVNULL
    ) -> int:
        command = [*self._runAs, str(self._binaries / "pg_ctl"), *arguments]
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=self._clusterDirectory,
            # pg_ctl has its own deadline (-t); this one is for a pg_ctl
            # that hangs for a reason of its own.
            timeout=timeout + 10,
            check=False,
        )
        return result.returncode

    def postmasterPid(self) -> int | None:
        """
        The postmaster's process id from postmaster.pid, if that process
        exists.
        """
        try:
            firstLine = (self.dataDirectory / "postmaster.pid").read_text().split("\n", 1)[0]
            pid = int(firstLine)
        except (OSError, ValueError):
            return None
        return pid if processExists(pid) else None

    @property
    def isRunning(self) -> bool:
        return self.postmasterPid() is not None

    def start(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Start the server and return once it accepts connections.

        A postmaster left running by an earlier process that was killed is
        stopped first: the cluster is private, so it can only be ours.

        @raise ServerError: when it does not come up within C{timeout}.
        """
        if self in running and self.isRunning:
            return
        if self.isRunning:
            self.stop(timeout)
        attempts = 3 if self._mayChangePort else 1
        for attempt in range(attempts):
            if self._startOnce(timeout):
                break
            if attempt + 1 < attempts and "in use" in logTail(self.logFile, 10):
                self._port = freePort()
                continue
            raise ServerError(
                f"PostgreSQL did not start on port {self._port} within {timeout:.0f} s; "
                f"the end of {self.logFile}:\n{logTail(self.logFile)}"
            )
        self._mayChangePort = False
        running.add(self)
        self._waitForConnections(timeout)

    def _startOnce(self, timeout: float) -> bool:
        socketDirectory = self.socketDirectory
        socketDirectory.mkdir(exist_ok=True)
        giveToPostgresUser(socketDirectory)
        # pg_ctl hands -o to /bin/sh, hence the quoting. The port and the
        # socket directory are options rather than postgresql.conf lines so
        # that a reused cluster can move to another port.
        options = " ".join(
            [
                f"-p {self._port}",
                f"-k {shlex.quote(str(socketDirectory))}",
                f"-c listen_addresses={LOOPBACK}",
            ]
        )
        # Without -l the server writes to pg_ctl's standard output, which is
        # our log file opened here: as root the postgres user could not
        # open a file in a directory only root may enter, but it can write
        # to a descriptor it inherits.
        with self.logFile.open("ab") as log:
            status = self._pgCtl(
                "start",
                "-D",
                str(self.dataDirectory),
                "-w",
                "-t",
                str(max(1, int(timeout))),
                "-o",
                options,
                timeout=timeout,
                output=log,
            )
        return status == 0

    def _waitForConnections(self, timeout: float) -> None:
        lastError: Exception | None = None

        def connects() -> bool:
            nonlocal lastError
            try:
                with self.connect(timeout=2):
                    return True
            except psycopg.OperationalError as e:
                lastError = e
                return False

        if not waitUntil(connects, timeout, interval=0.1):
            raise ServerError(
                f"PostgreSQL on port {self._port} started but refuses connections: {lastError}"
            )

    def stop(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Stop the server (fast shutdown: active sessions are disconnected)
        and wait until it has exited. A frozen server is thawed first, since
        a stopped process cannot shut down. Stopping a stopped server does
        nothing.
        """
        running.discard(self)
        pid = self.postmasterPid()
        if pid is None:
            return
        self.thaw()
        dataDirectory = str(self.dataDirectory)
        with self.logFile.open("ab") as log:
            status = self._pgCtl(
                "stop",
                "-D",
                dataDirectory,
                "-m",
                "fast",
                "-w",
                "-t",
                str(max(1, int(timeout))),
                timeout=timeout,
                output=log,
            )
        if status == 0 and not processExists(pid):
            return
        # A server that ignores a fast shutdown: kill it and its children,
        # rather than leave it running.
        signalProcesses([*childProcesses(pid), pid], signal.SIGKILL)
        if not waitUntil(lambda: not processExists(pid), 10):
            raise ServerError(f"PostgreSQL (pid {pid}) survived SIGKILL")

    def freeze(self) -> None:
        """
        Suspend the postmaster and all its children (SIGSTOP), so that
        connections hang instead of failing: the way to test what happens
        when the database stops answering. The kernel still completes TCP
        handshakes, so only a client with its own timeout notices.
        """
        pid = self.postmasterPid()
        if pid is None:
            raise ServerError("PostgreSQL is not running")
        # The postmaster first, so that it forks no new child meanwhile.
        os.kill(pid, signal.SIGSTOP)
        children = childProcesses(pid)
        signalProcesses(children, signal.SIGSTOP)
        waitUntilSuspended([pid, *children])

    def thaw(self) -> None:
        """
        Resume a server suspended by L{freeze}; harmless on one that is not.
        """
        pid = self.postmasterPid()
        if pid is None:
            return
        signalProcesses(childProcesses(pid), signal.SIGCONT)
        os.kill(pid, signal.SIGCONT)

    def kill(self, timeout: float = 10.0) -> None:
        """
        SIGKILL the postmaster and every one of its processes at once: a
        crash, not a shutdown (nothing is flushed, no client is told), the
        way to test a failover. Its shared memory interlock, which only a
        shutdown or the next start would remove, is removed here, since a
        killed server of a test is never started again.
        """
        running.discard(self)
        pid = self.postmasterPid()
        if pid is None:
            return
        # The children first known, then the postmaster killed before
        # them, so that it neither forks a new one nor restarts them.
        children = childProcesses(pid)
        signalProcesses([pid, *children], signal.SIGKILL)
        if not waitUntil(
            lambda: not any(processExists(each) for each in [pid, *children]), timeout
        ):
            raise ServerError(f"PostgreSQL (pid {pid}) survived SIGKILL")
        self._removeSharedMemory()

    def _removeSharedMemory(self) -> None:
        try:
            lines = (self.dataDirectory / "postmaster.pid").read_text().splitlines()
            shmid = lines[6].split()[1]
        except (OSError, IndexError):
            return
        ipcrm = shutil.which("ipcrm")
        if ipcrm is not None and shmid.isdigit():
            subprocess.run(
                [*self._runAs, ipcrm, "-m", shmid],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=10,
                check=False,
            )

    def alterSystem(self, settings: dict[str, str]) -> None:
        """
        Write C{settings} into postgresql.auto.conf (ALTER SYSTEM) and have
        the server read its configuration again: for settings that need
        no restart.
        """
        with self.connect() as connection:
            for name, value in settings.items():
                connection.execute(
                    sql.SQL("ALTER SYSTEM SET {} = {}").format(
                        sql.Identifier(name), sql.Literal(value)
                    )
                )
            connection.execute("SELECT pg_reload_conf()")

    def makeStandby(self, baseDirectory: Path, timeout: float = DEFAULT_TIMEOUT) -> PostgresServer:
        """
        A streaming standby of this running server, not yet started: its
        cluster copied with C{pg_basebackup -R} (which writes the
        primary's address into the standby's configuration and marks it a
        standby), on a free port of its own. The replication connection
        needs a C{replication} line in pg_hba.conf, which initdb writes
        for the loopback addresses with trust.

        @raise MissingBinaries: pg_basebackup is not installed.
        @raise ServerError: the copy failed.
        """
        baseBackup = self._binaries / "pg_basebackup"
        if not os.access(baseBackup, os.X_OK):
            raise MissingBinaries(
                f"pg_basebackup was not found beside {self._binaries / 'pg_ctl'}. "
                + INSTALL_HINT.format(package="postgresql")
            )
        baseDirectory = Path(os.path.abspath(baseDirectory))
        baseDirectory.mkdir(parents=True, exist_ok=True)
        clusterDirectory = _makeClusterDirectory(baseDirectory, self._runAs, self.inMemory)
        log = baseDirectory / "postgres.log"
        command = [
            *self._runAs,
            str(baseBackup),
            "-h",
            self.host,
            "-p",
            str(self._port),
            "-U",
            "postgres",
            "-D",
            str(clusterDirectory / "data"),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        ]
        if runLogged(command, log, timeout * 4, cwd=clusterDirectory) != 0:
            _removeCluster(baseDirectory / "cluster")
            raise ServerError(f"pg_basebackup failed; the end of {log}:\n{logTail(log)}")
        return PostgresServer(
            self._binaries, baseDirectory, clusterDirectory, freePort(), portChosen=True
        )

    def promote(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Promote this standby to a primary (C{pg_ctl promote}) and return
        once it takes writes.
        """
        with self.logFile.open("ab") as log:
            status = self._pgCtl(
                "promote",
                "-D",
                str(self.dataDirectory),
                "-w",
                "-t",
                str(max(1, int(timeout))),
                timeout=timeout,
                output=log,
            )
        if status != 0:
            raise ServerError(
                f"pg_ctl promote failed on port {self._port}; the end of "
                f"{self.logFile}:\n{logTail(self.logFile)}"
            )

    def destroy(self) -> None:
        """
        Stop the server and remove C{baseDirectory} with the cluster.
        """
        self.stop()
        _removeCluster(self._baseDirectory / "cluster")
        shutil.rmtree(self._baseDirectory, ignore_errors=True)

    def connect(
        self, dbname: str = "postgres", timeout: float = 5.0
    ) -> psycopg.Connection[tuple[Any, ...]]:
        """
        A new autocommit connection as the superuser; the caller closes it.
        """
        return psycopg.connect(
            self.superuserDSN(dbname), autocommit=True, connect_timeout=max(1, int(timeout))
        )

    def createDatabase(self, name: str, template: str = "template1") -> str:
        """
        Create the database C{name}, a copy of C{template}, and return a
        DSN that connects to it.
        """
        strategy = sql.SQL("FILE_COPY" if self.inMemory else "WAL_LOG")
        with self.connect() as connection:
            connection.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY {}").format(
                    sql.Identifier(name), sql.Identifier(template), strategy
                )
            )
        return self.superuserDSN(name)

    def dropDatabase(self, name: str) -> None:
        """
        Drop the database C{name}, disconnecting whoever is still connected
        to it (a test may leave a pool open); a missing database is fine.
        """
        with self.connect() as connection:
            connection.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    @contextlib.contextmanager
    def temporaryDatabase(self, prefix: str = "test_") -> Iterator[str]:
        """
        Create a database with a new random name, give its DSN to the
        C{with} block and drop it afterwards, however the block ends.
        """
        name = f"{prefix}{secrets.token_hex(8)}"
        dsn = self.createDatabase(name)
        try:
            yield dsn
        finally:
            self.dropDatabase(name)


def _removeCluster(clusterLink: Path) -> None:
    """
    Remove a cluster directory, or the link to one and its target.
    """
    if clusterLink.is_symlink():
        target = clusterLink.resolve()
        clusterLink.unlink()
        shutil.rmtree(target, ignore_errors=True)
    elif clusterLink.exists():
        shutil.rmtree(clusterLink)


def _makeClusterDirectory(baseDirectory: Path, runAs: list[str], inMemory: bool) -> Path:
    """
    An empty directory, owned by the user that runs PostgreSQL, to hold the
    cluster: with C{inMemory}, a new one under L{MEMORY_DIRECTORY} if it
    has room; else C{baseDirectory/cluster} when that user can use it, else
    a new directory under /tmp. C{baseDirectory/cluster} links to a
    directory made elsewhere.
    """
    clusterLink = baseDirectory / "cluster"
    parents = [tempfile.gettempdir(), "/tmp", "/var/tmp"]  # noqa: S108
    if inMemory and hasRoom(MEMORY_DIRECTORY):
        removeAbandoned(MEMORY_DIRECTORY)
        parents.insert(0, str(MEMORY_DIRECTORY))
    else:
        clusterLink.mkdir(mode=0o700)
        giveToPostgresUser(clusterLink)
        socketPath = clusterLink / "socket" / ".s.PGSQL.65535"
        if len(os.fsencode(socketPath)) <= _MAX_SOCKET_PATH and _usableByServer(clusterLink, runAs):
            return clusterLink
        clusterLink.rmdir()
    # mkdtemp makes a fresh 0700 directory, so a shared /tmp is safe here.
    for parent in dict.fromkeys(parents):
        if not os.path.isdir(parent):
            continue
        candidate = Path(tempfile.mkdtemp(prefix="svc-postgres-", dir=parent))
        giveToPostgresUser(candidate)
        if _usableByServer(candidate, runAs):
            (candidate / OWNER_FILE).write_text(f"{os.getpid()}\n")
            clusterLink.symlink_to(candidate, target_is_directory=True)
            return candidate
        candidate.rmdir()
    raise ServerError(
        f"The {POSTGRES_SYSTEM_USER!r} user can neither use {baseDirectory} nor a "
        "directory under /tmp for the PostgreSQL cluster."
    )
