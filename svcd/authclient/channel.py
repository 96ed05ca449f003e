"""
The gRPC channel to svc-auth, with the options every client of it wants:
reconnection within a second, keepalive, and one more try of a read that a
stopping svc-auth cancelled.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from svcd.common.config import GrpcTLS

# grpcio's default reconnect backoff grows to two minutes: after svc-auth
# has been away for a while, the proxy would keep failing closed long after
# it is back. Retry the connection at least every second instead, so
# service resumes within a second or so of svc-auth's return; calls made
# while the channel is down still fail at once (no wait_for_ready), which
# is what failing closed needs.
#
# A stopping svc-auth cancels the calls it had received but not yet begun
# (gRPC's server shutdown does; it also tells the channel to go elsewhere).
# ValidateToken and ValidateAgent only read, so a call svc-auth cancelled
# is sent once more, within the same deadline, to the replica the channel
# then uses (SVC_AUTH_GRPC_ADDR may name several): a rolling restart of
# the replicas then fails no request. A call the proxy cancels itself (its
# client went away) is never retried, and no other failure is.
RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [
                    {"service": "svc.auth.v1.AuthService", "method": "ValidateToken"},
                    {"service": "svc.auth.v1.AuthService", "method": "ValidateAgent"},
                ],
                "retryPolicy": {
                    "maxAttempts": 2,
                    "initialBackoff": "0.005s",
                    "maxBackoff": "0.02s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["CANCELLED"],
                },
            }
        ]
    }
)
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a dead svc-auth host (no RST, e.g. a lost VM) between calls.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", RETRY_SERVICE_CONFIG),
)


def authChannel(address: str, tls: GrpcTLS | None = None) -> Any:
    """
    The one channel to svc-auth at C{address} (an address list such as
    C{SVC_AUTH_GRPC_ADDR}): plaintext without C{tls}, else TLS with its CA
    and, for mutual TLS, its client certificate.
    """
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.rootCertificates,
        private_key=tls.privateKey,
        certificate_chain=tls.certificateChain,
    )
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
