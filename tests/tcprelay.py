"""
A TCP relay for fault tests: it forwards loopback connections to a target
port and can, on demand, freeze them (stop moving bytes while the
connections stay open, as a stalled network or a hung peer would) or cut
them (reset every open connection, as a dropped link or a restarted load
balancer would), while still accepting new connections.

Plain threads and blocking sockets: it runs beside the test's own code,
outside any reactor, and never touches the processes it sits between.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time

from svcd.devkit.servers import LOOPBACK

_CHUNK = 65536
_POLL = 0.02


class TcpRelay:
    """
    Listens on a free loopback port (L{port}) and forwards each connection
    to C{targetPort}.
    """

    def __init__(self, targetPort: int) -> None:
        self._targetPort = targetPort
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        # When bytes from the target last reached a client (monotonic).
        self.lastForwardedToClient = float("-inf")
        self._moving = threading.Event()
        self._moving.set()
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="relay-accept", daemon=True)

    def start(self) -> TcpRelay:
        self._acceptor.start()
        return self

    def freeze(self) -> None:
        """
        Stop moving bytes on every connection, open or new; nothing is
        closed.
        """
        self._moving.clear()

    def thaw(self) -> None:
        """
        Move bytes again; what waited in the kernel's buffers goes first.
        """
        self._moving.set()

    def cut(self) -> int:
        """
        Reset every open connection at once (both sides see a reset);
        return how many there were. New connections are still accepted.
        """
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for end in pair:
                _reset(end)
        return len(pairs)

    def connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    def stop(self) -> None:
        self._stopping.set()
        self._moving.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                readable, _, _ = select.select([self._listener], [], [], _POLL)
                if not readable:
                    continue
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection((LOOPBACK, self._targetPort), timeout=5)
            except OSError:
                _reset(client)
                continue
            server.settimeout(None)
            pair = (client, server)
            with self._lock:
                self._pairs.append(pair)
            threading.Thread(target=self._pump, args=(pair,), daemon=True).start()

    def _pump(self, pair: tuple[socket.socket, socket.socket]) -> None:
        client, server = pair
        peers = {client: server, server: client}
        try:
            while not self._stopping.is_set():
                if not self._moving.wait(_POLL):
                    continue
                readable, _, _ = select.select([client, server], [], [], _POLL)
                for source in readable:
                    if not self._moving.is_set():
                        break
                    data = source.recv(_CHUNK)
                    if not data:
                        return
                    peers[source].sendall(data)
                    if source is server:
                        self.lastForwardedToClient = time.monotonic()
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                if pair in self._pairs:
                    self._pairs.remove(pair)
            for end in pair:
                with contextlib.suppress(OSError):
                    end.close()


def _reset(end: socket.socket) -> None:
    """
    Close with a reset rather than an orderly end (SO_LINGER of zero).
    """
    with contextlib.suppress(OSError):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        end.close()
