"""
Redis under Sentinel, end to end (decisions D16): real C{twistd} daemons
(svc-auth, two svc-proxy) whose C{REDIS_URL} names a Sentinel group (a
master, a replica and three sentinels of Debian's redis-sentinel), a real
PostgreSQL, and the scripted upstream answering the most each request
allows, so that every request costs exactly its worst case.

The master is killed with SIGKILL under a steady stream of requests
through both proxies, from two organizations: one with room in its budget,
one whose budget is spent. While no master is known requests go on
unchecked and counted (the documented window); none is answered 5xx; every
answered request is one ledger row; the spent budget lets nothing through
from a second after the new master answers, is passed by no more than the
unchecked admissions counted, and its counter comes back to the ledger's
spend.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from authfixtures import Tenant
from ledgerfixtures import (
    PRICE_A,
    Stack,
    counter,
    nanoCost,
    orgRows,
    post,
    roomInTheDay,  # noqa: F401
    runningStack,
    spend,
    waitForRows,
    waitUntil,
)

from svcd.devkit.postgres import PostgresServer
from svcd.devkit.sentinel import SentinelGroup, command
from svcd.devkit.servers import MissingBinaries
from svcd.devkit.upstream.client import ScriptedUpstream

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

CAP = 30
UNCHECKED = "svc_proxy_unchecked_admissions_total"
# Reconciliations every second, so that the spent budget's counter is the
# ledger's spend again within seconds of the failover.
BUDGET_SETTINGS = {
    "SVC_BUDGET_LEASE": "2s",
    "SVC_BUDGET_RECONCILE_INTERVAL": "1s",
    "SVC_BUDGET_RECORD_GRACE": "4s",
}


def providersFile(path: Path, upstream: ScriptedUpstream) -> Path:
    price = ", ".join(f'{key} = "{value}"' for key, value in PRICE_A.items())
    text = [
        "[[providers]]",
        'name = "scripted"',
        f'base_url = "{upstream.baseURL}"',
        'timeout = "60s"',
        "max_connections = 64",
        "",
        "[[models]]",
        'name = "quick"',
        'provider = "scripted"',
        'upstream_model = "usage-at-cap"',
        f"max_output_tokens = {CAP}",
        f"price = {{ {price} }}",
    ]
    path.write_text("\n".join(text) + "\n")
    return path


BODY = json.dumps(
    {"model": "quick", "messages": [{"role": "user", "content": "how much is 12345 * 678?"}]}
).encode()


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    try:
        sentinels = SentinelGroup(tmp_path_factory.mktemp("sentinel"))
    except MissingBinaries as missing:
        pytest.skip(str(missing))
    try:
        sentinels.start()
        yield sentinels
    finally:
        sentinels.destroy()


@pytest.fixture(scope="module")
def stack(
    group: SentinelGroup,
    postgresServer: PostgresServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    # The stack's own Redis stays unused: REDIS_URL names the group.
    settings = {**BUDGET_SETTINGS, "REDIS_URL": group.url}
    with runningStack(
        postgresServer, tmp_path_factory.mktemp("failover"), providersFile, settings
    ) as running:
        yield running


def worstCase(stack: Stack) -> int:
    """
    What a request of L{BODY} costs, from the length of the body the
    provider receives (one request of an organization with a large budget).
    """
    probe = stack.tenant(f"probe-{uuid.uuid4().hex[:6]}")
    stack.budget(probe, 10**12)
    stack.seenEverywhere()
    before = {each.number for each in stack.upstream.requests()}
    answer = post(stack.proxies[0].httpPort, probe, BODY)
    assert answer.status == 200, answer.body
    (received,) = [each for each in stack.upstream.requests() if each.number not in before]
    return nanoCost(PRICE_A, received.bodyLength, 0, CAP)


@attrs.frozen
class Sent:
    tenant: str
    at: float
    status: int
    code: str | None


class Stream:
    """
    Requests one after the other from a few threads, alternating between
    the proxies, until stopped: when each was sent and how it was answered.
    """

    def __init__(self, stack: Stack, tenants: dict[str, Tenant], perTenant: int = 2) -> None:
        self._stack = stack
        self._tenants = tenants
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.sent: list[Sent] = []
        self._threads = [
            threading.Thread(target=self._send, args=(name, index), daemon=True)
            for name in tenants
            for index in range(perTenant)
        ]

    def __enter__(self) -> Stream:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exception: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _send(self, name: str, index: int) -> None:
        tenant = self._tenants[name]
        proxies = self._stack.proxies
        while not self._stop.is_set():
            index += 1
            at = time.monotonic()
            answer = post(proxies[index % len(proxies)].httpPort, tenant, BODY, timeout=30)
            code = None
            if answer.status != 200:
                code = answer.json().get("error", {}).get("code")
            with self._lock:
                self.sent.append(Sent(name, at, answer.status, code))
            self._stop.wait(0.01)

    def of(self, name: str, since: float = 0.0) -> list[Sent]:
        with self._lock:
            return [each for each in self.sent if each.tenant == name and each.at >= since]


def budgetKey(tenant: Tenant) -> str:
    today = datetime.datetime.now(datetime.UTC)
    start = datetime.datetime(today.year, today.month, 1, tzinfo=datetime.UTC)
    return f"budget:{{{tenant.orgID}}}:month:{int(start.timestamp())}"


def counted(group: SentinelGroup, tenant: Tenant) -> int | None:
    value = command(group.master().port, "GET", budgetKey(tenant))
    assert value is None or isinstance(value, bytes)
    return None if value is None else int(value)


def spendUntilRefused(stack: Stack, tenant: Tenant, count: int) -> None:
    """
    Spend C{count} requests of the budget (whose room is a little more than
    that), then see both proxies refuse the next. A refusal before that is
    the reconciliation's safe side (a row counted twice for a round, seen
    on a loaded machine): wait for the round to pass and try again.
    """
    admitted = 0
    deadline = time.monotonic() + 30
    while admitted < count:
        answer = post(stack.proxies[admitted % 2].httpPort, tenant, BODY)
        if answer.status == 200:
            admitted += 1
            continue
        assert answer.status == 429, answer.body
        assert time.monotonic() < deadline, "refused before the budget was spent"
        time.sleep(0.2)
    for proxy in stack.proxies:
        assert post(proxy.httpPort, tenant, BODY).status == 429


def test_aKilledMasterUnderLoad(stack: Stack, group: SentinelGroup) -> None:
    """
    SIGKILL the master under a stream of requests through both proxies:
    no answer is 5xx, every 200 is one ledger row, the spent budget is
    checked again within a second of the new master answering and passed
    by no more than the unchecked admissions counted, and its counter is
    the ledger's spend again afterwards.
    """
    quick = worstCase(stack)
    tenants = {"room": stack.tenant("room"), "spent": stack.tenant("spent")}
    stack.budget(tenants["room"], 10**12)
    budget = 4 * quick + quick // 2
    stack.budget(tenants["spent"], budget)
    stack.seenEverywhere()
    spendUntilRefused(stack, tenants["spent"], 4)
    uncheckedBefore = sum(counter(proxy, UNCHECKED) for proxy in stack.proxies)
    old = group.master()
    with Stream(stack, tenants) as stream:
        waitUntil(lambda: len(stream.of("room")) >= 20, "requests before the kill", 30)
        group.kill(old)
        killed = time.monotonic()
        group.waitForFailover(old.port, 30.0)
        answered = time.monotonic()
        waitUntil(
            lambda: len(stream.of("spent", answered + 1.5)) >= 5,
            "requests after the failover",
            30,
        )
    sent = stream.sent
    # The window: the room's requests went on throughout, none answered
    # 5xx (nor anything but 200, or the spent budget's 429).
    assert any(killed <= each.at < answered for each in stream.of("room"))
    assert {(each.status, each.code) for each in sent} <= {
        (200, None),
        (429, "BUDGET_EXCEEDED"),
    }, sorted({(each.status, each.code) for each in sent})
    assert all(each.status == 200 for each in stream.of("room"))
    # Let through while no master was known, and only then: checked again
    # within a second of the new master answering.
    through = [each for each in stream.of("spent") if each.status == 200]
    late = [round(each.at - answered, 3) for each in through if each.at >= answered + 1.0]
    assert late == [], late
    unchecked = sum(counter(proxy, UNCHECKED) for proxy in stack.proxies) - uncheckedBefore
    assert unchecked >= len(through)
    # Every 200 is one ledger row, nothing lost (waitForRows: never more).
    rooms = waitForRows(stack.dsn, tenants["room"].orgID, len(stream.of("room")))
    assert spend(rooms) == quick * len(rooms)
    spentRows = waitForRows(stack.dsn, tenants["spent"].orgID, 4 + len(through))
    # The budget passed by no more than the unchecked admissions counted.
    assert spend(spentRows) <= budget + unchecked * quick
    # The spent budget's counter comes back to the ledger's spend (the
    # reconciliation of a proxy that used it lately: each refusal is a
    # use), refusing throughout.
    ledger = spend(orgRows(stack.dsn, tenants["spent"].orgID))

    def healed() -> bool:
        for proxy in stack.proxies:
            assert post(proxy.httpPort, tenants["spent"], BODY).status == 429
        return counted(group, tenants["spent"]) == ledger

    waitUntil(healed, "the spent budget's counter at the ledger's spend", 30)
