"""
The settings every daemon that serves gRPC reads from its environment
(svc-auth, svc-memory; decisions D10): its TLS material, the client
certificates that may call its internal methods, and the rule that
refuses plaintext on a reachable address in production.
"""

from __future__ import annotations

from collections.abc import Mapping

from svcd.auth.callers import BadSubjects, parseSubjects
from svcd.common import config
from svcd.common.grpcserver import ServerTLS, isLoopback

_SUBJECTS = "SVC_GRPC_INTERNAL_SUBJECTS"


def serverTLS(environ: Mapping[str, str]) -> ServerTLS | None:
    """
    The server's certificate and key (C{SVC_GRPC_TLS_CERT},
    C{SVC_GRPC_TLS_KEY}: both or neither) and, for mutual TLS, the CA of
    its clients (C{SVC_GRPC_TLS_CLIENT_CA}); None for plaintext.
    """
    certificate = config.readPEM(environ, "SVC_GRPC_TLS_CERT")
    key = config.readPEM(environ, "SVC_GRPC_TLS_KEY")
    clientCA = config.readPEM(environ, "SVC_GRPC_TLS_CLIENT_CA")
    if certificate is None and key is None:
        if clientCA is not None:
            raise config.ConfigError(
                "SVC_GRPC_TLS_CLIENT_CA", "needs SVC_GRPC_TLS_CERT and SVC_GRPC_TLS_KEY too"
            )
        return None
    if certificate is None:
        raise config.ConfigError("SVC_GRPC_TLS_CERT", "is required with SVC_GRPC_TLS_KEY")
    if key is None:
        raise config.ConfigError("SVC_GRPC_TLS_KEY", "is required with SVC_GRPC_TLS_CERT")
    return ServerTLS(certificate=certificate, privateKey=key, clientCA=clientCA)


def readInternalSubjects(
    environ: Mapping[str, str], tls: ServerTLS | None, mayCall: str
) -> frozenset[str] | None:
    """
    The names of C{SVC_GRPC_INTERNAL_SUBJECTS}, required with mutual TLS
    and refused without it: unset with mutual TLS, every caller of the
    internal methods would be denied them; set without it, there is no
    client certificate to check, and the list would only seem to protect
    them.

    @param mayCall: what the listed certificates may call, as the
        refusal names it ("MemoryService, such as the proxies' and the
        workers'").
    """
    raw = config.text(environ, _SUBJECTS, "")
    mutual = tls is not None and tls.clientCA is not None
    if not raw:
        if mutual:
            raise config.ConfigError(
                _SUBJECTS,
                "is required with SVC_GRPC_TLS_CLIENT_CA: name the client certificates "
                f"(common name or DNS name, comma-separated) that may call {mayCall}",
            )
        return None
    if not mutual:
        raise config.ConfigError(
            _SUBJECTS,
            "needs mutual TLS (SVC_GRPC_TLS_CERT, SVC_GRPC_TLS_KEY and "
            "SVC_GRPC_TLS_CLIENT_CA): without client certificates there is no subject to check",
        )
    try:
        return parseSubjects(raw)
    except BadSubjects as error:
        raise config.ConfigError(_SUBJECTS, str(error)) from None


def refusePlaintextInProduction(environment: str, grpcHost: str, tls: ServerTLS | None) -> None:
    """
    Plaintext gRPC on an address other hosts can reach stops the daemon at
    start in production (elsewhere it is a warning at start,
    L{svcd.common.grpcserver.HostedGrpcServer}).
    """
    if environment == "production" and tls is None and not isLoopback(grpcHost):
        raise config.ConfigError(
            "SVC_GRPC_HOST",
            f"refusing plaintext gRPC on the non-loopback address {grpcHost} with "
            "SVC_ENV=production; set SVC_GRPC_TLS_CERT, SVC_GRPC_TLS_KEY and "
            "SVC_GRPC_TLS_CLIENT_CA",
        )
