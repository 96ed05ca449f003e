"""
Graceful shutdown of the real daemons: on SIGTERM each stops accepting
connections at once, lets the work in flight finish, closes what it holds
and exits 0 within SVC_SHUTDOWN_TIMEOUT.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from authfixtures import makeTenant, ownerStore
from fakeauth import servingAuth
from proxydoubles import newToken

from svcd.devkit.daemons import Daemon, authEnvironment
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

SLOW_VALIDATE = 1.0


class SlowAuth(auth_pb2_grpc.AuthServiceServicer):
    """
    ValidateToken takes about a second, then vouches for the token.
    """

    def __init__(self) -> None:
        self.validating = threading.Event()

    def ValidateToken(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.validating.set()
        time.sleep(SLOW_VALIDATE)
        return auth_pb2.ValidateTokenResponse(org_id=str(uuid.uuid4()), permissions=1)

    def ValidateAgent(self, request: Any, context: grpc.ServicerContext) -> Any:
        return auth_pb2.ValidateAgentResponse(
            agent_id=request.agent_id, org_id=request.org_id, status="active"
        )


@pytest.fixture
def slowAuth() -> Iterator[tuple[SlowAuth, int]]:
    servicer = SlowAuth()
    with servingAuth(servicer) as port:
        yield servicer, port


def refused(port: int) -> bool:
    """
    Is a new TCP connection to the port refused? A connection reset
    (the listening socket closed while ours waited in its backlog) is not
    yet a refusal: the caller asks again.
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False


def waitUntil(condition: Any, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"not within {limit} s"
        time.sleep(0.02)


def test_proxyFinishesRequestInFlight(slowAuth: tuple[SlowAuth, int], tmp_path: Path) -> None:
    """
    A chat request waiting on a slow ValidateToken when SIGTERM arrives
    still gets its answer (501); meanwhile new connections are refused; the
    proxy exits 0 well within SVC_SHUTDOWN_TIMEOUT and says it stopped.
    """
    servicer, grpcPort = slowAuth
    proxy = Daemon(
        "svc-proxy",
        {
            "SVC_HOST": "127.0.0.1",
            "SVC_PORT": str(freePort()),
            "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{grpcPort}",
            "SVC_AUTH_VALIDATE_TIMEOUT": "3s",
            "SVC_SHUTDOWN_TIMEOUT": "5s",
        },
        tmp_path / "proxy.log",
    ).start()
    try:
        proxy.waitForHealth()
        answers: list[tuple[int, bytes]] = []

        def send() -> None:
            connection = http.client.HTTPConnection("127.0.0.1", proxy.httpPort, timeout=10)
            connection.request(
                "POST",
                "/v1/chat/completions",
                body=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                headers={
                    "Authorization": "Bearer " + newToken(),
                    "X-SVC-Agent-ID": str(uuid.uuid4()),
                    "Content-Type": "application/json",
                },
            )
            response = connection.getresponse()
            answers.append((response.status, response.read()))
            connection.close()

        client = threading.Thread(target=send)
        client.start()
        assert servicer.validating.wait(10)
        signalled = time.monotonic()
        proxy.signal(signal.SIGTERM)
        waitUntil(lambda: refused(proxy.httpPort), limit=SLOW_VALIDATE / 2)
        assert not answers, "answered before ValidateToken returned"
        client.join(10)
        [(status, body)] = answers
        assert status == 501, body
        assert json.loads(body)["error"]["code"] == "PROVIDER_NOT_CONFIGURED"
        assert proxy.process is not None
        assert proxy.process.wait(10) == 0
        assert time.monotonic() - signalled < 5
    finally:
        proxy.terminate()
    messages = [json.loads(line)["message"] for line in proxy.output().splitlines() if line]
    assert "POST /v1/chat/completions 501" in messages
    assert messages.index("POST /v1/chat/completions 501") < messages.index("svc-proxy stopped")


def test_proxyGivesUpAfterShutdownTimeout(slowAuth: tuple[SlowAuth, int], tmp_path: Path) -> None:
    """
    A request still in flight when SVC_SHUTDOWN_TIMEOUT runs out does not
    hold the stop: the proxy warns and exits 0 soon after the timeout.
    """
    servicer, grpcPort = slowAuth
    proxy = Daemon(
        "svc-proxy",
        {
            "SVC_HOST": "127.0.0.1",
            "SVC_PORT": str(freePort()),
            "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{grpcPort}",
            "SVC_AUTH_VALIDATE_TIMEOUT": "3s",
            "SVC_SHUTDOWN_TIMEOUT": "200ms",
        },
        tmp_path / "proxy.log",
    ).start()
    try:
        proxy.waitForHealth()
        connection = http.client.HTTPConnection("127.0.0.1", proxy.httpPort, timeout=10)
        connection.request(
            "GET",
            "/v1/internal/auth-probe",
            headers={"Authorization": "Bearer " + newToken(), "X-SVC-Agent-ID": str(uuid.uuid4())},
        )
        assert servicer.validating.wait(10)
        signalled = time.monotonic()
        proxy.signal(signal.SIGTERM)
        assert proxy.process is not None
        assert proxy.process.wait(10) == 0
        assert time.monotonic() - signalled < SLOW_VALIDATE
        connection.close()
    finally:
        proxy.terminate()
    assert "Requests still in flight after 0.2 s; closing anyway" in proxy.output()


@contextlib.contextmanager
def tokensLocked(dsn: str) -> Iterator[None]:
    """
    Hold an exclusive lock on the tokens table: svc-auth's lookup of a
    token it has not cached waits until the lock is released.
    """
    with psycopg.connect(dsn) as connection:
        connection.execute("LOCK TABLE tokens IN ACCESS EXCLUSIVE MODE")
        try:
            yield
        finally:
            connection.rollback()


def test_authFinishesCallInFlight(migratedDSN: str, tmp_path: Path) -> None:
    """
    A ValidateToken call held up in the database when SIGTERM arrives still
    gets its answer (OK); meanwhile both the HTTP and the gRPC port refuse
    new connections; then svc-auth closes its pool and exits 0.
    """
    owner, connection = ownerStore(migratedDSN)
    tenant = makeTenant(owner)
    connection.close()
    environment = authEnvironment(
        migratedDSN, SVC_DB_STATEMENT_TIMEOUT="10s", SVC_SHUTDOWN_TIMEOUT="5s"
    )
    auth = Daemon("svc-auth", environment, tmp_path / "auth.log").start()
    grpcPort = int(environment["SVC_GRPC_PORT"])
    try:
        auth.waitForReady()
        channel = grpc.insecure_channel(f"127.0.0.1:{grpcPort}")
        stub = auth_pb2_grpc.AuthServiceStub(channel)
        grpc.channel_ready_future(channel).result(timeout=5)
        with tokensLocked(migratedDSN):
            call = stub.ValidateToken.future(
                auth_pb2.ValidateTokenRequest(access_token=tenant.token), timeout=10
            )
            time.sleep(0.3)
            assert not call.done(), "the call was not held up by the lock"
            signalled = time.monotonic()
            auth.signal(signal.SIGTERM)
            waitUntil(lambda: refused(auth.httpPort) and refused(grpcPort), limit=2)
            assert not call.done()
        response = call.result(timeout=10)
        assert response.org_id == str(tenant.orgID)
        channel.close()
        assert auth.process is not None
        assert auth.process.wait(10) == 0
        assert time.monotonic() - signalled < 5
    finally:
        auth.terminate()
    output = auth.output()
    assert "gRPC server stopped" in output
    assert "Database pool closed" in output
    assert output.index("gRPC server stopped") < output.index("Database pool closed")


def test_authStopsWithNothingInFlight(migratedDSN: str, tmp_path: Path) -> None:
    """
    An idle svc-auth closes both ports and exits 0 promptly on SIGTERM.
    """
    environment = authEnvironment(migratedDSN)
    auth = Daemon("svc-auth", environment, tmp_path / "auth.log").start()
    try:
        auth.waitForReady()
        signalled = time.monotonic()
        auth.signal(signal.SIGTERM)
        assert auth.process is not None
        assert auth.process.wait(10) == 0
        assert time.monotonic() - signalled < 3
        assert refused(auth.httpPort) and refused(int(environment["SVC_GRPC_PORT"]))
    finally:
        auth.terminate()


def test_authStopsAtOnceWithProxiesAttached(
    migratedDSN: str, redisURL: str, tmp_path: Path
) -> None:
    """
    A proxy's change feed is a call that never ends by itself; svc-auth
    ends it first when it stops, so a stop with a proxy attached and no
    slow call takes well under SVC_SHUTDOWN_TIMEOUT (10 s here), and the
    proxy hears why.
    """
    environment = authEnvironment(migratedDSN, SVC_SHUTDOWN_TIMEOUT="10s")
    auth = Daemon("svc-auth", environment, tmp_path / "auth.log").start()
    proxy = Daemon(
        "svc-proxy",
        {
            "SVC_HOST": "127.0.0.1",
            "SVC_PORT": str(freePort()),
            "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{environment['SVC_GRPC_PORT']}",
            "REDIS_URL": redisURL,
            "SVC_SHUTDOWN_TIMEOUT": "5s",
        },
        tmp_path / "proxy.log",
    ).start()
    try:
        auth.waitForReady(60)
        proxy.waitForReady(60)
        waitUntil(lambda: "Change feed from svc-auth is live" in proxy.output(), limit=30)
        signalled = time.monotonic()
        auth.signal(signal.SIGTERM)
        assert auth.process is not None
        assert auth.process.wait(10) == 0
        assert time.monotonic() - signalled < 2
        waitUntil(
            lambda: (
                "Change feed from svc-auth lost (UNAVAILABLE: svc-auth is stopping)"
                in proxy.output()
            ),
            limit=10,
        )
    finally:
        proxy.terminate()
        auth.terminate()
    assert "Ended 1 change feed stream(s): svc-auth is stopping" in auth.output()


def test_proxyFinishesAStreamInFlight(migratedDSN: str, redisURL: str, tmp_path: Path) -> None:
    """
    Issue 25: a streaming forward in flight when SIGTERM arrives completes,
    every event relayed, its usage event and [DONE] included, and its
    access line carries the usage; meanwhile new connections are refused;
    then the proxy exits 0.
    """
    owner, connection = ownerStore(migratedDSN)
    tenant = makeTenant(owner)
    connection.close()
    upstream = ScriptedUpstream(tmp_path / "upstream").start()
    providers = tmp_path / "providers.toml"
    providers.write_text(
        "[[providers]]\n"
        'name = "local"\n'
        f'base_url = "{upstream.baseURL}"\n'
        'timeout = "30s"\n'
        'idle_timeout = "10s"\n'
        "\n[[models]]\n"
        'name = "slow-stream"\n'
        'provider = "local"\n'
        # The events of the answer, 150 ms apart: about 2 s in all.
        'upstream_model = "gap:150"\n'
    )
    environment = authEnvironment(migratedDSN)
    auth = Daemon("svc-auth", environment, tmp_path / "auth.log").start()
    proxy = Daemon(
        "svc-proxy",
        {
            "SVC_HOST": "127.0.0.1",
            "SVC_PORT": str(freePort()),
            "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{environment['SVC_GRPC_PORT']}",
            "REDIS_URL": redisURL,
            "SVC_RATE_LIMIT_DEFAULT_RPM": "1000000",
            "SVC_PROVIDERS_FILE": str(providers),
            "SVC_SHUTDOWN_TIMEOUT": "30s",
            # A loaded machine may take longer than 50 ms to verify a token
            # the first time; what is tested here is the stop.
            "SVC_AUTH_VALIDATE_TIMEOUT": "5s",
        },
        tmp_path / "proxy.log",
    ).start()
    try:
        auth.waitForReady(60)
        proxy.waitForReady(60)
        httpConnection = http.client.HTTPConnection("127.0.0.1", proxy.httpPort, timeout=30)
        httpConnection.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(
                {
                    "model": "slow-stream",
                    "messages": [{"role": "user", "content": "tell me a story"}],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ),
            headers={
                "Authorization": f"Bearer {tenant.token}",
                "X-SVC-Agent-ID": str(tenant.agentID),
                "Content-Type": "application/json",
            },
        )
        response = httpConnection.getresponse()
        assert response.status == 200, response.read()
        first = response.readline()
        assert first.startswith(b"data: "), first
        signalled = time.monotonic()
        proxy.signal(signal.SIGTERM)
        waitUntil(lambda: refused(proxy.httpPort), limit=5)
        rest = response.read()
        httpConnection.close()
        events = [
            line[len(b"data: ") :]
            for line in (first + rest).splitlines()
            if line.startswith(b"data: ")
        ]
        assert events[-1] == b"[DONE]"
        usage = json.loads(events[-2])
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
        assert proxy.process is not None
        assert proxy.process.wait(30) == 0
        assert time.monotonic() - signalled < 30
    finally:
        proxy.terminate()
        auth.terminate()
        upstream.stop()
    lines = [json.loads(line) for line in proxy.output().splitlines() if line.strip()]
    [access] = [line for line in lines if line["message"] == "POST /v1/chat/completions 200"]
    assert access["completion_tokens"] == usage["usage"]["completion_tokens"]
    messages = [line["message"] for line in lines]
    assert messages.index("POST /v1/chat/completions 200") < messages.index("svc-proxy stopped")
