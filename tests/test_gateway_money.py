"""
Money that cannot be dodged or overspent (decisions D12 amended, issue 28),
end to end: real C{twistd} daemons (svc-auth, two svc-proxy), a real
PostgreSQL and Redis, the scripted upstream, budgets set with the real
C{svcctl budget}. What is checked, from outside the gateway only:

  - the ledger's key is the gateway's: requests that share one
    X-Request-ID, in one organization or in two, are each one row, and
    each keeps the client's id;
  - a budget's reservation is a true upper bound: a provider answering
    the most the request allows (the cap the gateway sent, for every one
    of C{n} choices; a prompt of every byte it received, full of tools and
    digits), 64 clients through two proxies, a dearer fallback: the
    ledger's total never passes the budget;
  - a provider answering more than the cap allows is billed as it
    reported, counted, and the budget refuses from then on;
  - an unpriced fallback is never tried under a budget; an absurd output
    cap is 400 and nothing is forwarded;
  - cache writes (decisions D14): a provider's usage with cache reads and
    writes is billed each part at its own price, to the nano-dollar,
    streamed or not, on every path (an OpenAI or an Anthropic client, to
    an OpenAI-compatible or an Anthropic provider), the client seeing its
    own dialect's counts (C{prompt_tokens_details}' C{cached_tokens} and
    C{cache_write_tokens}, or C{cache_read_input_tokens} and
    C{cache_creation_input_tokens}); svcctl usage sums the writes; a
    budget holds on both routes against a provider that bills every byte
    of the prompt as a cache write, dearer than input.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
from authfixtures import Tenant
from gatewayfixtures import Answer, request

# Autouse: no test here straddles the end of a UTC day (a budget's period).
from ledgerfixtures import (
    PRICE_A,
    PRICE_B,
    PRICE_D,
    Received,
    Stack,
    assertBudgetRefusal,
    burst,
    counter,
    dollars,
    headersOf,
    nanoCost,
    orgRows,
    post,
    roomInTheDay,  # noqa: F401
    runningStack,
    spend,
    svcctlDocument,
    waitForRows,
    waitUntil,
)

from svcd.devkit.postgres import PostgresServer
from svcd.devkit.upstream.client import ScriptedUpstream

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

# The scripted upstream's answers whose usage is the most the request
# allows (prompt: every byte of the body it received; completion: the cap
# it received for each of its n choices), and twice that completion.
MOST_ALLOWED = "usage-at-cap"
TWICE_ALLOWED = "usage-over-cap:2"
# The same, every token of the prompt a cache write (decisions D14).
MOST_ALLOWED_WRITTEN = "usage-at-cap+cache:0:999999999"
# An answer of 1,200 prompt tokens, 200 read from the cache and 500
# written to it, and 300 of output.
CACHED_AND_WRITTEN = "usage:1200:300+cache:200:500"

# A Claude-like price: reads a tenth of the input, writes a quarter more.
PRICE_W = {"input": "3.00", "output": "15.00", "cached_input": "0.30", "cache_write": "3.75"}

# The output cap of the capped models (providers file max_output_tokens):
# the cap the gateway sends when a request names none.
CAP = 40

# name -> (upstream model, price or None, max_output_tokens or None,
# fallbacks, cap_field or None)
MODELS: dict[str, tuple[str, dict[str, str] | None, int | None, list[str], str | None]] = {
    "plain": ("usage:3:4", PRICE_B, None, [], None),
    "maxed": (MOST_ALLOWED, PRICE_A, CAP, [], None),
    # The same, for a provider that takes max_tokens.
    "maxed-legacy": (MOST_ALLOWED, PRICE_A, CAP, [], "max_tokens"),
    # A cheap model whose provider fails, and its dearer fallback that
    # answers the most it may: the reservation is at the dearer price.
    "cheap-failing": ("status:503", PRICE_B, CAP, ["dear"], None),
    "dear": (MOST_ALLOWED, PRICE_D, CAP, [], None),
    "overdrawn": (TWICE_ALLOWED, PRICE_A, CAP, [], None),
    # Fails, and its fallback has no price.
    "priced-failing": ("status:503", PRICE_A, CAP, ["free"], None),
    "free": ("usage:10:5", None, None, [], None),
    "caching": (CACHED_AND_WRITTEN, PRICE_W, None, [], None),
    "written-at-cap": (MOST_ALLOWED_WRITTEN, PRICE_W, CAP, [], None),
}
# The same answers from a provider of Anthropic's API (decisions D14):
# name -> (upstream model, price, max_output_tokens).
ANTHROPIC_MODELS: dict[str, tuple[str, dict[str, str], int | None]] = {
    "claude-caching": (CACHED_AND_WRITTEN, PRICE_W, None),
    "claude-written-at-cap": (MOST_ALLOWED_WRITTEN, PRICE_W, CAP),
}


def providersFile(path: Path, upstream: ScriptedUpstream) -> Path:
    text = [
        "[[providers]]",
        'name = "scripted"',
        f'base_url = "{upstream.baseURL}"',
        'timeout = "30s"',
        'idle_timeout = "30s"',
        "max_connections = 128",
    ]
    for name, (upstreamModel, price, cap, fallbacks, capField) in MODELS.items():
        text += ["", "[[models]]", f'name = "{name}"', 'provider = "scripted"']
        text.append(f'upstream_model = "{upstreamModel}"')
        if fallbacks:
            text.append("fallbacks = " + json.dumps(fallbacks))
        if cap is not None:
            text.append(f"max_output_tokens = {cap}")
        if capField is not None:
            text.append(f'cap_field = "{capField}"')
        if price is not None:
            entries = ", ".join(f'{key} = "{value}"' for key, value in price.items())
            text.append(f"price = {{ {entries} }}")
    text += [
        "",
        "[[providers]]",
        'name = "scripted-anthropic"',
        f'base_url = "{upstream.baseURL}"',
        'api = "anthropic"',
        'timeout = "30s"',
        'idle_timeout = "30s"',
        "max_connections = 128",
    ]
    for name, (upstreamModel, price, cap) in ANTHROPIC_MODELS.items():
        entries = ", ".join(f'{key} = "{value}"' for key, value in price.items())
        text += ["", "[[models]]", f'name = "{name}"', 'provider = "scripted-anthropic"']
        text += [f'upstream_model = "{upstreamModel}"', f"price = {{ {entries} }}"]
        if cap is not None:
            text.append(f"max_output_tokens = {cap}")
    path.write_text("\n".join(text) + "\n")
    return path


@pytest.fixture(scope="module")
def stack(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    with runningStack(postgresServer, tmp_path_factory.mktemp("money"), providersFile) as running:
        yield running


def ledgerKeys(dsn: str, orgID: uuid.UUID) -> list[tuple[str, str]]:
    """
    (request_id, ledger_id) of each of the organization's rows, read as the
    schema owner.
    """
    with psycopg.connect(dsn, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT request_id, ledger_id::text FROM usage_ledger WHERE org_id = %s",
            (orgID,),
        ).fetchall()
    return [(str(requestID), str(ledgerID)) for requestID, ledgerID in rows]


def sendWithRequestID(port: int, tenant: Tenant, requestID: str) -> Answer:
    body = json.dumps({"model": "plain", "messages": [{"role": "user", "content": "hi"}]})
    return request(
        port,
        "POST",
        "/v1/chat/completions",
        {**headersOf(tenant), "X-Request-ID": requestID},
        body.encode(),
        timeout=60,
    )


def test_requestsSharingAnIdAreEachOneRow(stack: Stack) -> None:
    """
    Three requests of one organization and two of another, all with the
    same X-Request-ID, through both proxies: five rows, each keeping the
    client's id under a key of its own; each answer carries the client's
    id. (The ledger was keyed by the client's id: one row for the five.)
    """
    shared = str(uuid.uuid4())
    first, second = stack.tenant("reuse-a"), stack.tenant("reuse-b")
    for index, tenant in enumerate([first, first, first, second, second]):
        answer = sendWithRequestID(stack.proxies[index % 2].httpPort, tenant, shared)
        assert answer.status == 200, answer.body
        assert answer.headers["x-request-id"] == shared
    waitUntil(lambda: len(ledgerKeys(stack.dsn, first.orgID)) == 3, "three rows of the first")
    waitUntil(lambda: len(ledgerKeys(stack.dsn, second.orgID)) == 2, "two rows of the second")
    keys = ledgerKeys(stack.dsn, first.orgID) + ledgerKeys(stack.dsn, second.orgID)
    assert {requestID for requestID, _ in keys} == {shared}
    assert len({ledgerID for _, ledgerID in keys}) == 5
    for _, ledgerID in keys:
        assert uuid.UUID(ledgerID).version == 7


# The worst case, the hard way.

# A prompt full of what bytes/3 undercounts (digits), and tools whose
# schemas the old estimate did not count at all.
DIGITS = "0123456789" * 30
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": f"lookup_{index}",
            "description": DIGITS,
            "parameters": {
                "type": "object",
                "properties": {
                    f"p{n}": {"type": "integer", "maximum": 10**9 + n} for n in range(8)
                },
            },
        },
    }
    for index in range(4)
]
CHOICES = 3


def heavyBody(model: str) -> bytes:
    return json.dumps(
        {
            "model": model,
            "n": CHOICES,
            "tools": TOOLS,
            "messages": [
                {"role": "system", "content": DIGITS},
                {"role": "user", "content": DIGITS},
            ],
        }
    ).encode()


def forwardedLength(
    stack: Stack, body: bytes, upstreamModel: str, path: str = "/v1/chat/completions"
) -> tuple[int, Any]:
    """
    Send C{body} once to C{path} for an organization with a large budget
    (so the gateway adds its cap, as under any budget) and read what the
    provider received: the body's length in bytes and the body.
    """
    probe = stack.tenant(f"probe-{uuid.uuid4().hex[:6]}")
    stack.budget(probe, 10**12)
    stack.seenEverywhere()
    before = {each.number for each in stack.upstream.requests()}
    answer = post(stack.proxies[0].httpPort, probe, body, path=path)
    assert answer.status == 200, answer.body
    received = [
        each
        for each in stack.upstream.requests()
        if each.number not in before and each.body.get("model") == upstreamModel
    ]
    assert len(received) == 1, received
    return received[0].bodyLength, received[0].body


def worstCase(price: Mapping[str, str], bodyLength: int, completion: int = CAP * CHOICES) -> int:
    """
    The most a request can cost, by hand (decisions D12 amended): every
    byte of the body a token at the dearest input price (of an input, a
    cache read and, decisions D14, a cache write), the cap for each choice
    at the output price.
    """
    dearestInput = max(
        price["input"],
        price.get("cached_input", price["input"]),
        price.get("cache_write", price["input"]),
        key=float,
    )
    return nanoCost({"input": dearestInput, "output": price["output"]}, bodyLength, 0, completion)


@pytest.mark.parametrize("model", ["maxed", "maxed-legacy"])
def test_aBudgetHoldsAgainstAnswersAtTheCap(stack: Stack, model: str) -> None:
    """
    The provider answers the most each request allows: every byte of the
    body it received as a prompt token, the cap the gateway sent (the
    request named none) for each of its three choices. A budget of five
    such answers and a nano-dollar, 64 concurrent clients over two
    proxies: five answered, the others refused BUDGET_EXCEEDED, and the
    ledger's total at most the budget. The cap reached the provider under
    the model's cap field.
    """
    body = heavyBody(model)
    length, received = forwardedLength(stack, body, MOST_ALLOWED)
    capField = "max_tokens" if model == "maxed-legacy" else "max_completion_tokens"
    assert received[capField] == CAP
    assert received["n"] == CHOICES
    each = worstCase(PRICE_A, length)
    tenant = stack.tenant(f"atcap-{model}")
    budget = 5 * each + 1
    stack.budget(tenant, budget)
    stack.seenEverywhere()
    got = burst(stack, tenant, body)
    admitted = [one for one in got if one.answer.status == 200]
    for one in got:
        if one.answer.status != 200:
            assertBudgetRefusal(one, "org")
    rows = waitForRows(stack.dsn, tenant.orgID, len(admitted))
    assert all(row["cost_nano_usd"] == each for row in rows.values()), (
        {row["cost_nano_usd"] for row in rows.values()},
        each,
    )
    assert len(admitted) == 5
    assert spend(rows) <= budget
    print(f"{model}: worst case {each}, budget {budget}, spend {spend(rows)}, overshoot 0")


def test_aDearerFallbackIsReservedAtItsPrice(stack: Stack) -> None:
    """
    The model asked for is cheap and fails; its fallback is dearer and
    answers the most it may. Reserved at the dearer price, a budget of
    three such answers admits three of 64, and the ledger stays within it
    (reserved at the cheap price, far more would pass).
    """
    body = heavyBody("cheap-failing")
    length, _ = forwardedLength(stack, body, MOST_ALLOWED)
    each = worstCase(PRICE_D, length)
    tenant = stack.tenant("dearer")
    budget = 3 * each + 1
    stack.budget(tenant, budget)
    stack.seenEverywhere()
    got = burst(stack, tenant, body)
    admitted = [one for one in got if one.answer.status == 200]
    rows = waitForRows(stack.dsn, tenant.orgID, len(admitted))
    assert {row["model"] for row in rows.values()} == {"dear"}
    assert len(admitted) == 3, len(admitted)
    assert spend(rows) <= budget


def test_anAnswerPastTheCapIsBilledAndRefusesTheNext(stack: Stack) -> None:
    """
    A provider that answers twice what the cap allows: the one admitted
    request is billed as the provider reported (past its reservation), the
    overrun is counted, and the next request, on either proxy, is refused:
    the budget knows what was spent.
    """
    body = heavyBody("overdrawn")
    length, _ = forwardedLength(stack, body, TWICE_ALLOWED)
    reserved = worstCase(PRICE_A, length)
    tenant = stack.tenant("overdrawn")
    stack.budget(tenant, reserved + 1)
    stack.seenEverywhere()
    overruns = sum(
        counter(proxy, "svc_proxy_reservation_overruns_total") for proxy in stack.proxies
    )
    answer = post(stack.proxies[0].httpPort, tenant, body)
    assert answer.status == 200, answer.body
    rows = waitForRows(stack.dsn, tenant.orgID, 1)
    (row,) = rows.values()
    billed = nanoCost(PRICE_A, length, 0, 2 * CAP * CHOICES)
    assert row["cost_nano_usd"] == billed > reserved
    assert (
        sum(counter(proxy, "svc_proxy_reservation_overruns_total") for proxy in stack.proxies)
        == overruns + 1
    )
    for proxy in stack.proxies:
        refused = post(proxy.httpPort, tenant, body)
        assertBudgetRefusal(Received(refused, time.time()), "org")
    assert spend(orgRows(stack.dsn, tenant.orgID)) == billed


def test_anUnpricedFallbackIsNeverTriedUnderABudget(stack: Stack) -> None:
    """
    A priced model fails and its fallback has no price: under a budget the
    fallback is never tried (the client gets the failure); without one it
    answers.
    """
    body = json.dumps(
        {"model": "priced-failing", "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    budgeted, free = stack.tenant("nofree-budget"), stack.tenant("nofree")
    stack.budget(budgeted, 10**12)
    stack.seenEverywhere()
    before = {each.number for each in stack.upstream.requests()}
    refused = post(stack.proxies[0].httpPort, budgeted, body)
    assert refused.status >= 500, refused.body
    tried = [
        each.body.get("model") for each in stack.upstream.requests() if each.number not in before
    ]
    assert tried == ["status:503"]
    answered = post(stack.proxies[0].httpPort, free, body)
    assert answered.status == 200, answered.body
    assert answered.headers["x-svc-upstream-model"] == "free"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_anAbsurdCapIsRefusedAndNothingForwarded(stack: Stack, field: str) -> None:
    """
    An output cap above the model's max_output_tokens (1,048,576 when the
    providers file gives none) is 400 on that field; nothing reaches the
    provider, no row is written.
    """
    tenant = stack.tenant(f"absurd-{field}")
    before = len(stack.upstream.requests())
    for model, cap in (("plain", 10**15), ("plain", 2**20 + 1), ("maxed", CAP + 1)):
        body = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hi"}], field: cap}
        ).encode()
        answer = post(stack.proxies[0].httpPort, tenant, body)
        assert answer.status == 400, answer.body
        error = answer.json()["error"]
        assert error["code"] == "VALIDATION_ERROR"
        assert [each["field"] for each in error["field_errors"]] == [field]
    # At the maximum itself, it is forwarded.
    body = json.dumps(
        {"model": "plain", "messages": [{"role": "user", "content": "hi"}], field: 2**20}
    ).encode()
    assert post(stack.proxies[0].httpPort, tenant, body).status == 200
    assert len(stack.upstream.requests()) == before + 1
    waitForRows(stack.dsn, tenant.orgID, 1)


# Cache writes (decisions D14).


def streamedUsage(answer: Answer) -> dict[str, Any] | None:
    usage = None
    for line in answer.body.split(b"\n"):
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
    return usage


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_cacheReadsAndWritesArePricedApart(stack: Stack, stream: bool) -> None:
    """
    A provider's usage of 1,200 prompt tokens, 200 read from its cache and
    500 written to it (OpenAI's shape: C{prompt_tokens_details}'s
    C{cached_tokens} and C{cache_write_tokens}), and 300 of output: the
    client sees it as the provider said, and the row counts each part and
    costs each at its own price, to the nano-dollar, in a stream as in an
    answer; svcctl usage sums the writes apart.
    """
    tenant = stack.tenant(f"caching-{'stream' if stream else 'answer'}")
    extra: dict[str, Any] = (
        {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    )
    body = json.dumps(
        {"model": "caching", "messages": [{"role": "user", "content": "hi"}], **extra}
    ).encode()
    answer = post(stack.proxies[0].httpPort, tenant, body)
    assert answer.status == 200, answer.body
    usage = streamedUsage(answer) if stream else answer.json()["usage"]
    assert usage is not None
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (1200, 300)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 200
    assert usage["prompt_tokens_details"]["cache_write_tokens"] == 500
    (row,) = waitForRows(stack.dsn, tenant.orgID, 1).values()
    assert (
        row["prompt_tokens"],
        row["cached_tokens"],
        row["cache_write_tokens"],
        row["completion_tokens"],
        row["tokens_from"],
    ) == (1200, 200, 500, 300, "provider")
    # 500 uncached at $3.00, 200 reads at $0.30, 500 writes at $3.75 and
    # 300 of output at $15.00 a million.
    expected = 500 * 3000 + 200 * 300 + 500 * 3750 + 300 * 15_000
    assert row["cost_nano_usd"] == nanoCost(PRICE_W, 1200, 200, 300, 500) == expected
    printed = svcctlDocument(stack.dsn, "usage", "--org", str(tenant.orgID), "--by", "model")
    assert printed["rows"] == [
        {
            "key": "caching",
            "requests": 1,
            "prompt_tokens": 1200,
            "cached_tokens": 200,
            "completion_tokens": 300,
            "reasoning_tokens": 0,
            "cost_usd": dollars(expected),
            "cache_write_tokens": 500,
        }
    ]


def test_aBudgetHoldsAgainstAnswersWrittenToTheCache(stack: Stack) -> None:
    """
    The provider answers the most each request allows, and bills every
    token of its prompt as a cache write, a quarter dearer than input
    (decisions D14): reserved at the write price, a budget of five such
    answers and a nano-dollar admits five of 64 concurrent requests over
    two proxies, each row costs exactly what it reserved, and the ledger's
    total stays within the budget. (Reserved at the input price, six would
    pass and the sixth overspend.)
    """
    body = heavyBody("written-at-cap")
    length, _ = forwardedLength(stack, body, MOST_ALLOWED_WRITTEN)
    each = worstCase(PRICE_W, length)
    assert each == length * 3750 + CAP * CHOICES * 15_000
    tenant = stack.tenant("written-at-cap")
    budget = 5 * each + 1
    stack.budget(tenant, budget)
    stack.seenEverywhere()
    overruns = sum(
        counter(proxy, "svc_proxy_reservation_overruns_total") for proxy in stack.proxies
    )
    got = burst(stack, tenant, body)
    admitted = [one for one in got if one.answer.status == 200]
    for one in got:
        if one.answer.status != 200:
            assertBudgetRefusal(one, "org")
    rows = waitForRows(stack.dsn, tenant.orgID, len(admitted))
    assert {(row["prompt_tokens"], row["cache_write_tokens"]) for row in rows.values()} == {
        (length, length)
    }
    assert all(row["cost_nano_usd"] == each for row in rows.values())
    assert len(admitted) == 5
    assert spend(rows) <= budget
    assert (
        sum(counter(proxy, "svc_proxy_reservation_overruns_total") for proxy in stack.proxies)
        == overruns
    )


# Both dialects, both kinds of provider (decisions D14).

MESSAGES = "/v1/messages"
CHAT = "/v1/chat/completions"


def anthropicStreamUsage(answer: Answer) -> dict[str, Any]:
    """
    The usage of an Anthropic stream as its SDK makes it: message_start's,
    then each message_delta's counts over it.
    """
    usage: dict[str, Any] = {}
    for line in answer.body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if event.get("type") == "message_start":
            usage = dict(event["message"]["usage"])
        elif event.get("type") == "message_delta":
            usage.update({key: value for key, value in event["usage"].items() if value is not None})
    return usage


@pytest.mark.parametrize(
    ("path", "model", "stream"),
    [
        (CHAT, "claude-caching", False),
        (CHAT, "claude-caching", True),
        (MESSAGES, "claude-caching", False),
        (MESSAGES, "claude-caching", True),
        (MESSAGES, "caching", False),
        (MESSAGES, "caching", True),
    ],
    ids=[
        "chat-to-anthropic",
        "chat-to-anthropic-stream",
        "messages-to-anthropic",
        "messages-to-anthropic-stream",
        "messages-to-openai",
        "messages-to-openai-stream",
    ],
)
def test_cacheReadsAndWritesArePricedApartOnEveryPath(
    stack: Stack, path: str, model: str, stream: bool
) -> None:
    """
    The answer of test_cacheReadsAndWritesArePricedApart (1,200 prompt
    tokens: 500 uncached, 200 read from the cache, 500 written to it; 300
    of output) on the other paths: an OpenAI client to an Anthropic
    provider (the client sees C{prompt_tokens_details}' reads and writes),
    an Anthropic client to an Anthropic provider (relayed as given) and to
    an OpenAI-compatible one (the client sees C{cache_read_input_tokens}
    and C{cache_creation_input_tokens}), whole or streamed (from
    C{message_start} and C{message_delta}): every row counts and costs
    each part apart, to the nano-dollar.
    """
    tenant = stack.tenant(f"paths-{uuid.uuid4().hex[:8]}")
    document: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if path == MESSAGES:
        document["max_tokens"] = 1000
    if stream:
        document["stream"] = True
        if path == CHAT:
            document["stream_options"] = {"include_usage": True}
    answer = post(stack.proxies[0].httpPort, tenant, json.dumps(document).encode(), path=path)
    assert answer.status == 200, answer.body
    if path == CHAT:
        usage = streamedUsage(answer) if stream else answer.json()["usage"]
        assert usage is not None
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (1200, 300)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 200
        assert usage["prompt_tokens_details"]["cache_write_tokens"] == 500
    else:
        usage = anthropicStreamUsage(answer) if stream else answer.json()["usage"]
        assert (
            usage["input_tokens"],
            usage["cache_read_input_tokens"],
            usage["cache_creation_input_tokens"],
            usage["output_tokens"],
        ) == (500, 200, 500, 300)
    (row,) = waitForRows(stack.dsn, tenant.orgID, 1).values()
    assert (
        row["model"],
        row["prompt_tokens"],
        row["cached_tokens"],
        row["cache_write_tokens"],
        row["completion_tokens"],
        row["tokens_from"],
    ) == (model, 1200, 200, 500, 300, "provider")
    assert row["cost_nano_usd"] == 500 * 3000 + 200 * 300 + 500 * 3750 + 300 * 15_000


def messagesBody(model: str) -> bytes:
    """
    A Messages body heavy with what a byte-level tokenizer counts a token
    a byte of (digits, tools' schemas), its cap the model's ceiling.
    """
    return json.dumps(
        {
            "model": model,
            "max_tokens": CAP,
            "system": DIGITS,
            "tools": [
                {
                    "name": each["function"]["name"],
                    "description": each["function"]["description"],
                    "input_schema": each["function"]["parameters"],
                }
                for each in TOOLS
            ],
            "messages": [{"role": "user", "content": DIGITS}],
        }
    ).encode()


@pytest.mark.parametrize(
    ("path", "model"),
    [
        (MESSAGES, "claude-written-at-cap"),
        (MESSAGES, "written-at-cap"),
        (CHAT, "claude-written-at-cap"),
    ],
    ids=["messages-to-anthropic", "messages-to-openai", "chat-to-anthropic"],
)
def test_aBudgetHoldsOnBothRoutesAgainstAnswersWrittenToTheCache(
    stack: Stack, path: str, model: str
) -> None:
    """
    test_aBudgetHoldsAgainstAnswersWrittenToTheCache on the other paths:
    the provider (of either kind) bills every byte it received as a cache
    write and answers the whole cap; reserved at the write price on the
    body each provider is sent (translated or not), a budget of five such
    answers and a nano-dollar admits five of 64 concurrent requests over
    two proxies, each row costs exactly its reservation, and the ledger's
    total stays within the budget.
    """
    if path == MESSAGES:
        body = messagesBody(model)
    else:
        body = json.dumps(
            {
                "model": model,
                "tools": TOOLS,
                "messages": [
                    {"role": "system", "content": DIGITS},
                    {"role": "user", "content": DIGITS},
                ],
            }
        ).encode()
    length, received = forwardedLength(stack, body, MOST_ALLOWED_WRITTEN, path)
    assert CAP in (received.get("max_tokens"), received.get("max_completion_tokens"))
    each = worstCase(PRICE_W, length, CAP)
    assert each == length * 3750 + CAP * 15_000
    tenant = stack.tenant(f"written-{uuid.uuid4().hex[:8]}")
    budget = 5 * each + 1
    stack.budget(tenant, budget)
    stack.seenEverywhere()
    got = burst(stack, tenant, body, path=path)
    admitted = [one for one in got if one.answer.status == 200]
    for one in got:
        if one.answer.status != 200:
            assert one.answer.status == 429, one.answer.body
            assert one.answer.json()["error"]["code"] == "BUDGET_EXCEEDED"
    rows = waitForRows(stack.dsn, tenant.orgID, len(admitted))
    assert {(row["prompt_tokens"], row["cache_write_tokens"]) for row in rows.values()} == {
        (length, length)
    }
    assert all(row["cost_nano_usd"] == each for row in rows.values())
    assert len(admitted) == 5
    assert spend(rows) <= budget
