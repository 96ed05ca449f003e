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

import contextlib
import csv
import datetime
import http.client
import io
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import openai
import psycopg
import pytest
from authfixtures import Tenant, makeTenant
from gatewayfixtures import Answer

# Autouse: no test here straddles the end of a UTC day (a budget's period).
from ledgerfixtures import (
    PRICE_A,
    PRICE_B,
    PRICE_D,
    WAIT,
    Received,
    Stack,
    assertBudgetRefusal,
    burst,
    dollars,
    headersOf,
    ledgerRows,
    monthEnd,
    nanoCost,
    orgRows,
    post,
    proxyEnvironment,
    roomInTheDay,  # noqa: F401
    runningStack,
    spend,
    svcctl,
    svcctlDocument,
    waitForRows,
    waitUntil,
)

from svcd.auth.authority import issueToken
from svcd.auth.store import Store
from svcd.common.migrations import migrate
from svcd.common.permissions import Permission
from svcd.devkit.daemons import Daemon, authEnvironment
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

# Nine decimals, so that a cost falls between two nano-dollars and must be
# rounded (half up).
PRICE_C = {"input": "0.333333333", "output": "1.777777777", "cached_input": "0.1"}
MODELS: dict[str, tuple[str, dict[str, str] | None]] = {
    # OpenAI's shape: cached and reasoning details.
    "detailed": ("usage:1234:321:1000:77", PRICE_A),
    # No details, as vLLM answers.
    "plain": ("usage:1200:300", PRICE_B),
    "broken": ("status:500", PRICE_A),
    "endless": ("never-ending", PRICE_C),
    # A stream the provider cuts after its first events.
    "cut": ("close-mid-stream", PRICE_C),
    # An answer that comes too late for its client.
    "late": ("slow:60000+usage:1:1", PRICE_C),
    # Fails, then its fallback answers (the row names both).
    "flaky": ("status:503", PRICE_D),
    "free": ("usage:10:5", None),
    # Usage equal to the reservation of BUDGET_BODY: the most the request
    # allows (decisions D12, amended: every byte sent a token of prompt,
    # the cap of answer), so a budget's count after settlement is exactly
    # what was reserved.
    "budgeted": ("usage-at-cap", PRICE_A),
    # Usage below the reservation, answered late so that a burst is in
    # flight at once.
    "frugal": ("slow:1500+usage:5:20", PRICE_A),
}
FALLBACKS = {"flaky": ["plain"]}

MESSAGE = "hello there"
# The budget's worst case of a request of BUDGET_BODY (decisions D12,
# amended): one token per byte of the body the model "budgeted" is sent,
# counted by hand: 62 bytes up to the content ({"model":"usage-at-cap",
# "messages":[{"role":"user","content":"), its 63, then 21
# ("}],"max_tokens":100}); max_tokens 100.
BUDGET_CONTENT = "x" * 63
BUDGET_PROMPT, BUDGET_OUTPUT = 62 + 63 + 21, 100


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


def chatBody(model: str, content: str = MESSAGE, **extra: Any) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    ).encode()


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


@pytest.fixture(scope="module")
def stack(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    with runningStack(postgresServer, tmp_path_factory.mktemp("ledger"), providersFile) as running:
        yield running


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


def abandonedWhole(stack: Stack, port: int, tenant: Tenant, body: bytes) -> Sent:
    """
    A request (not streamed) whose client leaves once the provider has it,
    long before its answer. The client never saw an X-Request-ID: the
    request id is the one the provider received.
    """
    before = now()
    known = {each.number for each in stack.upstream.requests()}
    arrived: list[str] = []

    def atTheProvider() -> bool:
        for each in stack.upstream.requests():
            if each.number not in known and each.body == {
                **json.loads(body),
                "model": "slow:60000+usage:1:1",
            }:
                arrived.append(each.header("x-request-id") or "")
                return True
        return False

    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
            + "".join(f"{key}: {value}\r\n" for key, value in headersOf(tenant).items())
            + f"Content-Length: {len(body)}\r\n\r\n"
        )
        connection.sendall(head.encode() + body)
        waitUntil(atTheProvider, "the request at the provider")
    return Sent(arrived[0], 0, before, now())


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
    cut = sent(lambda: post(second, tenant, chatBody("cut", stream=True, max_tokens=40)))
    # The client got the status line and the first events, then the error
    # event that ends a stream.
    assert b'"code": "UPSTREAM_ERROR"' in cut[1].body or b'"code":"UPSTREAM_ERROR"' in cut[1].body
    expect(
        "cut stream",
        cut,
        model_requested="cut",
        model="cut",
        upstream_model="close-mid-stream",
        stream=True,
        outcome="upstream_error",
        # No usage came: the reservation's tokens, as the limits keep them
        # for an answer that failed after its first byte (D11).
        tokens=(promptEstimate(MESSAGE), 0, 40, 0),
        tokens_from="reservation",
        price=PRICE_C,
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

    gone = abandonedWhole(stack, second, tenant, chatBody("late", max_tokens=30))
    cases["client gone, not streamed"] = (
        gone,
        {
            "model_requested": "late",
            "model": "late",
            "upstream_model": "slow:60000+usage:1:1",
            "stream": False,
            "outcome": "client_gone",
            "tokens": (promptEstimate(MESSAGE), 0, 30, 0),
            "tokens_from": "reservation",
            "price": PRICE_C,
        },
    )

    statuses = {name: each.status for name, (each, _) in cases.items()}
    assert statuses == {
        **dict.fromkeys(cases, 200),
        "client gone, not streamed": 0,
        "broken": statuses["broken"],
        "broken stream": statuses["broken stream"],
    }
    assert statuses["broken"] >= 500 and statuses["broken stream"] >= 500, statuses

    rows = waitForRows(stack.dsn, tenant.orgID, len(cases))
    read = now()
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
            # A chat completion a client made itself (decisions D13).
            "kind": "chat",
            "parent_request_id": None,
        }
        assert {key: row[key] for key in expected} == expected, name
        assert client.before <= row["started_at"] <= client.after, name
        # A row ends with its answer; the proxy may notice a client gone
        # after the client saw itself leave.
        ended = read if fields["outcome"] == "client_gone" else client.after
        elapsed = ended - client.before
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


# 3. Budgets.

# What a request of budgetBody() reserves against a budget, and (with the
# model "budgeted") what it costs once answered.
WORST_CASE = nanoCost(PRICE_A, BUDGET_PROMPT, 0, BUDGET_OUTPUT)


def budgetBody(model: str = "budgeted") -> bytes:
    return chatBody(model, BUDGET_CONTENT, max_tokens=BUDGET_OUTPUT)


def sentLength(model: str) -> int:
    """
    The bytes budgetBody(model) is forwarded as: compact, the model's
    upstream name in place, the client's cap kept (nothing added).
    """
    sent = {
        "model": MODELS[model][0],
        "messages": [{"role": "user", "content": BUDGET_CONTENT}],
        "max_tokens": BUDGET_OUTPUT,
    }
    return len(json.dumps(sent, separators=(",", ":")))


assert sentLength("budgeted") == BUDGET_PROMPT


def dayEnd(now: float) -> int:
    return (int(now) // 86400 + 1) * 86400


def test_anOrganizationsBudgetIsNeverPassed(stack: Stack) -> None:
    """
    A monthly budget of five requests' worst case plus a nano-dollar, and
    64 concurrent clients over two proxies whose answers cost exactly what
    they reserved: five admitted, 59 refused BUDGET_EXCEEDED (scope org,
    Retry-After to the month's end), the ledger's spend at most the
    budget. Then Redis loses everything (FLUSHALL): the next request on
    either proxy is still refused, the spend taken again from the ledger.
    A model without a price under a budget is 400 NO_PRICE, never
    forwarded.
    """
    tenant = stack.tenant("budget")
    budget = 5 * WORST_CASE + 1
    stack.budget(tenant, budget)
    stack.seenEverywhere()
    received = burst(stack, tenant, budgetBody())
    admitted = [each.answer for each in received if each.answer.status == 200]
    assert len(admitted) == 5, sorted(each.answer.status for each in received)
    for each in received:
        if each.answer.status != 200:
            assertBudgetRefusal(each, "org")
    rows = waitForRows(stack.dsn, tenant.orgID, 5)
    assert set(rows) == {answer.headers["x-request-id"] for answer in admitted}
    assert spend(rows) == 5 * WORST_CASE <= budget
    print(f"org budget {budget}: 64 sent, 5 admitted, spend {spend(rows)}, overshoot 0")

    stack.redis.command("FLUSHALL")
    for proxy in stack.proxies:
        answer = post(proxy.httpPort, tenant, budgetBody())
        assertBudgetRefusal(Received(answer, time.time()), "org")

    answer = post(stack.proxies[0].httpPort, tenant, chatBody("free"))
    assert answer.status == 400
    error = answer.json()["error"]
    assert error["code"] == "VALIDATION_ERROR"
    assert [(each["field"], each["code"]) for each in error["field_errors"]] == [
        ("model", "NO_PRICE")
    ]
    assert len(orgRows(stack.dsn, tenant.orgID)) == 5


def test_answersCheaperThanReservedNeverPassTheBudget(stack: Stack) -> None:
    """
    Answers that cost less than they reserved (the scripted usage below the
    reservation, answered 1.5 s late so the burst is in flight at once):
    at least the five the budget holds are admitted, and the ledger's
    spend still never passes the budget.
    """
    tenant = stack.tenant("frugal")
    # Its upstream model's name is longer than "budgeted"'s: so is its body.
    budget = 5 * nanoCost(PRICE_A, sentLength("frugal"), 0, BUDGET_OUTPUT) + 1
    stack.budget(tenant, budget)
    stack.seenEverywhere()
    received = burst(stack, tenant, budgetBody("frugal"))
    admitted = [each.answer for each in received if each.answer.status == 200]
    assert len(admitted) >= 5
    for each in received:
        if each.answer.status != 200:
            assertBudgetRefusal(each, "org")
    rows = waitForRows(stack.dsn, tenant.orgID, len(admitted))
    assert all(row["cost_nano_usd"] == nanoCost(PRICE_A, 5, 0, 20) for row in rows.values())
    assert spend(rows) <= budget
    print(
        f"cheaper answers, budget {budget}: 64 sent, {len(admitted)} admitted,"
        f" spend {spend(rows)}, overshoot {max(0, spend(rows) - budget)}"
    )


def test_anAgentsBudgetBelowItsOrganizations(stack: Stack) -> None:
    """
    An agent's daily budget of three requests under its organization's
    monthly one of a hundred: of 64 concurrent requests of that agent,
    three are admitted and 61 refused as the agent's budget, Retry-After
    to the end of the UTC day; the organization's other agent goes on.
    After Redis lost its counts (FLUSHALL), the same on both proxies.
    """
    tenant = stack.tenant("agentcap")
    other = stack.owner.createAgent(tenant.orgID, "other", "active").agentID
    stack.budget(tenant, 100 * WORST_CASE)
    stack.budget(tenant, 3 * WORST_CASE + 1, agent=tenant.agentID, period="day")
    stack.seenEverywhere()
    received = burst(stack, tenant, budgetBody())
    assert sum(each.answer.status == 200 for each in received) == 3
    for each in received:
        if each.answer.status != 200:
            assertBudgetRefusal(each, "agent", dayEnd)
    others = burst(stack, tenant, budgetBody(), count=8, agent=other)
    assert [each.answer.status for each in others] == [200] * 8
    rows = waitForRows(stack.dsn, tenant.orgID, 11)
    agentRows = {key: row for key, row in rows.items() if row["agent_id"] == tenant.agentID}
    assert spend(agentRows) == 3 * WORST_CASE
    # Redis loses the counts: the agent's spend is taken again from the
    # ledger (GetSpend of that agent), and it is still refused.
    stack.redis.command("FLUSHALL")
    for proxy in stack.proxies:
        answer = post(proxy.httpPort, tenant, budgetBody())
        assertBudgetRefusal(Received(answer, time.time()), "agent", dayEnd)
        assert post(proxy.httpPort, tenant, budgetBody(), agent=other).status == 200


# 5. The SDK.


def test_theSdkSeesRateLimitErrorForABudget(stack: Stack) -> None:
    """
    The official openai SDK raises RateLimitError with the
    BUDGET_EXCEEDED envelope once the budget is spent.
    """
    tenant = stack.tenant("sdk")
    stack.budget(tenant, WORST_CASE + 1)
    stack.seenEverywhere()
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.proxies[0].httpPort}/v1",
        api_key=tenant.token,
        default_headers={"X-SVC-Agent-ID": str(tenant.agentID)},
        max_retries=0,
    )
    messages: Any = [{"role": "user", "content": BUDGET_CONTENT}]
    client.chat.completions.create(model="budgeted", messages=messages, max_tokens=BUDGET_OUTPUT)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(
            model="budgeted", messages=messages, max_tokens=BUDGET_OUTPUT
        )
    body: Any = caught.value.body
    assert body["code"] == "BUDGET_EXCEEDED"
    assert body["detail"] == {"scope": "org"}
    retryAfter = int(caught.value.response.headers["retry-after"])
    assert abs(retryAfter - (monthEnd(time.time()) - time.time())) <= 2


# 4. Reports.

SUMMED = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")
# Decisions D14: after cost_usd, so that D12's columns stay where they were.
WRITES = "cache_write_tokens"


def clientSums(records: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """
    What a report grouped by C{key} must say, from the clients' records.
    """
    sums: dict[str, dict[str, Any]] = {}
    for each in records:
        group = sums.setdefault(
            each[key], {"requests": 0, **dict.fromkeys(SUMMED, 0), "cost_usd": 0, WRITES: 0}
        )
        group["requests"] += 1
        for field in (*SUMMED, WRITES):
            group[field] += each[field]
        group["cost_usd"] += each["cost"]
    return {
        group: {**values, "cost_usd": dollars(values["cost_usd"])} for group, values in sums.items()
    }


def test_reportsEqualTheClientsRecords(stack: Stack) -> None:
    """
    After a known set of requests (three models, one without a price, two
    agents, stream and not), svcctl usage by model, agent and day, as JSON
    and as CSV, and GetUsage with a UsageRead token, give the sums the
    clients make of their own answers' usage at the providers file's
    prices, costs as exact decimal strings. Another organization's agent
    is PERMISSION_DENIED.
    """
    tenant = stack.tenant("report")
    second = stack.owner.createAgent(tenant.orgID, "second", "active").agentID
    reader, _ = issueToken(stack.owner, orgID=tenant.orgID, permissions=int(Permission.UsageRead))
    plan = [
        (tenant.agentID, "detailed", False),
        (tenant.agentID, "detailed", True),
        (tenant.agentID, "plain", False),
        (tenant.agentID, "free", False),
        (second, "detailed", False),
        (second, "plain", True),
        (second, "plain", False),
        (second, "free", True),
    ]
    records = []
    for index, (agent, model, stream) in enumerate(plan):
        extra: dict[str, Any] = (
            {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        )
        day = now().strftime("%Y-%m-%d")
        answer = post(stack.proxies[index % 2].httpPort, tenant, chatBody(model, **extra), agent)
        assert answer.status == 200, answer.body
        usage = streamedUsage(answer) if stream else answer.json()["usage"]
        assert usage is not None
        prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        written = (usage.get("prompt_tokens_details") or {}).get(WRITES, 0)
        reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        records.append(
            {
                "model": model,
                "agent": str(agent),
                "day": day,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "completion_tokens": completion,
                "reasoning_tokens": reasoning,
                WRITES: written,
                "cost": nanoCost(MODELS[model][1], prompt, cached, completion, written),
            }
        )
    waitForRows(stack.dsn, tenant.orgID, len(plan))
    total = clientSums([{**each, "all": ""} for each in records], "all")[""]
    assert total["cost_usd"] == dollars(3 * 5_045_000 + 3 * 360_000)

    channel = grpc.insecure_channel(f"127.0.0.1:{stack.auth.environment['SVC_GRPC_PORT']}")
    stub = auth_pb2_grpc.AuthServiceStub(channel)
    metadata = (("authorization", f"Bearer {reader}"),)
    try:
        for by in ("model", "agent", "day"):
            expected = clientSums(records, by)
            arguments = ("usage", "--org", str(tenant.orgID), "--by", by)
            printed = svcctlDocument(stack.dsn, *arguments, "--format", "json")
            assert printed["by"] == by
            assert {each.pop("key"): each for each in printed["rows"]} == expected, by
            assert printed["total"] == total
            result = svcctl(stack.dsn, *arguments, "--format", "csv")
            assert result.returncode == 0 and result.stderr == "", result.stderr
            lines = list(csv.reader(io.StringIO(result.stdout)))
            assert lines[0] == ["key", "requests", *SUMMED, "cost_usd", WRITES]
            assert {
                line[0]: dict(zip(lines[0][1:], line[1:], strict=True)) for line in lines[1:]
            } == {
                key: {field: str(value) for field, value in values.items()}
                for key, values in expected.items()
            }
            answer = stub.GetUsage(auth_pb2.GetUsageRequest(by=by), metadata=metadata, timeout=10)
            assert (answer.org_id, answer.by) == (str(tenant.orgID), by)
            fields = ("requests", *SUMMED, "cost_usd", WRITES)
            assert {
                each.key: {field: getattr(each, field) for field in fields} for each in answer.rows
            } == expected, by
            assert {field: getattr(answer.total, field) for field in fields} == total
        stranger = stack.tenant("stranger")
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetUsage(
                auth_pb2.GetUsageRequest(agent_id=str(stranger.agentID)),
                metadata=metadata,
                timeout=10,
            )
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        channel.close()


# 2. Nothing lost.

# How long each outage of the load test lasts at least (issue 21 asks for
# about 10 s; 5 s keep its spirit, the load runs through each outage) and
# how many answers the clients must have had during it.
OUTAGE = 5.0
ANSWERS_PER_PHASE = 20
CLIENTS = 6


@attrs.define
class Load:
    """
    A few clients in threads, each sending requests in turn to the two
    proxies, keeping the request id of every 200 it got.
    """

    proxies: list[Daemon]
    tenant: Tenant
    body: bytes
    answered: set[str] = attrs.Factory(set)
    statuses: dict[str, int] = attrs.Factory(dict)
    lock: threading.Lock = attrs.Factory(threading.Lock)
    stopping: threading.Event = attrs.Factory(threading.Event)
    threads: list[threading.Thread] = attrs.Factory(list)

    def start(self) -> None:
        for index in range(CLIENTS):
            thread = threading.Thread(target=self._client, args=(index,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _client(self, index: int) -> None:
        turn = index
        while not self.stopping.is_set():
            turn += 1
            try:
                answer = post(self.proxies[turn % 2].httpPort, self.tenant, self.body, timeout=30)
            except (OSError, http.client.HTTPException) as error:
                self._count(type(error).__name__)
                # Not a wait for anything: a refused connection comes back
                # at once, and the client must not spin on it.
                self.stopping.wait(0.02)
                continue
            self._count(str(answer.status))
            if answer.status == 200:
                with self.lock:
                    self.answered.add(answer.headers["x-request-id"])

    def _count(self, what: str) -> None:
        with self.lock:
            self.statuses[what] = self.statuses.get(what, 0) + 1

    def total(self) -> int:
        with self.lock:
            return sum(self.statuses.values())

    def ok(self) -> int:
        with self.lock:
            return len(self.answered)

    def moreAnswers(self, count: int = ANSWERS_PER_PHASE) -> None:
        """
        Wait until the clients have had C{count} more 200s.
        """
        start = self.ok()
        waitUntil(lambda: self.ok() >= start + count, f"{count} more answers")

    def through(self, seconds: float = OUTAGE) -> None:
        """
        Let the load run for at least C{seconds} and at least
        L{ANSWERS_PER_PHASE} answers of any kind (an outage exercised
        under load, not only lasted).
        """
        start, begun = self.total(), time.monotonic()
        waitUntil(
            lambda: (
                time.monotonic() - begun >= seconds and self.total() >= start + ANSWERS_PER_PHASE
            ),
            "the load through an outage",
            seconds + WAIT,
        )

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(WAIT)
            assert not thread.is_alive()


@contextlib.contextmanager
def ledgerLocked(dsn: str) -> Iterator[None]:
    """
    Hold a lock on the ledger's table that lets reads through and no
    insert: svc-auth's RecordUsage waits past its statement timeout and
    answers UNAVAILABLE while everything else works.
    """
    with psycopg.connect(dsn) as connection:
        connection.execute("LOCK TABLE usage_ledger IN EXCLUSIVE MODE")
        try:
            yield
        finally:
            connection.rollback()


def killed(proxy: Daemon) -> None:
    proxy.signal(signal.SIGKILL)
    assert proxy.process is not None
    assert proxy.process.wait(WAIT) == -signal.SIGKILL


def restartedWithJournal(proxy: Daemon) -> int:
    """
    Start a killed proxy again; the rows its log says it found
    unacknowledged in its journal and sent first (the line comes before
    it listens; none when the journal held none).
    """
    logged = proxy.logFile.stat().st_size
    proxy.start()
    proxy.waitForReady()

    def found() -> list[bytes]:
        with proxy.logFile.open("rb") as log:
            log.seek(logged)
            text = log.read()
        return re.findall(
            rb"(?:(\d+) usage row\(s\) not acknowledged by svc-auth; sending them first)"
            rb"|(svc-proxy listening on)",
            text,
        )

    # The log reaches the file when the process writes it out, not
    # necessarily by the time the proxy answers.
    waitUntil(lambda: any(listening for _, listening in found()), "the restarted proxy's log")
    counts = [int(count) for count, _ in found() if count]
    assert len(counts) <= 1, counts
    return counts[0] if counts else 0


def test_noRowLostNorTwiceThroughOutagesAndKills(
    privatePostgres: PostgresServer, scriptedUpstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """
    Steady load (six clients in threads) through two proxies, the first
    with SVC_USAGE_JOURNAL. In turn, each for at least 5 s under load (the
    issue asks about 10 s; 5 keep its spirit): svc-auth stopped and
    started; PostgreSQL stopped and started (authentication fails closed
    while the feed is down, so few requests are answered then); the
    ledger's table locked against inserts (everything else up: rows pile
    up in both proxies), the journalled proxy killed with kill -9 with its
    rows waiting and started again at once, the table unlocked; then,
    everything up, the journalled proxy killed with kill -9 again and
    started again. Once the load stops and both outboxes are empty, the
    ledger holds exactly one row for each request id the clients got a 200
    for, and no row twice. (A request whose answer the kill cut off leaves
    no row: the row is made when the answer ends. A row whose answer was
    written but never read by its client would be an extra; the figures
    printed name any.)

    Then a graceful stop with rows waiting against the real svc-auth: the
    table locked, three requests answered by the second proxy, its
    SIGTERM, the table unlocked: the proxy sends the three rows before it
    exits 0.
    """
    dsn = privatePostgres.createDatabase("ledger")
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as connection:
        tenant = makeTenant(Store(lambda: contextlib.nullcontext(connection)), "steady")
    redis = RedisServer.create(tmp_path / "redis")
    redis.start()
    providers = providersFile(tmp_path / "providers.toml", scriptedUpstream)
    auth = Daemon("svc-auth", authEnvironment(dsn), tmp_path / "auth.log").start()
    journal = tmp_path / "usage.journal"
    common = proxyEnvironment(auth, redis, providers)
    proxies = [
        Daemon(
            "svc-proxy",
            {
                **common,
                "SVC_PORT": str(freePort()),
                "SVC_USAGE_JOURNAL": str(journal),
                # Its log read as it is written.
                "PYTHONUNBUFFERED": "1",
            },
            tmp_path / "journalled.log",
        ),
        Daemon(
            "svc-proxy",
            {
                **common,
                "SVC_PORT": str(freePort()),
                "SVC_SHUTDOWN_TIMEOUT": "60s",
                "PYTHONUNBUFFERED": "1",
            },
            tmp_path / "plain.log",
        ),
    ]
    load = Load(proxies, tenant, chatBody("plain"))
    figures: dict[str, Any] = {}
    try:
        for proxy in proxies:
            proxy.start()
        for daemon in [auth, *proxies]:
            daemon.waitForReady()
        load.start()
        load.moreAnswers()

        auth.terminate()
        load.through()
        auth.start()
        auth.waitForReady()
        load.moreAnswers()

        privatePostgres.stop()
        figures["ok before PostgreSQL stopped"] = load.ok()
        load.through()
        figures["ok while PostgreSQL was down"] = (
            load.ok() - figures["ok before PostgreSQL stopped"]
        )
        privatePostgres.start()
        load.moreAnswers()

        # The ledger's table locked: svc-auth and PostgreSQL up, tokens
        # validated, RecordUsage failing (its inserts wait past the
        # statement timeout): rows pile up in both proxies under load, and
        # the journalled proxy is killed with them waiting.
        with ledgerLocked(dsn):
            load.through()
            waitUntil(
                lambda: gauge(proxies[0], "svc_proxy_usage_outbox_rows") >= 10,
                "rows waiting in the journalled proxy",
            )
            figures["waiting at the first kill"] = waiting = int(
                gauge(proxies[0], "svc_proxy_usage_outbox_rows")
            )
            killed(proxies[0])
            replayed = restartedWithJournal(proxies[0])
            figures["replayed at the first restart"] = replayed
            assert replayed >= waiting
            load.moreAnswers()
            figures["waiting when the table was unlocked"] = [
                int(gauge(proxy, "svc_proxy_usage_outbox_rows")) for proxy in proxies
            ]

        # And everything up.
        load.moreAnswers()
        killed(proxies[0])
        figures["replayed at the second restart"] = restartedWithJournal(proxies[0])
        load.moreAnswers()
        load.stop()

        def settled() -> bool:
            return all(gauge(proxy, "svc_proxy_usage_outbox_rows") == 0 for proxy in proxies)

        waitUntil(settled, "both outboxes empty")
        rows = ledgerRows(dsn, "org_id = %s", (tenant.orgID,))
        waitUntil(
            lambda: load.answered <= set(ledgerRows(dsn, "org_id = %s", (tenant.orgID,))),
            "a row for every answer",
        )
        rows = ledgerRows(dsn, "org_id = %s", (tenant.orgID,))
        with psycopg.connect(dsn, autocommit=True) as connection:
            counted = connection.execute(
                "SELECT count(*), count(DISTINCT request_id) FROM usage_ledger"
            ).fetchone()
        figures.update(
            answered=len(load.answered),
            rows=len(rows),
            extras=sorted(set(rows) - load.answered),
            statuses=dict(load.statuses),
        )
        print("ledger under outages:", json.dumps(figures))
        assert counted == (len(rows), len(rows))
        assert set(rows) >= load.answered
        # An extra row is an answer the proxy ended that its client never
        # read (cut by the kill); never more than the clients in flight.
        extras = set(rows) - load.answered
        assert len(extras) <= 2 * CLIENTS, figures
        assert all(rows[each]["outcome"] in ("ok", "client_gone") for each in extras)

        # A graceful stop sends the rows still waiting.
        locked = ledgerLocked(dsn)
        locked.__enter__()
        lastIDs = []
        for _ in range(3):
            answer = post(proxies[1].httpPort, tenant, chatBody("plain"))
            assert answer.status == 200, answer.body
            lastIDs.append(answer.headers["x-request-id"])
        waitUntil(lambda: gauge(proxies[1], "svc_proxy_usage_outbox_rows") == 3, "3 rows waiting")
        proxies[1].signal(signal.SIGTERM)
        waitUntil(
            lambda: "Sending 3 usage row(s) to svc-auth before stopping" in proxies[1].output(),
            "the flush at stop",
        )
        locked.__exit__(None, None, None)
        assert proxies[1].process is not None
        assert proxies[1].process.wait(WAIT) == 0
        assert set(lastIDs) <= set(ledgerRows(dsn, "org_id = %s", (tenant.orgID,)))
        assert "usage row(s) not acknowledged" not in proxies[1].output()
    finally:
        load.stop()
        for daemon in [*proxies, auth]:
            if daemon.process is not None:
                daemon.terminate()
        redis.destroy()
    for daemon in [auth, *proxies]:
        assert "Traceback" not in daemon.output(), daemon.output()


def test_aFullOutboxRefusesUntilSvcAuthTakesRows(stack: Stack) -> None:
    """
    A proxy whose outbox holds 5 rows (SVC_USAGE_OUTBOX_MAX=5) while
    svc-auth cannot record them (the ledger's table locked): five requests
    answered, the sixth refused 503 SERVICE_DEGRADED before it reaches the
    provider (no row for it, ever); once the table is free the five rows
    are recorded and the proxy forwards again.
    """
    tenant = stack.tenant("outbox")
    environment = {
        **stack.proxies[0].environment,
        "SVC_PORT": str(freePort()),
        "SVC_USAGE_OUTBOX_MAX": "5",
    }
    proxy = Daemon("svc-proxy", environment, stack.workdir / "small-outbox.log").start()
    try:
        proxy.waitForReady()
        with ledgerLocked(stack.dsn):
            answered = [post(proxy.httpPort, tenant, chatBody("plain")) for _ in range(5)]
            assert [answer.status for answer in answered] == [200] * 5
            waitUntil(lambda: gauge(proxy, "svc_proxy_usage_outbox_rows") == 5, "5 rows waiting")
            stack.upstream.clearRequests()
            refused = post(proxy.httpPort, tenant, chatBody("plain"))
            assert refused.status == 503, refused.body
            assert refused.json()["error"]["code"] == "SERVICE_DEGRADED"
            assert stack.upstream.requests() == []
        rows = waitForRows(stack.dsn, tenant.orgID, 5)
        assert set(rows) == {answer.headers["x-request-id"] for answer in answered}
        waitUntil(lambda: gauge(proxy, "svc_proxy_usage_outbox_rows") == 0, "the outbox empty")
        again = post(proxy.httpPort, tenant, chatBody("plain"))
        assert again.status == 200
        waitForRows(stack.dsn, tenant.orgID, 6)
    finally:
        assert proxy.terminate() == 0
    assert "Traceback" not in proxy.output()
