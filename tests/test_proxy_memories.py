"""
The memory routes at the proxy's edge (decisions D13), in one process: a
real svc-proxy site on a loopback port with the in-memory auth client,
counters and ledger, a real MemoryService (tests/memoryservice.py) on
the test's database, and the scripted upstream process embedding. What
the routes that embed reserve at their rate limit step (one call of the
limiter per request: the texts' estimate under a token limit, their worst
case under a budget) and settle, what a budget or the ledger refuses, and
the model the [memory] table names but the organization may not use, and
vectors that never mix (decisions D13 amended): no fallback embeds a
memory, and a vector memory cannot use is 502 with nothing stored and its
row kept. The same with the daemons is tests/test_gateway_memories.py.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_twisted
import treq
from authfixtures import Tenant
from memoryservice import RunningMemoryService
from proxydoubles import FakeAuthClient, MemoryCounters, MemoryLedger, newToken
from twisted.internet.defer import maybeDeferred, succeed
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import deferLater
from upstreamfixtures import clearedUpstream

from svcd.common.permissions import Permission
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.limits.book import BudgetRow, LimitBook, LimitsRow
from svcd.limits.limiter import RedisRateLimiter
from svcd.limits.records import Budget, Limits
from svcd.limits.reservation import inputsEstimate
from svcd.memoryclient.channel import memoryChannel
from svcd.memoryclient.client import MemoryClient
from svcd.providers.providersfile import providersFromEnvironment
from svcd.providers.upstream import Forwarder
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.routes.memories import QUEUE_FULL_RETRY_AFTER
from svcd.proxy.http.site import ProxySite
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.records import AgentInfo, TokenInfo

# Starts the scripted upstream process (conftest.py, pytest.ini).
pytestmark = pytest.mark.e2e


@pytest.fixture
def scriptedUpstream(moduleUpstream: ScriptedUpstream) -> ScriptedUpstream:
    """
    The module's one scripted upstream (upstreamfixtures.py), its log of
    requests emptied: the tests read only their own requests, and one
    upstream per test was most of the module's time.
    """
    return clearedUpstream(moduleUpstream)


MEMORY = int(Permission.MemoryRead | Permission.MemoryWrite)
ELSEWHERE = "0190f0a0-0000-7000-8000-0000000000ff"

PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[models]]
name = "embed-priced"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
price = {{ input = "0.02" }}

[[models]]
name = "embed-free"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"

[[models]]
name = "embed-elsewhere"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
orgs = ["{elsewhere}"]

[[models]]
name = "embed-failing"
provider = "scripted"
upstream_model = "status:503"
kind = "embedding"
price = {{ input = "0.02" }}
fallbacks = ["embed-priced"]

[[models]]
name = "embed-declared"
provider = "scripted"
upstream_model = "vectors:short"
kind = "embedding"
dimensions = 64
price = {{ input = "0.02" }}

[[models]]
name = "embed-huge"
provider = "scripted"
upstream_model = "vectors:huge"
kind = "embedding"
price = {{ input = "0.02" }}

[[models]]
name = "embed-plain"
provider = "scripted"
upstream_model = "{plain}"
kind = "embedding"

[memory]
embedding_model = "{model}"
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
    orgID: str
    agentID: str
    token: str
    book: LimitBook
    counters: MemoryCounters
    ledger: MemoryLedger
    upstream: ScriptedUpstream
    # What each call of the limiter's hit() was asked to reserve.
    reserved: list[tuple[int, int]]

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

    async def call(
        self,
        method: str,
        path: str,
        document: object = None,
        extraHeaders: dict[bytes | str, bytes | str] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        headers: dict[bytes | str, bytes | str] = {
            "Authorization": f"Bearer {self.token}",
            "X-SVC-Agent-ID": self.agentID,
            "Content-Type": "application/json",
            **(extraHeaders or {}),
        }
        response = await treq.request(
            method,
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(document).encode() if document is not None else None,
            headers=headers,
        )
        return response, json.loads(await response.content())


EdgeFactory = Callable[..., Any]


@pytest_twisted.async_yield_fixture
async def makeEdge(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    scriptedUpstream: ScriptedUpstream,
    migratedDSN: str,
    acme: Tenant,
) -> AsyncIterator[EdgeFactory]:
    """
    A function that starts an edge whose [memory] table names the model
    it is given, and returns its L{Edge}; a MemoryService on the test's
    database serves every one (with the keyword arguments of the
    fixture's indirect parameter, if any).
    """
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ServerEndpoint

    service = RunningMemoryService(migratedDSN, **getattr(request, "param", {})).start()
    cleanups: list[Callable[[], Any]] = []

    async def make(model: str, plain: str = "echo") -> Edge:
        """
        @param plain: the upstream model of C{embed-plain}.
        """
        providersFile = tmp_path / f"providers-{model}.toml"
        providersFile.write_text(
            PROVIDERS.format(
                base=scriptedUpstream.baseURL, elsewhere=ELSEWHERE, model=model, plain=plain
            )
        )
        providers = providersFromEnvironment({"SVC_PROVIDERS_FILE": str(providersFile)}, time.time)
        config = ProxyConfig(
            authGrpcAddr="auth.test:9091", providers=providers, memoryGrpcAddr=service.address
        )
        assert providers is not None and config.memory is not None
        auth = FakeAuthClient()
        token, orgID, agentID = newToken(), str(acme.orgID), str(acme.agentID)
        auth.tokens[token] = TokenInfo(orgID=orgID, permissions=MEMORY, tokenID=str(acme.tokenID))
        auth.agents[agentID] = AgentInfo(agentID=agentID, orgID=orgID, status="active")
        counters, book, metrics = MemoryCounters(), LimitBook(), ProxyMetrics()
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
        memory = MemoryClient(
            functools.partial(memoryChannel, service.address), IReactorFromThreads(reactor)
        )
        ledger = MemoryLedger()
        edge = ProxyEdge(
            config,
            auth,
            limiter,
            metrics,
            reactor,
            forwarder=forwarder,
            ledger=ledger,
            memory=memory,
        )
        site = ProxySite(edge.resource(), config.maxRequestBodyBytes, reactor)
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
        cleanups.extend([port.stopListening, forwarder.close, memory.close])
        return Edge(
            port.getHost().port,
            orgID,
            agentID,
            token,
            book,
            counters,
            ledger,
            scriptedUpstream,
            reserved,
        )

    try:
        yield make
    finally:
        for cleanup in reversed(cleanups):
            await maybeDeferred(cleanup)
        service.stop()


@pytest_twisted.ensureDeferred
async def test_theRoutesThatEmbedReserveTheirTexts(makeEdge: EdgeFactory) -> None:
    """
    Under a token limit, adding, changing a content and searching each
    reserve their text's estimate in their one call of the limiter,
    settled to the provider's prompt tokens; the routes that embed
    nothing reserve nothing.
    """
    edge: Edge = await makeEdge("embed-priced")
    edge.limit(org=Limits(tpm=100_000))
    content = "the user likes green tea"
    response, memory = await edge.call("POST", "/v1/memories", {"content": content})
    assert response.code == 201, memory
    assert edge.reserved == [(inputsEstimate([content]), 0)]
    assert response.headers.getRawHeaders("X-RateLimit-Remaining-Tokens") == [
        str(100_000 - inputsEstimate([content]))
    ]
    await waitFor(lambda: edge.tokensCounted() == 5)
    [row] = edge.ledger.rows
    assert (row.kind, row.prompt_tokens, row.ledger_id) == ("embedding", 5, row.ledger_id)
    response, _ = await edge.call(
        "PATCH", f"/v1/memories/{memory['id']}", {"content": "likes black coffee"}
    )
    assert response.code == 200
    response, found = await edge.call("POST", "/v1/memories/search", {"query": "coffee"})
    assert response.code == 200, found
    assert found["data"][0]["memory"]["id"] == memory["id"]
    for path in ("/v1/memories", f"/v1/memories/{memory['id']}"):
        response, _ = await edge.call("GET", path)
        assert response.code == 200
    assert edge.reserved[1:] == [
        (inputsEstimate(["likes black coffee"]), 0),
        (inputsEstimate(["coffee"]), 0),
        (0, 0),
        (0, 0),
    ]
    assert [row.kind for row in edge.ledger.rows] == ["embedding"] * 3
    await waitFor(lambda: edge.tokensCounted() == 5 + 3 + 1)


@pytest_twisted.ensureDeferred
async def test_searchModes(makeEdge: EdgeFactory) -> None:
    """
    POST /v1/memories/search ranks by its mode: "text" finds a memory by a
    rare word and embeds nothing (nothing reserved, no ledger row), its
    score BM25's; "hybrid" embeds the query as "vector" does and scores by
    reciprocal rank (1/61 for a memory first in both rankings); min_score
    is ignored outside vector mode; an unknown mode is 400 naming it.
    """
    edge: Edge = await makeEdge("embed-priced")
    edge.limit(org=Limits(tpm=100_000))
    for content in ("Alice's flight is on 2024-07-12", "the user likes green tea"):
        response, _ = await edge.call("POST", "/v1/memories", {"content": content})
        assert response.code == 201
    rows = len(edge.ledger.rows)
    response, found = await edge.call(
        "POST", "/v1/memories/search", {"query": "ALICE?", "mode": "text", "min_score": 1}
    )
    assert response.code == 200, found
    assert [each["memory"]["content"] for each in found["data"]] == [
        "Alice's flight is on 2024-07-12"
    ]
    assert found["data"][0]["score"] > 0
    assert edge.reserved[-1] == (0, 0)
    assert len(edge.ledger.rows) == rows
    response, found = await edge.call(
        "POST", "/v1/memories/search", {"query": "green tea", "mode": "hybrid", "min_score": 1}
    )
    assert response.code == 200, found
    assert found["data"][0]["memory"]["content"] == "the user likes green tea"
    assert found["data"][0]["score"] == pytest.approx(2 / 61, abs=1e-6)
    assert edge.reserved[-1] == (inputsEstimate(["green tea"]), 0)
    await waitFor(lambda: len(edge.ledger.rows) == rows + 1)
    response, answer = await edge.call(
        "POST", "/v1/memories/search", {"query": "tea", "mode": "keyword"}
    )
    assert response.code == 400
    assert [each["field"] for each in answer["error"]["field_errors"]] == ["mode"]


@pytest_twisted.ensureDeferred
async def test_anUnchangedContentIsReleased(makeEdge: EdgeFactory) -> None:
    """
    A PATCH whose content is the stored one reserved its estimate at the
    rate limit, then embeds nothing and releases it.
    """
    edge: Edge = await makeEdge("embed-priced")
    edge.limit(org=Limits(tpm=100_000))
    _, memory = await edge.call("POST", "/v1/memories", {"content": "same words"})
    await waitFor(lambda: edge.tokensCounted() == 2)
    response, _ = await edge.call(
        "PATCH", f"/v1/memories/{memory['id']}", {"content": "same words"}
    )
    assert response.code == 200
    assert edge.reserved[-1] == (inputsEstimate(["same words"]), 0)
    await waitFor(lambda: edge.tokensCounted() == 2)
    assert len(edge.ledger.rows) == 1


@pytest_twisted.ensureDeferred
async def test_aBudgetReservesTheWorstCase(makeEdge: EdgeFactory) -> None:
    """
    Under a budget, adding reserves the worst case of the body sent (a
    token per byte at the input price): a budget short of it refuses the
    add with nothing embedded or stored; at it, the add is settled to the
    provider's prompt tokens at the price.
    """
    edge: Edge = await makeEdge("embed-priced")
    content = "the cat sat"
    sent = json.dumps(
        {"model": "echo", "input": [content], "encoding_format": "base64"}, separators=(",", ":")
    )
    worstCase = len(sent) * 20
    edge.limit(orgBudget=Budget(nanoUSD=worstCase - 1, period="day"))
    response, answer = await edge.call("POST", "/v1/memories", {"content": content})
    assert (response.code, answer["error"]["code"]) == (429, "BUDGET_EXCEEDED")
    assert edge.upstream.requests() == []
    edge.limit(orgBudget=Budget(nanoUSD=worstCase, period="day"))
    response, answer = await edge.call("POST", "/v1/memories", {"content": content})
    assert response.code == 201, answer
    assert edge.reserved[-1] == (inputsEstimate([content]), worstCase)
    await waitFor(lambda: edge.spent() == 3 * 20)
    _, listed = await edge.call("GET", "/v1/memories")
    assert [each["id"] for each in listed["data"]] == [answer["id"]]


@pytest_twisted.ensureDeferred
async def test_anUnpricedModelUnderABudgetIs501(makeEdge: EdgeFactory) -> None:
    """
    Under a budget, a [memory] model without a price cannot embed (never
    billed at zero): the routes that embed are 501 MEMORY_NOT_CONFIGURED,
    reserving and forwarding nothing; reading still answers, and so does a
    text-mode search, which embeds nothing.
    """
    edge: Edge = await makeEdge("embed-free")
    edge.limit(orgBudget=Budget(nanoUSD=10**9, period="month"))
    searches = [{"query": "x"}, {"query": "x", "mode": "hybrid"}]
    for path, body in [("/v1/memories", {"content": "x"})] + [
        ("/v1/memories/search", each) for each in searches
    ]:
        response, answer = await edge.call("POST", path, body)
        assert (response.code, answer["error"]["code"]) == (501, "MEMORY_NOT_CONFIGURED")
    assert edge.reserved == [(0, 0)] * 3
    assert edge.upstream.requests() == [] and edge.ledger.rows == []
    response, _ = await edge.call("GET", "/v1/memories")
    assert response.code == 200
    response, found = await edge.call("POST", "/v1/memories/search", {"query": "x", "mode": "text"})
    assert (response.code, found) == (200, {"object": "list", "data": []})
    assert edge.upstream.requests() == [] and edge.ledger.rows == []
    edge.limit()
    response, _ = await edge.call("POST", "/v1/memories", {"content": "x"})
    assert response.code == 201


@pytest_twisted.ensureDeferred
async def test_aModelOfOtherOrganizationsIs501(makeEdge: EdgeFactory) -> None:
    """
    A [memory] model the providers file offers to other organizations
    only: the routes that embed are 501 (never a hint that it exists);
    listing and forgetting what is stored stay possible.
    """
    edge: Edge = await makeEdge("embed-elsewhere")
    edge.limit(org=Limits(tpm=100_000))
    response, answer = await edge.call("POST", "/v1/memories", {"content": "x"})
    assert (response.code, answer["error"]["code"]) == (501, "MEMORY_NOT_CONFIGURED")
    assert edge.reserved == [(0, 0)]
    for method in ("GET", "DELETE"):
        response, _ = await edge.call(method, "/v1/memories")
        assert response.code == 200


@pytest_twisted.ensureDeferred
async def test_aBadBodyReservesNothing(makeEdge: EdgeFactory) -> None:
    """
    A body that fails its rules reserves nothing and is 400 after the rate
    limit (with its headers).
    """
    edge: Edge = await makeEdge("embed-priced")
    edge.limit(org=Limits(tpm=100_000))
    response, answer = await edge.call("POST", "/v1/memories", {"content": ""})
    assert (response.code, answer["error"]["code"]) == (400, "VALIDATION_ERROR")
    assert edge.reserved == [(0, 0)]
    assert response.headers.getRawHeaders("X-RateLimit-Limit") == ["60"]


@pytest_twisted.ensureDeferred
async def test_aFullLedgerStoresNothing(makeEdge: EdgeFactory) -> None:
    """
    Never an embedding that goes unrecorded: with the outbox full, adding
    is 503 SERVICE_DEGRADED, nothing embedded, nothing stored, the
    reservation released.
    """
    edge: Edge = await makeEdge("embed-priced")
    edge.limit(org=Limits(tpm=100_000))
    edge.ledger.full = True
    response, answer = await edge.call("POST", "/v1/memories", {"content": "kept nowhere"})
    assert (response.code, answer["error"]["code"]) == (503, "SERVICE_DEGRADED")
    assert edge.upstream.requests() == []
    await waitFor(lambda: edge.tokensCounted() == 0)
    edge.ledger.full = False
    _, listed = await edge.call("GET", "/v1/memories")
    assert listed["data"] == []


@pytest_twisted.ensureDeferred
async def test_aFallbackNeverEmbedsAMemory(makeEdge: EdgeFactory) -> None:
    """
    Memory embeds with its model alone (decisions D13 amended): when the
    model fails, adding is 502 with nothing stored, its fallback never
    asked (its vectors live in another space: a memory it embedded was
    stored under its name and never found by the model's queries), and
    the one row is the model's.
    """
    edge: Edge = await makeEdge("embed-failing")
    response, answer = await edge.call("POST", "/v1/memories", {"content": "the cat sat"})
    assert (response.code, answer["error"]["code"]) == (502, "UPSTREAM_ERROR")
    assert [each.body["model"] for each in edge.upstream.requests()] == ["status:503"]
    await waitFor(lambda: len(edge.ledger.rows) == 1)
    [row] = edge.ledger.rows
    assert (row.model, row.outcome, row.kind) == ("embed-failing", "upstream_error", "embedding")
    _, listed = await edge.call("GET", "/v1/memories")
    assert listed["data"] == []


@pytest.mark.parametrize("model", ["embed-declared", "embed-huge"])
@pytest_twisted.ensureDeferred
async def test_aVectorMemoryCannotUseIs502(makeEdge: EdgeFactory, model: str) -> None:
    """
    A vector one value shorter than the model's declared dimensions (it
    was stored: 201), or holding a JSON number beyond float32 (a 500
    before), is 502 UPSTREAM_ERROR: nothing stored, and the embedding's
    row kept, with what the provider counted (it was paid).
    """
    edge: Edge = await makeEdge(model)
    edge.limit(org=Limits(tpm=100_000))
    content = "the user likes green tea"
    response, answer = await edge.call("POST", "/v1/memories", {"content": content})
    assert (response.code, answer["error"]["code"]) == (502, "UPSTREAM_ERROR"), answer
    await waitFor(lambda: edge.tokensCounted() == 5)
    [row] = edge.ledger.rows
    assert (row.outcome, row.prompt_tokens, row.tokens_from, row.cost_nano_usd) == (
        "upstream_error",
        5,
        "provider",
        5 * 20,
    )
    _, listed = await edge.call("GET", "/v1/memories")
    assert listed["data"] == []


@pytest_twisted.ensureDeferred
async def test_aVectorOfAnotherLengthThanTheScopesIs502(makeEdge: EdgeFactory) -> None:
    """
    When the model's vectors change length (a provider's new default, with
    no dimensions in the providers file), a memory embedded at the new
    length is 502 UPSTREAM_ERROR, added or changed: svc-memory refuses a
    vector not of the scope's length for the model, where it started a
    set of its own, silently, that the older vectors' queries never find.
    Nothing is stored; the embeddings' rows stay. A query of the new
    length is 502 too (it found nothing, silently), but in text mode.
    """
    before: Edge = await makeEdge("embed-plain")
    response, other = await before.call("POST", "/v1/memories", {"content": "lives in Oslo"})
    assert response.code == 201, other
    response, kept = await before.call("POST", "/v1/memories", {"content": "likes green tea"})
    assert response.code == 201, kept
    after: Edge = await makeEdge("embed-plain", plain="vectors:short")
    response, answer = await after.call("POST", "/v1/memories", {"content": "likes coffee"})
    assert (response.code, answer["error"]["code"]) == (502, "UPSTREAM_ERROR"), answer
    response, answer = await after.call(
        "PATCH", f"/v1/memories/{kept['id']}", {"content": "likes black coffee"}
    )
    assert (response.code, answer["error"]["code"]) == (502, "UPSTREAM_ERROR"), answer
    for mode in ("vector", "hybrid"):
        response, answer = await after.call(
            "POST", "/v1/memories/search", {"query": "green tea", "mode": mode}
        )
        assert (response.code, answer["error"]["code"]) == (502, "UPSTREAM_ERROR"), answer
    response, found = await after.call(
        "POST", "/v1/memories/search", {"query": "green tea", "mode": "text"}
    )
    assert response.code == 200 and found["data"][0]["memory"]["id"] == kept["id"]
    _, listed = await after.call("GET", "/v1/memories")
    assert [(each["id"], each["content"]) for each in listed["data"]] == [
        (kept["id"], "likes green tea"),
        (other["id"], "lives in Oslo"),
    ]
    await waitFor(lambda: len(after.ledger.rows) == 4)
    assert [row.outcome for row in after.ledger.rows] == ["ok"] * 4
    # The scope's only memory of the model takes a vector of another
    # length, and an empty scope any length.
    response, _ = await before.call("DELETE", f"/v1/memories/{other['id']}")
    assert response.code == 200
    response, changed = await after.call(
        "PATCH", f"/v1/memories/{kept['id']}", {"content": "likes black coffee"}
    )
    assert response.code == 200, changed
    response, _ = await before.call("DELETE", "/v1/memories")
    assert response.code == 200
    response, answer = await before.call("POST", "/v1/memories", {"content": "likes coffee"})
    assert response.code == 201, answer


@pytest.mark.parametrize("makeEdge", [{"maxWaitingPerOrg": 2}], indirect=True)
@pytest_twisted.ensureDeferred
async def test_aFullQueueIs429WithRetryAfter(makeEdge: EdgeFactory) -> None:
    """
    With SVC_MEMORY_MAX_WAITING_PER_ORG 2, a third conversation posted is
    429 MEMORY_QUEUE_FULL with Retry-After; the first, sent again (the
    same X-Request-ID and messages), is still 202 with its id.
    """
    edge: Edge = await makeEdge("embed-free")

    async def post(requestID: str) -> tuple[Any, dict[str, Any]]:
        return await edge.call(
            "POST",
            "/v1/memories",
            {"messages": [{"role": "user", "content": f"I moved to {requestID}"}]},
            {"X-Request-ID": requestID},
        )

    firstID = str(uuid.uuid4())
    first, firstAnswer = await post(firstID)
    second, _ = await post(str(uuid.uuid4()))
    assert (first.code, second.code) == (202, 202)
    full, refusal = await post(str(uuid.uuid4()))
    assert full.code == 429
    assert refusal["error"]["code"] == "MEMORY_QUEUE_FULL"
    assert full.headers.getRawHeaders("Retry-After") == [str(QUEUE_FULL_RETRY_AFTER)]
    again, againAnswer = await post(firstID)
    assert again.code == 202
    assert againAnswer["id"] == firstAnswer["id"]
