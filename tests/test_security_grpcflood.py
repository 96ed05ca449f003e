"""
One greedy gRPC caller against the real gateway (decisions D10): a client
with no credentials keeps 128 ValidateToken calls in flight on svc-auth's
gRPC port, on a connection of its own, while a paced stream of valid chat
requests goes through a real svc-proxy. svc-auth bounds the calls of one
connection and answers the excess RESOURCE_EXHAUSTED at once, so the
proxy's calls keep finding a thread: no valid request may get a 503, and
valid traffic keeps most of its throughput.

Before the bounds, the same flood made every valid request of its
duration fail with 503 (315 of 315): the flood's calls, each waiting up to
250 ms for a cold slot, filled grpcio's thread pool, and the proxy's calls
queued behind them past their deadline.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from authfixtures import Tenant
from gatewayfixtures import CHAT_BODY, Gateway, unlimitedGateway

from svcd.devkit.postgres import PostgresServer

# The flood runs in a process of its own, so that its work does not
# compete with the measuring threads for this interpreter's lock. One
# channel (one connection, one peer); every call is a well-formed PAT with
# a random token id, which costs svc-auth a database lookup and no argon2.
# A call that ends is replaced at once, so CONCURRENCY calls are always in
# flight. It stops by itself after its duration and prints the count of
# answers by status code.
FLOOD = r"""
import json, secrets, sys, threading, time, uuid
import grpc
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc
target, concurrency, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
channel = grpc.insecure_channel(target)
grpc.channel_ready_future(channel).result(timeout=10)
validate = auth_pb2_grpc.AuthServiceStub(channel).ValidateToken
counts = {}
lock = threading.Condition()
end = time.monotonic() + seconds
running = 0

def request():
    token = "svc_pat_%s_%s" % (uuid.uuid4(), secrets.token_urlsafe(32))
    return auth_pb2.ValidateTokenRequest(access_token=token)

def start():
    global running
    with lock:
        running += 1
    validate.future(request(), timeout=5).add_done_callback(done)

def done(call):
    global running
    code = call.code().name
    with lock:
        counts[code] = counts.get(code, 0) + 1
        running -= 1
        lock.notify_all()
    if time.monotonic() < end:
        start()

print("flooding", flush=True)
for _ in range(concurrency):
    start()
with lock:
    lock.wait_for(lambda: running == 0 and time.monotonic() >= end, timeout=seconds + 30)
print(json.dumps(counts), flush=True)
"""

CONCURRENCY = 128
FLOOD_SECONDS = 4.0
# Valid traffic: RATE chat requests a second, paced, over CLIENTS
# keep-alive connections, measured for MEASURE_SECONDS inside the flood.
# Each client has 160 ms for each of its requests, so what is measured is
# throughput: latency costs throughput only past that (before the bounds
# the flood made it 400 to 800 ms; after, a few tens of ms).
RATE = 100
CLIENTS = 16
MEASURE_SECONDS = 3.0
# What valid traffic must keep of its unflooded throughput. Generous: the
# flood and its client share this 2-core machine with both daemons,
# PostgreSQL and the measuring threads, so part of the loss is only CPU
# taken away; what the bounds prevent is the collapse (before them, about
# a fifth was left).
MINIMUM_RATIO = 0.5


# The latencies and throughput measured here are judged against the
# machine's own pace: with pytest-xdist's workers, these tests run last and
# alone (tests/conftest.py).
pytestmark = [pytest.mark.serial, pytest.mark.e2e]


@pytest.fixture(scope="module")
def gateway(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    # What is measured is whether the proxy's calls still find svc-auth
    # free to answer them, not this shared machine's scheduling: the flood's
    # client alone takes a good part of a core, and with the default 50 ms
    # deadline one hiccup turns a valid request into a 503 (as in
    # test_security_abuse). Before the bounds, the proxy's calls queued
    # behind the flood's for half a second, which the ratio shows.
    with unlimitedGateway(
        postgresServer, tmp_path_factory.mktemp("grpcflood"), SVC_AUTH_VALIDATE_TIMEOUT="1s"
    ) as running:
        yield running


@attrs.frozen
class Traffic:
    """
    What the valid clients saw: answers by HTTP status (0 for a connection
    failure), and each request's latency in seconds.
    """

    counts: dict[int, int]
    took: list[float]

    def describe(self) -> str:
        took = sorted(self.took)
        return (
            f"{self.counts}, p50 {took[len(took) // 2] * 1000:.1f} ms,"
            f" p99 {took[int(len(took) * 0.99)] * 1000:.1f} ms, max {took[-1] * 1000:.1f} ms"
        )


def pacedValidTraffic(port: int, tenant: Tenant, seconds: float) -> Traffic:
    """
    RATE valid chat requests a second for C{seconds} over CLIENTS
    connections, each request due at its slot (a late client does not
    catch up in a burst).
    """
    import http.client

    headers = {
        "Authorization": f"Bearer {tenant.token}",
        "X-SVC-Agent-ID": str(tenant.agentID),
        "Content-Type": "application/json",
    }
    counts: dict[int, int] = {}
    took: list[float] = []
    lock = threading.Lock()
    began = time.monotonic()
    interval = CLIENTS / RATE

    def client(offset: float) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        due = began + offset
        while True:
            now = time.monotonic()
            if now >= began + seconds:
                break
            if due > now:
                time.sleep(due - now)
            due = max(due + interval, time.monotonic())
            started = time.monotonic()
            try:
                connection.request("POST", "/v1/chat/completions", CHAT_BODY, headers)
                response = connection.getresponse()
                response.read()
                status = response.status
            except OSError:
                status = 0
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            with lock:
                counts[status] = counts.get(status, 0) + 1
                took.append(time.monotonic() - started)
        connection.close()

    threads = [
        threading.Thread(target=client, args=(index * interval / CLIENTS,))
        for index in range(CLIENTS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Traffic(counts, took)


def flooding(gateway: Gateway) -> Any:
    """
    Start the flood process on svc-auth's gRPC port; returns once its
    channel is connected and its calls are going out.
    """
    flood = subprocess.Popen(
        [
            sys.executable,
            "-c",
            FLOOD,
            f"127.0.0.1:{gateway.auth.environment['SVC_GRPC_PORT']}",
            str(CONCURRENCY),
            str(FLOOD_SECONDS),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert flood.stdout is not None
    assert flood.stdout.readline().strip() == "flooding"
    return flood


def test_greedyGrpcCallerCannotTakeTheGatewayDown(gateway: Gateway) -> None:
    """
    With 128 concurrent ValidateToken calls of made-up tokens on one
    connection of their own, valid chat requests through the proxy get no
    503 (every one is the Phase 1 answer, 501) and keep at least half of
    their throughput without the flood; the flood's excess is refused at
    once.
    """
    main = gateway.tenants["main"]
    warm = pacedValidTraffic(gateway.port, main, 0.5)
    assert set(warm.counts) == {501}, warm
    quiet = pacedValidTraffic(gateway.port, main, MEASURE_SECONDS)
    flood = flooding(gateway)
    try:
        time.sleep(0.3)
        loud = pacedValidTraffic(gateway.port, main, MEASURE_SECONDS)
        out, _ = flood.communicate(timeout=60)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()
    floodCounts = json.loads(out)
    ratio = loud.counts.get(501, 0) / quiet.counts[501]
    print(
        f"\nvalid alone, {MEASURE_SECONDS}s: {quiet.describe()}\nwith {CONCURRENCY} concurrent"
        f" bad calls ({sum(floodCounts.values()) / FLOOD_SECONDS:.0f} answered/s,"
        f" {floodCounts}): {loud.describe()}\nthroughput ratio {ratio:.2f}"
    )
    assert set(quiet.counts) == {501}, quiet
    assert set(loud.counts) == {501}, loud
    assert ratio >= MINIMUM_RATIO, (quiet, loud)
    # The flood's own answers: lookups of its made-up tokens, and its excess
    # refused at once, by the per-connection count (RESOURCE_EXHAUSTED) or
    # by HTTP/2's stream limit before any Python runs (UNAVAILABLE).
    assert set(floodCounts) <= {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
    refused = floodCounts.get("RESOURCE_EXHAUSTED", 0) + floodCounts.get("UNAVAILABLE", 0)
    assert refused > 0, floodCounts
    # The flood's own answers: lookups of its made-up tokens, and its excess
    # refused at once, by the per-connection count (RESOURCE_EXHAUSTED) or
    # by HTTP/2's stream limit before any Python runs (UNAVAILABLE).
    assert set(floodCounts) <= {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
    refused = floodCounts.get("RESOURCE_EXHAUSTED", 0) + floodCounts.get("UNAVAILABLE", 0)
    assert refused > 0, floodCounts
