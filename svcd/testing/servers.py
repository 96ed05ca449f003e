"""
Private PostgreSQL and Redis servers for the tests and for C{dev/gateway}.

Why private servers: a developer's machine may run no PostgreSQL or Redis at
all, or run them with data and settings we must neither depend on nor
disturb. So every test run, and the local development stack, starts its own
servers from the installed binaries, on free loopback ports, with their data
under a directory the caller names.

These helpers are synchronous (they run subprocesses and wait for them): the
tests call them from pytest fixtures, outside the reactor, and
L{svcd.devstack} runs no reactor at all.

Every server that was started and not stopped again is stopped when the
Python process exits (L{atexit}), so a test run leaves no stray server
behind even when a fixture finalizer never runs.
"""

# Running the installed server programs is this module's purpose; every
# command is a fixed program with arguments we build, never a shell string.
# ruff: noqa: S603

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import quote

import psycopg
from psycopg import sql

LOOPBACK = "127.0.0.1"

# How long start() and stop() wait by default. Generous, because a loaded CI
# machine can be slow to run initdb or to start a server; a healthy one takes
# well under a second.
DEFAULT_TIMEOUT = 30.0

# Where Debian's postgresql packages put the server binaries, one folder per
# major version (/usr/lib/postgresql/15/bin/initdb).
POSTGRES_INSTALL_ROOT = Path("/usr/lib/postgresql")

# Where to look for redis-server when it is not on PATH (sudo's secure_path
# and cron's PATH lack /usr/sbin on some systems).
REDIS_SERVER_CANDIDATES = ("/usr/bin/redis-server", "/usr/sbin/redis-server")

# The system account that owns PostgreSQL's files on Debian. initdb and the
# postmaster refuse to run as root, so root runs them as this user.
POSTGRES_SYSTEM_USER = "postgres"

# A Unix socket path may hold at most 107 bytes (sun_path); PostgreSQL
# refuses to start when "<socket dir>/.s.PGSQL.<port>" is longer.
_MAX_SOCKET_PATH = 100

_INSTALL_HINT = (
    "On Debian or Ubuntu install them with: sudo apt-get install {package} "
    "(dev/bootstrap does this for you)."
)


class ServerError(Exception):
    """
    A private server could not be created, started or stopped; the message
    says what happened and, where there is one, which log file to read.
    """


class MissingBinaries(ServerError):
    """
    The server programs are not installed on this machine.
    """


def freePort() -> int:
    """
    A TCP port on the loopback interface that nobody listens on right now,
    and that no other call of C{freePort} on this machine (in this process
    or another, for as long as that process lives) has handed out.

    The kernel picks it, so it is free at this instant; but the caller binds
    it only later (a daemon takes a second or more to start), and the kernel
    may pick the same port again for the next caller in between. Tests run
    in parallel (pytest-xdist workers, other developers' runs) would then
    start two servers on one port, and one of them fails. So each port
    handed out is reserved in L{_PortReservations}, and a port the kernel
    offers again while its reservation holds is passed over.

    A process that binds port 0 itself (grpcio, L{svcd.testing.relay}) can
    still take a reserved port before its owner binds it; the servers pick
    a new one and retry when their first start finds the port taken.
    """
    for _ in range(_PORT_ATTEMPTS):
        port = _unusedPort()
        if _reservations.reserve(port):
            return port
    # Every offer reserved: the directory is unusable or full of live
    # reservations. The kernel's choice is still free right now.
    return port


# How many ports the kernel may offer before freePort takes one without a
# reservation (a few are passed over at most, even with thousands held).
_PORT_ATTEMPTS = 50


def _unusedPort() -> int:
    """
    A loopback TCP port nobody has bound right now, as the kernel picks it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


class _PortReservations:
    """
    Ports handed out by L{freePort}, machine-wide for one user: a file per
    port in C{directory} holding the process id that reserved it. A
    reservation holds while that process lives (its servers may stop and
    start again on the same port) and for at most L{LIFETIME} seconds, in
    case the process id has been reused since. Choosing happens under an
    exclusive C{flock} of the directory's lock file, so two processes never
    reserve the same port. A process removes its reservations when it exits.

    Anything that goes wrong with the directory (another user's, a full
    disk) turns reservations off for this process rather than failing the
    caller: the ports are still the kernel's free ones.
    """

    LIFETIME = 6 * 3600.0

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._usable = True
        self._held: set[int] = set()

    def reserve(self, port: int) -> bool:
        """
        Reserve C{port} for this process; L{False} if someone holds it.
        """
        if not self._usable:
            return True
        try:
            return self._reserveLocked(port)
        except OSError:
            self._usable = False
            return True

    def _ensureDirectory(self) -> None:
        self._directory.mkdir(mode=0o700, exist_ok=True)
        # In a shared /tmp, a directory someone else made (or a symbolic
        # link to one) is not ours to trust.
        status = os.lstat(self._directory)
        if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.geteuid():
            raise PermissionError(f"{self._directory} is not a directory of ours")

    def _reserveLocked(self, port: int) -> bool:
        self._ensureDirectory()
        lockFile = os.open(self._directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lockFile, fcntl.LOCK_EX)
            entry = self._directory / str(port)
            if self._holds(entry):
                return False
            entry.write_text(str(os.getpid()))
            self._held.add(port)
            return True
        finally:
            os.close(lockFile)

    def _holds(self, entry: Path) -> bool:
        """
        Whether the reservation C{entry} is in force.
        """
        try:
            owner = int(entry.read_text())
            age = time.time() - entry.stat().st_mtime
        except (FileNotFoundError, ValueError):
            return False
        return age < self.LIFETIME and (owner == os.getpid() or _processAlive(owner))

    def releaseAll(self) -> None:
        """
        Remove this process's reservations (at exit).
        """
        pid = str(os.getpid())
        for port in self._held:
            entry = self._directory / str(port)
            with contextlib.suppress(OSError, ValueError):
                if entry.read_text() == pid:
                    entry.unlink()
        self._held.clear()


def _processAlive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _processState(pid) not in ("Z", "X")


_reservations = _PortReservations(Path(tempfile.gettempdir()) / f"svc-test-ports-{os.geteuid()}")
atexit.register(_reservations.releaseAll)


class _Stoppable(Protocol):
    def stop(self, timeout: float = DEFAULT_TIMEOUT) -> None: ...


# Servers started and not yet stopped, for the exit handler below.
_running: set[_Stoppable] = set()


@atexit.register
def _stopEverything() -> None:
    """
    Stop every server this process started and did not stop, so that an
    interrupted test run or a crashed dev stack leaves nothing running.
    """
    for server in list(_running):
        # Best effort at exit: one failure must not keep the others running.
        with contextlib.suppress(Exception):
            server.stop(timeout=10.0)
    _running.clear()


def _processState(pid: int) -> str | None:
    """
    The one-letter state of process C{pid} (R, S, T, Z, ...) from
    /proc/PID/stat, or L{None} if there is no such process.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name in parentheses may hold spaces and brackets; the
    # fields after the last ")" are "state ppid ...".
    return stat[stat.rindex(")") + 2]


def _parentProcess(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _childProcesses(parent: int) -> list[int]:
    """
    The process ids whose parent is C{parent}, read from /proc.
    """
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and _parentProcess(int(entry.name)) == parent
    ]


def _processExists(pid: int) -> bool:
    """
    Whether process C{pid} is alive. A zombie is not: a daemonized
    postmaster's parent is init, which may take a while to reap it, and its
    exit is what we wait for.
    """
    return _processState(pid) not in (None, "Z", "X")


def _waitUntilSuspended(pids: list[int], timeout: float = 5.0) -> None:
    """
    Wait until every process of C{pids} is stopped ("T"), a zombie or gone:
    SIGSTOP is delivered asynchronously, and freeze() promises a frozen
    server when it returns.
    """
    if not _waitUntil(
        lambda: all(_processState(pid) in (None, "T", "t", "Z", "X") for pid in pids), timeout
    ):
        raise ServerError(f"processes {pids} did not stop within {timeout:.0f} s")


def _signalProcesses(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _logTail(path: Path, lines: int = 20) -> str:
    """
    The last lines of a server's log, to put in an error message.
    """
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _waitUntil(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# PostgreSQL


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
            + _INSTALL_HINT.format(package="postgresql")
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
            + _INSTALL_HINT.format(package="postgresql")
        ) from None
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    if not os.access(runuser, os.X_OK):
        raise MissingBinaries("runuser (from util-linux) is needed to run PostgreSQL as root.")
    return [runuser, "-u", POSTGRES_SYSTEM_USER, "--"]


def _giveToPostgresUser(path: Path) -> None:
    """
    As root, make C{path} belong to the user that runs PostgreSQL.
    """
    if os.geteuid() == 0:
        account = pwd.getpwnam(POSTGRES_SYSTEM_USER)
        os.chown(path, account.pw_uid, account.pw_gid)


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

    @classmethod
    def create(
        cls, baseDirectory: Path, port: int | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> PostgresServer:
        """
        Make a new cluster under C{baseDirectory} with initdb, or reuse the
        one already there (as C{dev/gateway} does between runs). The server
        is not started.

        @param port: the TCP port to listen on; a free one when L{None}.
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
            clusterDirectory = _makeClusterDirectory(baseDirectory, runAs)
            _initdb(binaries, clusterDirectory, runAs, log, timeout)

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
        return pid if _processExists(pid) else None

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
        if self in _running and self.isRunning:
            return
        if self.isRunning:
            self.stop(timeout)
        attempts = 3 if self._mayChangePort else 1
        for attempt in range(attempts):
            if self._startOnce(timeout):
                break
            if attempt + 1 < attempts and "in use" in _logTail(self.logFile, 10):
                self._port = freePort()
                continue
            raise ServerError(
                f"PostgreSQL did not start on port {self._port} within {timeout:.0f} s; "
                f"the end of {self.logFile}:\n{_logTail(self.logFile)}"
            )
        self._mayChangePort = False
        _running.add(self)
        self._waitForConnections(timeout)

    def _startOnce(self, timeout: float) -> bool:
        socketDirectory = self.socketDirectory
        socketDirectory.mkdir(exist_ok=True)
        _giveToPostgresUser(socketDirectory)
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

        if not _waitUntil(connects, timeout, interval=0.1):
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
        _running.discard(self)
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
        if status == 0 and not _processExists(pid):
            return
        # A server that ignores a fast shutdown: kill it and its children,
        # rather than leave it running.
        _signalProcesses([*_childProcesses(pid), pid], signal.SIGKILL)
        if not _waitUntil(lambda: not _processExists(pid), 10):
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
        children = _childProcesses(pid)
        _signalProcesses(children, signal.SIGSTOP)
        _waitUntilSuspended([pid, *children])

    def thaw(self) -> None:
        """
        Resume a server suspended by L{freeze}; harmless on one that is not.
        """
        pid = self.postmasterPid()
        if pid is None:
            return
        _signalProcesses(_childProcesses(pid), signal.SIGCONT)
        os.kill(pid, signal.SIGCONT)

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

    def createDatabase(self, name: str) -> str:
        """
        Create the database C{name} and return a DSN that connects to it.
        """
        with self.connect() as connection:
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
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


def _makeClusterDirectory(baseDirectory: Path, runAs: list[str]) -> Path:
    """
    An empty directory, owned by the user that runs PostgreSQL, to hold the
    cluster: C{baseDirectory/cluster} when that user can use it, else a new
    directory under /tmp that C{baseDirectory/cluster} links to.
    """
    clusterLink = baseDirectory / "cluster"
    clusterLink.mkdir(mode=0o700)
    _giveToPostgresUser(clusterLink)
    socketPath = clusterLink / "socket" / ".s.PGSQL.65535"
    if len(os.fsencode(socketPath)) <= _MAX_SOCKET_PATH and _usableByServer(clusterLink, runAs):
        return clusterLink
    clusterLink.rmdir()
    # mkdtemp makes a fresh 0700 directory, so a shared /tmp is safe here.
    parents = [tempfile.gettempdir(), "/tmp", "/var/tmp"]  # noqa: S108
    for parent in dict.fromkeys(parents):
        if not os.path.isdir(parent):
            continue
        candidate = Path(tempfile.mkdtemp(prefix="svc-postgres-", dir=parent))
        _giveToPostgresUser(candidate)
        if _usableByServer(candidate, runAs):
            clusterLink.symlink_to(candidate, target_is_directory=True)
            return candidate
        candidate.rmdir()
    raise ServerError(
        f"The {POSTGRES_SYSTEM_USER!r} user can neither use {baseDirectory} nor a "
        "directory under /tmp for the PostgreSQL cluster."
    )


def _initdb(
    binaries: Path, clusterDirectory: Path, runAs: list[str], log: Path, timeout: float
) -> None:
    """
    Run initdb into C{clusterDirectory/data} and add our settings.

    initdb writes into data.new, renamed once complete, so an interrupted
    initdb never leaves a directory that looks like a usable cluster.
    """
    incomplete = clusterDirectory / "data.new"
    for locale in ("C.UTF-8", "C"):
        shutil.rmtree(incomplete, ignore_errors=True)
        command = [
            *runAs,
            str(binaries / "initdb"),
            "-D",
            str(incomplete),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            f"--locale={locale}",
            "--no-sync",
        ]
        with log.open("ab") as output:
            result = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=clusterDirectory,
                timeout=timeout * 4,
                check=False,
            )
        if result.returncode == 0:
            break
    else:
        raise ServerError(f"initdb failed; the end of {log}:\n{_logTail(log)}")
    with (incomplete / "postgresql.conf").open("a") as conf:
        conf.write(
            "\n# Added by svcd.testing.servers: a private, disposable server.\n"
            f"listen_addresses = '{LOOPBACK}'\n"
            "fsync = off\n"
            "synchronous_commit = off\n"
            "full_page_writes = off\n"
        )
    incomplete.rename(clusterDirectory / "data")


# Redis


def findRedisServer() -> Path:
    """
    The redis-server program.

    @raise MissingBinaries: when Redis is not installed.
    """
    found = shutil.which("redis-server")
    if found is None:
        for candidate in REDIS_SERVER_CANDIDATES:
            if os.access(candidate, os.X_OK):
                found = candidate
                break
    if found is None:
        raise MissingBinaries(
            "redis-server was not found on PATH. " + _INSTALL_HINT.format(package="redis-server")
        )
    return Path(found)


class RedisServer:
    """
    A private Redis server on 127.0.0.1 that keeps nothing on disk, run as a
    child process in the foreground (never daemonized) so that its process
    id is known and it can be stopped, frozen and restarted on the same
    port.
    """

    host = LOOPBACK

    def __init__(self, executable: Path, baseDirectory: Path, port: int, portChosen: bool) -> None:
        self._executable = executable
        self._baseDirectory = baseDirectory
        self._port = port
        self._mayChangePort = portChosen
        self._process: subprocess.Popen[bytes] | None = None

    @classmethod
    def create(cls, baseDirectory: Path, port: int | None = None) -> RedisServer:
        """
        Prepare a server whose working directory and log are in
        C{baseDirectory}; it is not started.

        @param port: the TCP port to listen on; a free one when L{None}.
        @raise MissingBinaries: when Redis is not installed.
        """
        executable = findRedisServer()
        baseDirectory = Path(os.path.abspath(baseDirectory))
        baseDirectory.mkdir(parents=True, exist_ok=True)
        return cls(
            executable,
            baseDirectory,
            port if port is not None else freePort(),
            portChosen=port is None,
        )

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """
        The redis:// URL of database 0.
        """
        return f"redis://{self.host}:{self._port}/0"

    @property
    def baseDirectory(self) -> Path:
        return self._baseDirectory

    @property
    def logFile(self) -> Path:
        return self._baseDirectory / "redis.log"

    @property
    def pid(self) -> int | None:
        if self._process is None or self._process.poll() is not None:
            return None
        return self._process.pid

    @property
    def isRunning(self) -> bool:
        return self.pid is not None

    def start(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Start the server and return once it answers PING.

        @raise ServerError: when it exits or does not answer within
            C{timeout}.
        """
        if self.isRunning:
            return
        attempts = 3 if self._mayChangePort else 1
        for attempt in range(attempts):
            if self._startOnce(timeout):
                break
            if attempt + 1 < attempts and "in use" in _logTail(self.logFile, 10):
                self._port = freePort()
                continue
            raise ServerError(
                f"Redis did not start on port {self._port} within {timeout:.0f} s; "
                f"the end of {self.logFile}:\n{_logTail(self.logFile)}"
            )
        self._mayChangePort = False

    def _startOnce(self, timeout: float) -> bool:
        command = [
            str(self._executable),
            "--port",
            str(self._port),
            "--bind",
            LOOPBACK,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._baseDirectory),
            "--daemonize",
            "no",
            "--logfile",
            "",
        ]
        with self.logFile.open("ab") as log:
            # A session of its own: a Ctrl-C in the terminal of dev/gateway
            # must not kill Redis before the daemons that use it are down.
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _running.add(self)
        process = self._process
        answered = _waitUntil(lambda: process.poll() is not None or self.ping(), timeout)
        if answered and process.poll() is None:
            return True
        self.stop()
        return False

    def stop(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Stop the server (SIGTERM, then SIGKILL after C{timeout}) and wait
        until it has exited; the port stays the same for the next start.
        """
        _running.discard(self)
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            self.thaw()
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._process = None

    def freeze(self) -> None:
        """
        Suspend the server (SIGSTOP): connections are accepted by the kernel
        but no command is answered.
        """
        pid = self.pid
        if pid is None:
            raise ServerError("Redis is not running")
        os.kill(pid, signal.SIGSTOP)
        _waitUntilSuspended([pid])

    def thaw(self) -> None:
        """
        Resume a server suspended by L{freeze}; harmless on one that is not.
        """
        pid = self.pid
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    def destroy(self) -> None:
        """
        Stop the server and remove C{baseDirectory}.
        """
        self.stop()
        shutil.rmtree(self._baseDirectory, ignore_errors=True)

    def command(self, *words: str, timeout: float = 2.0) -> bytes:
        """
        Send one command and return the first line of its reply, such as
        C{b"+PONG"}: enough for the few commands the tests and the dev
        stack need, without a Redis client library.

        @raise OSError: when the server cannot be reached or does not answer
            within C{timeout} (L{TimeoutError}).
        """
        encoded = [word.encode() for word in words]
        request = b"*%d\r\n" % len(encoded) + b"".join(
            b"$%d\r\n%s\r\n" % (len(word), word) for word in encoded
        )
        with socket.create_connection((self.host, self._port), timeout=timeout) as connection:
            connection.sendall(request)
            reply = b""
            while b"\r\n" not in reply:
                chunk = connection.recv(4096)
                if not chunk:
                    break
                reply += chunk
        return reply.split(b"\r\n", 1)[0]

    def ping(self, timeout: float = 1.0) -> bool:
        """
        Whether the server answers PING within C{timeout}.
        """
        try:
            return self.command("PING", timeout=timeout) == b"+PONG"
        except OSError:
            return False

    def flushAll(self) -> None:
        """
        Delete every key in every database.
        """
        reply = self.command("FLUSHALL")
        if reply != b"+OK":
            raise ServerError(f"FLUSHALL failed: {reply!r}")
