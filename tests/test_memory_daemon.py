"""
svc-memory as operators run it (decisions D13): C{twistd -n svc-memory} in
its own process, and daemonised.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from authfixtures import Tenant
from memoryfixtures import vectorBytes

from svcd.devkit.daemons import Daemon, memoryEnvironment, twistdCommand
from svcd.pb.memory.v1 import memory_pb2, memory_pb2_grpc

# Starts real daemons (conftest.py, pytest.ini): left out of a quick run.
# About twistd's own start: its daemons are new interpreters (forkedtwistd.py).
pytestmark = [pytest.mark.e2e, pytest.mark.freshinterpreter]


@pytest.fixture
def memoryDaemon(migratedDSN: str, tmp_path: Path) -> Iterator[Daemon]:
    daemon = Daemon("svc-memory", memoryEnvironment(migratedDSN), tmp_path / "memory.log")
    daemon.start().waitForHealth()
    yield daemon
    daemon.terminate()


def waitForListener(daemon: Daemon) -> None:
    """
    Wait (bounded) until /ready reports every check ok, the change
    listener's included (critical since D13 amended).
    """
    deadline = time.monotonic() + Daemon.START_TIMEOUT
    while True:
        status, body = daemon.get("/ready")
        if status == 200 and all(
            check["status"] == "ok" for check in json.loads(body)["checks"].values()
        ):
            return
        assert time.monotonic() < deadline, daemon.describe()
        time.sleep(0.05)


def stubOf(daemon: Daemon) -> tuple[grpc.Channel, memory_pb2_grpc.MemoryServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{daemon.environment['SVC_GRPC_PORT']}")
    return channel, memory_pb2_grpc.MemoryServiceStub(channel)


def addRequest(tenant: Tenant, content: str) -> memory_pb2.AddMemoryRequest:
    return memory_pb2.AddMemoryRequest(
        scope=memory_pb2.Scope(org_id=str(tenant.orgID), agent_id=str(tenant.agentID)),
        content=content,
        embedding=memory_pb2.Embedding(model="m", vector=vectorBytes([1.0, 0.0])),
    )


def test_servesOperationsRoutesAndMemoryService(memoryDaemon: Daemon, acme: Tenant) -> None:
    """
    The daemon answers /health, a ready /ready (postgres, grpc and the
    change listener), /metrics with svc_memory_* series, and MemoryService
    on its gRPC port: a memory added is found by a search.
    """
    assert memoryDaemon.get("/health")[0] == 200
    waitForListener(memoryDaemon)
    status, body = memoryDaemon.get("/ready")
    report = json.loads(body)
    assert status == 200 and set(report["checks"]) == {"postgres", "grpc", "listener"}
    assert all(check["status"] == "ok" for check in report["checks"].values())
    channel, stub = stubOf(memoryDaemon)
    with channel:
        added = stub.AddMemory(addRequest(acme, "remember the milk"), timeout=10)
        found = stub.Search(
            memory_pb2.SearchRequest(
                scope=added_scope(added), query=addRequest(acme, "q").embedding, k=3
            ),
            timeout=10,
        )
    assert [each.memory.content for each in found.results] == ["remember the milk"]
    status, metrics = memoryDaemon.get("/metrics")
    text = metrics.decode()
    for series in (
        'svc_memory_grpc_requests_total{code="OK",method="Search"} 1.0',
        'svc_memory_search_duration_seconds_count{cache="miss",mode="vector"} 1.0',
        "svc_memory_cache_bytes ",
        # A vector search builds no text index.
        "svc_memory_cache_text_bytes 0.0",
        "svc_memory_cache_scopes 1.0",
        "svc_memory_cache_misses_total 1.0",
        "svc_memory_observations_waiting 0.0",
        "svc_process_up 1.0",
    ):
        assert series in text, series
    # Content never reaches the log.
    assert "remember the milk" not in memoryDaemon.output()


def added_scope(memory: memory_pb2.Memory) -> memory_pb2.Scope:
    return memory_pb2.Scope(org_id=memory.org_id, agent_id=memory.agent_id, subject=memory.subject)


def test_sigtermDrainsACallInFlight(memoryDaemon: Daemon, migratedDSN: str, acme: Tenant) -> None:
    """
    SIGTERM while a call waits on the database: the call still completes
    (committed and answered), then the daemon exits 0.
    """
    waitForListener(memoryDaemon)
    channel, stub = stubOf(memoryDaemon)
    answers: list[object] = []
    with psycopg.connect(migratedDSN, autocommit=True) as blocker, channel:
        with blocker.transaction():
            # The add's count waits behind this lock.
            blocker.execute("LOCK TABLE memories IN ACCESS EXCLUSIVE MODE")

            def call() -> None:
                try:
                    answers.append(stub.AddMemory(addRequest(acme, "in flight"), timeout=20))
                except grpc.RpcError as error:
                    answers.append(error)

            caller = threading.Thread(target=call)
            caller.start()
            deadline = time.monotonic() + 10
            while not _waitingOnLock(blocker):
                assert time.monotonic() < deadline, "the add never reached the database"
                time.sleep(0.02)
            memoryDaemon.signal(signal.SIGTERM)
            time.sleep(0.3)  # the stop has begun; then the lock goes
        caller.join(20)
    assert len(answers) == 1 and isinstance(answers[0], memory_pb2.Memory), answers
    assert memoryDaemon.process is not None
    assert memoryDaemon.process.wait(20) == 0
    assert "gRPC server stopped" in memoryDaemon.output()


def _waitingOnLock(connection: psycopg.Connection[Any]) -> bool:
    row = connection.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND application_name = 'svc-memory'"
    ).fetchone()
    return row is not None and int(row[0]) == 1


def test_badConfigurationIsOneLine() -> None:
    """
    A bad variable stops svc-memory with one stderr line naming it.
    """
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SVC_", "POSTGRES_"))}
    result = subprocess.run(
        twistdCommand("svc-memory"),
        env={**clean, "POSTGRES_DSN": "host=127.0.0.1", "SVC_MEMORY_CACHE_MB": "lots"},
        capture_output=True,
        text=True,
        timeout=Daemon.START_TIMEOUT,
        check=False,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "SVC_MEMORY_CACHE_MB" in lines[0], result.stderr


def test_daemonised(migratedDSN: str, tmp_path: Path) -> None:
    """
    Daemonised (no -n, with --pidfile and --logfile), svc-memory serves
    after the fork (/ready 200, its listener up), logs JSON lines to its
    log file, and stops on SIGTERM, removing its pidfile.
    """
    pidFile, logFile = tmp_path / "memory.pid", tmp_path / "memory.log"
    environment = memoryEnvironment(migratedDSN)
    command = [
        sys.executable,
        "-c",
        "from twisted.scripts.twistd import run; run()",
        "--pidfile",
        str(pidFile),
        "--logfile",
        str(logFile),
        "svc-memory",
    ]
    daemon = Daemon("svc-memory", environment, tmp_path / "unused.log")
    variables = {k: v for k, v in os.environ.items() if not k.startswith(("SVC_", "POSTGRES_"))}
    launched = subprocess.run(
        command, env={**variables, **environment}, cwd=tmp_path, timeout=60, check=False
    )
    try:
        assert launched.returncode == 0
        deadline = time.monotonic() + Daemon.START_TIMEOUT
        while True:
            try:
                status, body = daemon.get("/ready", timeout=2)
                if status == 200 and json.loads(body)["checks"]["listener"]["status"] == "ok":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, logFile.read_text()
            time.sleep(0.1)
        os.kill(int(pidFile.read_text()), signal.SIGTERM)
        deadline = time.monotonic() + 20
        while pidFile.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        messages = [json.loads(line)["message"] for line in logFile.read_text().splitlines()]
        assert {"gRPC server stopped", "Database pool closed", "Server Shut Down."} <= set(messages)
    finally:
        if pidFile.exists():
            os.kill(int(pidFile.read_text()), signal.SIGKILL)
