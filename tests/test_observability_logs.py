"""
Structured logging: lines logged while the proxy handles a request carry
its request_id and trace_id even from code that knows neither (the auth
client's and the rate limiter's warnings, logged after a callFromThread or
a timer hop); Python logging records become our lines; svc-auth's HTTP
site logs a structured DEBUG line; the root service stops its children one
at a time; and a daemonised proxy writes JSON lines to its --logfile and
stops on SIGTERM sent through its pid file.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import pytest_twisted
import treq
from prometheus_client import CollectorRegistry
from proxydoubles import MemoryCounters, newToken
from twisted.application.service import Service
from twisted.internet import task
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import deferLater
from twisted.logger import ILogObserver, Logger, LogLevel, globalLogPublisher

from svcd.auth.web import AuthOperationsWeb, OperationsSite
from svcd.authclient.connection import AuthConnection
from svcd.common.logs import (
    REQUEST_ID,
    JSONLinesObserver,
    LineWriter,
    LoggingRootService,
    eventFields,
)
from svcd.common.tracing import TracingConfig, activate, deactivate, tracerProvider
from svcd.devkit.servers import freePort
from svcd.limits.limiter import RedisRateLimiter
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc
from svcd.proxy.config import ProxyConfig
from svcd.proxy.http.edge import ProxyEdge
from svcd.proxy.http.site import ProxySite
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.validation.client import GrpcAuthClient


class CapturedLines:
    """
    What the daemons' JSON observer writes, as parsed objects.
    """

    def __init__(self) -> None:
        self.output = io.StringIO()
        self.observer = JSONLinesObserver(self.output)

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.output.getvalue().splitlines()]


@pytest.fixture
def captured() -> Iterator[CapturedLines]:
    lines = CapturedLines()
    globalLogPublisher.addObserver(lines.observer)
    try:
        yield lines
    finally:
        globalLogPublisher.removeObserver(lines.observer)


# The fields added from context


def test_fieldsFromContext() -> None:
    """
    Inside a request's context a line gains request_id and the current
    span's trace_id; fields the line names itself win; outside, nothing is
    added.
    """
    span = tracerProvider(TracingConfig("t", "development", 0.0)).get_tracer("t").start_span("x")
    traceID = f"{span.get_span_context().trace_id:032x}"
    event = {"log_format": "hello", "log_level": LogLevel.info, "count": 3}
    assert eventFields(event) == {"count": 3}
    scope = REQUEST_ID.set("0190c6a2-0000-7000-8000-000000000001")
    token = activate(span)
    try:
        assert eventFields(event) == {
            "count": 3,
            "request_id": "0190c6a2-0000-7000-8000-000000000001",
            "trace_id": traceID,
        }
        assert eventFields({**event, "request_id": "mine", "trace_id": None}) == {
            "count": 3,
            "request_id": "mine",
            "trace_id": None,
        }
    finally:
        deactivate(token)
        REQUEST_ID.reset(scope)
    assert eventFields(event) == {"count": 3}


class FailingOrSlowAuth(auth_pb2_grpc.AuthServiceServicer):
    """
    ValidateToken fails with INTERNAL for tokens in C{failing}, else both
    calls answer OK.
    """

    def __init__(self) -> None:
        self.failing: set[str] = set()

    def ValidateToken(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.access_token in self.failing:
            context.abort(grpc.StatusCode.INTERNAL, "database unavailable")
        return auth_pb2.ValidateTokenResponse(org_id=str(uuid.uuid4()), permissions=1)

    def ValidateAgent(self, request: Any, context: grpc.ServicerContext) -> Any:
        return auth_pb2.ValidateAgentResponse(
            agent_id=request.agent_id, org_id=request.org_id, status="active"
        )


@pytest_twisted.async_yield_fixture
async def liveProxy() -> Any:
    """
    A proxy edge on a real loopback port with the real gRPC auth client
    (to a scripted grpcio server) and the real limiter over counters whose
    reply can be held back; the limiter's 50 ms budget runs on the reactor.
    """
    from twisted.internet import reactor

    servicer = FailingOrSlowAuth()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    auth_pb2_grpc.add_AuthServiceServicer_to_server(servicer, server)
    grpcPort = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{grpcPort}")
    grpc.channel_ready_future(channel).result(timeout=5)
    metrics = ProxyMetrics()
    provider = tracerProvider(TracingConfig("svc-proxy", "development", 0.0))
    auth = GrpcAuthClient(
        AuthConnection(lambda: channel, IReactorFromThreads(reactor), reactor), 2.0, metrics
    )
    counters = MemoryCounters()
    limiter = RedisRateLimiter(counters, reactor, 60, {}, timeout=0.05)
    edge = ProxyEdge(
        ProxyConfig(authGrpcAddr="unused:1"),
        auth,
        limiter,
        metrics,
        reactor,
        provider.get_tracer("test"),
    )
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
        ProxySite(edge.resource(), 1024 * 1024, reactor)
    )
    try:
        yield servicer, counters, port.getHost().port
    finally:
        await port.stopListening()
        auth.close()
        server.stop(0)


async def probe(port: int, token: str) -> Any:
    headers: dict[bytes | str, bytes | str] = {
        "Authorization": "Bearer " + token,
        "X-SVC-Agent-ID": str(uuid.uuid4()),
    }
    response = await treq.get(f"http://127.0.0.1:{port}/v1/internal/auth-probe", headers=headers)
    await response.content()
    return response


def ids(response: Any) -> tuple[str, str]:
    [requestID] = response.headers.getRawHeaders("X-Request-ID")
    [traceID] = response.headers.getRawHeaders("X-Trace-ID")
    return requestID, traceID


@pytest_twisted.ensureDeferred
async def test_authClientWarningCarriesRequestIDs(liveProxy: Any, captured: CapturedLines) -> None:
    """
    svc-auth failing ValidateToken makes the auth client warn after the
    answer came back through callFromThread; the warning carries the
    request's request_id and trace_id, which the client never saw.
    """
    servicer, _, port = liveProxy
    token = newToken()
    servicer.failing.add(token)
    response = await probe(port, token)
    assert response.code == 503
    requestID, traceID = ids(response)
    [warning] = [line for line in captured.lines() if line["level"] == "warn"]
    assert "ValidateToken to svc-auth failed" in warning["message"]
    assert (warning["request_id"], warning["trace_id"]) == (requestID, traceID)
    assert token not in captured.output.getvalue()


@pytest_twisted.ensureDeferred
async def test_rateLimiterWarningCarriesRequestIDs(liveProxy: Any, captured: CapturedLines) -> None:
    """
    Redis not answering within the limiter's budget (a reactor timer) makes
    the limiter warn and let the request through; the warning carries the
    request's ids, and so does the access line.
    """
    _, counters, port = liveProxy
    counters.reply = Deferred()
    response = await probe(port, newToken())
    assert response.code == 200
    requestID, traceID = ids(response)
    [warning] = [line for line in captured.lines() if line["level"] == "warn"]
    assert "Redis rate-limit counter failed" in warning["message"]
    assert (warning["request_id"], warning["trace_id"]) == (requestID, traceID)
    [access] = [line for line in captured.lines() if line.get("route") and line.get("status")]
    assert (access["request_id"], access["trace_id"]) == (requestID, traceID)
    assert access["message"] == "GET /v1/internal/auth-probe 200"


@pytest_twisted.ensureDeferred
async def test_concurrentRequestsKeepTheirOwnIDs(liveProxy: Any, captured: CapturedLines) -> None:
    """
    Two requests held in flight at once, each warning later: each warning
    carries its own request's ids, not the other's.
    """
    from twisted.internet import defer

    _, counters, port = liveProxy
    counters.reply = Deferred()
    first, second = await defer.gatherResults(
        [
            defer.ensureDeferred(probe(port, newToken())),
            defer.ensureDeferred(probe(port, newToken())),
        ]
    )
    expected = {ids(first), ids(second)}
    accessIDs = {
        (line["request_id"], line["trace_id"]) for line in captured.lines() if line.get("route")
    }
    assert accessIDs == expected
    # The limiter's warning is throttled: one line, for one of the two.
    [warning] = [line for line in captured.lines() if line["level"] == "warn"]
    assert (warning["request_id"], warning["trace_id"]) in expected


# Python logging


@pytest_twisted.ensureDeferred
async def test_stdlibRecordsBecomeLines(captured: CapturedLines) -> None:
    """
    While the root service runs, Python logging records at WARNING and
    above (grpcio's, the OpenTelemetry exporter's) come out as our lines
    with the logger's name as namespace; INFO does not; after stop the
    bridge is gone.
    """
    root = LoggingRootService(captured.observer, level=LogLevel.info)
    root.startService()
    library = logging.getLogger("opentelemetry.exporter.test")
    library.warning("Transient error %s encountered while exporting", "UNAVAILABLE")
    library.info("chatter")
    await root.stopService()
    library.warning("after stop")
    lines = [line for line in captured.lines() if line["namespace"] == library.name]
    assert [(line["level"], line["message"]) for line in lines] == [
        ("warn", "Transient error UNAVAILABLE encountered while exporting")
    ]


# Writing in batches


class FlushCounting(io.StringIO):
    """
    A text file that counts how often it is flushed.
    """

    flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


def test_linesAreWrittenInBatches() -> None:
    """
    Info lines wait in the writer until the oldest of them is C{maxDelay}
    old (checked at the next line) or C{maxBytes} are waiting; a warning
    writes everything waiting at once, in order.
    """
    clock = task.Clock()
    output = FlushCounting()
    writer = LineWriter(output, clock.seconds, maxDelay=0.2, maxBytes=1000)
    observer = JSONLinesObserver(writer)
    log = Logger(namespace="batch", observer=observer)
    log.info("first")
    clock.advance(0.1)
    log.info("second")
    assert output.getvalue() == ""
    clock.advance(0.1)
    log.info("third")
    assert [json.loads(line)["message"] for line in output.getvalue().splitlines()] == [
        "first",
        "second",
        "third",
    ]
    log.info("fourth")
    log.warn("trouble")
    assert [json.loads(line)["message"] for line in output.getvalue().splitlines()][-2:] == [
        "fourth",
        "trouble",
    ]
    flushes = output.flushes
    for _ in range(20):
        log.info("x" * 100)
    assert output.flushes > flushes
    assert len(output.getvalue().splitlines()) >= 5 + 7


@pytest_twisted.ensureDeferred
async def test_rootFlushesTheWriterWhileRunningAndAtStop() -> None:
    """
    The root service writes out what waits every C{maxDelay} seconds, so an
    idle daemon's last line is at most that late, and everything at stop.
    """
    clock = task.Clock()
    output = io.StringIO()
    writer = LineWriter(output, clock.seconds, maxDelay=0.2)
    log = Logger(namespace="batch", observer=JSONLinesObserver(writer))
    root = LoggingRootService(JSONLinesObserver(writer), writer=writer, clock=clock)
    root.startService()
    log.info("while idle")
    assert output.getvalue() == ""
    clock.advance(0.2)
    assert "while idle" in output.getvalue()
    log.info("just before stop")
    await root.stopService()
    assert "just before stop" in output.getvalue()
    assert not clock.getDelayedCalls()


# A signal handler that logs while a line is being written: Twisted's
# SIGTERM handler does ("Received SIGTERM, shutting down."), in the main
# thread, between two bytecodes of whatever it interrupted. Run in a
# process of its own (signal handlers run in the main thread only), whose
# file sends itself SIGUSR1 from inside the write of a warning: the handler
# then logs with every lock of the log path held by the code it
# interrupted.
SIGNAL_WHILE_WRITING = """
import io, json, os, signal, sys
from twisted.logger import Logger
from svcd.common.logs import JSONLinesObserver, LineWriter, TextLinesObserver

class SignalsOnFirstWrite(io.StringIO):
    signalled = False
    def write(self, text):
        written = super().write(text)
        if not self.signalled:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGUSR1)
        return written

output = SignalsOnFirstWrite()
writer = LineWriter(output, maxDelay=0.2)
observer = {"json": JSONLinesObserver, "text": TextLinesObserver}[sys.argv[1]](writer)
log = Logger(namespace="signal", observer=observer)
signal.signal(signal.SIGUSR1, lambda number, frame: log.info("from the handler"))
log.info("before")
log.warn("interrupted")
log.info("after")
writer.flush()
sys.stdout.write(output.getvalue())
"""


@pytest.mark.parametrize("logFormat", ["json", "text"])
def test_aSignalHandlerThatLogsWhileALineIsWrittenDoesNotHang(logFormat: str) -> None:
    """
    The line the handler logs is written after the one it interrupted, and
    nothing waits for itself: a plain lock anywhere on the path made the
    process hang for good (CI saw svc-proxy hang on SIGTERM).
    """
    ran = subprocess.run(
        [sys.executable, "-c", SIGNAL_WHILE_WRITING, logFormat],
        capture_output=True,
        text=True,
        # A bound against the hang this guards against, far above the
        # second the process takes.
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    if logFormat == "json":
        messages = [json.loads(line)["message"] for line in lines]
    else:
        messages = [line.split("] ", 1)[1] for line in lines]
    assert messages == ["before", "interrupted", "from the handler", "after"]


# Stopping in order


class Recorded(Service):
    def __init__(self, name: str, log: list[str], finish: Deferred[None] | None = None) -> None:
        self.name = name
        self._log = log
        self._finish = finish

    def stopService(self) -> Deferred[None]:
        super().stopService()
        name = self.name
        assert name is not None
        self._log.append("stop " + name)
        finished = self._finish if self._finish is not None else succeed(None)
        return finished.addCallback(lambda _: self._log.append("stopped " + name))


@pytest_twisted.ensureDeferred
async def test_rootStopsChildrenOneAtATime(captured: CapturedLines) -> None:
    """
    The last child added stops first, and the next one only once it has
    finished (the HTTP side drains before the pool and the spans' flush);
    a child failing to stop does not stop the others from stopping.
    """
    from twisted.internet import reactor

    log: list[str] = []
    draining: Deferred[None] = Deferred()
    root = LoggingRootService(captured.observer)
    Recorded("tracing", log).setServiceParent(root)
    broken = Recorded("database", log, Deferred())
    broken.setServiceParent(root)
    Recorded("http", log, draining).setServiceParent(root)
    root.startService()
    stopping = root.stopService()
    assert log == ["stop http"]
    reactor.callLater(0.01, draining.callback, None)
    await deferLater(reactor, 0.02, lambda: None)
    assert log == ["stop http", "stopped http", "stop database"]
    assert broken._finish is not None
    broken._finish.errback(RuntimeError("pool would not close"))
    await stopping
    assert log[-2:] == ["stop tracing", "stopped tracing"]
    assert not root.running
    assert any("Stopping Recorded failed" in line["message"] for line in captured.lines())


# svc-auth's HTTP site


@pytest_twisted.ensureDeferred
async def test_operationsSiteLogsStructuredDebugLine(captured: CapturedLines) -> None:
    """
    svc-auth's HTTP site logs one DEBUG line per request with method,
    route, status and duration, an unknown path as "unmatched" (never what
    the client typed), and no Twisted combined-log text.
    """
    from twisted.internet import reactor

    web = AuthOperationsWeb(reactor, [], CollectorRegistry())
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
        OperationsSite(web.app.resource(), reactor=reactor)
    )
    try:
        base = f"http://127.0.0.1:{port.getHost().port}"
        for path in ("/health", "/svc_pat_typed_by_mistake?x=1"):
            response = await treq.get(base + path)
            await response.content()
    finally:
        await port.stopListening()
    lines = [
        line for line in captured.lines() if line["namespace"] == "svcd.auth.web.OperationsSite"
    ]
    assert [(line["level"], line["message"]) for line in lines] == [
        ("debug", "GET /health 200"),
        ("debug", "GET unmatched 404"),
    ]
    assert all(line["duration_ms"] >= 0 for line in lines)
    assert "svc_pat_typed_by_mistake" not in captured.output.getvalue()


# A daemonised proxy


@pytest.mark.e2e
def test_daemonisedProxyLogsJSONToLogfile(tmp_path: Path) -> None:
    """
    `twistd --logfile=... --pidfile=... svc-proxy` (daemonised, no -n)
    writes JSON lines to the file, the access line with request_id and
    trace_id among them, and stops with status 0 on SIGTERM sent to the pid
    in the pid file, removing it.
    """
    pidFile, logFile = tmp_path / "x.pid", tmp_path / "x.log"
    port = freePort()
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SVC_", "REDIS", "OTEL_"))},
        "SVC_AUTH_GRPC_ADDR": "127.0.0.1:1",
        "SVC_HOST": "127.0.0.1",
        "SVC_PORT": str(port),
        "SVC_SHUTDOWN_TIMEOUT": "2s",
        # svc-auth is unreachable on purpose: listen without waiting for it.
        "SVC_START_TIMEOUT": "100ms",
    }
    command = [
        sys.executable,
        "-c",
        "from twisted.scripts.twistd import run; run()",
        f"--logfile={logFile}",
        f"--pidfile={pidFile}",
        "svc-proxy",
    ]
    launched = subprocess.run(command, env=environment, cwd=tmp_path, timeout=60, check=False)
    assert launched.returncode == 0
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    requestID = answer.headers["X-Request-ID"]
                    traceID = answer.headers["X-Trace-ID"]
                    break
            except OSError:
                assert time.monotonic() < deadline, logFile.read_text()
                time.sleep(0.1)
        pid = int(pidFile.read_text())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while pidFile.exists():
            assert time.monotonic() < deadline, "still running"
            time.sleep(0.05)
    finally:
        if pidFile.exists():
            os.kill(int(pidFile.read_text()), signal.SIGKILL)
    lines = [json.loads(line) for line in logFile.read_text().splitlines() if line.strip()]
    assert all({"timestamp", "level", "namespace", "message"} <= set(line) for line in lines)
    [access] = [line for line in lines if line["message"] == "GET /health 200"]
    assert (access["request_id"], access["trace_id"]) == (requestID, traceID)
    assert "svc-proxy stopped" in [line["message"] for line in lines]


@pytest.mark.parametrize(
    "event",
    [
        {"log_format": "{method} {route} {status}", "method": "GET", "route": "/x", "status": 200},
        {"log_format": "{{literal}} {a}", "a": 1},
        {"log_format": "{a!r} and {a}", "a": "quoted"},
        {"log_format": "{a.real}", "a": 3},
        {"log_format": "{a:>5}", "a": 1},
        {"log_format": "{f()}", "f": lambda: 5},
        {"log_format": "{missing} field"},
        {"log_format": "unbalanced {", "a": 1},
        {"log_format": "{0}"},
        {"log_format": None, "log_text": "no format"},
    ],
)
def test_messageAsTwistedFormatsIt(event: dict[str, Any]) -> None:
    """
    The observers' cached message formatting gives exactly what
    twisted.logger.formatEvent gives, for the plain formats it renders
    itself and for every other kind, which it hands to formatEvent.
    """
    from twisted.logger import formatEvent

    from svcd.common.logs import _message

    assert _message(event) == formatEvent(dict(event))
    assert _message(event) == formatEvent(dict(event))  # and again, from the cache


def test_timestampAcrossSeconds() -> None:
    """
    RFC 3339 UTC with milliseconds, right on both sides of a second.
    """
    from svcd.common.logs import _timestamp

    assert _timestamp({"log_time": 1700000000.1234}) == "2023-11-14T22:13:20.123Z"
    assert _timestamp({"log_time": 1700000000.9999}) == "2023-11-14T22:13:20.999Z"
    assert _timestamp({"log_time": 1700000001.0}) == "2023-11-14T22:13:21.000Z"
    assert _timestamp({"log_time": 1600000000.5}) == "2020-09-13T12:26:40.500Z"


@pytest.mark.parametrize("level", list(LogLevel.iterconstants()))
def test_levelFilterAgreesWithTwisted(level: LogLevel) -> None:
    """
    L{LevelFilter} passes on exactly the events Twisted's
    FilteringLogObserver with a LogLevelFilterPredicate of the same level
    would: every level, nested and empty namespaces, and events without a
    level or a namespace.
    """
    from twisted.logger import FilteringLogObserver, LogLevelFilterPredicate

    from svcd.common.logs import LevelFilter

    ours: list[dict[str, Any]] = []
    twisteds: list[dict[str, Any]] = []
    # Twisted takes any callable as an observer; its annotations ask for
    # the interface.
    mine = LevelFilter(cast(ILogObserver, ours.append), level)
    reference = FilteringLogObserver(
        cast(ILogObserver, twisteds.append), [LogLevelFilterPredicate(defaultLogLevel=level)]
    )
    events: list[dict[str, Any]] = [
        {"log_level": eventLevel, "log_namespace": namespace, "n": index}
        for index, (eventLevel, namespace) in enumerate(
            (eventLevel, namespace)
            for eventLevel in [*LogLevel.iterconstants(), None]
            for namespace in ("svcd.proxy.http.edge.ProxyEdge", "x", "", None)
        )
    ]
    events.append({"n": -1})
    for event in events:
        mine(dict(event))
        reference(dict(event))
    assert [event["n"] for event in ours] == [event["n"] for event in twisteds]
    assert ours, "some events pass at every level"
