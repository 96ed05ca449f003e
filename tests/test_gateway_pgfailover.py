"""
A PostgreSQL failover end to end (decisions D16, issue 48): real svc-auth,
svc-memory and svc-proxy daemons whose POSTGRES_DSN names a primary and its
synchronous streaming standby (C{target_session_attrs=read-write}), a
proxy answering chat completions all along; then the primary frozen (the
proxy's rows in flight to svc-auth hang), killed (SIGKILL, every process)
and the standby promoted.

Without a restart, both daemons serve again within seconds of the
promotion: svc-auth validates a token made on the new primary, svc-memory
finds a memory written before the failover and no longer recalls one
deleted on the new primary while its change listener was away (its
caches were rebuilt, not kept); and every request answered 200 has its
ledger row on the new primary (what svc-auth had not acknowledged, the
proxy's journal sent again).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from authfixtures import Tenant, makeTenant, ownerStore
from gatewayfixtures import Answer, request, waitFor
from standbyfixtures import MigratedPair, ledgerRequestIDs, migratedPair

from svcd.auth.authority import issueToken
from svcd.common.permissions import Permission
from svcd.devkit.daemons import Daemon, authEnvironment, memoryEnvironment
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.memory.store import MemoryStore
from svcd.memoryclient.records import Scope

# Starts real daemons (conftest.py, pytest.ini): left out of a quick run.
pytestmark = pytest.mark.e2e

# The promise measured: from the promotion (the failover manager's part
# done) to both daemons serving again.
SERVES_AGAIN_WITHIN = 15.0
# Bounds on what the daemons do on their own afterwards (the outbox's
# backoff is at most 5 s): guards against a hang, not promises.
WAIT = 30.0

EVERYTHING = int(
    Permission.ProxyChatCompletion
    | Permission.ProxyEmbeddings
    | Permission.MemoryRead
    | Permission.MemoryWrite
)

PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[models]]
name = "chat"
provider = "scripted"
upstream_model = "echo"

[[models]]
name = "embed"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
price = {{ input = "0.02" }}

[memory]
embedding_model = "embed"
"""

SUBJECT = "failover-user"
CHAT = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hello"}]}).encode()


@attrs.define
class Stack:
    pair: MigratedPair
    auth: Daemon
    memory: Daemon
    proxy: Daemon
    tenant: Tenant

    def call(self, method: str, path: str, body: object = None, token: str | None = None) -> Answer:
        headers = {
            "Authorization": f"Bearer {token or self.tenant.token}",
            "X-SVC-Agent-ID": str(self.tenant.agentID),
            "X-SVC-Memory-Subject": SUBJECT,
            "Content-Type": "application/json",
        }
        encoded = body if isinstance(body, bytes) else json.dumps(body).encode()
        return request(
            self.proxy.httpPort,
            method,
            path,
            headers,
            encoded if body is not None else None,
            timeout=30,
        )

    def found(self, query: str) -> list[str] | None:
        """
        The ids a search finds, or None when it is not answered 200.
        """
        answer = self.call("POST", "/v1/memories/search", {"query": query, "k": 5})
        if answer.status != 200:
            return None
        return [each["memory"]["id"] for each in answer.json()["data"]]


@contextlib.contextmanager
def runningStack(workdir: Path) -> Iterator[Stack]:
    with migratedPair(workdir / "postgres") as pair:
        owner, connection = ownerStore(pair.dsn())
        tenant = makeTenant(owner, "acme", permissions=EVERYTHING)
        connection.close()
        redis = RedisServer.create(workdir / "redis")
        redis.start()
        upstream = ScriptedUpstream(workdir / "upstream").start()
        daemons: list[Daemon] = []
        try:
            auth = Daemon("svc-auth", authEnvironment(pair.dsn()), workdir / "auth.log").start()
            daemons.append(auth)
            memory = Daemon(
                "svc-memory", memoryEnvironment(pair.dsn()), workdir / "memory.log"
            ).start()
            daemons.append(memory)
            providers = workdir / "providers.toml"
            providers.write_text(PROVIDERS.format(base=upstream.baseURL))
            proxy = Daemon(
                "svc-proxy",
                {
                    "SVC_HOST": "127.0.0.1",
                    "SVC_PORT": str(freePort()),
                    "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}",
                    "SVC_MEMORY_GRPC_ADDR": f"127.0.0.1:{memory.environment['SVC_GRPC_PORT']}",
                    "REDIS_URL": redis.url,
                    "SVC_PROVIDERS_FILE": str(providers),
                    "SVC_USAGE_JOURNAL": str(workdir / "usage.journal"),
                    "SVC_AUTH_VALIDATE_TIMEOUT": "2s",
                    "SVC_RATE_LIMIT_DEFAULT_RPM": "1000000",
                    "SVC_SHUTDOWN_TIMEOUT": "5s",
                },
                workdir / "proxy.log",
            ).start()
            daemons.append(proxy)
            for daemon in daemons:
                daemon.waitForReady()
            stack = Stack(pair, auth, memory, proxy, tenant)
            # The proxy's channel to svc-memory may have tried before it was up.
            waitFor(lambda: stack.call("GET", "/v1/memories").status == 200, WAIT)
            yield stack
        finally:
            for daemon in reversed(daemons):
                daemon.terminate()
            upstream.stop()
            redis.destroy()
        for daemon in daemons:
            assert "Traceback" not in daemon.output(), daemon.output()


class Load:
    """
    Chat completions sent one after another through the proxy on a thread
    of their own, each answer's status and request id kept.
    """

    def __init__(self, stack: Stack) -> None:
        self._stack = stack
        self._stopping = threading.Event()
        self.answers: list[tuple[int, str]] = []
        self._thread = threading.Thread(target=self._run, name="failover-load", daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exception: object) -> None:
        self._stopping.set()
        self._thread.join(60)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                answer = self._stack.call("POST", "/v1/chat/completions", CHAT)
                self.answers.append((answer.status, answer.headers.get("x-request-id", "")))
            except OSError:
                self.answers.append((0, ""))
            # A pace, not a wait for a condition: about 30 requests a
            # second at most, so that the load does not starve the
            # daemons of a shared machine's two cores.
            self._stopping.wait(0.03)

    def okSince(self, start: int) -> int:
        return sum(1 for status, _ in self.answers[start:] if status == 200)


def gauge(daemon: Daemon, name: str) -> float:
    status, body = daemon.get("/metrics", timeout=5.0)
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def ready(daemon: Daemon) -> bool:
    try:
        return daemon.get("/ready", timeout=1.0)[0] == 200
    except OSError:
        return False


def test_theDaemonsFollowAFailoverWithoutARestart(tmp_path: Path) -> None:
    """
    The primary frozen, then killed, under a steady load of chat
    completions, and the standby promoted once both daemons report the
    outage: within L{SERVES_AGAIN_WITHIN} of the promotion the same
    svc-auth validates a token made on the new primary and the same
    svc-memory finds what was written before and not what was deleted on
    the new primary in the gap; both report ready; every request answered
    200 (those answered while the primary was frozen included) has its
    ledger row on the new primary, sent again by the proxy.
    """
    with runningStack(tmp_path) as stack:
        primary, standby = stack.pair.servers
        daemons = (stack.auth, stack.memory, stack.proxy)
        pids = [processID(daemon) for daemon in daemons]
        kept = stack.call("POST", "/v1/memories", {"content": "the user drinks green tea"})
        assert kept.status == 201, kept.body
        forgotten = stack.call("POST", "/v1/memories", {"content": "the user plays the cello"})
        assert forgotten.status == 201, forgotten.body
        keptID, forgottenID = kept.json()["id"], forgotten.json()["id"]
        # Both in svc-memory's caches, from which a search answers while
        # its listener hears every change.
        assert keptID in (stack.found("green tea") or [])
        assert forgottenID in (stack.found("plays the cello") or [])
        waitFor(
            lambda: (
                gauge(stack.memory, "svc_memory_cache_scopes") >= 1
                and gauge(stack.memory, "svc_memory_record_cache_scopes") >= 1
            ),
            WAIT,
        )
        with Load(stack) as load:
            waitFor(lambda: load.okSince(0) >= 10, WAIT)
            # The primary hangs first, then dies, as a machine whose
            # database stalled and was then fenced would: requests go on
            # being answered (svc-auth validates from its cache, its
            # listener blocked on the silent server), their rows sent to
            # an svc-auth whose transactions hang, and not acknowledged;
            # once the primary is killed, svc-auth refuses what its cache
            # cannot vouch for and every request waits for a primary.
            atFreeze = len(load.answers)
            primary.freeze()
            waitFor(
                lambda: (
                    load.okSince(atFreeze) >= 1
                    and "RecordUsage to svc-auth failed" in stack.proxy.output()
                ),
                WAIT,
            )
            primary.kill()
            killed = time.monotonic()
            atKill = len(load.answers)
            waitFor(
                lambda: (
                    not ready(stack.auth)
                    and not ready(stack.memory)
                    and any(status != 200 for status, _ in load.answers[atKill:])
                ),
                WAIT,
            )
            duringOutage = len(load.answers)
            standby.promote()
            promoted = time.monotonic()
            # Deleted on the new primary as svcctl would, most likely
            # while svc-memory's listener is still away: the notification
            # is lost to it, and only caches rebuilt from the new primary
            # forget the memory.
            newPrimary = stack.pair.only(standby)
            owner, connection = ownerStore(newPrimary)
            with connection:
                MemoryStore(lambda: contextlib.nullcontext(connection)).delete(
                    Scope(stack.tenant.orgID, stack.tenant.agentID, SUBJECT),
                    uuid.UUID(forgottenID),
                )
                token, _ = issueToken(owner, orgID=stack.tenant.orgID, permissions=EVERYTHING)
            timings: dict[str, float] = {"outage until promoted": promoted - killed}

            def validates() -> bool:
                answer = stack.call("POST", "/v1/chat/completions", CHAT, token=token)
                return answer.status == 200

            waitFor(validates, SERVES_AGAIN_WITHIN)
            timings["svc-auth validates"] = time.monotonic() - promoted
            waitFor(lambda: keptID in (stack.found("green tea") or []), SERVES_AGAIN_WITHIN)
            timings["svc-memory searches"] = time.monotonic() - promoted
            waitFor(lambda: ready(stack.auth) and ready(stack.memory), SERVES_AGAIN_WITHIN)
            timings["both ready"] = time.monotonic() - promoted
            results = stack.found("plays the cello")
            assert results is not None and forgottenID not in results
            assert keptID in (stack.found("green tea") or [])
            after = len(load.answers)
            waitFor(lambda: load.okSince(after) >= 10, WAIT)
        statuses: dict[int, int] = {}
        for status, _ in load.answers:
            statuses[status] = statuses.get(status, 0) + 1
        frozen, outage = load.answers[atFreeze:atKill], load.answers[atKill:duringOutage]
        print(
            f"\ntimings (s): {timings}; answers: {statuses}; while frozen"
            f" {sum(status == 200 for status, _ in frozen)} of {len(frozen)} were 200,"
            f" once killed {sum(status == 200 for status, _ in outage)} of {len(outage)}"
        )
        for name, seconds in timings.items():
            if name != "outage until promoted":
                assert seconds < SERVES_AGAIN_WITHIN, (name, seconds)
        assert load.okSince(atFreeze) > 0
        answered = {requestID for status, requestID in load.answers if status == 200}
        missing: set[str] = set()

        def allRecorded() -> bool:
            nonlocal missing
            missing = answered - ledgerRequestIDs(newPrimary)
            return not missing

        with contextlib.suppress(AssertionError):
            waitFor(allRecorded, WAIT, interval=0.5)
        assert not missing, f"{len(missing)} of {len(answered)} answered requests have no row"
        # Nothing restarted: the same processes served throughout.
        for daemon, pid in zip(daemons, pids, strict=True):
            assert processID(daemon) == pid
            assert daemon.process is not None and daemon.process.poll() is None
        assert not primary.isRunning
        # What svc-auth could not take during the outage was sent again.
        assert "failed attempt(s)" in stack.proxy.output()


def processID(daemon: Daemon) -> int:
    assert daemon.process is not None
    return daemon.process.pid
