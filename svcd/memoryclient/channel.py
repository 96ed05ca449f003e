"""
The gRPC channel to svc-memory, with the options every client of it
wants: reconnection within a second, keepalive, and TLS.
"""

from __future__ import annotations

from typing import Any

import attrs
import grpc

# As the proxy's channel to svc-auth: reconnect within a second of
# svc-memory's return, notice a dead host between calls, and fail a call
# made while the channel is down at once (no wait_for_ready).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


@attrs.frozen
class ClientTLS:
    """
    TLS of the channel to svc-memory: the CA that signed its certificate
    and, for mutual TLS, this client's certificate and key (PEM).
    """

    rootCertificates: bytes | None
    certificateChain: bytes | None = None
    privateKey: bytes | None = attrs.field(default=None, repr=False)


def memoryChannel(address: str, tls: ClientTLS | None = None) -> Any:
    """
    A channel to svc-memory at C{address} (a target grpcio accepts, such
    as C{host:port} or C{ipv4:a:port,b:port}): plaintext without C{tls}.
    """
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.rootCertificates,
        private_key=tls.privateKey,
        certificate_chain=tls.certificateChain,
    )
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
