"""
One C{dev/gateway} run (L{DevStack}): the private servers, the
migrations, the demo tenant, the scripted model server, the daemons
started in order and watched, and the stop in reverse order.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from psycopg import sql

from svcd.common.config import ConfigError
from svcd.devkit.gateway.children import (
    CHECKOUT,
    STOP_TIMEOUT,
    Daemon,
    DevStackError,
    executableBeside,
    say,
    startedCommandLine,
    stopLeftovers,
    svcctl,
    writePrivateJSON,
)
from svcd.devkit.gateway.demo import (
    DEMO_CLAUDE_MODEL,
    DEMO_EMBEDDING_DIMENSIONS,
    DEMO_EMBEDDING_MODEL,
    DEMO_MODEL,
    announce,
    demoMemorySettings,
    demoModels,
    demoTenant,
    writeDemoProviders,
)
from svcd.devkit.gateway.settings import Settings
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.providers.providersfile import VARIABLE as PROVIDERS_VARIABLE
from svcd.providers.providersfile import providersFromEnvironment
from svcd.providers.table import ProviderTable

READY_TIMEOUT = 60.0
DEMO_DATABASE = "svc"
MODEL_SERVER = "model server"

# svc-proxy's deadline on its calls to svc-auth here, unless the developer
# sets SVC_AUTH_VALIDATE_TIMEOUT. The daemons' default, 50 ms, is sized for
# a server that does nothing else; the first request of a token is cold in
# svc-auth (a database read and argon2), and on a developer's machine busy
# with an editor, a build or the tests it can take longer, so the first
# command pasted would answer 503 SERVICE_DEGRADED.
VALIDATE_TIMEOUT = "1s"


class DevStack:
    """
    The servers and daemons of one C{dev/gateway} run: L{up} starts them,
    L{watch} waits, L{down} stops what was started, in reverse order.
    """

    def __init__(self, settings: Settings, environ: Mapping[str, str]) -> None:
        self._settings = settings
        self._environ = dict(environ)
        self._postgres: PostgresServer | None = None
        self._redis: RedisServer | None = None
        self._daemons: list[Daemon] = []
        self._processRecord = settings.dataDirectory / "processes.json"
        # The providers file written for the scripted model server, when
        # this run started one.
        self._writtenProviders: Path | None = None

    def _recordProcesses(self) -> None:
        """
        Note in processes.json which children run now, for L{stopLeftovers}
        of the next run should this one be killed before it cleans up.
        """
        children = [(daemon.name, daemon.process.pid) for daemon in self._daemons]
        if self._redis is not None and self._redis.pid is not None:
            children.append(("Redis", self._redis.pid))
        # The command line as /proc shows it, which is what stopLeftovers
        # compares: a script's shows its interpreter, Redis's its title.
        entries = [
            {"name": name, "pid": pid, "command": startedCommandLine(pid)} for name, pid in children
        ]
        writePrivateJSON(self._processRecord, entries)

    # Starting.

    def up(self) -> None:
        settings = self._settings
        # Not 0700: as root, the postgres user must reach .data/postgres.
        # demo.json, the one secret here, is 0600 itself.
        settings.dataDirectory.mkdir(parents=True, exist_ok=True)
        stopLeftovers(self._processRecord)
        dsn = self._database()
        redisURL = self._redisURL()
        svcctl(self._environ, "migrate", dsn=dsn, show=True)
        demo = demoTenant(self._environ, settings.dataDirectory, dsn)
        if settings.scriptedModelServer:
            self._writtenProviders = self._startModelServer()
        if self._memoryWanted():
            demoMemorySettings(self._environ, settings.dataDirectory, dsn, demo)
        self._startDaemons(dsn, redisURL)
        self._waitUntilReady()
        announce(
            settings,
            demo,
            demoModels(self._providers(), str(demo["org_id"])),
            self.proxyAvailable(),
            self._memoryWanted(),
        )

    def _database(self) -> str:
        if self._settings.postgresDSN is not None:
            say("PostgreSQL: using POSTGRES_DSN")
            return self._settings.postgresDSN
        directory = self._settings.dataDirectory / "postgres"
        reused = (directory / "cluster" / "data" / "PG_VERSION").is_file()
        say(("reusing" if reused else "creating") + f" the PostgreSQL cluster in {directory}")
        self._postgres = PostgresServer.create(directory)
        self._postgres.start()
        with self._postgres.connect() as connection:
            exists = connection.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (DEMO_DATABASE,)
            ).fetchone()
            if exists is None:
                connection.execute(
                    sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DEMO_DATABASE))
                )
        dsn = self._postgres.superuserDSN(DEMO_DATABASE)
        say(f"PostgreSQL: {dsn} (log: {self._postgres.logFile})")
        return dsn

    def _redisURL(self) -> str:
        if self._settings.redisURL is not None:
            say("Redis: using REDIS_URL")
            return self._settings.redisURL
        self._redis = RedisServer.create(self._settings.dataDirectory / "redis")
        self._redis.start()
        self._recordProcesses()
        say(f"Redis: {self._redis.url} (log: {self._redis.logFile})")
        return self._redis.url

    def _startModelServer(self) -> Path:
        """
        Run the scripted model server of the tests on a free loopback port,
        as a child stopped with the daemons (after svc-proxy, which was
        started after it), and write the providers file that sends the demo
        models (chat, Claude-shaped chat and embedding) to it; return the
        file's path.
        """
        directory = self._settings.dataDirectory / "model-server"
        directory.mkdir(exist_ok=True)
        portFile = directory / "ports.json"
        # A killed run's file would name ports nobody listens on.
        portFile.unlink(missing_ok=True)
        process = subprocess.Popen(  # noqa: S603 - our own module, arguments we built
            [
                sys.executable,
                "-m",
                "svcd.devkit.upstream",
                "--port",
                "0",
                "--port-file",
                str(portFile),
                "--embedding-dimensions",
                str(DEMO_EMBEDDING_DIMENSIONS),
            ],
            env=self._environ,
            cwd=CHECKOUT,
            stdin=subprocess.DEVNULL,
            # It writes nothing but errors, on stderr, which come here.
            stdout=subprocess.DEVNULL,
            # As the daemons: Ctrl-C reaches only us, and down() stops it.
            start_new_session=True,
        )
        self._daemons.append(Daemon(MODEL_SERVER, None, process))
        self._recordProcesses()
        # It writes the file (in one step) once it listens.
        deadline = time.monotonic() + READY_TIMEOUT
        while not portFile.exists():
            status = process.poll()
            if status is not None:
                raise DevStackError(
                    f"the {MODEL_SERVER} exited with status {status} before it listened "
                    "(its output is above)"
                )
            if time.monotonic() > deadline:
                raise DevStackError(
                    f"the {MODEL_SERVER} did not listen within {READY_TIMEOUT:.0f} s"
                )
            time.sleep(0.05)
        try:
            port = int(json.loads(portFile.read_text())["port"])
        except (OSError, ValueError, KeyError, TypeError):
            raise DevStackError(f"the {MODEL_SERVER} wrote no port in {portFile}") from None
        path = self._settings.dataDirectory / "providers.toml"
        writeDemoProviders(path, port)
        say(
            f"model server: the scripted one of the tests on 127.0.0.1:{port} answers the models "
            f'"{DEMO_MODEL}", "{DEMO_CLAUDE_MODEL}" (Anthropic\'s Messages API) and'
            f' "{DEMO_EMBEDDING_MODEL}" (providers file {path}; SVC_PROVIDERS_FILE names your own)'
        )
        return path

    def _startDaemons(self, dsn: str, redisURL: str) -> None:
        settings = self._settings
        twistd = executableBeside("twistd")
        if twistd is None:
            raise DevStackError("twistd was not found; is .venv complete? (run dev/bootstrap)")
        # Loopback only unless the developer says otherwise: the demo token
        # is printed on the terminal, and the services default to 0.0.0.0.
        base = {**self._environ, "PYTHONUNBUFFERED": "1"}
        base.setdefault("SVC_HOST", "127.0.0.1")
        self._startDaemon(
            twistd,
            "svc-auth",
            {
                **base,
                "SVC_PORT": str(settings.authPort),
                "SVC_GRPC_PORT": str(settings.authGrpcPort),
                "POSTGRES_DSN": dsn,
            },
            f"http://127.0.0.1:{settings.authPort}/ready",
        )
        memory = self._memoryWanted()
        if memory:
            # Decisions D13: the memories, on the same database.
            memoryEnvironment = {
                **base,
                "SVC_PORT": str(settings.memoryPort),
                "SVC_GRPC_PORT": str(settings.memoryGrpcPort),
                "POSTGRES_DSN": dsn,
            }
            self._startDaemon(
                twistd,
                "svc-memory",
                memoryEnvironment,
                f"http://127.0.0.1:{settings.memoryPort}/ready",
            )
        if self.proxyAvailable():
            proxyEnvironment = {
                **base,
                "SVC_PORT": str(settings.proxyPort),
                "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{settings.authGrpcPort}",
                "REDIS_URL": redisURL,
            }
            proxyEnvironment.pop("SVC_GRPC_PORT", None)
            proxyEnvironment.pop("POSTGRES_DSN", None)
            proxyEnvironment.setdefault("SVC_AUTH_VALIDATE_TIMEOUT", VALIDATE_TIMEOUT)
            if self._writtenProviders is not None:
                proxyEnvironment[PROVIDERS_VARIABLE] = str(self._writtenProviders)
            if memory:
                proxyEnvironment.setdefault(
                    "SVC_MEMORY_GRPC_ADDR", f"127.0.0.1:{settings.memoryGrpcPort}"
                )
            self._startDaemon(
                twistd,
                "svc-proxy",
                proxyEnvironment,
                f"http://127.0.0.1:{settings.proxyPort}/ready",
            )
            if memory:
                self._startWorker(twistd, base, redisURL)
        else:
            say("svcd/proxy/tap.py does not exist yet: running svc-auth only")

    def _startWorker(self, twistd: str, base: Mapping[str, str], redisURL: str) -> None:
        """
        Run C{twistd -n svc-worker} (decisions D13): it claims the
        observations queued in svc-memory, asks the extraction model for
        their memories and stores them, its calls limited and recorded
        through svc-auth as the proxy's are. Started last, so stopped
        first: it hands its claims back to a svc-memory still running.
        """
        settings = self._settings
        environment = {
            **base,
            "SVC_PORT": str(settings.workerPort),
            "SVC_MEMORY_GRPC_ADDR": f"127.0.0.1:{settings.memoryGrpcPort}",
            "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{settings.authGrpcPort}",
            "REDIS_URL": redisURL,
        }
        for name in ("SVC_GRPC_PORT", "POSTGRES_DSN", "SVC_USAGE_JOURNAL"):
            # The worker holds no database connection; a journal is one
            # process's (the proxy's, when the developer names one).
            environment.pop(name, None)
        if self._writtenProviders is not None:
            environment[PROVIDERS_VARIABLE] = str(self._writtenProviders)
        self._startDaemon(
            twistd,
            "svc-worker",
            environment,
            f"http://127.0.0.1:{settings.workerPort}/ready",
        )

    def _providers(self) -> ProviderTable | None:
        """
        The providers file the proxy reads (SVC_PROVIDERS_FILE, or the one
        written for the model server), None without one or when it cannot
        be read (the proxy then says why, and stops).
        """
        environ = self._environ
        if self._writtenProviders is not None:
            environ = {**environ, PROVIDERS_VARIABLE: str(self._writtenProviders)}
        try:
            return providersFromEnvironment(environ, time.time)
        except ConfigError:
            return None

    def _memoryWanted(self) -> bool:
        """
        Whether to run svc-memory: the providers file has a [memory] table
        (decisions D13), and the proxy exists to use it.
        """
        table = self._providers()
        return self.proxyAvailable() and table is not None and table.memory is not None

    @staticmethod
    def proxyAvailable() -> bool:
        return (CHECKOUT / "svcd" / "proxy" / "tap.py").is_file()

    def _startDaemon(
        self, twistd: str, name: str, environment: dict[str, str], readyURL: str
    ) -> None:
        say(f"starting {name}")
        process = subprocess.Popen(  # noqa: S603 - our virtualenv's twistd
            # --pidfile= (empty): two twistd in one directory would
            # otherwise both claim ./twistd.pid, and a stale one after a
            # crash would stop the next start.
            [twistd, "--nodaemon", "--pidfile=", name],
            env=environment,
            cwd=CHECKOUT,
            stdin=subprocess.DEVNULL,
            # A session of its own, so that Ctrl-C reaches only us and the
            # daemons are stopped in order, by down().
            start_new_session=True,
        )
        self._daemons.append(Daemon(name, readyURL, process))
        self._recordProcesses()

    def _waitUntilReady(self) -> None:
        # No proxy from the environment (http_proxy) for our own loopback
        # requests.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def ready(url: str) -> bool:
            try:
                with opener.open(url, timeout=2) as response:
                    return bool(response.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        # The model server was ready once started.
        pending = [
            (daemon, daemon.readyURL) for daemon in self._daemons if daemon.readyURL is not None
        ]
        deadline = time.monotonic() + READY_TIMEOUT
        while pending:
            for daemon, url in list(pending):
                status = daemon.process.poll()
                if status is not None:
                    raise DevStackError(
                        f"{daemon.name} exited with status {status} before it was ready "
                        "(its output is above)"
                    )
                if ready(url):
                    say(f"{daemon.name} is ready")
                    pending.remove((daemon, url))
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"{daemon.name} ({url})" for daemon, url in pending)
                raise DevStackError(f"not ready after {READY_TIMEOUT:.0f} s: {names}")
            if pending:
                time.sleep(0.25)

    # Running and stopping.

    def watch(self, interval: float = 0.5) -> None:
        """
        Return only by an exception: L{ShutdownRequested} from a signal, or
        L{DevStackError} when a daemon or a private server dies.
        """
        while True:
            for daemon in self._daemons:
                status = daemon.process.poll()
                if status is not None:
                    raise DevStackError(f"{daemon.name} exited with status {status}")
            if self._redis is not None and not self._redis.isRunning:
                raise DevStackError(f"Redis exited; see {self._redis.logFile}")
            if self._postgres is not None and not self._postgres.isRunning:
                raise DevStackError(f"PostgreSQL exited; see {self._postgres.logFile}")
            time.sleep(interval)

    def down(self) -> None:
        """
        Stop the daemons (SIGTERM to each, SIGKILL to those still running
        after L{STOP_TIMEOUT} seconds), then the servers we started.
        """
        for daemon in reversed(self._daemons):
            if daemon.process.poll() is None:
                say(f"stopping {daemon.name}")
                daemon.process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT
        for daemon in reversed(self._daemons):
            try:
                daemon.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{daemon.name} did not stop within {STOP_TIMEOUT:.0f} s: killing it")
                daemon.process.kill()
                daemon.process.wait()
        self._daemons.clear()
        if self._redis is not None:
            say("stopping Redis")
            self._redis.stop()
            self._redis = None
        if self._postgres is not None:
            say("stopping PostgreSQL")
            self._postgres.stop()
            self._postgres = None
        self._processRecord.unlink(missing_ok=True)
