"""
The forwarder's tries over a model's deployments (decisions D15), with
the scripted upstream (one process standing for several providers, each
under its own prefix, each deployment's script in its upstream model):
the router's plan is followed, each try sends, records and bills its
deployment, a failure before the first byte is followed by the next try,
a 429 and repeated failures cool the deployment, C{first_byte_timeout}
closes a slow try's connection and the next deployment answers, a
stream is retried before its first byte only, and svc-proxy's
C{svc_proxy_deployment_*} series count it all. The router's clock is a
C{task.Clock} (cooldowns pass when the test says), its draws seeded.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from random import Random
from typing import Any

import attrs
import pytest
import pytest_twisted
from prometheus_client import CollectorRegistry
from twisted.internet import task
from twisted.internet.defer import Deferred

from svcd.common.errors import ApiError, ErrorCode
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.limits.reservation import worstCaseCost
from svcd.metering.models import Deployment, Model, Provider
from svcd.metering.prices import Price
from svcd.providers.operations import CHAT_COMPLETIONS
from svcd.providers.records import UpstreamRecord
from svcd.providers.routing import Router, bodyKey
from svcd.providers.upstream import Answer, Forwarder
from svcd.proxy.metrics import ProxyMetrics

CHAT: dict[str, Any] = {
    "model": "pool",
    "messages": [{"role": "user", "content": "Say hello to the world"}],
}
STREAM: dict[str, Any] = {**CHAT, "stream": True}
NAMES = ("a", "b", "c")

pytestmark = pytest.mark.e2e


@attrs.define
class Client:
    status: int | None = None
    written: list[bytes] = attrs.field(factory=list)

    def begin(
        self, status: int, contentType: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> None:
        self.status = status

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def registerProducer(self, producer: Any) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass


@attrs.define
class Harness:
    upstream: ScriptedUpstream
    providers: dict[str, Provider]
    clock: task.Clock
    forwarder: Forwarder
    registry: CollectorRegistry

    def model(self, scripts: Sequence[tuple[str, str, float]], **values: Any) -> Model:
        """
        A model "pool" of deployments (provider name, script, weight).
        """
        deployments = tuple(
            Deployment(self.providers[name], script, weight) for name, script, weight in scripts
        )
        first = deployments[0]
        return Model("pool", first.provider, first.upstreamModel, deployments=deployments, **values)

    async def forward(
        self,
        model: Model | Sequence[Model],
        document: dict[str, Any] = CHAT,
        record: UpstreamRecord | None = None,
        client: Client | None = None,
    ) -> Answer:
        attempts = [model] if isinstance(model, Model) else list(model)
        return await self.forwarder.forward(
            document,
            attempts,
            str(uuid.uuid4()),
            client if client is not None else Client(),
            lambda error: b'data: {"error": "' + error.code.value.encode() + b'"}\n\n',
            record if record is not None else UpstreamRecord(),
        )

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def deploymentOf(self, path: str) -> str:
        """
        Which provider a request went to, by its path's prefix.
        """
        return path.split("/")[1]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedUpstream]:
    started = ScriptedUpstream(Path(tmp_path_factory.mktemp("deployments"))).start()
    yield started
    started.stop()


@pytest.fixture
def harness(upstream: ScriptedUpstream) -> Iterator[Harness]:
    from twisted.internet import reactor

    upstream.clearRequests()
    providers = {
        name: Provider(name, upstream.baseURLUnder(name), timeout=10.0, idleTimeout=10.0)
        for name in NAMES
    }
    registry = CollectorRegistry()
    clock = task.Clock()
    clock.advance(1_700_000_000)
    router = Router(clock, Random(15))
    forwarder = Forwarder(
        reactor, reactor, list(providers.values()), ProxyMetrics(registry), router=router
    )
    yield Harness(upstream, providers, clock, forwarder, registry)
    forwarder.close()


def sleep(seconds: float) -> Deferred[None]:
    from twisted.internet import reactor

    return task.deferLater(reactor, seconds, lambda: None)


@pytest_twisted.ensureDeferred
async def test_weightedSplit(harness: Harness) -> None:
    """
    Requests to a model of deployments weighted 1:1:2 split as the
    weights do; each request names the deployment that answered (its
    provider and upstream model in the record, its name in
    X-SVC-Upstream-Model's model), and goes once.
    N = 400: 100/100/200 exactly (smooth weighted round-robin, at a whole
    number of its cycles of 4).
    """
    model = harness.model([("a", "echo", 1.0), ("b", "echo", 1.0), ("c", "echo", 2.0)])
    count = 400
    seen: Counter[str] = Counter()
    for _ in range(count):
        record = UpstreamRecord()
        answer = await harness.forward(model, record=record)
        assert answer.status == 200 and record.tries == 1
        assert record.deployment == record.provider
        assert record.model == "pool" and record.upstreamModel == "echo"
        seen[record.provider or ""] += 1
    assert seen == {"a": 100, "b": 100, "c": 200}
    for name in ("a", "b", "c"):
        assert harness.sample(
            "svc_proxy_deployment_requests_total", model="pool", deployment=name, outcome="ok"
        ) == float(seen[name])
        assert harness.sample("svc_proxy_deployment_in_flight", model="pool", deployment=name) == 0
    paths = Counter(harness.deploymentOf(request.path) for request in harness.upstream.requests())
    assert paths == seen


@pytest_twisted.ensureDeferred
async def test_failingDeploymentIsRetriedThenCooled(harness: Harness) -> None:
    """
    One deployment of three failing (503) every request: no request fails,
    the failing one is followed by the next try; after cooldown_failures
    (3) failures it cools for the model's cooldown, and is tried again
    once that passed.
    """
    model = harness.model(
        [("a", "status:503", 1.0), ("b", "echo", 1.0), ("c", "echo", 1.0)], cooldown=10.0
    )
    for _ in range(60):
        record = UpstreamRecord()
        answer = await harness.forward(model, record=record)
        assert answer.status == 200 and record.provider in ("b", "c")
    failed = [r for r in harness.upstream.requests() if r.path.startswith("/a/")]
    assert len(failed) == 3
    assert (
        harness.sample(
            "svc_proxy_deployment_requests_total", model="pool", deployment="a", outcome="failed"
        )
        == 3
    )
    assert (
        harness.sample(
            "svc_proxy_deployment_cooldowns_total", model="pool", deployment="a", reason="failures"
        )
        == 1
    )
    harness.clock.advance(11)
    for _ in range(30):
        await harness.forward(model)
    failed = [r for r in harness.upstream.requests() if r.path.startswith("/a/")]
    assert len(failed) > 3


@pytest_twisted.ensureDeferred
async def test_rateLimitedDeploymentCools(harness: Harness) -> None:
    """
    A 429 with Retry-After: 30 cools its deployment for 30 s (on the
    router's clock): the next try answers, and no request goes to it until
    then.
    """
    model = harness.model([("a", "status:429:30", 1.0), ("b", "echo", 1.0)])
    record = UpstreamRecord()
    while record.tries < 2:
        record = UpstreamRecord()
        answer = await harness.forward(model, record=record)
        assert answer.status == 200 and record.deployment == "b"
    assert (
        harness.sample(
            "svc_proxy_deployment_cooldowns_total",
            model="pool",
            deployment="a",
            reason="rate_limited",
        )
        == 1
    )
    harness.upstream.clearRequests()
    for _ in range(20):
        await harness.forward(model)
    assert {harness.deploymentOf(r.path) for r in harness.upstream.requests()} == {"b"}
    harness.clock.advance(29)
    for _ in range(20):
        await harness.forward(model)
    assert {harness.deploymentOf(r.path) for r in harness.upstream.requests()} == {"b"}
    harness.clock.advance(2)
    for _ in range(20):
        await harness.forward(model)
    assert "a" in {harness.deploymentOf(r.path) for r in harness.upstream.requests()}


@pytest_twisted.ensureDeferred
async def test_rejectedIsNotRetried(harness: Harness) -> None:
    """
    A 400 is a refusal of the client's request: no other deployment is
    tried, no cooldown counts it.
    """
    model = harness.model([("a", "status:400", 1e9), ("b", "echo", 1.0)])
    record = UpstreamRecord()
    with pytest.raises(ApiError) as caught:
        await harness.forward(model, record=record)
    assert caught.value.code is ErrorCode.UPSTREAM_REJECTED
    assert record.tries == 1 and record.deployment == "a"
    assert (
        harness.sample(
            "svc_proxy_deployment_requests_total", model="pool", deployment="a", outcome="rejected"
        )
        == 1
    )


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("document", [CHAT, STREAM], ids=["whole", "stream"])
async def test_firstByteTimeout(harness: Harness, document: dict[str, Any]) -> None:
    """
    No first byte within first_byte_timeout (no head at all, or a stream's
    head without its first event): the try is cancelled, the upstream
    sees its connection closed, and the next deployment answers.
    """
    script = "slow:3000" if document is CHAT else "hold:3000"
    model = harness.model([("a", script, 1e9), ("b", "echo", 1.0)], firstByteTimeout=0.3)
    record = UpstreamRecord()
    client = Client()
    answer = await harness.forward(model, document, record=record, client=client)
    assert answer.status == 200 and record.tries == 2 and record.deployment == "b"
    requests = harness.upstream.waitUntilEnded(2, timeout=2.0)
    slow = [r for r in requests if r.path.startswith("/a/")]
    assert len(slow) == 1 and slow[0].outcome == "clientGone"
    assert slow[0].ended is not None and slow[0].ended - slow[0].arrived < 2.0
    assert (
        harness.sample(
            "svc_proxy_upstream_requests_total",
            provider="a",
            model="pool",
            status="first_byte_timeout",
        )
        == 1
    )
    assert (
        harness.sample(
            "svc_proxy_deployment_requests_total", model="pool", deployment="a", outcome="failed"
        )
        == 1
    )


@pytest_twisted.ensureDeferred
async def test_streamRetriedBeforeItsFirstByteOnly(harness: Harness) -> None:
    """
    A stream whose deployment fails before its first event is answered by
    the next; one that breaks after it is not retried (the client had its
    bytes): it ends with the error event, and the deployment failed.
    """
    model = harness.model([("a", "status:503", 1e9), ("b", "echo", 1.0)])
    record = UpstreamRecord()
    client = Client()
    answer = await harness.forward(model, STREAM, record=record, client=client)
    assert answer.streamed and record.tries == 2 and record.deployment == "b"
    assert b"[DONE]" in b"".join(client.written)

    model = harness.model([("a", "close-mid-stream", 1e9), ("b", "echo", 1.0)])
    record = UpstreamRecord()
    client = Client()
    answer = await harness.forward(model, STREAM, record=record, client=client)
    assert answer.streamed and record.tries == 1 and record.deployment == "a"
    assert record.brokenMidStream
    assert b'"error"' in b"".join(client.written)
    assert (
        harness.sample(
            "svc_proxy_deployment_requests_total", model="pool", deployment="a", outcome="broken"
        )
        == 1
    )


@pytest_twisted.ensureDeferred
async def test_clientGoneIsNoFailure(harness: Harness) -> None:
    """
    A client that goes away cancels its try: it ends (not in flight any
    more), and neither counts towards a cooldown nor is followed by
    another try.
    """
    model = harness.model([("a", "slow:3000", 1e9), ("b", "echo", 1.0)], cooldownFailures=1)
    work = Deferred.fromCoroutine(harness.forward(model))
    await sleep(0.2)
    assert harness.sample("svc_proxy_deployment_in_flight", model="pool", deployment="a") == 1
    work.cancel()
    with pytest.raises(Exception):  # noqa: B017 (CancelledError)
        await work
    assert harness.sample("svc_proxy_deployment_in_flight", model="pool", deployment="a") == 0
    assert (
        harness.sample(
            "svc_proxy_deployment_requests_total", model="pool", deployment="a", outcome="cancelled"
        )
        == 1
    )
    assert (
        harness.sample(
            "svc_proxy_deployment_cooldowns_total", model="pool", deployment="a", reason="failures"
        )
        == 0
    )
    harness.upstream.waitUntilEnded(1)
    assert [harness.deploymentOf(r.path) for r in harness.upstream.requests()] == ["a"]


@pytest_twisted.ensureDeferred
async def test_everyTryFails(harness: Harness) -> None:
    """
    Every deployment failing: the request makes one try of each (the
    default max_attempts) and answers as the last failure did.
    """
    model = harness.model([("a", "status:503", 1.0), ("b", "status:502", 1.0)])
    record = UpstreamRecord()
    with pytest.raises(ApiError) as caught:
        await harness.forward(model, record=record)
    assert caught.value.code is ErrorCode.UPSTREAM_ERROR
    assert record.tries == 2
    assert len(harness.upstream.requests()) == 2


def test_worstCaseOverDeployments(harness: Harness) -> None:
    """
    A budget's worst case measures every deployment's body (its own
    upstream model) and takes the largest; the bodies are kept by
    bodyKey, and the forwarder sends each to its own deployment.
    """
    price = Price(input=10**9, output=10**9, cachedInput=10**8)
    model = attrs.evolve(
        harness.model([("a", "echo", 1.0), ("b", "echo" + "+no-usage" * 20, 1.0)]), price=price
    )

    @attrs.frozen
    class Chat:
        document: dict[str, Any]
        messages: list[Any]
        maxTokens: int | None = None
        maxCompletionTokens: int | None = None
        choices: int = 1

    chat = Chat(CHAT, CHAT["messages"])
    bodies: dict[str, bytes] = {}
    cost = worstCaseCost(chat, [model], 50, 50, 0, bodies, CHAT_COMPLETIONS.sendable)
    assert set(bodies) == {"pool", bodyKey(model, 1)} == {"pool", "pool#1"}
    assert json.loads(bodies["pool#1"])["model"] == "echo" + "+no-usage" * 20
    assert (
        cost
        == price.worstCase(len(bodies["pool#1"]), 50)
        > price.worstCase(len(bodies["pool"]), 50)
    )
