"""
What the assembly of a gRPC daemon over PostgreSQL (svc-auth, svc-memory)
builds the same way, beside its own parts: the readiness checks of its
database and of its gRPC port, and its operations port (/health, /ready,
/metrics of L{svcd.common.opsweb}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.application import strports
from twisted.application.service import IService
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, quoteStringArgument
from twisted.internet.interfaces import IReactorTCP
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool
from twisted.web.server import Site

from svcd.common.grpcserver import HostedGrpcServer
from svcd.common.readiness import Check, CheckFailed


def tcpCheck(reactor: IReactorTCP, host: str, port: int) -> Deferred[None]:
    """
    Can we open a TCP connection to host:port? (the `grpc` check)
    """
    target = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    endpoint = TCP4ClientEndpoint(reactor, target, port, timeout=1)
    factory = Factory.forProtocol(Protocol)
    factory.noisy = False
    connecting = endpoint.connect(factory)

    def connected(protocol: Protocol) -> None:
        assert protocol.transport is not None
        protocol.transport.loseConnection()

    def failed(failure: Any) -> None:
        raise CheckFailed(f"gRPC port {port} is not accepting connections")

    return connecting.addCallbacks(connected, failed)


def postgresCheck(reactor: Any, threads: ThreadPool, ping: Callable[[], None]) -> Check:
    """
    /ready's C{postgres} check: C{ping}, a round trip through the daemon's
    pool, run in C{threads}, the daemon's database threads.
    """

    def probe() -> Deferred[None]:
        return deferToThreadPool(reactor, threads, ping)

    return Check("postgres", probe)


def grpcCheck(reactor: Any, host: str, server: HostedGrpcServer) -> Check:
    """
    /ready's C{grpc} check: C{server}'s port accepts connections.
    """

    def probe() -> Deferred[None]:
        if server.port is None:
            raise CheckFailed("gRPC server is not started")
        return tcpCheck(reactor, host, server.port)

    return Check("grpc", probe)


def operationsPort(reactor: Any, host: str, port: int, site: Site) -> IService:
    """
    The service of the operations port, serving C{site} on C{host}:C{port}.

    strports.service, rather than a StreamServerEndpointService of our
    own: the service it makes fails the start at once, with the reason,
    when the port cannot be had (Twisted's public way to ask for that).
    """
    kind = "tcp6" if ":" in host else "tcp"
    return strports.service(
        f"{kind}:port={port}:interface={quoteStringArgument(host)}",
        site,
        reactor=reactor,
    )
