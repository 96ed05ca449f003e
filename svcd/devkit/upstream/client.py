"""
The scripted model server from the outside: L{ScriptedUpstream} runs it
as a child process and reads its control port (the request log, the
connection counts), for the tests, the benchmarks and C{dev/gateway}; and
L{memoryProvidersFile}, a providers file of its models for memory.
"""

# Runs the server as a child process with an argument list we build, and
# talks HTTP to it on loopback only.
# ruff: noqa: S603, S310

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import attrs

from svcd.devkit.daemons import DaemonProcess
from svcd.devkit.upstream import LOOPBACK

# How long ScriptedUpstream waits for the process to listen, and to stop.
# Generous: a loaded machine can take seconds to import Twisted.
DEFAULT_START_TIMEOUT = 60.0
DEFAULT_STOP_TIMEOUT = 10.0


@attrs.frozen
class RecordedRequest:
    """
    One entry of the scripted upstream's request log (the package's
    manual says what each field holds).
    """

    number: int
    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: Any
    bodyText: str | None
    bodyLength: int
    clientPort: int | None
    arrived: float
    ended: float | None
    outcome: str | None
    status: int | None
    eventsSent: int

    @classmethod
    def fromJSON(cls, entry: dict[str, Any]) -> RecordedRequest:
        headers = tuple((name, value) for name, value in entry["headers"])
        return cls(**(entry | {"headers": headers}))

    def header(self, name: str) -> str | None:
        """
        The value of header C{name} (any case), the first when repeated, or
        L{None} when the request had none.
        """
        values = self.headerValues(name)
        return values[0] if values else None

    def headerValues(self, name: str) -> list[str]:
        return [value for header, value in self.headers if header == name.lower()]


@attrs.frozen
class ConnectionCounts:
    """
    The API port's TCP connections: open now, and accepted since the start.
    """

    open: int
    accepted: int


class UpstreamError(Exception):
    """
    The scripted upstream could not be started, or did not answer its
    control port; the message says why, with the end of its stderr.
    """


def popen(command: list[str], log: BinaryIO, cwd: Path) -> DaemonProcess:
    """
    Start the server's C{command} as a new process, its stderr on C{log}:
    how L{ScriptedUpstream.start} starts it unless L{launcher} says
    otherwise.
    """
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, cwd=cwd
    )


# How ScriptedUpstream.start starts the server. The test suite replaces it
# (tests/forkedtwistd.py) to fork it from a process that imported Twisted
# once, as it does its daemons.
launcher: Callable[[list[str], BinaryIO, Path], DaemonProcess] = popen

# Scripted upstreams started and not yet stopped, for the exit handler.
_running: set[ScriptedUpstream] = set()


@atexit.register
def _stopEverything() -> None:
    """
    Stop every scripted upstream this process started and did not stop,
    so that an interrupted test run leaves no server behind.
    """
    for upstream in list(_running):
        with contextlib.suppress(Exception):
            upstream.stop()
    _running.clear()


class ScriptedUpstream:
    """
    The scripted upstream run as a child process with the current
    interpreter, and a blocking client of its control port.

    Usage::

        upstream = ScriptedUpstream(tmp_path).start()
        client = openai.OpenAI(base_url=upstream.baseURL, api_key="x")
        ...
        assert upstream.requests()[0].body["model"] == "echo"
        upstream.stop()
    """

    def __init__(
        self,
        baseDirectory: Path | None = None,
        apiKey: str | None = None,
        embeddingDimensions: int | None = None,
    ) -> None:
        """
        @param baseDirectory: where the port file and C{upstream.log} (the
            process's stderr) go; a new temporary directory when L{None}.
        @param apiKey: when given, the key every API request must carry as
            C{Authorization: Bearer <key>} (C{x-api-key: <key>} on
            Anthropic's routes).
        @param embeddingDimensions: the length of embeddings when a request
            names none; L{DEFAULT_EMBEDDING_DIMENSIONS} when L{None}.
        """
        self.embeddingDimensions = embeddingDimensions
        if baseDirectory is None:
            baseDirectory = Path(tempfile.mkdtemp(prefix="scripted-upstream-"))
        self.baseDirectory = Path(os.path.abspath(baseDirectory))
        self.apiKey = apiKey
        self._process: DaemonProcess | None = None
        self._port: int | None = None
        self._controlPort: int | None = None

    @property
    def logFile(self) -> Path:
        return self.baseDirectory / "upstream.log"

    @property
    def _portFile(self) -> Path:
        return self.baseDirectory / "upstream.ports"

    @property
    def port(self) -> int:
        """
        The API port.

        @raise UpstreamError: when the server is not started.
        """
        if self._port is None:
            raise UpstreamError("the scripted upstream is not started")
        return self._port

    @property
    def host(self) -> str:
        return LOOPBACK

    @property
    def baseURL(self) -> str:
        """
        The base URL to configure as a provider's C{base_url}, or to give
        the C{openai} SDK: C{http://127.0.0.1:<port>/v1}.
        """
        return self.baseURLUnder("")

    @property
    def anthropicBaseURL(self) -> str:
        """
        The base URL to give the C{anthropic} SDK, which adds C{/v1} itself:
        C{http://127.0.0.1:<port>}. (A provider's C{base_url} is
        L{baseURL}, with C{/v1}, whatever its C{api}.)
        """
        return f"http://{LOOPBACK}:{self.port}"

    def baseURLUnder(self, prefix: str) -> str:
        """
        A base URL under another prefix on the same server, such as
        C{http://127.0.0.1:<port>/other/v1} for C{prefix="other"}: a second
        provider whose requests the log tells apart by C{path}.
        """
        prefix = prefix.strip("/")
        return f"http://{LOOPBACK}:{self.port}{'/' + prefix if prefix else ''}/v1"

    @property
    def isRunning(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> ScriptedUpstream:
        """
        Start the server and return once it listens.

        @raise UpstreamError: when it exits or writes no port file within
            C{timeout}.
        """
        if self.isRunning:
            return self
        self.baseDirectory.mkdir(parents=True, exist_ok=True)
        self._portFile.unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            "svcd.devkit.upstream",
            "--port",
            "0",
            "--port-file",
            str(self._portFile),
        ]
        if self.apiKey is not None:
            command += ["--api-key", self.apiKey]
        if self.embeddingDimensions is not None:
            command += ["--embedding-dimensions", str(self.embeddingDimensions)]
        with self.logFile.open("ab") as log:
            self._process = launcher(command, log, self.baseDirectory)
        _running.add(self)
        process = self._process
        deadline = time.monotonic() + timeout
        while not self._portFile.exists():
            if process.poll() is not None or time.monotonic() >= deadline:
                self.stop()
                raise UpstreamError(
                    f"the scripted upstream did not start within {timeout:.0f} s; "
                    f"its stderr ({self.logFile}):\n{self.output()}"
                )
            time.sleep(0.02)
        ports = json.loads(self._portFile.read_text())
        self._port, self._controlPort = ports["port"], ports["controlPort"]
        return self

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
        """
        Stop the server (SIGTERM, then SIGKILL after C{timeout}) and wait
        until it has exited.
        """
        _running.discard(self)
        process = self._process
        self._process = None
        self._port = self._controlPort = None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def output(self) -> str:
        """
        What the server wrote on stderr: nothing unless something failed.
        """
        return self.logFile.read_text(errors="replace") if self.logFile.exists() else ""

    def _control(self, method: str, path: str) -> Any:
        if self._controlPort is None:
            raise UpstreamError("the scripted upstream is not started")
        request = urllib.request.Request(
            f"http://{LOOPBACK}:{self._controlPort}{path}", method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=10.0) as answer:
                return json.loads(answer.read())
        except OSError as error:
            raise UpstreamError(f"{method} {path} failed: {error}\n{self.output()}") from error

    def requests(self) -> list[RecordedRequest]:
        """
        Every request the API port received since the start or the last
        L{clearRequests}, oldest first, as they stand now.
        """
        return [
            RecordedRequest.fromJSON(entry) for entry in self._control("GET", "/_upstream/requests")
        ]

    def clearRequests(self) -> None:
        self._control("DELETE", "/_upstream/requests")

    def connections(self) -> ConnectionCounts:
        counts = self._control("GET", "/_upstream/connections")
        return ConnectionCounts(open=counts["open"], accepted=counts["accepted"])

    def waitForRequests(
        self,
        condition: Callable[[list[RecordedRequest]], bool],
        timeout: float = 5.0,
    ) -> list[RecordedRequest]:
        """
        Poll the request log until C{condition} holds for it, and return it.

        @raise AssertionError: when it does not hold within C{timeout}; the
            message shows the log as it last was.
        """
        deadline = time.monotonic() + timeout
        while True:
            requests = self.requests()
            if condition(requests):
                return requests
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"the upstream's request log did not reach the expected state within "
                    f"{timeout} s: {requests}"
                )
            time.sleep(0.02)

    def waitUntilEnded(self, count: int = 1, timeout: float = 5.0) -> list[RecordedRequest]:
        """
        Wait until the log holds at least C{count} requests and every one
        has ended (finished, its client gone, or aborted); return the log.
        """
        return self.waitForRequests(
            lambda requests: (
                len(requests) >= count and all(request.ended is not None for request in requests)
            ),
            timeout,
        )


# The length of memoryProvidersFile's embedding model's vectors: the
# upstream that serves it must be started with it (embeddingDimensions),
# since a vector of another length than the model's declared dimensions is
# the provider's fault (decisions D13 amended).
MEMORY_EMBEDDING_DIMENSIONS = 256

MEMORY_PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[models]]
name = "extractor"
provider = "scripted"
upstream_model = "{extractor}"
price = {{ input = "1.00", output = "2.00" }}

[[models]]
name = "embedder"
provider = "scripted"
upstream_model = "{embedder}"
kind = "embedding"
dimensions = {dimensions}
price = {{ input = "0.02" }}

[memory]
embedding_model = "embedder"
{extraction}
dedupe_score = 0.92
"""


def memoryProvidersFile(
    path: Path,
    upstream: ScriptedUpstream,
    extractor: str = "echo",
    extraction: bool = True,
    embedder: str = "echo",
) -> Path:
    """
    A providers file of priced scripted models for memory (svc-worker's
    tests and bench/worker_drain.py): an embedding model of 256 dimensions
    (L{MEMORY_EMBEDDING_DIMENSIONS}, which C{upstream} must have been
    started with) answering as C{embedder} and, unless C{extraction} is
    false, an extraction model answering as C{extractor} (scripts of this
    package's grammar).

    256 and not fewer: the scripted embedding is a hashed bag of words, and
    the tests' facts share most of their words ("My fact number 0 is
    <id>-0."). In 64 dimensions two such facts of different requests came
    out at or above C{dedupe_score} by hash collisions about once in 5,000
    sets of 16 facts, and the worker rightly merged them, failing a test by
    chance; in 256 the highest similarity in 50,000 sets was 0.87. Such a
    collision is between the two requests' ids, whose words both of a
    request's facts share, so it often merged both facts of one request
    into the other's at once (3 of the 5 pairs of requests that came out
    that near in 30,000 sets of 8 at 64 dimensions, both facts at one
    score): what the earlier failure of test_sigtermFinishesWhatItHolds
    left (both facts of one observation missing, the other's there once).
    """
    path.write_text(
        MEMORY_PROVIDERS.format(
            base=upstream.baseURL,
            dimensions=MEMORY_EMBEDDING_DIMENSIONS,
            extractor=extractor,
            embedder=embedder,
            extraction='extraction_model = "extractor"' if extraction else "",
        )
    )
    return path
