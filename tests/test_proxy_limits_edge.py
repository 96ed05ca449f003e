"""
Limits rows at the proxy's edge (decisions D11), in one process: a real
svc-proxy site on a loopback port with the in-memory auth client and
counters, forwarding to the scripted upstream process. What a client sees
(429 with the limit and scope in C{detail}, the -Tokens headers) and what
a forwarded request does to the token counters: reserved at admission,
settled to the provider's usage, released when the answer failed before
its first byte, kept when the client left; requests that are not
forwarded reserve nothing.

One scripted upstream serves the whole module (a process per test cost
about 2.5 s each on a loaded machine, a hundred seconds of the end-to-end
run for tests whose own calls take a tenth of a second); each test's proxy
reaches it under a path prefix of its own (L{UpstreamOfTest}), so a test's
request log never holds another test's requests.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
import pytest_twisted
import treq
from proxydoubles import FakeAuthClient, MemoryCounters, MemoryLedger
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import deferLater
from twisted.logger import ILogObserver, globalLogPublisher

from svcd.devkit.upstream.client import RecordedRequest, ScriptedUpstream
from svcd.limits.book import BudgetRow, LimitBook, LimitsRow
from svcd.limits.limiter import RedisRateLimiter
from svcd.limits.records import Budget, Limits
from svcd.providers.providersfile import providersFromEnvironment
from svcd.providers.upstream import Forwarder
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.site import ProxySite
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.records import TokenInfo

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e


async def waitFor(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    from twisted.internet import reactor

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {seconds} s")
        await deferLater(reactor, 0.02, lambda: None)


@pytest.fixture(scope="module")
def moduleUpstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedUpstream]:
    """
    The scripted upstream of every test of this module (they then run on
    one worker, conftest.py).
    """
    upstream = ScriptedUpstream(tmp_path_factory.mktemp("upstream")).start()
    yield upstream
    upstream.stop()


@attrs.frozen
class UpstreamOfTest:
    """
    The module's scripted upstream as one test sees it: under a path prefix
    of the test's own, so that its log holds this test's requests only (a
    request of an earlier test, however late, has another prefix).
    """

    upstream: ScriptedUpstream
    prefix: str

    @property
    def baseURL(self) -> str:
        return self.upstream.baseURLUnder(self.prefix)

    def requests(self) -> list[RecordedRequest]:
        """
        This test's requests, oldest first (L{ScriptedUpstream.requests}).
        """
        mine = f"/{self.prefix}/"
        return [request for request in self.upstream.requests() if request.path.startswith(mine)]

    def clearRequests(self) -> None:
        self.upstream.clearRequests()


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
    upstream: UpstreamOfTest
    # The ledger id each call of the limiter's hit() was given.
    ledgerIDs: list[str | None]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def headers(self) -> dict[bytes | str, bytes | str]:
        return {
            "Authorization": "Bearer " + self.token,
            "X-SVC-Agent-ID": self.agentID,
            "Content-Type": "application/json",
        }

    def limit(
        self,
        org: Limits | None = None,
        agent: Limits | None = None,
        orgBudget: Budget | None = None,
    ) -> None:
        self.book.replace(
            [
                LimitsRow(self.orgID, None, org),
                LimitsRow(self.orgID, self.agentID, agent),
                BudgetRow(self.orgID, None, orgBudget),
            ]
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

    async def chat(self, model: str = "echo", **extra: Any) -> tuple[Any, dict[str, Any]]:
        body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], **extra}
        response = await treq.post(
            self.url("/v1/chat/completions"),
            json.dumps(body).encode(),
            headers=self.headers(),
        )
        content = await response.content()
        return response, json.loads(content) if not extra.get("stream") else {"raw": content}

    async def post(
        self, body: bytes, headers: dict[bytes | str, bytes | str] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        merged: dict[bytes | str, bytes | str] = {**self.headers(), **(headers or {})}
        response = await treq.post(self.url("/v1/chat/completions"), body, headers=merged)
        content = await response.content()
        return response, json.loads(content) if content.startswith(b"{") else {"raw": content}


@pytest_twisted.async_yield_fixture
async def edge(tmp_path: Path, moduleUpstream: ScriptedUpstream) -> AsyncIterator[Edge]:
    from twisted.internet import reactor
    from twisted.internet.endpoints import TCP4ServerEndpoint

    # Emptied for each test, so that the log does not grow over the module
    # (the earlier tests' requests are under prefixes of their own anyway).
    moduleUpstream.clearRequests()
    scriptedUpstream = UpstreamOfTest(moduleUpstream, f"test-{uuid.uuid4().hex}")

    providersFile = tmp_path / "providers.toml"
    providersFile.write_text(
        f"""
[[providers]]
name = "scripted"
base_url = "{scriptedUpstream.baseURL}"

[[models]]
name = "echo"
provider = "scripted"

[[models]]
name = "capped"
provider = "scripted"
upstream_model = "echo"
max_output_tokens = 64

[[models]]
name = "broken"
provider = "scripted"
upstream_model = "status:503"

[[models]]
name = "endless"
provider = "scripted"
upstream_model = "never-ending"

[[models]]
name = "cut"
provider = "scripted"
upstream_model = "close-mid-stream"

[[models]]
name = "priced"
provider = "scripted"
upstream_model = "echo"
max_output_tokens = 100
price = {{ input = "2.50", output = "10.00", cached_input = "1.25" }}

[[models]]
name = "cheap"
provider = "scripted"
upstream_model = "echo"
max_output_tokens = 100
price = {{ input = "1.00", output = "2.00" }}
fallbacks = ["dear"]

[[models]]
name = "dear"
provider = "scripted"
upstream_model = "echo"
max_output_tokens = 100
price = {{ input = "3.00", output = "30.00" }}

[[models]]
name = "old-api"
provider = "scripted"
upstream_model = "status:503"
cap_field = "max_tokens"
max_output_tokens = 300
price = {{ input = "1.00", output = "1.00" }}
fallbacks = ["new-api"]

[[models]]
name = "new-api"
provider = "scripted"
upstream_model = "echo"
max_output_tokens = 200
price = {{ input = "1.00", output = "1.00" }}

[[models]]
name = "priced-broken"
provider = "scripted"
upstream_model = "status:503"
max_output_tokens = 50
price = {{ input = "1.00", output = "1.00" }}
fallbacks = ["echo"]

[[models]]
name = "at-cap"
provider = "scripted"
upstream_model = "usage-at-cap"
max_output_tokens = 100
price = {{ input = "2.50", output = "10.00" }}

[[models]]
name = "over-cap"
provider = "scripted"
upstream_model = "usage-over-cap"
max_output_tokens = 100
price = {{ input = "2.50", output = "10.00" }}
"""
    )
    providers = providersFromEnvironment({"SVC_PROVIDERS_FILE": str(providersFile)}, time.time)
    assert providers is not None
    config = ProxyConfig(authGrpcAddr="auth.test:9091", providers=providers)
    auth = FakeAuthClient()
    token, orgID, agentID = auth.addTenant()
    counters = MemoryCounters()
    book = LimitBook()
    metrics = ProxyMetrics()
    limiter = RedisRateLimiter(
        counters, reactor, config.defaultRPM, book=book, spend=lambda *_: succeed(0)
    )
    ledgerIDs: list[str | None] = []
    hit = limiter.hit

    async def spiedHit(
        orgID: str,
        agentID: str | None,
        tokens: int = 0,
        cost: int = 0,
        ledgerID: str | None = None,
    ) -> Any:
        ledgerIDs.append(ledgerID)
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
            ledgerIDs,
        )
    finally:
        await port.stopListening()
        await forwarder.close()


def header(response: Any, name: str) -> str | None:
    values = response.headers.getRawHeaders(name)
    return values[0] if values else None


@pytest_twisted.ensureDeferred
async def test_withoutRowsNothingChanges(edge: Edge) -> None:
    """
    No limits row: the environment's rpm and D5's headers, no -Tokens
    header, nothing reserved.
    """
    response, _ = await edge.chat()
    assert response.code == 200
    assert header(response, "X-RateLimit-Limit") == "60"
    assert header(response, "X-RateLimit-Limit-Tokens") is None
    assert edge.tokensCounted() == 0
    assert edge.metric("svc_proxy_tokens_reserved_total") == 0


@pytest_twisted.ensureDeferred
async def test_forwardedRequestIsSettledToTheProvidersUsage(edge: Edge) -> None:
    """
    With a token limit, a forwarded request reserves its estimate plus
    the output cap (here the request's max_tokens), shows the -Tokens
    headers, and is settled to the provider's prompt + completion tokens.
    """
    edge.limit(org=Limits(tpm=100_000))
    response, answer = await edge.chat(max_tokens=200)
    assert response.code == 200
    # "hello there": 11 bytes -> 4 tokens, + 4 for the message, + 200.
    reserved = 4 + 4 + 200
    assert header(response, "X-RateLimit-Limit-Tokens") == "100000"
    assert header(response, "X-RateLimit-Remaining-Tokens") == str(100_000 - reserved)
    assert header(response, "X-RateLimit-Reset-Tokens") == header(response, "X-RateLimit-Reset")
    usage = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    # Settlements ride on the next admission, or go alone a moment later.
    await waitFor(lambda: edge.tokensCounted() == usage)
    assert edge.metric("svc_proxy_tokens_reserved_total") == reserved
    assert edge.metric("svc_proxy_tokens_settled_total") == usage


@pytest_twisted.ensureDeferred
async def test_streamIsSettledToItsUsageEvent(edge: Edge) -> None:
    """
    A stream is settled when it ends, to the usage event the gateway
    asked for (even when the client did not ask to see it).
    """
    edge.limit(agent=Limits(tpm=50_000))
    response, _ = await edge.chat(stream=True)
    assert response.code == 200
    # The model's cap is not set for "echo": 4096 is reserved.
    assert edge.metric("svc_proxy_tokens_reserved_total") == 4 + 4 + 4096
    settled = edge.metric("svc_proxy_tokens_settled_total")
    assert 0 < settled < 100
    # Settlements ride on the next admission, or go alone a moment later.
    await waitFor(lambda: edge.tokensCounted() == settled)


@pytest_twisted.ensureDeferred
async def test_theModelsCapIsTheLastResort(edge: Edge) -> None:
    """
    A model's max_output_tokens in the providers file is the cap when the
    request and the rows name none.
    """
    edge.limit(org=Limits(tpm=100_000))
    response, _ = await edge.chat(model="capped")
    assert response.code == 200
    assert edge.metric("svc_proxy_tokens_reserved_total") == 4 + 4 + 64
    edge.limit(org=Limits(tpm=100_000, maxOutputTokens=32))
    await edge.chat(model="capped")
    assert edge.metric("svc_proxy_tokens_reserved_total") == (4 + 4 + 64) + (4 + 4 + 32)


@pytest_twisted.ensureDeferred
async def test_failureBeforeTheFirstByteReleases(edge: Edge) -> None:
    """
    An answer that failed before its first byte (a provider's 503 here)
    releases its reservation.
    """
    edge.limit(org=Limits(tpm=100_000))
    response, answer = await edge.chat(model="broken")
    assert response.code == 502
    assert answer["error"]["code"] == "UPSTREAM_ERROR"
    # Settlements ride on the next admission, or go alone a moment later.
    await waitFor(lambda: edge.tokensCounted() == 0)
    assert edge.metric("svc_proxy_tokens_settled_total") == 0
    assert edge.metric("svc_proxy_tokens_reserved_total") == 4 + 4 + 4096


@pytest_twisted.ensureDeferred
async def test_clientGoneKeepsItsReservation(edge: Edge) -> None:
    """
    A client that leaves a stream before its usage arrived keeps its
    reservation counted.
    """
    edge.limit(org=Limits(tpm=100_000))
    body = {
        "model": "endless",
        "stream": True,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    request: Deferred[Any] = treq.post(
        edge.url("/v1/chat/completions"), json.dumps(body).encode(), headers=edge.headers()
    )
    response = await request
    assert response.code == 200
    await waitFor(
        lambda: (
            edge.metric(
                "svc_proxy_upstream_requests_total",
                provider="scripted",
                model="endless",
                status="200",
            )
            == 0
            and edge.tokensCounted() == 18
        )
    )
    response.original.deliverBody(_Dropper())
    await waitFor(
        lambda: (
            edge.metric(
                "svc_proxy_upstream_requests_total",
                provider="scripted",
                model="endless",
                status="cancelled",
            )
            == 1
        )
    )
    assert edge.tokensCounted() == 4 + 4 + 10
    assert edge.metric("svc_proxy_tokens_settled_total") == 0


class _Dropper:
    """
    Reads the first bytes of a body, then closes the connection.
    """

    def makeConnection(self, transport: Any) -> None:
        self.transport = transport

    def dataReceived(self, data: bytes) -> None:
        self.transport.stopProducing()

    def connectionLost(self, reason: Any) -> None:
        pass


@pytest_twisted.ensureDeferred
async def test_tokenLimitRefusal(edge: Edge) -> None:
    """
    Past a token limit: 429 RATE_LIMITED whose detail names the limit and
    scope, Retry-After, the -Tokens headers, and the refusal counted by
    limit and scope (and in svc_proxy_rate_limited_total).
    """
    edge.limit(org=Limits(tpm=1000), agent=Limits(tpm=300))
    # Reserves the agent's whole 300 (cut to it), settled to its usage.
    first, _ = await edge.chat(max_tokens=10_000)
    assert first.code == 200
    # 300 again: the agent's minute has the first one's usage already.
    refused, answer = await edge.chat(max_tokens=10_000)
    assert refused.code == 429
    assert answer["error"]["code"] == "RATE_LIMITED"
    assert answer["error"]["detail"] == {"limit": "tokens", "scope": "agent"}
    assert header(refused, "Retry-After") is not None
    assert header(refused, "X-RateLimit-Limit-Tokens") == "300"
    assert edge.metric("svc_proxy_limit_refusals_total", limit="tokens", scope="agent") == 1
    assert edge.metric("svc_proxy_rate_limited_total") == 1


@pytest_twisted.ensureDeferred
async def test_requestLimitRefusalOfAnAgent(edge: Edge) -> None:
    """
    An agent's rpm refuses its own requests with scope agent.
    """
    edge.limit(org=Limits(rpm=100), agent=Limits(rpm=1))
    first = await treq.get(edge.url("/v1/internal/auth-probe"), headers=edge.headers())
    await first.content()
    assert first.code == 200
    assert (header(first, "X-RateLimit-Limit"), header(first, "X-RateLimit-Remaining")) == (
        "1",
        "0",
    )
    second = await treq.get(edge.url("/v1/internal/auth-probe"), headers=edge.headers())
    answer = json.loads(await second.content())
    assert second.code == 429
    assert answer["error"]["detail"] == {"limit": "requests", "scope": "agent"}


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/internal/auth-probe", None, 200),
        (
            "/v1/chat/completions",
            b'{"model": "unknown", "messages": [{"role": "user", "content": "x"}]}',
            501,
        ),
        ("/v1/chat/completions", b'{"model": "echo"}', 400),
        ("/v1/chat/completions", b"not json", 400),
    ],
    ids=["auth probe", "model not served", "invalid body", "not json"],
)
@pytest_twisted.ensureDeferred
async def test_requestsNotForwardedReserveNothing(
    edge: Edge, path: str, body: bytes | None, status: int
) -> None:
    """
    The auth probe, a model the file does not serve (501) and a body that
    fails its rules (400, still after the rate limit) reserve no tokens,
    yet see the token limit's headers.
    """
    edge.limit(org=Limits(tpm=1000))
    if body is None:
        response = await treq.get(edge.url(path), headers=edge.headers())
    else:
        response = await treq.post(edge.url(path), body, headers=edge.headers())
    await response.content()
    assert response.code == status
    assert header(response, "X-RateLimit-Remaining-Tokens") == "1000"
    assert edge.tokensCounted() == 0


# Budgets (decisions D12)


@pytest_twisted.ensureDeferred
async def test_aBudgetIsSettledToTheCostOfTheAnswer(edge: Edge) -> None:
    """
    Under a budget, a forwarded request reserves its worst case at the
    model's prices and is settled to the cost of the provider's usage, to
    the nano-dollar.
    """
    edge.limit(orgBudget=Budget(nanoUSD=10**9, period="day"))
    response, answer = await edge.chat(model="priced")
    assert response.code == 200
    usage = answer["usage"]
    cost = usage["prompt_tokens"] * 2500 + usage["completion_tokens"] * 10_000
    # Settlements ride on the next admission, or go alone a moment later.
    await waitFor(lambda: edge.spent() == cost)


# The body "priced" sends upstream under a budget, counted by hand: the
# client's object, compact, model replaced by its upstream_model, and the
# cap assumed (the model's max_output_tokens, 100) added as
# max_completion_tokens: 97 bytes; a stream adds include_usage first.
PRICED_SENT = (
    '{"model":"echo","messages":[{"role":"user","content":"hello there"}],'
    '"max_completion_tokens":100}'
)
PRICED_STREAM_SENT = (
    '{"model":"echo","messages":[{"role":"user","content":"hello there"}],"stream":true,'
    '"stream_options":{"include_usage":true},"max_completion_tokens":100}'
)


@pytest.mark.parametrize(
    ("stream", "sent", "length"),
    [(False, PRICED_SENT, 97), (True, PRICED_STREAM_SENT, 151)],
    ids=["completion", "stream"],
)
@pytest_twisted.ensureDeferred
async def test_aRequestThatWouldPassTheBudgetIsRefused(
    edge: Edge, stream: bool, sent: str, length: int
) -> None:
    """
    A request whose worst case would pass the budget: 429 BUDGET_EXCEEDED
    with Retry-After to the day's end, counted as a budget refusal. The
    worst case (decisions D12, amended) is one token per byte of the body
    sent (97, or 151 for a stream) at $2.50 a million, plus the cap it
    assumed and sent (100) at $10.00: exactly that much is admitted.
    """
    assert len(sent) == length
    worstCase = length * 2500 + 100 * 10_000
    extra = {"stream": True} if stream else {}
    edge.limit(orgBudget=Budget(nanoUSD=worstCase - 1, period="day"))
    response, answer = await edge.chat(model="priced", **extra)
    assert response.code == 429
    answer = json.loads(answer["raw"]) if stream else answer
    assert answer["error"]["code"] == "BUDGET_EXCEEDED"
    assert answer["error"]["detail"] == {"scope": "org"}
    retryAfter = int(header(response, "Retry-After") or 0)
    assert 1 <= retryAfter <= 86_400
    assert (
        abs((time.time() + retryAfter) % 86_400) < 5 or (time.time() + retryAfter) % 86_400 > 86_395
    )
    assert edge.metric("svc_proxy_limit_refusals_total", limit="budget", scope="org") == 1
    assert edge.upstream.requests() == []
    edge.limit(orgBudget=Budget(nanoUSD=worstCase, period="day"))
    response, _ = await edge.chat(model="priced", **extra)
    assert response.code == 200
    [forwarded] = edge.upstream.requests()
    assert forwarded.bodyLength == length
    assert forwarded.body == json.loads(sent)


class _CountingJSON:
    """
    The json module as svcd.providers.upstream and svcd.metering.bodies
    see it, counting the bodies they serialize (attemptBody's json.dumps).
    """

    def __init__(self) -> None:
        self.dumped = 0

    def dumps(self, *args: Any, **kwargs: Any) -> str:
        self.dumped += 1
        return json.dumps(*args, **kwargs)

    def loads(self, *args: Any, **kwargs: Any) -> Any:
        return json.loads(*args, **kwargs)


@pytest_twisted.ensureDeferred
async def test_aBudgetsMeasuredBodyIsTheBodySent(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    Under a budget the body the reservation measured is the body sent,
    serialized once per request (not once to measure and again to
    forward); without one, once when forwarded.
    """
    from svcd.metering import bodies
    from svcd.providers import upstream

    counting = _CountingJSON()
    monkeypatch.setattr(upstream, "json", counting)
    monkeypatch.setattr(bodies, "json", counting)
    edge.limit(orgBudget=Budget(nanoUSD=10**9, period="day"))
    response, _ = await edge.chat(model="priced")
    assert response.code == 200
    [forwarded] = edge.upstream.requests()
    assert forwarded.body == json.loads(PRICED_SENT)
    assert counting.dumped == 1
    edge.limit()
    response, _ = await edge.chat(model="priced")
    assert response.code == 200
    assert counting.dumped == 2


@pytest_twisted.ensureDeferred
async def test_theCapIsSentUnderABudgetOnly(edge: Edge) -> None:
    """
    Without a budget (no limits, or a token limit only), the client's
    object goes upstream as it was (decisions D9): no cap is added.
    """
    await edge.chat(model="priced")
    edge.limit(org=Limits(tpm=100_000))
    await edge.chat(model="priced")
    bodies = [request.body for request in edge.upstream.requests()]
    assert [body["model"] for body in bodies] == ["echo", "echo"]
    assert all("max_completion_tokens" not in body for body in bodies)
    assert all("max_tokens" not in body for body in bodies)


@pytest_twisted.ensureDeferred
async def test_eachAttemptCarriesTheCapUnderItsOwnField(edge: Edge) -> None:
    """
    With fallbacks, each attempt is sent the cap under its own model's
    cap_field: "old-api" (cap_field max_tokens, 300 at most) fails, then
    "new-api" (max_completion_tokens, 200 at most) answers; each is sent
    the cap assumed (300) within its own ceiling, and no other cap key.
    """
    edge.limit(orgBudget=Budget(nanoUSD=10**9, period="day"))
    response, _ = await edge.chat(model="old-api")
    assert response.code == 200
    assert header(response, "X-SVC-Upstream-Model") == "new-api"
    old, new = (request.body for request in edge.upstream.requests())
    assert (old["model"], old["max_tokens"], "max_completion_tokens" in old) == (
        "status:503",
        300,
        False,
    )
    assert (new["model"], new["max_completion_tokens"], "max_tokens" in new) == ("echo", 200, False)


@pytest_twisted.ensureDeferred
async def test_aCapTheClientNamedIsSentAsItIs(edge: Edge) -> None:
    """
    A request that names its cap is bound by it: nothing is added, and its
    worst case is the body's bytes plus that cap (hand count: 85 bytes;
    20 tokens).
    """
    sent = '{"model":"echo","messages":[{"role":"user","content":"hello there"}],"max_tokens":20}'
    assert len(sent) == 85
    worstCase = 85 * 2500 + 20 * 10_000
    edge.limit(orgBudget=Budget(nanoUSD=worstCase - 1, period="day"))
    refused, _ = await edge.chat(model="priced", max_tokens=20)
    assert refused.code == 429
    edge.limit(orgBudget=Budget(nanoUSD=worstCase, period="day"))
    response, _ = await edge.chat(model="priced", max_tokens=20)
    assert response.code == 200
    [forwarded] = edge.upstream.requests()
    assert forwarded.body == json.loads(sent)


@pytest_twisted.ensureDeferred
async def test_choicesMultiplyTheCap(edge: Edge) -> None:
    """
    n choices may each be as long as the cap: n = 3 reserves three caps
    (the body sent: 103 bytes, counted by hand).
    """
    sent = (
        '{"model":"echo","messages":[{"role":"user","content":"hello there"}],"n":3,'
        '"max_completion_tokens":100}'
    )
    assert len(sent) == 103
    worstCase = 103 * 2500 + 3 * 100 * 10_000
    edge.limit(orgBudget=Budget(nanoUSD=worstCase - 1, period="day"))
    refused, answer = await edge.chat(model="priced", n=3)
    assert (refused.code, answer["error"]["code"]) == (429, "BUDGET_EXCEEDED")
    edge.limit(orgBudget=Budget(nanoUSD=worstCase, period="day"))
    response, _ = await edge.chat(model="priced", n=3)
    assert response.code == 200
    [forwarded] = edge.upstream.requests()
    assert forwarded.body == json.loads(sent)


# A request full of what a content-only estimate misses: tools and their
# schemas, a response_format schema, an assistant's tool_calls, digits.
TOOLS_BODY = (
    '{"model":"priced","messages":['
    '{"role":"system","content":"Answer with digits only."},'
    '{"role":"user","content":"3141592653589793238462643383279502884197"},'
    '{"role":"assistant","content":"","tool_calls":[{"id":"call_1","type":"function",'
    '"function":{"name":"lookup","arguments":"{\\"digits\\":\\"2718281828459045\\"}"}}]},'
    '{"role":"tool","content":"1618033988749894848204586834365638117720",'
    '"tool_call_id":"call_1"}],'
    '"tools":[{"type":"function","function":{"name":"lookup","description":"Look digits up.",'
    '"parameters":{"type":"object","properties":{"digits":{"type":"string",'
    '"pattern":"^[0-9]+$"}}}}}],'
    '"response_format":{"type":"json_schema","json_schema":{"name":"digits","schema":'
    '{"type":"object","properties":{"answer":{"type":"string"}}}}},'
    '"max_tokens":50}'
)


@pytest_twisted.ensureDeferred
async def test_toolsSchemasToolCallsAndDigitsAreCounted(edge: Edge) -> None:
    """
    Every byte of the body sent counts as a token of prompt: the 751
    bytes of TOOLS_BODY go upstream as 749 ("priced" becomes "echo"), so
    the worst case is 749 tokens at $2.50 plus the 50 of max_tokens at
    $10.00 a million, however few tokens its messages' contents make.
    """
    sent = TOOLS_BODY.replace('"model":"priced"', '"model":"echo"')
    assert (len(TOOLS_BODY), len(sent)) == (751, 749)
    worstCase = 749 * 2500 + 50 * 10_000
    edge.limit(orgBudget=Budget(nanoUSD=worstCase - 1, period="day"))
    refused, answer = await edge.post(TOOLS_BODY.encode())
    assert (refused.code, answer["error"]["code"]) == (429, "BUDGET_EXCEEDED")
    edge.limit(orgBudget=Budget(nanoUSD=worstCase, period="day"))
    response, _ = await edge.post(TOOLS_BODY.encode())
    assert response.code == 200
    [forwarded] = edge.upstream.requests()
    assert (forwarded.bodyLength, forwarded.body) == (749, json.loads(sent))


@pytest_twisted.ensureDeferred
async def test_aDearerFallbacksPriceIsReserved(edge: Edge) -> None:
    """
    "cheap" ($1/$2) falls back to "dear" ($3/$30): the reservation is the
    dearest that may answer, dear's, though cheap answers. Both are sent
    the same 97 bytes (upstream model "echo", cap 100).
    """
    cheapWorst = 97 * 1000 + 100 * 2000
    dearWorst = 97 * 3000 + 100 * 30_000
    assert dearWorst > cheapWorst
    edge.limit(orgBudget=Budget(nanoUSD=dearWorst - 1, period="day"))
    refused, answer = await edge.chat(model="cheap")
    assert (refused.code, answer["error"]["code"]) == (429, "BUDGET_EXCEEDED")
    edge.limit(orgBudget=Budget(nanoUSD=dearWorst, period="day"))
    response, answer = await edge.chat(model="cheap")
    assert response.code == 200
    assert header(response, "X-SVC-Upstream-Model") == "cheap"
    # Settled to the answer's cost at cheap's prices.
    usage = answer["usage"]
    cost = usage["prompt_tokens"] * 1000 + usage["completion_tokens"] * 2000
    await waitFor(lambda: edge.spent() == cost)


@pytest_twisted.ensureDeferred
async def test_anUnpricedFallbackIsNotTriedUnderABudget(edge: Edge) -> None:
    """
    Under a budget, "priced-broken" (503) does not fall back to "echo",
    which has no price: the answer is the provider's fault, and the one
    row is an upstream_error of "priced-broken". Without a budget, "echo"
    answers as always.
    """
    edge.limit(orgBudget=Budget(nanoUSD=10**9, period="day"))
    response, answer = await edge.chat(model="priced-broken")
    assert (response.code, answer["error"]["code"]) == (502, "UPSTREAM_ERROR")
    assert [request.body["model"] for request in edge.upstream.requests()] == ["status:503"]
    [row] = edge.ledger.rows
    assert (row.model, row.outcome, row.cost_nano_usd) == ("priced-broken", "upstream_error", 0)
    await waitFor(lambda: edge.spent() == 0)
    edge.limit()
    edge.upstream.clearRequests()
    response, _ = await edge.chat(model="priced-broken")
    assert response.code == 200
    assert header(response, "X-SVC-Upstream-Model") == "echo"
    assert [request.body["model"] for request in edge.upstream.requests()] == [
        "status:503",
        "echo",
    ]


@pytest_twisted.ensureDeferred
async def test_noPriceKeepsNoReservation(edge: Edge) -> None:
    """
    A NO_PRICE 400 reserves nothing and keeps nothing: neither tokens of
    the token limit nor cost of the budget; nothing is forwarded.
    """
    edge.limit(org=Limits(tpm=100_000), orgBudget=Budget(nanoUSD=10**9, period="day"))
    response, answer = await edge.chat(model="echo")
    assert (response.code, answer["error"]["code"]) == (400, "VALIDATION_ERROR")
    assert answer["error"]["field_errors"][0]["code"] == "NO_PRICE"
    assert (edge.tokensCounted(), edge.spent()) == (0, 0)
    assert edge.metric("svc_proxy_tokens_reserved_total") == 0
    assert edge.upstream.requests() == []
    assert edge.ledger.rows == []


@pytest.mark.parametrize(
    ("model", "cap", "value", "ceiling"),
    [
        ("priced", "max_tokens", 101, 100),
        ("priced", "max_completion_tokens", 101, 100),
        ("echo", "max_completion_tokens", 1_048_577, 1_048_576),
        ("echo", "max_tokens", 10**15, 1_048_576),
    ],
)
@pytest.mark.parametrize("limited", [False, True], ids=["no limits", "token limit"])
@pytest_twisted.ensureDeferred
async def test_aCapPastTheModelsCeilingIs400(
    edge: Edge, model: str, cap: str, value: int, ceiling: int, limited: bool
) -> None:
    """
    An output cap above the model's max_output_tokens (1,048,576 when the
    file gives none) is 400 VALIDATION_ERROR on that field, TOO_MANY:
    nothing forwarded, nothing reserved, no row. The ceiling itself is
    allowed.
    """
    if limited:
        edge.limit(org=Limits(tpm=10**9))
    response, answer = await edge.chat(model=model, **{cap: value})
    assert (response.code, answer["error"]["code"]) == (400, "VALIDATION_ERROR")
    assert answer["error"]["field_errors"] == [
        {"field": cap, "code": "TOO_MANY", "message": f"must be at most {ceiling} for this model"}
    ]
    assert edge.upstream.requests() == []
    assert edge.tokensCounted() == 0
    assert edge.ledger.rows == []
    response, _ = await edge.chat(model=model, **{cap: ceiling})
    assert response.code == 200
    [forwarded] = edge.upstream.requests()
    assert forwarded.body[cap] == ceiling


@pytest_twisted.ensureDeferred
async def test_aProviderAtTheCapCostsExactlyTheReservation(edge: Edge) -> None:
    """
    A provider that answers the most the request allows (every byte sent a
    token of prompt, both choices as long as the cap) costs exactly what
    was reserved, to the nano-dollar: the bound is tight, and no overrun.
    Hand count of the body sent: 111 bytes.
    """
    sent = (
        '{"model":"usage-at-cap","messages":[{"role":"user","content":"hello there"}],"n":2,'
        '"max_completion_tokens":100}'
    )
    assert len(sent) == 111
    worstCase = 111 * 2500 + 2 * 100 * 10_000
    edge.limit(orgBudget=Budget(nanoUSD=worstCase, period="day"))
    response, answer = await edge.chat(model="at-cap", n=2)
    assert response.code == 200
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (111, 200)
    [row] = edge.ledger.rows
    assert row.cost_nano_usd == worstCase
    assert edge.spent() == worstCase
    assert edge.metric("svc_proxy_reservation_overruns_total") == 0
    # The budget is spent: the next is refused.
    refused, _ = await edge.chat(model="at-cap", n=2)
    assert refused.code == 429


@pytest_twisted.ensureDeferred
async def test_anOverrunIsBilledAsReportedAndCounted(edge: Edge) -> None:
    """
    A provider that answers more than the cap it was sent allows (twice
    it here) is billed as it reported, the overrun counted in
    svc_proxy_reservation_overruns_total, and the budget refuses from then
    on. It is logged with keyword fields (never pre-formatted). Hand count
    of the body sent: 107 bytes; 100 tokens of cap.
    """
    reserved = 107 * 2500 + 100 * 10_000
    billed = 107 * 2500 + 200 * 10_000
    events: list[dict[str, Any]] = []

    def observe(event: dict[str, Any]) -> None:
        if "passed its reservation" in (event.get("log_format") or ""):
            events.append(event)

    edge.limit(orgBudget=Budget(nanoUSD=billed + reserved - 1, period="day"))
    globalLogPublisher.addObserver(cast(ILogObserver, observe))
    try:
        response, answer = await edge.chat(model="over-cap")
    finally:
        globalLogPublisher.removeObserver(cast(ILogObserver, observe))
    assert response.code == 200
    assert answer["usage"]["completion_tokens"] == 200
    [row] = edge.ledger.rows
    assert row.cost_nano_usd == billed
    await waitFor(lambda: edge.spent() == billed)
    assert edge.metric("svc_proxy_reservation_overruns_total") == 1
    [event] = events
    assert (event["model"], event["provider"]) == ("over-cap", "scripted")
    assert (event["reserved_nano_usd"], event["cost_nano_usd"]) == (reserved, billed)
    assert (event["ledger_id"], event["org_id"]) == (row.ledger_id, edge.orgID)
    refused, answer = await edge.chat(model="over-cap")
    assert (refused.code, answer["error"]["code"]) == (429, "BUDGET_EXCEEDED")
    # Without a budget there is no bound to pass: nothing is counted.
    edge.limit()
    response, _ = await edge.chat(model="over-cap", max_tokens=10)
    assert response.code == 200
    assert edge.metric("svc_proxy_reservation_overruns_total") == 1


@pytest_twisted.ensureDeferred
async def test_requestsSharingARequestIDAreEachTheirOwnRow(edge: Edge) -> None:
    """
    Decisions D12, amended: the ledger's key is the gateway's own UUID v7
    for each forwarded request, passed to the limiter with its
    reservation; two requests with one X-Request-ID are two rows with two
    ledger ids, each keeping the client's request id (and answering it).
    """
    edge.limit(orgBudget=Budget(nanoUSD=10**9, period="day"))
    clientID = "3f2c8a9e-4b1d-4c6e-9a7b-0d1e2f3a4b5c"
    body = json.dumps(
        {"model": "priced", "messages": [{"role": "user", "content": "hello there"}]}
    ).encode()
    first, _ = await edge.post(body, {"X-Request-ID": clientID})
    second, _ = await edge.post(body, {"X-Request-ID": clientID})
    assert (first.code, second.code) == (200, 200)
    assert header(first, "X-Request-ID") == header(second, "X-Request-ID") == clientID
    rows = edge.ledger.rows
    assert [row.request_id for row in rows] == [clientID, clientID]
    ledgerIDs = [row.ledger_id for row in rows]
    assert len(set(ledgerIDs)) == 2
    assert all(uuid.UUID(ledgerID).version == 7 for ledgerID in ledgerIDs)
    assert clientID not in ledgerIDs
    assert edge.ledgerIDs == ledgerIDs


@pytest_twisted.ensureDeferred
async def test_aModelWithoutAPriceIsRefusedUnderABudget(edge: Edge) -> None:
    """
    With a budget, a model without a price is 400 VALIDATION_ERROR on
    model, code NO_PRICE: never billed at zero. Without a budget it is
    forwarded as always.
    """
    edge.limit(orgBudget=Budget(nanoUSD=10**9, period="month"))
    response, answer = await edge.chat(model="echo")
    assert response.code == 400
    assert answer["error"]["code"] == "VALIDATION_ERROR"
    assert answer["error"]["field_errors"][0]["field"] == "model"
    assert answer["error"]["field_errors"][0]["code"] == "NO_PRICE"
    edge.limit()
    response, _ = await edge.chat(model="echo")
    assert response.code == 200


# The usage row of each forwarded request (decisions D12)


@pytest_twisted.ensureDeferred
async def test_eachForwardedRequestRecordsOneRow(edge: Edge) -> None:
    """
    A forwarded answer records one row: the request id, who asked, the
    model asked and the one that answered, the provider's usage and its
    cost at the model's price, to the nano-dollar.
    """
    response, answer = await edge.chat(model="priced")
    assert response.code == 200
    [row] = edge.ledger.rows
    usage = answer["usage"]
    assert row.request_id == header(response, "X-Request-ID")
    assert (row.org_id, row.agent_id) == (edge.orgID, edge.agentID)
    info = edge.auth.tokens[edge.token]
    assert isinstance(info, TokenInfo)
    assert row.token_id == info.tokenID
    assert (row.model_requested, row.model, row.provider) == ("priced", "priced", "scripted")
    assert (row.upstream_model, row.stream, row.outcome) == ("echo", False, "ok")
    assert (row.prompt_tokens, row.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert row.tokens_from == "provider"
    assert row.cost_nano_usd == usage["prompt_tokens"] * 2500 + usage["completion_tokens"] * 10_000
    assert len(row.price_version) == 16
    assert row.started_at_us > 0 and row.duration_us > 0


@pytest_twisted.ensureDeferred
async def test_rowsOfFailuresAndStreams(edge: Edge) -> None:
    """
    A provider's failure records a row with outcome upstream_error and no
    tokens; a stream records its usage event's tokens; a model without a
    price costs 0 with no price version (no budget applies).
    """
    failed, _ = await edge.chat(model="broken")
    assert failed.code == 502
    streamed, _ = await edge.chat(model="echo", stream=True)
    assert streamed.code == 200
    broken, stream = edge.ledger.rows
    assert (broken.outcome, broken.prompt_tokens, broken.completion_tokens) == (
        "upstream_error",
        0,
        0,
    )
    assert (stream.outcome, stream.stream, stream.tokens_from) == ("ok", True, "provider")
    assert stream.prompt_tokens > 0 and stream.completion_tokens > 0
    assert (stream.cost_nano_usd, stream.price_version) == (0, "")


@pytest_twisted.ensureDeferred
async def test_aStreamBrokenAfterItsFirstByte(edge: Edge) -> None:
    """
    A stream the provider cuts after its first events: the client got a
    200 and then the error event, so the row's outcome is upstream_error
    (not ok), with the tokens of its reservation, which the token limit
    keeps (only a failure before the first byte releases it).
    """
    edge.limit(org=Limits(tpm=100_000))
    response, answer = await edge.chat(model="cut", stream=True, max_tokens=10)
    assert response.code == 200
    assert b"UPSTREAM_ERROR" in answer["raw"]
    await waitFor(lambda: len(edge.ledger.rows) == 1)
    [row] = edge.ledger.rows
    assert (row.outcome, row.stream, row.tokens_from) == ("upstream_error", True, "reservation")
    assert (row.prompt_tokens, row.completion_tokens) == (4 + 4, 10)
    assert edge.tokensCounted() == 4 + 4 + 10
    assert edge.metric("svc_proxy_tokens_settled_total") == 0


@pytest_twisted.ensureDeferred
async def test_aClientGoneIsRecordedAtItsReservation(edge: Edge) -> None:
    """
    A client that leaves a stream before its usage: outcome client_gone,
    the tokens of its reservation (prompt estimate, output cap).
    """
    body = {
        "model": "endless",
        "stream": True,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    response = await treq.post(
        edge.url("/v1/chat/completions"), json.dumps(body).encode(), headers=edge.headers()
    )
    assert response.code == 200
    response.original.deliverBody(_Dropper())
    await waitFor(lambda: len(edge.ledger.rows) == 1)
    [row] = edge.ledger.rows
    assert (row.outcome, row.tokens_from) == ("client_gone", "reservation")
    assert (row.prompt_tokens, row.completion_tokens) == (4 + 4, 10)


@pytest_twisted.ensureDeferred
async def test_aFullOutboxRefusesBeforeForwarding(edge: Edge) -> None:
    """
    When the outbox is full, a request that would be forwarded is 503
    SERVICE_DEGRADED, never an unrecorded answer; others are not affected.
    """
    edge.ledger.full = True
    response, answer = await edge.chat(model="priced")
    assert response.code == 503
    assert answer["error"]["code"] == "SERVICE_DEGRADED"
    assert edge.ledger.rows == []
    probe = await treq.get(edge.url("/v1/internal/auth-probe"), headers=edge.headers())
    await probe.content()
    assert probe.code == 200
