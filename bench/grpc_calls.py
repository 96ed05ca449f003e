"""
What one unary grpcio call costs a busy Twisted reactor, made four ways:

    python bench/grpc_calls.py [--work-us 600] [--in-flight 32] [--seconds 5]
        [--rounds 2]

    future   stub.future() on the reactor's thread, its outcome handed back
             with callFromThread (svcd/common/grpcdefer.py: what svc-proxy
             does for svc-auth and svc-memory)
    held     the same, with one more call held open on the channel all the
             while, so that grpcio never ends the channel's completion
             thread (it ends it whenever no call is in flight, and starts a
             new one for the next call)
    workers  blocking calls (stub(...)) on as many threads as calls in
             flight, fed from a queue, their outcomes handed back with
             callFromThread: no completion thread at all
    aio      grpc.aio's call on Twisted's asyncio reactor (the only reactor
             grpc.aio runs on), awaited as a Deferred (Deferred.fromFuture):
             grpcio's events reach the loop through a socket, and no Python
             runs on grpcio's threads

Starts a trivial grpcio server (an echo of 3,000 bytes, the size of a
768-dimension query) in a process of its own, then, for each way in turn,
a client process whose reactor keeps --in-flight calls going and spends
--work-us of Python on the reactor's thread after each answer, as a
proxy's request would: with enough in flight the reactor is the bound, and
calls/s say what each call costs it ((1e6 / calls per second) - work, in
microseconds of the reactor's time). Prints calls/s, p50 and the CPU per
call of the process and of the reactor's thread alone, each way --rounds
times, alternating. A measurement, not a test: compare ways within one run.
"""

from __future__ import annotations

import argparse
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from concurrent import futures
from typing import Any

import grpc

SERVICE = "bench.Echo"
PAYLOAD_BYTES = 3_000
WAYS = ("future", "held", "workers", "aio")


def serve(port: int) -> None:
    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    def hold(request: bytes, context: grpc.ServicerContext) -> bytes:
        # Answers when the client goes away.
        stopped = threading.Event()
        context.add_callback(stopped.set)
        stopped.wait()
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Hold": grpc.unary_unary_rpc_method_handler(hold),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def client(port: int, way: str, inFlight: int, seconds: float, workSeconds: float) -> None:
    if way == "aio":
        import asyncio

        from twisted.internet import asyncioreactor

        eventLoop = asyncio.new_event_loop()
        asyncio.set_event_loop(eventLoop)
        asyncioreactor.install(eventLoop)
    else:
        from twisted.internet import epollreactor

        epollreactor.install()
    from twisted.internet import reactor
    from twisted.internet.defer import Deferred

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=10)
    echo = channel.unary_unary(f"/{SERVICE}/Echo", _registered_method=True)
    payload = os.urandom(PAYLOAD_BYTES)
    held = None
    if way == "held":
        held = channel.unary_unary(f"/{SERVICE}/Hold").future(b"", timeout=3600)
    asked: queue.SimpleQueue[Deferred[bytes]] = queue.SimpleQueue()

    def work() -> None:
        while True:
            answer = asked.get()
            try:
                reactor.callFromThread(answer.callback, echo(payload, timeout=5.0))  # type: ignore[attr-defined]
            except grpc.RpcError as error:
                reactor.callFromThread(answer.errback, error)  # type: ignore[attr-defined]

    if way == "workers":
        for _ in range(inFlight):
            threading.Thread(target=work, daemon=True).start()

    def deliver(answer: Deferred[bytes], future: Any) -> None:
        error = future.exception()
        if error is not None:
            answer.errback(error)
        else:
            answer.callback(future.result())

    if way == "aio":
        aioChannel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        aioEcho = aioChannel.unary_unary(f"/{SERVICE}/Echo", _registered_method=True)

    def call() -> Deferred[bytes]:
        if way == "aio":
            return Deferred.fromFuture(asyncio.ensure_future(aioEcho(payload, timeout=5.0)))
        answer: Deferred[bytes] = Deferred()
        if way == "workers":
            asked.put(answer)
            return answer
        future = echo.future(payload, timeout=5.0)
        future.add_done_callback(
            lambda done: reactor.callFromThread(deliver, answer, done)  # type: ignore[attr-defined]
        )
        return answer

    state: dict[str, Any] = {"measuring": False, "calls": 0, "latencies": []}

    def loop() -> None:
        began = time.perf_counter()

        def answered(_: bytes) -> None:
            if state["measuring"]:
                state["calls"] += 1
                state["latencies"].append(time.perf_counter() - began)
            # The rest of a request's work on the reactor's thread.
            until = time.perf_counter() + workSeconds
            while time.perf_counter() < until:
                sum(range(50))
            loop()

        call().addCallback(answered)

    def begin() -> None:
        state.update(
            measuring=True,
            began=time.perf_counter(),
            cpu=time.process_time(),
            thread=resource.getrusage(resource.RUSAGE_THREAD),
        )

    def end() -> None:
        elapsed = time.perf_counter() - state["began"]
        cpu = time.process_time() - state["cpu"]
        now = resource.getrusage(resource.RUSAGE_THREAD)
        before = state["thread"]
        reactorCPU = (now.ru_utime + now.ru_stime) - (before.ru_utime + before.ru_stime)
        calls = state["calls"]
        latencies = sorted(state["latencies"])
        print(
            f"{way:8} in flight {inFlight:3}  calls/s {calls / elapsed:7.0f}"
            f"  p50 {latencies[len(latencies) // 2] * 1000:7.3f} ms"
            f"  CPU/call: process {cpu / calls * 1e6:5.0f} µs,"
            f" reactor's thread {reactorCPU / calls * 1e6:5.0f} µs",
            flush=True,
        )
        if held is not None:
            held.cancel()
        reactor.stop()

    for _ in range(inFlight):
        loop()
    reactor.callLater(1.0, begin)
    reactor.callLater(1.0 + seconds, end)
    reactor.run()
    # Threads blocked in grpcio: leave without waiting for them.
    os._exit(0)


def freePort() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-us", type=float, default=600.0)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=2, metavar=("PORT", "WAY"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve is not None:
        serve(arguments.serve)
        return 0
    common = [
        "--in-flight",
        str(arguments.in_flight),
        "--seconds",
        str(arguments.seconds),
        "--work-us",
        str(arguments.work_us),
    ]
    if arguments.client is not None:
        port, way = arguments.client
        client(int(port), way, arguments.in_flight, arguments.seconds, arguments.work_us / 1e6)
        return 0
    port = freePort()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])

    def run(way: str) -> int:
        return subprocess.call([sys.executable, __file__, "--client", str(port), way, *common])

    try:
        time.sleep(1.0)
        for _ in range(arguments.rounds):
            for way in arguments.ways.split(","):
                if run(way) != 0:
                    return 1
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
