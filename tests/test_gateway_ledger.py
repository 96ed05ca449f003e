"""
The usage ledger, prices and budgets end to end (decisions D12, issue 21):
real C{twistd} daemons (svc-auth, two svc-proxy on ports of their own), a
real PostgreSQL and Redis, the scripted upstream answering with usage
shaped like real providers' (with and without OpenAI's cached and
reasoning details), and budgets set with the real C{svcctl budget}.

What is checked, from outside the gateway only (HTTP answers, the ledger's
rows read from PostgreSQL as the schema owner, svcctl's output, gRPC):

  - one row per forwarded request, every field exact, the cost to the
    nano-dollar (computed here with L{decimal}, not with the product's
    prices module), for answers ok, failed upstream and abandoned by
    their client;
  - no row lost and none twice while svc-auth stops, PostgreSQL stops, a
    proxy is killed with C{kill -9} and another stopped with SIGTERM with
    rows waiting;
  - budgets under 64 concurrent clients over two proxies: spend never past
    the budget, refusals 429 BUDGET_EXCEEDED with Retry-After to the end of
    the month, still refused after Redis lost its counts;
  - reports (svcctl usage JSON and CSV, GetUsage) equal to the clients'
    own records;
  - the openai SDK's RateLimitError.
"""

from __future__ import annotations

import calendar
import contextlib
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
from authfixtures import Tenant, makeTenant
from test_gateway_e2e import Answer, request

from svcd.auth.migrations import migrate
from svcd.auth.store import Store
from svcd.testing.daemons import Daemon, authEnvironment
from svcd.testing.servers import PostgresServer, RedisServer, freePort
from svcd.testing.upstream import ScriptedUpstream

# Bounds on waits for what the daemons do on their own (rows reaching the
# ledger, a budget reaching the proxies): far above what they take, a
# guard against a hang on a loaded machine.
WAIT = 60.0

# The models of the providers file: gateway name -> (upstream model, price
# in dollars per million tokens as the file writes it, or None).
PRICE_A = {"input": "2.50", "output": "10.00", "cached_input": "1.25"}
PRICE_B = {"input": "0.15", "output": "0.60"}
# Nine decimals, so that a cost falls between two nano-dollars and must be
# rounded (half up).
PRICE_C = {"input": "0.333333333", "output": "1.777777777", "cached_input": "0.1"}
PRICE_D = {"input": "9", "output": "9"}
MODELS: dict[str, tuple[str, dict[str, str] | None]] = {
    # OpenAI's shape: cached and reasoning details.
    "detailed": ("usage:1234:321:1000:77", PRICE_A),
    # No details, as vLLM answers.
    "plain": ("usage:1200:300", PRICE_B),
    "broken": ("status:500", PRICE_A),
    "endless": ("never-ending", PRICE_C),
    # Fails, then its fallback answers (the row names both).
    "flaky": ("status:503", PRICE_D),
    "free": ("usage:10:5", None),
    # Usage equal to the reservation of BUDGET_BODY: a budget's count after
    # settlement is exactly what was reserved.
    "budgeted": ("usage:25:100", PRICE_A),
    # Usage below the reservation, answered late so that a burst is in
    # flight at once.
    "frugal": ("slow:1500+usage:5:20", PRICE_A),
}
FALLBACKS = {"flaky": ["plain"]}

MESSAGE = "hello there"
# The reservation of a request of BUDGET_BODY (decisions D11): a prompt of
# 63 bytes is 21 tokens, plus 4 for its one message; max_tokens 100.
BUDGET_CONTENT = "x" * 63
BUDGET_PROMPT, BUDGET_OUTPUT = 25, 100

LEDGER_COLUMNS = (
    "request_id",
    "org_id",
    "agent_id",
    "token_id",
    "model_requested",
    "model",
    "provider",
    "upstream_model",
    "stream",
    "outcome",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "tokens_from",
    "cost_nano_usd",
    "price_version",
    "started_at",
    "duration_us",
)


def nanoCost(price: Mapping[str, str] | None, prompt: int, cached: int, completion: int) -> int:
    """
    D12's cost in nano-dollars, rounded half up, computed in decimal.
    """
    if price is None:
        return 0
    inputPrice = Decimal(price["input"])
    cachedPrice = Decimal(price.get("cached_input", price["input"]))
    dollars = (
        (prompt - cached) * inputPrice
        + cached * cachedPrice
        + completion * Decimal(price["output"])
    ) / 10**6
    return int((dollars * 10**9).to_integral_value(ROUND_HALF_UP))


def dollars(nano: int) -> str:
    """
    Nano-dollars as D12's exact decimal string: at least two decimals, no
    trailing zero beyond them.
    """
    whole, fraction = divmod(nano, 10**9)
    return f"{whole}.{f'{fraction:09d}'.rstrip('0').ljust(2, '0')}"


def promptEstimate(*contents: str) -> int:
    """
    D11's estimate of a prompt of these messages.
    """
    return sum(-(-len(each.encode()) // 3) + 4 for each in contents)


def providersFile(path: Path, upstream: ScriptedUpstream) -> Path:
    text = [
        "[[providers]]",
        'name = "scripted"',
        f'base_url = "{upstream.baseURL}"',
        'timeout = "30s"',
        'idle_timeout = "30s"',
        "max_connections = 128",
    ]
    for name, (upstreamModel, price) in MODELS.items():
        text += ["", "[[models]]", f'name = "{name}"', 'provider = "scripted"']
        text.append(f'upstream_model = "{upstreamModel}"')
        if name in FALLBACKS:
            text.append("fallbacks = " + json.dumps(FALLBACKS[name]))
        if price is not None:
            entries = ", ".join(f'{key} = "{value}"' for key, value in price.items())
            text.append(f"price = {{ {entries} }}")
    path.write_text("\n".join(text) + "\n")
    return path


def svcctl(dsn: str, *words: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "svcd.auth.ctl", *words],
        env={**os.environ, "POSTGRES_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def svcctlDocument(dsn: str, *words: str) -> dict[str, Any]:
    result = svcctl(dsn, *words)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def waitUntil(condition: Callable[[], bool], what: str, limit: float = WAIT) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {limit} s"
        time.sleep(0.05)


def ledgerRows(dsn: str, where: str, parameters: tuple[Any, ...]) -> dict[str, dict[str, Any]]:
    """
    The ledger's rows matching C{where}, by request id, read as the schema
    owner (who sees every organization's rows).
    """
    with psycopg.connect(dsn, autocommit=True) as connection:
        cursor = connection.execute(
            f"SELECT {', '.join(LEDGER_COLUMNS)} FROM usage_ledger WHERE {where}",
            parameters,
        )
        return {
            str(row[0]): dict(zip(LEDGER_COLUMNS, row, strict=True)) for row in cursor.fetchall()
        }


def orgRows(dsn: str, orgID: uuid.UUID) -> dict[str, dict[str, Any]]:
    return ledgerRows(dsn, "org_id = %s", (orgID,))


def waitForRows(dsn: str, orgID: uuid.UUID, count: int) -> dict[str, dict[str, Any]]:
    """
    The organization's rows once there are C{count} of them (never more).
    """
    rows: dict[str, dict[str, Any]] = {}

    def arrived() -> bool:
        nonlocal rows
        rows = orgRows(dsn, orgID)
        assert len(rows) <= count, (len(rows), count)
        return len(rows) == count

    waitUntil(arrived, f"{count} ledger rows")
    return rows


def headersOf(tenant: Tenant, agent: uuid.UUID | None = None) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {tenant.token}",
        "X-SVC-Agent-ID": str(agent or tenant.agentID),
        "Content-Type": "application/json",
    }


def chatBody(model: str, content: str = MESSAGE, **extra: Any) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    ).encode()


def post(
    port: int, tenant: Tenant, body: bytes, agent: uuid.UUID | None = None, timeout: float = 60
) -> Answer:
    return request(
        port, "POST", "/v1/chat/completions", headersOf(tenant, agent), body, timeout=timeout
    )


def streamedUsage(answer: Answer) -> dict[str, Any] | None:
    """
    The usage chunk of a streamed answer, when it has one.
    """
    usage = None
    for line in answer.body.split(b"\n"):
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
    return usage


def gauge(daemon: Daemon, name: str) -> float:
    status, body = daemon.get("/metrics", timeout=5.0)
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def monthEnd(now: float) -> int:
    moment = datetime.datetime.fromtimestamp(now, datetime.UTC)
    days = calendar.monthrange(moment.year, moment.month)[1]
    start = datetime.datetime(moment.year, moment.month, 1, tzinfo=datetime.UTC)
    return int((start + datetime.timedelta(days=days)).timestamp())


@attrs.define
class Stack:
    dsn: str
    redis: RedisServer
    auth: Daemon
    proxies: list[Daemon]
    owner: Store
    markers: list[int] = attrs.Factory(lambda: [2000])

    def tenant(self, name: str) -> Tenant:
        return makeTenant(self.owner, name)

    def budget(
        self, tenant: Tenant, nano: int, agent: uuid.UUID | None = None, period: str = "month"
    ) -> None:
        where = ["--org", str(tenant.orgID)]
        if agent is not None:
            where += ["--agent", str(agent)]
        printed = svcctlDocument(
            self.dsn, "budget", "set", *where, "--usd", dollars(nano), "--period", period
        )
        assert printed["nano_usd"] == nano

    def seenEverywhere(self) -> None:
        """
        Set a limits row of a marker organization and wait until both
        proxies enforce it: the change feed carries changes in commit
        order, so every budget set before it is known to them too.
        """
        self.markers[0] += 1
        limit = str(self.markers[0])
        marker = self.tenant(f"marker-{limit}")
        svcctlDocument(self.dsn, "limits", "set", "--org", str(marker.orgID), "--rpm", limit)
        for proxy in self.proxies:

            def seen(port: int = proxy.httpPort) -> bool:
                answer = request(
                    port, "GET", "/v1/internal/auth-probe", headersOf(marker), timeout=10
                )
                return answer.headers.get("x-ratelimit-limit") == limit

            waitUntil(seen, "the marker's limit on a proxy", 10)


def startProxies(
    count: int, common: Mapping[str, str], workdir: Path, name: str = "proxy"
) -> list[Daemon]:
    return [
        Daemon(
            "svc-proxy", {**common, "SVC_PORT": str(freePort())}, workdir / f"{name}-{n}.log"
        ).start()
        for n in range(count)
    ]


def proxyEnvironment(auth: Daemon, redis: RedisServer, providers: Path) -> dict[str, str]:
    return {
        "SVC_HOST": "127.0.0.1",
        "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}",
        "REDIS_URL": redis.url,
        "SVC_PROVIDERS_FILE": str(providers),
        # Cold validations on a loaded machine; these tests are about usage.
        "SVC_AUTH_VALIDATE_TIMEOUT": "5s",
        "SVC_RATE_LIMIT_DEFAULT_RPM": "1000000",
    }


@pytest.fixture(scope="module")
def stack(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("ledger")
    name = f"ledger_{uuid.uuid4().hex[:12]}"
    dsn = postgresServer.createDatabase(name)
    migrate(dsn)
    redis = RedisServer.create(workdir / "redis")
    redis.start()
    upstream = ScriptedUpstream(workdir / "upstream").start()
    connection = psycopg.connect(dsn, autocommit=True)
    owner = Store(lambda: contextlib.nullcontext(connection))
    providers = providersFile(workdir / "providers.toml", upstream)
    auth = Daemon("svc-auth", authEnvironment(dsn), workdir / "auth.log").start()
    proxies: list[Daemon] = []
    try:
        proxies = startProxies(2, proxyEnvironment(auth, redis, providers), workdir)
        for daemon in [auth, *proxies]:
            daemon.waitForReady()
        yield Stack(dsn, redis, auth, proxies, owner)
    finally:
        for daemon in reversed([auth, *proxies]):
            daemon.terminate()
        upstream.stop()
        redis.destroy()
        connection.close()
        postgresServer.dropDatabase(name)
    for daemon in [auth, *proxies]:
        assert "Traceback" not in daemon.output(), daemon.output()


# 1. One row per forwarded request, exact.


@attrs.frozen
class Sent:
    """
    What a client knows of one request it sent.
    """

    requestID: str
    status: int
    before: datetime.datetime
    after: datetime.datetime


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def sent(answer: Callable[[], Answer]) -> tuple[Sent, Answer]:
    before = now()
    got = answer()
    return Sent(got.headers["x-request-id"], got.status, before, now()), got


def abandonedStream(port: int, tenant: Tenant, body: bytes) -> Sent:
    """
    A streamed request whose client reads the answer's first event, then
    closes its connection while the stream goes on.
    """
    before = now()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
            + "".join(f"{key}: {value}\r\n" for key, value in headersOf(tenant).items())
            + f"Content-Length: {len(body)}\r\n\r\n"
        )
        connection.sendall(head.encode() + body)
        received = b""
        while b"data: " not in received.partition(b"\r\n\r\n")[2]:
            chunk = connection.recv(65536)
            assert chunk, received
            received += chunk
    match = re.search(rb"(?im)^x-request-id: *(\S+)\r$", received)
    assert match is not None and received.startswith(b"HTTP/1.1 200 "), received
    return Sent(match.group(1).decode(), 200, before, now())


def test_oneExactRowPerForwardedRequest(stack: Stack) -> None:
    """
    Through the real stack, each forwarded request leaves one row whose
    every field is what happened: non-stream and stream answers with
    OpenAI's usage details and without, an upstream 500, a fallback, a
    model without a price, and a stream its client abandoned (its tokens
    the reservation's, its cost those at the price). The request id is the
    X-Request-ID the client got; costs are exact to the nano-dollar.
    """
    tenant = stack.tenant("rows")
    first, second = (proxy.httpPort for proxy in stack.proxies)
    cases: dict[str, tuple[Sent, dict[str, Any]]] = {}

    def expect(name: str, result: tuple[Sent, Answer], **fields: Any) -> None:
        cases[name] = (result[0], fields)

    expect(
        "detailed",
        sent(lambda: post(first, tenant, chatBody("detailed"))),
        model_requested="detailed",
        model="detailed",
        upstream_model="usage:1234:321:1000:77",
        stream=False,
        outcome="ok",
        tokens=(1234, 1000, 321, 77),
        tokens_from="provider",
        price=PRICE_A,
    )
    detailedStream = sent(lambda: post(second, tenant, chatBody("detailed", stream=True)))
    expect(
        "detailed stream",
        detailedStream,
        model_requested="detailed",
        model="detailed",
        upstream_model="usage:1234:321:1000:77",
        stream=True,
        outcome="ok",
        tokens=(1234, 1000, 321, 77),
        tokens_from="provider",
        price=PRICE_A,
    )
    # The client did not ask for usage: the proxy asked for it anyway and
    # did not relay it.
    assert streamedUsage(detailedStream[1]) is None
    plainStream = sent(
        lambda: post(
            first,
            tenant,
            chatBody("plain", stream=True, stream_options={"include_usage": True}),
        )
    )
    assert streamedUsage(plainStream[1]) == {
        "prompt_tokens": 1200,
        "completion_tokens": 300,
        "total_tokens": 1500,
    }
    expect(
        "plain stream",
        plainStream,
        model_requested="plain",
        model="plain",
        upstream_model="usage:1200:300",
        stream=True,
        outcome="ok",
        tokens=(1200, 0, 300, 0),
        tokens_from="provider",
        price=PRICE_B,
    )
    expect(
        "plain",
        sent(lambda: post(second, tenant, chatBody("plain"))),
        model_requested="plain",
        model="plain",
        upstream_model="usage:1200:300",
        stream=False,
        outcome="ok",
        tokens=(1200, 0, 300, 0),
        tokens_from="provider",
        price=PRICE_B,
    )
    expect(
        "broken",
        sent(lambda: post(first, tenant, chatBody("broken"))),
        model_requested="broken",
        model="broken",
        upstream_model="status:500",
        stream=False,
        outcome="upstream_error",
        tokens=(0, 0, 0, 0),
        tokens_from="provider",
        price=PRICE_A,
    )
    expect(
        "broken stream",
        sent(lambda: post(second, tenant, chatBody("broken", stream=True))),
        model_requested="broken",
        model="broken",
        upstream_model="status:500",
        stream=True,
        outcome="upstream_error",
        tokens=(0, 0, 0, 0),
        tokens_from="provider",
        price=PRICE_A,
    )
    expect(
        "fallback",
        sent(lambda: post(first, tenant, chatBody("flaky"))),
        model_requested="flaky",
        model="plain",
        upstream_model="usage:1200:300",
        stream=False,
        outcome="ok",
        tokens=(1200, 0, 300, 0),
        tokens_from="provider",
        price=PRICE_B,
    )
    expect(
        "no price",
        sent(lambda: post(second, tenant, chatBody("free"))),
        model_requested="free",
        model="free",
        upstream_model="usage:10:5",
        stream=False,
        outcome="ok",
        tokens=(10, 0, 5, 0),
        tokens_from="provider",
        price=None,
    )
    abandoned = abandonedStream(first, tenant, chatBody("endless", stream=True, max_tokens=50))
    cases["client gone"] = (
        abandoned,
        {
            "model_requested": "endless",
            "model": "endless",
            "upstream_model": "never-ending",
            "stream": True,
            "outcome": "client_gone",
            "tokens": (promptEstimate(MESSAGE), 0, 50, 0),
            "tokens_from": "reservation",
            "price": PRICE_C,
        },
    )

    statuses = {name: each.status for name, (each, _) in cases.items()}
    assert statuses == {
        **dict.fromkeys(cases, 200),
        "broken": statuses["broken"],
        "broken stream": statuses["broken stream"],
    }
    assert statuses["broken"] >= 500 and statuses["broken stream"] >= 500, statuses

    rows = waitForRows(stack.dsn, tenant.orgID, len(cases))
    versions: dict[str, set[str]] = {}
    for name, (client, fields) in cases.items():
        row = rows[client.requestID]
        prompt, cached, completion, reasoning = fields["tokens"]
        expected = {
            "request_id": client.requestID,
            "org_id": tenant.orgID,
            "agent_id": tenant.agentID,
            "token_id": tenant.tokenID,
            "model_requested": fields["model_requested"],
            "model": fields["model"],
            "provider": "scripted",
            "upstream_model": fields["upstream_model"],
            "stream": fields["stream"],
            "outcome": fields["outcome"],
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": completion,
            "reasoning_tokens": reasoning,
            "tokens_from": fields["tokens_from"],
            "cost_nano_usd": nanoCost(fields["price"], prompt, cached, completion),
        }
        assert {key: row[key] for key in expected} == expected, name
        assert client.before <= row["started_at"] <= client.after, name
        elapsed = client.after - client.before
        assert 0 < row["duration_us"] <= elapsed / datetime.timedelta(microseconds=1), name
        if fields["price"] is None:
            assert row["price_version"] == "", name
        else:
            assert re.fullmatch(r"[0-9a-f]{16}", row["price_version"]), name
            versions.setdefault(json.dumps(fields["price"]), set()).add(row["price_version"])
    # One version per price entry, different entries different versions.
    assert all(len(each) == 1 for each in versions.values()), versions
    assert len({version for each in versions.values() for version in each}) == len(versions)
    # The figures the report gives: the exact costs of the two shapes.
    assert rows[cases["detailed"][0].requestID]["cost_nano_usd"] == 5_045_000
    assert rows[cases["plain"][0].requestID]["cost_nano_usd"] == 360_000
    assert rows[cases["client gone"][0].requestID]["cost_nano_usd"] == 91_556
