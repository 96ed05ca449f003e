"""
POST /v1/embeddings at the proxy's edge (decisions D13), in one process: a
real svc-proxy site on a loopback port with the in-memory auth client,
counters and ledger (which records the rows the proxy sends), forwarding
to the scripted upstream process. What is forwarded and relayed (vectors
as the provider gave them, float or base64), what is refused and never
forwarded (the body's rules, a model of the other kind, the permission,
NO_PRICE, dimensions past the model's), fallbacks and faults, what a
request reserves (the inputs' estimate; under a budget, its worst case)
and settles (the provider's prompt tokens), and the one row of kind
embedding it records. The same with the daemons and the openai SDK is
tests/test_gateway_embeddings.py.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_twisted
import treq
from proxydoubles import FakeAuthClient, MemoryCounters, MemoryLedger
from twisted.internet.defer import succeed
from twisted.internet.task import deferLater
from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from upstreamfixtures import clearedUpstream
from zope.interface import provider

from svcd.common.permissions import Permission
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.devkit.upstream.content import DEFAULT_EMBEDDING_DIMENSIONS, embeddingOf
from svcd.limits.book import BudgetRow, LimitBook, LimitsRow
from svcd.limits.limiter import RedisRateLimiter
from svcd.limits.records import Budget, Limits
from svcd.limits.reservation import inputsEstimate
from svcd.providers.providersfile import providersFromEnvironment
from svcd.providers.upstream import Forwarder
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.site import ProxySite
from svcd.proxy.metrics import ProxyMetrics

# Starts the scripted upstream process (conftest.py, pytest.ini): left out
# of a quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e


@pytest.fixture
def scriptedUpstream(moduleUpstream: ScriptedUpstream) -> ScriptedUpstream:
    """
    The module's one scripted upstream (upstreamfixtures.py), its log of
    requests emptied: the tests read only their own requests, and one
    upstream per test was most of the module's time.
    """
    return clearedUpstream(moduleUpstream)


BOTH = Permission.ProxyChatCompletion | Permission.ProxyEmbeddings

PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[providers]]
name = "other"
base_url = "{other}"

[[models]]
name = "chat"
provider = "scripted"
upstream_model = "echo"

[[models]]
name = "embed"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
dimensions = 64

[[models]]
name = "embed-small"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
dimensions = 16

[[models]]
name = "embed-priced"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
price = {{ input = "0.02" }}
fallbacks = ["embed-dear"]

[[models]]
name = "embed-dear"
provider = "other"
upstream_model = "echo-dear"
kind = "embedding"
price = {{ input = "0.13" }}

[[models]]
name = "embed-at-cap"
provider = "scripted"
upstream_model = "usage-at-cap"
kind = "embedding"
price = {{ input = "0.13" }}

[[models]]
name = "embed-failing"
provider = "scripted"
upstream_model = "status:503"
kind = "embedding"
fallbacks = ["embed-spare"]

[[models]]
name = "embed-spare"
provider = "other"
upstream_model = "echo"
kind = "embedding"

[[models]]
name = "embed-rejected"
provider = "scripted"
upstream_model = "status:400"
kind = "embedding"
fallbacks = ["embed-spare"]

[[models]]
name = "embed-limited"
provider = "scripted"
upstream_model = "status:429"
kind = "embedding"

[[models]]
name = "embed-no-usage"
provider = "scripted"
upstream_model = "no-usage"
kind = "embedding"
"""


async def waitFor(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    from twisted.internet import reactor

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {seconds} s")
        await deferLater(reactor, 0.02, lambda: None)


@attrs.define
class Edge:
    port: int
    auth: FakeAuthClient
    counters: MemoryCounters
    book: LimitBook
    metrics: ProxyMetrics
    token: str
    orgID: str
    agentID: str
    ledger: MemoryLedger
    upstream: ScriptedUpstream
    # What each call of the limiter's hit() was asked to reserve.
    reserved: list[tuple[int, int]]

    def headers(self, token: str | None = None) -> dict[bytes | str, bytes | str]:
        return {
            "Authorization": "Bearer " + (token or self.token),
            "X-SVC-Agent-ID": self.agentID,
            "Content-Type": "application/json",
        }

    def limit(self, org: Limits | None = None, orgBudget: Budget | None = None) -> None:
        self.book.replace(
            [LimitsRow(self.orgID, None, org), BudgetRow(self.orgID, None, orgBudget)]
        )

    def spent(self) -> int:
        return sum(
            count for key, count in self.counters.counts.items() if key.startswith("budget:")
        )

    def tokensCounted(self) -> int:
        return sum(count for key, count in self.counters.counts.items() if key.endswith(":tokens"))

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def post(
        self,
        path: str,
        body: bytes,
        token: str | None = None,
        headers: dict[bytes | str, bytes | str] | None = None,
    ) -> tuple[Any, Any]:
        response = await treq.post(
            f"http://127.0.0.1:{self.port}{path}",
            body,
            headers={**self.headers(token), **(headers or {})},
        )
        content = await response.content()
        return response, json.loads(content)

    async def embed(self, model: str = "embed", **fields: Any) -> tuple[Any, Any]:
        document = {"model": model, "input": ["the cat sat", "the cat ran"], **fields}
        return await self.post("/v1/embeddings", json.dumps(document).encode())


@pytest_twisted.async_yield_fixture
async def edge(tmp_path: Path, scriptedUpstream: ScriptedUpstream) -> AsyncIterator[Edge]:
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ServerEndpoint

    providersFile = tmp_path / "providers.toml"
    providersFile.write_text(
        PROVIDERS.format(
            base=scriptedUpstream.baseURL, other=scriptedUpstream.baseURLUnder("other")
        )
    )
    providers = providersFromEnvironment({"SVC_PROVIDERS_FILE": str(providersFile)}, time.time)
    assert providers is not None
    config = ProxyConfig(authGrpcAddr="auth.test:9091", providers=providers)
    auth = FakeAuthClient()
    token, orgID, agentID = auth.addTenant(permissions=BOTH)
    counters = MemoryCounters()
    book = LimitBook()
    metrics = ProxyMetrics()
    limiter = RedisRateLimiter(
        counters, reactor, config.defaultRPM, book=book, spend=lambda *_: succeed(0)
    )
    reserved: list[tuple[int, int]] = []
    hit = limiter.hit

    async def spiedHit(
        orgID: str,
        agentID: str | None,
        tokens: int = 0,
        cost: int = 0,
        ledgerID: str | None = None,
    ) -> Any:
        reserved.append((tokens, cost))
        return await hit(orgID, agentID, tokens, cost, ledgerID=ledgerID)

    limiter.hit = spiedHit  # type: ignore[method-assign]
    forwarder = Forwarder(reactor, reactor, tuple(providers.providers.values()), metrics)
    ledger = MemoryLedger()
    proxyEdge = ProxyEdge(
        config, auth, limiter, metrics, reactor, forwarder=forwarder, ledger=ledger
    )
    site = ProxySite(proxyEdge.resource(), config.maxRequestBodyBytes, reactor)
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
    try:
        yield Edge(
            port.getHost().port,
            auth,
            counters,
            book,
            metrics,
            token,
            orgID,
            agentID,
            ledger,
            scriptedUpstream,
            reserved,
        )
    finally:
        await port.stopListening()
        await forwarder.close()


def header(response: Any, name: str) -> str | None:
    values = response.headers.getRawHeaders(name)
    return values[0] if values else None


def cosine(left: list[float], right: list[float]) -> float:
    return sum(a * b for a, b in zip(left, right, strict=True))


# Forwarded and relayed


@pytest_twisted.ensureDeferred
async def test_anAnswerIsRelayedAsTheProviderGaveIt(edge: Edge) -> None:
    """
    An embeddings request goes to the provider's <base_url>/embeddings
    with the model replaced by its upstream_model and every other key
    kept, with the gateway's headers only; the answer comes back as the
    provider gave it, byte for byte, with X-SVC-Upstream-Model and the
    gateway's headers. (The scripted vectors of texts that share words
    are near.)
    """
    inputs = ["the cat sat", "the cat ran"]
    document = {"model": "embed", "input": inputs, "user": "u-1", "x": [1]}
    response, answer = await edge.post("/v1/embeddings", json.dumps(document).encode())
    assert response.code == 200, answer
    assert header(response, "Content-Type") == "application/json"
    assert header(response, "X-SVC-Upstream-Model") == "embed"
    assert header(response, "X-RateLimit-Limit") == "60"
    [received] = edge.upstream.requests()
    assert (received.method, received.path) == ("POST", "/v1/embeddings")
    assert received.body == {**document, "model": "echo"}
    assert received.header("x-request-id") == header(response, "X-Request-ID")
    assert received.header("authorization") is None
    assert received.header("x-svc-agent-id") is None
    assert answer["object"] == "list" and answer["model"] == "echo"
    vectors = [each["embedding"] for each in answer["data"]]
    assert [each["index"] for each in answer["data"]] == [0, 1]
    assert vectors == [embeddingOf(text, DEFAULT_EMBEDDING_DIMENSIONS)[0] for text in inputs]
    assert cosine(vectors[0], vectors[1]) > 0.5
    assert answer["usage"] == {"prompt_tokens": 6, "total_tokens": 6}


@pytest_twisted.ensureDeferred
async def test_base64VectorsAreRelayedAsGiven(edge: Edge) -> None:
    """
    encoding_format base64 and dimensions are the provider's to honour:
    the gateway sends them on and relays the base64 strings untouched
    (little-endian float32, as OpenAI encodes them).
    """
    response, answer = await edge.embed(encoding_format="base64", dimensions=16, input="one")
    assert response.code == 200, answer
    [received] = edge.upstream.requests()
    assert (received.body["encoding_format"], received.body["dimensions"]) == ("base64", 16)
    [item] = answer["data"]
    raw = base64.b64decode(item["embedding"])
    assert raw == embeddingOf("one", 16)[1]
    assert len(struct.unpack("<16f", raw)) == 16


@pytest_twisted.ensureDeferred
async def test_aFaultTriesTheFallbacks(edge: Edge) -> None:
    """
    D9's faults and fallbacks, for embeddings: a 503 tries the fallback
    (on another provider), which answers and is named; a 400 is
    UPSTREAM_REJECTED with the provider's status and no fallback; a 429
    is UPSTREAM_RATE_LIMITED with its Retry-After.
    """
    response, answer = await edge.embed(model="embed-failing")
    assert response.code == 200, answer
    assert header(response, "X-SVC-Upstream-Model") == "embed-spare"
    assert [each.path for each in edge.upstream.requests()] == [
        "/v1/embeddings",
        "/other/v1/embeddings",
    ]
    edge.upstream.clearRequests()
    response, answer = await edge.embed(model="embed-rejected")
    assert (response.code, answer["error"]["code"]) == (400, "UPSTREAM_REJECTED")
    assert "Scripted error 400" in answer["error"]["detail"]
    assert len(edge.upstream.requests()) == 1
    response, answer = await edge.embed(model="embed-limited")
    assert (response.code, answer["error"]["code"]) == (429, "UPSTREAM_RATE_LIMITED")
    assert header(response, "Retry-After") == "7"
    rows = edge.ledger.rows
    assert [(row.model, row.outcome) for row in rows] == [
        ("embed-spare", "ok"),
        ("embed-rejected", "upstream_error"),
        ("embed-limited", "upstream_error"),
    ]


# Refused, and never forwarded


@pytest.mark.parametrize(
    ("body", "status", "code", "fields"),
    [
        (b'{"model": "embed"}', 400, "VALIDATION_ERROR", [("input", "REQUIRED")]),
        (b'{"model": "embed", "input": ""}', 400, "VALIDATION_ERROR", [("input", "REQUIRED")]),
        (b'{"model": "embed", "input": []}', 400, "VALIDATION_ERROR", [("input", "REQUIRED")]),
        (
            b'{"model": "embed", "input": ["a", ""]}',
            400,
            "VALIDATION_ERROR",
            [("input[1]", "REQUIRED")],
        ),
        (
            b'{"model": "embed", "input": [1, 2]}',
            400,
            "VALIDATION_ERROR",
            [("input", "INVALID_FORMAT")],
        ),
        (
            json.dumps({"model": "embed", "input": ["x"] * 2049}).encode(),
            400,
            "VALIDATION_ERROR",
            [("input", "TOO_MANY")],
        ),
        (
            b'{"model": "embed", "input": "x", "encoding_format": "hex"}',
            400,
            "VALIDATION_ERROR",
            [("encoding_format", "INVALID_ENUM")],
        ),
        (
            b'{"model": "embed", "input": "x", "dimensions": 0}',
            400,
            "VALIDATION_ERROR",
            [("dimensions", "INVALID_FORMAT")],
        ),
        (
            b'{"model": "embed-small", "input": "x", "dimensions": 17}',
            400,
            "VALIDATION_ERROR",
            [("dimensions", "TOO_MANY")],
        ),
        (b'{"model": "embed", "input": "\\ud800"}', 400, "INVALID_JSON", []),
        (b'{"model": "embed", "input": "x", "n": 1e999999}', 400, "INVALID_JSON", []),
        (b'["embed"]', 400, "VALIDATION_ERROR", [("body", "INVALID_FORMAT")]),
        (b'{"model": "chat", "input": "x"}', 501, "PROVIDER_NOT_CONFIGURED", []),
        (b'{"model": "unknown", "input": "x"}', 501, "PROVIDER_NOT_CONFIGURED", []),
    ],
    ids=[
        "no input",
        "empty string",
        "empty array",
        "an empty string among them",
        "token array",
        "2049 inputs",
        "encoding_format",
        "dimensions zero",
        "dimensions past the model's",
        "lone surrogate",
        "infinite number",
        "not an object",
        "a chat model",
        "an unknown model",
    ],
)
@pytest_twisted.ensureDeferred
async def test_refusedRequestsAreNeverForwarded(
    edge: Edge, body: bytes, status: int, code: str, fields: list[tuple[str, str]]
) -> None:
    """
    Each refusal of the body (with its field errors), and a model that is
    not an embedding model the organization may use (501, as chat does),
    forwards nothing, records no row and keeps no reservation, even with
    a token limit in force.
    """
    edge.limit(org=Limits(tpm=1_000_000))
    response, answer = await edge.post("/v1/embeddings", body)
    assert response.code == status, answer
    error = answer["error"]
    assert error["code"] == code
    assert [(each["field"], each["code"]) for each in error.get("field_errors", [])] == fields
    assert edge.upstream.requests() == []
    assert edge.ledger.rows == []
    assert edge.tokensCounted() == 0


@pytest_twisted.ensureDeferred
async def test_theChatRouteRefusesAnEmbeddingModel(edge: Edge) -> None:
    """
    A model not listed with the route's kind is 501 on either route: the
    chat route asked for an embedding model answers as for a model the
    file does not list, and forwards nothing.
    """
    body = json.dumps({"model": "embed", "messages": [{"role": "user", "content": "hi"}]})
    response, answer = await edge.post("/v1/chat/completions", body.encode())
    assert (response.code, answer["error"]["code"]) == (501, "PROVIDER_NOT_CONFIGURED")
    assert edge.upstream.requests() == []
    response, _ = await edge.post(
        "/v1/chat/completions", body.replace('"embed"', '"chat"').encode()
    )
    assert response.code == 200


@pytest_twisted.ensureDeferred
async def test_theRouteNeedsProxyEmbeddings(edge: Edge) -> None:
    """
    A token without ProxyEmbeddings gets 403 INSUFFICIENT_PERMISSIONS on
    the embeddings route (before its body is looked at), and a token with
    it alone may not chat.
    """
    chatOnly, _, _ = edge.auth.addTenant(
        permissions=Permission.ProxyChatCompletion, orgID=edge.orgID
    )
    response, answer = await edge.post("/v1/embeddings", b"not json", token=chatOnly)
    assert (response.code, answer["error"]["code"]) == (403, "INSUFFICIENT_PERMISSIONS")
    embedOnly, _, _ = edge.auth.addTenant(permissions=Permission.ProxyEmbeddings, orgID=edge.orgID)
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
    response, answer = await edge.post("/v1/chat/completions", body.encode(), token=embedOnly)
    assert (response.code, answer["error"]["code"]) == (403, "INSUFFICIENT_PERMISSIONS")
    response, answer = await edge.post(
        "/v1/embeddings", b'{"model": "embed", "input": "x"}', token=embedOnly
    )
    assert response.code == 200, answer
    assert edge.upstream.requests()[0].path == "/v1/embeddings"


@pytest_twisted.ensureDeferred
async def test_theStepsComeInChatsOrder(edge: Edge) -> None:
    """
    Body size, content type and the token come before the body: 415
    without application/json (even with a bad body), 401 without a token.
    """
    response, answer = await edge.post(
        "/v1/embeddings", b"{", headers={"Content-Type": "text/plain"}
    )
    assert (response.code, answer["error"]["code"]) == (415, "UNSUPPORTED_MEDIA_TYPE")
    response, answer = await edge.post("/v1/embeddings", b"{", headers={"Authorization": "Basic x"})
    assert (response.code, answer["error"]["code"]) == (401, "INVALID_TOKEN")
    assert edge.upstream.requests() == []


# Reserved, settled, recorded


@pytest_twisted.ensureDeferred
async def test_theReservationIsTheInputsEstimate(edge: Edge) -> None:
    """
    With a token limit, an embeddings request reserves its inputs'
    estimate (D11's bytes / 3 per input, nothing for output), shows it in
    the -Tokens headers, and is settled to the provider's prompt tokens.
    """
    edge.limit(org=Limits(tpm=100_000))
    inputs = ["the cat sat", "the cat ran", "é" * 10]
    response, answer = await edge.embed(input=inputs)
    assert response.code == 200, answer
    # 11 bytes -> 4, 11 -> 4, 20 -> 7.
    assert inputsEstimate(inputs) == 15
    assert edge.reserved == [(15, 0)]
    assert header(response, "X-RateLimit-Remaining-Tokens") == str(100_000 - 15)
    assert edge.metric("svc_proxy_tokens_reserved_total") == 15
    await waitFor(lambda: edge.tokensCounted() == answer["usage"]["prompt_tokens"] == 7)
    assert edge.metric("svc_proxy_tokens_settled_total") == 7


@pytest_twisted.ensureDeferred
async def test_oneRowOfKindEmbedding(edge: Edge) -> None:
    """
    A forwarded embeddings request sends one usage row: kind embedding,
    no parent, not a stream, the provider's prompt tokens and no
    completion tokens, its cost at the input price; metrics count its
    prompt tokens, and the access log has them with the provider.
    """
    lines: list[LogEvent] = []

    @provider(ILogObserver)
    def observe(event: LogEvent) -> None:
        if event.get("route") == "/v1/embeddings":
            lines.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        response, answer = await edge.embed(model="embed-priced")
    finally:
        globalLogPublisher.removeObserver(observe)
    assert response.code == 200, answer
    prompt = answer["usage"]["prompt_tokens"]
    [row] = edge.ledger.rows
    assert (row.kind, row.parent_request_id, row.stream, row.outcome) == (
        "embedding",
        "",
        False,
        "ok",
    )
    assert row.request_id == header(response, "X-Request-ID")
    assert (row.model_requested, row.model, row.upstream_model) == (
        "embed-priced",
        "embed-priced",
        "echo",
    )
    assert (row.prompt_tokens, row.completion_tokens, row.tokens_from) == (prompt, 0, "provider")
    assert row.cost_nano_usd == prompt * 20 == 120
    labels = {"provider": "scripted", "model": "embed-priced"}
    assert edge.metric("svc_proxy_upstream_tokens_total", kind="prompt", **labels) == prompt
    assert edge.metric("svc_proxy_upstream_tokens_total", kind="completion", **labels) == 0
    assert edge.metric("svc_proxy_upstream_requests_total", status="200", **labels) == 1
    assert (
        edge.metric("svc_proxy_requests_total", route="/v1/embeddings", method="POST", code="200")
        == 1
    )
    [line] = lines
    assert (line["status"], line["provider"], line["model"]) == (200, "scripted", "embed-priced")
    assert (line["prompt_tokens"], line["completion_tokens"]) == (prompt, 0)


@pytest_twisted.ensureDeferred
async def test_rowsWithoutUsageOrAfterAFault(edge: Edge) -> None:
    """
    An answer without usage records the reservation's estimate (the
    inputs' tokens, none for output); a failed one records no tokens.
    """
    response, _ = await edge.embed(model="embed-no-usage", input="a b c d e f")
    assert response.code == 200
    response, _ = await edge.embed(model="embed-limited")
    assert response.code == 429
    first, second = edge.ledger.rows
    assert (first.kind, first.tokens_from, first.prompt_tokens, first.completion_tokens) == (
        "embedding",
        "reservation",
        4,
        0,
    )
    assert (second.kind, second.outcome, second.prompt_tokens) == ("embedding", "upstream_error", 0)


@pytest_twisted.ensureDeferred
async def test_aBudgetReservesTheDearestWorstCase(edge: Edge) -> None:
    """
    Under a budget, the reservation's cost is an upper bound (decisions
    D12, amended): one token per byte of the body each model that may
    answer is sent, at the dearest input price of the model and its
    fallbacks ($0.13 a million for "embed-dear", whose upstream name is
    longer); a budget a nano-dollar short of it refuses the request with
    nothing forwarded; at the worst case it is admitted and settled to
    the provider's prompt tokens at the price of the model that answered.
    """
    document = {"model": "embed-priced", "input": ["the cat sat", "the cat ran"]}
    sentToDear = json.dumps({**document, "model": "echo-dear"}, separators=(",", ":"))
    # $0.13 a million tokens is 130 nano-dollars a token.
    worstCase = len(sentToDear) * 130
    assert worstCase == 59 * 130
    edge.limit(orgBudget=Budget(nanoUSD=worstCase - 1, period="day"))
    response, answer = await edge.post("/v1/embeddings", json.dumps(document).encode())
    assert (response.code, answer["error"]["code"]) == (429, "BUDGET_EXCEEDED")
    assert edge.upstream.requests() == []
    edge.limit(orgBudget=Budget(nanoUSD=worstCase, period="day"))
    response, answer = await edge.post("/v1/embeddings", json.dumps(document).encode())
    assert response.code == 200, answer
    assert edge.reserved[-1] == (inputsEstimate(document["input"]), worstCase)
    # Settled to the prompt tokens of "embed-priced", which answered.
    await waitFor(lambda: edge.spent() == answer["usage"]["prompt_tokens"] * 20)


@pytest_twisted.ensureDeferred
async def test_aProviderAtTheWorstCaseCostsNoMore(edge: Edge) -> None:
    """
    A provider that counts a token per byte of the body it was sent (the
    most a byte-level tokenizer can) costs exactly the reservation: no
    overrun.
    """
    edge.limit(orgBudget=Budget(nanoUSD=10**9, period="day"))
    response, answer = await edge.embed(model="embed-at-cap")
    assert response.code == 200, answer
    [received] = edge.upstream.requests()
    assert answer["usage"]["prompt_tokens"] == received.bodyLength
    reserved = edge.reserved[-1][1]
    await waitFor(lambda: edge.spent() == reserved)
    assert edge.metric("svc_proxy_reservation_overruns_total") == 0


@pytest_twisted.ensureDeferred
async def test_anUnpricedModelUnderABudgetIsNoPrice(edge: Edge) -> None:
    """
    With a budget, an embedding model without a price is 400 NO_PRICE on
    model, never forwarded nor billed at zero; without one it answers.
    """
    edge.limit(orgBudget=Budget(nanoUSD=10**9, period="month"))
    response, answer = await edge.embed(model="embed")
    assert response.code == 400
    [fieldError] = answer["error"]["field_errors"]
    assert (fieldError["field"], fieldError["code"]) == ("model", "NO_PRICE")
    assert edge.upstream.requests() == [] and edge.ledger.rows == []
    edge.limit()
    response, _ = await edge.embed(model="embed")
    assert response.code == 200


@pytest_twisted.ensureDeferred
async def test_aFullOutboxRefusesBeforeForwarding(edge: Edge) -> None:
    """
    Never an answer that goes unrecorded: with the outbox full, 503
    SERVICE_DEGRADED and nothing forwarded.
    """
    edge.ledger.full = True
    response, answer = await edge.embed()
    assert (response.code, answer["error"]["code"]) == (503, "SERVICE_DEGRADED")
    assert edge.upstream.requests() == []
