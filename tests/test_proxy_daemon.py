"""
C{twistd -n svc-proxy} as a real process: it starts, answers /health and
/ready (503 while svc-auth is unreachable), writes JSON log lines, stops on
SIGTERM with status 0, and refuses a bad configuration or a taken port with
one line and status 1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from svcd.devkit.daemons import Daemon, twistdCommand
from svcd.devkit.servers import freePort
from svcd.pb.auth.v1 import auth_pb2_grpc

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
# About twistd's own start: its daemons are new interpreters (forkedtwistd.py).
pytestmark = [pytest.mark.e2e, pytest.mark.freshinterpreter]


def proxyEnvironment(**overrides: str) -> dict[str, str]:
    return {
        "SVC_AUTH_GRPC_ADDR": "127.0.0.1:1",
        "SVC_HOST": "127.0.0.1",
        "SVC_PORT": str(freePort()),
        "SVC_SHUTDOWN_TIMEOUT": "2s",
        # svc-auth is unreachable on purpose: listen without waiting for it.
        "SVC_START_TIMEOUT": "100ms",
        **overrides,
    }


def runToCompletion(environment: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    variables = {
        name: value for name, value in os.environ.items() if not name.startswith(("SVC_", "REDIS"))
    }
    return subprocess.run(
        twistdCommand("svc-proxy"),
        env={**variables, **environment},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        check=False,
    )


def test_servesAndStops(tmp_path: Path) -> None:
    """
    The daemon answers /health 200 and /ready 503 (auth unreachable, Redis
    not configured), logs JSON lines, and exits 0 on SIGTERM.
    """
    daemon = Daemon("svc-proxy", proxyEnvironment(), tmp_path / "proxy.log").start()
    try:
        daemon.waitForHealth()
        status, body = daemon.get("/health")
        assert (status, json.loads(body)) == (200, {"status": "ok", "checks": {}})
        status, body = daemon.get("/ready")
        report = json.loads(body)
        assert status == 503
        assert report["status"] == "unhealthy"
        assert report["checks"]["auth_grpc"]["status"] == "failed"
        assert report["checks"]["redis"]["message"] == "REDIS_URL is not configured"
        status, body = daemon.get("/v1/internal/auth-probe")
        assert (status, json.loads(body)["error"]["code"]) == (401, "MISSING_TOKEN")
    finally:
        assert daemon.terminate() == 0
    lines = [json.loads(line) for line in daemon.output().splitlines() if line.strip()]
    messages = [line["message"] for line in lines]
    assert "GET /health 200" in messages
    assert "svc-proxy stopped" in messages
    assert all({"timestamp", "level", "namespace", "message"} <= set(line) for line in lines)


def test_missingAuthAddress(tmp_path: Path) -> None:
    """
    Without SVC_AUTH_GRPC_ADDR the daemon refuses to start: one line on
    stderr naming the variable, no traceback, status 1.
    """
    environment = proxyEnvironment()
    del environment["SVC_AUTH_GRPC_ADDR"]
    result = runToCompletion(environment, tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        "svc-proxy: configuration error: SVC_AUTH_GRPC_ADDR: is required and not set\n"
    )
    assert "Traceback" not in result.stdout


def test_badOverride(tmp_path: Path) -> None:
    """
    A malformed SVC_RATE_LIMIT_ORG_OVERRIDES entry stops the daemon with one
    line naming the variable.
    """
    result = runToCompletion(proxyEnvironment(SVC_RATE_LIMIT_ORG_OVERRIDES="acme=10"), tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("svc-proxy: configuration error: SVC_RATE_LIMIT_ORG_OVERRIDES:")
    assert result.stderr.count("\n") == 1


def _providersFile(directory: Path, providerLines: str, modelLines: str) -> Path:
    path = directory / "providers.toml"
    path.write_text(
        '[[providers]]\nname = "local"\nbase_url = "http://127.0.0.1:8000/v1"\n'
        f'{providerLines}\n[[models]]\nname = "fast"\n{modelLines}\n'
    )
    return path


def test_badProvidersFile(tmp_path: Path) -> None:
    """
    A providers file whose model names an undefined provider stops the
    daemon before it listens: exactly one line naming the variable, the
    file and the fault, no traceback, status 1.
    """
    providers = _providersFile(tmp_path, "", 'provider = "nope"')
    result = runToCompletion(proxyEnvironment(SVC_PROVIDERS_FILE=str(providers)), tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        f"svc-proxy: configuration error: SVC_PROVIDERS_FILE: {providers}: "
        'model "fast": provider "nope" is not defined\n'
    )
    assert "Traceback" not in result.stdout


def test_providersKeyUnset(tmp_path: Path) -> None:
    """
    A provider whose api_key_env names a variable that is not set stops
    the daemon with one line naming the file, the provider and the
    variable, status 1.
    """
    providers = _providersFile(
        tmp_path, 'api_key_env = "SVC_TEST_PROVIDER_KEY"', 'provider = "local"'
    )
    result = runToCompletion(proxyEnvironment(SVC_PROVIDERS_FILE=str(providers)), tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        f"svc-proxy: configuration error: SVC_PROVIDERS_FILE: {providers}: "
        'provider "local": api_key_env: SVC_TEST_PROVIDER_KEY is not set in the environment\n'
    )
    assert "Traceback" not in result.stdout


def test_exampleProvidersFile(tmp_path: Path) -> None:
    """
    With the example providers file and its key set, the daemon starts and
    serves, and its output never holds the key.
    """
    key = "sk-example-key-never-logged"
    environment = proxyEnvironment(
        SVC_PROVIDERS_FILE=str(Path(__file__).resolve().parents[1] / "etc/svc/providers.toml"),
        OPENAI_API_KEY=key,
        SVC_LOG_LEVEL="debug",
    )
    daemon = Daemon("svc-proxy", environment, tmp_path / "proxy.log").start()
    try:
        daemon.waitForHealth()
    finally:
        assert daemon.terminate() == 0
    assert key not in daemon.output()


def test_portTaken(tmp_path: Path) -> None:
    """
    A port that is already taken is one line and status 1.
    """
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runToCompletion(proxyEnvironment(SVC_PORT=str(port)), tmp_path)
    assert result.returncode == 1
    assert "svc-proxy: cannot start:" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_workersShareThePort(tmp_path: Path) -> None:
    """
    With SVC_REUSE_PORT=true two svc-proxy processes listen on one port and
    the kernel gives each a share of new connections; a third process
    without it cannot bind the port (one line, status 1).
    """
    shared = proxyEnvironment(SVC_REUSE_PORT="true")
    workers = [
        Daemon("svc-proxy", shared, tmp_path / f"proxy-{number}.log").start() for number in (1, 2)
    ]
    try:
        for worker in workers:
            worker.waitForHealth()
        # Each worker logs when it listens; wait until both do, since a
        # health check through the shared port may reach either one.
        deadline = time.monotonic() + 20
        while not all('"svc-proxy listening' in worker.output() for worker in workers):
            assert time.monotonic() < deadline, [worker.output() for worker in workers]
            time.sleep(0.05)
        for _ in range(100):
            # A new connection each time: the kernel picks a listener per
            # connection, by a hash of its addresses and ports.
            with urllib.request.urlopen(workers[0].url("/health"), timeout=5) as answer:
                assert answer.status == 200
        alone = runToCompletion({**shared, "SVC_REUSE_PORT": "false"}, tmp_path)
        assert alone.returncode == 1
        assert "svc-proxy: cannot start:" in alone.stderr
    finally:
        assert [worker.terminate() for worker in workers] == [0, 0]
    answered = [worker.output().count('"message":"GET /health 200"') for worker in workers]
    assert sum(answered) >= 100
    assert min(answered) > 0, answered


def test_sigintStops(tmp_path: Path) -> None:
    """
    Ctrl-C (SIGINT) stops the daemon cleanly too.

    Started as from a terminal: a process started by a shell's background
    job inherits SIGINT ignored, and twistd rightly leaves it so; the test
    run may be such a job, so the daemon gets SIGINT's default disposition
    (exec turns a handled signal into a default one).
    """
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        daemon = Daemon("svc-proxy", proxyEnvironment(), tmp_path / "proxy.log").start()
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        daemon.waitForHealth()
        daemon.signal(signal.SIGINT)
        assert daemon.process is not None
        assert daemon.process.wait(20) == 0
    finally:
        daemon.terminate()


def test_daemonised(tmp_path: Path, redisURL: str) -> None:
    """
    Daemonised (no -n, with --pidfile and --logfile) the proxy still
    reaches svc-auth over gRPC and Redis after the fork (/ready 200 ok),
    logs JSON lines to its log file, and stops on SIGTERM, removing its
    pidfile.
    """
    servicer = _UnauthenticatedAuth()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    auth_pb2_grpc.add_AuthServiceServicer_to_server(servicer, server)
    grpcPort = server.add_insecure_port("127.0.0.1:0")
    server.start()
    pidFile, logFile = tmp_path / "proxy.pid", tmp_path / "proxy.log"
    environment = proxyEnvironment(SVC_AUTH_GRPC_ADDR=f"127.0.0.1:{grpcPort}", REDIS_URL=redisURL)
    command = [
        sys.executable,
        "-c",
        "from twisted.scripts.twistd import run; run()",
        "--pidfile",
        str(pidFile),
        "--logfile",
        str(logFile),
        "svc-proxy",
    ]
    try:
        variables = {k: v for k, v in os.environ.items() if not k.startswith(("SVC_", "REDIS"))}
        launched = subprocess.run(
            command, env={**variables, **environment}, cwd=tmp_path, timeout=60, check=False
        )
        assert launched.returncode == 0
        url = f"http://127.0.0.1:{environment['SVC_PORT']}/ready"
        deadline = time.monotonic() + 20
        report: dict[str, object] = {}
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:
                    report = json.loads(answer.read())
                    break
            except (OSError, urllib.error.HTTPError):
                time.sleep(0.1)
        assert report.get("status") == "ok", report
        pid = int(pidFile.read_text())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while pidFile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pidFile.exists()
        lines = [json.loads(line) for line in logFile.read_text().splitlines() if line]
        assert "svc-proxy stopped" in [line["message"] for line in lines]
    finally:
        if pidFile.exists():
            os.kill(int(pidFile.read_text()), signal.SIGKILL)
        server.stop(0)


class _UnauthenticatedAuth(auth_pb2_grpc.AuthServiceServicer):
    def ValidateToken(self, request: object, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "not a token")


def test_twistedWithoutAPrivateNameRefusesToStart(tmp_path: Path) -> None:
    """
    Issue 24 item 2: a Twisted that lacks one of the private names the
    edge relies on stops svc-proxy at start with one line naming it, not
    with a mislabelled refusal or a crashed request later. The missing
    name is simulated by a sitecustomize that deletes it before twistd
    imports the proxy.
    """
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text(
        "from twisted.web.http import HTTPChannel\n"
        "del HTTPChannel._respondToBadRequestAndDisconnect\n"
    )
    path = os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH", "")]))
    result = runToCompletion(proxyEnvironment(PYTHONPATH=path), tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("svc-proxy: Twisted "), result.stderr
    assert "lacks HTTPChannel._respondToBadRequestAndDisconnect," in result.stderr
    assert "was tested with (25.5 to 26.10)" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def _listenedAfter(daemon: Daemon) -> float:
    """
    How long the proxy waited before it listened, from its start log (an
    info line, written within a fraction of a second).
    """
    deadline = time.monotonic() + 10
    while True:
        for line in daemon.output().splitlines():
            if '"svc-proxy listening on' in line:
                return float(json.loads(line)["waited_s"])
        assert time.monotonic() < deadline, f"the proxy never listened:\n{daemon.output()}"
        time.sleep(0.05)


def _unauthenticatedServer(port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    auth_pb2_grpc.add_AuthServiceServicer_to_server(_UnauthenticatedAuth(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, bound


def test_listensOnlyOnceSvcAuthAnswers(tmp_path: Path) -> None:
    """
    Issue 25, point 3: a proxy whose svc-auth is not up yet does not
    listen (a new connection is refused, and systemd is not told it is
    ready); once svc-auth answers, it listens, tells systemd (READY=1, for
    a unit of Type=notify) and logs how long it waited.
    """
    grpcPort = freePort()
    notifyPath = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notifyPath))
        notify.settimeout(30)
        environment = proxyEnvironment(
            SVC_AUTH_GRPC_ADDR=f"127.0.0.1:{grpcPort}",
            SVC_START_TIMEOUT="60s",
            NOTIFY_SOCKET=str(notifyPath),
        )
        daemon = Daemon("svc-proxy", environment, tmp_path / "proxy.log").start()
        server = None
        try:
            # Logged as the service starts, before it would listen.
            deadline = time.monotonic() + 30
            while "rate limiting is off" not in daemon.output():
                assert time.monotonic() < deadline, daemon.output()
                time.sleep(0.05)
            began = time.monotonic()
            while time.monotonic() - began < 1.0:
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(("127.0.0.1", daemon.httpPort), timeout=1).close()
                time.sleep(0.1)
            server, _ = _unauthenticatedServer(grpcPort)
            assert notify.recv(100) == b"READY=1"
            assert daemon.get("/health")[0] == 200
            assert _listenedAfter(daemon) >= 1.0
        finally:
            assert daemon.terminate() == 0
            if server is not None:
                server.stop(0)
    assert "still waits" not in daemon.output()


def test_startsWithoutRedisAfterTheStartTimeout(tmp_path: Path) -> None:
    """
    Issue 25, point 3: a worker that cannot reach Redis still starts once
    SVC_START_TIMEOUT has passed, logging what it was waiting for; it then
    serves as before (rate limits fail open).
    """
    server, grpcPort = _unauthenticatedServer()
    environment = proxyEnvironment(
        SVC_AUTH_GRPC_ADDR=f"127.0.0.1:{grpcPort}",
        REDIS_URL=f"redis://127.0.0.1:{freePort()}/0",
        SVC_START_TIMEOUT="1s",
    )
    daemon = Daemon("svc-proxy", environment, tmp_path / "proxy.log").start()
    try:
        daemon.waitForHealth()
        assert 1.0 <= _listenedAfter(daemon) < 5.0
        # It serves as before: /ready fails on Redis alone once the channel
        # to svc-auth is up (on a loaded machine, that may take a moment).
        deadline = time.monotonic() + 20
        while True:
            status, body = daemon.get("/ready")
            checks = json.loads(body)["checks"]
            if checks["auth_grpc"]["status"] == "ok":
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.1)
        assert status == 503 and checks["redis"]["status"] == "failed"
    finally:
        assert daemon.terminate() == 0
        server.stop(0)
    waited = [
        json.loads(line)["message"]
        for line in daemon.output().splitlines()
        if "still waits" in line
    ]
    # Redis, and perhaps more on a loaded machine, named once.
    assert len(waited) == 1, waited
    assert waited[0].startswith("svc-proxy still waits for "), waited
    assert waited[0].endswith(
        "Redis after 1.0 s; listening anyway: auth fails closed (503) until svc-auth"
        " answers, rate limits fail open until Redis does"
    ), waited
