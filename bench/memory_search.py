"""
Benchmark of svc-memory's exact search (decisions D13): gRPC Search of one
scope of 768-dimension memories at one connection, against a real
`twistd -n svc-memory`, at 1,000, 10,000 and 100,000 memories; the cache's
bytes per memory (vectors, and apart the records a search answers with);
PostgreSQL's; and AddMemory calls per second.

    python bench/memory_search.py [--sizes 1000,10000,100000] [--searches 200]

Starts its own PostgreSQL (or uses --dsn, an empty database), migrates it,
makes a tenant, fills one scope (subject) per size straight into the table
with COPY (the bench measures search, not how fast rows arrive), starts
svc-memory on free loopback ports, then for each scope: one search that
loads it (a miss, timed apart), and --searches searches with random
queries, k=10, one after another on one channel. Targets on the 2-core
development machine: p50 at most 1 ms, 3 ms and 25 ms; cache bytes per
memory at most 1.2 x 768 x 4 = 3,686.

Client and server share this machine's cores; the figures are a floor of
what svc-memory does alone. Prints a table, and JSON with --json FILE;
exits 1 when the cache's bytes per memory pass the bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import numpy
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from svcd.auth.migrations import migrate  # noqa: E402
from svcd.auth.store import Store  # noqa: E402
from svcd.common.ids import uuid7  # noqa: E402
from svcd.pb.memory.v1 import memory_pb2, memory_pb2_grpc  # noqa: E402
from svcd.testing.daemons import Daemon, memoryEnvironment  # noqa: E402
from svcd.testing.servers import PostgresServer  # noqa: E402

DIMENSIONS = 768
MODEL = "bench-embed"
TARGET_P50_MS = {1_000: 1.0, 10_000: 3.0, 100_000: 25.0}
RECORD_BYTES = "svc_memory_record_cache_bytes"


def fill(dsn: str, orgID: uuid.UUID, agentID: uuid.UUID, subject: str, count: int) -> None:
    """
    C{count} memories of random unit vectors in one scope, by COPY as the
    schema owner.
    """
    generator = numpy.random.default_rng(count)
    started = int(time.time() * 1000) - count
    with psycopg.connect(dsn, autocommit=True) as connection, connection.cursor() as cursor:
        with cursor.copy(
            "COPY memories (id, org_id, agent_id, subject, content, metadata, source,"
            " embedding_model, dimensions, vector) FROM STDIN"
        ) as copy:
            for first in range(0, count, 10_000):
                block = generator.standard_normal((min(10_000, count - first), DIMENSIONS))
                block = (block / numpy.linalg.norm(block, axis=1)[:, None]).astype("<f4")
                for offset, vector in enumerate(block):
                    number = first + offset
                    copy.write_row(
                        (
                            uuid7(started + number),
                            orgID,
                            agentID,
                            subject,
                            f"memory number {number} of the benchmark",
                            "{}",
                            "api",
                            MODEL,
                            DIMENSIONS,
                            vector.tobytes(),
                        )
                    )


def cacheBytes(daemon: Daemon, series: str = "svc_memory_cache_bytes") -> float:
    """
    The daemon's gauge C{series}; 0 for one it does not export (an older
    svc-memory, measured for comparison, has no cache of records).
    """
    status, body = daemon.get("/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    if series != "svc_memory_cache_bytes":
        return 0.0
    raise AssertionError(f"no {series}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--searches", type=int, default=200)
    parser.add_argument("--adds", type=int, default=1000)
    parser.add_argument("--dsn", help="an empty database to use instead of a private server")
    parser.add_argument("--json", help="also write the results to this file")
    arguments = parser.parse_args()
    sizes = [int(each) for each in arguments.sizes.split(",")]
    rows: list[dict[str, object]] = []
    extra: dict[str, object] = {}

    with tempfile.TemporaryDirectory(prefix="svc-bench-") as scratch:
        workdir = Path(scratch)
        server = None
        dsn = arguments.dsn
        if dsn is None:
            server = PostgresServer.create(workdir / "postgres")
            server.start()
            dsn = server.createDatabase("bench")
        try:
            migrate(dsn)
            with psycopg.connect(dsn, autocommit=True) as connection:
                store = Store(lambda: contextlib.nullcontext(connection))
                orgID = store.createOrganization("bench")
                agentID = store.createAgent(orgID, "bench").agentID
            for size in sizes:
                started = time.perf_counter()
                fill(dsn, orgID, agentID, f"scope-{size}", size)
                print(f"filled {size} memories in {time.perf_counter() - started:.1f}s")
            with psycopg.connect(dsn, autocommit=True) as connection:
                connection.execute("VACUUM ANALYZE memories")
                total = connection.execute(
                    "SELECT pg_total_relation_size('memories'), count(*) FROM memories"
                ).fetchone()
                assert total is not None
                extra["postgres_bytes_per_memory"] = round(total[0] / total[1])

            cacheMB = max(64, sum(sizes) * DIMENSIONS * 4 * 12 // 10 // 2**20 + 64)
            daemon = Daemon(
                "svc-memory",
                memoryEnvironment(dsn, SVC_LOG_LEVEL="WARN", SVC_MEMORY_CACHE_MB=str(cacheMB)),
                workdir / "memory.log",
            ).start()
            try:
                daemon.waitForReady()
                port = daemon.environment["SVC_GRPC_PORT"]
                generator = numpy.random.default_rng(1)
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = memory_pb2_grpc.MemoryServiceStub(channel)
                    for size in sizes:
                        scope = memory_pb2.Scope(
                            org_id=str(orgID), agent_id=str(agentID), subject=f"scope-{size}"
                        )

                        def search(
                            scope: memory_pb2.Scope = scope,
                        ) -> memory_pb2.SearchResponse:
                            query = generator.standard_normal(DIMENSIONS).astype("<f4")
                            answer: memory_pb2.SearchResponse = stub.Search(
                                memory_pb2.SearchRequest(
                                    scope=scope,
                                    query=memory_pb2.Embedding(model=MODEL, vector=query.tobytes()),
                                    k=10,
                                ),
                                timeout=120,
                            )
                            return answer

                        before = cacheBytes(daemon)
                        recordsBefore = cacheBytes(daemon, RECORD_BYTES)
                        started = time.perf_counter()
                        first = search()
                        loadMs = (time.perf_counter() - started) * 1000
                        assert len(first.results) == min(10, size)
                        perMemory = (cacheBytes(daemon) - before) / size
                        # The scope's records load on their own thread
                        # after its first search: timed searches start
                        # once they are in (an older svc-memory has none).
                        started = time.perf_counter()
                        while (
                            cacheBytes(daemon, RECORD_BYTES) == recordsBefore
                            and daemon.get("/metrics")[1].find(RECORD_BYTES.encode()) >= 0
                            and time.perf_counter() - started < 300
                        ):
                            time.sleep(0.05)
                        recordsMs = (time.perf_counter() - started) * 1000
                        recordsPerMemory = (cacheBytes(daemon, RECORD_BYTES) - recordsBefore) / size
                        latencies = []
                        for _ in range(arguments.searches):
                            started = time.perf_counter()
                            search()
                            latencies.append((time.perf_counter() - started) * 1000)
                        latencies.sort()
                        rows.append(
                            {
                                "memories": size,
                                "p50_ms": round(statistics.median(latencies), 3),
                                "p90_ms": round(latencies[int(len(latencies) * 0.9)], 3),
                                "p99_ms": round(latencies[int(len(latencies) * 0.99)], 3),
                                "target_p50_ms": TARGET_P50_MS.get(size),
                                "first_search_ms": round(loadMs, 1),
                                "cache_bytes_per_memory": round(perMemory, 1),
                                "cache_bytes_per_memory_bound": 1.2 * DIMENSIONS * 4,
                                "record_cache_bytes_per_memory": round(recordsPerMemory, 1),
                                "records_loaded_after_ms": round(recordsMs, 1),
                            }
                        )
                    scope = memory_pb2.Scope(
                        org_id=str(orgID), agent_id=str(agentID), subject="adds"
                    )
                    vector = generator.standard_normal(DIMENSIONS).astype("<f4").tobytes()
                    started = time.perf_counter()
                    for number in range(arguments.adds):
                        stub.AddMemory(
                            memory_pb2.AddMemoryRequest(
                                scope=scope,
                                content=f"added memory {number}",
                                embedding=memory_pb2.Embedding(model=MODEL, vector=vector),
                            ),
                            timeout=10,
                        )
                    extra["grpc_adds_per_second_one_connection"] = round(
                        arguments.adds / (time.perf_counter() - started)
                    )
            except BaseException:
                # The daemon's log goes with the scratch directory: its
                # last lines say why a call failed (svc-memory logs the
                # database's error class, never a memory's content).
                daemon.terminate()
                sys.stderr.write(daemon.logFile.read_text()[-4000:])
                raise
            finally:
                daemon.terminate()
        finally:
            if server is not None:
                server.destroy()

    header = list(rows[0]) if rows else []
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row[key]) for key in header))
    for key, value in extra.items():
        print(f"{key}: {value}")
    if arguments.json:
        Path(arguments.json).write_text(json.dumps({"search": rows, **extra}, indent=2) + "\n")
    bound = 1.2 * DIMENSIONS * 4
    over = [row for row in rows if float(str(row["cache_bytes_per_memory"])) > bound]
    if over:
        print(f"cache bytes per memory above the bound of {bound:.0f}: {over}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
