"""
Serving a stand-in AuthService servicer on a real grpcio server, for tests
of svc-proxy's gRPC link that script svc-auth's answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from svcd.pb.auth.v1 import auth_pb2_grpc


@contextmanager
def servingAuth(servicer: auth_pb2_grpc.AuthServiceServicer, workers: int = 4) -> Iterator[int]:
    """
    Serve C{servicer} on 127.0.0.1 (a free port) for the duration of the
    block; yields the port.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    auth_pb2_grpc.add_AuthServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(0)
