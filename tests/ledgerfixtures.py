"""
The harness of the ledger and money end-to-end modules: a L{Stack} of svc-
auth and one or more svc-proxy daemons against the scripted upstream, the
prices of its models, and the budget and ledger helpers (L{spend},
L{orgRows}, L{assertBudgetRefusal} ...) the modules share.

Moved here from test_gateway_ledger.py (and L{counter} from
test_gateway_money.py) so that the modules that share them import a library
rather than another test module.
"""

from __future__ import annotations

import calendar
import contextlib
import datetime
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import attrs
import forkedpython
import psycopg
import pytest
from authfixtures import Tenant, makeTenant
from gatewayfixtures import Answer, request

from svcd.auth.store import Store
from svcd.devkit.daemons import Daemon, authEnvironment
from svcd.devkit.pgtemplate import migratedDatabase
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import ScriptedUpstream

# Bounds on waits for what the daemons do on their own (rows reaching the
# ledger, a budget reaching the proxies): far above what they take, a
# guard against a hang on a loaded machine.
WAIT = 60.0


# The models of the providers file: gateway name -> (upstream model, price
# in dollars per million tokens as the file writes it, or None).
PRICE_A = {"input": "2.50", "output": "10.00", "cached_input": "1.25"}


PRICE_B = {"input": "0.15", "output": "0.60"}


PRICE_D = {"input": "9", "output": "9"}


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
    "kind",
    "parent_request_id",
    "cache_write_tokens",
)


def nanoCost(
    price: Mapping[str, str] | None, prompt: int, cached: int, completion: int, written: int = 0
) -> int:
    """
    D12's cost in nano-dollars, rounded half up, computed in decimal; with
    D14's C{written} tokens of the prompt (cache writes) at C{cache_write}.
    """
    if price is None:
        return 0
    inputPrice = Decimal(price["input"])
    cachedPrice = Decimal(price.get("cached_input", price["input"]))
    writePrice = Decimal(price.get("cache_write", price["input"]))
    dollars = (
        (prompt - cached - written) * inputPrice
        + cached * cachedPrice
        + written * writePrice
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


def svcctl(dsn: str, *words: str) -> subprocess.CompletedProcess[str]:
    # Forked, as authhelpers.svcctl (forkedpython.py).
    return forkedpython.run(
        [sys.executable, "-m", "svcd.ctl", *words],
        env={**os.environ, "POSTGRES_DSN": dsn},
        timeout=60,
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


def post(
    port: int,
    tenant: Tenant,
    body: bytes,
    agent: uuid.UUID | None = None,
    timeout: float = 60,
    path: str = "/v1/chat/completions",
) -> Answer:
    return request(port, "POST", path, headersOf(tenant, agent), body, timeout=timeout)


# The longest any test of the modules that use it takes, and more: none
# may straddle the end of a UTC day (a month's end is one too), where the
# budgets of D12 start again and a report by day splits.
DAY_MARGIN_SECONDS = 120.0


@pytest.fixture(autouse=True)
def roomInTheDay() -> None:
    """
    Wait (at most L{DAY_MARGIN_SECONDS}) until the UTC day has at least
    that long left, as test_gateway_limits does for the minute. Autouse
    in the modules that import it (test_gateway_ledger, test_gateway_money,
    test_gateway_budget_drift); this module is no plugin, so nowhere else.
    """
    left = 86400 - time.time() % 86400
    if left < DAY_MARGIN_SECONDS:
        time.sleep(left + 0.05)


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
    upstream: ScriptedUpstream
    workdir: Path
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
        # Budgets exact, not failing open on a Redis call slowed past the
        # 100 ms default by a loaded machine.
        "SVC_REDIS_TIMEOUT": "5s",
        "SVC_RATE_LIMIT_DEFAULT_RPM": "1000000",
    }


@attrs.frozen
class Received:
    answer: Answer
    at: float


def burst(
    stack: Stack,
    tenant: Tenant,
    body: bytes,
    count: int = 64,
    agent: uuid.UUID | None = None,
    path: str = "/v1/chat/completions",
) -> list[Received]:
    """
    C{count} requests at once (one thread each) to C{path}, alternating
    between the two proxies; each answer with the time it arrived.
    """
    ready = threading.Barrier(count)

    def send(index: int) -> Received:
        ready.wait(timeout=30)
        answer = post(stack.proxies[index % 2].httpPort, tenant, body, agent, path=path)
        return Received(answer, time.time())

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(send, range(count)))


def assertBudgetRefusal(
    received: Received, scope: str, periodEnd: Callable[[float], int] = monthEnd
) -> None:
    """
    429 BUDGET_EXCEEDED, the scope in detail, Retry-After the seconds until
    the period ends, the UTC month by default (within 2 s of when the
    answer arrived).
    """
    answer = received.answer
    assert answer.status == 429, answer.body
    error = answer.json()["error"]
    assert (error["code"], error["detail"]) == ("BUDGET_EXCEEDED", {"scope": scope})
    assert error["request_id"] == answer.headers["x-request-id"]
    expected = periodEnd(received.at) - received.at
    assert abs(int(answer.headers["retry-after"]) - expected) <= 2, (
        answer.headers["retry-after"],
        expected,
    )


def spend(rows: Mapping[str, Mapping[str, Any]]) -> int:
    return sum(int(row["cost_nano_usd"]) for row in rows.values())


def counter(daemon: Daemon, name: str) -> float:
    """
    The sum of a counter's samples on the daemon's /metrics (0 when it has
    none yet).
    """
    status, body = daemon.get("/metrics", timeout=5.0)
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def runningStack(
    postgresServer: PostgresServer,
    workdir: Path,
    providersFile: Callable[[Path, ScriptedUpstream], Path],
    proxySettings: Mapping[str, str] | None = None,
) -> Iterator[Stack]:
    """
    The end-to-end stack of the ledger's modules: a database of its own on
    C{postgresServer}, migrated; a Redis and the scripted upstream of its
    own; svc-auth and two proxies reading the providers file that
    C{providersFile} writes, with C{proxySettings} on top of
    L{proxyEnvironment}. Torn down in reverse; no daemon may have logged a
    traceback.
    """
    name = f"{workdir.name}_{uuid.uuid4().hex[:12]}".replace("-", "_").lower()
    dsn = migratedDatabase(postgresServer, name)
    redis = RedisServer.create(workdir / "redis")
    redis.start()
    upstream = ScriptedUpstream(workdir / "upstream").start()
    connection = psycopg.connect(dsn, autocommit=True)
    owner = Store(lambda: contextlib.nullcontext(connection))
    providers = providersFile(workdir / "providers.toml", upstream)
    auth = Daemon("svc-auth", authEnvironment(dsn), workdir / "auth.log").start()
    proxies: list[Daemon] = []
    try:
        environment = {**proxyEnvironment(auth, redis, providers), **(proxySettings or {})}
        proxies = startProxies(2, environment, workdir)
        for daemon in [auth, *proxies]:
            daemon.waitForReady()
        yield Stack(dsn, redis, auth, proxies, owner, upstream, workdir)
    finally:
        for daemon in reversed([auth, *proxies]):
            daemon.terminate()
        upstream.stop()
        redis.destroy()
        connection.close()
        postgresServer.dropDatabase(name)
    for daemon in [auth, *proxies]:
        assert "Traceback" not in daemon.output(), daemon.output()
