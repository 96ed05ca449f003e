"""
svc-auth as operators run it: C{twistd -n svc-auth} in its own process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from authfixtures import makeTenant

from svcd.auth.store import Store
from svcd.common.migrations import migrate
from svcd.common.pat import READINESS_SENTINEL
from svcd.common.readiness import READY_MAX_AGE
from svcd.devkit.daemons import Daemon, authEnvironment, twistdCommand
from svcd.devkit.postgres import PostgresServer
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
# About twistd's own start: its daemons are new interpreters (forkedtwistd.py).
pytestmark = [pytest.mark.e2e, pytest.mark.freshinterpreter]


@pytest.fixture
def authDaemon(migratedDSN: str, tmp_path: Path) -> Iterator[Daemon]:
    daemon = Daemon("svc-auth", authEnvironment(migratedDSN), tmp_path / "auth.log").start()
    daemon.waitForHealth()
    yield daemon
    daemon.terminate()


def test_servesHealthReadyMetricsAndGrpc(authDaemon: Daemon) -> None:
    """
    The daemon answers /health, a ready /ready with both checks, /metrics
    with the spec's series, and ValidateToken on its gRPC port.
    """
    assert authDaemon.get("/health") == (200, b'{"status":"ok","checks":{}}')
    status, body = authDaemon.get("/ready")
    report = json.loads(body)
    assert status == 200 and report["status"] == "ok"
    assert set(report["checks"]) == {"postgres", "grpc"}
    for check in report["checks"].values():
        assert check["status"] == "ok" and isinstance(check["latency_ms"], float)

    port = authDaemon.environment["SVC_GRPC_PORT"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = auth_pb2_grpc.AuthServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ValidateToken(
                auth_pb2.ValidateTokenRequest(access_token=READINESS_SENTINEL), timeout=5
            )
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED

    status, metrics = authDaemon.get("/metrics")
    assert status == 200
    for name in (
        b"svc_auth_validate_token_duration_seconds_bucket",
        b"svc_auth_grpc_requests_total",
        b"svc_db_query_duration_seconds_bucket",
        b"svc_process_up 1.0",
        b'svc_auth_grpc_refused_total{reason="peer"} 0.0',
    ):
        assert name in metrics
    assert b'le="0.001"' in metrics and b'le="5.0"' in metrics
    assert b'result="unauthenticated"' in metrics


def test_metricsNeverNameATenant(authDaemon: Daemon, owner: Store) -> None:
    """
    After validations of a real tenant's token and agent, /metrics holds
    neither its organization id, its agent id nor its token id.
    """
    tenant = makeTenant(owner)
    port = authDaemon.environment["SVC_GRPC_PORT"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = auth_pb2_grpc.AuthServiceStub(channel)
        stub.ValidateToken(auth_pb2.ValidateTokenRequest(access_token=tenant.token), timeout=5)
        stub.ValidateAgent(
            auth_pb2.ValidateAgentRequest(agent_id=str(tenant.agentID), org_id=str(tenant.orgID)),
            metadata=(("authorization", f"Bearer {tenant.token}"),),
            timeout=5,
        )
    status, metrics = authDaemon.get("/metrics")
    assert status == 200
    assert b'svc_auth_validate_agent_duration_seconds_count{result="ok"} 1.0' in metrics
    for identifier in (tenant.orgID, tenant.agentID, tenant.tokenID):
        assert str(identifier).encode() not in metrics


def test_wrongMethodAndUnknownPathUseTheEnvelope(authDaemon: Daemon) -> None:
    """
    POST /health is 405 METHOD_NOT_ALLOWED and an unknown path is 404
    NOT_FOUND, both in the error envelope.
    """
    import urllib.error
    import urllib.request

    request = urllib.request.Request(authDaemon.url("/health"), data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=5)
    assert raised.value.code == 405
    assert json.loads(raised.value.read())["error"]["code"] == "METHOD_NOT_ALLOWED"
    status, body = authDaemon.get("/nope")
    assert status == 404 and json.loads(body)["error"]["code"] == "NOT_FOUND"


def test_readinessFollowsPostgres(privatePostgres: PostgresServer, tmp_path: Path) -> None:
    """
    With PostgreSQL stopped, /ready answers 503 unhealthy within its 750 ms
    budget, naming the failed postgres check; it is ready again once
    PostgreSQL is back, without restarting svc-auth.
    """
    dsn = privatePostgres.createDatabase("auth")
    migrate(dsn)
    daemon = Daemon("svc-auth", authEnvironment(dsn), tmp_path / "auth.log").start()
    try:
        daemon.waitForHealth()
        assert daemon.get("/ready")[0] == 200
        privatePostgres.stop()
        # /ready shares one run of its checks for READY_MAX_AGE (decisions
        # D10): the next probe after that runs them again.
        time.sleep(READY_MAX_AGE)
        started = time.monotonic()
        status, body = daemon.get("/ready")
        took = time.monotonic() - started
        report = json.loads(body)
        assert status == 503 and report["status"] == "unhealthy"
        assert report["checks"]["postgres"]["status"] == "failed"
        assert report["checks"]["postgres"]["message"]
        assert report["checks"]["grpc"]["status"] == "ok"
        assert took < 1.5
        privatePostgres.start()
        deadline = time.monotonic() + 10
        while daemon.get("/ready")[0] != 200:
            assert time.monotonic() < deadline, daemon.output()
            time.sleep(0.1)
    finally:
        assert daemon.terminate() == 0


def test_sigtermStopsCleanly(authDaemon: Daemon) -> None:
    """
    SIGTERM stops the gRPC server and the HTTP listener and exits 0 well
    within SVC_SHUTDOWN_TIMEOUT.
    """
    started = time.monotonic()
    assert authDaemon.terminate() == 0
    assert time.monotonic() - started < 5
    assert "Server Shut Down" in authDaemon.output()


@pytest.mark.parametrize(
    "environment, variable",
    [
        ({}, "POSTGRES_DSN"),
        ({"POSTGRES_DSN": "host=127.0.0.1", "SVC_PORT": "eighty"}, "SVC_PORT"),
        (
            {"POSTGRES_DSN": "host=127.0.0.1", "SVC_SHUTDOWN_TIMEOUT": "soon"},
            "SVC_SHUTDOWN_TIMEOUT",
        ),
        (
            {"POSTGRES_DSN": "host=127.0.0.1", "SVC_ENV": "production", "SVC_GRPC_HOST": "0.0.0.0"},
            "SVC_GRPC_HOST",
        ),
        ({"POSTGRES_DSN": "host=127.0.0.1", "SVC_LOG_LEVEL": "LOUD"}, "SVC_LOG_LEVEL"),
    ],
)
def test_badConfigurationIsOneLine(environment: dict[str, str], variable: str) -> None:
    """
    A missing or bad variable stops svc-auth with one stderr line naming it
    and a non-zero exit, never a traceback.
    """
    clean = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SVC_", "POSTGRES_", "OTEL_"))
    }
    result = subprocess.run(
        twistdCommand("svc-auth"),
        env={**clean, **environment},
        capture_output=True,
        text=True,
        # A bound against a hang (twistd imports for seconds on a loaded
        # machine), as for a daemon's start.
        timeout=Daemon.START_TIMEOUT,
        check=False,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert variable in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_grpcPortInUseStopsTheStart(migratedDSN: str, tmp_path: Path) -> None:
    """
    A second svc-auth on a gRPC port already taken exits non-zero instead
    of running without its gRPC server.
    """
    first = Daemon("svc-auth", authEnvironment(migratedDSN), tmp_path / "first.log").start()
    try:
        first.waitForHealth()
        environment = authEnvironment(migratedDSN, SVC_GRPC_PORT=first.environment["SVC_GRPC_PORT"])
        result = subprocess.run(
            twistdCommand("svc-auth"),
            env={**os.environ, **environment},
            capture_output=True,
            text=True,
            timeout=Daemon.START_TIMEOUT,
            check=False,
        )
        assert result.returncode != 0
        assert "gRPC" in result.stdout + result.stderr
    finally:
        first.terminate()


def test_httpPortInUseStopsTheStart(migratedDSN: str, tmp_path: Path) -> None:
    """
    An svc-auth whose HTTP port is taken stops at once with one line
    naming the port, instead of running without its health and metrics
    (the service of C{strports.service} raises when it cannot listen).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = subprocess.run(
            twistdCommand("svc-auth"),
            env={**os.environ, **authEnvironment(migratedDSN, SVC_PORT=port)},
            capture_output=True,
            text=True,
            timeout=Daemon.START_TIMEOUT,
            check=False,
        )
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if "cannot start" in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("svc-auth: cannot start: ") and port in lines[0]


def test_twistedWithoutAPrivateNameRefusesToStart(migratedDSN: str, tmp_path: Path) -> None:
    """
    Issue 29 item 5: a Twisted whose reactor no longer records the signal
    that stopped it (what L{exitZeroOnStopSignals} clears) stops svc-auth
    at start with one line naming the name, not with a SIGTERM that kills
    it later. The missing name is simulated by a sitecustomize that deletes
    it before twistd imports svc-auth.
    """
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text(
        "from twisted.internet.base import ReactorBase\ndel ReactorBase._exitSignal\n"
    )
    path = os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        twistdCommand("svc-auth"),
        env={**os.environ, **authEnvironment(migratedDSN, PYTHONPATH=path)},
        capture_output=True,
        text=True,
        timeout=Daemon.START_TIMEOUT,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("svc-auth: Twisted "), result.stderr
    assert "lacks ReactorBase._exitSignal," in result.stderr
    assert "was tested with (25.5 to 26.10)" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def plaintextWarnings(daemon: Daemon) -> list[dict[str, object]]:
    """
    Once the daemon has logged that gRPC listens, its warnings about
    plaintext gRPC.
    """
    deadline = time.monotonic() + 20
    while "gRPC AuthService listening" not in daemon.output():
        assert time.monotonic() < deadline, daemon.output()
        assert daemon.process is not None and daemon.process.poll() is None, daemon.output()
        time.sleep(0.05)
    events = [json.loads(line) for line in daemon.output().splitlines() if line.startswith("{")]
    return [
        event
        for event in events
        if event["level"] == "warn" and "plaintext" in str(event["message"])
    ]


@pytest.mark.parametrize(
    ("environment", "host", "warned"),
    [
        ("development", "0.0.0.0", True),
        ("staging", "0.0.0.0", True),
        ("development", "127.0.0.1", False),
        ("production", "127.0.0.1", False),
    ],
)
def test_plaintextGrpcBeyondLoopbackIsWarnedAbout(
    migratedDSN: str, tmp_path: Path, environment: str, host: str, warned: bool
) -> None:
    """
    svc-auth serving plaintext gRPC on an address other hosts can reach
    logs one warning at start naming the address, in every environment
    that lets it start (production refuses to); on loopback it logs none.
    """
    daemon = Daemon(
        "svc-auth",
        authEnvironment(migratedDSN, SVC_ENV=environment, SVC_GRPC_HOST=host),
        tmp_path / "auth.log",
    ).start()
    try:
        warnings = plaintextWarnings(daemon)
    finally:
        daemon.terminate()
    if warned:
        (warning,) = warnings
        assert warning["host"] == host
        assert "SVC_GRPC_TLS_CERT" in str(warning["message"])
    else:
        assert warnings == []


del signal, sys
