"""
The same fact told in many chats at once is one memory (decisions D13,
step 3, under concurrency): real svc-auth, two svc-memory replicas (two
caches, each following the other's writes within a second) and two
svc-worker daemons, one on each replica, draining observations that all
tell the same fact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from workerfixtures import newRequestIDs, runningWorkerRig

from svcd.devkit.daemons import Daemon, memoryEnvironment
from svcd.devkit.postgres import PostgresServer

# Starts real daemons (conftest.py, pytest.ini): left out of a quick run.
pytestmark = pytest.mark.e2e

FACT = "My favourite colour is green."


def test_theSameFactInManyChatsAtOnceIsOneMemory(
    postgresServer: PostgresServer, tmp_path: Path
) -> None:
    """
    Forty observations of one subject, each telling the same fact (no
    extraction model: the user's text is the memory), drained at once by
    two workers (eight at a time each) through two svc-memory replicas:
    exactly one memory, extracted, and no observation left.
    """
    with runningWorkerRig(postgresServer, tmp_path, extraction=False) as rig:
        replica = Daemon(
            "svc-memory", memoryEnvironment(rig.dsn), tmp_path / "memory-2.log"
        ).start()
        try:
            replica.waitForReady()
            addresses = [
                f"127.0.0.1:{each.environment['SVC_GRPC_PORT']}" for each in (rig.memory, replica)
            ]
            rig.queue(dict.fromkeys(newRequestIDs(40), FACT), subject="erin")
            for name, address in zip(("first", "second"), addresses, strict=True):
                rig.startWorker(name, SVC_MEMORY_GRPC_ADDR=address, SVC_WORKER_CONCURRENCY="8")
            rig.waitForDrained(seconds=120)
            memories = rig.memories(subject="erin")
            assert [(each["content"], each["source"]) for each in memories] == [(FACT, "extracted")]
        finally:
            replica.terminate()
