"""
Where svc-proxy listens: SVC_HOST and SVC_PORT, alone or shared with
other svc-proxy processes.

One svc-proxy is one reactor thread, so one core. To use every core of a
host, run several (the systemd template C{etc/systemd/svc-proxy@.service})
with C{SVC_REUSE_PORT=true}: each binds the same port with C{SO_REUSEPORT}
and the kernel spreads new connections over them. The proxy keeps no
state between requests (rate-limit counters live in Redis), so any worker
can answer any request.

Binding and listening are two steps (L{ProxyPort}). The port is bound
when the daemon starts, so that a port in use stops it at once with one
line, as any configuration error does; it listens only once the proxy is
ready to answer (L{svcd.proxy.service}). Until then the kernel gives it no
connection: a bound socket that does not listen has no accept queue, so
a new connection goes to the workers of the port that do listen, or, with
none, is refused at once rather than left waiting.
"""

from __future__ import annotations

import socket
from typing import Any, cast

from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IReactorSocket
from twisted.logger import Logger

# The accept queue. Twisted's default of 50 overflows when a few hundred
# clients connect at once; the kernel then drops SYNs and the client
# retries only after a second, which shows up as a one-second tail. nginx
# uses 511 on Linux; the kernel caps it at net.core.somaxconn.
BACKLOG = 511


class ProxyPort:
    """
    The TCP socket of SVC_HOST and SVC_PORT (IPv6 when the host has a
    colon), bound by L{bind} and listening from L{listen} on, with
    C{SO_REUSEPORT} when C{reusePort} is set, so that several processes of
    the same user can listen on one address and port.

    Twisted's own TCP endpoints bind and listen in one step; this class
    does both itself and hands the listening socket to
    L{IReactorSocket.adoptStreamPort}.
    """

    log = Logger()

    def __init__(
        self, reactor: Any, host: str, port: int, reusePort: bool, backlog: int = BACKLOG
    ) -> None:
        self._reactor: IReactorSocket = reactor
        self._host = host
        self._port = port
        self._reusePort = reusePort
        self._backlog = backlog
        self._family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket: socket.socket | None = None

    @property
    def bound(self) -> bool:
        return self._socket is not None

    def bind(self) -> None:
        """
        Bind the address, once (it is called where twistd binds ports,
        before it gives up privileges).

        @raise CannotListenError: the address is in use or not this host's.
        """
        if self._socket is not None:
            return
        bound = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            # As Twisted does for its own listening ports: a restart must
            # not wait for old connections in TIME_WAIT.
            bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._reusePort:
                bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            bound.bind((self._host, self._port))
        except OSError as error:
            bound.close()
            raise CannotListenError(self._host, self._port, error) from None
        self._socket = bound

    def listen(self, protocolFactory: IProtocolFactory, waited: float) -> IListeningPort:
        """
        Listen on the bound socket (binding it first if need be) and serve
        C{protocolFactory} there; log the address, and how many seconds the
        proxy C{waited} for its dependencies first. With a port of 0, or
        several workers on one port, that line is where an operator (or a
        test) learns that this process is serving.

        @raise CannotListenError: another socket listens on the address
            without C{SO_REUSEPORT} (it bound while this one was waiting).
        """
        self.bind()
        listening = self._socket
        assert listening is not None
        self._socket = None
        try:
            try:
                listening.listen(self._backlog)
                listening.setblocking(False)
            except OSError as error:
                raise CannotListenError(self._host, self._port, error) from None
            # adoptStreamPort duplicates the descriptor; ours is closed below.
            # (Twisted's stubs want a ServerFactory; any IProtocolFactory does.)
            port: IListeningPort = self._reactor.adoptStreamPort(
                listening.fileno(), self._family, cast(Any, protocolFactory)
            )
        finally:
            listening.close()
        address: Any = port.getHost()
        self.log.info(
            "svc-proxy listening on {host}:{port}, ready after {waited_s} s",
            host=address.host,
            port=address.port,
            shared_port=self._reusePort,
            waited_s=round(waited, 3),
        )
        return port

    def close(self) -> None:
        """
        Give back a socket that was bound but never listened on.
        """
        bound, self._socket = self._socket, None
        if bound is not None:
            bound.close()
