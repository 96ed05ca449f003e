"""
grpcio's transport settled by importing svcd (svcd/common/grpcruntime.py):
the default when the environment names no experiments, an operator's own
value kept, and grpcio still knowing every experiment it turns off (a
grpcio that does not logs "Unknown experiment" at import: an upgrade must
revisit the setting then); and a channel finding its restarted server
promptly (keepConnecting).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc

from svcd.common.grpcruntime import GRPC_EXPERIMENTS, POLLING_THREAD_READS, settleGrpcTransport
from svcd.devkit.servers import freePort
from svcd.memoryclient.channel import memoryChannel

# A fresh interpreter: grpcio reads the variable once, at its import.
_PROBE = "import os, svcd, grpc; print(os.environ['GRPC_EXPERIMENTS'])"


def _probe(environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def _without(name: str) -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != name}


def test_theDefaultIsSetWhenNoneIsNamed() -> None:
    environ: dict[str, str] = {}
    settleGrpcTransport(environ)
    assert environ == {GRPC_EXPERIMENTS: POLLING_THREAD_READS}


def test_anOperatorsValueIsKept() -> None:
    for theirs in ("", "-event_engine_listener", "event_engine_dns"):
        environ = {GRPC_EXPERIMENTS: theirs}
        settleGrpcTransport(environ)
        assert environ == {GRPC_EXPERIMENTS: theirs}


def test_importingSvcdSettlesItBeforeGrpcio() -> None:
    """
    In a process that imports svcd and then grpcio, as every daemon and
    svcctl does, the variable is the default when grpcio reads it, and
    grpcio knows each experiment named (it says nothing on stderr).
    """
    done = _probe(_without(GRPC_EXPERIMENTS))
    assert done.stdout.strip() == POLLING_THREAD_READS
    assert "experiment" not in done.stderr.lower(), done.stderr
    for experiment in POLLING_THREAD_READS.split(","):
        assert experiment.startswith("-event_engine_")


def test_grpcioNamesAnUnknownExperiment() -> None:
    """
    The check above can fail: grpcio does say so of an experiment it does
    not know.
    """
    environment = _without(GRPC_EXPERIMENTS)
    environment[GRPC_EXPERIMENTS] = "-no_such_experiment_of_svc"
    done = _probe(environment)
    assert done.stdout.strip() == "-no_such_experiment_of_svc"
    assert "Unknown experiment: no_such_experiment_of_svc" in done.stderr


# A grpcio server of its own process (so that nothing of this process
# polls for it): echoes every unary call, says "up" once it listens.
_SERVER = """
import sys, time, grpc
from concurrent import futures
class Echo(grpc.GenericRpcHandler):
    def service(self, details):
        return grpc.unary_unary_rpc_method_handler(lambda request, context: request)
server = grpc.server(futures.ThreadPoolExecutor(2))
server.add_generic_rpc_handlers((Echo(),))
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
print("up", flush=True)
time.sleep(600)
"""


def _serve(port: int) -> subprocess.Popen[bytes]:
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)], stdout=subprocess.PIPE)
    assert server.stdout is not None
    assert server.stdout.readline() == b"up\n"
    return server


def test_aRestartedServerIsFoundPromptly() -> None:
    """
    A channel of svc's (memoryChannel: keepConnecting, the options of
    every client) whose server is killed, then started again on its port
    three seconds later, while calls that fail at once are made every
    10 ms: the first call to succeed comes well within the second that
    reconnection is promised in (measured 0.1 to 0.4 s; grpcio's older
    client without the watch took 1.9 to 4.4 s).
    """
    port = freePort()
    server = _serve(port)
    channel = memoryChannel(f"127.0.0.1:{port}")
    echo = channel.unary_unary("/svc.test.Echo/E")

    def answered() -> bool:
        try:
            return bool(echo(b"ping", timeout=0.5) == b"ping")
        except grpc.RpcError:
            return False

    try:
        assert answered()
        server.kill()
        server.wait(10)
        down = time.monotonic()
        while time.monotonic() - down < 3.0:
            assert not answered()
            time.sleep(0.01)
        server = _serve(port)
        back = time.monotonic()
        while not answered():
            assert time.monotonic() - back < 10.0, "never reconnected"
            time.sleep(0.01)
        assert time.monotonic() - back < 1.5
    finally:
        channel.close()
        server.kill()
        server.wait(10)
