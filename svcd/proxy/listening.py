"""
Where svc-proxy listens: SVC_HOST and SVC_PORT, alone or shared with
other svc-proxy processes.

One svc-proxy is one reactor thread, so one core. To use every core of a
host, run several (the systemd template C{etc/systemd/svc-proxy@.service})
with C{SVC_REUSE_PORT=true}: each binds the same port with C{SO_REUSEPORT}
and the kernel spreads new connections over them. The proxy keeps no
state between requests (rate-limit counters live in Redis), so any worker
can answer any request.
"""

from __future__ import annotations

import socket
from typing import Any, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import (
    IListeningPort,
    IProtocolFactory,
    IReactorSocket,
    IStreamServerEndpoint,
)
from twisted.logger import Logger
from zope.interface import implementer

# The accept queue. Twisted's default of 50 overflows when a few hundred
# clients connect at once; the kernel then drops SYNs and the client
# retries only after a second, which shows up as a one-second tail. nginx
# uses 511 on Linux; the kernel caps it at net.core.somaxconn.
BACKLOG = 511


@implementer(IStreamServerEndpoint)
class SharedPortEndpoint:
    """
    A TCP server endpoint whose socket has C{SO_REUSEPORT} set, so that
    several processes of the same user can listen on one address and port.

    Twisted's own TCP endpoints cannot set the option before binding; this
    one binds and listens a socket itself and hands it to
    L{IReactorSocket.adoptStreamPort}.
    """

    def __init__(self, reactor: IReactorSocket, host: str, port: int, backlog: int = BACKLOG):
        self._reactor = reactor
        self._host = host
        self._port = port
        self._backlog = backlog

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listening = socket.socket(family, socket.SOCK_STREAM)
        try:
            try:
                # As Twisted does for its own listening ports: a restart
                # must not wait for old connections in TIME_WAIT.
                listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                listening.bind((self._host, self._port))
                listening.listen(self._backlog)
                listening.setblocking(False)
            except OSError as error:
                return fail(CannotListenError(self._host, self._port, error))
            # adoptStreamPort duplicates the descriptor; ours is closed below.
            # (Twisted's stubs want a ServerFactory; any IProtocolFactory does.)
            port = self._reactor.adoptStreamPort(
                listening.fileno(), family, cast(Any, protocolFactory)
            )
            return succeed(port)
        finally:
            listening.close()


@implementer(IStreamServerEndpoint)
class AnnouncedEndpoint:
    """
    An endpoint that logs the address it listens on, once it does: with a
    port of 0, or several workers on one port, the log is where an
    operator (or a test) learns that this process is serving.
    """

    log = Logger()

    def __init__(self, endpoint: IStreamServerEndpoint, shared: bool) -> None:
        self._endpoint = endpoint
        self._shared = shared

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        def announce(port: IListeningPort) -> IListeningPort:
            address: Any = port.getHost()
            self.log.info(
                "svc-proxy listening on {host}:{port}",
                host=address.host,
                port=address.port,
                shared_port=self._shared,
            )
            return port

        return self._endpoint.listen(protocolFactory).addCallback(announce)


def listenEndpoint(reactor: Any, host: str, port: int, reusePort: bool) -> IStreamServerEndpoint:
    """
    The TCP endpoint for SVC_HOST and SVC_PORT (IPv6 when the host has a
    colon), shared with other processes when C{reusePort} is set.
    """
    return AnnouncedEndpoint(_bareEndpoint(reactor, host, port, reusePort), reusePort)


def _bareEndpoint(reactor: Any, host: str, port: int, reusePort: bool) -> IStreamServerEndpoint:
    if reusePort:
        return SharedPortEndpoint(reactor, host, port)
    endpoint: object
    if ":" in host:
        endpoint = TCP6ServerEndpoint(reactor, port, backlog=BACKLOG, interface=host)  # type: ignore[no-untyped-call, unused-ignore]
    else:
        endpoint = TCP4ServerEndpoint(reactor, port, backlog=BACKLOG, interface=host)  # type: ignore[no-untyped-call, unused-ignore]
    return cast(IStreamServerEndpoint, endpoint)
