"""
A daemon's grpcio server, built and hosted one way for every daemon that
serves gRPC (svc-auth's AuthService, svc-memory's MemoryService).

Built (L{buildGrpcServer}): grpcio runs the methods in a thread pool of its
own with a thread for each call the admission interceptor lets in, and
refuses calls past the pool's size itself, so its queue never holds a call
waiting for a thread; the standard health service and server reflection
beside the daemon's service; bound on a loopback or other address,
plaintext or with (mutual) TLS, and a failed bind raised as
L{GrpcBindError}, which stops the start with one line.

Hosted (L{HostedGrpcServer}): bound in privilegedStartService, which
twistd calls before the reactor runs and after it has daemonised (grpcio
must not cross a fork); started with the reactor; on stop refusing new
calls, then letting those in flight finish for up to the grace period,
waited for on a thread so that the reactor never blocks. Plaintext on an
address other hosts can reach is logged as a warning at start (it is
refused in production by each daemon's configuration, decisions D10).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import attrs
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from svcd.common.lifecycle import StartupError


@attrs.frozen
class ServerTLS:
    """
    Mutual TLS material of the gRPC server (PEM bytes): its certificate and
    key, and the CA that client certificates must chain to.
    """

    certificate: bytes
    privateKey: bytes = attrs.field(repr=False)
    clientCA: bytes | None


class GrpcBindError(StartupError):
    """
    The gRPC port could not be bound (in use, or an address we do not
    have).
    """


def isLoopback(host: str) -> bool:
    """
    Is C{host} (a bind address) reachable from this host only?
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# Every server's channel arguments; a daemon may add its own.
_OPTIONS: tuple[tuple[str, Any], ...] = (
    # Two processes on one port would split calls between an old and a new
    # daemon by accident; refuse instead.
    ("grpc.so_reuseport", 0),
    # Clients ping their idle channels every 10 s to notice a dead peer;
    # grpc's defaults would answer such pings with GOAWAY (too_many_pings)
    # and make the next call pay for a reconnect.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
)


def buildGrpcServer(
    serviceName: str,
    handlers: Mapping[str, grpc.RpcMethodHandler],
    host: str,
    port: int,
    *,
    threads: int,
    streamsPerConnection: int,
    admission: grpc.ServerInterceptor,
    threadNamePrefix: str,
    tls: ServerTLS | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """
    A grpcio server, bound but not started, serving C{handlers} as
    C{serviceName}, the standard health service and server reflection;
    returns it with its health servicer and the bound port (useful when
    C{port} is 0).

    @param threads: the thread pool's size, and the calls grpcio takes at
        once: what the admission's bounds let in, plus spare threads for
        refusals.
    @param streamsPerConnection: what one connection may have open at once.
    @param admission: the first interceptor, so that a refused call costs
        nothing more (no span, no parsing).
    @param interceptors: run around every admitted call, such as
        L{svcd.common.tracing.ServerTracingInterceptor}.
    @param options: channel arguments besides every server's.

    @raise GrpcBindError: when the address cannot be bound.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=threadNamePrefix),
        interceptors=[ComposedInterceptors((admission, *interceptors))],
        maximum_concurrent_rpcs=threads,
        options=[("grpc.max_concurrent_streams", streamsPerConnection), *_OPTIONS, *options],
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(serviceName, handlers),))
    server.add_registered_method_handlers(serviceName, handlers)
    healthServicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(healthServicer, server)
    reflection.enable_server_reflection(
        (
            serviceName,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    address = f"{_hostForAddress(host)}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials(
                [(tls.privateKey, tls.certificate)],
                root_certificates=tls.clientCA,
                require_client_auth=tls.clientCA is not None,
            )
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:
        # grpcio reports a failed bind as RuntimeError (older releases
        # returned port 0); either way the reason is in grpcio's own log.
        bound = 0
    if bound == 0:
        raise GrpcBindError(
            f"cannot listen for gRPC on {address} (in use, or not an address of this host)"
        )
    return server, healthServicer, bound


class ComposedInterceptors(grpc.ServerInterceptor):  # type: ignore[misc]
    """
    Server interceptors run as one, outermost first (as grpcio would run
    them), and their handler remembered by method: each call then costs
    grpcio's polling thread, which runs C{intercept_service} holding the
    interpreter lock while the calls' threads wait for it, one look-up
    instead of a continuation per interceptor (grpcio's pipeline makes two
    closures and a call per interceptor per call: 9 to 18 µs for two of
    them on the development machine, under load).

    Only for interceptors whose handler depends on the method and the
    handler they wrap alone, never on a call's metadata: those of
    L{svcd.common.grpcadmission}, L{svcd.common.internalcallers} and
    L{svcd.common.tracing}, which each remembered theirs so already.
    """

    def __init__(self, interceptors: Sequence[grpc.ServerInterceptor]) -> None:
        self._interceptors = tuple(interceptors)
        # Only grpcio's polling thread calls intercept_service: no lock.
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        method: str = details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._through(0, handler, details)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _through(self, index: int, handler: Any, details: Any) -> Any:
        if index == len(self._interceptors):
            return handler
        return self._interceptors[index].intercept_service(
            lambda inner: self._through(index + 1, handler, inner), details
        )


def _hostForAddress(host: str) -> str:
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


class HostedGrpcServer(Service):
    """
    A server of L{buildGrpcServer} as a twistd service (see the module's
    docstring). A daemon's subclass says what it serves (L{serviceName},
    L{label}), what would cross the network in clear without TLS
    (L{carries}), builds its server (L{build}) and may act when the server
    stops taking calls (L{stopping}).
    """

    log = Logger()

    serviceName: str = ""
    label: str = ""
    carries: str = ""

    def __init__(
        self,
        reactor: IReactorThreads,
        host: str,
        port: int,
        gracePeriod: float,
        tls: ServerTLS | None = None,
    ) -> None:
        self._reactor = reactor
        self._host = host
        self._requestedPort = port
        self._gracePeriod = gracePeriod
        self._tls = tls
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self.port: int | None = None

    def build(self, port: int) -> tuple[grpc.Server, health.HealthServicer, int]:
        """
        The daemon's server (L{buildGrpcServer}) on C{port}, bound.
        """
        raise NotImplementedError

    def stopping(self) -> None:
        """
        The server takes no new call from now on; those in flight are
        finishing.
        """

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        self._server, self._health, self.port = self.build(self._requestedPort)

    def startService(self) -> None:
        super().startService()
        assert self._server is not None and self._health is not None
        self._server.start()
        for name in ("", self.serviceName):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.log.info(
            "gRPC {grpc_service} listening on {host}:{port}",
            grpc_service=self.label,
            host=self._host,
            port=self.port,
        )
        if self._tls is None and not isLoopback(self._host):
            self.log.warn(
                "gRPC is plaintext on {host}, an address other hosts can reach: {carries}"
                " cross the network in clear. Set SVC_GRPC_TLS_CERT, SVC_GRPC_TLS_KEY and"
                " SVC_GRPC_TLS_CLIENT_CA, or SVC_GRPC_HOST=127.0.0.1",
                host=self._host,
                carries=self.carries,
            )

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        server, self._server = self._server, None
        if server is None:
            return succeed(None)
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        # The server takes no new call from now on, and says so on each
        # connection (an HTTP/2 GOAWAY).
        stopped = server.stop(self._gracePeriod)
        self.stopping()
        waiting: Deferred[Any] = deferToThreadPool(
            self._reactor, self._reactor.getThreadPool(), stopped.wait, self._gracePeriod + 1.0
        )

        def logged(result: object) -> object:
            self.log.info("gRPC server stopped")
            return result

        return waiting.addCallback(logged)
