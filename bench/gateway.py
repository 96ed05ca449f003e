"""
Benchmark of the whole gateway over loopback with wrk.

    python bench/gateway.py [--duration 10] [--connections 32,256]

Starts, on this machine, its own PostgreSQL and Redis, `twistd -n
svc-auth`, `twistd -n svc-proxy` and a bare Klein handler (bench/floor.py)
that answers the same 501 JSON with nothing in front of it, creates a
tenant, then drives each row with wrk (Debian package wrk; bench/load.lua)
and prints requests/s, p50, p99, p99.9, unexpected statuses and the ratio
to the floor measured in the same run:

    floor     bare Klein handler, POST -> 501
    chat      full pipeline: valid token, active agent, rate limit on -> 501
    probe     GET /v1/internal/auth-probe -> 200
    rejected  a well-formed token with a wrong secret -> 401

The tenant's rate limit is raised far above the load, so the limiter runs
(one Redis round trip per request) without refusing anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from svcd.auth.authority import issueToken  # noqa: E402
from svcd.auth.migrations import migrate  # noqa: E402
from svcd.auth.store import Store  # noqa: E402
from svcd.common.pat import formatToken, newSecret, parseToken  # noqa: E402
from svcd.testing.daemons import Daemon, authEnvironment  # noqa: E402
from svcd.testing.servers import PostgresServer, RedisServer, freePort  # noqa: E402

LOAD_SCRIPT = Path(__file__).with_name("load.lua")


def runWrk(
    url: str, connections: int, duration: float, environment: dict[str, str]
) -> dict[str, Any]:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk is missing: apt-get install wrk")
    threads = min(2, connections)
    command = [
        wrk,
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "5s",
        "-s",
        str(LOAD_SCRIPT),
        url,
    ]
    result = subprocess.run(
        command,
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=duration + 60,
        check=True,
    )
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            parsed: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return parsed
    raise RuntimeError(f"no RESULT line from wrk:\n{result.stdout}\n{result.stderr}")


def summarize(name: str, connections: int, expected: int, raw: dict[str, Any]) -> dict[str, Any]:
    seconds = raw["duration_us"] / 1e6
    statuses = {int(status): count for status, count in raw["statuses"].items()}
    unexpected = sum(count for status, count in statuses.items() if status != expected)
    return {
        "row": name,
        "connections": connections,
        "rps": raw["requests"] / seconds,
        "p50_ms": raw["p50_us"] / 1000,
        "p99_ms": raw["p99_us"] / 1000,
        "p999_ms": raw["p999_us"] / 1000,
        "errors": unexpected + raw["socket_errors"],
        "statuses": statuses,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per row")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each row")
    parser.add_argument("--connections", default="32", help="comma-separated, e.g. 32,256")
    parser.add_argument("--rows", default="floor,chat,probe,rejected")
    parser.add_argument("--log-level", default="INFO", help="SVC_LOG_LEVEL of the daemons")
    parser.add_argument("--json", type=Path, help="also write the results here")
    arguments = parser.parse_args()
    connectionCounts = [int(each) for each in arguments.connections.split(",")]
    rows = arguments.rows.split(",")

    with (
        tempfile.TemporaryDirectory(prefix="svc-bench-") as scratch,
        contextlib.ExitStack() as stack,
    ):
        workdir = Path(scratch)
        postgres = PostgresServer.create(workdir / "postgres")
        postgres.start()
        stack.callback(postgres.destroy)
        dsn = postgres.createDatabase("bench")
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as connection:
            store = Store(lambda: contextlib.nullcontext(connection))
            orgID = store.createOrganization("bench")
            agent = store.createAgent(orgID, "bench-agent")
            token, _ = issueToken(store, orgID=orgID, permissions=1)
        parsed = parseToken(token)
        assert parsed is not None
        wrongSecret = formatToken(parsed.tokenID, newSecret())

        redis = RedisServer.create(workdir / "redis")
        redis.start()
        stack.callback(redis.destroy)

        auth = Daemon(
            "svc-auth",
            authEnvironment(dsn, SVC_LOG_LEVEL=arguments.log_level),
            workdir / "auth.log",
        ).start()
        stack.callback(auth.terminate)
        auth.waitForReady()
        proxy = Daemon(
            "svc-proxy",
            {
                "SVC_HOST": "127.0.0.1",
                "SVC_PORT": str(freePort()),
                "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}",
                "REDIS_URL": redis.url,
                "SVC_RATE_LIMIT_ORG_OVERRIDES": f"{orgID}=1000000000",
                "SVC_LOG_LEVEL": arguments.log_level,
            },
            workdir / "proxy.log",
        ).start()
        stack.callback(proxy.terminate)
        proxy.waitForReady()

        floorPort = freePort()
        floor = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("floor.py")), str(floorPort)]
        )
        stack.callback(floor.terminate)
        deadline = time.monotonic() + 10
        while True:
            try:
                with contextlib.closing(
                    __import__("socket").create_connection(("127.0.0.1", floorPort), 1)
                ):
                    break
            except OSError:
                assert time.monotonic() < deadline, "floor server did not start"
                time.sleep(0.05)

        proxyURL = f"http://127.0.0.1:{proxy.httpPort}"
        shapes = {
            "floor": (f"http://127.0.0.1:{floorPort}/v1/chat/completions", "POST", "", "", 501),
            "chat": (f"{proxyURL}/v1/chat/completions", "POST", token, str(agent.agentID), 501),
            "probe": (f"{proxyURL}/v1/internal/auth-probe", "GET", token, str(agent.agentID), 200),
            "rejected": (
                f"{proxyURL}/v1/chat/completions",
                "POST",
                wrongSecret,
                str(agent.agentID),
                401,
            ),
        }
        results = []
        for connections in connectionCounts:
            for row in rows:
                url, method, bearer, agentID, expected = shapes[row]
                environment = {
                    "SVC_BENCH_METHOD": method,
                    "SVC_BENCH_TOKEN": bearer,
                    "SVC_BENCH_AGENT": agentID,
                }
                if arguments.warmup:
                    runWrk(url, connections, arguments.warmup, environment)
                raw = runWrk(url, connections, arguments.duration, environment)
                results.append(summarize(row, connections, expected, raw))

    floors = {each["connections"]: each["rps"] for each in results if each["row"] == "floor"}
    header = (
        f"{'row':<9} {'conns':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}"
        f" {'p99.9 ms':>9} {'errors':>7} {'vs floor':>9}"
    )
    print(header)
    print("-" * len(header))
    for each in results:
        floorRPS = floors.get(each["connections"])
        ratio = f"{each['rps'] / floorRPS:8.1%}" if floorRPS else "      n/a"
        each["ratio_to_floor"] = None if not floorRPS else each["rps"] / floorRPS
        print(
            f"{each['row']:<9} {each['connections']:>5} {each['rps']:>9.0f} {each['p50_ms']:>8.2f}"
            f" {each['p99_ms']:>8.2f} {each['p999_ms']:>9.2f} {each['errors']:>7} {ratio:>9}"
        )
    if arguments.json:
        arguments.json.write_text(json.dumps(results, indent=2))
    return 1 if any(each["errors"] for each in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
