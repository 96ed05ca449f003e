"""
svc-auth's admission of gRPC calls (L{svcd.common.grpcadmission}, decisions D10)
against a real grpcio server: at most so many calls at once per client
connection and in total, the excess answered RESOURCE_EXHAUSTED at once
while the admitted calls are still blocked, and every slot freed when its
call ends, however it ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, cast

import attrs
import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter
from twisted.logger import ILogObserver, Logger, LogLevel

from svcd.common.grpcadmission import (
    STANDARD_STREAMS,
    AdmissionInterceptor,
    Bounds,
    Lane,
    RefusalLog,
)

SERVICE = "test.Blocking"
HOLD = f"/{SERVICE}/Hold"
FAIL = f"/{SERVICE}/Fail"
ECHO = f"/{SERVICE}/Echo"
WATCH = f"/{SERVICE}/Watch"


class BlockingService:
    """
    Methods that block until the test lets them go (or their call ends),
    counting how many are inside.
    """

    def __init__(self) -> None:
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.inside = 0

    def _enter(self) -> None:
        with self._lock:
            self.inside += 1

    def _leave(self) -> None:
        with self._lock:
            self.inside -= 1

    def hold(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._enter()
        try:
            while not self.release.wait(0.01):
                if not context.is_active():
                    break
            return b"held"
        finally:
            self._leave()

    def fail(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        raise RuntimeError("the handler failed")

    def echo(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    def watch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._enter()
        try:
            yield b"first"
            # Blocks without looking at the call, as a change feed waiting
            # for the next change would: only the end-of-call callback can
            # free its slot when the client goes away.
            self.release.wait(30)
            yield b"last"
        finally:
            self._leave()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Hold": grpc.unary_unary_rpc_method_handler(self.hold),
                "Fail": grpc.unary_unary_rpc_method_handler(self.fail),
                "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
                "Watch": grpc.unary_stream_rpc_method_handler(self.watch),
            },
        )


@attrs.define
class Served:
    """
    A running server with its admission interceptor, metrics and log.
    """

    server: grpc.Server
    port: int
    service: BlockingService
    interceptor: AdmissionInterceptor
    registry: CollectorRegistry
    answered: list[tuple[str, str]]
    logged: list[dict[str, Any]]
    channels: list[grpc.Channel] = attrs.field(factory=list)

    def connection(self) -> grpc.Channel:
        """
        A channel on a connection of its own (a peer of its own).
        """
        channel = grpc.insecure_channel(
            f"127.0.0.1:{self.port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self.channels.append(channel)
        return channel

    def refused(self, reason: str) -> float | None:
        return self.registry.get_sample_value("svc_auth_grpc_refused_total", {"reason": reason})

    def running(self, method: str = HOLD) -> tuple[int, int]:
        return self.interceptor.laneState(method).running()


@pytest.fixture
def serve() -> Iterator[Callable[[Bounds], Served]]:
    """
    Start a real grpcio server with the blocking service behind an
    AdmissionInterceptor of the given bounds, sized as buildServer sizes
    svc-auth's (without HTTP/2's stream limit, so that per-peer refusals
    reach the interceptor).
    """
    started: list[Served] = []

    def start(bounds: Bounds) -> Served:
        registry = CollectorRegistry()
        counter = Counter("svc_auth_grpc_refused", "refused", ["reason"], registry=registry)
        logged: list[dict[str, Any]] = []
        refusals = RefusalLog(counter)
        refusals.log = Logger(observer=cast(ILogObserver, logged.append))
        answered: list[tuple[str, str]] = []
        interceptor = AdmissionInterceptor(
            bounds,
            refusals,
            answered=lambda method, code: answered.append((method, code)),
            countedService=SERVICE,
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=bounds.threads),
            interceptors=[interceptor],
            maximum_concurrent_rpcs=bounds.threads,
        )
        service = BlockingService()
        server.add_generic_rpc_handlers((service.handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        served = Served(server, port, service, interceptor, registry, answered, logged)
        started.append(served)
        return served

    yield start
    for served in started:
        served.service.release.set()
        for channel in served.channels:
            channel.close()
        served.server.stop(0).wait(5)


def waitUntil(condition: Callable[[], bool], limit: float = 5.0) -> None:
    """
    Poll C{condition} until it holds, or fail after C{limit} seconds.
    """
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {limit}s"
        time.sleep(0.01)


def holding(channel: grpc.Channel, count: int, timeout: float = 30) -> list[Any]:
    call = channel.unary_unary(HOLD)
    return [call.future(b"", timeout=timeout) for _ in range(count)]


def refusedAtOnce(channel: grpc.Channel, method: str = HOLD) -> grpc.RpcError:
    """
    A call on C{channel} that must be refused within a second (while the
    admitted calls stay blocked for as long as the test likes).
    """
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as raised:
        channel.unary_unary(method)(b"", timeout=10)
    assert time.monotonic() - started < 1.0
    return raised.value


def test_callsPerConnectionAreBounded(serve: Callable[[Bounds], Served]) -> None:
    """
    Past perPeer calls running on one connection, the next call of that
    connection is answered RESOURCE_EXHAUSTED at once, counted under
    reason peer and in the per-method answers, and logged as a warning;
    another connection's call is still served.
    """
    served = serve(Bounds(calls=Lane("calls", total=10, perPeer=2)))
    greedy = served.connection()
    held = holding(greedy, 2)
    waitUntil(lambda: served.service.inside == 2)

    error = refusedAtOnce(greedy)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert served.connection().unary_unary(ECHO)(b"hi", timeout=5) == b"hi"

    assert served.refused("peer") == 1
    assert served.refused("total") == 0
    assert served.answered == [("Hold", "RESOURCE_EXHAUSTED")]
    (event,) = served.logged
    assert event["log_level"] == LogLevel.warn
    assert (event["reason"], event["refused"], event["limit"]) == ("peer", 1, 2)
    assert event["peer"].startswith("ipv4:127.0.0.1:")
    served.service.release.set()
    assert [call.result() for call in held] == [b"held", b"held"]


def test_callsInTotalAreBounded(serve: Callable[[Bounds], Served]) -> None:
    """
    Past total calls running over all connections, a call of a connection
    that has none running is answered RESOURCE_EXHAUSTED at once, counted
    under reason total.
    """
    served = serve(Bounds(calls=Lane("calls", total=3, perPeer=2)))
    held = holding(served.connection(), 2) + holding(served.connection(), 1)
    waitUntil(lambda: served.service.inside == 3)

    error = refusedAtOnce(served.connection())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (served.refused("total"), served.refused("peer")) == (1, 0)
    served.service.release.set()
    for call in held:
        assert call.result() == b"held"


def test_slotsAreFreedHoweverCallsEnd(serve: Callable[[Bounds], Served]) -> None:
    """
    A slot is given back when its call answers, fails, is cancelled by its
    client or runs out of time: afterwards nothing is counted as running,
    no peer is remembered, and the connection gets its full share again.
    """
    served = serve(Bounds(calls=Lane("calls", total=4, perPeer=2)))
    channel = served.connection()

    with pytest.raises(grpc.RpcError) as failed:
        channel.unary_unary(FAIL)(b"", timeout=5)
    assert failed.value.code() == grpc.StatusCode.UNKNOWN
    assert served.running(FAIL) == (0, 0)

    cancelled = holding(channel, 2)
    waitUntil(lambda: served.service.inside == 2)
    for call in cancelled:
        call.cancel()
    waitUntil(lambda: served.running() == (0, 0))

    late = holding(channel, 2, timeout=0.3)
    for call in late:
        with pytest.raises(grpc.RpcError) as expired:
            call.result()
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    waitUntil(lambda: served.running() == (0, 0))

    answered = holding(channel, 2)
    waitUntil(lambda: served.service.inside == 2)
    served.service.release.set()
    assert [call.result() for call in answered] == [b"held", b"held"]
    waitUntil(lambda: served.running() == (0, 0))
    assert served.refused("peer") == served.refused("total") == 0


def test_aStreamHasALaneOfItsOwn(serve: Callable[[Bounds], Served]) -> None:
    """
    A streaming method given its own lane neither takes the short calls'
    slots nor waits for them: with every call slot taken, a stream is
    admitted; past its own per-peer bound the next stream is refused; and
    a stream whose client goes away frees its slot although its handler is
    still blocked.
    """
    bounds = Bounds(calls=Lane("calls", total=2, perPeer=2)).withLane(
        WATCH, Lane("feed", total=2, perPeer=1)
    )
    assert bounds.threads == 2 + 2 + bounds.spareThreads
    served = serve(bounds)
    proxy = served.connection()
    held = holding(served.connection(), 2)
    waitUntil(lambda: served.service.inside == 2)

    watch = proxy.unary_stream(WATCH)
    stream = watch(b"", timeout=30)
    assert next(stream) == b"first"
    assert refusedAtOnce(proxy, HOLD).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as second:
        next(watch(b"", timeout=10))
    assert second.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert served.refused("peer") == 1
    assert served.refused("total") == 1

    stream.cancel()
    waitUntil(lambda: served.running(WATCH) == (0, 0))
    again = watch(b"", timeout=30)
    assert next(again) == b"first"
    again.cancel()
    served.service.release.set()
    for call in held:
        assert call.result() == b"held"


def test_standardBoundsSizeThePoolAndTheConnections() -> None:
    """
    svc-auth's standard bounds: the short calls, the standard streams in a
    lane of their own, a thread for each admissible call plus the spare
    ones, and an HTTP/2 stream limit that a client within every per-peer
    bound never meets.
    """
    bounds = Bounds.standard(total=64, perPeer=32)
    assert bounds.calls == Lane("calls", total=64, perPeer=32)
    assert bounds.lanes["/grpc.health.v1.Health/Watch"] == STANDARD_STREAMS
    assert bounds.threads == 64 + STANDARD_STREAMS.total + bounds.spareThreads
    assert bounds.streamsPerConnection == 32 + STANDARD_STREAMS.perPeer


def test_refusalsAreLoggedOnceAMinutePerReasonWithTheirCount() -> None:
    """
    The first refusal of each reason is logged at once; later ones within
    a minute only counted, and the next line carries how many there were.
    Refusals by bound are warnings, calls dropped past their deadline info.
    """
    now = [1000.0]
    registry = CollectorRegistry()
    counter = Counter("svc_auth_grpc_refused", "refused", ["reason"], registry=registry)
    logged: list[dict[str, Any]] = []
    refusals = RefusalLog(counter, clock=lambda: now[0])
    refusals.log = Logger(observer=cast(ILogObserver, logged.append))

    for _ in range(3):
        refusals.refused("peer")
    refusals.refused("deadline")
    now[0] += 59.0
    refusals.refused("peer")
    now[0] += 1.5
    refusals.refused("peer")

    assert [(event["reason"], event["refused"], event["log_level"]) for event in logged] == [
        ("peer", 1, LogLevel.warn),
        ("deadline", 1, LogLevel.info),
        ("peer", 4, LogLevel.warn),
    ]
    assert registry.get_sample_value("svc_auth_grpc_refused_total", {"reason": "peer"}) == 5
    assert registry.get_sample_value("svc_auth_grpc_refused_total", {"reason": "total"}) == 0
