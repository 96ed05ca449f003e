"""
Private PostgreSQL and Redis servers for the tests and for C{dev/gateway}:
what the two (L{svcd.devkit.postgres}, L{svcd.devkit.redis}) share, free
loopback ports, the exit handler, the errors and the process helpers.

Why private servers: a developer's machine may run no PostgreSQL or Redis at
all, or run them with data and settings we must neither depend on nor
disturb. So every test run, and the local development stack, starts its own
servers from the installed binaries, on free loopback ports, with their data
under a directory the caller names.

These helpers are synchronous (they run subprocesses and wait for them): the
tests call them from pytest fixtures, outside the reactor, and
L{svcd.devkit.gateway} runs no reactor at all.

Every server that was started and not stopped again is stopped when the
Python process exits (L{atexit}), so a test run leaves no stray server
behind even when a fixture finalizer never runs.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import random
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

LOOPBACK = "127.0.0.1"

# How long start() and stop() wait by default. Generous, because a loaded CI
# machine can be slow to run initdb or to start a server; a healthy one takes
# well under a second.
DEFAULT_TIMEOUT = 30.0

INSTALL_HINT = (
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


def findProgram(name: str, candidates: tuple[str, ...], package: str) -> Path:
    """
    The program C{name}: on PATH, or else the first of C{candidates} that
    may be run (sudo's secure_path and cron's PATH lack /usr/sbin on some
    systems).

    @raise MissingBinaries: when it is not installed, naming the Debian
        C{package} that has it.
    """
    found = shutil.which(name)
    if found is None:
        found = next((each for each in candidates if os.access(each, os.X_OK)), None)
    if found is None:
        raise MissingBinaries(
            f"{name} was not found on PATH. " + INSTALL_HINT.format(package=package)
        )
    return Path(found)


def freePort() -> int:
    """
    A TCP port on the loopback interface that nobody listens on right now,
    and that no other call of C{freePort} on this machine (in this process
    or another, for as long as that process lives) has handed out.

    It is free at this instant; but the caller binds it only later (a
    daemon takes a second or more to start), and the same port may be
    picked again for the next caller in between. Tests run
    in parallel (pytest-xdist workers, other developers' runs) would then
    start two servers on one port, and one of them fails. So each port
    handed out is reserved in L{_PortReservations}, and a port offered
    again while its reservation holds is passed over.

    The port comes from below the kernel's range of ephemeral ports
    (L{_unusedPort}) when that leaves room: no C{connect()} takes a local
    port there, nor anyone's bind of port 0 (grpcio, tests/tcprelay.py),
    so between this call and its owner's bind only another explicit bind
    of that port could take it. Otherwise it is the kernel's own pick, and
    any of those can take it first; the servers pick a new one and retry
    when their first start finds the port taken.
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

# The band freePort draws from: from here up to the first ephemeral port
# (32768 by Linux's default; 10,000 ports and more), above the registered
# ports of the servers a developer's machine may run (PostgreSQL's 5432,
# Redis's 6379, 8080 and its kin). A band of fewer than _LEAST_BAND ports
# (an ip_local_port_range lowered by the operator) is not used.
_BAND_START = 20000
_LEAST_BAND = 2000
_BAND_ATTEMPTS = 20
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeralStart() -> int | None:
    """
    The first port of the kernel's ephemeral range; None when it cannot
    be read (not Linux).
    """
    try:
        return int(_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _unusedPort() -> int:
    """
    A loopback TCP port nobody has bound right now: one drawn at random
    below the ephemeral range that a bind shows free, else (no such band,
    or every draw taken) the kernel's pick.
    """
    start = _ephemeralStart()
    if start is not None and start - _BAND_START >= _LEAST_BAND:
        for _ in range(_BAND_ATTEMPTS):
            port = _random.randrange(_BAND_START, start)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((LOOPBACK, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        kernels: int = probe.getsockname()[1]
        return kernels


# Seeded by the system, not by the tests' random seeds: two workers seeded
# alike would draw the same ports in the same order.
_random = random.SystemRandom()


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
running: set[_Stoppable] = set()


@atexit.register
def _stopEverything() -> None:
    """
    Stop every server this process started and did not stop, so that an
    interrupted test run or a crashed dev stack leaves nothing running.
    """
    for server in list(running):
        # Best effort at exit: one failure must not keep the others running.
        with contextlib.suppress(Exception):
            server.stop(timeout=10.0)
    running.clear()


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


def childProcesses(parent: int) -> list[int]:
    """
    The process ids whose parent is C{parent}, read from /proc.
    """
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and _parentProcess(int(entry.name)) == parent
    ]


def processExists(pid: int) -> bool:
    """
    Whether process C{pid} is alive. A zombie is not: a daemonized
    postmaster's parent is init, which may take a while to reap it, and its
    exit is what we wait for.
    """
    return _processState(pid) not in (None, "Z", "X")


def waitUntilSuspended(pids: list[int], timeout: float = 5.0) -> None:
    """
    Wait until every process of C{pids} is stopped ("T"), a zombie or gone:
    SIGSTOP is delivered asynchronously, and freeze() promises a frozen
    server when it returns.
    """
    if not waitUntil(
        lambda: all(_processState(pid) in (None, "T", "t", "Z", "X") for pid in pids), timeout
    ):
        raise ServerError(f"processes {pids} did not stop within {timeout:.0f} s")


def signalProcesses(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def logTail(path: Path, lines: int = 20) -> str:
    """
    The last lines of a server's log, to put in an error message.
    """
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def waitUntil(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
