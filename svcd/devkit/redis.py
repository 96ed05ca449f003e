"""
A private Redis server (L{RedisServer}) for the tests, the benchmarks and
C{dev/gateway}: run in the foreground as a child process, keeping nothing
on disk (see L{svcd.devkit.servers} for why private servers).
"""

# Running the installed server program is this module's purpose; every
# command is a fixed program with arguments we build, never a shell string.
# ruff: noqa: S603

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from svcd.devkit.servers import (
    DEFAULT_TIMEOUT,
    LOOPBACK,
    ServerError,
    findProgram,
    freePort,
    logTail,
    running,
    waitUntil,
    waitUntilSuspended,
)

# Where to look for redis-server when it is not on PATH (sudo's secure_path
# and cron's PATH lack /usr/sbin on some systems).
REDIS_SERVER_CANDIDATES = ("/usr/bin/redis-server", "/usr/sbin/redis-server")


def findRedisServer() -> Path:
    """
    The redis-server program.

    @raise MissingBinaries: when Redis is not installed.
    """
    return findProgram("redis-server", REDIS_SERVER_CANDIDATES, "redis-server")


class RedisServer:
    """
    A private Redis server on 127.0.0.1 that keeps nothing on disk, run as a
    child process in the foreground (never daemonized) so that its process
    id is known and it can be stopped, frozen and restarted on the same
    port.
    """

    host = LOOPBACK
    # More of redis-server's options, for a kind of server of its own (a
    # Redis Cluster's node: L{svcd.devkit.rediscluster}).
    serverArguments: tuple[str, ...] = ()

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
            if attempt + 1 < attempts and "in use" in logTail(self.logFile, 10):
                self._port = freePort()
                continue
            raise ServerError(
                f"Redis did not start on port {self._port} within {timeout:.0f} s; "
                f"the end of {self.logFile}:\n{logTail(self.logFile)}"
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
            *self.serverArguments,
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
        running.add(self)
        process = self._process
        answered = waitUntil(lambda: process.poll() is not None or self.ping(), timeout)
        if answered and process.poll() is None:
            return True
        self.stop()
        return False

    def stop(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Stop the server (SIGTERM, then SIGKILL after C{timeout}) and wait
        until it has exited; the port stays the same for the next start.
        """
        running.discard(self)
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
        waitUntilSuspended([pid])

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
