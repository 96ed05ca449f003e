"""
Abuse through the real gateway: a flood of well-formed tokens with wrong
secrets or unknown ids does not slow valid traffic by more than 2x, and a
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

import pytest
from authfixtures import Tenant
from test_gateway_e2e import CHAT_BODY, Gateway, assertEnvelope, chat, unlimitedGateway

from svcd.auth.authority import issueToken
from svcd.testing.servers import PostgresServer

# The flood runs in a process of its own, so that its threads do not
# compete with the measuring client for this interpreter's lock. It sends
# chat requests with bearers of the right format that svc-auth must
# refuse: unknown token ids, wrong secrets for the valid token svc-auth
# has cached, and wrong secrets for a real token it has not (each a cold
# argon2 verification). It stops by itself after its duration.
FLOOD = r"""
import http.client, json, sys, threading, time, uuid, secrets
port, agent, valid, cached, cold, seconds, threads, rate = sys.argv[1:9]
seconds, threads, rate = float(seconds), int(threads), float(rate)
counts = {}
lock = threading.Lock()
body = b'{"model":"m","messages":[{"role":"user","content":"x"}]}'

def bearer(n):
    if valid != "-":
        return valid
    tokenID = (uuid.uuid4(), uuid.UUID(cached), uuid.UUID(cold))[n % 3]
    return "svc_pat_%s_%s" % (tokenID, secrets.token_urlsafe(32))

def run():
    connection = http.client.HTTPConnection("127.0.0.1", int(port), timeout=5)
    began = time.monotonic()
    n = 0
    while time.monotonic() - began < seconds:
        n += 1
        # Paced: request n of this thread is due at began + n / (rate / threads).
        delay = began + n * threads / rate - time.monotonic()
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

workers = [threading.Thread(target=run) for _ in range(threads)]
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


FLOOD_SECONDS = 3.0
MEASURE_SECONDS = 2.5
# The flood's rate: 200 bad requests a second, about as many as the one
# valid client sends alone. An unpaced flood from this same 2-core machine
# would measure mostly the flooding client's own CPU, not the gateway's
# defences; the control run with valid tokens at the same rate shows what
# any traffic of that rate costs here.
FLOOD_RATE = 200
# A shared 2-core machine is noisy: a trial is a quiet run then a flooded
# one, and the claim holds when one of up to three trials shows it. A
# systematic slowdown past 2x fails all three.
TRIALS = 3


def flooding(gateway: Gateway, bearer: str, cached: Tenant, coldID: str) -> Any:
    """
    Start the flood process: C{bearer} for every request, or bad tokens
    when it is "-"; FLOOD_RATE requests a second over 4 connections.
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
            str(FLOOD_SECONDS),
            "4",
            str(FLOOD_RATE),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def measuredUnder(
    gateway: Gateway, flood: Any, tenant: Tenant
) -> tuple[list[float], dict[int, int]]:
    try:
        time.sleep(0.3)
        took = latencies(gateway.port, tenant, MEASURE_SECONDS)
        out, _ = flood.communicate(timeout=30)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()
    return took, {int(status): count for status, count in json.loads(out).items()}


def describe(took: list[float]) -> str:
    return (
        f"{len(took) / MEASURE_SECONDS:.0f}/s, p50 {statistics.median(took) * 1000:.2f} ms, "
        f"p90 {percentile(took, 0.9) * 1000:.2f} ms"
    )


def test_badTokenFloodDoesNotSlowValidTraffic(gateway: Gateway) -> None:
    """
    Valid requests' median latency with a concurrent flood of bad tokens
    (unknown ids, wrong secrets for a cached token, wrong secrets for an
    uncached one; each refused 401, or 503 when svc-auth sheds cold
    verifications) is at most twice their median without it, and no valid
    request fails. A control flood of valid tokens at the same rate is
    measured too, for the report.
    """
    main = gateway.tenants["main"]
    cold, _ = issueToken(gateway.owner, orgID=main.orgID, permissions=1)
    coldID = cold[len("svc_pat_") : len("svc_pat_") + 36]
    assert chat(gateway.port, main).status == 501  # svc-auth caches the valid token
    latencies(gateway.port, main, 0.5)  # warm up

    report = []
    ratios = []
    for trial in range(TRIALS):
        quiet = latencies(gateway.port, main, MEASURE_SECONDS)
        loud, counts = measuredUnder(gateway, flooding(gateway, "-", main, coldID), main)
        flooded = sum(counts.values())
        assert flooded > FLOOD_RATE * FLOOD_SECONDS * 0.8, counts
        assert set(counts) <= {401, 503} and counts.get(401, 0) > flooded * 0.9, counts
        ratios.append(statistics.median(loud) / statistics.median(quiet))
        report.append(
            f"trial {trial + 1}: valid alone {describe(quiet)}; with {flooded / FLOOD_SECONDS:.0f}"
            f" bad tokens/s {counts}: {describe(loud)}; p50 ratio {ratios[-1]:.2f}, p90 ratio "
            f"{percentile(loud, 0.9) / percentile(quiet, 0.9):.2f}"
        )
        if ratios[-1] <= 2.0:
            break
    control, controlCounts = measuredUnder(
        gateway, flooding(gateway, main.token, main, coldID), main
    )
    assert set(controlCounts) == {501}, controlCounts
    report.append(
        f"control, {sum(controlCounts.values()) / FLOOD_SECONDS:.0f} valid tokens/s: "
        f"{describe(control)}"
    )
    print("\n" + "\n".join(report))
    assert min(ratios) <= 2.0, report


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
