"""
The harness of svc-worker's end-to-end tests (decisions D13): real svc-auth,
svc-memory and svc-worker daemons (twistd processes) on a private
PostgreSQL and Redis, the scripted model server answering extraction and
embeddings, observations queued through svc-memory's QueueObservations as
the proxy queues them, and what the tests read back (memories, waiting
observations, ledger rows) read as the schema owner.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import psycopg
from authfixtures import Tenant, makeTenant
from ledgerfixtures import ledgerRows

from svcd.auth.store import Store
from svcd.devkit.daemons import Daemon, authEnvironment, memoryEnvironment
from svcd.devkit.pgtemplate import migratedDatabase
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import (
    MEMORY_EMBEDDING_DIMENSIONS,
    ScriptedUpstream,
    memoryProvidersFile,
)
from svcd.pb.memory.v1 import memory_pb2, memory_pb2_grpc


def waitUntil(condition: Callable[[], bool], what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.05)


@attrs.define
class WorkerRig:
    """
    A running stack for the worker: svc-auth, svc-memory, Redis, the
    scripted upstream, and the workers the test starts.
    """

    dsn: str
    redis: RedisServer
    auth: Daemon
    memory: Daemon
    upstream: ScriptedUpstream
    workdir: Path
    owner: Store
    tenant: Tenant
    providers: Path
    workers: list[Daemon] = attrs.Factory(list)

    def workerEnvironment(self, **overrides: str) -> dict[str, str]:
        return {
            "SVC_HOST": "127.0.0.1",
            "SVC_PORT": str(freePort()),
            "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{self.auth.environment['SVC_GRPC_PORT']}",
            "SVC_MEMORY_GRPC_ADDR": f"127.0.0.1:{self.memory.environment['SVC_GRPC_PORT']}",
            "REDIS_URL": self.redis.url,
            "SVC_PROVIDERS_FILE": str(self.providers),
            "SVC_WORKER_POLL_INTERVAL": "100ms",
            "SVC_SHUTDOWN_TIMEOUT": "5s",
            "SVC_LOG_LEVEL": "DEBUG",
            **overrides,
        }

    def startWorker(self, name: str = "worker", ready: bool = True, **overrides: str) -> Daemon:
        """
        Start one svc-worker (its log in C{name}.log); by default wait until
        /ready (the change feed live, a claim answered).
        """
        daemon = Daemon(
            "svc-worker", self.workerEnvironment(**overrides), self.workdir / f"{name}.log"
        ).start()
        self.workers.append(daemon)
        if ready:
            daemon.waitForReady()
        return daemon

    def logs(self) -> str:
        """
        Every daemon's log, for the assertion that content never reaches
        one.
        """
        return "\n".join(each.output() for each in (self.auth, self.memory, *self.workers))

    def queue(
        self, requests: dict[str, str], subject: str = "", tenant: Tenant | None = None
    ) -> None:
        """
        Queue one observation per request id, each with the user's text
        given and an answer, as a proxy queues them (without a key, as an
        earlier release did: each keyed by its request id).
        """
        tenant = tenant or self.tenant
        scope = memory_pb2.Scope(
            org_id=str(tenant.orgID), agent_id=str(tenant.agentID), subject=subject
        )
        observations = [
            memory_pb2.Observation(
                scope=scope,
                request_id=requestID,
                messages=[
                    memory_pb2.ObservedMessage(role="user", content=text),
                    memory_pb2.ObservedMessage(role="assistant", content="Noted."),
                ],
            )
            for requestID, text in requests.items()
        ]
        with grpc.insecure_channel(
            f"127.0.0.1:{self.memory.environment['SVC_GRPC_PORT']}"
        ) as channel:
            for start in range(0, len(observations), 500):
                memory_pb2_grpc.MemoryServiceStub(channel).QueueObservations(
                    memory_pb2.QueueObservationsRequest(
                        observations=observations[start : start + 500]
                    ),
                    timeout=30,
                )

    def query(self, sql: str, parameters: tuple[Any, ...]) -> list[dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True) as connection:
            cursor = connection.execute(sql, parameters)
            names = [column.name for column in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def memories(self, tenant: Tenant | None = None, subject: str = "") -> list[dict[str, Any]]:
        tenant = tenant or self.tenant
        return self.query(
            "SELECT id, content, source, source_request_id, embedding_model, created_at,"
            " updated_at FROM memories WHERE org_id = %s AND agent_id = %s AND subject = %s"
            " ORDER BY created_at, id",
            (tenant.orgID, tenant.agentID, subject),
        )

    def contents(self, tenant: Tenant | None = None, subject: str = "") -> list[str]:
        return sorted(each["content"] for each in self.memories(tenant, subject))

    def observations(self, tenant: Tenant | None = None) -> list[dict[str, Any]]:
        tenant = tenant or self.tenant
        return self.query(
            "SELECT id, request_id, state, attempts, reason, next_attempt_at, lease_owner,"
            " lease_expires_at, now() AS now FROM memory_observations WHERE org_id = %s"
            " ORDER BY request_id",
            (tenant.orgID,),
        )

    def ledger(self, tenant: Tenant | None = None) -> list[dict[str, Any]]:
        tenant = tenant or self.tenant
        return list(ledgerRows(self.dsn, "org_id = %s", (tenant.orgID,)).values())

    def waitForDrained(self, tenant: Tenant | None = None, seconds: float = 60.0) -> None:
        waitUntil(lambda: not self.observations(tenant), "every observation processed", seconds)

    def metric(self, worker: Daemon, line: str) -> float:
        """
        The value of the series named exactly C{line} on C{worker}'s
        /metrics (0 when absent).
        """
        text = worker.get("/metrics")[1].decode()
        for each in text.splitlines():
            name, _, value = each.rpartition(" ")
            if name == line:
                return float(value)
        return 0.0


@attrs.define
class WorkerStack:
    """
    What a worker rig runs on and a module's tests may share: a migrated
    database, Redis, the scripted upstream, svc-auth and svc-memory. What
    a test may change is its own: each L{rig} has a new organization (the
    tests read memories, observations and ledger rows by it), its own
    providers file (the scripted models it names) and its own workers.
    Starting the stack (two twistd daemons, the upstream and Redis) was
    most of a worker test's cost (test_worker_daemon.py and
    test_worker_e2e.py share one per module).
    """

    dsn: str
    redis: RedisServer
    auth: Daemon
    memory: Daemon
    upstream: ScriptedUpstream
    owner: Store

    @contextlib.contextmanager
    def rig(
        self,
        workdir: Path,
        extractor: str = "echo",
        extraction: bool = True,
        prepare: Callable[[WorkerRig], None] | None = None,
        embedder: str = "echo",
    ) -> Iterator[WorkerRig]:
        """
        A rig on this stack for one test, without a worker (the test starts
        its own, after C{prepare} has set budgets or limits if it needs
        to), whose tenant is a new organization. Afterwards its workers are
        stopped and every observation still queued is deleted, whichever
        organization it is of: a later rig's workers claim any organization's
        due observations, and must find only their own test's.
        """
        workdir.mkdir(parents=True, exist_ok=True)
        rig = WorkerRig(
            dsn=self.dsn,
            redis=self.redis,
            auth=self.auth,
            memory=self.memory,
            upstream=self.upstream,
            workdir=workdir,
            owner=self.owner,
            tenant=makeTenant(self.owner, "main"),
            providers=memoryProvidersFile(
                workdir / "providers.toml", self.upstream, extractor, extraction, embedder
            ),
        )
        try:
            if prepare is not None:
                prepare(rig)
            yield rig
        finally:
            for worker in rig.workers:
                worker.terminate()
            # A test may have restarted svc-memory (rig.memory is then a new
            # daemon, on the stack's environment and ports): when the
            # stack's own has stopped, the new one is the stack's from now
            # on (the next rig's), else stop it; the stack stops its own.
            if rig.memory is not self.memory:
                if self.memory.process is not None and self.memory.process.poll() is not None:
                    self.memory = rig.memory
                else:
                    rig.memory.terminate()
            rig.query("DELETE FROM memory_observations RETURNING id", ())


@contextlib.contextmanager
def runningWorkerStack(postgres: PostgresServer, workdir: Path) -> Iterator[WorkerStack]:
    """
    A L{WorkerStack} on a new database of C{postgres}, its files (logs,
    Redis) under C{workdir}; stopped afterwards.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    dsn = migratedDatabase(postgres, f"worker_{secrets.token_hex(6)}")
    redis = RedisServer.create(workdir / "redis")
    redis.start()
    connection = psycopg.connect(dsn, autocommit=True)
    upstream = ScriptedUpstream(
        workdir / "upstream", embeddingDimensions=MEMORY_EMBEDDING_DIMENSIONS
    ).start()
    auth = Daemon("svc-auth", authEnvironment(dsn), workdir / "auth.log").start()
    memory = Daemon("svc-memory", memoryEnvironment(dsn), workdir / "memory.log").start()
    stack: WorkerStack | None = None
    try:
        auth.waitForReady()
        memory.waitForReady()
        stack = WorkerStack(
            dsn=dsn,
            redis=redis,
            auth=auth,
            memory=memory,
            upstream=upstream,
            owner=Store(lambda: contextlib.nullcontext(connection)),
        )
        yield stack
    finally:
        # The svc-memory a rig's test started again, if the stack kept one.
        if stack is not None and stack.memory is not memory:
            stack.memory.terminate()
        memory.terminate()
        auth.terminate()
        upstream.stop()
        redis.stop()
        connection.close()


@contextlib.contextmanager
def runningWorkerRig(
    postgres: PostgresServer,
    workdir: Path,
    extractor: str = "echo",
    extraction: bool = True,
    prepare: Callable[[WorkerRig], None] | None = None,
    embedder: str = "echo",
) -> Iterator[WorkerRig]:
    """
    The stack and a rig on it, for one test alone (L{WorkerStack.rig}
    says what the rig is).
    """
    with runningWorkerStack(postgres, workdir) as stack:
        with stack.rig(workdir, extractor, extraction, prepare, embedder) as rig:
            yield rig


def newRequestIDs(count: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(count)]


def factsOf(requestID: str, count: int = 2) -> str:
    """
    A user's turn stating C{count} facts particular to C{requestID}, and a
    question (which extraction leaves out).
    """
    facts = " ".join(f"My fact number {n} is {requestID}-{n}." for n in range(count))
    return f"{facts} What do you think?"


def expectedFacts(requestIDs: list[str], count: int = 2) -> list[str]:
    """
    The memories L{factsOf} of each of C{requestIDs} make, sorted.
    """
    return sorted(f"My fact number {n} is {each}-{n}." for each in requestIDs for n in range(count))


def waitForMetric(rig: WorkerRig, worker: Daemon, line: str, value: float) -> None:
    """
    Wait (bounded) until C{worker}'s metric C{line} reads C{value}: svc-memory
    commits an observation's completion before the worker has its answer and
    counts it, so a count read once right after the drain can lag.
    """
    waitUntil(lambda: rig.metric(worker, line) == value, f"{line} == {value}")


def asJSON(value: Any) -> str:
    return json.dumps(value, default=str, sort_keys=True)
