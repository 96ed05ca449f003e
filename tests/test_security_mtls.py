"""
Mutual TLS between svc-proxy and svc-auth (decisions D1), with real
daemons and real certificates from throwaway CAs (trustme): a proxy with a
client certificate of the CA svc-auth trusts is served; one without a
client certificate, with one of another CA, speaking plaintext, or not
trusting svc-auth's CA is refused and fails closed (chat 503
SERVICE_DEGRADED, /ready 503). svc-auth with SVC_ENV=production refuses
to serve plaintext gRPC on a non-loopback address.

The internal methods (RecordUsage, GetSpend, WatchChanges; decisions D12,
amended) answer only the client certificates SVC_GRPC_INTERNAL_SUBJECTS
names, by common name or DNS name: another certificate of the same CA is
PERMISSION_DENIED there while the token methods still answer it, and
svc-auth with mutual TLS refuses to start without the list.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import psycopg
import pytest
import trustme
from authfixtures import Tenant, makeTenant
from gatewayfixtures import assertEnvelope, chat, request
from waiting import waitUntil

from svcd.auth.store import Store
from svcd.devkit.daemons import Daemon, authEnvironment, twistdCommand
from svcd.devkit.pgtemplate import migratedDatabase
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e


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
    commonNamedCert: Path
    commonNamedKey: Path
    unnamedCert: Path
    unnamedKey: Path


# The client certificates svc-auth's SVC_GRPC_INTERNAL_SUBJECTS names: the
# proxies' (PEMs.clientCert) by its DNS name, and PEMs.commonNamedCert by
# its common name (its DNS name is not listed).
PROXY_DNS_NAME = "svc-proxy.internal"
INTERNAL_COMMON_NAME = "svc-ledger-writer"
INTERNAL_SUBJECTS = f"{PROXY_DNS_NAME}, {INTERNAL_COMMON_NAME}"


def writePEMs(directory: Path) -> PEMs:
    ca = trustme.CA()
    other = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert(PROXY_DNS_NAME)
    stranger = other.issue_cert(PROXY_DNS_NAME)
    commonNamed = ca.issue_cert("writer.unlisted.internal", common_name=INTERNAL_COMMON_NAME)
    # Of the very CA the proxies' certificates come from, named nowhere.
    unnamed = ca.issue_cert("operator.internal", common_name="operator")
    paths = PEMs(*(directory / name for name in attrs.fields_dict(PEMs)))
    ca.cert_pem.write_to_path(str(paths.ca))
    other.cert_pem.write_to_path(str(paths.otherCA))
    server.cert_chain_pems[0].write_to_path(str(paths.serverCert))
    server.private_key_pem.write_to_path(str(paths.serverKey))
    client.cert_chain_pems[0].write_to_path(str(paths.clientCert))
    client.private_key_pem.write_to_path(str(paths.clientKey))
    stranger.cert_chain_pems[0].write_to_path(str(paths.strangerCert))
    stranger.private_key_pem.write_to_path(str(paths.strangerKey))
    commonNamed.cert_chain_pems[0].write_to_path(str(paths.commonNamedCert))
    commonNamed.private_key_pem.write_to_path(str(paths.commonNamedKey))
    unnamed.cert_chain_pems[0].write_to_path(str(paths.unnamedCert))
    unnamed.private_key_pem.write_to_path(str(paths.unnamedKey))
    return paths


def mutualTLS(pems: PEMs) -> dict[str, str]:
    """
    svc-auth's variables for mutual TLS, as production sets them.
    """
    return {
        "SVC_GRPC_TLS_CERT": str(pems.serverCert),
        "SVC_GRPC_TLS_KEY": str(pems.serverKey),
        "SVC_GRPC_TLS_CLIENT_CA": str(pems.ca),
        "SVC_GRPC_INTERNAL_SUBJECTS": INTERNAL_SUBJECTS,
    }


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
    owner: Store

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
    sharedRedisServer: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TLSAuth]:
    """
    svc-auth serving gRPC only over mutual TLS, as in production.
    """
    workdir = tmp_path_factory.mktemp("mtls")
    pems = writePEMs(workdir)
    name = f"mtls_{secrets.token_hex(6)}"
    dsn = migratedDatabase(postgresServer, name)
    connection = psycopg.connect(dsn, autocommit=True)
    owner = Store(lambda: contextlib.nullcontext(connection))
    tenant = makeTenant(owner, "tls")
    auth = Daemon(
        "svc-auth",
        authEnvironment(dsn, SVC_ENV="production", **mutualTLS(pems)),
        workdir / "auth.log",
    ).start()
    try:
        auth.waitForReady()
        yield TLSAuth(auth, pems, tenant, sharedRedisServer.url, workdir, dsn, owner)
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
                return error.code()
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
        tlsAuth.dsn, SVC_ENV="production", SVC_GRPC_HOST="0.0.0.0", **mutualTLS(pems)
    )
    daemon = Daemon("svc-auth", environment, tlsAuth.workdir / "public.log").start()
    try:
        daemon.waitForReady()
    finally:
        assert daemon.terminate() == 0


# The internal methods (decisions D12, amended).

INTERNAL = ("RecordUsage", "GetSpend", "WatchChanges")


def secureChannel(tls: TLSAuth, cert: Path, key: Path) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        tls.pems.ca.read_bytes(), key.read_bytes(), cert.read_bytes()
    )
    return grpc.secure_channel(tls.grpcAddress, credentials)


def usageRow(tenant: Tenant) -> auth_pb2.UsageRow:
    """
    A well-formed ledger row of C{tenant}, under a request id of its own.
    """
    return auth_pb2.UsageRow(
        request_id=str(uuid.uuid4()),
        org_id=str(tenant.orgID),
        agent_id=str(tenant.agentID),
        token_id=str(tenant.tokenID),
        model_requested="fast",
        model="fast",
        provider="local",
        upstream_model="llama-3.1-8b",
        outcome="ok",
        prompt_tokens=10,
        completion_tokens=5,
        tokens_from="provider",
        cost_nano_usd=7,
        price_version="0123456789abcdef",
        started_at_us=int(time.time() * 10**6),
        duration_us=1000,
    )


def ledgerRequestIDs(dsn: str, tenant: Tenant) -> set[str]:
    """
    The request ids of the tenant's ledger rows, read as the schema owner.
    """
    with psycopg.connect(dsn, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT request_id FROM usage_ledger WHERE org_id = %s", (tenant.orgID,)
        ).fetchall()
    return {str(row[0]) for row in rows}


@attrs.frozen
class Called:
    code: grpc.StatusCode
    details: str


def callInternal(
    channel: grpc.Channel, method: str, tenant: Tenant, row: auth_pb2.UsageRow
) -> Called:
    """
    One call of an internal method: RecordUsage with C{row}, GetSpend of
    the tenant's organization for the last hour, or WatchChanges up to
    its first message (the snapshot's first).
    """
    stub = auth_pb2_grpc.AuthServiceStub(channel)
    now = int(time.time())
    try:
        if method == "RecordUsage":
            stub.RecordUsage(auth_pb2.RecordUsageRequest(rows=[row]), timeout=10)
        elif method == "GetSpend":
            stub.GetSpend(
                auth_pb2.GetSpendRequest(
                    org_id=str(tenant.orgID), since_unix=now - 3600, until_unix=now + 60
                ),
                timeout=10,
            )
        else:
            stream = stub.WatchChanges(auth_pb2.WatchChangesRequest(), timeout=10)
            try:
                next(stream)
            finally:
                stream.cancel()
    except grpc.RpcError as error:
        return Called(error.code(), error.details() or "")
    return Called(grpc.StatusCode.OK, "")


def authMetric(tls: TLSAuth, name: str, **labels: str) -> float:
    """
    The value of one series of svc-auth's /metrics (0 when absent).
    """
    status, body = tls.auth.get("/metrics")
    assert status == 200
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    series = f"{name}{{{wanted}}}" if labels else name
    for line in body.decode().splitlines():
        if line.rsplit(" ", 1)[0] == series:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize(
    "which", ["by DNS name", "by common name"], ids=["dns-name", "common-name"]
)
def test_namedCertificatesCallTheInternalMethods(tlsAuth: TLSAuth, which: str) -> None:
    """
    A client certificate named in SVC_GRPC_INTERNAL_SUBJECTS, by a DNS
    subjectAltName (the proxies') or by its common name only, is answered
    on RecordUsage (its row is in the ledger), GetSpend and WatchChanges.
    """
    pems = tlsAuth.pems
    cert, key = (
        (pems.clientCert, pems.clientKey)
        if which == "by DNS name"
        else (pems.commonNamedCert, pems.commonNamedKey)
    )
    tenant = makeTenant(tlsAuth.owner, f"named-{which}")
    row = usageRow(tenant)
    with secureChannel(tlsAuth, cert, key) as channel:
        called = {method: callInternal(channel, method, tenant, row) for method in INTERNAL}
    assert {method: each.code for method, each in called.items()} == dict.fromkeys(
        INTERNAL, grpc.StatusCode.OK
    ), called
    assert ledgerRequestIDs(tlsAuth.dsn, tenant) == {row.request_id}


def test_unnamedCertificateOfTheSameCAIsDenied(tlsAuth: TLSAuth) -> None:
    """
    A certificate of the CA the proxies' come from, but named nowhere in
    SVC_GRPC_INTERNAL_SUBJECTS, is PERMISSION_DENIED on the three internal
    methods (its row is not recorded), with a details text saying why and
    no traceback; the token methods still answer it. Each denial is
    counted by method, and logged with the certificate's subject.
    """
    pems = tlsAuth.pems
    tenant = makeTenant(tlsAuth.owner, "unnamed")
    row = usageRow(tenant)
    before = {
        method: authMetric(tlsAuth, "svc_auth_internal_calls_denied_total", method=method)
        for method in INTERNAL
    }
    with secureChannel(tlsAuth, pems.unnamedCert, pems.unnamedKey) as channel:
        called = {method: callInternal(channel, method, tenant, row) for method in INTERNAL}
        validated = auth_pb2_grpc.AuthServiceStub(channel).ValidateToken(
            auth_pb2.ValidateTokenRequest(access_token=tenant.token), timeout=10
        )
    assert {method: each.code for method, each in called.items()} == dict.fromkeys(
        INTERNAL, grpc.StatusCode.PERMISSION_DENIED
    ), called
    for each in called.values():
        assert "SVC_GRPC_INTERNAL_SUBJECTS" in each.details
        assert "Traceback" not in each.details
    assert validated.org_id == str(tenant.orgID)
    assert ledgerRequestIDs(tlsAuth.dsn, tenant) == set()
    for method in INTERNAL:
        after = authMetric(tlsAuth, "svc_auth_internal_calls_denied_total", method=method)
        assert after - before[method] == 1, method
        assert (
            authMetric(
                tlsAuth, "svc_auth_grpc_requests_total", method=method, code="PERMISSION_DENIED"
            )
            >= 1
        )

    def logged() -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in tlsAuth.auth.output().splitlines() if line[:1] == "{"]
        return [line for line in lines if "denied" in line and "subject" in line]

    waitUntil(lambda: bool(logged()), 10.0, interval=0.05)
    line = logged()[0]
    assert line["level"] == "warn"
    assert line["common_name"] == "operator" and line["dns_names"] == "operator.internal"
    assert "CN=operator" in line["subject"]
    assert tenant.token not in tlsAuth.auth.output()
    assert "Traceback" not in tlsAuth.auth.output()


def providersFile(path: Path, upstream: ScriptedUpstream) -> Path:
    """
    One priced model whose every answer costs 2,000 tokens at $1 a
    million: 2,000,000 nano-dollars.
    """
    path.write_text(
        "\n".join(
            [
                "[[providers]]",
                'name = "scripted"',
                f'base_url = "{upstream.baseURL}"',
                "",
                "[[models]]",
                'name = "priced"',
                'provider = "scripted"',
                'upstream_model = "usage:1000:1000"',
                'price = { input = "1.00", output = "1.00" }',
            ]
        )
        + "\n"
    )
    return path


PRICED_BODY = json.dumps(
    {"model": "priced", "messages": [{"role": "user", "content": "hello there"}]}
).encode()


def proxyMetric(proxy: Daemon, name: str) -> float | None:
    status, body = proxy.get("/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_namedProxyRecordsUsageAndFollowsTheFeedEndToEnd(tlsAuth: TLSAuth, tmp_path: Path) -> None:
    """
    A proxy with the certificate SVC_GRPC_INTERNAL_SUBJECTS names, over
    mutual TLS, uses all three internal methods: its change feed is up, a
    forwarded request's row reaches the ledger (RecordUsage), a budget set
    afterwards reaches it (WatchChanges) and is enforced against the spend
    already in the ledger (GetSpend): 429 BUDGET_EXCEEDED.
    """
    roomInTheMonth()
    pems = tlsAuth.pems
    tenant = makeTenant(tlsAuth.owner, "budgeted")
    upstream = ScriptedUpstream(tmp_path / "upstream").start()
    try:
        with tlsAuth.proxy(
            "ledger",
            SVC_AUTH_GRPC_TLS_CA=str(pems.ca),
            SVC_AUTH_GRPC_TLS_CERT=str(pems.clientCert),
            SVC_AUTH_GRPC_TLS_KEY=str(pems.clientKey),
            SVC_PROVIDERS_FILE=str(providersFile(tmp_path / "providers.toml", upstream)),
            SVC_AUTH_VALIDATE_TIMEOUT="5s",
            SVC_REDIS_TIMEOUT="5s",
        ) as proxy:
            proxy.waitForReady()
            waitUntil(lambda: proxyMetric(proxy, "svc_proxy_auth_feed_up") == 1, 30.0)
            first = chat(proxy.httpPort, tenant, body=PRICED_BODY)
            assert first.status == 200, first.body
            waitUntil(lambda: len(ledgerRequestIDs(tlsAuth.dsn, tenant)) == 1, 30.0)
            # Half of what the first request cost.
            tlsAuth.owner.setBudget(tenant.orgID, None, 1_000_000, "month")
            answers: list[Any] = []

            def refused() -> bool:
                answers.append(chat(proxy.httpPort, tenant, body=PRICED_BODY))
                assert answers[-1].status in (200, 429), answers[-1].body
                return bool(answers[-1].status == 429)

            waitUntil(refused, 30.0, interval=0.1)
            assertEnvelope(answers[-1], 429, "BUDGET_EXCEEDED")
        assert "PERMISSION_DENIED" not in proxy.output()
    finally:
        upstream.stop()


def roomInTheMonth(margin: float = 120.0) -> None:
    """
    Wait (at most C{margin} seconds) until the UTC month has at least that
    long left: a month's budget starts again at its end.
    """
    moment = datetime.datetime.now(datetime.UTC)
    following = (moment.replace(day=1) + datetime.timedelta(days=32)).replace(
        day=1, hour=0, minute=0, second=0, microsecond=0
    )
    left = (following - moment).total_seconds()
    if left < margin:
        time.sleep(left + 0.05)


@pytest.mark.parametrize(
    "variables, problem",
    [
        ({"SVC_GRPC_INTERNAL_SUBJECTS": ""}, "is required with SVC_GRPC_TLS_CLIENT_CA"),
        ({"SVC_GRPC_INTERNAL_SUBJECTS": " , "}, "names no certificate subject"),
        (
            {"SVC_GRPC_TLS_CLIENT_CA": "", "SVC_GRPC_INTERNAL_SUBJECTS": PROXY_DNS_NAME},
            "needs mutual TLS",
        ),
    ],
    ids=["unset-with-mtls", "empty", "without-client-ca"],
)
def test_internalSubjectsMustGoWithMutualTLS(
    tlsAuth: TLSAuth, variables: dict[str, str], problem: str
) -> None:
    """
    svc-auth with mutual TLS and no SVC_GRPC_INTERNAL_SUBJECTS (which would
    deny every proxy its ledger and change feed), or with a list that names
    nothing, or with a list but no client certificates to check it
    against, refuses to start: one stderr line naming the variable, a
    non-zero exit, nothing listening.
    """
    environment = authEnvironment(tlsAuth.dsn, **{**mutualTLS(tlsAuth.pems), **variables})
    result = subprocess.run(
        twistdCommand("svc-auth"),
        env={**cleanEnvironment(), **environment},
        capture_output=True,
        text=True,
        timeout=Daemon.START_TIMEOUT,
        check=False,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "SVC_GRPC_INTERNAL_SUBJECTS" in lines[0] and problem in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    for port in (environment["SVC_PORT"], environment["SVC_GRPC_PORT"]):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
