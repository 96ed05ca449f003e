"""
The edge's guards of decisions D10 against the real daemons (twistd
svc-proxy and svc-auth, PostgreSQL, Redis):

  - /ready is not an amplifier: a burst of 1,000 concurrent anonymous
    probes costs svc-auth a handful of ValidateToken calls (counted by
    svc-auth itself), while a Redis or svc-auth fault still shows on
    /ready within a second;
  - a hung Redis is cheap: Redis frozen (SIGSTOP) for 5 s under
    concurrent load, requests keep their pace (the circuit breaker skips
    Redis), and limiting is back within about a second of the thaw;
  - chat bodies that cannot be forwarded as standard JSON, other
    spellings of a route, and a 5,000-character method, through the real
    proxy and its real log.

The figures each test measures are printed (run with -s to see them).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import selectors
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from gatewayfixtures import Gateway, assertEnvelope, chat, request, unlimitedGateway, waitFor
from rawhttp import exchange, parsed, rawChat

from svcd.common.readiness import READY_MAX_AGE
from svcd.devkit.postgres import PostgresServer

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

# svc-proxy's readiness checker timeout (spec 4.2).
CHECK_TIMEOUT = 0.5
# A fault shows on /ready at most this long after it happens: a shared
# outcome is at most READY_MAX_AGE old, and the next check takes at most
# CHECK_TIMEOUT to find a hung dependency (decisions D10: "within a
# second").
FAULT_VISIBLE = 1.0
# The breaker: one second open, then a trial under the 100 ms Redis budget.
OPEN_SECONDS = 1.0
REDIS_BUDGET = 0.1
# Scheduling slack on a busy 2-core machine.
SLACK = 0.5


# These tests are not about svc-auth's deadline: on a busy machine a 50 ms
# deadline missed would turn an answer they check into a 503.
AUTH_DEADLINE = {"SVC_AUTH_VALIDATE_TIMEOUT": "1s"}


@pytest.fixture(scope="module")
def gateway(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    with unlimitedGateway(
        postgresServer, tmp_path_factory.mktemp("edge"), **AUTH_DEADLINE
    ) as running:
        yield running


@pytest.fixture
def privateGateway(postgresServer: PostgresServer, tmp_path: Path) -> Iterator[Gateway]:
    """
    A gateway of this test's own, whose Redis and daemons it may freeze.
    """
    with unlimitedGateway(postgresServer, tmp_path, **AUTH_DEADLINE) as running:
        yield running


def validateTokenCalls(gateway: Gateway) -> float:
    """
    The ValidateToken calls svc-auth has answered, every status, from its
    own /metrics.
    """
    status, body = gateway.auth.get("/metrics")
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith("svc_auth_grpc_requests_total{") and 'method="ValidateToken"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def slowerThanRedisBudget(gateway: Gateway) -> float:
    """
    How many requests the proxy took longer than the 100 ms Redis budget
    to answer, by its own clock (svc_proxy_request_duration_seconds): a
    request that waited for a hung Redis is one, while the client's side
    of a busy machine adds nothing.
    """
    status, body = gateway.proxy.get("/metrics")
    assert status == 200
    count = within = None
    for line in body.decode().splitlines():
        if line.startswith("svc_proxy_request_duration_seconds_count "):
            count = float(line.rsplit(" ", 1)[1])
        elif line.startswith('svc_proxy_request_duration_seconds_bucket{le="0.1"} '):
            within = float(line.rsplit(" ", 1)[1])
    assert count is not None and within is not None
    return count - within


def concurrentGets(port: int, target: bytes, count: int, limit: float = 60.0) -> list[int]:
    """
    Open C{count} connections at once, send C{GET target} on each as soon
    as it is connected, and read every answer; the statuses, in no order.
    """
    raw = b"GET " + target + b" HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n"
    selector = selectors.DefaultSelector()
    for _ in range(count):
        connection = socket.socket()
        connection.setblocking(False)
        connection.connect_ex(("127.0.0.1", port))
        selector.register(connection, selectors.EVENT_WRITE, bytearray())
    statuses: list[int] = []
    deadline = time.monotonic() + limit
    while len(statuses) < count:
        assert time.monotonic() < deadline, f"{len(statuses)} of {count} answered"
        for key, events in selector.select(timeout=1.0):
            ready = key.fileobj
            assert isinstance(ready, socket.socket)
            if events & selectors.EVENT_WRITE:
                ready.sendall(raw)
                selector.modify(ready, selectors.EVENT_READ, key.data)
                continue
            chunk = ready.recv(65536)
            if chunk:
                key.data.extend(chunk)
                continue
            selector.unregister(ready)
            ready.close()
            statuses.append(int(bytes(key.data).split(b" ", 2)[1]))
    selector.close()
    return statuses


def readyChecks(port: int) -> tuple[int, dict[str, Any]]:
    answer = request(port, "GET", "/ready", timeout=5.0)
    return answer.status, answer.json()["checks"]


class ReadyPoller:
    """
    A thread asking /ready again and again (as a load balancer or a flood
    would), keeping the shared outcome fresh, and recording when each
    answer began and what it said.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.answers: list[tuple[float, int, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ReadyPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            status, checks = readyChecks(self.port)
            self.answers.append((started, status, checks))
            self._stop.wait(0.01)

    def firstFailure(self, check: str, since: float) -> float | None:
        for started, status, checks in list(self.answers):
            if started >= since and status == 503 and checks[check]["status"] == "failed":
                return started
        return None


# /ready is not an amplifier


def test_readyBurstCostsAHandfulOfCalls(gateway: Gateway) -> None:
    """
    1,000 concurrent /ready probes, every one answered with a report, cost
    svc-auth at most one ValidateToken call per 250 ms of the burst (plus
    the one in flight at its start): a handful, not a thousand. (On a busy
    machine a shared check may miss its 500 ms and answer its probes 503:
    that is a report too.) The burst starts with the shared outcome
    stale, so at least one call is due.
    """
    waitFor(lambda: request(gateway.port, "GET", "/ready").status == 200, 5)
    # Let the outcome that probe left go stale, so the burst must check at
    # least once (a burst shorter than READY_MAX_AGE would otherwise be
    # answered wholly from it, and show nothing).
    time.sleep(READY_MAX_AGE)
    before = validateTokenCalls(gateway)
    began = time.monotonic()
    statuses = concurrentGets(gateway.port, b"/ready", 1000)
    took = time.monotonic() - began
    calls = validateTokenCalls(gateway) - before
    print(
        f"1,000 concurrent /ready probes in {took:.2f} s: {calls:.0f} ValidateToken calls; "
        f"{statuses.count(200)} answered 200, {statuses.count(503)} 503"
    )
    assert set(statuses) <= {200, 503} and len(statuses) == 1000
    assert 1 <= calls <= math.ceil(took / READY_MAX_AGE) + 1


def test_readyShowsARedisFaultWithinASecond(privateGateway: Gateway) -> None:
    """
    With /ready probed without pause (the shared outcome kept fresh),
    Redis killed shows as a failed redis check within a second; back,
    /ready is 200 again by itself.
    """
    gateway = privateGateway
    with ReadyPoller(gateway.port) as poller:
        waitFor(lambda: len(poller.answers) >= 5, 5)
        pid = gateway.redis.pid
        assert pid is not None
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        waitFor(lambda: poller.firstFailure("redis", killed) is not None, FAULT_VISIBLE + SLACK)
        seen = poller.firstFailure("redis", killed)
        assert seen is not None
        gateway.redis.stop()
        gateway.redis.start()
        waitFor(lambda: poller.answers[-1][1] == 200, 10)
    print(f"redis killed: /ready said so {seen - killed:.3f} s later")
    assert seen - killed < FAULT_VISIBLE


def test_readyShowsAFrozenAuthWithinASecond(privateGateway: Gateway) -> None:
    """
    With /ready probed without pause, svc-auth frozen (SIGSTOP: its port
    accepts, nothing answers) shows as a failed auth_grpc check within a
    second, the check's own 500 ms timeout included.
    """
    gateway = privateGateway
    with ReadyPoller(gateway.port) as poller:
        waitFor(lambda: len(poller.answers) >= 5, 5)
        frozen = time.monotonic()
        gateway.auth.freeze()
        try:
            waitFor(
                lambda: poller.firstFailure("auth_grpc", frozen) is not None,
                FAULT_VISIBLE + SLACK,
            )
        finally:
            gateway.auth.thaw()
        seen = poller.firstFailure("auth_grpc", frozen)
        assert seen is not None
        # The answer that said so began at `seen` and took the check's
        # timeout at most: the fault was visible to a probe by then.
        [(_, _, checks)] = [answer for answer in poller.answers if answer[0] == seen]
        visibleAfter = seen - frozen + checks["auth_grpc"]["latency_ms"] / 1000
        waitFor(lambda: poller.answers[-1][1] == 200, 10)
    print(f"svc-auth frozen: /ready said so {visibleAfter:.3f} s later")
    assert visibleAfter < FAULT_VISIBLE + SLACK


# A hung Redis is cheap


@attrs.frozen
class Sample:
    started: float
    took: float
    status: int
    rateLimited: bool


class ConcurrentLoad:
    """
    C{workers} threads sending chat requests back to back for C{tenant},
    each on its own keep-alive connection, until stopped.
    """

    def __init__(self, gateway: Gateway, tenant: str, workers: int, limit: float = 60) -> None:
        self.gateway = gateway
        self.tenant = gateway.tenants[tenant]
        self.limit = limit
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def __enter__(self) -> ConcurrentLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _run(self) -> None:
        headers = {
            "Authorization": f"Bearer {self.tenant.token}",
            "X-SVC-Agent-ID": str(self.tenant.agentID),
            "Content-Type": "application/json",
        }
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        connection = http.client.HTTPConnection("127.0.0.1", self.gateway.port, timeout=10)
        began = time.monotonic()
        try:
            while not self._stop.is_set() and time.monotonic() - began < self.limit:
                started = time.monotonic()
                connection.request("POST", "/v1/chat/completions", body=body, headers=headers)
                response = connection.getresponse()
                response.read()
                sample = Sample(
                    started,
                    time.monotonic() - started,
                    response.status,
                    response.getheader("X-RateLimit-Limit") is not None,
                )
                with self._lock:
                    self.samples.append(sample)
        finally:
            connection.close()

    def between(self, start: float, end: float = math.inf) -> list[Sample]:
        with self._lock:
            return [sample for sample in self.samples if start <= sample.started < end]

    def rate(self, start: float, end: float) -> float:
        return len(self.between(start, end)) / (end - start)


# Throughput during the stall is judged against throughput before it: with
# pytest-xdist's workers this test runs last and alone (tests/conftest.py).
@pytest.mark.serial
def test_frozenRedisUnderLoad(privateGateway: Gateway) -> None:
    """
    Redis frozen (SIGSTOP) for 5 s under 16 concurrent clients: every
    request is still answered 501 (fail open), and the breaker keeps the
    cost of the stall to one 100 ms Redis deadline per second (plus the
    requests in flight when it began): throughput holds and the proxy
    answers most requests faster than that deadline, where before it
    answered every one slower (throughput fell to a third). /ready still says redis failed (the
    breaker does not hide it). After the thaw, X-RateLimit-* are back on
    every answer within the breaker's second plus one deadline, and an
    organization over its limit gets 429 again.
    """
    gateway = privateGateway
    workers = 16
    with ConcurrentLoad(gateway, "main", workers) as load:
        waitFor(lambda: len(load.samples) >= 50, 10)
        warm = time.monotonic()
        slowAtWarm = slowerThanRedisBudget(gateway)
        time.sleep(2)
        frozenAt = time.monotonic()
        slowAtFreeze = slowerThanRedisBudget(gateway)
        gateway.redis.freeze()
        try:
            time.sleep(1)
            status, checks = readyChecks(gateway.port)
            assert status == 503 and checks["redis"]["status"] == "failed", checks
            time.sleep(4)
        finally:
            thawedAt = time.monotonic()
            # The /ready above waited its 500 ms: one slow answer that is
            # not a chat request.
            slowDuring = slowerThanRedisBudget(gateway) - slowAtFreeze - 1
            gateway.redis.thaw()
        waitFor(
            lambda: (
                len(load.between(thawedAt)) >= 20
                and all(sample.rateLimited for sample in load.between(thawedAt)[-10:])
            ),
            10,
        )
        backAt = min(
            sample.started
            for sample in load.between(thawedAt)
            if all(later.rateLimited for later in load.between(sample.started))
        )
        time.sleep(max(0.0, backAt + 2 - time.monotonic()))
        end = time.monotonic()

    before = load.rate(warm, frozenAt)
    during = load.rate(frozenAt, thawedAt)
    after = load.rate(backAt, end)

    stalled = load.between(frozenAt, thawedAt)
    slowBefore = slowAtFreeze - slowAtWarm
    tookBefore = sorted(sample.took for sample in load.between(warm, frozenAt))
    tookDuring = sorted(sample.took for sample in stalled)
    print(
        f"Redis frozen {thawedAt - frozenAt:.1f} s under {workers} clients: "
        f"{before:.0f} requests/s before, {during:.0f} during, {after:.0f} after; "
        f"p50 {tookBefore[len(tookBefore) // 2] * 1000:.1f} ms before, "
        f"{tookDuring[len(tookDuring) // 2] * 1000:.1f} ms during; requests the proxy took "
        f"over 100 ms to answer: {slowBefore:.0f} in the 2 s before, {slowDuring:.0f} of "
        f"{len(stalled)} during; limiting back {backAt - thawedAt:.2f} s after the thaw"
    )
    assert {sample.status for sample in load.samples} == {501}
    # Without the breaker the proxy answered every request of the stall
    # after the deadline (97% to 100% measured, against 0% to 32% before
    # the freeze). With it: the requests in flight at the freeze (one per
    # client), one trial per second, and what a busy machine makes slow
    # anyway, as before the freeze (clusters of requests sharing a
    # ValidateToken call that took 100 ms). Measured under two busy loops
    # on a machine shared with other test runs: 0% to 11% before the
    # freeze, 1% to 35% during; 55% and 45% when the machine was busier
    # still. Judged as a share above the one before the freeze.
    shareBefore = slowBefore / max(1, len(load.between(warm, frozenAt)))
    assert slowDuring / len(stalled) < shareBefore + 0.4, (slowBefore, slowDuring, len(stalled))
    assert during >= before / 2, (before, during)
    assert backAt - thawedAt < OPEN_SECONDS + REDIS_BUDGET + SLACK

    # Limiting, not just the headers: the organization limited to 3 a
    # minute reaches 429.
    limited = gateway.tenants["limited"]
    statuses = [chat(gateway.port, limited).status for _ in range(4)]
    assert 429 in statuses, statuses


# Bad input through the real daemons


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999999}',
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": [{"a": -1E400}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "t": {"\\udfff": 1}}',
    ],
    ids=["infinite", "nested-infinite", "lone-surrogate", "surrogate-key"],
)
def test_unforwardableJSONIsInvalidJSON(gateway: Gateway, body: bytes) -> None:
    """
    A number that overflows a double or a lone surrogate, anywhere in a
    chat body, is 400 INVALID_JSON from the real proxy.
    """
    received, _ = exchange(gateway.port, rawChat(gateway, body))
    assertEnvelope(parsed(received), 400, "INVALID_JSON")


def test_pairedSurrogatesStillServed(gateway: Gateway) -> None:
    """
    An escaped surrogate pair (an emoji, as json.dumps writes it) is
    standard JSON: served as before.
    """
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "\U0001f600"}]})
    assert b"\\ud83d" in body.encode()
    received, _ = exchange(gateway.port, rawChat(gateway, body.encode()))
    assertEnvelope(parsed(received), 501, "PROVIDER_NOT_CONFIGURED")


@pytest.mark.parametrize(
    "target",
    [b"//v1/internal/auth-probe", b"/v1/internal/auth%2Dprobe", b"/v1%2Finternal%2Fauth-probe"],
)
def test_otherSpellingsAreNotFound(gateway: Gateway, target: bytes) -> None:
    """
    The spellings that reached the auth probe before decisions D10 are 404
    NOT_FOUND from the real proxy, with valid credentials; the canonical
    path still answers 200.
    """
    tenant = gateway.tenants["main"]
    credentials = (
        f"Authorization: Bearer {tenant.token}\r\nX-SVC-Agent-ID: {tenant.agentID}\r\n"
    ).encode()
    head = b" HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n" + credentials + b"\r\n"
    received, _ = exchange(gateway.port, b"GET " + target + head)
    assertEnvelope(parsed(received), 404, "NOT_FOUND")
    received, _ = exchange(gateway.port, b"GET /v1/internal/auth-probe" + head)
    assert parsed(received).status == 200


def test_longMethodInTheDaemonsLog(gateway: Gateway) -> None:
    """
    A 5,000-character method reaches the proxy's log file as OTHER, and no
    line of the log holds it.
    """
    method = b"Y" * 5000
    received, _ = exchange(
        gateway.port, method + b" /health HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n"
    )
    assert parsed(received).status == 405
    requestID = parsed(received).headers["x-request-id"]

    def accessLine() -> dict[str, Any] | None:
        for line in gateway.proxy.output().splitlines():
            if requestID in line and line.startswith("{"):
                document: dict[str, Any] = json.loads(line)
                if "route" in document:
                    return document
        return None

    waitFor(lambda: accessLine() is not None, 5)
    line = accessLine()
    assert line is not None and line["method"] == "OTHER" and line["path"] == "/health"
    assert "Y" * 100 not in gateway.proxy.output()
