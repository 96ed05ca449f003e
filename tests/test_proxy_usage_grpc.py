"""
The usage outbox over a real gRPC link (decisions D12): the real
LedgerSender.recordUsage against a real grpcio server whose RecordUsage
keeps rows by ledger key (L{fakeauth.LedgerAuth}). Every row
arrives exactly once and in order, also when the server fails the first
attempts with UNAVAILABLE, and when it hangs past the client's deadline
(the batch is sent again; the late commit makes the retry a duplicate).
And the sender shares the proxy's one channel to svc-auth, and its slots,
with the validations.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_twisted
from fakeauth import LedgerAuth, servingAuth
from google.protobuf import json_format
from proxydoubles import newToken
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IReactorFromThreads

from svcd.authclient.channel import CHANNEL_OPTIONS
from svcd.authclient.connection import AuthConnection
from svcd.ledger.journal import Journal
from svcd.ledger.outbox import Outbox
from svcd.ledger.sender import LedgerSender
from svcd.pb.auth.v1 import auth_pb2
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.validation.client import GrpcAuthClient

# Each test's bound on the flush that waits for every row: far above what
# it takes, a bound against a hang, not a promise.
FLUSH_BOUND = 30.0


def row(number: int) -> auth_pb2.UsageRow:
    return auth_pb2.UsageRow(
        request_id=f"0190c6a2-0000-7000-8000-{number:012d}",
        org_id="0190c6a2-0000-7000-8000-00000000000a",
        outcome="ok",
        prompt_tokens=number,
    )


# The client's deadline on RecordUsage in these tests: short, so that the
# deadline tests are quick; the tests of delivery itself use a patient one
# (a batch of 500 rows past 0.3 s on a loaded machine is sent again, as it
# should be, which is not what they count).
SHORT_USAGE_TIMEOUT = 0.3
PATIENT_USAGE_TIMEOUT = 5.0


@contextlib.contextmanager
def ledgerSender(port: int, usageTimeout: float) -> Iterator[LedgerSender]:
    """
    The ledger's sender on a started connection of its own to svc-auth on
    C{port}.
    """
    from twisted.internet import reactor

    connection = AuthConnection(
        lambda: grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS),
        IReactorFromThreads(reactor),
        reactor,
    )
    connection.start()
    try:
        yield LedgerSender(connection, usageTimeout=usageTimeout)
    finally:
        connection.close()


@contextlib.asynccontextmanager
async def ledgerClient(
    usageTimeout: float,
) -> AsyncIterator[tuple[LedgerAuth, LedgerSender, ProxyMetrics]]:
    servicer = LedgerAuth()
    with servingAuth(servicer, workers=8) as port, ledgerSender(port, usageTimeout) as sender:
        yield servicer, sender, ProxyMetrics()


@pytest_twisted.async_yield_fixture
async def ledger() -> AsyncIterator[tuple[LedgerAuth, LedgerSender, ProxyMetrics]]:
    async with ledgerClient(SHORT_USAGE_TIMEOUT) as parts:
        yield parts


@pytest_twisted.async_yield_fixture
async def patientLedger() -> AsyncIterator[tuple[LedgerAuth, LedgerSender, ProxyMetrics]]:
    async with ledgerClient(PATIENT_USAGE_TIMEOUT) as parts:
        yield parts


def outboxOf(client: LedgerSender, metrics: ProxyMetrics) -> Outbox:
    from twisted.internet import reactor

    outbox = Outbox(client, reactor, metrics, firstRetry=0.05, lastRetry=0.5)
    outbox.start()
    return outbox


async def sendAll(outbox: Outbox, count: int) -> None:
    for number in range(1, count + 1):
        outbox.record(row(number))
    assert await outbox.flush(FLUSH_BOUND) == 0


def expected(count: int) -> list[str]:
    return [row(number).request_id for number in range(1, count + 1)]


@pytest_twisted.ensureDeferred
async def test_rowsArriveOnceInOrder(patientLedger: Any) -> None:
    """
    1,200 rows recorded in one go reach svc-auth once each, in order, in
    batches of at most 500; svc_proxy_usage_rows_sent_total counts them.
    (With the short deadline, a CI-like run saw a batch of 500 sent twice:
    its call missed 0.3 s and was retried, as it should be.)
    """
    servicer, client, metrics = patientLedger
    outbox = outboxOf(client, metrics)
    await sendAll(outbox, 1200)
    assert servicer.recorded() == expected(1200)
    assert max(servicer.batches) <= 500
    assert sum(servicer.batches) == 1200
    assert metrics.registry.get_sample_value("svc_proxy_usage_rows_sent_total") == 1200
    assert outbox.close() == 0


@pytest_twisted.ensureDeferred
async def test_unavailableAtFirst(ledger: Any) -> None:
    """
    svc-auth failing the first attempts with UNAVAILABLE (its database
    down): the rows wait and arrive once each, in order, when it answers.
    """
    servicer, client, metrics = ledger
    servicer.failFirst = 4
    outbox = outboxOf(client, metrics)
    await sendAll(outbox, 700)
    assert servicer.recorded() == expected(700)
    assert servicer.attempts >= 4 + 2
    outbox.close()


@pytest_twisted.ensureDeferred
async def test_hangsPastTheDeadline(ledger: Any) -> None:
    """
    A RecordUsage that hangs past the client's deadline (DEADLINE_EXCEEDED)
    is sent again; svc-auth's late commit of the first attempt makes the
    rows of the retry duplicates: each is recorded once.
    """
    servicer, client, metrics = ledger
    servicer.hangFirst = 1
    servicer.hangSeconds = 1.0
    outbox = outboxOf(client, metrics)
    await sendAll(outbox, 50)
    assert servicer.recorded() == expected(50)
    assert servicer.attempts >= 2
    outbox.close()


@pytest_twisted.ensureDeferred
async def test_recordUsageDeadlineAndCancel(ledger: Any) -> None:
    """
    recordUsage fails with DEADLINE_EXCEEDED past the client's usage
    timeout, and a cancelled call ends at once.
    """
    from twisted.internet.defer import CancelledError

    servicer, client, _ = ledger
    servicer.hangFirst = 1
    servicer.hangSeconds = 1.0
    with pytest.raises(grpc.RpcError) as failed:
        await client.recordUsage([row(1)])
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = client.recordUsage([row(2)])
    call.cancel()
    with pytest.raises(CancelledError):
        await call
    response = await client.recordUsage([row(3)])
    assert (response.recorded, response.duplicates) == (1, 0)


@pytest_twisted.ensureDeferred
async def test_theStandInKeysRowsByLedgerIDAndKeepsEveryField(patientLedger: Any) -> None:
    """
    The stand-in svc-auth that proxy tests assert on behaves as the real
    one (decisions D12 amended): rows sharing a request id under their own
    ledger ids are each recorded, with every field as sent (kind and
    parent_request_id included, decisions D13); a row sent again as it was
    is a duplicate, and with another kind a conflict that leaves the row
    as first recorded; a row without a ledger id is keyed by its request
    id.
    """
    servicer, client, _ = patientLedger
    shared = "0190c6a2-0000-7000-8000-000000000777"
    chat = auth_pb2.UsageRow(
        ledger_id="0190c6a2-0000-7000-8000-0000000000c1",
        request_id=shared,
        org_id=servicer.orgID,
        outcome="ok",
        kind="chat",
    )
    recall = auth_pb2.UsageRow(
        ledger_id="0190c6a2-0000-7000-8000-0000000000c2",
        request_id=shared,
        org_id=servicer.orgID,
        outcome="ok",
        kind="embedding",
        parent_request_id=shared,
    )
    response = await client.recordUsage([chat, recall])
    assert (response.recorded, response.duplicates, list(response.rejected)) == (2, 0, [])
    assert servicer.recorded() == [shared, shared]
    assert servicer.rowsOf(shared) == [chat, recall]
    assert (servicer.rowsOf(shared)[1].kind, servicer.rowsOf(shared)[1].parent_request_id) == (
        "embedding",
        shared,
    )

    other = auth_pb2.UsageRow()
    other.CopyFrom(recall)
    other.kind = "extraction"
    response = await client.recordUsage([recall, other, row(1), row(1)])
    assert (response.recorded, response.duplicates) == (1, 2)
    assert [(each.index, each.reason) for each in response.rejected] == [(1, "conflict")]
    assert servicer.rowsOf(shared)[1].kind == "embedding"
    assert servicer.rowOf(row(1).request_id) == row(1)
    assert servicer.recorded() == [shared, shared, row(1).request_id]


class RejectingAuth(LedgerAuth):
    """
    svc-auth as issue 28 makes it: a row it cannot hold (here, negative
    prompt tokens) is listed in C{rejected} as "invalid" and the others are
    committed. With C{wholeBatch}, an older svc-auth instead: the whole
    batch fails with INVALID_ARGUMENT.
    """

    def __init__(self, wholeBatch: bool) -> None:
        super().__init__()
        self.wholeBatch = wholeBatch

    def RecordUsage(self, request: Any, context: grpc.ServicerContext) -> Any:
        bad = [index for index, each in enumerate(request.rows) if each.prompt_tokens < 0]
        if bad and self.wholeBatch:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rows[{bad[0]}].prompt_tokens must not be negative",
            )
        good = auth_pb2.RecordUsageRequest(
            rows=[each for index, each in enumerate(request.rows) if index not in bad]
        )
        response = super().RecordUsage(good, context)
        response.rejected.extend(
            auth_pb2.RejectedUsageRow(
                index=index, reason="invalid", detail="prompt_tokens must not be negative"
            )
            for index in bad
        )
        return response


@pytest.mark.parametrize("wholeBatch", [False, True], ids=["rejected", "invalid_argument"])
@pytest_twisted.ensureDeferred
async def test_poisonRowSetAsideOthersRecorded(wholeBatch: bool, tmp_path: Path) -> None:
    """
    Two rows svc-auth cannot hold among 1,200 good ones, whether it lists
    them as rejected or (an older svc-auth) fails their whole batch with
    INVALID_ARGUMENT: every good row is recorded, in order; the bad ones
    are in the rejects file beside the journal; the outbox is empty and
    has room (forwarding goes on); after a restart neither comes back from
    the journal.
    """
    from twisted.internet import reactor

    servicer = RejectingAuth(wholeBatch)
    path = tmp_path / "usage.journal"
    poisoned = {250, 777}
    with servingAuth(servicer, workers=8) as port, ledgerSender(port, 5.0) as client:
        metrics = ProxyMetrics()
        outbox = Outbox(
            client,
            reactor,
            metrics,
            journal=Journal(str(path)),
            firstRetry=0.05,
            lastRetry=0.5,
        )
        outbox.start()
        for number in range(1, 1201):
            made = row(number)
            if number in poisoned:
                made.prompt_tokens = -number
            outbox.record(made)
        assert await outbox.flush(FLUSH_BOUND) == 0
        assert outbox.waiting == 0 and outbox.hasRoom()
        # Forwarding was never blocked: a row recorded now goes too.
        outbox.record(row(1201))
        assert await outbox.flush(FLUSH_BOUND) == 0
        assert outbox.close() == 0
    assert servicer.recorded() == [
        row(number).request_id for number in range(1, 1202) if number not in poisoned
    ]
    lines = [
        json.loads(line) for line in (tmp_path / "usage.journal.rejects").read_text().splitlines()
    ]
    assert [
        json_format.ParseDict(line["row"], auth_pb2.UsageRow()).request_id for line in lines
    ] == [row(number).request_id for number in sorted(poisoned)]
    assert {line["reason"] for line in lines} == {"invalid"}
    assert all("prompt_tokens must not be negative" in line["detail"] for line in lines)
    assert (
        metrics.registry.get_sample_value(
            "svc_proxy_usage_rows_rejected_total", {"reason": "invalid"}
        )
        == 2
    )
    restarted = Journal(str(path))
    assert restarted.open() == []
    restarted.close()


class ArrivalsAuth(LedgerAuth):
    """
    L{LedgerAuth} that notes which method each call was, in the order the
    calls arrive, and answers GetSpend with a fixed spend.
    """

    def __init__(self) -> None:
        super().__init__()
        self.arrived: list[str] = []

    def ValidateToken(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.arrived.append("ValidateToken")
        return super().ValidateToken(request, context)

    def ValidateAgent(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.arrived.append("ValidateAgent")
        return super().ValidateAgent(request, context)

    def RecordUsage(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.arrived.append("RecordUsage")
        return super().RecordUsage(request, context)

    def GetSpend(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.arrived.append("GetSpend")
        return auth_pb2.GetSpendResponse(cost_nano_usd=42)


@pytest_twisted.ensureDeferred
async def test_validationsAndLedgerShareOneChannelAndItsSlots() -> None:
    """
    The proxy's validation client and the ledger's sender on one
    connection with one slot, as the proxy wires them: while a
    ValidateToken call is in flight, a RecordUsage batch, a second
    ValidateToken, a ValidateAgent and a GetSpend queue, in that order.
    The later stage goes first (ValidateAgent, then GetSpend), then the
    first stage in its order (the batch, then the new token). One channel
    is made, and only the validations are counted in
    svc_proxy_auth_validate_duration_seconds.
    """
    from twisted.internet import reactor

    servicer = ArrivalsAuth()
    made: list[Any] = []
    metrics = ProxyMetrics()
    with servingAuth(servicer) as port:

        def channel() -> Any:
            made.append(grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS))
            return made[-1]

        connection = AuthConnection(
            channel, IReactorFromThreads(reactor), reactor, maxInFlight=1, queueTimeout=10.0
        )
        validation = GrpcAuthClient(connection, 5.0, metrics)
        sender = LedgerSender(connection)
        validation.start()
        try:
            calls: list[Deferred[Any]] = [
                validation.validateToken(newToken()),
                sender.recordUsage([row(1)]),
                validation.validateToken(newToken()),
                validation.validateAgent(newToken(), str(uuid.uuid4()), servicer.orgID),
                sender.getSpend(servicer.orgID, None, 0, 60),
            ]
            answers = await gatherResults(calls)
        finally:
            validation.close()
    assert servicer.arrived == [
        "ValidateToken",
        "ValidateAgent",
        "GetSpend",
        "RecordUsage",
        "ValidateToken",
    ]
    assert answers[1].recorded == 1
    assert answers[4] == 42
    assert len(made) == 1
    assert (
        metrics.registry.get_sample_value(
            "svc_proxy_auth_validate_duration_seconds_count", {"result": "ok"}
        )
        == 3
    )
