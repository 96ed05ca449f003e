"""
A private Redis Cluster (L{RedisCluster}) for the tests (decisions D16):
three masters, each a L{svcd.devkit.redis.RedisServer} started with
C{--cluster-enabled yes} on a free port, joined by hand (CLUSTER ADDSLOTS
and MEET: faster than C{redis-cli --cluster create}, and no other program
needed), no replicas. It offers what the tests use of a
L{svcd.devkit.redis.RedisServer} (C{url}, C{command}, C{flushAll}, C{stop},
C{start}, C{freeze}, C{thaw}), each command sent to the master of its key.
"""

# Running the installed server program is this module's purpose (through
# RedisServer); every command is a fixed program with arguments we build.
# ruff: noqa: S603

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from svcd.devkit.redis import RedisServer, findRedisServer
from svcd.devkit.servers import DEFAULT_TIMEOUT, LOOPBACK, ServerError, freePort, waitUntil
from svcd.limits.clusterlink import keySlot

SLOTS = 16384

# Commands without a key, sent to every master (FLUSHALL) or the first.
_KEYLESS = frozenset({b"PING", b"TIME", b"FLUSHALL", b"FLUSHDB", b"INFO", b"CLUSTER", b"DBSIZE"})


_CLUSTER_ARGUMENTS = (
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
    "nodes.conf",
    # A master that stops answering is seen as failed within about a
    # second (the tests kill one).
    "--cluster-node-timeout",
    "1000",
    # The other masters go on serving their slots meanwhile, as an
    # operator of svc is advised to configure (docs/operations.rst).
    "--cluster-require-full-coverage",
    "no",
)


class ClusterNode(RedisServer):
    """
    One master of a L{RedisCluster}: its cluster state (nodes.conf) is
    kept in its directory, so that it comes back with its slots after a
    stop.

    @param busPort: the port of the cluster's bus (Redis 7's
        C{--cluster-port}); None for the port plus 10000, the only one
        Redis 6 knows.
    """

    def __init__(
        self,
        executable: Path,
        baseDirectory: Path,
        port: int,
        portChosen: bool,
        busPort: int | None = None,
    ) -> None:
        super().__init__(executable, baseDirectory, port, portChosen)
        self.busPort = busPort
        bus = ("--cluster-port", str(busPort)) if busPort is not None else ()
        self.serverArguments = (*_CLUSTER_ARGUMENTS, *bus)


def call(host: str, port: int, *words: str | bytes, timeout: float = 5.0) -> Any:
    """
    One command over a plain socket, with the reply read whole (RESP
    integers, simple and bulk strings, errors as L{ServerError}, nil and
    arrays).
    """
    encoded = [word.encode() if isinstance(word, str) else word for word in words]
    request = b"*%d\r\n" % len(encoded) + b"".join(
        b"$%d\r\n%s\r\n" % (len(word), word) for word in encoded
    )
    with socket.create_connection((host, port), timeout=timeout) as connection:
        connection.sendall(request)
        reader = connection.makefile("rb")

        def read() -> Any:
            line = reader.readline().rstrip(b"\r\n")
            kind, rest = line[:1], line[1:]
            if kind == b":":
                return int(rest)
            if kind == b"+":
                return rest
            if kind == b"-":
                raise ServerError(rest.decode(errors="replace"))
            if kind == b"*":
                return None if rest == b"-1" else [read() for _ in range(int(rest))]
            if kind == b"$":
                return None if rest == b"-1" else reader.read(int(rest) + 2)[:-2]
            raise ServerError(f"unexpected reply {line!r}")

        return read()


def _redisMajor(executable: Path) -> int:
    """
    The major version of the redis-server program.
    """
    version = subprocess.run(
        [str(executable), "--version"], capture_output=True, text=True, check=False
    ).stdout
    found = re.search(r"v=(\d+)\.", version)
    return int(found.group(1)) if found else 0


class RedisCluster:
    """
    A Redis Cluster of C{masters} private servers on 127.0.0.1, slots
    spread evenly as C{redis-cli --cluster create} does.
    """

    host = LOOPBACK

    def __init__(self, baseDirectory: Path, nodes: list[ClusterNode]) -> None:
        self._baseDirectory = baseDirectory
        self.nodes = nodes

    @classmethod
    def create(cls, baseDirectory: Path, masters: int = 3) -> RedisCluster:
        """
        Prepare the servers, each in a directory of its own under
        C{baseDirectory}; nothing is started.

        @raise MissingBinaries: when Redis is not installed.
        """
        executable = findRedisServer()
        busPorts = _redisMajor(executable) >= 7
        baseDirectory = Path(os.path.abspath(baseDirectory))
        nodes = []
        for index in range(masters):
            directory = baseDirectory / f"node{index}"
            directory.mkdir(parents=True, exist_ok=True)
            port = freePort()
            # Redis 6's bus is the port plus 10000, which must be a port.
            while not busPorts and port > 55535:
                port = freePort()
            bus = freePort() if busPorts else None
            nodes.append(ClusterNode(executable, directory, port, portChosen=False, busPort=bus))
        return cls(baseDirectory, nodes)

    @property
    def port(self) -> int:
        return self.nodes[0].port

    @property
    def url(self) -> str:
        """
        The redis+cluster:// URL naming every master.
        """
        return "redis+cluster://" + ",".join(f"{self.host}:{node.port}" for node in self.nodes)

    @property
    def isRunning(self) -> bool:
        return all(node.isRunning for node in self.nodes)

    def ranges(self) -> list[tuple[int, int]]:
        """
        The slots of each master, first to last (as given at the start).
        """
        count = len(self.nodes)
        bounds = [index * SLOTS // count for index in range(count + 1)]
        return [(bounds[index], bounds[index + 1] - 1) for index in range(count)]

    def start(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Start every master and return once the cluster says its state is
        ok on each (the slots given and the masters met at the first
        start; a restart finds them in nodes.conf).

        @raise ServerError: when a server does not start, or the cluster
            is not ok within C{timeout}.
        """
        began = time.monotonic()
        for node in self.nodes:
            node.start(timeout)
        if self._info(self.nodes[0]).get("cluster_slots_assigned") == "0":
            self._form()
        left = max(1.0, timeout - (time.monotonic() - began))
        if not waitUntil(self._ok, left, interval=0.05):
            states = [self._info(node).get("cluster_state") for node in self.nodes]
            raise ServerError(f"the Redis Cluster is not ok within {timeout:.0f} s: {states}")

    def _form(self) -> None:
        for epoch, (node, (first, last)) in enumerate(zip(self.nodes, self.ranges(), strict=True)):
            slots = [str(slot) for slot in range(first, last + 1)]
            call(self.host, node.port, "CLUSTER", "ADDSLOTS", *slots)
            # Distinct epochs at once, as redis-cli gives them: no
            # collision for the masters to settle first.
            call(self.host, node.port, "CLUSTER", "SET-CONFIG-EPOCH", str(epoch + 1))
        introducer = self.nodes[0]
        for node in self.nodes[1:]:
            meet = ["CLUSTER", "MEET", self.host, str(node.port)]
            if node.busPort is not None:
                meet.append(str(node.busPort))
            call(self.host, introducer.port, *meet)

    def _info(self, node: ClusterNode) -> dict[str, str]:
        try:
            text = call(self.host, node.port, "CLUSTER", "INFO", timeout=1.0)
        except (OSError, ServerError):
            return {}
        fields = (line.split(":", 1) for line in text.decode().splitlines() if ":" in line)
        return {name: value for name, value in fields}

    def _ok(self) -> bool:
        """
        Every master says the cluster is ok and knows every other, and
        every master's map covers every slot with every master (gossip is
        done).
        """
        count = str(len(self.nodes))
        ports = {node.port for node in self.nodes}
        for node in self.nodes:
            info = self._info(node)
            if info.get("cluster_state") != "ok" or info.get("cluster_known_nodes") != count:
                return False
            try:
                ranges = call(self.host, node.port, "CLUSTER", "SLOTS", timeout=1.0)
            except (OSError, ServerError):
                return False
            covered = sum(int(last) - int(first) + 1 for first, last, *_ in ranges)
            if covered != SLOTS or {int(entry[2][1]) for entry in ranges} != ports:
                return False
        return True

    def stop(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Stop every master; the ports stay the same for the next start.
        """
        for node in self.nodes:
            node.stop(timeout)

    def freeze(self) -> None:
        """
        Suspend every master (SIGSTOP): see L{RedisServer.freeze}.
        """
        for node in self.nodes:
            node.freeze()

    def thaw(self) -> None:
        for node in self.nodes:
            node.thaw()

    def destroy(self) -> None:
        for node in self.nodes:
            node.destroy()
        shutil.rmtree(self._baseDirectory, ignore_errors=True)

    def nodeOf(self, key: str | bytes) -> ClusterNode:
        """
        The master that serves C{key}'s slot.
        """
        text = key.decode() if isinstance(key, bytes) else key
        slot = keySlot(text)
        for node, (first, last) in zip(self.nodes, self.ranges(), strict=True):
            if first <= slot <= last:
                return node
        raise AssertionError(slot)

    def addressFor(self, *words: str | bytes) -> tuple[str, int]:
        """
        Where to send a command: to the master of its key (EVAL's first),
        or to the first master for a command without one.
        """
        encoded = [word.encode() if isinstance(word, str) else word for word in words]
        name = encoded[0].upper()
        key: bytes | None = None
        if name in (b"EVAL", b"EVALSHA"):
            if int(encoded[2]) > 0:
                key = encoded[3]
        elif name not in _KEYLESS and len(encoded) > 1:
            key = encoded[1]
        node = self.nodes[0] if key is None else self.nodeOf(key)
        return self.host, node.port

    def command(self, *words: str, timeout: float = 2.0) -> bytes:
        """
        Send one command to the master of its key and return the first
        line of its reply, as L{RedisServer.command} does.
        """
        _, port = self.addressFor(*words)
        for node in self.nodes:
            if node.port == port:
                return node.command(*words, timeout=timeout)
        raise AssertionError(port)

    def ping(self, timeout: float = 1.0) -> bool:
        return all(node.ping(timeout) for node in self.nodes)

    def flushAll(self) -> None:
        """
        Delete every key on every master.
        """
        for node in self.nodes:
            node.flushAll()
