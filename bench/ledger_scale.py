"""
Benchmark of the usage ledger at scale (issue 28, decisions D12 amended):
GetSpend and reports read the rollup, and what keeping the rollup costs
RecordUsage.

    python bench/ledger_scale.py [--rows 1000000] [--spend-calls 2000]
        [--record-batches 40] [--rounds 3] [--writers 1,4] [--json FILE]
        [--before DIR] [--migration-rows N] [--workdir DIR]

Starts its own PostgreSQL (or uses --dsn, an empty database), migrates it,
makes one organization (three agents, two tokens, four models), and loads
--rows ledger rows of it spread over the current UTC month up to now,
straight into PostgreSQL (generate_series, a million rows per statement),
then builds the rollup from them with the statement the migration uses
(sql/0007_ledger_key_and_rollup.sql). Then, against a real `twistd -n
svc-auth` on loopback:

    GetSpend     --spend-calls sequential calls through the gRPC method for
                 the current month (what a proxy asks after Redis lost a
                 budget's count), for the organization and for one agent:
                 p50, p99, max; then Store.spend's query alone, in this
                 process, and its plan
    scan         for comparison, the sum the ledger alone gives (GetSpend's
                 query before the rollup), timed once
    usage        `svcctl usage --org ORG --by model` for the month: the
                 whole command (a new Python process) and its query alone
    record       RecordUsage rows/s, before and after the rollup, on this
                 server in one run: batches of 1,000 new rows (12 groups of
                 agent, token and model), each in its transaction as
                 svc_auth_app, with the statement of bfd08eb (INSERT ... ON
                 CONFLICT DO NOTHING, no rollup) and with Store.recordUsage's
                 (the same INSERT in a CTE that also adds to the rollup),
                 alternating rounds so that drift hits both alike, by
                 --writers concurrent connections; then through the gRPC
                 method itself (the new code at scale; with --before, the
                 daemon of bfd08eb against this tree's, fresh ledgers)
    migration    with --migration-rows N, sql/0007 on a ledger of N rows
                 written before it, then sql/0008 (the kinds) after it

The private server runs with fsync off (svcd.devkit.postgres): commits cost
no disk flush, so rows/s is the CPU's, a bound on both statements alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from svcd.auth.authority import issueToken  # noqa: E402
from svcd.auth.store import Store  # noqa: E402
from svcd.auth.store.base import APPLICATION_ROLE  # noqa: E402
from svcd.auth.store.ledger import (  # noqa: E402
    _RECORD_USAGE,
    INSERT_USAGE_WITHOUT_ROLLUP,
    UsageRecord,
    ledgerBatch,
)
from svcd.common.ids import uuid7Text  # noqa: E402
from svcd.common.migrations import migrate  # noqa: E402
from svcd.common.permissions import Permission  # noqa: E402
from svcd.devkit.daemons import Daemon, authEnvironment  # noqa: E402
from svcd.devkit.postgres import PostgresServer  # noqa: E402
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc  # noqa: E402

MODELS = ("fast", "slow", "vision", "large")
CHUNK = 1_000_000
BATCH = 1_000


def monthStart(now: datetime.datetime) -> datetime.datetime:
    return datetime.datetime(now.year, now.month, 1, tzinfo=datetime.UTC)


def nextMonth(start: datetime.datetime) -> datetime.datetime:
    index = start.year * 12 + start.month
    return datetime.datetime(index // 12, index % 12 + 1, 1, tzinfo=datetime.UTC)


def load(
    dsn: str,
    orgID: uuid.UUID,
    agents: list[uuid.UUID],
    tokens: list[uuid.UUID],
    count: int,
    since: datetime.datetime,
    until: datetime.datetime,
) -> dict[str, float]:
    """
    Load C{count} rows of C{orgID} spread evenly over [since, until), then
    the rollup as the migration builds it; seconds of each step.
    """
    timings: dict[str, float] = {}
    span = (until - since).total_seconds()
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as connection:
        for first in range(0, count, CHUNK):
            last = min(first + CHUNK, count) - 1
            connection.execute(
                # Keys in ascending order (as UUID v7s made over time are),
                # the same row shape as a proxy's, numbers varying by row.
                "INSERT INTO usage_ledger (ledger_id, request_id, org_id, agent_id, token_id,"
                " model_requested, model, provider, upstream_model, stream, outcome,"
                " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens,"
                " tokens_from, cost_nano_usd, price_version, started_at, duration_us)"
                " SELECT key, key::text, %(org)s, (%(agents)s::uuid[])[1 + i %% 3],"
                " (%(tokens)s::uuid[])[1 + i %% 2], (%(models)s::text[])[1 + i %% 4],"
                " (%(models)s::text[])[1 + i %% 4], 'bench', 'upstream-model', i %% 5 = 0, 'ok',"
                " 500 + i %% 1000, i %% 100, 200 + i %% 300, i %% 50, 'provider',"
                " 1000 + i %% 100000, '0123456789abcdef',"
                " %(since)s + (i * %(step)s) * interval '1 microsecond', 250000"
                " FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i,"
                " LATERAL (SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid"
                " AS key) AS keys",
                {
                    "org": orgID,
                    "agents": agents,
                    "tokens": tokens,
                    "models": list(MODELS),
                    "since": since,
                    "step": span * 10**6 / count,
                    "first": first,
                    "last": last,
                },
            )
            print(f"  loaded {last + 1:,} rows", flush=True)
        timings["load_s"] = time.perf_counter() - started
        started = time.perf_counter()
        # The migration's statement (sql/0007_ledger_key_and_rollup.sql).
        connection.execute(
            "INSERT INTO usage_rollup (org_id, day, agent_id, token_id, model, requests,"
            " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, cost_nano_usd)"
            " SELECT org_id, (started_at AT TIME ZONE 'UTC')::date, agent_id, token_id, model,"
            " count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens),"
            " sum(reasoning_tokens), sum(cost_nano_usd) FROM usage_ledger GROUP BY 1, 2, 3, 4, 5"
        )
        timings["rollup_s"] = time.perf_counter() - started
        started = time.perf_counter()
        connection.execute("VACUUM ANALYZE usage_ledger")
        connection.execute("VACUUM ANALYZE usage_rollup")
        timings["vacuum_s"] = time.perf_counter() - started
        sizes = connection.execute(
            "SELECT pg_total_relation_size('usage_ledger'), pg_total_relation_size('usage_rollup'),"
            " (SELECT count(*) FROM usage_rollup)"
        ).fetchone()
        assert sizes is not None
        timings["ledger_bytes"], timings["rollup_bytes"], timings["rollup_rows"] = map(float, sizes)
    return timings


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max_ms": ordered[-1],
    }


def timed(call: Callable[[], Any], times: int) -> list[float]:
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


@contextlib.contextmanager
def applicationConnection(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute(f"SET ROLE {APPLICATION_ROLE}")
        yield connection


def benchBatch(
    orgID: uuid.UUID, agents: list[uuid.UUID], tokens: list[uuid.UUID], now: datetime.datetime
) -> list[UsageRecord]:
    return [
        UsageRecord(
            ledgerID=uuid7Text(),
            requestID=uuid7Text(),
            orgID=orgID,
            agentID=agents[index % 3],
            tokenID=tokens[index % 2],
            modelRequested=MODELS[index % 4],
            model=MODELS[index % 4],
            provider="bench",
            upstreamModel="upstream-model",
            stream=False,
            outcome="ok",
            promptTokens=500 + index,
            cachedTokens=index % 100,
            completionTokens=200,
            reasoningTokens=0,
            tokensFrom="provider",
            costNanoUSD=1000 + index,
            priceVersion="0123456789abcdef",
            startedAt=now,
            durationUS=250_000,
        )
        for index in range(BATCH)
    ]


_TICKS = os.sysconf("SC_CLK_TCK")


def cpuSeconds(pids: Iterable[int]) -> dict[int, float]:
    """
    The CPU time (user and system, all threads) each of C{pids} has used,
    from /proc; a process gone is left out. CPU time, unlike wall time,
    hardly moves with what else runs on a shared machine.
    """
    used = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        used[pid] = (int(fields[11]) + int(fields[12])) / _TICKS
    return used


def cpuSpent(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(value - before.get(pid, 0.0) for pid, value in after.items())


def recordRate(
    dsn: str,
    statement: str,
    batches: list[list[UsageRecord]],
    writers: int,
) -> tuple[float, float]:
    """
    Rows per second of C{statement} recording C{batches} (each in its own
    transaction in its organization's context, as Store.recordUsage does),
    shared among C{writers} connections at once; and the CPU microseconds
    per row that PostgreSQL's backends spent on them.
    """
    payloads = [ledgerBatch(batch) for batch in batches]
    orgID = str(batches[0][0].orgID)
    shares = [payloads[index::writers] for index in range(writers)]
    ready = threading.Barrier(writers + 1)
    failures: list[BaseException] = []
    cpu: list[float] = []

    def write(share: list[str]) -> None:
        try:
            with applicationConnection(dsn) as connection:
                row = connection.execute("SELECT pg_backend_pid()").fetchone()
                assert row is not None
                before = cpuSeconds([row[0]])
                ready.wait()
                for payload in share:
                    with connection.transaction():
                        connection.execute("SELECT set_config('svc.org_id', %s, true)", (orgID,))
                        connection.execute(statement, (payload,))
                cpu.append(cpuSpent(before, cpuSeconds(before)))
        except BaseException as error:  # reported below
            failures.append(error)
            raise

    threads = [threading.Thread(target=write, args=(share,)) for share in shares]
    for thread in threads:
        thread.start()
    ready.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise failures[0]
    rows = sum(len(batch) for batch in batches)
    return rows / elapsed, sum(cpu) / rows * 10**6


def usageRows(records: list[UsageRecord]) -> list[auth_pb2.UsageRow]:
    return [
        auth_pb2.UsageRow(
            ledger_id=each.ledgerID,
            request_id=each.requestID,
            org_id=str(each.orgID),
            agent_id=str(each.agentID),
            token_id=str(each.tokenID),
            model_requested=each.modelRequested,
            model=each.model,
            provider=each.provider,
            upstream_model=each.upstreamModel,
            outcome=each.outcome,
            prompt_tokens=each.promptTokens,
            cached_tokens=each.cachedTokens,
            completion_tokens=each.completionTokens,
            tokens_from=each.tokensFrom,
            cost_nano_usd=each.costNanoUSD,
            price_version=each.priceVersion,
            started_at_us=int(each.startedAt.timestamp() * 10**6),
            duration_us=each.durationUS,
        )
        for each in records
    ]


def grpcRecordRate(
    stub: auth_pb2_grpc.AuthServiceStub,
    orgID: uuid.UUID,
    agents: list[uuid.UUID],
    tokens: list[uuid.UUID],
    now: datetime.datetime,
    batches: int,
    clients: int,
    processes: Callable[[], list[int]] = list,
) -> tuple[float, float]:
    """
    Rows per second of C{batches} RecordUsage calls of 1,000 new rows,
    C{clients} calls in flight at once (as that many proxies would send),
    and the CPU microseconds per row spent by C{processes()} (svc-auth and
    its database connections).
    """
    requests = [
        auth_pb2.RecordUsageRequest(rows=usageRows(benchBatch(orgID, agents, tokens, now)))
        for _ in range(batches)
    ]
    shares = [requests[index::clients] for index in range(clients)]

    def send(share: list[auth_pb2.RecordUsageRequest]) -> None:
        for request in share:
            answer = stub.RecordUsage(request, timeout=60)
            assert answer.recorded == BATCH and not answer.rejected, answer

    threads = [threading.Thread(target=send, args=(share,)) for share in shares]
    before = cpuSeconds(processes())
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    spent = cpuSpent(before, cpuSeconds(set(before) | set(processes())))
    return BATCH * batches / elapsed, spent / (BATCH * batches) * 10**6


def serverProcesses(daemon: Daemon, dsn: str) -> Callable[[], list[int]]:
    """
    The pids of svc-auth and of its PostgreSQL backends (those of its
    database, but for the one asking).
    """

    def pids() -> list[int]:
        assert daemon.process is not None
        with psycopg.connect(dsn, autocommit=True) as connection:
            rows = connection.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            ).fetchall()
        return [daemon.process.pid, *(row[0] for row in rows)]

    return pids


def compareDaemons(
    server: PostgresServer,
    before: Path,
    workdir: Path,
    now: datetime.datetime,
    batches: int,
    rounds: int,
    clients: list[int],
) -> dict[str, float]:
    """
    RecordUsage rows/s of the code in C{before} (a tree of the commit
    before the rollup, bfd08eb: its daemon on a database migrated as it
    knew it, through 0006) and of this tree (on a database migrated fully),
    both ledgers fresh, in alternating rounds.
    """
    daemons = {}
    tenants = {}
    databases = {}
    for name, through, path in [
        ("before", "0006_usage.sql", str(before)),
        ("after", None, ""),
    ]:
        dsn = server.createDatabase(f"record_{name}")
        databases[name] = dsn
        migrate(dsn, through=through)
        with psycopg.connect(dsn, autocommit=True) as connection:
            store = Store(lambda: contextlib.nullcontext(connection))
            orgID = store.createOrganization(name)
            agents = [store.createAgent(orgID, f"agent-{n}").agentID for n in range(3)]
        tenants[name] = (orgID, agents, [uuid.uuid4(), uuid.uuid4()])
        overrides = {"SVC_LOG_LEVEL": "WARN"}
        if path:
            overrides["PYTHONPATH"] = path
        daemons[name] = Daemon(
            "svc-auth", authEnvironment(dsn, **overrides), workdir / f"auth-{name}.log"
        ).start()
    rates: dict[str, list[float]] = {}
    costs: dict[str, list[float]] = {}
    try:
        channels = {}
        for name, daemon in daemons.items():
            daemon.waitForHealth()
            channels[name] = grpc.insecure_channel(
                f"127.0.0.1:{daemon.environment['SVC_GRPC_PORT']}"
            )
        for _ in range(rounds):
            for count in clients:
                for name, channel in channels.items():
                    stub = auth_pb2_grpc.AuthServiceStub(channel)
                    orgID, agents, tokens = tenants[name]
                    rate, cost = grpcRecordRate(
                        stub,
                        orgID,
                        agents,
                        tokens,
                        now,
                        batches,
                        count,
                        serverProcesses(daemons[name], databases[name]),
                    )
                    rates.setdefault(f"{name}_{count}_rows_per_s", []).append(rate)
                    costs.setdefault(f"{name}_{count}_cpu_us_per_row", []).append(cost)
        for channel in channels.values():
            channel.close()
    finally:
        for daemon in daemons.values():
            daemon.terminate()
    return {key: statistics.median(values) for key, values in [*rates.items(), *costs.items()]}


def timeMigration(server: PostgresServer, count: int) -> dict[str, float]:
    """
    Seconds of sql/0007 on a ledger of C{count} rows written as before it
    (keyed by request id), in a database of its own; then of sql/0008 (the
    kinds, decisions D13) on the ledger and rollup 0007 left.
    """
    dsn = server.createDatabase("migration")
    migrate(dsn, through="0006_usage.sql")
    orgID = uuid.uuid4()
    with psycopg.connect(dsn, autocommit=True) as connection:
        for first in range(0, count, CHUNK):
            connection.execute(
                "INSERT INTO usage_ledger (request_id, org_id, agent_id, token_id,"
                " model_requested, model, provider, upstream_model, stream, outcome,"
                " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens,"
                " tokens_from, cost_nano_usd, price_version, started_at, duration_us)"
                " SELECT gen_random_uuid()::text, %s, NULL, NULL, 'fast', 'fast', 'bench',"
                " 'upstream-model', false, 'ok', 500, 0, 200, 0, 'provider', 1000 + i %% 1000,"
                " 'v', now() - i * interval '1 second', 1"
                " FROM generate_series(%s::bigint, %s::bigint) AS i",
                (orgID, first, min(first + CHUNK, count) - 1),
            )
        connection.execute("VACUUM ANALYZE usage_ledger")
    started = time.perf_counter()
    assert migrate(dsn, through="0007_ledger_key_and_rollup.sql") == [
        "0007_ledger_key_and_rollup.sql"
    ]
    keyed = time.perf_counter() - started
    started = time.perf_counter()
    assert migrate(dsn, through="0008_usage_kind.sql") == ["0008_usage_kind.sql"]
    return {
        "rows": float(count),
        "migration_s": keyed,
        "kind_migration_s": time.perf_counter() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--spend-calls", type=int, default=2_000)
    parser.add_argument("--record-batches", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writers", default="1,4")
    parser.add_argument("--dsn", help="an empty database to use instead of a private server")
    parser.add_argument("--workdir", help="where the private server lives (default: /tmp)")
    parser.add_argument("--json", help="write the results there too")
    parser.add_argument(
        "--migration-rows",
        type=int,
        default=0,
        help="also time sql/0007 on a ledger of that many rows written before it",
    )
    parser.add_argument(
        "--before",
        help="a tree of the commit before the rollup (git archive bfd08eb | tar -x -C DIR):"
        " compare RecordUsage through gRPC, its daemon against this tree's",
    )
    arguments = parser.parse_args()
    results: dict[str, Any] = {"rows": arguments.rows}

    with tempfile.TemporaryDirectory(prefix="svc-ledger-", dir=arguments.workdir) as scratch:
        workdir = Path(scratch)
        server = None
        dsn = arguments.dsn
        if dsn is None:
            server = PostgresServer.create(workdir / "postgres")
            server.start()
            dsn = server.createDatabase("bench")
        try:
            migrate(dsn)
            now = datetime.datetime.now(datetime.UTC)
            since = monthStart(now)
            until = nextMonth(since)
            with psycopg.connect(dsn, autocommit=True) as connection:
                store = Store(lambda: contextlib.nullcontext(connection))
                orgID = store.createOrganization("bench")
                agents = [store.createAgent(orgID, f"agent-{n}").agentID for n in range(3)]
                tokens = [uuid.uuid4(), uuid.uuid4()]
                issueToken(store, orgID=orgID, permissions=int(Permission.UsageRead))
            print(f"loading {arguments.rows:,} rows into {since:%Y-%m} ...", flush=True)
            results["load"] = load(dsn, orgID, agents, tokens, arguments.rows, since, now)
            print(json.dumps(results["load"]), flush=True)

            with psycopg.connect(dsn, autocommit=True) as connection:
                started = time.perf_counter()
                connection.execute(
                    "SELECT coalesce(sum(cost_nano_usd), 0) FROM usage_ledger"
                    " WHERE org_id = %s AND started_at >= %s AND started_at < %s",
                    (orgID, since, until),
                ).fetchone()
                results["scan_ms"] = (time.perf_counter() - started) * 1000
            print(f"the ledger's own sum of the month: {results['scan_ms']:.0f} ms", flush=True)

            daemon = Daemon(
                "svc-auth", authEnvironment(dsn, SVC_LOG_LEVEL="WARN"), workdir / "auth.log"
            ).start()
            try:
                daemon.waitForHealth()
                port = daemon.environment["SVC_GRPC_PORT"]
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = auth_pb2_grpc.AuthServiceStub(channel)
                    month = auth_pb2.GetSpendRequest(
                        org_id=str(orgID),
                        since_unix=int(since.timestamp()),
                        until_unix=int(until.timestamp()),
                    )
                    ofAgent = auth_pb2.GetSpendRequest()
                    ofAgent.CopyFrom(month)
                    ofAgent.agent_id = str(agents[0])
                    expected = stub.GetSpend(month, timeout=10)
                    for name, spend in [("org", month), ("agent", ofAgent)]:
                        stub.GetSpend(spend, timeout=10)

                        def call(spend: auth_pb2.GetSpendRequest = spend) -> None:
                            stub.GetSpend(spend, timeout=10)

                        samples = timed(call, arguments.spend_calls)
                        results[f"getspend_{name}"] = percentiles(samples)
                        print(f"GetSpend ({name}): {results[f'getspend_{name}']}", flush=True)
                    results["getspend_nano_usd"] = expected.cost_nano_usd
                    # The query alone, in this process, as svc-auth runs it
                    # (svc_auth_app, the organization's context): what the
                    # database does, without gRPC and the machine's
                    # scheduling around it.
                    with applicationConnection(dsn) as connection:
                        appStore = Store(lambda: contextlib.nullcontext(connection))
                        samples = timed(
                            lambda: appStore.spend(orgID, None, since, until),
                            arguments.spend_calls,
                        )
                        results["spend_query"] = percentiles(samples)
                        with connection.transaction():
                            connection.execute(
                                "SELECT set_config('svc.org_id', %s, true)", (str(orgID),)
                            )
                            plan = connection.execute(
                                "EXPLAIN (ANALYZE, BUFFERS) SELECT coalesce(sum(cost_nano_usd), 0)"
                                " FROM usage_rollup WHERE org_id = %s AND day >= %s AND day < %s",
                                (orgID, since.date(), until.date()),
                            ).fetchall()
                        results["spend_plan"] = [row[0] for row in plan]
                    print(f"  its query: {results['spend_query']}", flush=True)

                    command = [
                        sys.executable,
                        "-m",
                        "svcd.ctl",
                        "usage",
                        "--org",
                        str(orgID),
                        "--by",
                        "model",
                    ]
                    environment = {"POSTGRES_DSN": dsn, "PATH": "/usr/bin:/bin"}
                    samples = []
                    for _ in range(5):
                        started = time.perf_counter()
                        printed = subprocess.run(
                            command, env=environment, capture_output=True, text=True, check=True
                        )
                        samples.append((time.perf_counter() - started) * 1000)
                    report = json.loads(printed.stdout)
                    assert report["total"]["requests"] == arguments.rows, report["total"]
                    results["svcctl_usage_by_model"] = percentiles(samples)
                    with psycopg.connect(dsn, autocommit=True) as connection:
                        owner = Store(lambda: contextlib.nullcontext(connection))
                        samples = timed(
                            lambda: owner.usageSums(orgID, None, since, until, "model"), 20
                        )
                    results["usage_query_by_model"] = percentiles(samples)
                    print(f"svcctl usage --by model: {results['svcctl_usage_by_model']}")
                    print(f"  its query: {results['usage_query_by_model']}", flush=True)

                    rates: dict[str, list[float]] = {}
                    costs: dict[str, list[float]] = {}
                    for writers in (int(each) for each in arguments.writers.split(",")):
                        for _ in range(arguments.rounds):
                            for name, statement in [
                                ("before", INSERT_USAGE_WITHOUT_ROLLUP),
                                ("after", _RECORD_USAGE),
                            ]:
                                batches = [
                                    benchBatch(orgID, agents, tokens, now)
                                    for _ in range(arguments.record_batches)
                                ]
                                rate, cost = recordRate(dsn, statement, batches, writers)
                                rates.setdefault(f"{name}_{writers}", []).append(rate)
                                costs.setdefault(f"{name}_{writers}", []).append(cost)
                    results["record_rows_per_s"] = {
                        key: statistics.median(values) for key, values in rates.items()
                    }
                    results["record_backend_cpu_us_per_row"] = {
                        key: statistics.median(values) for key, values in costs.items()
                    }
                    print(f"  backend CPU: {results['record_backend_cpu_us_per_row']}")
                    print(f"record rows/s: {results['record_rows_per_s']}", flush=True)

                    results["recordusage_grpc_rows_per_s_at_scale"] = statistics.median(
                        grpcRecordRate(
                            stub, orgID, agents, tokens, now, arguments.record_batches, 1
                        )[0]
                        for _ in range(arguments.rounds)
                    )
                    print(
                        "RecordUsage through gRPC at scale:"
                        f" {results['recordusage_grpc_rows_per_s_at_scale']:.0f} rows/s",
                        flush=True,
                    )
                    after = stub.GetSpend(month, timeout=10)
                    with psycopg.connect(dsn, autocommit=True) as connection:
                        row = connection.execute(
                            "SELECT (SELECT sum(cost_nano_usd) FROM usage_ledger"
                            " WHERE started_at >= %s AND started_at < %s),"
                            " (SELECT sum(cost_nano_usd) FROM usage_rollup WHERE day >= %s)",
                            (since, until, since.date()),
                        ).fetchone()
                    assert row is not None
                    # The "before" rounds wrote rows without the rollup on
                    # purpose; everything else is in both.
                    results["ledger_minus_rollup_nano_usd"] = int(row[0]) - int(row[1])
                    results["getspend_after_nano_usd"] = after.cost_nano_usd
            finally:
                daemon.terminate()
            if arguments.before and server is not None:
                results["recordusage_grpc_before_after"] = compareDaemons(
                    server,
                    Path(arguments.before),
                    workdir,
                    now,
                    arguments.record_batches,
                    arguments.rounds,
                    [int(each) for each in arguments.writers.split(",")],
                )
                print(
                    f"RecordUsage through gRPC: {results['recordusage_grpc_before_after']}",
                    flush=True,
                )
            if arguments.migration_rows and server is not None:
                results["migration"] = timeMigration(server, arguments.migration_rows)
                print(f"migration: {results['migration']}", flush=True)
        finally:
            if server is not None:
                server.destroy()
    print(json.dumps(results, indent=2))
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
