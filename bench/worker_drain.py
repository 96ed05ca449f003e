"""
Benchmark of svc-worker draining a backlog (decisions D13, issue 33):
10,000 waiting observations, the scripted model server answering the
extraction and the embeddings, one `twistd -n svc-worker` beside real
svc-auth, svc-memory, PostgreSQL and Redis. Target on the 2-core
development machine: at least 200 observations a second, every fact
stored exactly once.

    python bench/worker_drain.py [--observations 10000] [--concurrency 64]
        [--subjects 100] [--organizations 1] [--profile DIR] [--statements N]
        [--json FILE]

Starts its own PostgreSQL, Redis, scripted upstream, svc-auth and
svc-memory on free loopback ports, makes a tenant, and queues the
observations through svc-memory's QueueObservations (500 a call, as the
proxy's outbox sends them), spread over --subjects subjects of one agent
(one user's scope holds 200 facts, not 20,000: SVC_MEMORY_MAX_PER_SCOPE
is 10,000, and a user's memories are what a search compares). Each
observation's user turn states two facts and asks a question; the
scripted extraction answers the two facts. Then it starts svc-worker and
measures from its /ready (its first claim answered) until no observation
is left, polling the table every 100 ms.

With --organizations N (N > 1) the observations are spread over N
organizations (one agent each), queued one organization's backlog after
the other, the first organization's largest (half of them; the others
share the rest): the claims' fairness across organizations (decisions
D13, amended) is then what decides when each organization's first
observation is processed. The round reports, over the organizations, the
seconds from the drain's start until the first of each organization's
observations was done (the median and the worst).

Verified at the end: every expected fact is a memory exactly once (source
extracted), nothing else is stored, no observation is left (none failed),
and the ledger holds one extraction and one embedding row per observation.

With --profile DIR, svc-worker runs under py-spy (pip install py-spy) for
the drain, and the flat profile of its main thread (the reactor) and of
every thread is written to DIR and summarised.

With --statements N, the private PostgreSQL loads pg_stat_statements
(every statement, those inside functions too) and the round lists the N
statements that took the most time during the drain, with their calls
and milliseconds per observation. Every round also reports each process's
CPU milliseconds per observation, and what svc-memory counted during the
drain (its cache's hits, misses and evictions, its transactions by
operation, its calls by method). The drain is watched through one
connection, not a new one per poll (each a backend forked), ten times a
second until every organization has its first observation done, then
four times (each poll reads the whole queue: 4 to 8 ms of PostgreSQL's
CPU with 10,000 waiting).

Every process shares this machine's cores: the rate is a floor of what
svc-worker does alone. Prints a table, and JSON with --json FILE; exits 1
when a fact is missing or stored twice.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import attrs
import grpc
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from svcd.auth.store import Store  # noqa: E402
from svcd.common.migrations import migrate  # noqa: E402
from svcd.devkit.daemons import Daemon, authEnvironment, memoryEnvironment  # noqa: E402
from svcd.devkit.postgres import PostgresServer  # noqa: E402
from svcd.devkit.redis import RedisServer  # noqa: E402
from svcd.devkit.servers import freePort  # noqa: E402
from svcd.devkit.upstream.client import (  # noqa: E402
    MEMORY_EMBEDDING_DIMENSIONS,
    ScriptedUpstream,
    memoryProvidersFile,
)
from svcd.pb.memory.v1 import memory_pb2, memory_pb2_grpc  # noqa: E402

TARGET_PER_SECOND = 200.0


def factsOf(requestID: str) -> list[str]:
    """
    Two facts about the user, each with words of its own: the scripted
    embeddings are hashed bags of words (256 dimensions), so facts sharing
    most words (as "My fact number 0 is <id>-0.") would now and then come
    out at or above dedupe_score and be merged, as they should.
    """
    return [f"My fact is {uuid.uuid5(uuid.UUID(requestID), str(n))}." for n in range(2)]


def shares(count: int, organizations: int) -> list[int]:
    """
    How many of C{count} observations each organization queues: all of
    them for one; else half for the first, the rest spread evenly.
    """
    if organizations == 1:
        return [count]
    first = count // 2
    rest = count - first
    return [first] + [
        rest // (organizations - 1) + (1 if n < rest % (organizations - 1) else 0)
        for n in range(organizations - 1)
    ]


def queue(
    port: str,
    tenants: list[tuple[uuid.UUID, uuid.UUID]],
    count: int,
    subjects: int,
    prefix: str,
) -> dict[str, str]:
    """
    Queue C{count} observations, one organization's backlog after the
    other (L{shares}); return each request id's subject.
    """
    owners: list[tuple[uuid.UUID, uuid.UUID]] = []
    for tenant, share in zip(tenants, shares(count, len(tenants)), strict=True):
        owners += [tenant] * share
    requests = {str(uuid.uuid4()): f"{prefix}user-{number % subjects}" for number in range(count)}
    observations = [
        memory_pb2.Observation(
            scope=memory_pb2.Scope(org_id=str(orgID), agent_id=str(agentID), subject=subject),
            request_id=requestID,
            messages=[
                memory_pb2.ObservedMessage(
                    role="user", content=" ".join(factsOf(requestID)) + " What do you think?"
                ),
                memory_pb2.ObservedMessage(role="assistant", content="Noted."),
            ],
        )
        for (requestID, subject), (orgID, agentID) in zip(requests.items(), owners, strict=True)
    ]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        for start in range(0, len(observations), 500):
            stub.QueueObservations(
                memory_pb2.QueueObservationsRequest(observations=observations[start : start + 500]),
                timeout=60,
            )
    return requests


def waiting(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as connection:
        return sum(waitingByOrganization(connection).values())


def waitingByOrganization(connection: psycopg.Connection[Any]) -> dict[uuid.UUID, int]:
    return dict(
        connection.execute(
            "SELECT org_id, count(*) FROM memory_observations GROUP BY org_id"
        ).fetchall()
    )


# What svc-memory counts that says where a drain's work went.
MEMORY_COUNTERS = (
    "svc_memory_cache_hits_total",
    "svc_memory_cache_misses_total",
    "svc_memory_cache_evictions_total",
    "svc_memory_record_cache_hits_total",
    "svc_memory_record_cache_misses_total",
    "svc_memory_record_cache_evictions_total",
    "svc_db_query_duration_seconds_count",
    "svc_db_query_duration_seconds_sum",
    "svc_memory_grpc_requests_total",
)


def counted(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """
    What each counter of C{after} gained since C{before}, those that did.
    """
    return {
        name: round(value - before.get(name, 0.0), 3)
        for name, value in sorted(after.items())
        if value != before.get(name, 0.0)
    }


def loadStatements(server: PostgresServer) -> None:
    """
    pg_stat_statements for the private server, every statement counted
    (those a function runs too), before it starts.
    """
    with (server.dataDirectory / "postgresql.conf").open("a") as conf:
        conf.write(
            "shared_preload_libraries = 'pg_stat_statements'\n"
            "pg_stat_statements.track = all\n"
            "pg_stat_statements.max = 1000\n"
            "pg_stat_statements.track_planning = on\n"
        )


def topStatements(
    connection: psycopg.Connection[Any], count: int, observations: int
) -> list[dict[str, Any]]:
    """
    The C{count} statements that took the most time since the last
    reset, each with its calls and milliseconds per observation.
    """
    rows = connection.execute(
        "SELECT query, calls, total_exec_time + total_plan_time, total_plan_time, rows"
        " FROM pg_stat_statements"
        " ORDER BY total_exec_time + total_plan_time DESC LIMIT %s",
        (count,),
    ).fetchall()
    return [
        {
            "calls_per_observation": round(calls / observations, 3),
            "ms_per_observation": round(total / observations, 4),
            "ms_per_call": round(total / calls, 4) if calls else 0.0,
            "planning_ms_per_call": round(planning / calls, 4) if calls else 0.0,
            "rows": rows_,
            "query": " ".join(query.split())[:240],
        }
        for query, calls, total, planning, rows_ in rows
    ]


def verify(dsn: str, requests: dict[str, str]) -> dict[str, Any]:
    """
    Every expected fact once, in its subject; nothing else in the round's
    subjects; the ledger's rows of the round's observations.
    """
    subjects = sorted(set(requests.values()))
    ids = list(requests)
    with psycopg.connect(dsn, autocommit=True) as connection:
        stored = collections.Counter(
            (subject, content)
            for subject, content, source in connection.execute(
                "SELECT subject, content, source FROM memories WHERE subject = ANY(%s)",
                (subjects,),
            ).fetchall()
            if source == "extracted"
        )
        others = connection.execute(
            "SELECT count(*) FROM memories WHERE source <> 'extracted' AND subject = ANY(%s)",
            (subjects,),
        ).fetchone()
        left = connection.execute(
            "SELECT state, count(*) FROM memory_observations WHERE request_id = ANY(%s)"
            " GROUP BY state",
            (ids,),
        ).fetchall()
        ledger: dict[str, int] = dict(
            connection.execute(
                "SELECT kind, count(*) FROM usage_ledger WHERE parent_request_id = ANY(%s)"
                " GROUP BY kind",
                (ids,),
            ).fetchall()
        )
    expected = collections.Counter(
        (subject, fact) for requestID, subject in requests.items() for fact in factsOf(requestID)
    )
    missing = expected - stored
    twice = {key: count for key, count in stored.items() if count > 1}
    extra = stored - expected
    return {
        "memories": sum(stored.values()),
        "expected": sum(expected.values()),
        "missing": sum(missing.values()),
        "stored_twice": len(twice),
        "unexpected": sum(extra.values()) + (others[0] if others else 0),
        "observations_left": {state: count for state, count in left},
        "ledger_rows": ledger,
    }


def metrics(daemon: Daemon, prefixes: tuple[str, ...]) -> dict[str, float]:
    text = daemon.get("/metrics")[1].decode()
    found = {}
    for line in text.splitlines():
        if line.startswith(prefixes):
            name, _, value = line.rpartition(" ")
            found[name] = float(value)
    return found


def cpuSeconds(root: int) -> float:
    """
    User and system CPU seconds of process C{root} and every live
    descendant (PostgreSQL's backends are the postmaster's children).
    """
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        times[pid] = (int(fields[11]) + int(fields[12])) / tick
    total = 0.0
    for pid, seconds in times.items():
        walker: int | None = pid
        while walker is not None and walker != root and walker in parents:
            walker = parents.get(walker) or None
        if walker == root:
            total += seconds
    return total


def summariseProfile(raw: Path, top: int = 20) -> dict[str, Any]:
    """
    From py-spy's raw (collapsed) output, which holds only samples of
    threads not idle: the share of samples per thread, the functions most
    often on the stack (inclusive; the project's own and grpcio's, not the
    reactor's and threads' plumbing) and most often on top (self).
    """
    threads: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    itself: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        samples = int(count)
        total += samples
        threads[frames[0].split(": ", 1)[-1] if frames else "?"] += samples
        for frame in set(frames[1:]):
            if "svcd/" in frame or "grpc/" in frame or "psycopg" in frame:
                inclusive[frame] += samples
        if len(frames) > 1:
            itself[frames[-1]] += samples

    def share(counter: collections.Counter[str], count: int) -> list[tuple[str, float]]:
        return [(name, round(100.0 * n / total, 1)) for name, n in counter.most_common(count)]

    return {
        "samples": total,
        "threads_percent": share(threads, 8),
        "inclusive_percent": share(inclusive, top),
        "self_percent": share(itself, top),
    }


@attrs.frozen
class Stack:
    """
    What every round drains against: one database, tenant and set of
    daemons.
    """

    dsn: str
    # Each organization's id and its agent's.
    tenants: list[tuple[uuid.UUID, uuid.UUID]]
    auth: Daemon
    memory: Daemon
    redis: RedisServer
    upstream: ScriptedUpstream
    server: PostgresServer
    providers: Path


def drain(
    stack: Stack, arguments: argparse.Namespace, number: int, tree: Path | None, scratch: Path
) -> dict[str, Any]:
    """
    One round: queue the observations (subjects of their own), start a
    worker (from C{tree} when given: PYTHONPATH first), measure its drain,
    stop it, verify.
    """
    results: dict[str, Any] = {}
    started = time.perf_counter()
    requests = queue(
        stack.memory.environment["SVC_GRPC_PORT"],
        stack.tenants,
        arguments.observations,
        arguments.subjects,
        f"r{number}-",
    )
    results["queue_seconds"] = round(time.perf_counter() - started, 2)
    assert waiting(stack.dsn) == arguments.observations
    environment = {
        "SVC_HOST": "127.0.0.1",
        "SVC_PORT": str(freePort()),
        "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{stack.auth.environment['SVC_GRPC_PORT']}",
        "SVC_MEMORY_GRPC_ADDR": f"127.0.0.1:{stack.memory.environment['SVC_GRPC_PORT']}",
        "REDIS_URL": stack.redis.url,
        "SVC_PROVIDERS_FILE": str(stack.providers),
        "SVC_WORKER_CONCURRENCY": str(arguments.concurrency),
        "SVC_MEMORY_MAX_IN_FLIGHT": str(arguments.memory_in_flight),
        "SVC_WORKER_POLL_INTERVAL": "100ms",
        "SVC_LOG_LEVEL": "WARN",
    }
    if tree is not None:
        environment["PYTHONPATH"] = str(tree)
    worker = Daemon("svc-worker", environment, scratch / f"worker-{number}.log").start()
    try:
        worker.waitForReady()
        postmaster, redisPid = stack.server.postmasterPid(), stack.redis.pid
        assert worker.process is not None and stack.memory.process is not None
        assert stack.auth.process is not None and stack.upstream._process is not None
        assert postmaster is not None and redisPid is not None
        processes = {
            "svc-worker": worker.process.pid,
            "svc-memory": stack.memory.process.pid,
            "svc-auth": stack.auth.process.pid,
            "scripted upstream": stack.upstream._process.pid,
            "postgres": postmaster,
            "redis": redisPid,
        }
        cpuBefore = {name: cpuSeconds(pid) for name, pid in processes.items()}
        spies = []
        if arguments.profile:
            profileDir = Path(arguments.profile)
            profileDir.mkdir(parents=True, exist_ok=True)
            for name, pid in (("worker", worker.process.pid), ("memory", processes["svc-memory"])):
                spies.append(
                    subprocess.Popen(
                        [
                            shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                            "record",
                            "--pid",
                            str(pid),
                            "--format",
                            "raw",
                            "--threads",
                            "--rate",
                            "100",
                            *(["--gil"] if arguments.profile_gil else []),
                            "--output",
                            str(profileDir / f"{name}-{number}.raw"),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        watching = psycopg.connect(stack.dsn, autocommit=True)
        if arguments.statements:
            watching.execute("SELECT pg_stat_statements_reset()")
        memoryBefore = metrics(stack.memory, MEMORY_COUNTERS)
        began = time.perf_counter()
        queued = waitingByOrganization(watching)
        # When the first of each organization's observations was done.
        firstDone: dict[uuid.UUID, float] = {}
        while True:
            byOrganization = waitingByOrganization(watching)
            now = time.perf_counter() - began
            for orgID, count in queued.items():
                if orgID not in firstDone and byOrganization.get(orgID, 0) < count:
                    firstDone[orgID] = now
            left = sum(byOrganization.values())
            if left == 0:
                break
            if time.perf_counter() - began > 900:
                raise SystemExit(f"not drained within 900 s: {left} left")
            # Each poll reads the whole queue (some milliseconds of
            # PostgreSQL's CPU): ten a second while an organization waits
            # for its first, four after (the drain's end a quarter of a
            # second late at most).
            time.sleep(0.1 if len(firstDone) < len(queued) else 0.25)
        seconds = time.perf_counter() - began
        results["cpu_seconds_during_drain"] = {
            name: round(cpuSeconds(pid) - cpuBefore[name], 2) for name, pid in processes.items()
        }
        results["load_average_1m_after"] = os.getloadavg()[0]
        results["memory_counted"] = counted(memoryBefore, metrics(stack.memory, MEMORY_COUNTERS))
        if arguments.statements:
            results["statements"] = topStatements(
                watching, arguments.statements, arguments.observations
            )
        watching.close()
        perObservation = {
            name: round(1000.0 * cpu / arguments.observations, 3)
            for name, cpu in results["cpu_seconds_during_drain"].items()
        }
        perObservation["all"] = round(sum(perObservation.values()), 3)
        results["cpu_ms_per_observation"] = perObservation
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(60)
        results["drain_seconds"] = round(seconds, 2)
        if len(queued) > 1:
            firsts = sorted(firstDone.values())
            results["organizations"] = len(queued)
            results["first_done_seconds"] = {
                "median": round(firsts[len(firsts) // 2], 2),
                "worst": round(firsts[-1], 2),
            }
        results["observations_per_second"] = round(arguments.observations / seconds, 1)
        results["worker_metrics"] = {
            name: value
            for name, value in metrics(
                worker,
                (
                    "svc_worker_observations_total",
                    "svc_worker_memories_total",
                    "svc_worker_lease_renewals_total",
                ),
            ).items()
            if value
        }
    finally:
        worker.terminate()
    # The ledger's rows reach svc-auth in batches: wait for the last.
    deadline = time.monotonic() + 30
    while True:
        checked = verify(stack.dsn, requests)
        rows = checked["ledger_rows"]
        if (
            rows.get("extraction") == arguments.observations
            and rows.get("embedding") == arguments.observations
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    results["verified"] = checked
    for name in ("worker", "memory"):
        raw = Path(arguments.profile or ".") / f"{name}-{number}.raw"
        if arguments.profile and raw.exists():
            results[f"profile_{name}_inclusive_percent"] = summariseProfile(raw)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--observations", type=int, default=10_000)
    parser.add_argument("--subjects", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--organizations",
        type=int,
        default=1,
        help="organizations the observations are spread over (the first has half)",
    )
    parser.add_argument(
        "--memory-in-flight", type=int, default=8, help="the worker's SVC_MEMORY_MAX_IN_FLIGHT"
    )
    parser.add_argument(
        "--before",
        help="a tree of an earlier commit (git archive COMMIT | tar -x -C DIR) whose worker"
        " drains a round of its own first, against the same daemons",
    )
    parser.add_argument("--profile", help="a directory for py-spy's profile of svc-worker")
    parser.add_argument(
        "--profile-gil",
        action="store_true",
        help="with --profile: only samples of threads holding the GIL (Python's own CPU)",
    )
    parser.add_argument(
        "--statements",
        type=int,
        default=0,
        help="list the N statements that took PostgreSQL the most time (pg_stat_statements)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    arguments = parser.parse_args()
    results: dict[str, Any] = {
        "observations": arguments.observations,
        "subjects": arguments.subjects,
        "concurrency": arguments.concurrency,
        "organizations": arguments.organizations,
        "memory_in_flight": arguments.memory_in_flight,
        "target_per_second": TARGET_PER_SECOND,
        "rounds": [],
    }

    scratch = Path(tempfile.mkdtemp(prefix="svc-bench-drain-"))
    stack = contextlib.ExitStack()
    try:
        server = PostgresServer.create(scratch / "postgres")
        if arguments.statements:
            loadStatements(server)
        server.start()
        stack.callback(server.destroy)
        dsn = server.createDatabase("bench")
        migrate(dsn)
        if arguments.statements:
            with psycopg.connect(dsn, autocommit=True) as connection:
                connection.execute("CREATE EXTENSION pg_stat_statements")
        with psycopg.connect(dsn, autocommit=True) as connection:
            store = Store(lambda: contextlib.nullcontext(connection))
            tenants = []
            for number in range(arguments.organizations):
                orgID = store.createOrganization(f"bench-{number}")
                tenants.append((orgID, store.createAgent(orgID, f"bench-{number}").agentID))
        redis = RedisServer.create(scratch / "redis")
        redis.start()
        stack.callback(redis.stop)
        upstream = ScriptedUpstream(
            scratch / "upstream", embeddingDimensions=MEMORY_EMBEDDING_DIMENSIONS
        ).start()
        stack.callback(upstream.stop)
        providers = scratch / "providers.toml"
        memoryProvidersFile(providers, upstream)
        auth = Daemon(
            "svc-auth", authEnvironment(dsn, SVC_LOG_LEVEL="WARN"), scratch / "auth.log"
        ).start()
        stack.callback(auth.terminate)
        memory = Daemon(
            "svc-memory", memoryEnvironment(dsn, SVC_LOG_LEVEL="WARN"), scratch / "memory.log"
        ).start()
        stack.callback(memory.terminate)
        auth.waitForReady()
        memory.waitForReady()
        context = Stack(dsn, tenants, auth, memory, redis, upstream, server, providers)
        rounds: list[tuple[str, Path | None]] = []
        if arguments.before:
            rounds.append(("before", Path(arguments.before).resolve()))
        rounds.append(("this tree", None))
        for number, (name, tree) in enumerate(rounds):
            results["rounds"].append(
                {"worker": name, **drain(context, arguments, number, tree, scratch)}
            )
    finally:
        stack.close()
        if not arguments.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"kept {scratch}")

    print(json.dumps(results, indent=2))
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(results, indent=2) + "\n")
    ok = True
    for each in results["rounds"]:
        checked = each["verified"]
        ok = ok and (
            checked["missing"] == 0
            and checked["stored_twice"] == 0
            and checked["unexpected"] == 0
            and not checked["observations_left"]
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
