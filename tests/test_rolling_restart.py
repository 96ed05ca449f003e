"""
Rolling restarts lose no request (issue 25), tried as an operator would,
against real daemons, PostgreSQL and Redis (tests/rolling.py):

  - two svc-proxy workers on one port, each SIGTERMed, waited for and
    started again in turn, three times, while 12 clients make protected
    requests: no keep-alive client sees a failure, ever; with
    C{net.ipv4.tcp_migrate_req=1} no client at all does, and with it at 0
    (the kernel's default) the only failures are the new connections the
    kernel resets from a closing listener's accept queue, which are counted
    and reported;
  - two svc-auth replicas named in one proxy's C{SVC_AUTH_GRPC_ADDR}, each
    SIGTERMed and started again in turn under load: no failure, and each
    stop takes under 2 s.

The sysctl is per network namespace, so the proxies' run happens in a
namespace of its own (C{ip netns}), which needs root; PostgreSQL is reached
there through its Unix socket. Each run prints its figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import rolling

from svcd.devkit.postgres import PostgresServer

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

ROUNDS = 3


def _ip(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *arguments], capture_output=True, text=True, timeout=30, check=False
    )


@contextlib.contextmanager
def networkNamespace(migrateRequests: int) -> Iterator[str]:
    """
    A network namespace of this test's own, its loopback up and
    C{net.ipv4.tcp_migrate_req} set in it; deleted afterwards, with any
    process still in it (only this test's) killed first.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and ip(8) for a network namespace of its own")
    name = f"svc-rolling-{os.getpid()}-{secrets.token_hex(3)}"
    added = _ip("netns", "add", name)
    if added.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {added.stderr.strip()}")
    try:
        loopback = _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        assert loopback.returncode == 0, loopback.stderr
        setting = f"net.ipv4.tcp_migrate_req={migrateRequests}"
        sysctl = _ip("netns", "exec", name, "sysctl", "-q", "-w", setting)
        if sysctl.returncode != 0:
            pytest.skip(f"cannot set net.ipv4.tcp_migrate_req: {sysctl.stderr.strip()}")
        yield name
    finally:
        pids = _ip("netns", "pids", name).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", name)


def socketDSN(postgres: PostgresServer, dsn: str) -> str:
    """
    C{dsn}'s database, reached through the server's Unix socket.
    """
    database = urllib.parse.urlsplit(dsn).path.lstrip("/")
    query = urllib.parse.urlencode({"host": str(postgres.socketDirectory), "port": postgres.port})
    return f"postgresql://postgres@/{database}?{query}"


def summary(report: dict[str, Any]) -> str:
    lines = [
        f"{report['target']}: tcp_migrate_req={report['tcp_migrate_req']},"
        f" {report['seconds']} s, logs in {report['logs']}"
    ]
    for kind in ("keepAlive", "oneShot"):
        tally = report[kind]
        if tally["clients"]:
            lines.append(
                f"  {kind}: {tally['clients']} clients, {tally['requests']} requests,"
                f" {tally['failed']} failed ({tally['resets']} reset by the kernel;"
                f" statuses {tally['statuses']}; errors {tally['errors']})"
            )
    for each in report["restarts"]:
        lines.append(
            f"  {each['daemon']} round {each['round']}: stopped in {each['stopSeconds']} s"
            f" (status {each['exitStatus']}), serving again {each['startSeconds']} s later"
        )
    return "\n".join(lines)


@pytest.mark.parametrize("migrateRequests", [1, 0])
def test_rollingRestartOfTheProxies(
    postgresServer: PostgresServer, migratedDSN: str, tmp_path: Path, migrateRequests: int
) -> None:
    """
    Two workers on one port, each restarted in turn three times under
    load: no keep-alive client ever fails; with tcp_migrate_req=1 no
    client does; with it at 0 the only failures are resets of new
    connections, counted and reported.
    """
    workdir = tmp_path / "run"
    with networkNamespace(migrateRequests) as name:
        run = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                name,
                sys.executable,
                rolling.__file__,
                "--dsn",
                socketDSN(postgresServer, migratedDSN),
                "--workdir",
                str(workdir),
                "--restart",
                "proxies",
                "--rounds",
                str(ROUNDS),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=2))
    print(summary(report))
    assert report["tcp_migrate_req"] == migrateRequests
    assert [each["exitStatus"] for each in report["restarts"]] == [0] * (2 * ROUNDS)
    keepAlive, oneShot = report["keepAlive"], report["oneShot"]
    assert keepAlive["requests"] > 200 and oneShot["requests"] > 200, summary(report)
    assert keepAlive["failed"] == 0, summary(report) + f"\n{keepAlive['samples']}"
    if migrateRequests:
        assert oneShot["failed"] == 0, summary(report) + f"\n{oneShot['samples']}"
    else:
        # No userland drain can save these: reported, not refused.
        assert oneShot["failed"] == oneShot["resets"], summary(report) + f"\n{oneShot['samples']}"


def test_rollingRestartOfSvcAuthReplicas(migratedDSN: str, tmp_path: Path) -> None:
    """
    Two svc-auth replicas in one proxy's SVC_AUTH_GRPC_ADDR, each SIGTERMed
    and started again in turn under load: no failed request, and each stop
    (SVC_SHUTDOWN_TIMEOUT 10 s, proxies attached) under 2 s.
    """
    report = rolling.run(migratedDSN, tmp_path / "run", "auth", rounds=2)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=2))
    print(summary(report))
    restarts = report["restarts"]
    assert [each["exitStatus"] for each in restarts] == [0] * 4
    assert max(each["stopSeconds"] for each in restarts) < 2.0, summary(report)
    keepAlive = report["keepAlive"]
    assert keepAlive["requests"] > 200, summary(report)
    assert keepAlive["failed"] == 0, summary(report) + f"\n{keepAlive['samples']}"
