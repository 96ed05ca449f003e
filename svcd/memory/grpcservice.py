"""
The gRPC face of svc-memory: the svc.memory.v1.MemoryService servicer,
with the standard health service and server reflection, hosted by a twistd
service so that the gRPC server starts and stops with the reactor.

Built as svc-auth's is (L{svcd.auth.grpcservice}): grpcio runs the
methods in its own thread pool, where the blocking work belongs (the
database, a scope's load on a cache miss, the search's product, which
releases the GIL); calls are admitted within L{svcd.common.grpcadmission}'s
bounds (at once and per client connection, refused RESOURCE_EXHAUSTED
past them, never queued); requests are parsed here, so that one protobuf
cannot parse (a string that is not UTF-8) is INVALID_ARGUMENT rather than
grpcio's INTERNAL with a traceback. The server is built and hosted as
every daemon's (L{svcd.common.grpcserver}). Its methods on memories are
in L{svcd.memory.grpcmemories}, those of the observation queue in
L{svcd.memory.grpcobservations}, and what they share (a request's fields
read, a failure's status) in L{svcd.memory.grpcrequests}.

A write (add, a new content, a delete) through a replica that caches the
scope is answered only once its change is in that cache
(L{svcd.memory.search.Searcher.settle}): a caller reads its own writes;
other replicas follow within a second.

Nothing here logs a memory's content or an observation's messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health
from twisted.internet.interfaces import IReactorThreads
from twisted.logger import Logger

from svcd.common.grpcadmission import AdmissionInterceptor, Bounds, RefusalLog
from svcd.common.grpcserver import HostedGrpcServer, ServerTLS, buildGrpcServer
from svcd.memory.grpcmemories import MemoryMethods
from svcd.memory.grpcobservations import ObservationMethods
from svcd.memory.grpcrequests import Refusal, statusOf
from svcd.memory.metrics import MemoryMetrics
from svcd.memory.search import Searcher
from svcd.memory.store import MemoryStore
from svcd.pb.memory.v1 import memory_pb2

SERVICE_NAME = "svc.memory.v1.MemoryService"
METHODS = tuple(
    method.name for method in memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].methods
)

# The methods whose answers are written as bytes (svcd.memory.wire).
_ENCODED_ANSWERS = frozenset({"Search", "SearchMany"})
# The methods given the call's context too (its deadline).
_WITH_CONTEXT = frozenset({"SearchMany"})


class MemoryServicer(MemoryMethods, ObservationMethods):
    """
    Maps requests to L{MemoryStore} and L{Searcher}, and their refusals to
    status codes (see memory.proto).

    @param maxPerScope: SVC_MEMORY_MAX_PER_SCOPE.
    @param maxWaitingPerOrg: SVC_MEMORY_MAX_WAITING_PER_ORG (None: no
        bound).
    """

    log = Logger()

    def __init__(
        self,
        store: MemoryStore,
        searcher: Searcher,
        metrics: MemoryMetrics,
        maxPerScope: int,
        maxWaitingPerOrg: int | None = None,
    ) -> None:
        self._store = store
        self._searcher = searcher
        self.metrics = metrics
        self._maxPerScope = maxPerScope
        self._maxWaitingPerOrg = maxWaitingPerOrg

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """
        MemoryService's unary handlers by method name, each parsing the
        request's bytes itself; those of L{_ENCODED_ANSWERS} answer bytes
        they wrote, the others a message grpcio serializes.
        """
        handlers = {}
        for method in memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].methods:
            requestType = getattr(memory_pb2, method.input_type.name)
            responseType = getattr(memory_pb2, method.output_type.name)
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                self._handler(method.name, requestType, getattr(self, method.name)),
                request_deserializer=None,
                response_serializer=None
                if method.name in _ENCODED_ANSWERS
                else responseType.SerializeToString,
            )
        return handlers

    def _handler(
        self,
        method: str,
        requestType: type[Message],
        work: Callable[..., Message | bytes],
    ) -> Callable[[bytes, grpc.ServicerContext], Message | bytes]:
        def answer(raw: bytes, context: grpc.ServicerContext) -> Message | bytes:
            code = grpc.StatusCode.OK
            try:
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
                try:
                    request = requestType.FromString(raw)
                except DecodeError:
                    raise Refusal(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request is not a valid {requestType.DESCRIPTOR.name}"
                        " (broken wire format, or a string that is not UTF-8)",
                    ) from None
                if method in _WITH_CONTEXT:
                    return work(request, context)
                return work(request)
            except Exception as error:
                code, details = statusOf(method, error, self.log)
            finally:
                self.metrics.answered(method, code.name)
            context.abort(code, details)
            raise AssertionError("context.abort returned")

        return answer


class MemoryGrpcService(HostedGrpcServer):
    """
    svc-memory's gRPC server as a twistd service (L{HostedGrpcServer}).
    """

    serviceName = SERVICE_NAME
    label = "MemoryService"
    carries = "memories"

    def __init__(
        self,
        reactor: IReactorThreads,
        servicer: MemoryServicer,
        host: str,
        port: int,
        bounds: Bounds,
        gracePeriod: float,
        tls: ServerTLS | None = None,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
    ) -> None:
        super().__init__(reactor, host, port, gracePeriod, tls)
        self._servicer = servicer
        self._bounds = bounds
        self._interceptors = tuple(interceptors)

    def build(self, port: int) -> tuple[grpc.Server, health.HealthServicer, int]:
        return buildServer(
            self._servicer, self._host, port, self._bounds, self._tls, self._interceptors
        )


def buildServer(
    servicer: MemoryServicer,
    host: str,
    port: int,
    bounds: Bounds,
    tls: ServerTLS | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """
    A grpcio server (L{buildGrpcServer}), bound but not started, serving
    MemoryService, health and reflection; with its health servicer and
    bound port. Admitted as svc-auth's (L{svcd.auth.grpcservice.buildServer}).

    @raise GrpcBindError: when the address cannot be bound.
    """
    return buildGrpcServer(
        SERVICE_NAME,
        servicer.handlers(),
        host,
        port,
        threads=bounds.threads,
        streamsPerConnection=bounds.streamsPerConnection,
        admission=AdmissionInterceptor(
            bounds,
            RefusalLog(servicer.metrics.refused),
            answered=servicer.metrics.answered,
            countedService=SERVICE_NAME,
        ),
        threadNamePrefix="svc-memory-grpc",
        tls=tls,
        interceptors=interceptors,
        # A batch of observations (500 of up to 64 messages of 16 KiB) may
        # exceed grpcio's default of 4 MiB.
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
    )
