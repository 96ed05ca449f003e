"""
A million made-up token ids against one svc-proxy: memory stays flat.

    python bench/madeup.py [--count 1000000] [--warmup 50000] [--connections 200]

Starts, on this machine, its own PostgreSQL and Redis, `twistd -n
svc-auth` and `twistd -n svc-proxy` (with its validation cache and the
change feed, as deployed), makes a tenant, and sends chat requests whose
bearers are well-formed tokens with made-up ids, each id a new one, over
keep-alive connections driven by one selector (svcd.devkit.flood). The
proxy refuses them itself (401, no call to svc-auth: its Bloom filter of
known ids says no) and must keep nothing per made-up id.

After a warm-up of --warmup requests (the allocator and every code path
at the same concurrency), it prints the proxy's resident memory and open
file descriptors every --every requests, then checks what
tests/test_gateway_cache.py checked when it sent the million itself:
every request answered, only 401 (or 503, when an overloaded machine
delays the feed's heartbeats and a request goes to svc-auth as without the
cache), at least 95% refused by the proxy without a call, and the RSS grown
by less than --max-growth MiB (16: 16 bytes per made-up id at a million).
Exit status 1 when a check fails.

The test suite keeps the promise's proof in seconds
(test_madeUpTokensLeaveMemoryFlat: tens of thousands of ids, growth
bounded below what keeping anything per id would cost); this is the soak.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from svcd.auth.store import Store  # noqa: E402
from svcd.common.migrations import migrate  # noqa: E402
from svcd.devkit.daemons import Daemon, authEnvironment  # noqa: E402
from svcd.devkit.flood import floodMadeUp, rssKiB  # noqa: E402
from svcd.devkit.postgres import PostgresServer  # noqa: E402
from svcd.devkit.redis import RedisServer  # noqa: E402
from svcd.devkit.servers import freePort  # noqa: E402


def metricValue(daemon: Daemon, name: str) -> float:
    """
    A sample of the daemon's /metrics (C{name} with its labels), 0 when
    absent.
    """
    for line in daemon.get("/metrics")[1].decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


REFUSED = 'svc_proxy_auth_local_refusals_total{reason="unknown_token"}'


@contextlib.contextmanager
def runningProxy(workdir: Path) -> Iterator[tuple[Daemon, str]]:
    """
    PostgreSQL, Redis, svc-auth and svc-proxy with its change feed up;
    yields the proxy and an agent id of a real tenant.
    """
    with contextlib.ExitStack() as stack:
        postgres = PostgresServer.create(workdir / "postgres")
        postgres.start()
        stack.callback(postgres.destroy)
        dsn = postgres.createDatabase("madeup")
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as connection:
            store = Store(lambda: contextlib.nullcontext(connection))
            orgID = store.createOrganization("madeup")
            agent = store.createAgent(orgID, "madeup-agent")
        redis = RedisServer.create(workdir / "redis")
        redis.start()
        stack.callback(redis.destroy)
        auth = Daemon("svc-auth", authEnvironment(dsn), workdir / "auth.log").start()
        stack.callback(auth.terminate)
        auth.waitForReady()
        proxy = Daemon(
            "svc-proxy",
            {
                "SVC_HOST": "127.0.0.1",
                "SVC_PORT": str(freePort()),
                "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}",
                "REDIS_URL": redis.url,
                # The flood saturates both cores of a small machine; a
                # request that does go to svc-auth should not miss a 50 ms
                # deadline by scheduling alone.
                "SVC_AUTH_VALIDATE_TIMEOUT": "500ms",
                "SVC_SHUTDOWN_TIMEOUT": "5s",
            },
            workdir / "proxy.log",
        ).start()
        stack.callback(proxy.terminate)
        proxy.waitForReady()
        deadline = time.monotonic() + 30
        while metricValue(proxy, "svc_proxy_auth_feed_up") != 1.0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the change feed did not come up:\n{proxy.output()[-2000:]}")
            time.sleep(0.05)
        yield proxy, str(agent.agentID)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1_000_000, help="made-up ids to send")
    parser.add_argument("--warmup", type=int, default=50_000, help="made-up ids sent first")
    parser.add_argument("--connections", type=int, default=200, help="keep-alive connections")
    parser.add_argument("--every", type=int, default=100_000, help="report every N requests")
    parser.add_argument(
        "--max-growth", type=float, default=16.0, metavar="MIB", help="RSS growth allowed"
    )
    arguments = parser.parse_args()

    with (
        tempfile.TemporaryDirectory(prefix="svc-madeup-") as scratch,
        runningProxy(Path(scratch)) as (proxy, agentID),
    ):
        assert proxy.process is not None
        pid = proxy.process.pid
        floodMadeUp(proxy.httpPort, agentID, arguments.warmup, arguments.connections)
        refusedBefore = metricValue(proxy, REFUSED)
        before = rssKiB(pid)
        fdsBefore = len(os.listdir(f"/proc/{pid}/fd"))
        print(f"{'requests':>10} {'req/s':>7} {'RSS MiB':>8} {'fds':>4}")
        print(f"{0:>10,} {'':>7} {before / 1024:>8.1f} {fdsBefore:>4}", flush=True)
        statuses: collections.Counter[int] = collections.Counter()
        sent = 0
        started = time.monotonic()
        while sent < arguments.count:
            chunk = min(arguments.every, arguments.count - sent)
            chunkStarted = time.monotonic()
            statuses += floodMadeUp(proxy.httpPort, agentID, chunk, arguments.connections)
            sent += chunk
            rate = chunk / (time.monotonic() - chunkStarted)
            fds = len(os.listdir(f"/proc/{pid}/fd"))
            print(f"{sent:>10,} {rate:>7.0f} {rssKiB(pid) / 1024:>8.1f} {fds:>4}", flush=True)
        took = time.monotonic() - started
        after = rssKiB(pid)
        refused = metricValue(proxy, REFUSED) - refusedBefore

    growth = (after - before) / 1024
    checks = {
        f"every request answered ({sum(statuses.values()):,} of {arguments.count:,})": sum(
            statuses.values()
        )
        == arguments.count,
        f"only 401 or 503 ({dict(statuses)})": set(statuses) <= {401, 503},
        f"refused without a call: {refused:,.0f} (at least 95%)": (
            refused >= 0.95 * arguments.count
        ),
        f"RSS grew {growth:+.1f} MiB (less than {arguments.max_growth:g})": (
            growth < arguments.max_growth
        ),
    }
    print(f"{arguments.count:,} made-up ids in {took:.0f} s ({arguments.count / took:.0f} req/s)")
    for check, passed in checks.items():
        print(f"{'ok' if passed else 'FAILED'}: {check}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
