"""
L{svcd.common.opsweb}, the operations routes of every daemon but the
proxy, in memory: the Klein resource behind StubTreq, checks that the
test answers, and a fake clock.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs
import pytest
import pytest_twisted
from prometheus_client import CollectorRegistry, Counter
from treq.testing import StubTreq
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

from svcd.common.metrics import CONTENT_TYPE
from svcd.common.opsweb import OperationsWeb
from svcd.common.readiness import READY_MAX_AGE, Check, CheckFailed, SharedReadiness


@attrs.define
class Probe:
    """
    A readiness check the test answers: each run appends a Deferred to
    C{pending}, unless C{outcome} answers it at once.
    """

    outcome: Exception | str | None = "held"
    pending: list[Deferred[None]] = attrs.field(factory=list)
    runs: int = 0

    def __call__(self) -> Deferred[None]:
        self.runs += 1
        if self.outcome == "held":
            held: Deferred[None] = Deferred()
            self.pending.append(held)
            return held
        if isinstance(self.outcome, Exception):
            return fail(self.outcome)
        return succeed(None)


@attrs.define
class Harness:
    clock: Clock
    registry: CollectorRegistry
    web: OperationsWeb
    stub: StubTreq

    async def get(self, path: str, method: str = "GET") -> tuple[Any, bytes]:
        # StubTreq sets request() and the others in its __init__ (setattr
        # over treq.__all__); treq's types do not declare them.
        response = await self.stub.request(  # type: ignore[attr-defined]
            method, "http://ops.test" + path
        )
        return response, await response.content()


def harness(*checks: Check) -> Harness:
    clock = Clock()
    registry = CollectorRegistry()
    web = OperationsWeb(clock, checks, registry)
    return Harness(clock, registry, web, StubTreq(web.resource()))


def contentType(response: Any) -> bytes:
    [value] = response.headers.getRawHeaders(b"Content-Type")
    assert isinstance(value, bytes)
    return value


@pytest_twisted.ensureDeferred
async def test_healthAnswersWithoutChecking() -> None:
    """
    GET /health is 200 with the fixed body, and runs no check.
    """
    probe = Probe()
    ops = harness(Check("postgres", probe))
    response, body = await ops.get("/health")
    assert (response.code, body) == (200, b'{"status":"ok","checks":{}}')
    assert contentType(response) == b"application/json"
    assert probe.runs == 0


@pytest_twisted.ensureDeferred
async def test_readyOK() -> None:
    """
    GET /ready is 200 ok, each check with its latency, when every check
    passes.
    """
    ops = harness(Check("postgres", Probe(None)), Check("grpc", Probe(None)))
    response, body = await ops.get("/ready")
    assert response.code == 200
    assert contentType(response) == b"application/json"
    assert body == (
        b'{"status":"ok","checks":{"postgres":{"status":"ok","latency_ms":0.0},'
        b'"grpc":{"status":"ok","latency_ms":0.0}}}'
    )


@pytest_twisted.ensureDeferred
async def test_failingCheckIs503WithTheSameReport() -> None:
    """
    A failing critical check makes /ready 503 unhealthy, in the compact
    JSON svc-auth has always answered (non-ASCII escaped), naming the check
    and its message.
    """
    ops = harness(
        Check("postgres", Probe(CheckFailed("base arrêtée"))),
        Check("grpc", Probe(None)),
    )
    response, body = await ops.get("/ready")
    assert response.code == 503
    assert contentType(response) == b"application/json"
    assert body == (
        b'{"status":"unhealthy","checks":{"postgres":{"status":"failed","latency_ms":0.0,'
        b'"message":"base arr\\u00eat\\u00e9e"},"grpc":{"status":"ok","latency_ms":0.0}}}'
    )


@pytest_twisted.ensureDeferred
async def test_concurrentProbesShareOneRun() -> None:
    """
    A hundred probes at once run each check once: they all wait on the
    run in flight and are answered by it.
    """
    probe = Probe()
    ops = harness(Check("postgres", probe))
    waiting = [Deferred.fromCoroutine(ops.get("/ready")) for _ in range(100)]
    assert probe.runs == 1
    probe.pending[0].callback(None)
    ops.stub.flush()
    answers = [await answer for answer in waiting]
    assert {(response.code, body) for response, body in answers} == {
        (200, b'{"status":"ok","checks":{"postgres":{"status":"ok","latency_ms":0.0}}}')
    }
    assert probe.runs == 1 and ops.web.readiness.calls == 1


@pytest_twisted.ensureDeferred
async def test_probesWithinMaxAgeReuseTheReport() -> None:
    """
    Probes less than 250 ms after the start of a run get its report,
    failure included; the first probe after that runs the checks again.
    """
    probe = Probe(CheckFailed("down"))
    ops = harness(Check("postgres", probe))
    for _ in range(10):
        response, _ = await ops.get("/ready")
        assert response.code == 503
        ops.clock.advance(READY_MAX_AGE / 20)
    assert probe.runs == 1
    ops.clock.advance(READY_MAX_AGE)
    probe.outcome = None
    response, _ = await ops.get("/ready")
    assert response.code == 200 and probe.runs == 2


@pytest_twisted.ensureDeferred
async def test_hungCheckTimesOutOnce() -> None:
    """
    A check that never answers fails after its 500 ms, for every probe
    that waited on it, at the cost of one run.
    """
    probe = Probe()
    ops = harness(Check("grpc", probe))
    waiting = [Deferred.fromCoroutine(ops.get("/ready")) for _ in range(5)]
    ops.clock.advance(0.5)
    ops.stub.flush()
    for answer in waiting:
        response, body = await answer
        assert response.code == 503
        assert json.loads(body)["checks"]["grpc"]["message"] == "timed out after 500 ms"
    assert probe.runs == 1


@pytest_twisted.ensureDeferred
async def test_metricsExposesTheRegistry() -> None:
    """
    GET /metrics is the Prometheus exposition of the given registry.
    """
    ops = harness()
    Counter("svc_test_things", "Things", registry=ops.registry).inc(3)
    response, body = await ops.get("/metrics")
    assert response.code == 200
    assert contentType(response) == CONTENT_TYPE.encode("ascii")
    assert b"svc_test_things_total 3.0" in body


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [("GET", "/nope", 404, "NOT_FOUND"), ("POST", "/health", 405, "METHOD_NOT_ALLOWED")],
)
@pytest_twisted.ensureDeferred
async def test_errorsUseTheEnvelope(method: str, path: str, status: int, code: str) -> None:
    """
    An unknown path and a wrong method answer the proxy's error envelope,
    its request_id also in X-Request-ID.
    """
    ops = harness()
    response, body = await ops.get(path, method)
    error = json.loads(body)["error"]
    assert (response.code, error["code"]) == (status, code)
    assert contentType(response) == b"application/json"
    assert [error["request_id"].encode()] == response.headers.getRawHeaders(b"X-Request-ID")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", error["timestamp"])


def test_sharedReadinessEncodesOncePerRun() -> None:
    """
    L{SharedReadiness} encodes the report once per run, with the encoder
    it is given (the proxy's keeps non-ASCII characters as they are).
    """
    encoded: list[object] = []

    def encode(document: object) -> bytes:
        encoded.append(document)
        return json.dumps(document, ensure_ascii=False).encode("utf-8")

    clock = Clock()
    readiness = SharedReadiness([Check("redis", Probe(CheckFailed("é")))], clock, encode=encode)
    reports = [readiness.get() for _ in range(3)]
    results = [report.result for report in reports]
    assert results == [results[0]] * 3
    first = results[0]
    assert isinstance(first, tuple)
    status, body = first
    assert status == 503 and "é".encode() in body
    assert len(encoded) == 1 and readiness.calls == 1
