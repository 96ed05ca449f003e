"""
What one Search costs svc-memory, measured from the outside: CPU (µs of
its process, from /proc/<pid>/stat, and of each kind of thread) and
context switches (every thread's, from /proc/<pid>/task/*/status) per
Search, with the p50 a blocking client sees; the forward-recall row's
Search (a scope of --memories memories of 64 dimensions, k 5), one call
at a time, as at one connection.

    python bench/search_cost.py [--memories 1000] [--searches 2000] [--rounds 3]
        [--tree DIR] [--memory-env NAME=VALUE] [--health] [--threads] [--in-flight N]

One svc-memory per --tree (its code, by PYTHONPATH, as bench/compare.py
runs a revision; default: this work tree), every one on one PostgreSQL and
one scope; the rounds alternate them, each round's searches after a warm
up of 200, so that what else runs on the machine weighs on each alike.
A --tree may end in C{@NAME=VALUE,...}: that daemon's own environment
besides --memory-env's. Prints one line per round and daemon, then each
daemon's medians over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import struct
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psycopg
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway import remember  # noqa: E402

from svcd.auth.store import Store  # noqa: E402
from svcd.common.migrations import migrate  # noqa: E402
from svcd.devkit.daemons import Daemon, memoryEnvironment  # noqa: E402
from svcd.devkit.postgres import PostgresServer  # noqa: E402
from svcd.pb.memory.v1 import memory_pb2, memory_pb2_grpc  # noqa: E402

MODEL = "bench-embed"
TICK = os.sysconf("SC_CLK_TCK")


def processTimes(pid: int) -> tuple[float, int, Counter[str]]:
    """
    The process's CPU seconds and its threads' context switches (voluntary
    and not); by thread id, its CPU ticks and (as C{"sw <id>"}) its context
    switches.
    """
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICK
    switches = 0
    byTask: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            taskStat = (task / "stat").read_text()
        except OSError:
            continue
        own = sum(
            int(line.split()[1])
            for line in status.splitlines()
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        )
        switches += own
        rest = taskStat.rsplit(")", 1)[1].split()
        byTask[task.name] += int(rest[11]) + int(rest[12])
        byTask["sw " + task.name] += own
    return cpu, switches, byTask


def fill(address: str, orgID: str, agentID: str, memories: int) -> None:
    """
    The scope the forward-recall row of bench/gateway.py searches: the
    same memories and vectors, stored the same way.
    """
    remember(address, orgID, agentID, memories)


def searches(
    daemon: Daemon,
    orgID: str,
    agentID: str,
    count: int,
    warmup: int = 200,
    health: bool = False,
    inFlight: int = 1,
) -> tuple[float, float, float, dict[str, float]]:
    """
    C{count} Searches one after another, each with an unsampled parent's
    C{traceparent} as svc-proxy sends 99% of them: µs of CPU, context
    switches and p50 ms per Search, and µs of CPU and context switches per
    Search by thread id. With C{health}, health checks on the same server
    instead: the floor of a call that does nothing. With C{inFlight}
    above 1, that many client threads on the one channel, each making its
    share one after another.
    """
    assert daemon.process is not None
    pid = daemon.process.pid
    generator = random.Random(7)
    port = daemon.environment["SVC_GRPC_PORT"]
    scope = memory_pb2.Scope(org_id=orgID, agent_id=agentID)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)

        def request() -> memory_pb2.SearchRequest:
            vector = struct.pack("<64f", *(generator.gauss(0, 1) for _ in range(64)))
            return memory_pb2.SearchRequest(
                scope=scope, k=5, query=memory_pb2.Embedding(model=MODEL, vector=vector)
            )

        def call(made: memory_pb2.SearchRequest) -> None:
            traceparent = (
                f"00-{generator.getrandbits(128):032x}-{generator.getrandbits(64):016x}-00"
            )
            if health:
                checker.Check(health_pb2.HealthCheckRequest(), timeout=10)
                return
            answer = stub.Search(made, timeout=10, metadata=(("traceparent", traceparent),))
            assert len(answer.results) == 5

        checker = health_pb2_grpc.HealthStub(channel)
        made = [request() for _ in range(count + warmup)]
        for each in made[:warmup]:
            call(each)
        cpu0, switches0, names0 = processTimes(pid)
        latencies: list[float] = []

        def share(number: int) -> None:
            for each in made[warmup + number :: inFlight]:
                started = time.perf_counter()
                call(each)
                latencies.append(time.perf_counter() - started)

        with ThreadPoolExecutor(inFlight) as clients:
            list(clients.map(share, range(inFlight)))
        cpu1, switches1, names1 = processTimes(pid)
    names1.subtract(names0)
    perThread = {
        name: value / count if name.startswith("sw ") else value * 1e6 / TICK / count
        for name, value in names1.most_common(30)
        if value
    }
    return (
        (cpu1 - cpu0) * 1e6 / count,
        (switches1 - switches0) / count,
        statistics.median(latencies) * 1000,
        perThread,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memories", type=int, default=1000)
    parser.add_argument("--searches", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[])
    parser.add_argument("--memory-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--health", action="store_true", help="also time health checks (the floor) each round"
    )
    parser.add_argument("--threads", action="store_true", help="print each thread's share")
    parser.add_argument(
        "--in-flight", type=int, default=1, help="client threads, each one call at a time"
    )
    arguments = parser.parse_args()
    memoryEnv = dict(each.split("=", 1) for each in arguments.memory_env)
    trees = arguments.tree or [str(ROOT)]
    with tempfile.TemporaryDirectory(prefix="svc-search-cost-") as scratch:
        workdir = Path(scratch)
        server = PostgresServer.create(workdir / "postgres")
        server.start()
        daemons: list[tuple[str, Daemon]] = []
        try:
            dsn = server.createDatabase("bench")
            migrate(dsn)
            with psycopg.connect(dsn, autocommit=True) as connection:
                store = Store(lambda: contextlib.nullcontext(connection))
                orgID = store.createOrganization("bench")
                agentID = store.createAgent(orgID, "bench").agentID
            for number, spec in enumerate(trees):
                tree, _, extra = spec.partition("@")
                own = dict(each.split("=", 1) for each in extra.split(",") if each)
                environment = memoryEnvironment(
                    dsn,
                    SVC_LOG_LEVEL="WARN",
                    SVC_MEMORY_MAX_PER_SCOPE="1000000",
                    PYTHONPATH=str(Path(tree).resolve()),
                    **memoryEnv,
                    **own,
                )
                daemon = Daemon("svc-memory", environment, workdir / f"memory-{number}.log")
                daemons.append((spec, daemon.start()))
            for _, daemon in daemons:
                daemon.waitForReady()
            started = time.perf_counter()
            fill(
                f"127.0.0.1:{daemons[0][1].environment['SVC_GRPC_PORT']}",
                str(orgID),
                str(agentID),
                arguments.memories,
            )
            print(f"filled {arguments.memories} memories in {time.perf_counter() - started:.1f}s")
            kinds = [(spec, False) for spec, _ in daemons]
            if arguments.health:
                kinds += [(spec, True) for spec, _ in daemons]
            results: dict[str, list[tuple[float, float, float]]] = {}
            for number in range(arguments.rounds):
                for spec, health in kinds:
                    daemon = dict(daemons)[spec]
                    label = f"{spec} health" if health else spec
                    load = os.getloadavg()[0]
                    cpu, switches, p50, perThread = searches(
                        daemon,
                        str(orgID),
                        str(agentID),
                        arguments.searches,
                        health=health,
                        inFlight=arguments.in_flight,
                    )
                    results.setdefault(label, []).append((cpu, switches, p50))
                    threads = ", ".join(f"{name} {value:.1f}" for name, value in perThread.items())
                    print(
                        f"round {number + 1}  {label}: {cpu:7.0f} µs CPU/call"
                        f"  {switches:5.1f} switches  p50 {p50:.3f} ms  load {load:.1f}"
                        + (f"  ({threads})" if arguments.threads else ""),
                        flush=True,
                    )
            for spec, rows in results.items():
                print(
                    f"median  {spec}: {statistics.median(r[0] for r in rows):7.0f} µs CPU/call"
                    f"  {statistics.median(r[1] for r in rows):5.1f} switches"
                    f"  p50 {statistics.median(r[2] for r in rows):.3f} ms"
                )
        finally:
            for _, daemon in daemons:
                daemon.terminate()
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
