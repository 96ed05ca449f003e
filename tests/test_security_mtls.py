"""
Mutual TLS between svc-proxy and svc-auth (decisions D1), with real
daemons and real certificates from throwaway CAs (trustme): a proxy with a
client certificate of the CA svc-auth trusts is served; one without a
client certificate, with one of another CA, speaking plaintext, or not
trusting svc-auth's CA is refused and fails closed (chat 503
SERVICE_DEGRADED, /ready 503). svc-auth with SVC_ENV=production refuses
to serve plaintext gRPC on a non-loopback address.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import psycopg
import pytest
import trustme
from authfixtures import Tenant, makeTenant
from test_gateway_e2e import assertEnvelope, chat, request

from svcd.auth.migrations import migrate
from svcd.auth.store import Store
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc
from svcd.testing.daemons import Daemon, authEnvironment, twistdCommand
from svcd.testing.servers import PostgresServer, RedisServer, freePort
from svcd.testing.waiting import waitUntil


@attrs.frozen
class PEMs:
    """
    Paths of the PEM files the daemons are given.
    """

    ca: Path
    serverCert: Path
    serverKey: Path
    clientCert: Path
    clientKey: Path
    otherCA: Path
    strangerCert: Path
    strangerKey: Path


def writePEMs(directory: Path) -> PEMs:
    ca = trustme.CA()
    other = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("svc-proxy.internal")
    stranger = other.issue_cert("svc-proxy.internal")
    paths = PEMs(*(directory / name for name in attrs.fields_dict(PEMs)))
    ca.cert_pem.write_to_path(str(paths.ca))
    other.cert_pem.write_to_path(str(paths.otherCA))
    server.cert_chain_pems[0].write_to_path(str(paths.serverCert))
    server.private_key_pem.write_to_path(str(paths.serverKey))
    client.cert_chain_pems[0].write_to_path(str(paths.clientCert))
    client.private_key_pem.write_to_path(str(paths.clientKey))
    stranger.cert_chain_pems[0].write_to_path(str(paths.strangerCert))
    stranger.private_key_pem.write_to_path(str(paths.strangerKey))
    return paths


# For a proxy whose channel to svc-auth is refused on purpose: it listens
# without waiting for the channel.
NEVER_READY = {"SVC_START_TIMEOUT": "100ms"}


@attrs.frozen
class TLSAuth:
    auth: Daemon
    pems: PEMs
    tenant: Tenant
    redisURL: str
    workdir: Path
    dsn: str

    @property
    def grpcAddress(self) -> str:
        return f"127.0.0.1:{self.auth.environment['SVC_GRPC_PORT']}"

    @contextlib.contextmanager
    def proxy(self, name: str, **tls: str) -> Iterator[Daemon]:
        daemon = Daemon(
            "svc-proxy",
            {
                "SVC_HOST": "127.0.0.1",
                "SVC_PORT": str(freePort()),
                "SVC_AUTH_GRPC_ADDR": self.grpcAddress,
                "REDIS_URL": self.redisURL,
                "SVC_SHUTDOWN_TIMEOUT": "5s",
                **tls,
            },
            self.workdir / f"proxy-{name}.log",
        ).start()
        try:
            daemon.waitForHealth()
            yield daemon
        finally:
            daemon.terminate()


@pytest.fixture(scope="module")
def tlsAuth(
    postgresServer: PostgresServer,
    redisServer: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TLSAuth]:
    """
    svc-auth serving gRPC only over mutual TLS, as in production.
    """
    workdir = tmp_path_factory.mktemp("mtls")
    pems = writePEMs(workdir)
    name = f"mtls_{secrets.token_hex(6)}"
    dsn = postgresServer.createDatabase(name)
    migrate(dsn)
    connection = psycopg.connect(dsn, autocommit=True)
    tenant = makeTenant(Store(lambda: contextlib.nullcontext(connection)), "tls")
    auth = Daemon(
        "svc-auth",
        authEnvironment(
            dsn,
            SVC_ENV="production",
            SVC_GRPC_TLS_CERT=str(pems.serverCert),
            SVC_GRPC_TLS_KEY=str(pems.serverKey),
            SVC_GRPC_TLS_CLIENT_CA=str(pems.ca),
        ),
        workdir / "auth.log",
    ).start()
    try:
        auth.waitForReady()
        yield TLSAuth(auth, pems, tenant, redisServer.url, workdir, dsn)
    finally:
        auth.terminate()
        connection.close()
        postgresServer.dropDatabase(name)


def assertRefused(tls: TLSAuth, proxy: Daemon) -> None:
    """
    The proxy cannot reach svc-auth: chat fails closed with 503
    SERVICE_DEGRADED and /ready names auth_grpc.
    """
    answer = chat(proxy.httpPort, tls.tenant)
    assertEnvelope(answer, 503, "SERVICE_DEGRADED")
    checks: list[dict[str, Any]] = []

    def redisConnected() -> bool:
        # The proxy listens after SVC_START_TIMEOUT (NEVER_READY), maybe
        # before its Redis connection is up: /ready says so until it is.
        ready = request(proxy.httpPort, "GET", "/ready")
        assert ready.status == 503
        checks.append(ready.json()["checks"])
        return bool(checks[-1]["redis"]["status"] == "ok")

    waitUntil(redisConnected, 30.0, interval=0.05)
    assert {each["auth_grpc"]["status"] for each in checks} == {"failed"}


def test_rightClientCertificateIsServed(tlsAuth: TLSAuth) -> None:
    """
    A proxy trusting svc-auth's CA and presenting a client certificate of
    the CA svc-auth trusts gets through: chat 501, /ready 200.
    """
    pems = tlsAuth.pems
    with tlsAuth.proxy(
        "right",
        SVC_AUTH_GRPC_TLS_CA=str(pems.ca),
        SVC_AUTH_GRPC_TLS_CERT=str(pems.clientCert),
        SVC_AUTH_GRPC_TLS_KEY=str(pems.clientKey),
        # The link is what is tested, not the deadline: the first (cold)
        # validation over a new TLS connection can outlast the 50 ms
        # default with both cores busy, and fail closed (503).
        SVC_AUTH_VALIDATE_TIMEOUT="5s",
    ) as proxy:
        proxy.waitForReady()
        assertEnvelope(chat(proxy.httpPort, tlsAuth.tenant), 501, "PROVIDER_NOT_CONFIGURED")
        probe = request(
            proxy.httpPort,
            "GET",
            "/v1/internal/auth-probe",
            {
                "Authorization": f"Bearer {tlsAuth.tenant.token}",
                "X-SVC-Agent-ID": str(tlsAuth.tenant.agentID),
            },
        )
        assert probe.status == 200 and probe.json()["org_id"] == str(tlsAuth.tenant.orgID)


def test_noClientCertificateIsRefused(tlsAuth: TLSAuth) -> None:
    """
    Server-authenticated TLS without a client certificate is refused by
    svc-auth's handshake.
    """
    with tlsAuth.proxy(
        "anonymous", SVC_AUTH_GRPC_TLS_CA=str(tlsAuth.pems.ca), **NEVER_READY
    ) as proxy:
        assertRefused(tlsAuth, proxy)


def test_clientCertificateOfAnotherCAIsRefused(tlsAuth: TLSAuth) -> None:
    """
    A well-formed client certificate that does not chain to
    SVC_GRPC_TLS_CLIENT_CA is refused.
    """
    pems = tlsAuth.pems
    with tlsAuth.proxy(
        "stranger",
        SVC_AUTH_GRPC_TLS_CA=str(pems.ca),
        SVC_AUTH_GRPC_TLS_CERT=str(pems.strangerCert),
        SVC_AUTH_GRPC_TLS_KEY=str(pems.strangerKey),
        **NEVER_READY,
    ) as proxy:
        assertRefused(tlsAuth, proxy)


def test_plaintextAndUntrustedServerAreRefused(tlsAuth: TLSAuth) -> None:
    """
    A plaintext proxy cannot talk to a TLS svc-auth, and a proxy that does
    not trust svc-auth's CA refuses svc-auth's certificate even with a
    good client certificate.
    """
    pems = tlsAuth.pems
    with tlsAuth.proxy("plaintext", **NEVER_READY) as proxy:
        assertRefused(tlsAuth, proxy)
    with tlsAuth.proxy(
        "distrustful",
        SVC_AUTH_GRPC_TLS_CA=str(pems.otherCA),
        SVC_AUTH_GRPC_TLS_CERT=str(pems.clientCert),
        SVC_AUTH_GRPC_TLS_KEY=str(pems.clientKey),
        **NEVER_READY,
    ) as proxy:
        assertRefused(tlsAuth, proxy)


def test_grpcClientsNeedTheCertificateToo(tlsAuth: TLSAuth) -> None:
    """
    Straight gRPC (what an attacker on the internal network would try):
    only a channel with the right client certificate gets an answer.
    """
    pems = tlsAuth.pems
    request_ = auth_pb2.ValidateTokenRequest(access_token=tlsAuth.tenant.token)

    def call(channel: grpc.Channel) -> grpc.StatusCode:
        with channel:
            try:
                auth_pb2_grpc.AuthServiceStub(channel).ValidateToken(request_, timeout=2)
            except grpc.RpcError as error:
                return error.code()  # type: ignore[no-any-return]
            return grpc.StatusCode.OK

    ca, cert, key = (path.read_bytes() for path in (pems.ca, pems.clientCert, pems.clientKey))
    strangerCert, strangerKey = pems.strangerCert.read_bytes(), pems.strangerKey.read_bytes()
    address = tlsAuth.grpcAddress
    assert call(grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))) == (
        grpc.StatusCode.OK
    )
    for channel in (
        grpc.insecure_channel(address),
        grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)),
        grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, strangerKey, strangerCert)),
    ):
        assert call(channel) == grpc.StatusCode.UNAVAILABLE


def cleanEnvironment() -> dict[str, str]:
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SVC_", "POSTGRES_", "OTEL_", "REDIS_"))
    }


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10"])
def test_productionRefusesPlaintextOnAPublicAddress(tlsAuth: TLSAuth, host: str) -> None:
    """
    The real daemon, with an otherwise valid configuration (a reachable
    database, free ports), refuses to start with SVC_ENV=production and
    plaintext gRPC on a non-loopback address: one line on stderr naming
    SVC_GRPC_HOST, a non-zero exit, and nothing listening on its ports.
    """
    environment = authEnvironment(tlsAuth.dsn, SVC_ENV="production", SVC_GRPC_HOST=host)
    result = subprocess.run(
        twistdCommand("svc-auth"),
        env={**cleanEnvironment(), **environment},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "SVC_GRPC_HOST" in lines[0] and "production" in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    for port in (environment["SVC_PORT"], environment["SVC_GRPC_PORT"]):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()


def test_productionServesTLSOnAPublicAddress(tlsAuth: TLSAuth) -> None:
    """
    The same production daemon starts when its gRPC is mutual TLS, even on
    a non-loopback address (reached here over loopback only).
    """
    pems = tlsAuth.pems
    environment = authEnvironment(
        tlsAuth.dsn,
        SVC_ENV="production",
        SVC_GRPC_HOST="0.0.0.0",
        SVC_GRPC_TLS_CERT=str(pems.serverCert),
        SVC_GRPC_TLS_KEY=str(pems.serverKey),
        SVC_GRPC_TLS_CLIENT_CA=str(pems.ca),
    )
    daemon = Daemon("svc-auth", environment, tlsAuth.workdir / "public.log").start()
    try:
        daemon.waitForReady()
    finally:
        assert daemon.terminate() == 0
