"""
Faults under load, with real processes: a background loop of chat requests
runs through a real svc-proxy while Redis is killed and restarted, svc-auth
is killed, frozen and restarted, and PostgreSQL is stopped and restarted
under svc-auth.

For each fault the tests check what clients see while it lasts (the
statuses of the spec: fail-open 501s without rate-limit headers for Redis,
503 SERVICE_DEGRADED or AUTH_UNAVAILABLE for svc-auth and its database),
that /ready reports it within its 750 ms budget, that service comes back by
itself within 5 s of the dependency's return, that no request ever took
longer than its deadlines allow, and that a revocation and a token made
before the fault are still in force after it.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from authfixtures import Tenant
from gatewayfixtures import (
    Answer,
    Gateway,
    assertEnvelope,
    chat,
    request,
    unlimitedGateway,
    waitFor,
)

from svcd.auth.authority import issueToken
from svcd.common.readiness import READY_MAX_AGE
from svcd.devkit.postgres import PostgresServer

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

# The deadlines of one chat request through the proxy: ValidateToken and
# ValidateAgent 50 ms each, the Redis counter 100 ms. A request may take
# that plus scheduling slack on a busy 2-core machine, never more.
REQUEST_BUDGET = 0.05 + 0.05 + 0.1
SLACK = 0.6
# /ready: 750 ms budget, plus slack.
READY_BUDGET = 0.75 + 0.5
# Service must be back within this long of the dependency's return.
RECOVERY = 5.0


@attrs.frozen
class Sample:
    """
    One request of the load loop.
    """

    started: float
    took: float
    status: int
    code: str | None
    rateLimited: bool


class Load:
    """
    A background thread sending chat requests for C{tenant} one after
    another, each on a new connection, until stopped; bounded by
    C{limit} seconds in any case.
    """

    def __init__(self, port: int, tenant: Tenant, pause: float = 0.01, limit: float = 60.0) -> None:
        self.port = port
        self.tenant = tenant
        self.pause = pause
        self.limit = limit
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        began = time.monotonic()
        while not self._stop.is_set() and time.monotonic() - began < self.limit:
            started = time.monotonic()
            try:
                answer = chat(self.port, self.tenant)
            except OSError as error:
                self.samples.append(
                    Sample(started, time.monotonic() - started, 0, repr(error), False)
                )
            else:
                code = answer.json()["error"]["code"] if answer.status >= 400 else None
                self.samples.append(
                    Sample(
                        started,
                        time.monotonic() - started,
                        answer.status,
                        code,
                        "x-ratelimit-limit" in answer.headers,
                    )
                )
            self._stop.wait(self.pause)

    def between(self, start: float, end: float = float("inf")) -> list[Sample]:
        return [sample for sample in self.samples if start <= sample.started < end]

    def assertNoneHung(self) -> None:
        assert self.samples
        slowest = max(self.samples, key=lambda sample: sample.took)
        assert slowest.took < REQUEST_BUDGET + SLACK, slowest
        assert all(sample.status for sample in self.samples), [
            s for s in self.samples if not s.status
        ]

    def summary(self) -> str:
        took = sorted(sample.took for sample in self.samples)
        return (
            f"{len(took)} requests, median {took[len(took) // 2] * 1000:.1f} ms, "
            f"max {took[-1] * 1000:.1f} ms"
        )


def waitForSamples(load: Load, after: float, count: int = 5, limit: float = 10.0) -> None:
    waitFor(lambda: len(load.between(after)) >= count, limit)


def timedReady(port: int) -> tuple[float, int, dict[str, object]]:
    """
    /ready just after a fault: the first answer that is not 200 and how
    long it took. /ready shares one check at most 250 ms old (decisions
    D10), so for that long it may still give the answer of a check made
    before the fault: probe until it changes, for that long plus slack.
    """
    deadline = time.monotonic() + READY_MAX_AGE + SLACK
    while True:
        started = time.monotonic()
        answer = request(port, "GET", "/ready")
        took = time.monotonic() - started
        if answer.status != 200 or started > deadline:
            return took, answer.status, answer.json()
        time.sleep(0.02)


def recoveredAt(load: Load, since: float, status: int = 501, header: bool | None = None) -> float:
    """
    The start of the first sample after C{since} with C{status} after which
    every sample has it too; waits for up to RECOVERY seconds.
    """

    def stable() -> float | None:
        after = load.between(since)
        for index, sample in enumerate(after):
            if (
                all(
                    each.status == status and (header is None or each.rateLimited == header)
                    for each in after[index:]
                )
                and len(after) - index >= 3
            ):
                return sample.started
        return None

    waitFor(lambda: stable() is not None, RECOVERY + 1)
    found = stable()
    assert found is not None
    return found


@attrs.define
class Credentials:
    """
    A token revoked and a token created before the fault.
    """

    revoked: Tenant
    created: Tenant


def answerOnceSettled(gateway: Gateway, tenant: Tenant, status: int) -> Answer:
    """
    Chat as C{tenant} until the answer is C{status}, within L{RECOVERY},
    with nothing but 503 before it: a token's first validation (an argon2
    verification in svc-auth) may miss the 50 ms deadline on a loaded
    machine, and that request fails closed, which is not what these tests
    are about; any other answer (a revoked token accepted, a live one
    refused) fails at once.
    """
    answers: list[Answer] = []

    def settled() -> bool:
        answers.append(chat(gateway.port, tenant))
        assert answers[-1].status in (status, 503), [answer.status for answer in answers]
        return answers[-1].status == status

    waitFor(settled, RECOVERY)
    return answers[-1]


def credentialsBeforeTheFault(gateway: Gateway) -> Credentials:
    """
    Revoke a token that svc-auth has cached (it answered for it), and make
    one it has never seen; check both took effect.
    """
    main = gateway.tenants["main"]
    revokedToken, revokedRecord = issueToken(gateway.owner, orgID=main.orgID, permissions=1)
    revoked = attrs.evolve(main, token=revokedToken, tokenID=revokedRecord.tokenID)
    answerOnceSettled(gateway, revoked, 501)
    gateway.owner.revokeToken(revokedRecord.tokenID)
    waitFor(lambda: chat(gateway.port, revoked).status == 401, limit=1.5)
    createdToken, createdRecord = issueToken(gateway.owner, orgID=main.orgID, permissions=1)
    return Credentials(
        revoked, attrs.evolve(main, token=createdToken, tokenID=createdRecord.tokenID)
    )


def assertStillInForce(gateway: Gateway, credentials: Credentials) -> None:
    assertEnvelope(answerOnceSettled(gateway, credentials.revoked, 401), 401, "INVALID_TOKEN")
    assertEnvelope(
        answerOnceSettled(gateway, credentials.created, 501), 501, "PROVIDER_NOT_CONFIGURED"
    )


@pytest.fixture
def faultyGateway(postgresServer: PostgresServer, tmp_path: Path) -> Iterator[Gateway]:
    """
    A gateway whose Redis and daemons this test may kill.
    """
    with unlimitedGateway(postgresServer, tmp_path) as gateway:
        yield gateway


# svc-auth missing the proxy's validation deadline on a loaded machine:
# ValidateAgent's 503 AUTH_UNAVAILABLE, ValidateToken's 503 SERVICE_DEGRADED.
FAILED_CLOSED = frozenset({(503, "AUTH_UNAVAILABLE"), (503, "SERVICE_DEGRADED")})


def test_redisKilledMidLoad(faultyGateway: Gateway) -> None:
    """
    Redis killed (SIGKILL) under load: requests go on being served (fail
    open, 501 without X-RateLimit headers), /ready says redis failed within
    its budget; Redis restarted: the headers are back within 5 s and
    /ready is 200, without touching the proxy.
    """
    gateway = faultyGateway
    credentials = credentialsBeforeTheFault(gateway)
    redis = gateway.redis
    with Load(gateway.port, gateway.tenants["main"]) as load:
        waitForSamples(load, 0)
        pid = redis.pid
        assert pid is not None
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        redis.stop()
        took, status, body = timedReady(gateway.port)
        assert status == 503 and took < READY_BUDGET, (took, body)
        checks = body["checks"]
        assert isinstance(checks, dict) and checks["redis"]["status"] == "failed"
        waitForSamples(load, time.monotonic(), count=20)
        during = load.between(killed + 0.2)
        # 501 as before the fault (a rare validation failed closed aside,
        # see the end).
        duringAnswers = {(sample.status, sample.code) for sample in during}
        assert (501, "PROVIDER_NOT_CONFIGURED") in duringAnswers, duringAnswers
        assert duringAnswers <= {(501, "PROVIDER_NOT_CONFIGURED"), *FAILED_CLOSED}, duringAnswers
        assert not any(sample.rateLimited for sample in during[-10:])

        redis.start()
        back = time.monotonic()
        recovered = recoveredAt(load, back, header=True)
        waitFor(lambda: request(gateway.port, "GET", "/ready").status == 200, RECOVERY)
        assert recovered - back < RECOVERY
    # Redis's death never changes an answer: every one is the 501 of a
    # server without providers. The only other answers allowed are svc-auth
    # missing the proxy's validation deadline on a loaded machine (503
    # AUTH_UNAVAILABLE for ValidateAgent, 503 SERVICE_DEGRADED for
    # ValidateToken: failing closed by design, nothing to do with Redis;
    # each seen once in CI-like runs on a busy machine), and rarely.
    answers = [(sample.status, sample.code) for sample in load.samples]
    closed = sum(1 for answer in answers if answer in FAILED_CLOSED)
    assert set(answers) <= {(501, "PROVIDER_NOT_CONFIGURED"), *FAILED_CLOSED}, answers
    assert closed <= len(answers) // 20, answers
    load.assertNoneHung()
    print(
        f"redis killed: {load.summary()}; headers back {recovered - back:.2f} s after restart;"
        f" {closed} validation(s) failed closed"
    )
    assertStillInForce(gateway, credentials)


def test_authKilledFrozenAndRestartedMidLoad(faultyGateway: Gateway) -> None:
    """
    svc-auth frozen (SIGSTOP), then killed (SIGKILL) and restarted, under
    load: while it is away every request fails closed with 503
    SERVICE_DEGRADED (or AUTH_UNAVAILABLE when it vanished between the two
    calls) within the deadlines, /ready says auth_grpc failed within its
    budget; once it is back the proxy recovers by itself within 5 s.
    """
    gateway = faultyGateway
    credentials = credentialsBeforeTheFault(gateway)
    auth = gateway.auth
    assert auth.process is not None
    faultCodes = {"SERVICE_DEGRADED", "AUTH_UNAVAILABLE"}
    with Load(gateway.port, gateway.tenants["main"]) as load:
        waitForSamples(load, 0)

        # Samples count from once every thread is stopped (SIGSTOP lands
        # late on a loaded machine: Daemon.freeze).
        auth.freeze()
        frozen = time.monotonic()
        try:
            took, status, body = timedReady(gateway.port)
            assert status == 503 and took < READY_BUDGET, (took, body)
            checks = body["checks"]
            assert isinstance(checks, dict) and checks["auth_grpc"]["status"] == "failed"
            waitForSamples(load, time.monotonic(), count=20)
        finally:
            auth.thaw()
        thawed = time.monotonic()
        frozenSamples = load.between(frozen + 0.1, thawed)
        assert frozenSamples and {sample.status for sample in frozenSamples} == {503}
        assert {sample.code for sample in frozenSamples} <= faultCodes
        thawRecovery = recoveredAt(load, thawed) - thawed

        killed = time.monotonic()
        auth.signal(signal.SIGKILL)
        auth.process.wait(10)
        took, status, body = timedReady(gateway.port)
        assert status == 503 and took < READY_BUDGET, (took, body)
        waitForSamples(load, time.monotonic(), count=20)
        deadSamples = load.between(killed + 0.1)
        assert {sample.status for sample in deadSamples} == {503}
        assert {sample.code for sample in deadSamples} <= faultCodes

        auth.start()
        auth.waitForReady()
        back = time.monotonic()
        restartRecovery = recoveredAt(load, back) - back
        waitFor(lambda: request(gateway.port, "GET", "/ready").status == 200, RECOVERY)
    assert thawRecovery < RECOVERY and restartRecovery < RECOVERY
    load.assertNoneHung()
    print(
        f"svc-auth faults: {load.summary()}; back {thawRecovery:.2f} s after SIGCONT, "
        f"{restartRecovery:.2f} s after the restarted daemon was ready"
    )
    assertStillInForce(gateway, credentials)


@pytest.fixture
def gatewayOnPrivatePostgres(privatePostgres: PostgresServer, tmp_path: Path) -> Iterator[Gateway]:
    with unlimitedGateway(privatePostgres, tmp_path) as gateway:
        yield gateway


def authReady(gateway: Gateway) -> tuple[float, int, dict[str, object]]:
    started = time.monotonic()
    status, body = gateway.auth.get("/ready", timeout=5)
    return time.monotonic() - started, status, json.loads(body)


def test_postgresStoppedUnderAuthMidLoad(
    privatePostgres: PostgresServer, gatewayOnPrivatePostgres: Gateway
) -> None:
    """
    PostgreSQL stopped under svc-auth, under load: svc-auth's cache may
    answer for the token it knows for at most a second without its change
    listener, then requests fail closed with 503 (Internal from svc-auth);
    a token it never saw fails at once. svc-auth's /ready says postgres
    failed within its budget (the proxy's /ready stays 200: svc-auth itself
    answers). PostgreSQL restarted: service is back within 5 s, for known
    and new tokens, and the revocation made before still holds.
    """
    gateway = gatewayOnPrivatePostgres
    credentials = credentialsBeforeTheFault(gateway)
    with Load(gateway.port, gateway.tenants["main"]) as load:
        waitForSamples(load, 0)
        stopping = time.monotonic()
        privatePostgres.stop()
        stopped = time.monotonic()

        took, status, body = authReady(gateway)
        assert status == 503 and took < READY_BUDGET, (took, body)
        checks = body["checks"]
        assert isinstance(checks, dict) and checks["postgres"]["status"] == "failed"
        assert request(gateway.port, "GET", "/ready").status == 200

        unknownToSvcAuth = chat(gateway.port, credentials.created)
        assert unknownToSvcAuth.status == 503, unknownToSvcAuth.body
        assert unknownToSvcAuth.code in ("SERVICE_DEGRADED", "AUTH_UNAVAILABLE")

        waitFor(
            lambda: time.monotonic() - stopped > 2.0 and len(load.between(stopped + 1.5)) >= 10, 10
        )
        served = [sample for sample in load.between(stopping) if sample.status == 501]
        lastServed = max((sample.started for sample in served), default=stopping)
        # The cache's one second without its listener, plus the listener's
        # time to notice (it polls every 250 ms) and slack.
        assert lastServed - stopped < 1.0 + 0.25 + 0.5, lastServed - stopped
        late = load.between(stopped + 1.75)
        assert late and {sample.status for sample in late} == {503}
        assert {sample.code for sample in late} <= {"SERVICE_DEGRADED", "AUTH_UNAVAILABLE"}

        privatePostgres.start()
        back = time.monotonic()
        recovery = recoveredAt(load, back) - back
        waitFor(lambda: gateway.auth.get("/ready")[0] == 200, RECOVERY)
    assert recovery < RECOVERY
    load.assertNoneHung()
    print(
        f"postgres stopped: {load.summary()}; cached token served until "
        f"{lastServed - stopped:+.2f} s after the stop; back {recovery:.2f} s after the restart"
    )
    assertStillInForce(gateway, credentials)


def test_idleConnectionToProxySurvivesFaults(faultyGateway: Gateway) -> None:
    """
    A client's keep-alive connection opened before svc-auth is killed and
    restarted is still served on the same connection afterwards: the
    faults are answered, not turned into broken connections.
    """
    gateway = faultyGateway
    tenant = gateway.tenants["main"]
    headers = {
        "Authorization": f"Bearer {tenant.token}",
        "X-SVC-Agent-ID": str(tenant.agentID),
        "Content-Type": "application/json",
    }
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=5)
    try:

        def send() -> int:
            connection.request("POST", "/v1/chat/completions", body=body, headers=headers)
            response = connection.getresponse()
            response.read()
            return response.status

        # Served first (its first validation may miss the deadline on a
        # loaded machine: a 503 this test is not about).
        waitFor(lambda: send() == 501, RECOVERY)
        assert gateway.auth.process is not None
        gateway.auth.signal(signal.SIGKILL)
        gateway.auth.process.wait(10)
        assert send() == 503
        gateway.auth.start()
        gateway.auth.waitForReady()
        waitFor(lambda: send() == 501, RECOVERY)
    finally:
        connection.close()
