"""
Rolling restarts under load, as an operator does them (issue 25).

    python tests/rolling.py --dsn DSN --workdir DIR
                            [--restart proxies|auth] [--rounds N]

With C{--restart proxies} (the default): two svc-proxy workers share one
port (C{SVC_REUSE_PORT=true}, as C{etc/systemd/svc-proxy@.service} runs
them) in front of a real svc-auth, PostgreSQL (C{--dsn}, migrated here)
and a private Redis; 12 clients make protected requests all along, 6 on
keep-alive connections and 6 with one connection per request; each worker
in turn is sent SIGTERM, waited for and started again (it serves again
once it logs that it listens), C{N} rounds.

With C{--restart auth}: two svc-auth replicas, one svc-proxy given both
(C{SVC_AUTH_GRPC_ADDR=ipv4:127.0.0.1:P1,127.0.0.1:P2}); 8 keep-alive
clients, 6 with one hot token and 2 with 40 tokens in turn; each replica
in turn is sent SIGTERM, waited for, started again and waited for until
its C{/ready} answers 200.

The proxies' deadline for svc-auth is 5 s instead of 50 ms (see C{run}):
the run measures what restarts cost, not how a machine loaded by the whole
stack, its clients and whatever else runs there keeps a 50 ms deadline.

Prints one JSON document: for each kind of client the requests made,
those answered 200, and the failures (any other status, by status; a
connection reset by the kernel, counted apart; any other exception, by
type, with a few samples), and for each restart how long the stop took,
its exit status and how long the new process took to serve. Every daemon
log stays in C{DIR}.

It runs in the network namespace it is started in:
tests/test_rolling_restart.py starts it in one of its own (C{ip netns
exec}), with C{net.ipv4.tcp_migrate_req} set there alone. PostgreSQL is
then reached through its Unix socket, which no network namespace hides.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import psycopg
import urllib3

from svcd.auth.authority import issueToken
from svcd.auth.store import Store
from svcd.common.migrations import migrate
from svcd.common.permissions import Permission
from svcd.devkit.daemons import Daemon, authEnvironment
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import freePort

PROBE = "/v1/internal/auth-probe"

# How long the clients run before the first restart and after the last.
SETTLE_SECONDS = 1.0

# Bounds on the daemons' stop and start: a daemon past them is a failure
# of the run, not something to wait for.
STOP_LIMIT = 30.0
START_LIMIT = 60.0

# How many failures of each kind the report describes.
SAMPLES = 10


def _causes(error: BaseException) -> Iterator[BaseException]:
    """
    C{error} and what it wraps: its cause, its context, and exceptions among
    its arguments (urllib3 puts the socket's error there).
    """
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [each for each in current.args if isinstance(each, BaseException)]
        pending += [each for each in (current.__cause__, current.__context__) if each is not None]


def isReset(error: BaseException) -> bool:
    """
    Did the kernel reset the connection (ECONNRESET or EPIPE), as it does to
    the connections a closing listener had queued but not accepted? A
    connection the server closed without an answer (http.client's
    RemoteDisconnected, itself a ConnectionResetError) is not one.
    """
    for each in _causes(error):
        if isinstance(each, http.client.RemoteDisconnected):
            return False
    return any(isinstance(each, ConnectionResetError | BrokenPipeError) for each in _causes(error))


@attrs.define
class Tally:
    """
    What one kind of client saw.
    """

    clients: int = 0
    requests: int = 0
    ok: int = 0
    resets: int = 0
    statuses: collections.Counter[int] = attrs.field(factory=collections.Counter)
    errors: collections.Counter[str] = attrs.field(factory=collections.Counter)
    samples: list[str] = attrs.field(factory=list)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def answered(self, status: int, began: float) -> None:
        with self._lock:
            self.requests += 1
            if status == 200:
                self.ok += 1
            else:
                self.statuses[status] += 1
                self._sample(f"{time.monotonic() - began:.3f} s: status {status}")

    def failed(self, error: BaseException, began: float) -> None:
        with self._lock:
            self.requests += 1
            if isReset(error):
                self.resets += 1
            else:
                self.errors[type(error).__name__] += 1
            self._sample(f"{time.monotonic() - began:.3f} s: {error!r}")

    def _sample(self, text: str) -> None:
        if len(self.samples) < SAMPLES:
            self.samples.append(text)

    @property
    def failures(self) -> int:
        return self.requests - self.ok

    def report(self) -> dict[str, Any]:
        return {
            "clients": self.clients,
            "requests": self.requests,
            "ok": self.ok,
            "failed": self.failures,
            "resets": self.resets,
            "statuses": {str(status): count for status, count in self.statuses.items()},
            "errors": dict(self.errors),
            "samples": self.samples,
        }


@attrs.frozen
class Caller:
    """
    The headers of one tenant's protected requests, for each of its tokens.
    """

    agentID: str
    tokens: tuple[str, ...]

    def headers(self, turn: int) -> dict[str, str]:
        return {
            "Authorization": f"Bearer {self.tokens[turn % len(self.tokens)]}",
            "X-SVC-Agent-ID": self.agentID,
        }


class Clients:
    """
    Client threads making protected requests until stopped: keep-alive
    ones through urllib3 (a pool of one connection each, no retries, as a
    C{requests} session without retries), and ones that open a connection
    per request with http.client and C{Connection: close}.
    """

    def __init__(self, port: int, began: float) -> None:
        self._port = port
        self._began = began
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.keepAlive = Tally()
        self.oneShot = Tally()

    def startKeepAlive(self, caller: Caller, count: int) -> None:
        self.keepAlive.clients += count
        for _ in range(count):
            self._start(self._keepAlive, caller)

    def startOneShot(self, caller: Caller, count: int) -> None:
        self.oneShot.clients += count
        for _ in range(count):
            self._start(self._oneShot, caller)

    def _start(self, loop: Callable[[Caller], None], caller: Caller) -> None:
        thread = threading.Thread(target=loop, args=(caller,), daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(30)

    def _keepAlive(self, caller: Caller) -> None:
        pool = urllib3.HTTPConnectionPool(
            "127.0.0.1",
            self._port,
            maxsize=1,
            block=True,
            retries=False,
            timeout=urllib3.Timeout(connect=5.0, read=10.0),
        )
        turn = 0
        try:
            while not self._stopping.is_set():
                turn += 1
                try:
                    answer = pool.request("GET", PROBE, headers=caller.headers(turn))
                except Exception as error:
                    self.keepAlive.failed(error, self._began)
                    continue
                self.keepAlive.answered(answer.status, self._began)
        finally:
            pool.close()

    def _oneShot(self, caller: Caller) -> None:
        turn = 0
        while not self._stopping.is_set():
            turn += 1
            connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=10.0)
            try:
                connection.request(
                    "GET", PROBE, headers={**caller.headers(turn), "Connection": "close"}
                )
                response = connection.getresponse()
                response.read()
            except Exception as error:
                self.oneShot.failed(error, self._began)
                continue
            finally:
                connection.close()
            self.oneShot.answered(response.status, self._began)


def makeCaller(dsn: str, tokens: int) -> Caller:
    """
    A new organization with an active agent and C{tokens} tokens, made in
    the database as svcctl does.
    """
    with psycopg.connect(dsn, autocommit=True) as connection:
        store = Store(lambda: contextlib.nullcontext(connection))
        orgID = store.createOrganization(f"rolling-{uuid.uuid4().hex[:8]}")
        agent = store.createAgent(orgID, "rolling-agent", "active")
        made = tuple(
            issueToken(store, orgID=orgID, permissions=int(Permission.ProxyChatCompletion))[0]
            for _ in range(tokens)
        )
    return Caller(str(agent.agentID), made)


def _waitFor(condition: Callable[[], bool], limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {limit} s")
        time.sleep(0.02)


def _listening(daemon: Daemon) -> bool:
    if daemon.process is not None and daemon.process.poll() is not None:
        raise RuntimeError(f"{daemon.logFile} exited with {daemon.process.returncode}")
    return '"svc-proxy listening on' in daemon.output()


@attrs.define
class Restart:
    daemon: str
    roundNumber: int
    stopSeconds: float
    exitStatus: int | None
    startSeconds: float

    def report(self) -> dict[str, Any]:
        return {
            "daemon": self.daemon,
            "round": self.roundNumber,
            "stopSeconds": round(self.stopSeconds, 3),
            "exitStatus": self.exitStatus,
            "startSeconds": round(self.startSeconds, 3),
        }


def restart(
    daemons: list[Daemon],
    index: int,
    name: str,
    roundNumber: int,
    workdir: Path,
    serving: Callable[[Daemon], None],
) -> Restart:
    """
    SIGTERM C{daemons[index]}, wait for it to exit, start it again with the
    same environment and wait until C{serving} returns.
    """
    old = daemons[index]
    assert old.process is not None
    began = time.monotonic()
    old.signal(signal.SIGTERM)
    try:
        status: int | None = old.process.wait(STOP_LIMIT)
    except Exception:
        old.process.kill()
        old.process.wait()
        status = None
    stopped = time.monotonic()
    new = Daemon(old.plugin, old.environment, workdir / f"{name}-round{roundNumber}.log").start()
    daemons[index] = new
    serving(new)
    return Restart(name, roundNumber, stopped - began, status, time.monotonic() - stopped)


def proxyServes(daemon: Daemon) -> None:
    _waitFor(lambda: _listening(daemon), START_LIMIT, "svc-proxy listening")


def authServes(daemon: Daemon) -> None:
    daemon.waitForReady(START_LIMIT)


def migrateRequest() -> int | None:
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_migrate_req").read_text())
    except (OSError, ValueError):
        return None


def run(dsn: str, workdir: Path, target: str, rounds: int) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    migrate(dsn)
    hot = makeCaller(dsn, 1)
    many = makeCaller(dsn, 40) if target == "auth" else hot
    redis = RedisServer.create(workdir / "redis")
    redis.start()
    auths: list[Daemon] = []
    proxies: list[Daemon] = []
    restarts: list[Restart] = []
    began = time.monotonic()
    clients: Clients | None = None
    try:
        replicas = 2 if target == "auth" else 1
        for number in range(1, replicas + 1):
            auths.append(
                Daemon(
                    "svc-auth",
                    authEnvironment(dsn, SVC_SHUTDOWN_TIMEOUT="10s"),
                    workdir / f"svc-auth-{number}.log",
                ).start()
            )
        for auth in auths:
            auth.waitForReady(START_LIMIT)
        grpcAddresses = [f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}" for auth in auths]
        port = freePort()
        environment = {
            "SVC_HOST": "127.0.0.1",
            "SVC_PORT": str(port),
            "SVC_AUTH_GRPC_ADDR": (
                "ipv4:" + ",".join(grpcAddresses) if len(grpcAddresses) > 1 else grpcAddresses[0]
            ),
            "REDIS_URL": redis.url,
            "SVC_RATE_LIMIT_DEFAULT_RPM": "1000000000",
            "SVC_SHUTDOWN_TIMEOUT": "10s",
            # What is measured is what restarts cost. On a loaded 2-core
            # machine running this whole stack and its clients, a call to
            # svc-auth sometimes takes longer than the default 50 ms (most
            # often from a worker just started, whose cache is still cold),
            # and with other work on the machine even a second; its 503
            # would be counted against the restart.
            "SVC_AUTH_VALIDATE_TIMEOUT": "5s",
            "SVC_AUTH_QUEUE_TIMEOUT": "5s",
        }
        workers = 2 if target == "proxies" else 1
        if workers > 1:
            environment["SVC_REUSE_PORT"] = "true"
        for number in range(1, workers + 1):
            proxies.append(
                Daemon("svc-proxy", environment, workdir / f"svc-proxy-{number}.log").start()
            )
        for proxy in proxies:
            proxyServes(proxy)

        clients = Clients(port, began)
        if target == "proxies":
            clients.startKeepAlive(hot, 6)
            clients.startOneShot(hot, 6)
        else:
            clients.startKeepAlive(hot, 6)
            clients.startKeepAlive(many, 2)
        time.sleep(SETTLE_SECONDS)

        for number in range(1, rounds + 1):
            if target == "proxies":
                for index in range(len(proxies)):
                    restarts.append(
                        restart(
                            proxies, index, f"svc-proxy-{index + 1}", number, workdir, proxyServes
                        )
                    )
            else:
                for index in range(len(auths)):
                    restarts.append(
                        restart(auths, index, f"svc-auth-{index + 1}", number, workdir, authServes)
                    )
        time.sleep(SETTLE_SECONDS)
        clients.stop()
        return {
            "target": target,
            "tcp_migrate_req": migrateRequest(),
            "seconds": round(time.monotonic() - began, 1),
            "keepAlive": clients.keepAlive.report(),
            "oneShot": clients.oneShot.report(),
            "restarts": [each.report() for each in restarts],
            "logs": str(workdir),
        }
    finally:
        if clients is not None:
            clients.stop()
        for daemon in [*proxies, *auths]:
            daemon.terminate()
        redis.destroy()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="a PostgreSQL database (migrated here)")
    parser.add_argument("--workdir", required=True, type=Path, help="logs and Redis go here")
    parser.add_argument("--restart", choices=("proxies", "auth"), default="proxies")
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args(argv)
    report = run(arguments.dsn, arguments.workdir, arguments.restart, arguments.rounds)
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
