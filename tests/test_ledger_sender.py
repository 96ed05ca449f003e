"""
The ledger's sender (L{svcd.ledger.sender.LedgerSender}) on a connection
of its own (L{svcd.authclient}) against a real svc-auth (its assembly on a
real grpcio server, a real PostgreSQL): what svc-worker (decisions D13)
will hold to write ledger rows and read a budget's spend, without svc-proxy.

The first test runs the sender in a fresh interpreter that imports no
module of svcd.proxy, so the code path is proven free of it, not only the
imports (test_packages_standalone.py checks those for every module).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_twisted
from authfixtures import makeTenant
from authhelpers import JUNE, microseconds, usageRow
from authservice import RunningAuthService
from twisted.internet.interfaces import IReactorFromThreads

from svcd.auth.store import Store
from svcd.authclient.channel import authChannel
from svcd.authclient.connection import AuthConnection
from svcd.ledger.sender import LedgerSender
from svcd.pb.auth.v1 import auth_pb2

ROOT = Path(__file__).resolve().parents[1]

# The rows' hour: their spend is read over [SINCE, UNTIL).
SINCE = int(JUNE.timestamp())
UNTIL = SINCE + 24 * 3600
AT = microseconds(JUNE + datetime.timedelta(hours=1))

# Run in a fresh interpreter: argv is svc-auth's address, a serialized
# RecordUsageRequest in hex, the organization and the agent. Prints what
# the sender got and which modules of svcd.proxy were loaded.
_SEND = """
import json, sys

import grpc
from twisted.internet.defer import ensureDeferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import react

from svcd.authclient.channel import authChannel
from svcd.authclient.connection import AuthConnection
from svcd.ledger.sender import LedgerSender
from svcd.pb.auth.v1 import auth_pb2

address, request, org, agent, since, until = sys.argv[1:]
since, until = int(since), int(until)
rows = auth_pb2.RecordUsageRequest.FromString(bytes.fromhex(request)).rows


async def main(reactor):
    connection = AuthConnection(
        lambda: authChannel(address), IReactorFromThreads(reactor), reactor
    )
    connection.start()
    # The channel's first handshake, waited for with a bound: a machine
    # whose cores are busy may take seconds to make it, longer than a
    # call's deadline, and what is tested is the sender, not that race.
    grpc.channel_ready_future(connection.startedChannel()).result(timeout=30)
    try:
        sender = LedgerSender(connection)
        first = await sender.recordUsage(rows)
        again = await sender.recordUsage(rows)
        spend = [
            await sender.getSpend(org, None, since, until),
            await sender.getSpend(org, agent, since, until),
        ]
    finally:
        connection.close()
    proxy = sorted(m for m in sys.modules if m == "svcd.proxy" or m.startswith("svcd.proxy."))
    print(json.dumps({
        "first": [first.recorded, first.duplicates, len(first.rejected)],
        "again": [again.recorded, again.duplicates, len(again.rejected)],
        "spend": spend,
        "proxy": proxy,
    }))


react(lambda reactor: ensureDeferred(main(reactor)))
"""


def test_senderRecordsAndReadsSpendWithoutTheProxy(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    In a process that never imports svcd.proxy, the sender records rows
    in svc-auth's ledger (sent again, they are duplicates) and reads back
    what the organization and one of its agents spent.
    """
    tenant = makeTenant(owner)
    otherAgent = owner.createAgent(tenant.orgID, "other").agentID
    rows = [
        usageRow(tenant, cost_nano_usd=1_000, started_at_us=AT),
        usageRow(tenant, cost_nano_usd=20, started_at_us=AT),
        usageRow(tenant, agent_id=str(otherAgent), cost_nano_usd=300, started_at_us=AT),
    ]
    request = auth_pb2.RecordUsageRequest(rows=rows).SerializeToString().hex()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _SEND,
            f"127.0.0.1:{authService.port}",
            request,
            str(tenant.orgID),
            str(tenant.agentID),
            str(SINCE),
            str(UNTIL),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer == {
        "first": [3, 0, 0],
        "again": [0, 3, 0],
        "spend": [1_320, 1_020],
        "proxy": [],
    }


@pytest.fixture
def sender(authService: RunningAuthService) -> Iterator[LedgerSender]:
    from twisted.internet import reactor

    connection = AuthConnection(
        lambda: authChannel(f"127.0.0.1:{authService.port}"), IReactorFromThreads(reactor), reactor
    )
    connection.start()
    yield LedgerSender(connection)
    connection.close()


@pytest_twisted.ensureDeferred
async def test_rejectedRowsAreListedByIndex(sender: LedgerSender, owner: Store) -> None:
    """
    A row svc-auth cannot hold comes back in the answer's C{rejected} by
    its index (what the outbox sets aside), the others are recorded, and
    only their cost is spent; another organization spent nothing.
    """
    tenant = makeTenant(owner)
    rows = [
        usageRow(tenant, cost_nano_usd=5, started_at_us=AT),
        usageRow(tenant, cost_nano_usd=7, started_at_us=AT, prompt_tokens=-1),
        usageRow(tenant, cost_nano_usd=11, started_at_us=AT),
    ]
    answer = await sender.recordUsage(rows)
    assert (answer.recorded, answer.duplicates) == (2, 0)
    assert [(each.index, each.reason) for each in answer.rejected] == [(1, "invalid")]
    assert await sender.getSpend(str(tenant.orgID), None, SINCE, UNTIL) == 16
    assert await sender.getSpend(str(uuid.uuid4()), None, SINCE, UNTIL) == 0
