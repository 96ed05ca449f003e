"""
Models of several deployments through the real gateway (decisions D15):
`twistd -n svc-auth` and `twistd -n svc-proxy` over PostgreSQL and Redis,
forwarding to one scripted upstream that stands for three providers (each
under its own base path; the path in the upstream's log says which was
asked). What a client sees: requests split as the weights say, a
deployment that fails every request costs no client an error, one with
no first byte within C{first_byte_timeout} is left (its connection
closed) for the next, a 429 cools its deployment, a stream is retried
before its first byte only; what an operator sees: the
C{svc_proxy_deployment_*} series and the access log's C{deployment} and
C{tries}.

The split is checked with N = 2,000 requests against each deployment's
binomial expectation within 5 sigma (sigma = sqrt(N p (1 - p)): 19.4 for
a share of 1/4, 22.4 for 1/2): a fair run falls outside with a chance
under 1e-6 per share.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest
from authfixtures import Tenant
from forwardingfixtures import FORWARDING_ENVIRONMENT, Metrics
from gatewayfixtures import Answer, Gateway, chat, request, runningGateway

from svcd.devkit.postgres import PostgresServer
from svcd.devkit.upstream.client import RecordedRequest, ScriptedUpstream

pytestmark = pytest.mark.e2e

SPLIT_REQUESTS = 2_000
FLAKY_REQUESTS = 1_000
SIGMAS = 5.0
# Concurrent clients: enough to keep both cores busy.
CLIENTS = 8
HEAVY = 1_000_000  # a weight that puts its deployment first (1 in a million not)

MODELS = """
[[models]]
name = "split"
deployments = [{ provider = "a" }, { provider = "b" }, { provider = "c", weight = 2 }]

[[models]]
name = "flaky"
deployments = [
    { provider = "a", upstream_model = "status:503" },
    { provider = "b" },
    { provider = "c" },
]

[[models]]
name = "slowfirst"
first_byte_timeout = "300ms"
deployments = [
    { provider = "a", upstream_model = "slow:5000", weight = HEAVY },
    { provider = "b" },
]

[[models]]
name = "heldfirst"
first_byte_timeout = "300ms"
deployments = [
    { provider = "a", upstream_model = "hold:5000", weight = HEAVY },
    { provider = "b" },
]

[[models]]
name = "limited"
deployments = [
    { provider = "a", upstream_model = "status:429:30", weight = HEAVY },
    { provider = "b" },
]

[[models]]
name = "failsfirst"
deployments = [
    { provider = "a", upstream_model = "status:503", weight = HEAVY },
    { provider = "b" },
]

[[models]]
name = "breaks"
deployments = [
    { provider = "a", upstream_model = "close-mid-stream", weight = HEAVY },
    { provider = "b" },
]
""".replace("HEAVY", str(HEAVY))


@attrs.frozen
class Deployed:
    gateway: Gateway
    upstream: ScriptedUpstream

    @property
    def tenant(self) -> Tenant:
        return self.gateway.tenants["main"]

    def chat(self, model: str, stream: bool = False) -> Answer:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": "hello there"}],
        }
        if stream:
            body["stream"] = True
        return chat(self.gateway.port, self.tenant, body=json.dumps(body).encode())

    def many(self, model: str, count: int) -> list[int]:
        """
        The statuses of C{count} requests to C{model}, CLIENTS at a time.
        """
        with ThreadPoolExecutor(CLIENTS) as pool:
            return list(pool.map(lambda _: self.chat(model).status, range(count)))

    def metrics(self) -> Metrics:
        answer = request(self.gateway.port, "GET", "/metrics")
        assert answer.status == 200
        return Metrics.parse(answer.body.decode())

    def received(self, requestID: str, count: int, timeout: float = 10.0) -> list[RecordedRequest]:
        """
        The upstream's requests for the gateway's C{requestID}, once
        C{count} have ended.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = sorted(
                (
                    each
                    for each in self.upstream.requests()
                    if each.header("x-request-id") == requestID
                ),
                key=lambda each: each.arrived,
            )
            if len(found) >= count and all(each.ended is not None for each in found):
                return found
            assert time.monotonic() < deadline, found
            time.sleep(0.02)

    def accessLine(self, requestID: str, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.gateway.proxy.output().splitlines():
                if line.startswith("{"):
                    parsed: dict[str, Any] = json.loads(line)
                    if parsed.get("request_id") == requestID and "route" in parsed:
                        return parsed
            assert time.monotonic() < deadline, f"no access-log line for {requestID}"
            time.sleep(0.05)


def providerOf(each: RecordedRequest) -> str:
    return each.path.split("/")[1]


@pytest.fixture(scope="module")
def deployed(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployed]:
    workdir = tmp_path_factory.mktemp("deployments")
    upstream = ScriptedUpstream(workdir / "upstream").start()

    def prepare(tenants: dict[str, Tenant]) -> dict[str, str]:
        lines = []
        for name in ("a", "b", "c"):
            lines += [
                "[[providers]]",
                f'name = "{name}"',
                f"base_url = {json.dumps(upstream.baseURLUnder(name))}",
                'timeout = "20s"',
                'idle_timeout = "20s"',
                "",
            ]
        path = Path(workdir / "providers.toml")
        path.write_text("\n".join(lines) + MODELS)
        return {"SVC_PROVIDERS_FILE": str(path)}

    try:
        with runningGateway(
            postgresServer, workdir, proxyEnvironment=FORWARDING_ENVIRONMENT, prepare=prepare
        ) as gateway:
            yield Deployed(gateway, upstream)
    finally:
        upstream.stop()


def test_weightedSplit(deployed: Deployed) -> None:
    """
    2,000 requests to deployments weighted 1:1:2 split as the weights say
    (each share within 5 sigma of its expectation), every one answered,
    each by one try; the metrics and the upstream agree, and nothing is
    left in flight.
    """
    before = deployed.metrics()
    statuses = deployed.many("split", SPLIT_REQUESTS)
    assert set(statuses) == {200}
    after = deployed.metrics()
    for name, share in (("a", 0.25), ("b", 0.25), ("c", 0.5)):
        labels = {"model": "split", "deployment": name}
        served = after.value(
            "svc_proxy_deployment_requests_total", outcome="ok", **labels
        ) - before.value("svc_proxy_deployment_requests_total", outcome="ok", **labels)
        sigma = (SPLIT_REQUESTS * share * (1 - share)) ** 0.5
        assert abs(served - SPLIT_REQUESTS * share) <= SIGMAS * sigma, (name, served)
        assert after.value("svc_proxy_deployment_in_flight", **labels) == 0
    answer = deployed.chat("split")
    requestID = answer.headers["x-request-id"]
    line = deployed.accessLine(requestID)
    sent = deployed.received(requestID, 1)
    assert line["tries"] == 1 and line["deployment"] == providerOf(sent[0])
    assert line["provider"] == providerOf(sent[0]) and line["upstream_model"] == "split"


def test_failingDeploymentCostsNoClientAnError(deployed: Deployed) -> None:
    """
    One deployment of three failing every request: 1,000 requests, not one
    client error; the failing one cooled (cooldown_failures failures) and
    its tries were followed by another deployment's.
    """
    statuses = deployed.many("flaky", FLAKY_REQUESTS)
    assert statuses.count(200) == FLAKY_REQUESTS, sorted(set(statuses))
    metrics = deployed.metrics()
    labels = {"model": "flaky", "deployment": "a"}
    assert metrics.value("svc_proxy_deployment_requests_total", outcome="ok", **labels) == 0
    assert metrics.value("svc_proxy_deployment_requests_total", outcome="failed", **labels) >= 3
    assert metrics.value("svc_proxy_deployment_cooldowns_total", reason="failures", **labels) >= 1
    served = sum(
        metrics.value(
            "svc_proxy_deployment_requests_total", model="flaky", deployment=name, outcome="ok"
        )
        for name in ("b", "c")
    )
    assert served == FLAKY_REQUESTS


@pytest.mark.parametrize(("model", "stream"), [("slowfirst", False), ("heldfirst", True)])
def test_firstByteTimeout(deployed: Deployed, model: str, stream: bool) -> None:
    """
    No first byte within first_byte_timeout (300 ms; no head at all, or a
    stream's head without its first event): the slow upstream sees its
    connection closed at once, and the next deployment answers.
    """
    began = time.monotonic()
    answer = deployed.chat(model, stream)
    assert answer.status == 200, answer.body
    assert time.monotonic() - began < 4.0
    if stream:
        assert b"[DONE]" in answer.body
    requestID = answer.headers["x-request-id"]
    slow, answered = deployed.received(requestID, 2)
    assert (providerOf(slow), providerOf(answered)) == ("a", "b")
    assert slow.outcome == "clientGone"
    assert slow.ended is not None and slow.ended - slow.arrived < 3.0
    line = deployed.accessLine(requestID)
    assert (line["deployment"], line["tries"]) == ("b", 2)
    metrics = deployed.metrics()
    assert (
        metrics.value(
            "svc_proxy_upstream_requests_total",
            provider="a",
            model=model,
            status="first_byte_timeout",
        )
        >= 1
    )


def test_rateLimitedDeploymentCools(deployed: Deployed) -> None:
    """
    A 429 with Retry-After: 30 cools its deployment: the request is
    answered by the next, and the requests that follow do not go to it.
    """
    answer = deployed.chat("limited")
    assert answer.status == 200
    requestID = answer.headers["x-request-id"]
    assert [providerOf(each) for each in deployed.received(requestID, 2)] == ["a", "b"]
    statuses = [deployed.chat("limited") for _ in range(20)]
    assert {each.status for each in statuses} == {200}
    for each in statuses:
        sent = deployed.received(each.headers["x-request-id"], 1)
        assert [providerOf(one) for one in sent] == ["b"]
    metrics = deployed.metrics()
    assert (
        metrics.value(
            "svc_proxy_deployment_cooldowns_total",
            model="limited",
            deployment="a",
            reason="rate_limited",
        )
        == 1
    )


def test_streamRetriedBeforeItsFirstByteOnly(deployed: Deployed) -> None:
    """
    A stream whose deployment fails before its first event is answered by
    the next deployment; one whose deployment breaks after it is not
    retried: the client's stream ends with an error event.
    """
    answer = deployed.chat("failsfirst", stream=True)
    assert answer.status == 200 and b"[DONE]" in answer.body
    requestID = answer.headers["x-request-id"]
    assert [providerOf(each) for each in deployed.received(requestID, 2)] == ["a", "b"]

    answer = deployed.chat("breaks", stream=True)
    assert answer.status == 200 and b'"error"' in answer.body
    requestID = answer.headers["x-request-id"]
    assert [providerOf(each) for each in deployed.received(requestID, 1)] == ["a"]
    time.sleep(0.3)
    assert len(deployed.received(requestID, 1)) == 1
    line = deployed.accessLine(requestID)
    assert (line["deployment"], line["tries"]) == ("a", 1)
