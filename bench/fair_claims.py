"""
Benchmark of the fair claim and the per-organization count of waiting
observations at scale (decisions D13, amended, "No organization holds up
another"; sql/0018_fair_claims.sql).

    python bench/fair_claims.py [--through MIGRATION] [--repeat 20]
        [--json FILE]

Starts its own PostgreSQL, applies the migrations (through --through,
say 0017_..., to measure the claim before sql/0018), and measures, for
each shape of queue, svc_claim_observations' time for claims of 1, 10
and 100 (each in a transaction rolled back, so every claim sees the same
queue; median and worst of --repeat), and queueing's count of an
organization's waiting observations bounded by 100,000 (as svc_memory_app,
under row-level security). Prints the plan (EXPLAIN ANALYZE) of the fair
claim's statement for each shape too.

Shapes: one organization with 100,000 waiting (64 of them in hand);
300 organizations with 300 each; one with 100,000 and 300 with 10 each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from svcd.common.migrations import migrate  # noqa: E402
from svcd.devkit.postgres import PostgresServer  # noqa: E402

SHAPES: dict[str, list[int]] = {
    "1 org x 100,000": [100_000],
    "300 orgs x 300": [300] * 300,
    "1 org x 100,000 + 300 x 10": [100_000] + [10] * 300,
}
IN_HAND = 64


def fill(connection: psycopg.Connection[Any], backlogs: list[int]) -> list[uuid.UUID]:
    """
    Queue the backlogs (one organization each, one agent), the oldest
    first, and lease IN_HAND of the first organization's oldest.
    """
    connection.execute("TRUNCATE memory_observations")
    orgs = [uuid.uuid4() for _ in backlogs]
    rows = 0
    for orgID, count in zip(orgs, backlogs, strict=True):
        connection.execute(
            "INSERT INTO memory_observations (id, org_id, agent_id, subject, request_id,"
            " observation_key, messages, next_attempt_at)"
            " SELECT gen_random_uuid(), %s, %s, '', 'req-' || n, 'key-' || n,"
            ' \'[{"role": "user", "content": "hello"}]\'::jsonb,'
            " now() - interval '1 hour' + make_interval(secs => (%s + n) / 1000.0)"
            " FROM generate_series(1, %s) AS n",
            (orgID, uuid.uuid4(), rows, count),
        )
        rows += count
    connection.execute(
        "UPDATE memory_observations SET lease_owner = 'bench',"
        " lease_expires_at = now() + interval '1 hour', lease_token = gen_random_uuid()"
        " WHERE id IN (SELECT id FROM memory_observations WHERE org_id = %s"
        " ORDER BY next_attempt_at LIMIT %s)",
        (orgs[0], IN_HAND),
    )
    connection.execute("VACUUM ANALYZE memory_observations")
    return orgs


def timeClaims(connection: psycopg.Connection[Any], limit: int, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        with connection.transaction(force_rollback=True):
            started = time.perf_counter()
            connection.execute(
                "SELECT * FROM svc_claim_observations('bench', 60, %s)", (limit,)
            ).fetchall()
            times.append((time.perf_counter() - started) * 1000)
    return times


COUNT = (
    "SELECT count(*) FROM (SELECT 1 FROM memory_observations"
    " WHERE org_id = %s AND state = 'waiting' LIMIT 100000) AS held"
)


def timeCount(dsn: str, orgID: uuid.UUID, repeat: int, plan: bool = False) -> list[float]:
    """
    Queueing's count (svcd.memory.store.queue._room) as svc_memory_app, under
    row-level security; with C{plan}, its plan printed once.
    """
    times = []
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute("SET ROLE svc_memory_app")
        for _ in range(repeat):
            with connection.transaction():
                connection.execute("SELECT set_config('svc.org_id', %s, true)", (str(orgID),))
                started = time.perf_counter()
                connection.execute(COUNT, (orgID,)).fetchone()
                times.append((time.perf_counter() - started) * 1000)
        if plan:
            with connection.transaction():
                connection.execute("SELECT set_config('svc.org_id', %s, true)", (str(orgID),))
                rows = connection.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + COUNT, (orgID,)
                ).fetchall()
                print("\n".join(str(row[0]) for row in rows), flush=True)
    return times


def fairPlan(connection: psycopg.Connection[Any], limit: int) -> str:
    """
    The plan of the fair pass's statement (the function's first query, as
    a SELECT of what it would lease).
    """
    source = (ROOT / "sql" / "0018_fair_claims.sql").read_text()
    start = source.index("WITH RECURSIVE organizations")
    end = source.index(", took AS (", start)
    query = source[start:end].replace("wanted", str(limit)) + "SELECT id FROM chosen"
    rows = connection.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + query).fetchall()
    return "\n".join(row[0] for row in rows)


def summary(times: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(times), 2), "max_ms": round(max(times), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--through", default=None)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plans", action="store_true", help="print the fair pass's plans")
    arguments = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fair-claims-") as directory:
        server = PostgresServer.create(Path(directory))
        server.start()
        try:
            with server.temporaryDatabase() as dsn:
                applied = migrate(dsn, through=arguments.through)
                fair = any(name.startswith("0018") for name in applied)
                with psycopg.connect(dsn, autocommit=True) as connection:
                    for shape, backlogs in SHAPES.items():
                        orgs = fill(connection, backlogs)
                        row: dict[str, Any] = {}
                        for limit in (1, 10, 100):
                            row[f"claim_{limit}"] = summary(
                                timeClaims(connection, limit, arguments.repeat)
                            )
                        row["count"] = summary(
                            timeCount(dsn, orgs[0], arguments.repeat, fair and arguments.plans)
                        )
                        results[shape] = row
                        print(f"{shape}: {json.dumps(row)}", flush=True)
                        if fair and arguments.plans:
                            print(fairPlan(connection, 10), flush=True)
        finally:
            server.destroy()
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
