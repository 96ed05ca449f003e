"""
Models of several deployments through the real gateway (decisions D15):
`twistd -n svc-auth` and `twistd -n svc-proxy` over PostgreSQL and Redis,
forwarding to three scripted upstreams, one per provider (each provider
also under its own base path, so that the path in an upstream's log says
which was asked). What a client sees, at the scale issue 47 names:
8,000 requests split as the weights say (1:1:2, each share within 3% of
itself), a deployment that fails every request costs none of 10,000
requests an error, least_busy and latency routing send a deployment ten
times slower than the others under 10% of 500 requests (weighted
routing, blind to it, a third); then one with no first byte within
C{first_byte_timeout} is left (its connection closed) for the next, a 429
cools its deployment, a stream is retried before its first byte only;
what an operator sees: the C{svc_proxy_deployment_*} series and the
access log's C{deployment} and C{tries}.

The split is exact up to about one try per deployment: weighted routing
picks a request's first deployment by smooth weighted round-robin
(L{svcd.providers.routing}), so the issue's 3% of each share (60 of a
quarter's 2,000) holds whatever the run; a weighted random pick would miss
it about one run in five (its sigma is 39 for a quarter, 45 for the half),
and equal weights by far (2,667 each).

The floods go over many keep-alive connections driven by one selector
(L{svcd.devkit.flood}), so that the 20,000 requests of the module cost the
client little CPU beside the proxy's; every test shares the module's one
stack. Measured on the shared 2-core machine at load 14 to 16: the module
in 185 s, of which the stack's start 35 s, the 8,000 requests 42 s, the
10,000 72 s and the steering tests 25 s; at load 25 to 44 in 243 s (the
floods 67 and 104 s); 55 s of CPU either time.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from authfixtures import Tenant
from forwardingfixtures import FORWARDING_ENVIRONMENT, Metrics
from gatewayfixtures import Answer, Gateway, chat, request, runningGateway

from svcd.devkit.flood import chatRequest, flood
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.upstream.client import RecordedRequest, ScriptedUpstream

pytestmark = pytest.mark.e2e

PROVIDERS = ("a", "b", "c")
SPLIT_REQUESTS = 8_000
# Each share within 3% of itself (issue 47).
SPLIT_TOLERANCE = 0.03
FLAKY_REQUESTS = 10_000
STEERED_REQUESTS = 500
# A whole number of weighted routing's cycles of 3: a third exactly.
BLIND_REQUESTS = 60
# Keep-alive connections of a flood: requests in flight.
FLOOD_CONNECTIONS = 32
# Those of the steering tests: enough that least_busy has something to
# count, few enough that the proxy is far from busy (the time a busy
# proxy takes over each answer is a try's time in flight too, and narrows
# the gap between the fast and the slow).
STEERED_CONNECTIONS = 16
HEAVY = 1_000_000  # a weight that puts its deployment first (1 in a million not)
# Milliseconds to the first byte of the steering tests' deployments: far
# above what a proxy of a loaded machine adds to each try (least_busy gives
# the slow one under 10% while that is under 1.57 FAST: at FAST = 50 a
# proxy at load 18 sent it 17%).
FAST = 200
SLOW = 10 * FAST

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

# The steering tests' models: b ten times slower than a and c to its
# first byte, under each routing.
STEERED = {"least_busy": "steered-least-busy", "latency": "steered-latency", "weighted": "blind"}
MODELS += "".join(
    f"""
[[models]]
name = "{name}"
routing = "{routing}"
deployments = [
    {{ provider = "a", upstream_model = "slow:{FAST}" }},
    {{ provider = "b", upstream_model = "slow:{SLOW}" }},
    {{ provider = "c", upstream_model = "slow:{FAST}" }},
]
"""
    for routing, name in STEERED.items()
)


@attrs.frozen
class Deployed:
    gateway: Gateway
    upstreams: dict[str, ScriptedUpstream]

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

    def flood(self, model: str, count: int, connections: int = FLOOD_CONNECTIONS) -> Counter[int]:
        """
        The statuses of C{count} requests to C{model}, counted, sent over
        C{connections} keep-alive connections; the upstreams' logs emptied
        first, so that L{sentTo} counts the flood's tries.
        """
        for upstream in self.upstreams.values():
            upstream.clearRequests()
        body = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hello there"}]}
        ).encode()
        wire = chatRequest(self.tenant.token, str(self.tenant.agentID), body)
        return flood(self.gateway.port, wire, count, connections, limit=300)

    def served(self, before: Metrics, after: Metrics, model: str) -> dict[str, float]:
        """
        The tries of C{model} each deployment answered between two
        scrapes.
        """
        return {
            name: after.value(
                "svc_proxy_deployment_requests_total", model=model, deployment=name, outcome="ok"
            )
            - before.value(
                "svc_proxy_deployment_requests_total", model=model, deployment=name, outcome="ok"
            )
            for name in PROVIDERS
        }

    def sentTo(self) -> dict[str, int]:
        """
        The tries each upstream has logged since the last L{flood}, by the
        provider it stands for; then its log is emptied, so that the
        module's other tests read short logs.
        """
        counts = {}
        for name, upstream in self.upstreams.items():
            counts[name] = len(upstream.requests())
            upstream.clearRequests()
        return counts

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
                    for upstream in self.upstreams.values()
                    for each in upstream.requests()
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
                # The floods' 20,000 lines are passed over unparsed.
                if line.startswith("{") and requestID in line:
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
    upstreams: dict[str, ScriptedUpstream] = {}

    def prepare(tenants: dict[str, Tenant]) -> dict[str, str]:
        lines = []
        for name, upstream in upstreams.items():
            lines += [
                "[[providers]]",
                f'name = "{name}"',
                f"base_url = {json.dumps(upstream.baseURLUnder(name))}",
                'timeout = "20s"',
                'idle_timeout = "20s"',
                # More than a flood's connections: no try waits for a slot.
                "max_connections = 64",
                "",
            ]
        path = Path(workdir / "providers.toml")
        path.write_text("\n".join(lines) + MODELS)
        return {"SVC_PROVIDERS_FILE": str(path)}

    try:
        for name in PROVIDERS:
            upstreams[name] = ScriptedUpstream(workdir / f"upstream-{name}").start()
        with runningGateway(
            postgresServer, workdir, proxyEnvironment=FORWARDING_ENVIRONMENT, prepare=prepare
        ) as gateway:
            yield Deployed(gateway, upstreams)
    finally:
        for upstream in upstreams.values():
            upstream.stop()


def test_weightedSplit(deployed: Deployed) -> None:
    """
    8,000 requests to deployments weighted 1:1:2 split as the weights say,
    each share within 3% of itself (1,940 to 2,060 of the quarters), every
    one answered, each by one try; the metrics and the upstreams agree,
    and nothing is left in flight.
    """
    before = deployed.metrics()
    statuses = deployed.flood("split", SPLIT_REQUESTS)
    assert statuses == {200: SPLIT_REQUESTS}
    after = deployed.metrics()
    served = deployed.served(before, after, "split")
    for name, share in (("a", 0.25), ("b", 0.25), ("c", 0.5)):
        expected = SPLIT_REQUESTS * share
        assert abs(served[name] - expected) <= SPLIT_TOLERANCE * expected, served
        labels = {"model": "split", "deployment": name}
        assert after.value("svc_proxy_deployment_in_flight", **labels) == 0
    assert deployed.sentTo() == served
    answer = deployed.chat("split")
    requestID = answer.headers["x-request-id"]
    line = deployed.accessLine(requestID)
    sent = deployed.received(requestID, 1)
    assert line["tries"] == 1 and line["deployment"] == providerOf(sent[0])
    assert line["provider"] == providerOf(sent[0]) and line["upstream_model"] == "split"


def test_failingDeploymentCostsNoClientAnError(deployed: Deployed) -> None:
    """
    One deployment of three failing every request: 10,000 requests, not
    one client error; the failing one cooled (cooldown_failures failures)
    and its tries were followed by another deployment's.
    """
    statuses = deployed.flood("flaky", FLAKY_REQUESTS)
    assert statuses == {200: FLAKY_REQUESTS}
    metrics = deployed.metrics()
    labels = {"model": "flaky", "deployment": "a"}
    assert metrics.value("svc_proxy_deployment_requests_total", outcome="ok", **labels) == 0
    failed = metrics.value("svc_proxy_deployment_requests_total", outcome="failed", **labels)
    assert failed >= 3
    assert metrics.value("svc_proxy_deployment_cooldowns_total", reason="failures", **labels) >= 1
    served = sum(
        metrics.value(
            "svc_proxy_deployment_requests_total", model="flaky", deployment=name, outcome="ok"
        )
        for name in ("b", "c")
    )
    assert served == FLAKY_REQUESTS
    sent = deployed.sentTo()
    assert sent["a"] == failed and sent["b"] + sent["c"] == FLAKY_REQUESTS


@pytest.mark.parametrize("routing", ["least_busy", "latency"])
def test_steersAwayFromASlowDeployment(deployed: Deployed, routing: str) -> None:
    """
    One deployment of three ten times slower to its first byte (2 s
    against 200 ms): least_busy and latency routing send it under 10% of
    500 requests, 16 at a time, yet some (it is not failing: least_busy
    keeps about as many tries on it as on the others, about 5% of the
    requests; latency measures it with the first requests, then leaves
    it).
    """
    before = deployed.metrics()
    model = STEERED[routing]
    statuses = deployed.flood(model, STEERED_REQUESTS, STEERED_CONNECTIONS)
    assert statuses == {200: STEERED_REQUESTS}
    served = deployed.served(before, deployed.metrics(), model)
    assert sum(served.values()) == STEERED_REQUESTS
    assert 0 < served["b"] < 0.10 * STEERED_REQUESTS, served
    assert deployed.sentTo() == served


def test_weightedRoutingIsBlindToTheSlowDeployment(deployed: Deployed) -> None:
    """
    The steering tests' deployments under weighted routing: the slow one
    gets its third (20 of 60), so what keeps it under 10% there is the
    routing.
    """
    before = deployed.metrics()
    model = STEERED["weighted"]
    statuses = deployed.flood(model, BLIND_REQUESTS, STEERED_CONNECTIONS)
    assert statuses == {200: BLIND_REQUESTS}
    served = deployed.served(before, deployed.metrics(), model)
    assert served["b"] == BLIND_REQUESTS / 3, served
    assert deployed.sentTo() == served


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
