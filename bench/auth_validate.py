"""
Benchmark of svc-auth's ValidateToken: calls per second for a cached valid
token, against a real `twistd -n svc-auth` process, and the cost of one
cold argon2id verification.

    python bench/auth_validate.py [--duration 10] [--concurrency 32]

Starts its own PostgreSQL (or uses --dsn), migrates a fresh database,
makes a tenant, starts svc-auth on free loopback ports, then keeps
--concurrency calls in flight on one channel (grpc's future API) for
--duration seconds. Client and server share this machine's cores, so the
figures are a floor for what svc-auth does on its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from svcd.auth.hashing import hashSecret, verifySecret  # noqa: E402
from svcd.common.migrations import migrate  # noqa: E402
from svcd.common.pat import newSecret  # noqa: E402
from svcd.devkit.daemons import Daemon, authEnvironment  # noqa: E402
from svcd.devkit.postgres import PostgresServer  # noqa: E402
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc  # noqa: E402


def argon2Cost(rounds: int = 200) -> float:
    """
    Milliseconds of one verifySecret with the production parameters.
    """
    secret = newSecret()
    stored = hashSecret(secret)
    started = time.perf_counter()
    for _ in range(rounds):
        assert verifySecret(stored, secret)
    return (time.perf_counter() - started) / rounds * 1000


def closedLoop(
    stub: auth_pb2_grpc.AuthServiceStub, token: str, concurrency: int, duration: float
) -> tuple[int, int, list[float]]:
    """
    Keep C{concurrency} ValidateToken calls in flight for C{duration}
    seconds; return (successes, errors, latencies in ms of a sample).
    """
    request = auth_pb2.ValidateTokenRequest(access_token=token)
    lock = threading.Lock()
    done = threading.Event()
    counts = {"ok": 0, "error": 0, "inflight": 0}
    latencies: list[float] = []
    deadline = time.monotonic() + duration

    def launch() -> None:
        started = time.perf_counter()
        future = stub.ValidateToken.future(request, timeout=5)

        def finished(call: grpc.Future) -> None:
            elapsed = (time.perf_counter() - started) * 1000
            with lock:
                if call.exception() is None:
                    counts["ok"] += 1
                else:
                    counts["error"] += 1
                if len(latencies) < 200_000:
                    latencies.append(elapsed)
                if time.monotonic() < deadline:
                    again = True
                else:
                    again = False
                    counts["inflight"] -= 1
                    if counts["inflight"] == 0:
                        done.set()
            if again:
                launch()

        future.add_done_callback(finished)

    with lock:
        counts["inflight"] = concurrency
    for _ in range(concurrency):
        launch()
    done.wait(duration + 30)
    return counts["ok"], counts["error"], latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--dsn", help="an empty database to use instead of a private server")
    arguments = parser.parse_args()

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
            import contextlib

            import psycopg

            from svcd.auth.authority import issueToken
            from svcd.auth.store import Store

            with psycopg.connect(dsn, autocommit=True) as connection:
                store = Store(lambda: contextlib.nullcontext(connection))
                orgID = store.createOrganization("bench")
                token, _ = issueToken(store, orgID=orgID, permissions=1)
                coldTokens = [issueToken(store, orgID=orgID, permissions=1)[0] for _ in range(50)]

            daemon = Daemon(
                "svc-auth",
                authEnvironment(dsn, SVC_LOG_LEVEL="WARN"),
                workdir / "auth.log",
            ).start()
            try:
                daemon.waitForHealth()
                port = daemon.environment["SVC_GRPC_PORT"]
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = auth_pb2_grpc.AuthServiceStub(channel)
                    stub.ValidateToken(auth_pb2.ValidateTokenRequest(access_token=token), timeout=5)

                    coldLatencies = []
                    for cold in coldTokens:
                        started = time.perf_counter()
                        stub.ValidateToken(
                            auth_pb2.ValidateTokenRequest(access_token=cold), timeout=5
                        )
                        coldLatencies.append((time.perf_counter() - started) * 1000)
                    warmLatencies = []
                    for _ in range(200):
                        started = time.perf_counter()
                        stub.ValidateToken(
                            auth_pb2.ValidateTokenRequest(access_token=token), timeout=5
                        )
                        warmLatencies.append((time.perf_counter() - started) * 1000)

                    ok, errors, latencies = closedLoop(
                        stub, token, arguments.concurrency, arguments.duration
                    )
            finally:
                daemon.terminate()
        finally:
            if server is not None:
                server.destroy()

    latencies.sort()
    result = {
        "cached_validate_token_calls_per_second": round(ok / arguments.duration),
        "errors": errors,
        "concurrency": arguments.concurrency,
        "cached_p50_ms_under_load": round(latencies[len(latencies) // 2], 3),
        "cached_p99_ms_under_load": round(latencies[int(len(latencies) * 0.99)], 3),
        "cached_single_call_median_ms": round(statistics.median(warmLatencies), 3),
        "cold_validate_token_median_ms": round(statistics.median(coldLatencies), 3),
        "argon2id_verify_ms": round(argon2Cost(), 3),
    }
    width = max(len(key) for key in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(result))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
