"""
svc-proxy's gRPC client of svc-auth against a real grpcio server on a
loopback port, with a scripted AuthService: the status mapping of spec
4.3, 5.6 and decisions D4, the deadline enforced on the call, cancellation
reaching the server, the forwarded bearer, the readiness probe, and TLS.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_twisted
from fakeauth import servingAuth
from proxydoubles import newToken
from twisted.internet.defer import CancelledError, Deferred, gatherResults
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import deferLater

from svcd.authclient.channel import authChannel
from svcd.authclient.connection import AuthConnection
from svcd.authclient.slots import CallSlots
from svcd.common.errors import ApiError
from svcd.common.pat import READINESS_SENTINEL
from svcd.common.readiness import CheckFailed
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc
from svcd.proxy.config import ProxyConfig
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.records import AgentInfo, TokenInfo
from svcd.proxy.validation.client import GrpcAuthClient

Behaviour = Callable[[Any, grpc.ServicerContext], Any]


class ScriptedAuthService(auth_pb2_grpc.AuthServiceServicer):
    """
    An AuthService whose answers the test sets, recording what it was
    asked and with which metadata.
    """

    def __init__(self) -> None:
        self.token: Behaviour = lambda request, context: auth_pb2.ValidateTokenResponse()
        self.agent: Behaviour = lambda request, context: auth_pb2.ValidateAgentResponse()
        self.calls: list[tuple[str, Any, dict[str, str]]] = []

    def ValidateToken(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append(("ValidateToken", request, dict(context.invocation_metadata())))
        return self.token(request, context)

    def ValidateAgent(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append(("ValidateAgent", request, dict(context.invocation_metadata())))
        return self.agent(request, context)


def abortWith(code: grpc.StatusCode, details: str = "") -> Behaviour:
    def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)

    return behaviour


def sleepThen(seconds: float, response: Any) -> Behaviour:
    def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
        time.sleep(seconds)
        return response

    return behaviour


def inTurn(*behaviours: Behaviour) -> Behaviour:
    """
    Each call answered by the next behaviour; a call beyond them fails.
    """
    answers = iter(behaviours)
    return lambda request, context: next(answers)(request, context)


def tokenOK(orgID: str, permissions: int = 1, agentID: str = "") -> Behaviour:
    return lambda request, context: auth_pb2.ValidateTokenResponse(
        org_id=orgID,
        permissions=permissions,
        agent_id=agentID,
        token_id=str(uuid.uuid4()),
        expires_at="2030-01-01T00:00:00.000Z",
    )


def agentOK(status: str = "active") -> Behaviour:
    return lambda request, context: auth_pb2.ValidateAgentResponse(
        agent_id=request.agent_id, org_id=request.org_id, status=status
    )


@pytest.fixture
def service() -> Iterator[tuple[ScriptedAuthService, int]]:
    servicer = ScriptedAuthService()
    with servingAuth(servicer, workers=8) as port:
        yield servicer, port


def clientOn(
    channelFactory: Callable[[], Any], timeout: float, metrics: ProxyMetrics, **slots: Any
) -> GrpcAuthClient:
    """
    The proxy's validation client on a connection of its own to the
    channel C{channelFactory} makes; C{slots} are the connection's
    C{maxInFlight} and C{queueTimeout}.
    """
    from twisted.internet import reactor

    connection = AuthConnection(channelFactory, IReactorFromThreads(reactor), reactor, **slots)
    return GrpcAuthClient(connection, timeout, metrics)


def makeClient(port: int, timeout: float = 0.05) -> tuple[GrpcAuthClient, ProxyMetrics]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    # Connected before the test, so a 50 ms deadline measures the call,
    # not the TCP and HTTP/2 handshakes.
    grpc.channel_ready_future(channel).result(timeout=5)
    metrics = ProxyMetrics()
    return clientOn(lambda: channel, timeout, metrics), metrics


@pytest.fixture
def scripted(
    service: tuple[ScriptedAuthService, int],
) -> Iterator[tuple[ScriptedAuthService, GrpcAuthClient, ProxyMetrics]]:
    servicer, port = service
    # A deadline far above any answer's time even on a busy machine: these
    # tests are about answers; the deadline tests make a client of 50 ms.
    client, metrics = makeClient(port, timeout=2.0)
    try:
        yield servicer, client, metrics
    finally:
        client.close()


Scripted = tuple[ScriptedAuthService, GrpcAuthClient, ProxyMetrics]


async def apiErrorOf(deferred: Deferred[Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        await deferred
    return caught.value


def resultCount(metrics: ProxyMetrics, result: str) -> float:
    value = metrics.registry.get_sample_value(
        "svc_proxy_auth_validate_duration_seconds_count", {"result": result}
    )
    return 0.0 if value is None else value


# ValidateToken


@pytest_twisted.ensureDeferred
async def test_validateTokenOK(scripted: Scripted) -> None:
    """
    OK gives the token's org (canonical), permissions and other fields; no
    metadata is sent with ValidateToken.
    """
    servicer, client, metrics = scripted
    orgID = str(uuid.uuid4())
    servicer.token = tokenOK(orgID.upper(), permissions=9)
    token = newToken()
    info = await client.validateToken(token)
    assert isinstance(info, TokenInfo)
    assert (info.orgID, info.permissions, info.agentID) == (orgID, 9, None)
    assert info.expiresAt == "2030-01-01T00:00:00.000Z"
    [(method, request, metadata)] = servicer.calls
    assert (method, request.access_token) == ("ValidateToken", token)
    assert "authorization" not in metadata
    assert resultCount(metrics, "ok") == 1


@pytest_twisted.ensureDeferred
async def test_validateTokenWithAgent(scripted: Scripted) -> None:
    """
    A token bound to an agent carries its agent id.
    """
    servicer, client, _ = scripted
    agentID = str(uuid.uuid4())
    servicer.token = tokenOK(str(uuid.uuid4()), agentID=agentID)
    assert (await client.validateToken(newToken())).agentID == agentID


@pytest_twisted.ensureDeferred
async def test_validateTokenFiresOnReactorThread(scripted: Scripted) -> None:
    """
    The result is delivered on the reactor thread, not a grpcio thread.
    """
    servicer, client, _ = scripted
    servicer.token = tokenOK(str(uuid.uuid4()))
    threads: list[threading.Thread] = []
    await client.validateToken(newToken()).addCallback(
        lambda info: threads.append(threading.current_thread())
    )
    assert threads == [threading.main_thread()]


@pytest_twisted.ensureDeferred
async def test_validateTokenUnauthenticated(scripted: Scripted) -> None:
    """
    UNAUTHENTICATED is 401 INVALID_TOKEN.
    """
    servicer, client, metrics = scripted
    servicer.token = abortWith(grpc.StatusCode.UNAUTHENTICATED, "token revoked")
    error = await apiErrorOf(client.validateToken(newToken()))
    assert (error.status, error.code.value) == (401, "INVALID_TOKEN")
    assert resultCount(metrics, "unauthenticated") == 1


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNKNOWN,
    ],
)
@pytest_twisted.ensureDeferred
async def test_validateTokenOtherStatus(scripted: Scripted, code: grpc.StatusCode) -> None:
    """
    Any status but OK and UNAUTHENTICATED is 503 SERVICE_DEGRADED (fail
    closed).
    """
    servicer, client, metrics = scripted
    servicer.token = abortWith(code, "whatever")
    error = await apiErrorOf(client.validateToken(newToken()))
    assert (error.status, error.code.value) == (503, "SERVICE_DEGRADED")
    assert resultCount(metrics, code.name.lower()) == 1


@pytest_twisted.ensureDeferred
async def test_validateTokenMalformedOrg(scripted: Scripted) -> None:
    """
    OK with an org id that is not a UUID is not trusted: 503
    SERVICE_DEGRADED.
    """
    servicer, client, _ = scripted
    servicer.token = tokenOK("not-a-uuid")
    error = await apiErrorOf(client.validateToken(newToken()))
    assert error.code.value == "SERVICE_DEGRADED"


@pytest_twisted.ensureDeferred
async def test_validateTokenDeadline(service: tuple[ScriptedAuthService, int]) -> None:
    """
    A svc-auth slower than the 50 ms deadline gives 503 SERVICE_DEGRADED
    after about 50 ms, long before its 1 s answer.
    """
    servicer, port = service
    client, metrics = makeClient(port, timeout=0.05)
    servicer.token = sleepThen(1.0, auth_pb2.ValidateTokenResponse(org_id=str(uuid.uuid4())))
    try:
        began = time.monotonic()
        error = await apiErrorOf(client.validateToken(newToken()))
        elapsed = time.monotonic() - began
    finally:
        client.close()
    assert error.code.value == "SERVICE_DEGRADED"
    assert 0.045 <= elapsed < 0.6, elapsed
    assert resultCount(metrics, "deadline_exceeded") == 1


@pytest_twisted.ensureDeferred
async def test_reactorNotBlocked(service: tuple[ScriptedAuthService, int]) -> None:
    """
    While a call waits for svc-auth the reactor keeps running: a timer due
    in 10 ms fires long before the 300 ms answer.
    """
    from twisted.internet import reactor

    servicer, port = service
    client, _ = makeClient(port, timeout=2.0)
    try:
        servicer.token = sleepThen(0.3, auth_pb2.ValidateTokenResponse(org_id=str(uuid.uuid4())))
        began = time.monotonic()
        call = client.validateToken(newToken())
        timerFired = await deferLater(reactor, 0.01, time.monotonic)
        assert not call.called
        await call
        assert timerFired - began < 0.1
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_cancelCancelsCall(service: tuple[ScriptedAuthService, int]) -> None:
    """
    Cancelling the Deferred cancels the gRPC call: the server sees its RPC
    terminated at once.
    """
    from twisted.internet import reactor

    servicer, port = service
    client, metrics = makeClient(port, timeout=5.0)
    terminated = threading.Event()

    def waitForCancel(request: Any, context: grpc.ServicerContext) -> Any:
        context.add_callback(terminated.set)
        terminated.wait(5)
        return auth_pb2.ValidateTokenResponse()

    servicer.token = waitForCancel
    try:
        call = client.validateToken(newToken())
        await deferLater(reactor, 0.05, lambda: None)
        began = time.monotonic()
        call.cancel()
        with pytest.raises(CancelledError):
            await call
        while not terminated.is_set() and time.monotonic() - began < 2:
            await deferLater(reactor, 0.01, lambda: None)
        assert terminated.is_set()
        assert time.monotonic() - began < 0.5
        assert resultCount(metrics, "cancelled") == 1
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_validateTokenUnreachable() -> None:
    """
    Nobody listening: 503 SERVICE_DEGRADED, quickly.
    """
    channel = grpc.insecure_channel("127.0.0.1:1")
    client = clientOn(lambda: channel, 0.05, ProxyMetrics())
    try:
        began = time.monotonic()
        error = await apiErrorOf(client.validateToken(newToken()))
        assert error.code.value == "SERVICE_DEGRADED"
        assert time.monotonic() - began < 0.5
        error = await apiErrorOf(
            client.validateAgent(newToken(), str(uuid.uuid4()), str(uuid.uuid4()))
        )
        assert error.code.value == "AUTH_UNAVAILABLE"
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_channelMadeLazily(service: tuple[ScriptedAuthService, int]) -> None:
    """
    The channel is made at start (or first use), not at construction:
    twistd builds the service before it forks to daemonise.
    """
    servicer, port = service
    servicer.token = abortWith(grpc.StatusCode.UNAUTHENTICATED)
    made: list[Any] = []

    def factory() -> Any:
        made.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        return made[-1]

    client = clientOn(factory, 1.0, ProxyMetrics())
    assert made == []
    client.start()
    await client.checkReachable()
    await apiErrorOf(client.validateToken(newToken()))
    assert len(made) == 1
    client.close()
    with pytest.raises(CheckFailed, match="ValueError"):
        await client.checkReachable()
    assert len(made) == 1

    unused = clientOn(factory, 1.0, ProxyMetrics())
    unused.close()
    error = await apiErrorOf(unused.validateToken(newToken()))
    assert error.code.value == "SERVICE_DEGRADED"
    assert len(made) == 1


@pytest_twisted.ensureDeferred
async def test_closedChannel(scripted: Scripted) -> None:
    """
    After close, calls fail closed instead of raising.
    """
    _, client, _ = scripted
    client.close()
    error = await apiErrorOf(client.validateToken(newToken()))
    assert error.code.value == "SERVICE_DEGRADED"


# ValidateAgent


@pytest_twisted.ensureDeferred
async def test_validateAgentForwardsBearer(scripted: Scripted) -> None:
    """
    ValidateAgent carries the agent, the org and the caller's bearer as
    metadata "authorization: Bearer <token>".
    """
    servicer, client, _ = scripted
    servicer.agent = agentOK()
    token, agentID, orgID = newToken(), str(uuid.uuid4()), str(uuid.uuid4())
    info = await client.validateAgent(token, agentID, orgID)
    assert info == AgentInfo(agentID=agentID, orgID=orgID, status="active")
    [(method, request, metadata)] = servicer.calls
    assert (method, request.agent_id, request.org_id) == ("ValidateAgent", agentID, orgID)
    assert metadata["authorization"] == "Bearer " + token


@pytest.mark.parametrize(
    ("code", "details", "status", "errorCode"),
    [
        (grpc.StatusCode.PERMISSION_DENIED, "agent is not active", 403, "AGENT_SUSPENDED"),
        (grpc.StatusCode.PERMISSION_DENIED, "agent not found", 403, "AGENT_NOT_AUTHORIZED"),
        (grpc.StatusCode.PERMISSION_DENIED, "agent is not active!", 403, "AGENT_NOT_AUTHORIZED"),
        (grpc.StatusCode.PERMISSION_DENIED, "", 403, "AGENT_NOT_AUTHORIZED"),
        (grpc.StatusCode.UNAUTHENTICATED, "token revoked", 401, "INVALID_TOKEN"),
        (grpc.StatusCode.INVALID_ARGUMENT, "agent_id is not a UUID", 400, "VALIDATION_ERROR"),
        (grpc.StatusCode.UNAVAILABLE, "", 503, "AUTH_UNAVAILABLE"),
        (grpc.StatusCode.INTERNAL, "db down", 503, "AUTH_UNAVAILABLE"),
        (grpc.StatusCode.NOT_FOUND, "", 503, "AUTH_UNAVAILABLE"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_validateAgentStatus(
    scripted: Scripted, code: grpc.StatusCode, details: str, status: int, errorCode: str
) -> None:
    """
    The ValidateAgent status mapping of spec 4.3 and decisions D4.
    """
    servicer, client, _ = scripted
    servicer.agent = abortWith(code, details)
    error = await apiErrorOf(client.validateAgent(newToken(), str(uuid.uuid4()), str(uuid.uuid4())))
    assert (error.status, error.code.value) == (status, errorCode)
    if errorCode == "VALIDATION_ERROR":
        assert [(e.field, e.code.value) for e in error.fieldErrors] == [
            ("X-SVC-Agent-ID", "INVALID_FORMAT")
        ]


@pytest_twisted.ensureDeferred
async def test_validateAgentDeadline(service: tuple[ScriptedAuthService, int]) -> None:
    """
    ValidateAgent past its deadline is 503 AUTH_UNAVAILABLE after about
    50 ms, long before its 1 s answer.
    """
    servicer, port = service
    client, _ = makeClient(port, timeout=0.05)
    servicer.agent = sleepThen(1.0, auth_pb2.ValidateAgentResponse(status="active"))
    try:
        began = time.monotonic()
        error = await apiErrorOf(
            client.validateAgent(newToken(), str(uuid.uuid4()), str(uuid.uuid4()))
        )
        elapsed = time.monotonic() - began
    finally:
        client.close()
    assert error.code.value == "AUTH_UNAVAILABLE"
    assert 0.045 <= elapsed < 0.6, elapsed


@pytest_twisted.ensureDeferred
async def test_validateAgentInactiveOK(scripted: Scripted) -> None:
    """
    OK for an agent whose status is not active still fails closed.
    """
    servicer, client, _ = scripted
    servicer.agent = agentOK("paused")
    error = await apiErrorOf(client.validateAgent(newToken(), str(uuid.uuid4()), str(uuid.uuid4())))
    assert error.code.value == "AGENT_SUSPENDED"


# Readiness


@pytest.mark.parametrize(
    "behaviour",
    [abortWith(grpc.StatusCode.UNAUTHENTICATED, "malformed"), tokenOK(str(uuid.uuid4()))],
)
@pytest_twisted.ensureDeferred
async def test_checkReachable(scripted: Scripted, behaviour: Behaviour) -> None:
    """
    The auth_grpc check sends the readiness sentinel; UNAUTHENTICATED (the
    expected answer) and OK both mean reachable.
    """
    servicer, client, _ = scripted
    servicer.token = behaviour
    await client.checkReachable()
    [(_, request, _)] = servicer.calls
    assert request.access_token == READINESS_SENTINEL


@pytest_twisted.ensureDeferred
async def test_checkReachableFails(scripted: Scripted) -> None:
    """
    Another status fails the check, saying which.
    """
    servicer, client, _ = scripted
    servicer.token = abortWith(grpc.StatusCode.INTERNAL, "db down")
    with pytest.raises(CheckFailed, match=r"^ValidateToken answered INTERNAL$"):
        await client.checkReachable()


@pytest_twisted.ensureDeferred
async def test_checkReachableDown() -> None:
    """
    Nobody listening: the check fails with UNAVAILABLE.
    """
    client = clientOn(
        lambda: grpc.insecure_channel("127.0.0.1:1"),
        0.05,
        ProxyMetrics(),
    )
    try:
        with pytest.raises(CheckFailed, match="UNAVAILABLE"):
            await client.checkReachable()
    finally:
        client.close()


# TLS


def _openssl(*arguments: str) -> None:
    subprocess.run(["openssl", *arguments], check=True, capture_output=True)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """
    A CA, a server certificate for 127.0.0.1 and a client certificate.
    """
    folder = tmp_path_factory.mktemp("pki")
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", "/CN=test-ca", "-keyout", str(folder / "ca.key"), "-out", str(folder / "ca.pem"),
    )  # fmt: skip
    for name in ("server", "client"):
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(folder / f"{name}.key"), "-out", str(folder / f"{name}.csr"),
        )  # fmt: skip
        (folder / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl(
            "x509", "-req", "-in", str(folder / f"{name}.csr"), "-CA", str(folder / "ca.pem"),
            "-CAkey", str(folder / "ca.key"), "-CAcreateserial", "-days", "2",
            "-extfile", str(folder / f"{name}.ext"), "-out", str(folder / f"{name}.pem"),
        )  # fmt: skip
    return folder


@pytest.fixture
def mutualTLSService(certificates: Path) -> Iterator[tuple[ScriptedAuthService, int]]:
    servicer = ScriptedAuthService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    auth_pb2_grpc.add_AuthServiceServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [((certificates / "server.key").read_bytes(), (certificates / "server.pem").read_bytes())],
        root_certificates=(certificates / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(0)


@pytest_twisted.ensureDeferred
async def test_mutualTLS(
    certificates: Path, mutualTLSService: tuple[ScriptedAuthService, int]
) -> None:
    """
    With SVC_AUTH_GRPC_TLS_CA, _CERT and _KEY the channel does mutual TLS;
    with the CA alone the server refuses the client, which fails closed.
    """
    servicer, port = mutualTLSService
    servicer.token = abortWith(grpc.StatusCode.UNAUTHENTICATED)
    environ = {
        "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{port}",
        "SVC_AUTH_GRPC_TLS_CA": str(certificates / "ca.pem"),
        "SVC_AUTH_GRPC_TLS_CERT": str(certificates / "client.pem"),
        "SVC_AUTH_GRPC_TLS_KEY": str(certificates / "client.key"),
    }
    config = ProxyConfig.fromEnvironment(environ)
    # A deadline that a TLS handshake on a loaded machine fits in (2 s did
    # not, once, at load 30 to 48): what is tested is the certificates.
    client = clientOn(
        lambda: authChannel(config.authGrpcAddr, config.authTLS), 15.0, ProxyMetrics()
    )
    try:
        await client.checkReachable()
        assert len(servicer.calls) == 1
    finally:
        client.close()

    del environ["SVC_AUTH_GRPC_TLS_CERT"], environ["SVC_AUTH_GRPC_TLS_KEY"]
    config = ProxyConfig.fromEnvironment(environ)
    client = clientOn(lambda: authChannel(config.authGrpcAddr, config.authTLS), 2.0, ProxyMetrics())
    try:
        error = await apiErrorOf(client.validateToken(newToken()))
        assert error.code.value == "SERVICE_DEGRADED"
        assert len(servicer.calls) == 1
    finally:
        client.close()


class ConcurrencyRecorder:
    """
    A ValidateToken behaviour that takes C{seconds} and records how many
    calls the server ran at once.
    """

    def __init__(self, seconds: float, orgID: str) -> None:
        self._seconds = seconds
        self._orgID = orgID
        self._lock = threading.Lock()
        self.running = 0
        self.mostAtOnce = 0

    def __call__(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self.running += 1
            self.mostAtOnce = max(self.mostAtOnce, self.running)
        try:
            time.sleep(self._seconds)
        finally:
            with self._lock:
                self.running -= 1
        return auth_pb2.ValidateTokenResponse(org_id=self._orgID, permissions=1)


@pytest_twisted.ensureDeferred
async def test_callsBeyondTheBoundWaitBeforeTheirDeadlineStarts(
    service: tuple[ScriptedAuthService, int],
) -> None:
    """
    With at most 2 calls in flight, 8 concurrent validations of 300 ms
    each reach svc-auth two at a time, and all succeed although together
    they take longer than the 1 s deadline: each deadline starts when its
    call is sent, not while it waits its turn. (The call takes well under
    its deadline, so that a loaded machine cannot make it miss it: at 30
    ms against 50 ms it did, with both cores busy.)
    """
    servicer, port = service
    recorder = ConcurrencyRecorder(0.3, str(uuid.uuid4()))
    servicer.token = recorder
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    client = clientOn(
        lambda: channel,
        1.0,
        ProxyMetrics(),
        maxInFlight=2,
        queueTimeout=10.0,
    )
    try:
        began = time.monotonic()
        results = await gatherResults([client.validateToken(newToken()) for _ in range(8)])
        took = time.monotonic() - began
        assert len(results) == 8
        assert recorder.mostAtOnce == 2
        assert took > 1.0
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_aCallThatWaitsTooLongFailsClosed(
    service: tuple[ScriptedAuthService, int],
) -> None:
    """
    A call that finds no free slot within the queue timeout is never sent
    and fails closed: 503 SERVICE_DEGRADED for ValidateToken, 503
    AUTH_UNAVAILABLE for ValidateAgent, counted as queue_timeout.
    """
    servicer, port = service
    recorder = ConcurrencyRecorder(0.3, str(uuid.uuid4()))
    servicer.token = recorder
    servicer.agent = agentOK()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    metrics = ProxyMetrics()
    client = clientOn(
        lambda: channel,
        1.0,
        metrics,
        maxInFlight=1,
        queueTimeout=0.05,
    )
    try:
        first = client.validateToken(newToken())
        began = time.monotonic()
        error = await apiErrorOf(client.validateToken(newToken()))
        assert error.code.value == "SERVICE_DEGRADED"
        error = await apiErrorOf(
            client.validateAgent(newToken(), str(uuid.uuid4()), str(uuid.uuid4()))
        )
        assert error.code.value == "AUTH_UNAVAILABLE"
        assert time.monotonic() - began < 0.25
        assert resultCount(metrics, "queue_timeout") == 2
        await first
        assert recorder.mostAtOnce == 1
    finally:
        client.close()


def test_callSlotsServeTheLaterStageFirst() -> None:
    """
    With every slot taken, a freed slot goes to a waiting ValidateAgent
    call (stage 1) before any waiting ValidateToken call (stage 0), first
    come first served within a stage; a cancelled waiter is skipped, and a
    slot nobody waits for becomes free again.
    """
    slots = CallSlots(1)
    assert slots.acquire(0).called
    served: list[str] = []
    waiters = {
        "token-1": slots.acquire(0),
        "agent-1": slots.acquire(1),
        "token-2": slots.acquire(0),
        "agent-2": slots.acquire(1),
    }

    def serve(_: None, name: str) -> None:
        served.append(name)

    for name, turn in waiters.items():
        turn.addCallback(serve, name)
    waiters["agent-1"].cancel()
    waiters["agent-1"].addErrback(lambda failure: None)
    for _ in range(3):
        slots.release()
    assert served == ["agent-2", "token-1", "token-2"]
    slots.release()
    assert slots.acquire(1).called
    assert not slots.acquire(0).called


@pytest_twisted.ensureDeferred
async def test_aRequestsSecondCallGoesBeforeNewRequests(
    service: tuple[ScriptedAuthService, int],
) -> None:
    """
    Through a real grpcio server with one slot: while a ValidateToken call
    is in flight, two more ValidateToken calls and then one ValidateAgent
    call queue; the ValidateAgent call is sent next.
    """
    servicer, port = service
    orgID = str(uuid.uuid4())
    order: list[str] = []

    def token(request: Any, context: grpc.ServicerContext) -> Any:
        order.append("token")
        time.sleep(0.05)
        return auth_pb2.ValidateTokenResponse(org_id=orgID, permissions=1)

    def agent(request: Any, context: grpc.ServicerContext) -> Any:
        order.append("agent")
        return auth_pb2.ValidateAgentResponse(
            agent_id=request.agent_id, org_id=request.org_id, status="active"
        )

    servicer.token = token
    servicer.agent = agent
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    client = clientOn(
        lambda: channel,
        1.0,
        ProxyMetrics(),
        maxInFlight=1,
        queueTimeout=5.0,
    )
    try:
        calls: list[Deferred[Any]] = [client.validateToken(newToken()) for _ in range(3)]
        calls.append(client.validateAgent(newToken(), str(uuid.uuid4()), orgID))
        await gatherResults(calls)
        assert order == ["token", "agent", "token", "token"]
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_concurrentValidationsOfOneTokenShareTheNextCall(
    service: tuple[ScriptedAuthService, int],
) -> None:
    """
    Through a real grpcio server: five validations of one token that arrive
    while a call for it is in flight cost one more call, not five, and get
    that later call's answer, never the earlier one's. Here the token is
    revoked between the two calls: the first request is let through, the
    five that asked after it was sent are refused.
    """
    from twisted.internet import reactor

    servicer, port = service
    orgID = str(uuid.uuid4())
    servicer.token = inTurn(
        sleepThen(0.1, auth_pb2.ValidateTokenResponse(org_id=orgID, permissions=1)),
        abortWith(grpc.StatusCode.UNAUTHENTICATED, "revoked"),
    )
    client, _ = makeClient(port, timeout=5.0)
    token = newToken()
    try:
        first = client.validateToken(token)
        await deferLater(reactor, 0.03, lambda: None)
        later = [apiErrorOf(client.validateToken(token)) for _ in range(5)]
        assert (await first).orgID == orgID
        for refusal in later:
            assert (await refusal).code.value == "INVALID_TOKEN"
        assert [name for name, _, _ in servicer.calls] == ["ValidateToken", "ValidateToken"]
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_agentValidationsShareOnlyIdenticalQuestions(
    service: tuple[ScriptedAuthService, int],
) -> None:
    """
    ValidateAgent calls are shared only between requests with the same
    token, agent and organization.
    """
    servicer, port = service
    # A deadline a loaded machine meets: calls that take 20 ms each, five
    # of them at once, missed 50 ms by scheduling alone (this test is about
    # sharing, not the deadline).
    client, _ = makeClient(port, timeout=1.0)
    orgID, agentID = str(uuid.uuid4()), str(uuid.uuid4())

    def agent(request: Any, context: grpc.ServicerContext) -> Any:
        time.sleep(0.02)
        return auth_pb2.ValidateAgentResponse(
            agent_id=request.agent_id, org_id=request.org_id, status="active"
        )

    servicer.agent = agent
    token, other = newToken(), newToken()
    asked = [
        client.validateAgent(token, agentID, orgID),
        client.validateAgent(token, agentID, orgID),
        client.validateAgent(token, agentID, orgID),
        client.validateAgent(other, agentID, orgID),
        client.validateAgent(token, str(uuid.uuid4()), orgID),
    ]
    try:
        answered = await gatherResults(asked)
    finally:
        client.close()
    assert [agent.status for agent in answered] == ["active"] * 5
    bearers = sorted(metadata["authorization"] for _, _, metadata in servicer.calls)
    assert bearers == sorted([f"Bearer {token}"] * 3 + [f"Bearer {other}"])


@pytest_twisted.ensureDeferred
async def test_sharersOfACallThatFailedWithoutAnAnswerTryOnceMore(
    service: tuple[ScriptedAuthService, int],
) -> None:
    """
    A shared call that misses its deadline fails the request that sent it
    (503 as always) but not the requests that merely shared it: those
    share one more call. Here three requests arrive during a first call;
    the second call, sent by the first of them, misses its deadline; the
    other two get the third call's answer.
    """
    from twisted.internet import reactor

    servicer, port = service
    orgID = str(uuid.uuid4())
    ok = auth_pb2.ValidateTokenResponse(org_id=orgID, permissions=1)
    servicer.token = inTurn(sleepThen(0.05, ok), sleepThen(0.3, ok), sleepThen(0, ok))
    client, metrics = makeClient(port, timeout=0.15)
    token = newToken()
    try:
        first = client.validateToken(token)
        await deferLater(reactor, 0.01, lambda: None)
        sender = apiErrorOf(client.validateToken(token))
        sharers = [client.validateToken(token) for _ in range(2)]
        assert (await first).orgID == orgID
        assert (await sender).code.value == "SERVICE_DEGRADED"
        assert [info.orgID for info in await gatherResults(sharers)] == [orgID, orgID]
        assert len(servicer.calls) == 3
        assert resultCount(metrics, "deadline_exceeded") == 1
    finally:
        client.close()


@pytest_twisted.ensureDeferred
async def test_aCallSvcAuthCancelledIsSentOnceMore(
    service: tuple[ScriptedAuthService, int],
) -> None:
    """
    A stopping svc-auth cancels the calls it had received but not begun;
    the proxy's channel (its service config) sends such a call once more,
    ValidateToken and ValidateAgent alike, since both only read. No other
    failure is retried, and a call cancelled twice fails closed.
    """
    servicer, port = service
    channel = authChannel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=5)
    client = clientOn(lambda: channel, 2.0, ProxyMetrics())
    orgID = str(uuid.uuid4())
    cancelled = abortWith(grpc.StatusCode.CANCELLED, "svc-auth is stopping")
    try:
        servicer.token = inTurn(cancelled, tokenOK(orgID))
        info = await client.validateToken(newToken())
        assert info.orgID == orgID
        assert len(servicer.calls) == 2

        servicer.calls.clear()
        servicer.agent = inTurn(cancelled, agentOK())
        agentID = str(uuid.uuid4())
        agent = await client.validateAgent(newToken(), agentID, orgID)
        assert agent.agentID == agentID
        assert len(servicer.calls) == 2

        servicer.calls.clear()
        servicer.token = inTurn(abortWith(grpc.StatusCode.UNAVAILABLE), tokenOK(orgID))
        error = await apiErrorOf(client.validateToken(newToken()))
        assert error.code.value == "SERVICE_DEGRADED"
        assert len(servicer.calls) == 1

        servicer.calls.clear()
        servicer.token = inTurn(cancelled, cancelled, tokenOK(orgID))
        error = await apiErrorOf(client.validateToken(newToken()))
        assert error.code.value == "SERVICE_DEGRADED"
        assert len(servicer.calls) == 2
    finally:
        client.close()
