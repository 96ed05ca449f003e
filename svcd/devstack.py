"""
The whole gateway on one machine, in the foreground: what C{dev/gateway}
runs.

It starts private PostgreSQL and Redis servers with their data in C{.data/}
of the checkout (unless POSTGRES_DSN or REDIS_URL name servers to use
instead), applies the migrations with C{svcctl migrate}, makes a demo
organization, agent and token once (remembered in C{.data/demo.json}),
runs C{twistd -n svc-auth} and C{twistd -n svc-proxy} as child processes
whose output goes straight to this terminal, waits until both report
ready, and prints curl commands that send a request through the gateway,
plain and streaming.

Without C{SVC_PROVIDERS_FILE} in the environment it also runs the
project's scripted model server (L{svcd.testing.upstream}) on a free
loopback port, writes C{.data/providers.toml} with two models answered by
it, the chat model C{demo} and the embedding model C{demo-embed}
(decisions D13), with a C{[memory]} table naming C{demo-embed}, and gives
that file to svc-proxy alone: the printed commands then get a model's
answer, with usage, vectors, and a memory stored and found, on the first
run. Whenever the providers file has a C{[memory]} table, C{twistd -n
svc-memory} runs too, on the same database, and svc-proxy is given its
address, and so does C{twistd -n svc-worker}, which turns the observations
queued in svc-memory into memories; the demo agent then has recall and
observe on, so that the printed commands tell the gateway a fact and find
it recalled into the next answer. (Observe C{on}, not C{all}: only chats
that name their user, C{X-SVC-Memory-Subject}, are observed, as the
printed commands do; decisions D13 amended, "Whose words".) With
C{SVC_PROVIDERS_FILE} set (even empty: no provider, every chat request
answers 501), svc-proxy gets the variable as it is and no model server
runs. The daemons themselves never assume a providers file (decisions D9).

Ctrl-C, SIGTERM or a closed terminal stops the daemons (SIGTERM, then
SIGKILL after 15 s), the model server and the servers it started, and
exits 0. If one of them dies on its own, everything else is stopped and
the exit status is 1.

No reactor runs here: this process only starts, watches and stops others,
so plain subprocesses and polling keep it simple.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import psycopg
from psycopg import sql

from svcd.common.config import ConfigError
from svcd.common.permissions import parsePermissions
from svcd.providers.table import CHAT, EMBEDDING, ProviderTable, providersFromEnvironment
from svcd.providers.table import VARIABLE as PROVIDERS_VARIABLE
from svcd.testing.servers import PostgresServer, RedisServer, ServerError

# The checkout this module belongs to: dev/gateway runs from there, and
# twistd finds the svc plugins in its twisted/plugins/ even where the
# project is not installed.
CHECKOUT = Path(__file__).resolve().parent.parent

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
DEMO_DATABASE = "svc"

# The model of the providers file written for the scripted model server,
# and the script of svcd/testing/upstream.py's grammar that answers it: a
# normal answer describing the request, with usage.
DEMO_MODEL = "demo"
DEMO_UPSTREAM_MODEL = "echo"
# The embedding model of that file (decisions D13): the scripted server's
# vectors, under which texts that share words are near, of this length.
DEMO_EMBEDDING_MODEL = "demo-embed"
DEMO_EMBEDDING_DIMENSIONS = 64
MODEL_SERVER = "model server"
# The demo token's permissions: those of every route of svc-proxy (chat,
# embeddings, memories; the auth probes need none). A token remembered in
# demo.json without them all is replaced by a new one.
DEMO_PERMISSIONS = "ProxyChatCompletion,ProxyEmbeddings,MemoryRead,MemoryWrite"
# The subject of the printed memory commands (decisions D13).
DEMO_SUBJECT = "demo-user"
# The fact the printed commands tell the gateway and the question that
# recalls it, of a subject of their own, so that the memory stored by the
# commands before them is not recalled too. The scripted extraction keeps
# the user's sentences in the first person; the scripted embeddings make
# texts sharing words ("I", "drink", "morning") near.
DEMO_FACT_SUBJECT = "demo-tea-drinker"
# Why the fact's commands name a subject (decisions D13 amended): printed
# with them.
DEMO_OBSERVE_NOTE = (
    "(observe is on for the demo agent: a chat is remembered only when it names its user"
    " with X-SVC-Memory-Subject, as these do; the hello chats above name none and are not)"
)
DEMO_FACT = "I drink green tea every morning."
DEMO_QUESTION = "What do I drink in the morning?"

# svc-proxy's deadline on its calls to svc-auth here, unless the developer
# sets SVC_AUTH_VALIDATE_TIMEOUT. The daemons' default, 50 ms, is sized for
# a server that does nothing else; the first request of a token is cold in
# svc-auth (a database read and argon2), and on a developer's machine busy
# with an editor, a build or the tests it can take longer, so the first
# command pasted would answer 503 SERVICE_DEGRADED.
VALIDATE_TIMEOUT = "1s"

ENVIRONMENT_HELP = """\
environment variables:
  POSTGRES_DSN         use this PostgreSQL database instead of a private server
  REDIS_URL            use this Redis instead of a private server
  SVC_PROXY_PORT       svc-proxy's HTTP port (default 8080)
  SVC_AUTH_PORT        svc-auth's HTTP port for /health, /ready, /metrics (default 8081)
  SVC_AUTH_GRPC_PORT   svc-auth's gRPC port (default 9091)
  SVC_MEMORY_PORT      svc-memory's HTTP port (default 8082), when the
                       providers file has a [memory] table
  SVC_MEMORY_GRPC_PORT svc-memory's gRPC port (default 9092)
  SVC_WORKER_PORT      svc-worker's HTTP port for /health, /ready, /metrics
                       (default 8083); the worker runs beside svc-memory
  SVC_HOST             the address the daemons listen on (default 127.0.0.1)
  SVC_AUTH_VALIDATE_TIMEOUT
                       svc-proxy's deadline on calls to svc-auth (default
                       here 1s: the daemons' 50ms is meant for a server that
                       does nothing else)
  SVC_PROVIDERS_FILE   a providers file: svc-proxy forwards chat requests to
                       its models, and the commands printed at the end use
                       the first one (and its first embedding model, if
                       any). Unset: the scripted model server of the tests
                       answers the models "demo" and "demo-embed"
                       (.data/providers.toml), and memory is on with
                       "demo-embed" (svc-memory and svc-worker run beside
                       the others).
                       With a file of your own, they run when the
                       file has a [memory] table.
                       Set but empty: no provider, chat requests answer 501
  Every other variable is passed on to every daemon (SVC_LOG_FORMAT=text
  for readable logs, SVC_LOG_LEVEL=DEBUG, ...).
"""


class DevStackError(Exception):
    """
    Something went wrong that the developer must fix; shown as one line,
    without a traceback.
    """


class ShutdownRequested(BaseException):
    """
    SIGINT, SIGTERM or SIGHUP arrived. A BaseException, like
    KeyboardInterrupt, so that no C{except Exception} on the way swallows
    it before the stack is stopped.
    """


def _port(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise DevStackError(f"{name} must be a port number from 1 to 65535, got {raw!r}")
    return int(raw)


@attrs.frozen
class Settings:
    """
    What the developer asked for, from the environment and the command line.
    """

    dataDirectory: Path
    proxyPort: int
    authPort: int
    authGrpcPort: int
    memoryPort: int
    memoryGrpcPort: int
    workerPort: int
    postgresDSN: str | None
    redisURL: str | None
    # No SVC_PROVIDERS_FILE at all (an empty one is a choice: no provider).
    scriptedModelServer: bool

    @classmethod
    def fromEnvironment(cls, environ: Mapping[str, str], dataDirectory: Path) -> Settings:
        return cls(
            dataDirectory=dataDirectory,
            proxyPort=_port(environ, "SVC_PROXY_PORT", 8080),
            authPort=_port(environ, "SVC_AUTH_PORT", 8081),
            authGrpcPort=_port(environ, "SVC_AUTH_GRPC_PORT", 9091),
            memoryPort=_port(environ, "SVC_MEMORY_PORT", 8082),
            memoryGrpcPort=_port(environ, "SVC_MEMORY_GRPC_PORT", 9092),
            workerPort=_port(environ, "SVC_WORKER_PORT", 8083),
            postgresDSN=environ.get("POSTGRES_DSN", "").strip() or None,
            redisURL=environ.get("REDIS_URL", "").strip() or None,
            scriptedModelServer=PROVIDERS_VARIABLE not in environ,
        )


@attrs.define
class Daemon:
    """
    A child process (a twistd daemon, the model server) and the URL that
    answers 200 once it is ready, or None when it is ready once started.
    """

    name: str
    readyURL: str | None
    process: subprocess.Popen[bytes]


def say(message: str) -> None:
    """
    A line of our own, told apart from the daemons' output by its prefix.
    """
    print(f"dev/gateway: {message}", file=sys.stderr, flush=True)


def writePrivateJSON(path: Path, document: object) -> None:
    """
    Write C{document} to C{path}, readable by its owner only (it holds a
    token), replacing the old file in one step so a crash never leaves half
    a file.
    """
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as output:
        # The file may have existed with looser permissions.
        os.fchmod(output.fileno(), 0o600)
        json.dump(document, output, indent=2)
        output.write("\n")
    os.replace(temporary, path)


def databaseIdentity(dsn: str) -> str:
    """
    A name for the database behind C{dsn} that stays the same between runs
    and changes when the database is a new one, so that demo.json is not
    believed about a database that never saw its tenant: the cluster's
    system identifier (new at every initdb), the database's name and oid
    (new when it is dropped and made again). A role that may not read the
    system identifier gets host and port in its place.
    """
    with psycopg.connect(dsn, connect_timeout=10, autocommit=True) as connection:
        row = connection.execute(
            "SELECT current_database(), oid::text FROM pg_database"
            " WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        name, oid = row
        try:
            system = connection.execute(
                "SELECT system_identifier::text FROM pg_control_system()"
            ).fetchone()
            cluster = str(system[0]) if system else ""
        except psycopg.Error:
            cluster = f"{connection.info.host}:{connection.info.port}"
    return f"{cluster}/{name}/{oid}"


def _expired(expiresAt: object) -> bool:
    if not isinstance(expiresAt, str) or not expiresAt:
        return False
    try:
        moment = datetime.datetime.fromisoformat(expiresAt)
    except ValueError:
        return False
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    # A minute of margin: a token about to expire is of no use to paste.
    return moment <= datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=1)


def _executableBeside(name: str) -> str | None:
    """
    The console script C{name} of the virtualenv we run in, else on PATH.
    """
    beside = Path(sys.executable).parent / name
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def _commandLine(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _startedCommandLine(pid: int, timeout: float = 5.0) -> list[str] | None:
    """
    The command line of a child we have just started, or None once it has
    exited. Popen returns as soon as the child's exec has closed its
    close-on-exec descriptors, which is before the kernel has set up the
    new program's arguments: /proc then shows an empty command line (most
    of the time, on a busy machine), and a record of that would never match
    in L{stopLeftovers}. So wait, briefly, until there is one.
    """
    deadline = time.monotonic() + timeout
    while True:
        command = _commandLine(pid)
        if command or command is None or time.monotonic() >= deadline:
            return command
        time.sleep(0.01)


def stopLeftovers(record: Path, timeout: float = STOP_TIMEOUT) -> None:
    """
    Stop the processes that an earlier run recorded in C{record} and left
    running because it was killed (SIGKILL, a crash): they would hold the
    ports this run needs. A process counts only if its command line is the
    one recorded, so a reused process id is never signalled.
    """
    try:
        entries = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    survivors = []
    for entry in entries if isinstance(entries, list) else []:
        pid, command = entry.get("pid"), entry.get("command")
        if isinstance(pid, int) and command and _commandLine(pid) == command:
            say(f"stopping {entry.get('name', pid)} left running by an earlier run (pid {pid})")
            os.kill(pid, signal.SIGTERM)
            survivors.append((pid, command))
    deadline = time.monotonic() + timeout
    while survivors and time.monotonic() < deadline:
        time.sleep(0.1)
        survivors = [(pid, command) for pid, command in survivors if _commandLine(pid) == command]
    for pid, _ in survivors:
        os.kill(pid, signal.SIGKILL)
    record.unlink(missing_ok=True)


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
            {"name": name, "pid": pid, "command": _startedCommandLine(pid)}
            for name, pid in children
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
        self._svcctl("migrate", dsn=dsn, show=True)
        demo = self._demoTenant(dsn)
        if settings.scriptedModelServer:
            self._writtenProviders = self._startModelServer()
        if self._memoryWanted():
            self._demoMemorySettings(dsn, demo)
        self._startDaemons(dsn, redisURL)
        self._waitUntilReady()
        self._announce(demo)

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

    def _svcctl(self, *arguments: str, dsn: str, show: bool = False) -> dict[str, Any]:
        """
        Run one svcctl command against C{dsn} and return the JSON object it
        prints. Its stderr goes to the terminal; its stdout is never shown
        unless C{show}, since it may hold a token.
        """
        script = _executableBeside("svcctl")
        command = [script] if script else [sys.executable, "-m", "svcd.ctl"]
        what = "svcctl " + " ".join(arguments[:2])
        try:
            result = subprocess.run(  # noqa: S603 - our own svcctl, arguments we built
                [*command, *arguments],
                env={**self._environ, "POSTGRES_DSN": dsn},
                cwd=CHECKOUT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                timeout=300,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise DevStackError(f"{what} did not finish within 300 s") from None
        if result.returncode != 0:
            raise DevStackError(f"{what} failed with exit status {result.returncode} (see above)")
        try:
            document = json.loads(result.stdout)
        except ValueError:
            raise DevStackError(f"{what} did not print a JSON document") from None
        if not isinstance(document, dict):
            raise DevStackError(f"{what} printed JSON that is not an object")
        if show:
            say(f"{what}: {json.dumps(document, sort_keys=True)}")
        return document

    def _demoTenant(self, dsn: str) -> dict[str, Any]:
        """
        The demo organization, agent and token: made once and remembered in
        demo.json, step by step, so that an interrupted run resumes where it
        stopped instead of making a second organization.
        """
        path = self._settings.dataDirectory / "demo.json"
        identity = databaseIdentity(dsn)
        demo: dict[str, Any] = {}
        if path.exists():
            try:
                demo = json.loads(path.read_text())
            except ValueError:
                demo = {}
            if demo.get("database") != identity:
                say(f"{path} is about another database; making a new demo tenant")
                demo = {}
        demo["database"] = identity

        def field(document: Mapping[str, Any], key: str) -> str:
            value = document.get(key)
            if not isinstance(value, str) or not value:
                raise DevStackError(f"svcctl's answer lacks {key!r}")
            return value

        if "org_id" not in demo:
            created = self._svcctl("org", "create", "--name", "demo", dsn=dsn)
            demo["org_id"] = field(created, "org_id")
            writePrivateJSON(path, demo)
            say(f"created the demo organization {demo['org_id']}")
        if "agent_id" not in demo:
            created = self._svcctl(
                "agent", "create", "--org", demo["org_id"], "--name", "demo-agent", dsn=dsn
            )
            demo["agent_id"] = field(created, "agent_id")
            writePrivateJSON(path, demo)
            say(f"created the demo agent {demo['agent_id']}")
        wanted = parsePermissions(DEMO_PERMISSIONS)
        if (
            "token" not in demo
            or _expired(demo.get("expires_at"))
            or demo.get("permissions") != wanted
        ):
            created = self._svcctl(
                "token",
                "create",
                "--org",
                demo["org_id"],
                "--agent",
                demo["agent_id"],
                "--name",
                "demo",
                "--permissions",
                DEMO_PERMISSIONS,
                dsn=dsn,
            )
            replaced = demo.get("token_id") if "token" in demo else None
            demo["token"] = field(created, "token")
            demo["token_id"] = field(created, "token_id")
            demo["expires_at"] = created.get("expires_at")
            demo["permissions"] = created.get("permissions")
            writePrivateJSON(path, demo)
            say(f"created the demo token {demo['token_id']} (saved in {path})")
            if isinstance(replaced, str) and replaced:
                # An older run's token (expired, or without a permission
                # the demo needs now): nobody has it any more.
                try:
                    self._svcctl("token", "revoke", replaced, dsn=dsn)
                except DevStackError as error:
                    say(f"could not revoke the demo token it replaces, {replaced}: {error}")
                else:
                    say(f"revoked the demo token it replaces, {replaced}")
        return demo

    def _demoMemorySettings(self, dsn: str, demo: dict[str, Any]) -> None:
        """
        Turn recall and observe on for the demo agent (decisions D13), so
        that what the printed commands tell the gateway becomes a memory
        and comes back in the next answer. Once per demo tenant, noted in
        demo.json: a developer who turns them off with C{svcctl memory
        settings} afterwards is not overruled at the next run.

        Observe C{on} (decisions D13 amended, "Whose words"), not C{all}:
        the demo shows the setting an agent that serves many users needs,
        under which a chat is observed only when it names its user
        (C{X-SVC-Memory-Subject}); every printed command meant to be
        remembered names one, and the plain C{hello} chats, which name
        none, are answered as usual and not observed. (C{all} would
        observe those too, into the agent's one shared subject: right
        only for an agent that serves one user.) A run of an earlier
        release set the switch on, which sql/0016 made C{on}: the same.
        """
        if demo.get("memory_settings") == "on":
            return
        self._svcctl(
            "memory",
            "settings",
            "--org",
            demo["org_id"],
            "--agent",
            demo["agent_id"],
            "--recall",
            "on",
            "--observe",
            "on",
            dsn=dsn,
        )
        demo["memory_settings"] = "on"
        writePrivateJSON(self._settings.dataDirectory / "demo.json", demo)
        say("turned recall and observe on for the demo agent")

    def _startModelServer(self) -> Path:
        """
        Run the scripted model server of the tests on a free loopback port,
        as a child stopped with the daemons (after svc-proxy, which was
        started after it), and write the providers file that sends the demo
        models (chat and embedding) to it; return the file's path.
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
                "svcd.testing.upstream",
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
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(
            "# Written by dev/gateway at each run without SVC_PROVIDERS_FILE: the\n"
            "# scripted model server of the tests (svcd/testing/upstream.py), which\n"
            "# it runs on a free port, answers the model below. To forward to your\n"
            "# own models, write a file like etc/svc/providers.toml and run\n"
            "# SVC_PROVIDERS_FILE=that-file dev/gateway.\n"
            "\n"
            "[[providers]]\n"
            'name = "scripted"\n'
            f'base_url = "http://127.0.0.1:{port}/v1"\n'
            "\n"
            "[[models]]\n"
            f'name = "{DEMO_MODEL}"\n'
            'provider = "scripted"\n'
            f'upstream_model = "{DEMO_UPSTREAM_MODEL}"   # an answer that describes the request\n'
            "\n"
            "[[models]]\n"
            f'name = "{DEMO_EMBEDDING_MODEL}"\n'
            'provider = "scripted"\n'
            f'upstream_model = "{DEMO_UPSTREAM_MODEL}"   # vectors near for texts sharing words\n'
            'kind = "embedding"\n'
            f"dimensions = {DEMO_EMBEDDING_DIMENSIONS}\n"
            "\n"
            "# Memory (decisions D13): svc-memory and svc-worker run beside the\n"
            "# others; the proxy and the worker embed memories and queries with\n"
            "# the embedding model, and the worker asks the chat model for the\n"
            "# memories an exchange holds (the scripted server answers with the\n"
            "# user's sentences that say something of the user).\n"
            "[memory]\n"
            f'embedding_model = "{DEMO_EMBEDDING_MODEL}"\n'
            f'extraction_model = "{DEMO_MODEL}"\n'
        )
        os.replace(temporary, path)
        say(
            f"model server: the scripted one of the tests on 127.0.0.1:{port} answers the models "
            f'"{DEMO_MODEL}" and "{DEMO_EMBEDDING_MODEL}" (providers file {path};'
            " SVC_PROVIDERS_FILE names your own)"
        )
        return path

    def _startDaemons(self, dsn: str, redisURL: str) -> None:
        settings = self._settings
        twistd = _executableBeside("twistd")
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

    def _announce(self, demo: Mapping[str, Any]) -> None:
        settings = self._settings
        proxy = f"http://127.0.0.1:{settings.proxyPort}"
        lines = [
            "",
            "svc gateway is running:",
            f"  svc-auth   http://127.0.0.1:{settings.authPort}  (gRPC 127.0.0.1:"
            f"{settings.authGrpcPort})",
        ]
        if self.proxyAvailable():
            lines.append(f"  svc-proxy  {proxy}")
        model, embeddingModel = self._demoModels(str(demo["org_id"]))
        headers = (
            f' -H "Authorization: Bearer {demo["token"]}"'
            f' -H "X-SVC-Agent-ID: {demo["agent_id"]}"'
            ' -H "Content-Type: application/json"'
        )
        body = '{"model":"%s",%s"messages":[{"role":"user","content":"hello"}]}'
        lines += [
            f"  demo organization {demo['org_id']}, agent {demo['agent_id']}",
            "",
            "Send a request through the gateway:"
            if model is not None
            else "Send a request through the gateway (svc-proxy has no model for the demo"
            " organization: it answers 501 PROVIDER_NOT_CONFIGURED):",
            "",
            f"  curl -i {proxy}/v1/chat/completions{headers}"
            f" -d '{body % (model or DEMO_MODEL, '')}'",
        ]
        if model is not None:
            # Usage is relayed on a stream only when the client asks (D9).
            streaming = '"stream":true,"stream_options":{"include_usage":true},'
            lines += [
                "",
                f"Stream the answer of {model} (its usage comes last):",
                "",
                f"  curl -N {proxy}/v1/chat/completions{headers} -d '{body % (model, streaming)}'",
            ]
        if embeddingModel is not None:
            # Decisions D13: the embeddings route, with two texts.
            texts = '{"model":"%s","input":["the cat sat on the mat","the cat ran"]}'
            lines += [
                "",
                f"Embed two texts with {embeddingModel} (one vector each, its usage last):",
                "",
                f"  curl -i {proxy}/v1/embeddings{headers} -d '{texts % embeddingModel}'",
            ]
        if embeddingModel is not None and self._memoryWanted():
            # Decisions D13: a memory told, then found.
            subject = f' -H "X-SVC-Memory-Subject: {DEMO_SUBJECT}"'
            told = '{"content":"The user likes green tea in the morning."}'
            asked = '{"query":"What does the user drink in the morning?","k":3}'
            lines += [
                "",
                "Store a memory about a user of the demo agent, then search for it:",
                "",
                f"  curl -i {proxy}/v1/memories{headers}{subject} -d '{told}'",
                f"  curl -i {proxy}/v1/memories/search{headers}{subject} -d '{asked}'",
            ]
        if model is not None and embeddingModel is not None and self._memoryWanted():
            # Decisions D13: a fact told in a conversation, queued for
            # svc-worker (which asks the extraction model for its memories),
            # then recalled into a chat completion (X-SVC-Memories: how
            # many), then listed.
            subject = f' -H "X-SVC-Memory-Subject: {DEMO_FACT_SUBJECT}"'
            compact = (",", ":")
            told = json.dumps(
                {"messages": [{"role": "user", "content": DEMO_FACT}]}, separators=compact
            )
            asked = json.dumps(
                {"model": model, "messages": [{"role": "user", "content": DEMO_QUESTION}]},
                separators=compact,
            )
            lines += [
                "",
                "Tell the gateway a fact (svc-worker makes a memory of it within a second or so),",
                "ask about it (X-SVC-Memories: 1, the memory recalled into the prompt),"
                " then list the memories:",
                DEMO_OBSERVE_NOTE,
                "",
                f"  curl -i {proxy}/v1/memories{headers}{subject} -d '{told}'",
                f"  curl -i {proxy}/v1/chat/completions{headers}{subject} -d '{asked}'",
                f"  curl {proxy}/v1/memories{headers}{subject}",
            ]
        if model is not None:
            lines += ["", 'With the openai Python SDK: README.rst, "Quick start".']
        lines += ["", "Ctrl-C stops everything.", ""]
        print("\n".join(lines), flush=True)

    def _demoModels(self, orgID: str) -> tuple[str | None, str | None]:
        """
        The first chat model and the first embedding model (decisions D13)
        of the providers file (SVC_PROVIDERS_FILE, or the one written for
        the model server) the demo organization may use, each None without
        one (a chat request then answers 501; no embeddings command is
        printed).
        """
        table = self._providers()
        if table is None:
            return None, None
        models = table.modelsFor(orgID)
        chat = next((model.name for model in models if model.kind == CHAT), None)
        embedding = next((model.name for model in models if model.kind == EMBEDDING), None)
        return chat, embedding

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


def _requestShutdown(signum: int, frame: FrameType | None) -> None:
    raise ShutdownRequested(signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dev/gateway",
        description="Run svc-auth and svc-proxy locally with private PostgreSQL and Redis.",
        epilog=ENVIRONMENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--data-directory",
        type=Path,
        default=CHECKOUT / ".data",
        help="where the private servers and demo.json live (default: .data of the checkout)",
    )
    options = parser.parse_args(argv)
    try:
        settings = Settings.fromEnvironment(os.environ, options.data_directory.absolute())
    except DevStackError as error:
        say(str(error))
        return 2

    stack = DevStack(settings, os.environ)
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for signum in signals:
        signal.signal(signum, _requestShutdown)
    status = 0
    try:
        stack.up()
        stack.watch()
    except ShutdownRequested:
        say("stopping")
    except (DevStackError, ServerError) as error:
        say(str(error))
        status = 1
    finally:
        # The stop is bounded; a second Ctrl-C must not cut it short and
        # leave servers running.
        for signum in signals:
            signal.signal(signum, signal.SIG_IGN)
        stack.down()
    return status


if __name__ == "__main__":
    sys.exit(main())
