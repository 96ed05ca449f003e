"""
The gateway harness of the end-to-end modules: a real svc-auth and svc-proxy
(twistd processes) on a private PostgreSQL and Redis, and a plain HTTP
client to drive them (L{request}, L{chat}, L{Answer}) with the checks every
module makes of an answer (L{assertEnvelope}, L{assertCommonHeaders}).

Moved here from test_gateway_e2e.py, whose tests it was written for, so that
the modules that share it import a library rather than another test module.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import attrs
import psycopg
from authfixtures import Tenant, makeTenant

from svcd.auth.store import Store
from svcd.common.ids import parseUUID
from svcd.devkit.daemons import Daemon, authEnvironment
from svcd.devkit.pgtemplate import migratedDatabase
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import freePort

CHAT_BODY = json.dumps(
    {"model": "demo", "messages": [{"role": "user", "content": "hello there"}]}
).encode()


@attrs.frozen
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    # The status line's reason phrase, when the answer was read with it.
    reason: str | None = None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str:
        return str(self.json()["error"]["code"])


def request(
    port: int,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    timeout: float = 10.0,
) -> Answer:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return Answer(
            response.status,
            {key.lower(): value for key, value in response.getheaders()},
            response.read(),
            response.reason,
        )
    finally:
        connection.close()


def tooLarge(port: int, length: int) -> Answer:
    """
    Announce a body of C{length} bytes and send only its first kilobyte, as
    a client whose upload the proxy refuses early: the 413 must come from
    the Content-Length alone, without waiting for the body.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {length}\r\n\r\n".encode()
            + b"{" * 1024
        )
        response = http.client.HTTPResponse(connection)
        response.begin()
        return Answer(
            response.status,
            {key.lower(): value for key, value in response.getheaders()},
            response.read(),
            response.reason,
        )


def chat(port: int, tenant: Tenant, **overrides: Any) -> Answer:
    headers = {
        "Authorization": f"Bearer {tenant.token}",
        "X-SVC-Agent-ID": str(tenant.agentID),
        "Content-Type": "application/json",
    }
    headers.update(overrides.pop("headers", {}))
    return request(
        port,
        "POST",
        overrides.pop("path", "/v1/chat/completions"),
        headers,
        overrides.pop("body", CHAT_BODY),
    )


def assertEnvelope(answer: Answer, status: int, code: str) -> None:
    """
    An error answer: the status with its standard reason phrase (decisions
    D10), the code, the envelope's fields, and the headers every response
    carries.
    """
    assert answer.status == status, (answer.status, answer.body)
    if answer.reason is not None:
        assert answer.reason == HTTPStatus(status).phrase, answer.reason
    error = answer.json()["error"]
    assert error["code"] == code
    assert error["message"]
    assert error["request_id"] == answer.headers["x-request-id"]
    assert error["timestamp"].endswith("Z")
    assertCommonHeaders(answer)


def assertCommonHeaders(answer: Answer) -> None:
    requestID = parseUUID(answer.headers["x-request-id"])
    assert requestID is not None and requestID.version in (4, 7)
    assert len(answer.headers["x-trace-id"]) == 32
    assert float(answer.headers["x-response-time"]) >= 0


@attrs.define
class Gateway:
    """
    A running gateway: its database, Redis, both daemons and some tenants.
    """

    dsn: str
    redis: RedisServer
    auth: Daemon
    proxy: Daemon
    tenants: dict[str, Tenant]
    owner: Store

    @property
    def port(self) -> int:
        return self.proxy.httpPort


@contextlib.contextmanager
def runningGateway(
    postgres: PostgresServer,
    workdir: Path,
    proxyEnvironment: dict[str, str] | None = None,
    prepare: Callable[[dict[str, Tenant]], dict[str, str]] | None = None,
) -> Iterator[Gateway]:
    """
    @param prepare: called with the tenants once they exist, before the
        daemons start; returns more variables for svc-proxy (such as
        SVC_PROVIDERS_FILE naming a file that lists the tenants'
        organizations).
    """
    name = f"e2e_{secrets.token_hex(6)}"
    dsn = migratedDatabase(postgres, name)
    redis = RedisServer.create(workdir / "redis")
    redis.start()
    connection = psycopg.connect(dsn, autocommit=True)
    owner = Store(lambda: contextlib.nullcontext(connection))
    tenants = {
        "main": makeTenant(owner, "main"),
        "other": makeTenant(owner, "other"),
        "limited": makeTenant(owner, "limited"),
        "probeOnly": makeTenant(owner, "probe-only", permissions=0),
        "paused": makeTenant(owner, "paused", agentStatus="paused"),
        "bound": makeTenant(owner, "bound", bindAgent=True),
    }
    prepared = prepare(tenants) if prepare is not None else {}
    auth = Daemon("svc-auth", authEnvironment(dsn), workdir / "auth.log").start()
    proxy = Daemon(
        "svc-proxy",
        {
            "SVC_HOST": "127.0.0.1",
            "SVC_PORT": str(freePort()),
            "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}",
            "REDIS_URL": redis.url,
            "SVC_RATE_LIMIT_ORG_OVERRIDES": f"{tenants['limited'].orgID}=3",
            "SVC_SHUTDOWN_TIMEOUT": "5s",
            **(proxyEnvironment or {}),
            **prepared,
        },
        workdir / "proxy.log",
    ).start()
    try:
        auth.waitForReady()
        proxy.waitForReady()
        yield Gateway(dsn, redis, auth, proxy, tenants, owner)
    finally:
        proxy.terminate()
        auth.terminate()
        redis.destroy()
        connection.close()
        postgres.dropDatabase(name)


# A rate limit no test traffic reaches, for tests about something else.
UNLIMITED = {"SVC_RATE_LIMIT_DEFAULT_RPM": "1000000"}


# svc-auth's deadline for gateways whose tests are not about it (as
# test_faults_edge, test_security_abuse and test_security_grpcflood do):
# on a loaded machine (the suite's own workers, two busy loops beside it) a
# token's first validation, an argon2 verification, or any call can take
# longer than the default 50 ms, and a deadline missed by scheduling alone
# turns the answer a test checks into a 503. The deadline's own tests
# (test_faults_gateway, test_authDownFrozenAndBack) keep the default.
PATIENT_AUTH = {"SVC_AUTH_VALIDATE_TIMEOUT": "1s"}


def unlimitedGateway(
    postgres: PostgresServer, workdir: Path, **environment: str
) -> contextlib.AbstractContextManager[Gateway]:
    """
    L{runningGateway} with a rate limit that no test traffic reaches.
    """
    return runningGateway(postgres, workdir, proxyEnvironment={**UNLIMITED, **environment})


def waitFor(condition: Any, limit: float, interval: float = 0.05) -> float:
    started = time.monotonic()
    while True:
        if condition():
            return time.monotonic() - started
        assert time.monotonic() - started < limit, f"not within {limit}s"
        time.sleep(interval)


def waitForReady(port: int, status: int, failed: str | None = None, limit: float = 1.5) -> None:
    """
    Wait until /ready answers C{status} (with the check C{failed} failed).
    /ready shares one check at most 250 ms old (decisions D10): a change
    shows within a second (the check's own 500 ms timeout included), not
    at once. Every answer must come within the 750 ms budget.
    """

    def answered() -> bool:
        started = time.monotonic()
        answer = request(port, "GET", "/ready")
        assert time.monotonic() - started < 1.0
        if answer.status != status:
            return False
        return failed is None or answer.json()["checks"][failed]["status"] == "failed"

    waitFor(answered, limit)
