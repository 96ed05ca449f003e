"""
The bare prototype of the gateway benchmark: what the chat pipeline costs
with nothing of ours in it, as a reference measured in the same run.

    python bench/prototype.py auth PORT
    python bench/prototype.py proxy PORT AUTH_PORT REDIS_PORT
    python bench/prototype.py ceiling PORT REDIS_PORT

C{auth} is a grpcio server (synchronous, 16 threads, as svc-auth's) whose
ValidateToken and ValidateAgent answer at once with fixed messages.
C{proxy} is a bare Klein handler that, for each POST /v1/chat/completions,
makes those two calls through grpcio's future API bridged to the reactor
with callFromThread (as svc-proxy does), then one Redis INCR, then answers
the floor's 501. No validation, headers, logs, metrics or tracing.
C{ceiling} is the same handler with the gRPC calls left out: one Redis
INCR, then the 501; what a proxy whose validations are all answered from
memory could reach at best.
"""

from __future__ import annotations

import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import txredisapi
from klein import Klein
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.web.server import Site

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from floor import BODY

from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc

ORG_ID = "01a1fe13-c305-7e5a-a047-2746b0df2027"
AGENT_ID = "01a1fe13-c305-7e5a-a047-2746b0df2028"


class FixedAnswers(auth_pb2_grpc.AuthServiceServicer):
    def ValidateToken(self, request: Any, context: Any) -> Any:
        return auth_pb2.ValidateTokenResponse(org_id=ORG_ID, permissions=1)

    def ValidateAgent(self, request: Any, context: Any) -> Any:
        return auth_pb2.ValidateAgentResponse(
            agent_id=request.agent_id, org_id=request.org_id, status="active"
        )


def serveAuth(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    auth_pb2_grpc.add_AuthServiceServicer_to_server(FixedAnswers(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def call(method: Any, request: Any, metadata: Any = None) -> Deferred[Any]:
    answer: Deferred[Any] = Deferred()

    def deliver(future: Any) -> None:
        error = future.exception()
        if error is None:
            answer.callback(future.result())
        else:
            answer.errback(error)

    future = method.future(request, timeout=0.05, metadata=metadata)
    future.add_done_callback(lambda done: reactor.callFromThread(deliver, done))  # type: ignore[attr-defined]
    return answer


def serveProxy(port: int, authPort: int | None, redisPort: int) -> None:
    """
    The prototype proxy; without C{authPort}, the ceiling (no gRPC calls).
    """
    stub = (
        None
        if authPort is None
        else auth_pb2_grpc.AuthServiceStub(grpc.insecure_channel(f"127.0.0.1:{authPort}"))
    )
    redis = txredisapi.lazyConnection("127.0.0.1", redisPort)
    bearer = (("authorization", "Bearer svc_pat_prototype"),)
    app = Klein()

    @app.route("/v1/chat/completions", methods=["POST"])
    async def chat(request: Any) -> bytes:
        if stub is None:
            await redis.incr(f"prototype:{ORG_ID}")
            request.setResponseCode(501)
            request.setHeader(b"Content-Type", b"application/json")
            return BODY
        try:
            token = await call(
                stub.ValidateToken,
                auth_pb2.ValidateTokenRequest(access_token="svc_pat_prototype"),
            )
            await call(
                stub.ValidateAgent,
                auth_pb2.ValidateAgentRequest(agent_id=AGENT_ID, org_id=token.org_id),
                bearer,
            )
        except grpc.RpcError:
            # Nothing bounds the calls in flight here: under overload they
            # miss their deadline, and the row counts these 503s.
            request.setResponseCode(503)
            return b""
        await redis.incr(f"prototype:{token.org_id}")
        request.setResponseCode(501)
        request.setHeader(b"Content-Type", b"application/json")
        return BODY

    site = Site(app.resource())
    site.noisy = False
    site.log = lambda request: None  # type: ignore[method-assign]
    reactor.listenTCP(port, site, backlog=511, interface="127.0.0.1")  # type: ignore[arg-type]
    reactor.run()


if __name__ == "__main__":
    if sys.argv[1] == "auth":
        serveAuth(int(sys.argv[2]))
    elif sys.argv[1] == "ceiling":
        serveProxy(int(sys.argv[2]), None, int(sys.argv[3]))
    else:
        serveProxy(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
