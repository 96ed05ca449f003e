"""
Abuse through the real gateway: a flood of well-formed tokens with wrong
secrets or unknown ids does not slow valid traffic by more than 1.5x, and a
flood of requests of one organization never touches another
organization's rate limit. Traffic goes to 127.0.0.1 only, bounded in
count and time.
"""

from __future__ import annotations

import http.client
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from authfixtures import Tenant
from test_gateway_e2e import CHAT_BODY, Gateway, assertEnvelope, chat, unlimitedGateway

from svcd.auth.authority import issueToken
from svcd.testing.servers import PostgresServer

# The flood runs in a process of its own, so that its threads do not
# compete with the measuring client for this interpreter's lock. It sends
# chat requests with bearers of the right format that must be refused:
# wrong secrets for a real token svc-auth has not verified (each would be
# a cold argon2 verification: the flood of the previous round, which
# slowed valid traffic 3.8 times), wrong secrets for the valid token
# svc-auth has cached, and unknown token ids. It floods in alternate
# seconds (on during [start + 2k, start + 2k + 1)), paced, and stops by
# itself after its duration.
FLOOD = r"""
import http.client, json, sys, threading, time, uuid, secrets
port, agent, valid, cached, cold, start, seconds, threads, rate = sys.argv[1:10]
start, seconds, threads, rate = float(start), float(seconds), int(threads), float(rate)
counts = {}
lock = threading.Lock()
body = b'{"model":"m","messages":[{"role":"user","content":"x"}]}'

def bearer(n):
    if valid != "-":
        return valid
    kind = n % 4
    tokenID = uuid.UUID(cold) if kind < 2 else (uuid.UUID(cached), uuid.uuid4())[kind - 2]
    return "svc_pat_%s_%s" % (tokenID, secrets.token_urlsafe(32))

def run(offset):
    connection = http.client.HTTPConnection("127.0.0.1", int(port), timeout=5)
    n = offset
    due = start + offset / rate
    while due < start + seconds:
        n += threads
        # Only in the flooding seconds.
        if int(due - start) % 2 == 0:
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)
            try:
                connection.request("POST", "/v1/chat/completions", body=body, headers={
                    "Authorization": "Bearer " + bearer(n), "X-SVC-Agent-ID": agent,
                    "Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()
                status = response.status
            except OSError:
                status = 0
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", int(port), timeout=5)
            with lock:
                counts[status] = counts.get(status, 0) + 1
        due += threads / rate

workers = [threading.Thread(target=run, args=(offset,)) for offset in range(threads)]
for worker in workers:
    worker.start()
for worker in workers:
    worker.join()
print(json.dumps(counts))
"""


@pytest.fixture(scope="module")
def gateway(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    # What is measured here is how much slower valid requests get, so a
    # valid request must never fail for a reason other than the flood: with
    # the default 50 ms deadline, one scheduling hiccup of this shared
    # 2-core machine (the flood, its client and both daemons share it) was
    # enough to turn a valid request into a 503 and fail the run. The
    # deadline's own behaviour is covered by the fault tests.
    with unlimitedGateway(
        postgresServer, tmp_path_factory.mktemp("abuse"), SVC_AUTH_VALIDATE_TIMEOUT="1s"
    ) as running:
        yield running


def latencies(port: int, tenant: Tenant, seconds: float) -> list[float]:
    """
    Valid chat requests one after another on one keep-alive connection for
    C{seconds}; each must be the Phase 1 answer.
    """
    headers = {
        "Authorization": f"Bearer {tenant.token}",
        "X-SVC-Agent-ID": str(tenant.agentID),
        "Content-Type": "application/json",
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    took = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            started = time.perf_counter()
            connection.request("POST", "/v1/chat/completions", body=CHAT_BODY, headers=headers)
            response = connection.getresponse()
            response.read()
            took.append(time.perf_counter() - started)
            assert response.status == 501, response.status
    finally:
        connection.close()
    return took


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


ROUNDS = 4
# The flood's rate in its seconds: 300 bad requests a second, the previous
# round's flood. An unpaced flood from this same 2-core machine would
# measure mostly the flooding client's own CPU, not the gateway's
# defences; the control flood with a valid token at the same rate shows
# what any traffic of that rate costs here.
FLOOD_RATE = 300
# Threads sharing the pace: an unknown token id waits about a fifth of a
# second for its 401, so the flood needs many requests in flight.
FLOOD_THREADS = 48
# Samples within this long of a switch between quiet and flooded seconds
# belong to neither.
EDGE = 0.15


def flooding(gateway: Gateway, bearer: str, cached: Tenant, coldID: str, start: float) -> Any:
    """
    Start the flood process: C{bearer} for every request, or bad tokens
    when it is "-", in the even seconds from C{start} (Unix time).
    """
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            FLOOD,
            str(gateway.port),
            str(cached.agentID),
            bearer,
            str(cached.tokenID),
            coldID,
            str(start),
            str(2 * ROUNDS),
            str(FLOOD_THREADS),
            str(FLOOD_RATE),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def alternating(gateway: Gateway, bearer: str, tenant: Tenant, coldID: str) -> Alternation:
    """
    Valid requests one after another while the flood runs in alternate
    seconds; their latencies split into the quiet and the flooded seconds,
    and the flood's own answers.
    """
    start = time.time() + 1.0
    flood = flooding(gateway, bearer, tenant, coldID, start)
    headers = {
        "Authorization": f"Bearer {tenant.token}",
        "X-SVC-Agent-ID": str(tenant.agentID),
        "Content-Type": "application/json",
    }
    quiet: list[float] = []
    loud: list[float] = []
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=5)
    try:
        while time.time() < start:
            time.sleep(0.01)
        while (now := time.time()) < start + 2 * ROUNDS:
            began = time.perf_counter()
            connection.request("POST", "/v1/chat/completions", body=CHAT_BODY, headers=headers)
            response = connection.getresponse()
            response.read()
            took = time.perf_counter() - began
            assert response.status == 501, response.status
            phase = now - start
            if EDGE < phase % 1.0 < 1.0 - EDGE:
                (loud if int(phase) % 2 == 0 else quiet).append(took)
        out, _ = flood.communicate(timeout=60)
    finally:
        connection.close()
        if flood.poll() is None:
            flood.kill()
            flood.wait()
    counts = {int(status): count for status, count in json.loads(out).items()}
    return Alternation(quiet, loud, counts)


@attrs.frozen
class Alternation:
    quiet: list[float]
    loud: list[float]
    counts: dict[int, int]

    @property
    def ratio(self) -> float:
        return statistics.median(self.loud) / statistics.median(self.quiet)

    def describe(self) -> str:
        return (
            f"quiet p50 {statistics.median(self.quiet) * 1000:.2f} ms ({len(self.quiet)}),"
            f" flooded p50 {statistics.median(self.loud) * 1000:.2f} ms ({len(self.loud)}),"
            f" p50 ratio {self.ratio:.2f}, p90 ratio "
            f"{percentile(self.loud, 0.9) / percentile(self.quiet, 0.9):.2f};"
            f" flood answers {self.counts}"
        )


def test_badTokenFloodDoesNotSlowValidTraffic(gateway: Gateway) -> None:
    """
    Valid requests' median latency during 300 bad bearers a second (wrong
    secrets for a real token svc-auth has not verified, each a cold argon2
    verification without the proxy's failure budget; wrong secrets for a
    cached token; unknown token ids), measured in alternate seconds against
    the seconds without it, stays within 1.5 times; every bad bearer is
    refused 401 and no valid request fails. A control flood of valid
    tokens at the same rate is measured too, for the report.
    """
    main = gateway.tenants["main"]
    cold, _ = issueToken(gateway.owner, orgID=main.orgID, permissions=1)
    coldID = cold[len("svc_pat_") : len("svc_pat_") + 36]
    assert chat(gateway.port, main).status == 501  # svc-auth caches the valid token
    latencies(gateway.port, main, 0.5)  # warm up

    flooded = alternating(gateway, "-", main, coldID)
    control = alternating(gateway, main.token, main, coldID)
    print(f"\nbad bearers: {flooded.describe()}\ncontrol, valid bearers: {control.describe()}")
    sent = sum(flooded.counts.values())
    assert sent > FLOOD_RATE * ROUNDS * 0.8, flooded.counts
    assert set(flooded.counts) == {401}, flooded.counts
    assert set(control.counts) == {501}, control.counts
    assert flooded.ratio <= 1.5, flooded.describe()


def test_oneOrganizationsFloodLeavesAnothersLimitAlone(gateway: Gateway) -> None:
    """
    An organization limited to 3 requests a minute floods the proxy and is
    refused 429; meanwhile another organization's X-RateLimit-Remaining
    counts its own requests only and it is never refused.
    """
    limited, other = gateway.tenants["limited"], gateway.tenants["other"]
    secondsLeft = 60 - time.time() % 60
    if secondsLeft < 8:
        time.sleep(secondsLeft + 0.2)
    first = chat(gateway.port, other)
    assert first.status == 501
    remaining = int(first.headers["x-ratelimit-remaining"])
    reset = first.headers["x-ratelimit-reset"]
    statuses = []
    for round_ in range(1, 21):
        for _ in range(10):
            statuses.append(chat(gateway.port, limited).status)
        answer = chat(gateway.port, other)
        assertEnvelope(answer, 501, "PROVIDER_NOT_CONFIGURED")
        if answer.headers["x-ratelimit-reset"] == reset:
            assert int(answer.headers["x-ratelimit-remaining"]) == remaining - round_
    assert statuses.count(429) >= len(statuses) - 3
    assert set(statuses) == {501, 429}
