"""
Running svc-auth, svc-proxy and svc-memory as real processes (C{twistd -n ...}) for
end-to-end tests and the benchmark.
"""

# Runs our own daemons with argument lists, and talks HTTP to them on
# loopback only.
# ruff: noqa: S603, S310
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO, Protocol

from svcd.devkit.servers import freePort


def twistdCommand(plugin: str) -> list[str]:
    """
    C{twistd -n <plugin>} with this interpreter, so the test's virtualenv is
    the one that runs.
    """
    # --pidfile= : no pidfile, so runs never trip over a stale one.
    return [
        sys.executable,
        "-c",
        "from twisted.scripts.twistd import run; run()",
        "-n",
        "--pidfile=",
        plugin,
    ]


class DaemonProcess(Protocol):
    """
    What L{Daemon} and the tests use of a daemon's process: the part of
    C{subprocess.Popen} that a process started some other way can offer.
    """

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def popen(
    command: list[str], environment: dict[str, str], output: BinaryIO, cwd: Path
) -> DaemonProcess:
    """
    Start C{command} as a new process, its stdout and stderr both on
    C{output}: how a daemon starts unless L{launcher} says otherwise.
    """
    return subprocess.Popen(
        command, env=environment, stdout=output, stderr=subprocess.STDOUT, cwd=cwd
    )


# How Daemon.start starts a process. The test suite replaces it
# (tests/forkedtwistd.py) to fork its daemons from a process that imported
# the third-party libraries once, instead of paying for a new interpreter
# and those imports at each of its hundreds of starts.
launcher: Callable[[list[str], dict[str, str], BinaryIO, Path], DaemonProcess] = popen


class Daemon:
    """
    One twistd process; its combined output goes to C{logFile}.
    """

    def __init__(self, plugin: str, environment: Mapping[str, str], logFile: Path) -> None:
        self.plugin = plugin
        self.environment = dict(environment)
        self.logFile = logFile
        self.process: DaemonProcess | None = None
        self.httpPort = int(self.environment["SVC_PORT"])

    def start(self) -> "Daemon":
        # A daemon that dies of a signal (a crash in a C extension) says
        # where, in its log, instead of vanishing silently.
        environment = {"PYTHONFAULTHANDLER": "1", **os.environ, **self.environment}
        with self.logFile.open("ab") as output:
            self.process = launcher(
                twistdCommand(self.plugin), environment, output, self.logFile.parent
            )
        return self

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpPort}{path}"

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """
        A GET on the daemon's HTTP port: status and body (also for 4xx and
        5xx answers).
        """
        try:
            with urllib.request.urlopen(self.url(path), timeout=timeout) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    # How long a daemon may take to answer at all. A healthy machine needs
    # about a second; one whose cores are shared with the suite's other
    # workers and with other runs beside it needed more than 20 s (twistd,
    # Twisted, grpcio and OpenTelemetry imported with a fraction of a core).
    # A bound against a daemon that never comes up, not a promise.
    START_TIMEOUT = 60.0

    def waitForHealth(self, timeout: float = START_TIMEOUT) -> None:
        self.waitForRoute("/health", timeout)

    def waitForReady(self, timeout: float = START_TIMEOUT) -> None:
        """
        Wait until /ready answers 200, as a load balancer would before
        sending traffic.
        """
        self.waitForRoute("/ready", timeout)

    def waitForRoute(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.plugin} exited with {self.process.returncode}:\n{self.output()}"
                )
            try:
                if self.get(path, timeout=1.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.plugin} did not answer {path} with 200:\n{self.output()}")

    def output(self) -> str:
        return self.logFile.read_text(errors="replace") if self.logFile.exists() else ""

    def describe(self, lines: int = 30) -> str:
        """
        The process's state (running, or its exit status) and the last
        C{lines} lines of its log: what a failed wait on it should say.
        """
        status = None if self.process is None else self.process.poll()
        state = "running" if status is None else f"exited with {status}"
        tail = "\n".join(self.output().splitlines()[-lines:])
        pid = None if self.process is None else self.process.pid
        return f"{self.plugin} (pid {pid}) {state}; its log ends:\n{tail}"

    def signal(self, signum: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def freeze(self, timeout: float = 5.0) -> None:
        """
        Suspend the daemon (SIGSTOP) and return only once every one of its
        threads is stopped: its ports still accept, nothing answers.

        SIGSTOP is delivered asynchronously: the thread the kernel picks to
        take it must be scheduled before the others are stopped, and until
        then grpcio's threads go on answering. On a loaded machine that
        took up to 170 ms, time enough to answer a request sent after
        C{signal(SIGSTOP)} returned.
        """
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not _allThreadsStopped(self.process.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.plugin} did not stop within {timeout} s")
            time.sleep(0.001)

    def thaw(self) -> None:
        """
        Resume a daemon suspended by L{freeze}.
        """
        self.signal(signal.SIGCONT)

    def terminate(self, timeout: float = 20.0) -> int:
        """
        SIGTERM, then wait; returns the exit status (SIGKILL after
        C{timeout}, which makes the status negative).
        """
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        # Already over: its status, at once.
        return self.process.wait()


def _allThreadsStopped(pid: int) -> bool:
    """
    Is every thread of process C{pid} stopped (or gone)? Each thread has its
    own state in /proc/PID/task/TID/stat; /proc/PID/stat is the main
    thread's only.
    """
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            # The thread has exited meanwhile.
            continue
        # The name in parentheses may hold anything; the state follows it.
        if stat[stat.rindex(")") + 2] not in "TtZX":
            return False
    return True


def authEnvironment(dsn: str, **overrides: str) -> dict[str, str]:
    """
    The environment of an svc-auth on free loopback ports.
    """
    return {
        "POSTGRES_DSN": dsn,
        "SVC_HOST": "127.0.0.1",
        "SVC_PORT": str(freePort()),
        "SVC_GRPC_PORT": str(freePort()),
        "SVC_SHUTDOWN_TIMEOUT": "5s",
        **overrides,
    }


def memoryEnvironment(dsn: str, **overrides: str) -> dict[str, str]:
    """
    The environment of an svc-memory on free loopback ports.
    """
    return {
        "POSTGRES_DSN": dsn,
        "SVC_HOST": "127.0.0.1",
        "SVC_PORT": str(freePort()),
        "SVC_GRPC_PORT": str(freePort()),
        "SVC_SHUTDOWN_TIMEOUT": "5s",
        **overrides,
    }
