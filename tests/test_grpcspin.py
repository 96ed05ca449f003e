"""
grpcio's channel thread held between calls (svcd/common/grpcspin.py),
against a real grpcio server: calls still work, the thread is the same
one from call to call, the held call never reaches the server, and
releasing it or closing the channel ends the thread without an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from svcd.common.grpcspin import holdChannelThread
from svcd.devkit.servers import freePort

_SERVICE = "svc.test.Echo"


class _Recording(grpc.GenericRpcHandler):  # type: ignore[misc]
    """
    Answers Echo's E with its request, and remembers every method asked.
    """

    def __init__(self) -> None:
        self.methods: list[str] = []

    def service(self, details: Any) -> Any:
        self.methods.append(details.method)
        if details.method == f"/{_SERVICE}/E":
            return grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        return None


@pytest.fixture
def server() -> Iterator[tuple[str, _Recording]]:
    handler = _Recording()
    made = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    made.add_generic_rpc_handlers((handler,))
    port = made.add_insecure_port("127.0.0.1:0")
    made.start()
    try:
        yield f"127.0.0.1:{port}", handler
    finally:
        made.stop(0).wait(5)


def _channelThreads() -> int:
    # grpcio's channel threads (its channel_spin, run by cygrpc's _run);
    # the server's threads are its pool's and its _serve.
    return sum(1 for thread in threading.enumerate() if thread.name.endswith("(_run)"))


def _waitUntil(condition: Any, what: str) -> None:
    limit = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < limit, what
        time.sleep(0.01)


def test_theThreadOutlivesEachCall(server: tuple[str, _Recording]) -> None:
    """
    With the call held, calls made one at a time are answered, no thread
    is started for any of them after the first, and the server sees only
    the calls made (never the held one).
    """
    address, handler = server
    channel = grpc.insecure_channel(address)
    echo = channel.unary_unary(f"/{_SERVICE}/E")
    try:
        held = holdChannelThread(channel)
        assert held is not None
        before = _channelThreads()
        for index in range(20):
            assert echo.future(b"%d" % index, timeout=5).result() == b"%d" % index
            assert _channelThreads() == before
        assert set(handler.methods) == {f"/{_SERVICE}/E"}
        threads = _channelThreads()
        held.release()
        _waitUntil(lambda: _channelThreads() < threads, "the thread never ended")
        # Released twice: nothing more.
        held.release()
        # Calls still work, starting the thread as grpcio does.
        assert echo.future(b"after", timeout=5).result() == b"after"
    finally:
        channel.close()


def test_closingTheChannelEndsTheThread(server: tuple[str, _Recording]) -> None:
    """
    A channel closed with the call held ends its thread, without an
    exception on it.
    """
    address, _ = server
    failures: list[Any] = []
    previous = threading.excepthook
    threading.excepthook = failures.append
    try:
        channel = grpc.insecure_channel(address)
        echo = channel.unary_unary(f"/{_SERVICE}/E")
        before = _channelThreads()
        assert holdChannelThread(channel) is not None
        assert _channelThreads() == before + 1
        assert echo.future(b"x", timeout=5).result() == b"x"
        channel.close()
        _waitUntil(lambda: _channelThreads() == before, "the thread never ended")
    finally:
        threading.excepthook = previous
    assert failures == []


def test_aChannelOfAnotherKindIsLeftAlone() -> None:
    """
    Something that is not a grpcio channel (a test's fake, a grpcio
    without the private parts used) holds nothing, and fails nothing.
    """
    assert holdChannelThread(object()) is None


def test_aServerDownFailsCallsAtOnceAsBefore() -> None:
    """
    With no server listening, calls still fail at once (UNAVAILABLE, as
    without the held call: it asks the channel for no connection), and the
    held call stays until the channel closes.
    """
    channel = grpc.insecure_channel(f"127.0.0.1:{freePort()}")
    echo = channel.unary_unary(f"/{_SERVICE}/E")
    try:
        before = _channelThreads()
        assert holdChannelThread(channel) is not None
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as raised:
                echo.future(b"x", timeout=5).result()
            assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 4
        assert _channelThreads() == before + 1
    finally:
        channel.close()
    _waitUntil(lambda: _channelThreads() == before, "the thread never ended")
