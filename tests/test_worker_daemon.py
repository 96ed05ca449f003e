"""
svc-worker as operators run it (decisions D13, issue 33): C{twistd -n
svc-worker} beside real svc-auth and svc-memory daemons, Redis and the
scripted model server. Here, twistd's part: the plugin started and ready,
observations queued as the proxy queues them becoming memories, every
provider call a ledger row of the organization, content never in a log;
SIGTERM with work in hand; a configuration refused at start; daemonised.

The worker's behaviour driven from outside (each fact once however the
worker is killed or doubled, leases, budgets' refusals, failures backing
off) is in tests/test_worker_e2e.py, which dev/floor leaves out: what it
runs of Twisted is the worker's code, which test_worker_lease and
test_worker_units run in-process on the floor, and twistd's, run here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from workerfixtures import (
    WorkerStack,
    expectedFacts,
    factsOf,
    newRequestIDs,
    runningWorkerStack,
    waitForMetric,
    waitUntil,
)

from svcd.devkit.daemons import Daemon, twistdCommand
from svcd.devkit.postgres import PostgresServer

# Starts real daemons (conftest.py, pytest.ini): left out of a quick run.
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerStack]:
    """
    One svc-auth, svc-memory, Redis and scripted upstream for the module's
    tests: each test's rig has its own organization, models and workers,
    and leaves no observation behind (L{WorkerStack.rig}). Started per
    test, the stack took most of the module's time.
    """
    with runningWorkerStack(postgresServer, tmp_path_factory.mktemp("workerstack")) as running:
        yield running


def test_observationsBecomeMemoriesPaidByTheOrganization(
    stack: WorkerStack, tmp_path: Path
) -> None:
    """
    Observations queued become the memories the extraction model found in
    the user's turns (the question left out), source C{extracted} with the
    observation's request id; the observations are gone; each observation
    made one ledger row of kind C{extraction} and one of kind
    C{embedding}, both with the observation's request id as parent; the
    metrics count them done; /ready reports the feed, svc-memory and Redis;
    no memory's content is in any log.
    """
    with stack.rig(tmp_path) as rig:
        worker = rig.startWorker()
        status, body = worker.get("/ready")
        assert status == 200, body
        assert set(json.loads(body)["checks"]) == {"auth_feed", "memory", "redis"}
        requestIDs = newRequestIDs(3)
        rig.queue({each: factsOf(each) for each in requestIDs})
        rig.waitForDrained()
        memories = rig.memories()
        assert sorted(each["content"] for each in memories) == expectedFacts(requestIDs)
        assert {each["source"] for each in memories} == {"extracted"}
        assert {each["source_request_id"] for each in memories} == set(requestIDs)
        waitUntil(lambda: len(rig.ledger()) == 6, "six ledger rows")
        rows = rig.ledger()
        assert sorted((row["kind"], row["parent_request_id"]) for row in rows) == sorted(
            (kind, each) for each in requestIDs for kind in ("extraction", "embedding")
        )
        assert {row["outcome"] for row in rows} == {"ok"}
        assert all(row["cost_nano_usd"] > 0 for row in rows)
        assert {row["model"] for row in rows} == {"extractor", "embedder"}
        waitForMetric(rig, worker, 'svc_worker_observations_total{outcome="done"}', 3)
        waitForMetric(rig, worker, "svc_worker_observation_seconds_count", 3)
        waitForMetric(rig, worker, 'svc_worker_memories_total{action="added"}', 6)
        status, _ = rig.memory.get("/metrics")
        assert "svc_memory_observations_waiting" in rig.memory.get("/metrics")[1].decode()
        logs = rig.logs()
        for memory in memories:
            assert memory["content"] not in logs
        assert "My fact number" not in logs


def test_sigtermFinishesWhatItHolds(stack: WorkerStack, tmp_path: Path) -> None:
    """
    SIGTERM while observations are in hand: the worker finishes them (or
    hands them back, due at once and with no attempt counted) within its
    stop timeout and exits 0; nothing stays leased to it, and a worker
    started after it stores every fact once.
    """
    with stack.rig(tmp_path, extractor="slow:400") as rig:
        worker = rig.startWorker(SVC_WORKER_CONCURRENCY="4", SVC_SHUTDOWN_TIMEOUT="4s")
        requestIDs = newRequestIDs(8)
        rig.queue({each: factsOf(each) for each in requestIDs})
        waitUntil(
            lambda: rig.metric(worker, "svc_worker_observations_in_flight") > 0,
            "observations in hand",
        )
        worker.signal(signal.SIGTERM)
        assert worker.process is not None and worker.process.wait(20) == 0
        waiting = rig.observations()
        assert all(row["lease_owner"] is None for row in waiting), waiting
        assert all(row["attempts"] == 0 for row in waiting), waiting
        rig.startWorker("after")
        rig.waitForDrained()
        assert sorted(each["content"] for each in rig.memories()) == expectedFacts(requestIDs)


def test_refusesToStartWithoutMemory(tmp_path: Path) -> None:
    """
    A providers file without a [memory] table: C{twistd -n svc-worker}
    exits 1 at once with one line naming the variable and the file.
    """
    providers = tmp_path / "providers.toml"
    providers.write_text(
        '[[providers]]\nname = "p"\nbase_url = "http://127.0.0.1:9/v1"\n\n'
        '[[models]]\nname = "m"\nprovider = "p"\n'
    )
    environment = {
        **{key: value for key, value in os.environ.items() if not key.startswith("SVC_")},
        "SVC_MEMORY_GRPC_ADDR": "127.0.0.1:9092",
        "SVC_AUTH_GRPC_ADDR": "127.0.0.1:9091",
        "SVC_PROVIDERS_FILE": str(providers),
    }
    result = subprocess.run(
        twistdCommand("svc-worker"),
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 1
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("svc-worker: configuration error: SVC_PROVIDERS_FILE: ")
    assert "has no [memory] table" in lines[0]


def test_daemonised(stack: WorkerStack, tmp_path: Path) -> None:
    """
    Daemonised (no -n, with --pidfile and --logfile), svc-worker makes its
    channels and its feed's thread after the fork: it becomes ready,
    processes an observation, logs JSON lines to its log file, and stops on
    SIGTERM, removing its pidfile.
    """
    with stack.rig(tmp_path / "rig") as rig:
        pidFile, logFile = tmp_path / "worker.pid", tmp_path / "worker.log"
        environment = rig.workerEnvironment(SVC_LOG_LEVEL="INFO")
        command = [
            *twistdCommand("svc-worker")[:3],
            "--pidfile",
            str(pidFile),
            "--logfile",
            str(logFile),
            "svc-worker",
        ]
        variables = {k: v for k, v in os.environ.items() if not k.startswith("SVC_")}
        launched = subprocess.run(
            command, env={**variables, **environment}, cwd=tmp_path, timeout=60, check=False
        )
        assert launched.returncode == 0
        daemon = Daemon("svc-worker", environment, tmp_path / "unused.log")
        try:
            waitUntil(lambda: _ready(daemon), "the daemonised worker ready", 60)
            [requestID] = newRequestIDs(1)
            rig.queue({requestID: factsOf(requestID)})
            rig.waitForDrained()
            assert rig.contents() == expectedFacts([requestID])
            os.kill(int(pidFile.read_text()), signal.SIGTERM)
            waitUntil(lambda: not pidFile.exists(), "the pidfile removed", 20)
            messages = [json.loads(line)["message"] for line in logFile.read_text().splitlines()]
            assert "svc-worker stopped" in messages
        finally:
            if pidFile.exists():
                os.kill(int(pidFile.read_text()), signal.SIGKILL)


def _ready(daemon: Daemon) -> bool:
    try:
        return daemon.get("/ready", timeout=2)[0] == 200
    except OSError:
        return False
