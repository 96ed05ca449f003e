"""
A private Redis Sentinel group for the tests (decisions D16): a master, a
replica and three sentinels (L{SentinelGroup}), each a child process on a
free loopback port, keeping nothing but the sentinels' own configuration
files on disk (see L{svcd.devkit.servers} for why private servers).

The sentinels are told to decide quickly (a master is down after
C{downAfter} ms), so that a test sees a failover in a few seconds.
"""

# Running the installed programs is this module's purpose; every command is
# a fixed program with arguments we build, never a shell string.
# ruff: noqa: S603

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import (
    DEFAULT_TIMEOUT,
    LOOPBACK,
    ServerError,
    findProgram,
    freePort,
    logTail,
    running,
    waitUntil,
)

SENTINEL_CANDIDATES = ("/usr/bin/redis-sentinel", "/usr/sbin/redis-sentinel")
MASTER_NAME = "svcmaster"

Reply = bytes | int | list["Reply"] | None


def findRedisSentinel() -> Path:
    """
    The redis-sentinel program (Debian's package redis-sentinel).

    @raise MissingBinaries: when it is not installed.
    """
    return findProgram("redis-sentinel", SENTINEL_CANDIDATES, "redis-sentinel")


def command(port: int, *words: str, timeout: float = 2.0, password: str | None = None) -> Reply:
    """
    Send one command to the server on C{port} (after C{AUTH password}, with
    one) and return its whole reply (RESP 2: bulk strings as bytes, errors
    as L{ServerError}).

    @raise OSError: when the server cannot be reached or does not answer
        within C{timeout}.
    """
    commands = [("AUTH", password), words] if password is not None else [words]
    request = b"".join(_encoded(each) for each in commands)
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as connection:
        connection.sendall(request)
        reader = _Reader(connection)
        replies = [reader.reply() for _ in commands]
    return replies[-1]


def _encoded(words: tuple[str, ...]) -> bytes:
    encoded = [word.encode() for word in words]
    return b"*%d\r\n" % len(encoded) + b"".join(
        b"$%d\r\n%s\r\n" % (len(word), word) for word in encoded
    )


class _Reader:
    def __init__(self, connection: socket.socket) -> None:
        self._connection = connection
        self._buffer = b""

    def _line(self) -> bytes:
        while b"\r\n" not in self._buffer:
            self._more()
        line, self._buffer = self._buffer.split(b"\r\n", 1)
        return line

    def _more(self) -> None:
        chunk = self._connection.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self._buffer += chunk

    def reply(self) -> Reply:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise ServerError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            while len(self._buffer) < length + 2:
                self._more()
            data, self._buffer = self._buffer[:length], self._buffer[length + 2 :]
            return data
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [self.reply() for _ in range(count)]
        raise ServerError(f"not a RESP reply: {line!r}")


def info(port: int, section: str, password: str | None = None) -> dict[str, str]:
    """
    One section of C{INFO} as a dictionary.
    """
    reply = command(port, "INFO", section, password=password)
    assert isinstance(reply, bytes)
    fields: dict[str, str] = {}
    for line in reply.decode().splitlines():
        if ":" in line and not line.startswith("#"):
            field, value = line.split(":", 1)
            fields[field] = value
    return fields


class SentinelProcess:
    """
    One redis-sentinel on 127.0.0.1, in the foreground as a child process,
    with its configuration file (which Sentinel rewrites) in
    C{baseDirectory}.
    """

    def __init__(self, executable: Path, baseDirectory: Path, port: int) -> None:
        self._executable = executable
        self._baseDirectory = baseDirectory
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def logFile(self) -> Path:
        return self._baseDirectory / "sentinel.log"

    @property
    def pid(self) -> int | None:
        if self._process is None or self._process.poll() is not None:
            return None
        return self._process.pid

    def configure(self, masterPort: int, downAfter: int, failoverTimeout: int) -> None:
        """
        Write the configuration: monitor the master on C{masterPort}
        (quorum 2).
        """
        self._baseDirectory.mkdir(parents=True, exist_ok=True)
        lines = [
            f"port {self.port}",
            f"bind {LOOPBACK}",
            "daemonize no",
            'logfile ""',
            f"dir {self._baseDirectory}",
            "protected-mode no",
            f"sentinel monitor {MASTER_NAME} {LOOPBACK} {masterPort} 2",
            f"sentinel down-after-milliseconds {MASTER_NAME} {downAfter}",
            f"sentinel failover-timeout {MASTER_NAME} {failoverTimeout}",
            f"sentinel parallel-syncs {MASTER_NAME} 1",
        ]
        (self._baseDirectory / "sentinel.conf").write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Start the sentinel and return once it answers PING.
        """
        if self.pid is not None:
            return
        with self.logFile.open("ab") as log:
            self._process = subprocess.Popen(
                [str(self._executable), str(self._baseDirectory / "sentinel.conf")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        running.add(self)
        process = self._process
        if not waitUntil(lambda: process.poll() is not None or self.ping(), timeout):
            self.stop()
            raise ServerError(
                f"redis-sentinel did not start on port {self.port} within {timeout:.0f} s; "
                f"the end of {self.logFile}:\n{logTail(self.logFile)}"
            )
        if process.poll() is not None:
            self.stop()
            raise ServerError(
                f"redis-sentinel exited at start; the end of {self.logFile}:\n"
                f"{logTail(self.logFile)}"
            )

    def ping(self) -> bool:
        try:
            return command(self.port, "PING", timeout=1.0) == b"PONG"
        except (OSError, ServerError):
            return False

    def stop(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Stop the sentinel (SIGTERM, then SIGKILL after C{timeout}).
        """
        running.discard(self)
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def masterAddress(self) -> tuple[str, int] | None:
        """
        The master's address as this sentinel knows it now.
        """
        reply = command(self.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        if not isinstance(reply, list) or len(reply) != 2:
            return None
        host, port = reply
        assert isinstance(host, bytes) and isinstance(port, bytes)
        return host.decode(), int(port)

    def masterState(self) -> dict[str, str]:
        """
        C{SENTINEL MASTER}: what this sentinel knows of the master.
        """
        reply = command(self.port, "SENTINEL", "MASTER", MASTER_NAME)
        assert isinstance(reply, list)
        words = [word.decode() if isinstance(word, bytes) else str(word) for word in reply]
        return dict(zip(words[::2], words[1::2], strict=True))


class SentinelGroup:
    """
    A master, its replica and three sentinels watching them, on free
    loopback ports under C{baseDirectory}.

    @ivar servers: the two Redis servers, the master first at start (after
        a failover the sentinels say which is which: L{master}).
    """

    def __init__(
        self,
        baseDirectory: Path,
        sentinelCount: int = 3,
        downAfter: int = 800,
        failoverTimeout: int = 3000,
    ) -> None:
        executable = findRedisSentinel()
        self.baseDirectory = Path(os.path.abspath(baseDirectory))
        self.servers = [
            RedisServer.create(self.baseDirectory / "master"),
            RedisServer.create(self.baseDirectory / "replica"),
        ]
        self.sentinels = [
            SentinelProcess(executable, self.baseDirectory / f"sentinel{index}", freePort())
            for index in range(sentinelCount)
        ]
        self._downAfter = downAfter
        self._failoverTimeout = failoverTimeout

    @property
    def url(self) -> str:
        """
        The C{redis+sentinel://} URL of the group (database 0).
        """
        hosts = ",".join(f"{LOOPBACK}:{sentinel.port}" for sentinel in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}"

    def start(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Start the servers, make the second a replica of the first, start
        the sentinels, and return once each sentinel knows the replica and
        the other sentinels (so that a failover can happen).
        """
        master, replica = self.servers
        master.start(timeout)
        replica.start(timeout)
        for server in self.servers:
            # Redis 7 waits 5 s for more replicas before a diskless full
            # sync; this group has one (and after a failover, the old master
            # comes back as the other).
            command(server.port, "CONFIG", "SET", "repl-diskless-sync-delay", "0")
        command(replica.port, "REPLICAOF", LOOPBACK, str(master.port))

        def replicating() -> bool:
            return info(replica.port, "replication").get("master_link_status") == "up"

        if not waitUntil(replicating, timeout):
            raise ServerError("the replica did not connect to its master")
        for sentinel in self.sentinels:
            sentinel.configure(master.port, self._downAfter, self._failoverTimeout)
            sentinel.start(timeout)
        others = str(len(self.sentinels) - 1)

        def ready() -> bool:
            try:
                states = [sentinel.masterState() for sentinel in self.sentinels]
            except (OSError, ServerError):
                return False
            return all(
                state.get("num-other-sentinels") == others and state.get("num-slaves") == "1"
                for state in states
            )

        if not waitUntil(ready, timeout, interval=0.1):
            raise ServerError("the sentinels did not find each other and the replica in time")

    def masterPort(self) -> int | None:
        """
        The master's port as the first sentinel that answers names it.
        """
        for sentinel in self.sentinels:
            if sentinel.pid is None:
                continue
            try:
                address = sentinel.masterAddress()
            except (OSError, ServerError):
                continue
            if address is not None:
                return address[1]
        return None

    def master(self) -> RedisServer:
        """
        The server the sentinels name as the master.
        """
        port = self.masterPort()
        for server in self.servers:
            if server.port == port:
                return server
        raise ServerError(f"the sentinels name no server of this group ({port})")

    def kill(self, server: RedisServer) -> None:
        """
        SIGKILL C{server}: no goodbye to its clients, replica or sentinels.
        """
        pid = server.pid
        if pid is None:
            raise ServerError("that server is not running")
        os.kill(pid, signal.SIGKILL)
        server.stop()

    def waitForFailover(self, oldPort: int, timeout: float = DEFAULT_TIMEOUT) -> int:
        """
        Wait until a running sentinel names another master than the one on
        C{oldPort}, and that one says it is the master (the moment a client
        can follow the failover); its port.
        """
        found: list[int] = []

        def switched() -> bool:
            for sentinel in self.sentinels:
                if sentinel.pid is None:
                    continue
                try:
                    address = sentinel.masterAddress()
                    if address is None or address[1] == oldPort:
                        continue
                    role = command(address[1], "ROLE")
                except (OSError, ServerError):
                    continue
                if isinstance(role, list) and role and role[0] == b"master":
                    found.append(address[1])
                    return True
            return False

        if not waitUntil(switched, timeout, interval=0.02):
            raise ServerError(f"no failover from port {oldPort} within {timeout:.0f} s")
        return found[0]

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        for server in self.servers:
            server.stop()

    def destroy(self) -> None:
        self.stop()
        for server in self.servers:
            server.destroy()
        shutil.rmtree(self.baseDirectory, ignore_errors=True)
