"""
What a request leaves to the cycle collector, in the real daemons (issue
24 item 3): a finished request must be freed by reference counting, not
wait in a reference cycle for the collector, whose pause would land on
the requests in flight.

The gateway is real (`twistd -n svc-auth`, `twistd -n svc-proxy`,
PostgreSQL, Redis, a scripted upstream) and so is the bench's floor, a
bare Klein handler answering the same 501 (bench/floor.py); each process
runs with tests/gcprobe/ first on its PYTHONPATH, whose C{sitecustomize}
has the collector save what it finds (C{gc.DEBUG_SAVEALL}) and count it
on SIGUSR2. A few hundred requests of one kind on one keep-alive
connection, between two counts, give the objects per request the
collector had to free; the floor's, measured in the same test, is the
bound: Klein's own rendering leaves a request in a cycle (twisted/klein
pull request 101), so the floor's figure is what a request costs the
collector when it is left there.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from authfixtures import Tenant
from gatewayfixtures import Gateway, runningGateway
from prometheus_client.parser import text_string_to_metric_families

from svcd.auth.authority import issueToken
from svcd.common.pat import formatToken, newSecret
from svcd.common.permissions import Permission
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import ScriptedUpstream

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("gcprobe")
FLOOR = ROOT / "bench" / "floor.py"

# Requests per measured window, and before it (connections, caches).
REQUESTS = 300
WARMUP = 30

CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"


def probeEnvironment(directory: Path) -> dict[str, str]:
    """
    The variables that put the probe in a process (tests/gcprobe).
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = [str(PROBE), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), "SVC_GC_PROBE_DIR": str(directory)}


@attrs.define
class Probed:
    """
    A process with the probe, and the port it answers HTTP on.
    """

    pid: int
    port: int
    directory: Path
    windows: int = 0

    def window(self, timeout: float = 30.0) -> dict[str, Any]:
        """
        Close the probe's current window: what the collector found since
        the last one (see tests/gcprobe/sitecustomize.py).
        """
        self.windows += 1
        written = self.directory / f"window-{self.windows}.json"
        os.kill(self.pid, signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while not written.exists():
            assert time.monotonic() < deadline, f"no {written.name} within {timeout} s"
            time.sleep(0.02)
        found: dict[str, Any] = json.loads(written.read_text())
        return found

    def perRequest(
        self, path: str, headers: dict[str, str], body: bytes, expected: int
    ) -> tuple[float, dict[str, Any]]:
        """
        The objects per request the collector found over L{REQUESTS}
        requests, and the window itself.
        """
        _send(self.port, path, headers, body, expected, WARMUP)
        self.window()
        _send(self.port, path, headers, body, expected, REQUESTS)
        found = self.window()
        return found["objects"] / REQUESTS, found


def _send(
    port: int, path: str, headers: dict[str, str], body: bytes, expected: int, count: int
) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for _ in range(count):
            connection.request("POST", path, body=body, headers=headers)
            answer = connection.getresponse()
            content = answer.read()
            assert answer.status == expected, (answer.status, content[:500])
    finally:
        connection.close()


def _chatBody(model: str, stream: bool = False) -> bytes:
    document: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        document["stream"] = True
    return json.dumps(document).encode()


def _embeddingsBody() -> bytes:
    return json.dumps({"model": "embedded", "input": ["hi", "hello there"]}).encode()


def _providersFile(path: Path, upstream: ScriptedUpstream) -> Path:
    path.write_text(
        f"""
[[providers]]
name = "local"
base_url = {json.dumps(upstream.baseURL)}

[[models]]
name = "forwarded"
provider = "local"
upstream_model = "echo"

[[models]]
name = "embedded"
provider = "local"
upstream_model = "echo"
kind = "embedding"
"""
    )
    return path


@attrs.frozen
class Measured:
    gateway: Gateway
    proxy: Probed
    floor: Probed
    tenant: Tenant
    # Tokens of the main and other tenants with ProxyEmbeddings too.
    embeddingTokens: dict[str, str]

    def headers(
        self, wrongSecret: bool = False, tokenLimited: bool = False, embeddings: bool = False
    ) -> dict[str, str]:
        tenant = self.gateway.tenants["other"] if tokenLimited else self.tenant
        token = tenant.token
        if embeddings:
            token = self.embeddingTokens["other" if tokenLimited else "main"]
        if wrongSecret:
            token = formatToken(tenant.tokenID, newSecret())
        return {
            "Authorization": f"Bearer {token}",
            "X-SVC-Agent-ID": str(tenant.agentID),
            "Content-Type": "application/json",
        }


@pytest.fixture(scope="module")
def measured(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Measured]:
    workdir = tmp_path_factory.mktemp("gccycles")
    upstream = ScriptedUpstream(workdir / "upstream").start()
    floorPort = freePort()
    floor = subprocess.Popen(
        [sys.executable, str(FLOOR), str(floorPort)],
        env={**os.environ, **probeEnvironment(workdir / "probe-floor")},
    )
    try:
        _waitForPort(floor, floorPort)
        with runningGateway(
            postgresServer,
            workdir,
            proxyEnvironment={
                "SVC_RATE_LIMIT_DEFAULT_RPM": "1000000",
                "SVC_AUTH_VALIDATE_TIMEOUT": "5s",
                "SVC_PROVIDERS_FILE": str(_providersFile(workdir / "providers.toml", upstream)),
                **probeEnvironment(workdir / "probe-proxy"),
            },
        ) as gateway:
            assert gateway.proxy.process is not None
            embeddingTokens = {
                name: issueToken(
                    gateway.owner,
                    orgID=gateway.tenants[name].orgID,
                    permissions=Permission.ProxyChatCompletion | Permission.ProxyEmbeddings,
                )[0]
                for name in ("main", "other")
            }
            _limitTokens(gateway)
            yield Measured(
                gateway,
                Probed(gateway.proxy.process.pid, gateway.port, workdir / "probe-proxy"),
                Probed(floor.pid, floorPort, workdir / "probe-floor"),
                gateway.tenants["main"],
                embeddingTokens,
            )
    finally:
        floor.terminate()
        floor.wait(10)
        upstream.stop()


def _limitTokens(gateway: Gateway, timeout: float = 30.0) -> None:
    """
    Give the "other" tenant's organization a token limit no test reaches
    (decisions D11), so that its forwarded requests reserve and settle
    tokens, and wait until the proxy applies it.
    """
    other = gateway.tenants["other"]
    gateway.owner.setLimits(other.orgID, None, {"tpm": 1_000_000_000})
    headers = {
        "Authorization": f"Bearer {other.token}",
        "X-SVC-Agent-ID": str(other.agentID),
        "Content-Type": "application/json",
    }
    deadline = time.monotonic() + timeout
    while True:
        connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
        try:
            connection.request("POST", CHAT, body=_chatBody("forwarded"), headers=headers)
            answer = connection.getresponse()
            answer.read()
        finally:
            connection.close()
        if answer.getheader("X-RateLimit-Limit-Tokens") is not None:
            return
        assert time.monotonic() < deadline, "the proxy did not apply the token limit"
        time.sleep(0.1)


def _waitForPort(process: subprocess.Popen[bytes], port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
            return
        except OSError:
            assert process.poll() is None, "bench/floor.py exited"
            assert time.monotonic() < deadline, "bench/floor.py did not listen"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def floorPerRequest(measured: Measured) -> float:
    """
    What a request to the bare Klein handler leaves the collector.
    """
    perRequest, _ = measured.floor.perRequest(
        CHAT, {"Content-Type": "application/json"}, _chatBody("demo"), 501
    )
    # Klein's own cycle holds each request: tens of objects each.
    assert perRequest > 10
    return perRequest


@pytest.mark.parametrize(
    ("body", "variant", "expected"),
    [
        pytest.param(_chatBody("demo"), "", 501, id="501"),
        pytest.param(_embeddingsBody(), "embeddings", 200, id="embed"),
        pytest.param(_embeddingsBody(), "embeddings tokenLimited", 200, id="embed-tokens"),
        pytest.param(_chatBody("forwarded"), "", 200, id="forward"),
        pytest.param(_chatBody("forwarded", stream=True), "", 200, id="stream"),
        pytest.param(_chatBody("forwarded"), "tokenLimited", 200, id="forward-tokens"),
        pytest.param(_chatBody("forwarded", stream=True), "tokenLimited", 200, id="stream-tokens"),
        pytest.param(_chatBody("demo"), "wrongSecret", 401, id="rejected"),
    ],
)
def test_requestsLeaveNothingToTheCollector(
    measured: Measured, floorPerRequest: float, body: bytes, variant: str, expected: int
) -> None:
    """
    A chat request answered 501, forwarded, relayed as a stream (also with
    a token limit, whose reservation each settles), or refused by svc-auth
    (a wrong secret), and an embeddings request forwarded (decisions D13;
    also with a token limit) leave the collector nothing: the window finds fewer
    objects than it had requests (a request in a cycle would leave at least
    one; a quiet daemon's windows find none at all), and so far fewer than
    the bare Klein handler's requests leave.
    """
    headers = measured.headers(
        wrongSecret="wrongSecret" in variant,
        tokenLimited="tokenLimited" in variant,
        embeddings="embeddings" in variant,
    )
    path = EMBEDDINGS if "embeddings" in variant else CHAT
    perRequest, found = measured.proxy.perRequest(path, headers, body, expected)
    assert found["objects"] < REQUESTS, (perRequest, floorPerRequest, found)
    assert perRequest <= floorPerRequest, (perRequest, floorPerRequest, found)


def _pauseCounts(text: str) -> dict[str, float]:
    counts = {}
    for family in text_string_to_metric_families(text):
        if family.name == "svc_python_gc_pause_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    counts[sample.labels["generation"]] = sample.value
    return counts


def test_bothDaemonsExportPauses(measured: Measured) -> None:
    """
    Both daemons publish the collector's pauses by generation on /metrics;
    the full collection each did while settling its heap at start is
    there.
    """
    for daemon in (measured.gateway.proxy, measured.gateway.auth):
        status, body = daemon.get("/metrics")
        assert status == 200
        counts = _pauseCounts(body.decode())
        assert set(counts) == {"0", "1", "2"}
        assert counts["2"] >= 1
