"""
The proxy's usage outbox and journal (decisions D12), on a fake clock with
a fake RecordUsage: batches of at most 500 rows, in order, one call at a
time; a failed batch tried again, the same rows, after a capped backoff;
nothing dropped before svc-auth acknowledged it; the bound that makes the
edge refuse; the journal's replay, torn tail and compaction; the flush of
a graceful stop.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import uuid
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from google.protobuf import json_format
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher

from svcd.ledger.journal import Journal
from svcd.ledger.journalfile import JOURNAL_MAGIC, JournalError, checkJournalPath
from svcd.ledger.outbox import Outbox
from svcd.pb.auth.v1 import auth_pb2
from svcd.proxy.metrics import ProxyMetrics


class StatusError(grpc.RpcError):  # type: ignore[misc]
    """
    A failed call as grpcio reports it: an RpcError that is a grpc.Call.
    """

    def __init__(self, code: grpc.StatusCode, details: str = "scripted") -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


grpc.Call.register(StatusError)


class FakeSender:
    """
    RecordUsage whose answers the test gives: each call waits in C{calls}
    as (rows, Deferred).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[list[auth_pb2.UsageRow], Deferred[Any]]] = []

    def recordUsage(self, rows: Sequence[auth_pb2.UsageRow]) -> Deferred[Any]:
        answer: Deferred[Any] = Deferred()
        self.calls.append((list(rows), answer))
        return answer

    def ids(self, index: int) -> list[str]:
        return [row.request_id for row in self.calls[index][0]]

    def acknowledge(self, index: int = -1) -> None:
        rows, answer = self.calls[index]
        answer.callback(auth_pb2.RecordUsageResponse(recorded=len(rows)))

    def fail(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, index: int = -1) -> None:
        self.calls[index][1].errback(StatusError(code))


def fired(deferred: Deferred[Any]) -> bool:
    """
    Whether C{deferred} has fired, read afresh (mypy keeps what an earlier
    C{assert not deferred.called} narrowed C{.called} to).
    """
    return deferred.called


def row(number: int) -> auth_pb2.UsageRow:
    return auth_pb2.UsageRow(
        request_id=f"00000000-0000-7000-8000-{number:012d}",
        org_id=str(uuid.UUID(int=1)),
        outcome="ok",
        prompt_tokens=number,
    )


def ids(first: int, last: int) -> list[str]:
    return [row(number).request_id for number in range(first, last + 1)]


def outbox(
    sender: FakeSender,
    clock: Clock,
    journal: Journal | None = None,
    metrics: ProxyMetrics | None = None,
    **keywords: Any,
) -> Outbox:
    made = Outbox(
        sender,
        clock,
        metrics if metrics is not None else ProxyMetrics(),
        journal=journal,
        random=lambda: 1.0,
        **{"linger": 0.0, **keywords},
    )
    made.start()
    return made


def sample(metrics: ProxyMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None
    return value


def test_sentAtOnceThenInBatchesOfAtMost500InOrder() -> None:
    """
    The first row goes at once, alone; the rows that arrive while it is in
    flight go next, 500 at most per call, oldest first, one call at a time.
    """
    sender, clock, metrics = FakeSender(), Clock(), ProxyMetrics()
    box = outbox(sender, clock, metrics=metrics)
    box.record(row(1))
    assert [sender.ids(0)] == [ids(1, 1)]
    for number in range(2, 1202):
        box.record(row(number))
    assert len(sender.calls) == 1
    assert sample(metrics, "svc_proxy_usage_outbox_rows") == 1201
    sender.acknowledge()
    assert sender.ids(1) == ids(2, 501)
    sender.acknowledge()
    assert sender.ids(2) == ids(502, 1001)
    sender.acknowledge()
    assert sender.ids(3) == ids(1002, 1201)
    sender.acknowledge()
    assert len(sender.calls) == 4 and box.waiting == 0
    assert sample(metrics, "svc_proxy_usage_rows_sent_total") == 1201
    assert sample(metrics, "svc_proxy_usage_outbox_rows") == 0
    assert not clock.getDelayedCalls()


def test_answeredAtOnceStillOneCallAtATime() -> None:
    """
    A sender that answers within the call (no wait at all) still sends
    every row once, in order, in batches of at most 500.
    """
    sent: list[list[str]] = []

    class Instant:
        def recordUsage(self, rows: Sequence[auth_pb2.UsageRow]) -> Deferred[Any]:
            sent.append([each.request_id for each in rows])
            answer: Deferred[Any] = Deferred()
            answer.callback(auth_pb2.RecordUsageResponse(recorded=len(rows)))
            return answer

    box = Outbox(Instant(), Clock(), ProxyMetrics(), linger=0.0)
    box._queue.extend(row(number) for number in range(1, 1101))
    box.start()
    assert [len(batch) for batch in sent] == [500, 500, 100]
    assert [each for batch in sent for each in batch] == ids(1, 1100)
    assert box.waiting == 0


def test_failedBatchTriedAgainWithCappedBackoff() -> None:
    """
    A failed call (UNAVAILABLE, DEADLINE_EXCEEDED, anything) is tried again,
    the very same rows, after 0.1 s doubling up to 5 s (the jitter's upper
    end here); rows recorded meanwhile wait for the next batch; nothing is
    sent before the backoff is over.
    """
    sender, clock = FakeSender(), Clock()
    box = outbox(sender, clock)
    box.record(row(1))
    box.record(row(2))
    sender.fail(grpc.StatusCode.UNAVAILABLE)
    waits = []
    errors: list[Exception] = [
        StatusError(grpc.StatusCode.DEADLINE_EXCEEDED),
        RuntimeError("anything"),
        *[StatusError(grpc.StatusCode.UNAVAILABLE)] * 7,
    ]
    for error in errors:
        [pending] = clock.getDelayedCalls()
        waits.append(round(pending.getTime() - clock.seconds(), 3))
        calls = len(sender.calls)
        clock.advance(pending.getTime() - clock.seconds() - 0.001)
        assert len(sender.calls) == calls
        box.record(row(len(sender.calls) + 2))
        clock.advance(0.002)
        assert len(sender.calls) == calls + 1
        assert sender.ids(-1) == ids(1, 1)
        sender.calls[-1][1].errback(error)
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    [pending] = clock.getDelayedCalls()
    clock.advance(5.0)
    sender.acknowledge()
    # The rows that arrived meanwhile, in order, and the backoff is over.
    assert sender.ids(-1) == ids(2, 11)
    sender.acknowledge()
    assert box.waiting == 0 and not clock.getDelayedCalls()


def test_jitterBetweenHalfAndAllOfTheBackoff() -> None:
    """
    Each wait is drawn between half and all of the backoff, so that proxies
    that lost svc-auth together do not all come back in step.
    """
    sender, clock = FakeSender(), Clock()
    box = Outbox(sender, clock, ProxyMetrics(), random=lambda: 0.0, linger=0.0)
    box.start()
    box.record(row(1))
    sender.fail()
    [pending] = clock.getDelayedCalls()
    assert pending.getTime() == pytest.approx(0.05)


def test_nothingDroppedBeforeAcknowledged() -> None:
    """
    Rows stay counted, and sent again, however many attempts fail; they
    leave only with svc-auth's answer.
    """
    sender, clock, metrics = FakeSender(), Clock(), ProxyMetrics()
    box = outbox(sender, clock, metrics=metrics)
    for number in range(1, 4):
        box.record(row(number))
    for _ in range(20):
        sender.fail()
        assert box.waiting == 3
        clock.advance(5.0)
    assert sample(metrics, "svc_proxy_usage_rows_sent_total") == 0
    sender.acknowledge()
    sender.acknowledge()
    assert box.waiting == 0
    assert sample(metrics, "svc_proxy_usage_rows_sent_total") == 3


def test_hasRoomUntilTheBound() -> None:
    """
    With SVC_USAGE_OUTBOX_MAX rows waiting there is no room (the edge then
    refuses 503); an acknowledgement makes room again.
    """
    sender, clock = FakeSender(), Clock()
    box = outbox(sender, clock, maxRows=3)
    for number in range(1, 4):
        assert box.hasRoom()
        box.record(row(number))
    assert not box.hasRoom()
    sender.acknowledge()
    assert box.hasRoom() and box.waiting == 2


def test_failuresLoggedThrottled() -> None:
    """
    A long outage is a warning now and then (with how many were
    suppressed), not one per attempt; the return is logged once.
    """
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(cast(ILogObserver, events.append))
    try:
        sender, clock = FakeSender(), Clock()
        box = outbox(sender, clock)
        box.record(row(1))
        # Failures at 0, 3, 6, 9 and 12 s: one line at 0 s, one at 12 s.
        for _ in range(5):
            sender.fail()
            clock.advance(3.0)
        sender.acknowledge()
    finally:
        globalLogPublisher.removeObserver(cast(ILogObserver, events.append))
    ours = [event for event in events if "RecordUsage to svc-auth failed" in formatEvent(event)]
    assert [event["log_level"] for event in ours] == [LogLevel.warn, LogLevel.warn]
    assert ours[0]["grpc_status"] == "unavailable" and ours[0]["rows"] == 1
    assert ours[1]["suppressed"] == 3
    [back] = [event for event in events if "took usage row(s) again" in formatEvent(event)]
    assert back["attempts"] == 5


# The flush of a graceful stop


def test_flushSendsEverythingWaiting() -> None:
    """
    flush() fires with 0 once every row is acknowledged; a batch waiting
    out its backoff is tried at once.
    """
    sender, clock = FakeSender(), Clock()
    box = outbox(sender, clock)
    for number in range(1, 702):
        box.record(row(number))
    sender.fail()
    flushed = box.flush(10.0)
    assert len(sender.calls) == 2 and not flushed.called
    sender.acknowledge()
    sender.acknowledge()
    sender.acknowledge()
    assert fired(flushed) and flushed.result == 0
    assert box.close() == 0


def test_flushBoundedByItsTimeout() -> None:
    """
    With svc-auth away, flush() gives up at its bound and says how many
    rows are left; close() stops the retries.
    """
    sender, clock = FakeSender(), Clock()
    box = outbox(sender, clock)
    box.record(row(1))
    box.record(row(2))
    flushed = box.flush(2.0)
    sender.fail()
    clock.advance(1.0)
    sender.fail()
    assert not flushed.called
    clock.advance(1.0)
    assert fired(flushed) and flushed.result == 2
    assert box.close() == 2
    assert not clock.getDelayedCalls()


def test_flushOfAnEmptyOutbox() -> None:
    box = outbox(FakeSender(), Clock())
    flushed = box.flush(2.0)
    assert flushed.called and flushed.result == 0


def test_flushEndsWhenRecordUsageIsUnimplemented() -> None:
    """
    An svc-auth without RecordUsage (older than the proxy) will not gain it
    while the stop waits: the flush ends at once with the rows left.
    """
    sender, clock = FakeSender(), Clock()
    box = outbox(sender, clock)
    box.record(row(1))
    flushed = box.flush(10.0)
    sender.fail(grpc.StatusCode.UNIMPLEMENTED)
    assert flushed.called and flushed.result == 1


def test_closeCancelsTheCallInFlight() -> None:
    sender, clock = FakeSender(), Clock()
    box = outbox(sender, clock)
    box.record(row(1))
    assert box.close() == 1
    assert sender.calls[0][1].called
    assert not clock.getDelayedCalls()


# The journal


def journalRecords(path: Path) -> bytes:
    data = path.read_bytes()
    assert data.startswith(JOURNAL_MAGIC)
    return data[len(JOURNAL_MAGIC) :]


def test_journalReplaysRowsNotAcknowledged(tmp_path: Path) -> None:
    """
    Rows written to the journal and not acknowledged when the process
    vanished (no close: a kill -9) are queued first at the next start, in
    order, before any new row.
    """
    path = tmp_path / "usage.journal"
    sender, clock = FakeSender(), Clock()
    box = outbox(sender, clock, journal=Journal(str(path)))
    for number in range(1, 6):
        box.record(row(number))
    sender.acknowledge()  # row 1
    sender.acknowledge()  # rows 2..5
    for number in range(6, 9):
        box.record(row(number))
    sender.fail()
    # Killed: nothing more happens to this outbox.

    again, clock = FakeSender(), Clock()
    restarted = outbox(again, clock, journal=Journal(str(path)))
    restarted.record(row(9))
    assert restarted.waiting == 4
    assert again.ids(0) == ids(6, 8)
    again.acknowledge()
    assert again.ids(1) == ids(9, 9)


def test_journalWrittenBeforeQueued(tmp_path: Path) -> None:
    """
    A row is in the file (written to the kernel) when record() returns,
    before any answer of svc-auth.
    """
    path = tmp_path / "usage.journal"
    sender = FakeSender()
    box = outbox(sender, Clock(), journal=Journal(str(path)))
    before = path.stat().st_size
    box.record(row(1))
    assert path.stat().st_size > before
    assert row(1).SerializeToString() in path.read_bytes()


def test_journalCompactedAtStart(tmp_path: Path) -> None:
    """
    At start the journal is rewritten with only the rows not acknowledged.
    """
    path = tmp_path / "usage.journal"
    sender = FakeSender()
    box = outbox(sender, Clock(), journal=Journal(str(path)))
    for number in range(1, 4):
        box.record(row(number))
    sender.acknowledge()
    sender.acknowledge()
    box.record(row(4))
    grown = path.stat().st_size
    journal = Journal(str(path))
    assert [each.request_id for each in journal.open()] == ids(4, 4)
    assert path.stat().st_size < grown
    records = journalRecords(path)
    assert row(4).SerializeToString() in records
    assert row(1).SerializeToString() not in records
    assert not (tmp_path / "usage.journal.compacting").exists()
    journal.close()


def test_journalCompactedWhenLargeAndAllAcknowledged(tmp_path: Path) -> None:
    """
    A journal past its bound is emptied once every row is acknowledged;
    not while rows wait.
    """
    path = tmp_path / "usage.journal"
    sender = FakeSender()
    journal = Journal(str(path), compactBytes=1000)
    box = outbox(sender, Clock(), journal=journal)
    for number in range(1, 40):
        box.record(row(number))
    sender.acknowledge()
    assert path.stat().st_size > 1000
    sender.acknowledge()
    assert path.read_bytes() == JOURNAL_MAGIC
    box.record(row(40))
    assert Journal(str(path)).open()[0].request_id == row(40).request_id


def test_tornTailIgnoredAndTruncated(tmp_path: Path) -> None:
    """
    A record cut short by a kill -9 at the end of the journal is ignored,
    logged once, and gone after the start's rewrite; the rows before it
    are replayed.
    """
    path = tmp_path / "usage.journal"
    journal = Journal(str(path))
    journal.open()
    journal.append(row(1))
    journal.append(row(2))
    journal.close()
    whole = path.read_bytes()
    with path.open("ab") as torn:
        torn.write(whole[len(JOURNAL_MAGIC) : len(JOURNAL_MAGIC) + 12])
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(cast(ILogObserver, events.append))
    try:
        replayed = Journal(str(path)).open()
    finally:
        globalLogPublisher.removeObserver(cast(ILogObserver, events.append))
    assert [each.request_id for each in replayed] == ids(1, 2)
    [warning] = [event for event in events if "torn" in event.get("log_format", "")]
    assert warning["log_level"] == LogLevel.warn and warning["dropped"] == 12
    assert path.read_bytes() == whole


def test_damagedRecordEndsTheReplay(tmp_path: Path) -> None:
    """
    A record whose checksum does not match is treated as the torn end.
    """
    path = tmp_path / "usage.journal"
    journal = Journal(str(path))
    journal.open()
    journal.append(row(1))
    journal.append(row(2))
    journal.close()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert [each.request_id for each in Journal(str(path)).open()] == ids(1, 1)


def test_doubtfulAcknowledgementIgnored(tmp_path: Path) -> None:
    """
    An acknowledgement that does not match the rows before it is ignored:
    those rows are sent again (a harmless duplicate), never dropped.
    """
    path = tmp_path / "usage.journal"
    journal = Journal(str(path))
    journal.open()
    journal.append(row(1))
    journal.append(row(2))
    journal.acknowledge(1, row(2).request_id)
    journal.acknowledge(3, row(2).request_id)
    journal.close()
    assert [each.request_id for each in Journal(str(path)).open()] == ids(1, 2)


def test_journalKilledDuringItsFirstWrite(tmp_path: Path) -> None:
    path = tmp_path / "usage.journal"
    path.write_bytes(JOURNAL_MAGIC[:5])
    assert Journal(str(path)).open() == []
    assert path.read_bytes() == JOURNAL_MAGIC


def test_notAJournal(tmp_path: Path) -> None:
    """
    A file that is not a journal is refused, not overwritten.
    """
    path = tmp_path / "notes.txt"
    path.write_text("my notes\n")
    with pytest.raises(JournalError, match="is not a usage journal"):
        Journal(str(path)).open()
    with pytest.raises(JournalError, match="is not a usage journal"):
        checkJournalPath(str(path))
    assert path.read_text() == "my notes\n"


def test_checkJournalPath(tmp_path: Path) -> None:
    checkJournalPath(str(tmp_path / "new.journal"))
    with pytest.raises(JournalError, match="does not exist"):
        checkJournalPath(str(tmp_path / "missing" / "usage.journal"))
    with pytest.raises(JournalError, match="is a directory"):
        checkJournalPath(str(tmp_path))


def test_journalWriteFailureKeepsTheRowInMemory(tmp_path: Path) -> None:
    """
    A journal that cannot be written (a full disk) does not lose the row:
    it is queued and sent all the same, and the file keeps no half record.
    """
    path = tmp_path / "usage.journal"
    journal = Journal(str(path))
    sender = FakeSender()
    box = outbox(sender, Clock(), journal=journal)
    assert journal._fd is not None
    os.close(journal._fd)
    journal._fd = os.open(str(path), os.O_RDONLY)
    box.record(row(1))
    assert sender.ids(0) == ids(1, 1)
    assert path.read_bytes() == JOURNAL_MAGIC


def test_rowsWaitALittleForOthersToShareTheirBatch() -> None:
    """
    A row waits C{linger} for others, so that under load a RecordUsage
    call carries many rows rather than one (each call costs both daemons
    and svc-auth a commit); a full batch goes at once; rows that come
    while a call is in flight wait again once it is answered; a stop's
    flush waits for nothing.
    """
    sender, clock = FakeSender(), Clock()
    box = outbox(sender, clock, linger=0.05, batchRows=5)
    box.record(row(1))
    box.record(row(2))
    assert sender.calls == []
    clock.advance(0.049)
    assert sender.calls == []
    clock.advance(0.001)
    assert [sender.ids(index) for index in range(len(sender.calls))] == [ids(1, 2)]
    for number in range(3, 9):
        box.record(row(number))
    sender.acknowledge()
    # Six rows waiting: a full batch of five at once, the sixth lingers.
    assert sender.ids(-1) == ids(3, 7)
    sender.acknowledge()
    assert len(sender.calls) == 2
    clock.advance(0.05)
    assert sender.ids(-1) == ids(8, 8)
    sender.acknowledge()
    box.record(row(9))
    flushed = box.flush(1.0)
    assert sender.ids(-1) == ids(9, 9)
    sender.acknowledge()
    assert flushed.result == 0


# Rejected rows (decisions D12, amended: no row stalls the ledger)


def ledgerRow(number: int, requestID: str | None = None) -> auth_pb2.UsageRow:
    """
    A row as the gateway makes it now: keyed by its ledger id, carrying the
    client's request id (the same one on every row when C{requestID} is
    given, as a client reusing its X-Request-ID does).
    """
    made = row(number)
    made.ledger_id = f"0190c6a2-0000-7000-9000-{number:012d}"
    if requestID is not None:
        made.request_id = requestID
    return made


def rejection(index: int, reason: str, detail: str) -> auth_pb2.RejectedUsageRow:
    return auth_pb2.RejectedUsageRow(index=index, reason=reason, detail=detail)


def rejects(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def rejectedSample(metrics: ProxyMetrics, reason: str) -> float | None:
    return metrics.registry.get_sample_value(
        "svc_proxy_usage_rows_rejected_total", {"reason": reason}
    )


@contextmanager
def logged() -> Iterator[list[dict[str, Any]]]:
    """
    The events logged within the block.
    """
    events: list[dict[str, Any]] = []
    observer = cast(ILogObserver, events.append)
    globalLogPublisher.addObserver(observer)
    try:
        yield events
    finally:
        globalLogPublisher.removeObserver(observer)


def test_rejectedRowsSetAsideAndTheBatchAcknowledged(tmp_path: Path) -> None:
    """
    svc-auth answers a batch with two rows rejected: the whole batch leaves
    the outbox; the rejected rows are in <journal>.rejects (the row as
    protobuf JSON, reason, detail, time), counted by reason, logged as a
    throttled warning with the ledger id, reason and detail; onRecorded
    hears the committed rows only; after a restart none of the batch comes
    back from the journal.
    """
    path = tmp_path / "usage.journal"
    sender, clock, metrics = FakeSender(), Clock(), ProxyMetrics()
    clock.advance(1_700_000_000)
    heard: list[list[str]] = []
    with logged() as events:
        box = outbox(
            sender,
            clock,
            journal=Journal(str(path)),
            metrics=metrics,
            onRecorded=lambda ledgerIDs: heard.append(list(ledgerIDs)),
            linger=0.05,
        )
        for number in range(1, 6):
            box.record(ledgerRow(number))
        clock.advance(0.05)
        sender.calls[0][1].callback(
            auth_pb2.RecordUsageResponse(
                recorded=2,
                duplicates=1,
                rejected=[
                    rejection(1, "invalid", "prompt_tokens is negative"),
                    rejection(3, "conflict", "recorded with other content"),
                ],
            )
        )
    assert box.waiting == 0 and box.hasRoom()
    assert not clock.getDelayedCalls()
    lines = rejects(tmp_path / "usage.journal.rejects")
    assert [json_format.ParseDict(line["row"], auth_pb2.UsageRow()) for line in lines] == [
        ledgerRow(2),
        ledgerRow(4),
    ]
    assert [(line["reason"], line["detail"]) for line in lines] == [
        ("invalid", "prompt_tokens is negative"),
        ("conflict", "recorded with other content"),
    ]
    assert lines[0]["time"] == "2023-11-14T22:13:20.050Z"
    assert rejectedSample(metrics, "invalid") == 1
    assert rejectedSample(metrics, "conflict") == 1
    assert sample(metrics, "svc_proxy_usage_rows_sent_total") == 3
    assert heard == [[ledgerRow(number).ledger_id for number in (1, 3, 5)]]
    # One warning: the second rejection, within 10 s, is suppressed.
    warnings = [event for event in events if "rejected usage row" in formatEvent(event)]
    assert len(warnings) == 1
    assert warnings[0]["log_level"] == LogLevel.warn
    assert (warnings[0]["ledger_id"], warnings[0]["reason"], warnings[0]["detail"]) == (
        ledgerRow(2).ledger_id,
        "invalid",
        "prompt_tokens is negative",
    )
    assert "row" not in warnings[0]
    box.close()
    assert Journal(str(path)).open() == []


def test_rejectedWithoutAJournalLoggedWholeAndCounted() -> None:
    """
    Without a journal a rejected row is logged, every one (not throttled:
    the log is its only copy), with its ids and numbers, and counted.
    """
    sender, clock, metrics = FakeSender(), Clock(), ProxyMetrics()
    with logged() as events:
        box = outbox(sender, clock, metrics=metrics, linger=0.05)
        for number in range(1, 4):
            box.record(ledgerRow(number))
        clock.advance(0.05)
        sender.calls[0][1].callback(
            auth_pb2.RecordUsageResponse(
                recorded=1,
                rejected=[rejection(0, "invalid", "bad"), rejection(2, "invalid", "bad")],
            )
        )
    assert box.waiting == 0
    lines = [event for event in events if "rejected usage row" in formatEvent(event)]
    assert [event["log_level"] for event in lines] == [LogLevel.error, LogLevel.error]
    assert [json_format.Parse(event["row"], auth_pb2.UsageRow()) for event in lines] == [
        ledgerRow(1),
        ledgerRow(3),
    ]
    assert rejectedSample(metrics, "invalid") == 2


class PoisonSender:
    """
    RecordUsage of an svc-auth older than per-row rejects: a batch holding
    a row it refuses (negative prompt tokens) fails whole with
    INVALID_ARGUMENT, at once; any other batch is committed at once.
    """

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.recorded: list[int] = []

    def recordUsage(self, rows: Sequence[auth_pb2.UsageRow]) -> Deferred[Any]:
        numbers = [each.prompt_tokens for each in rows]
        self.batches.append(numbers)
        answer: Deferred[Any] = Deferred()
        if any(number < 0 for number in numbers):
            answer.errback(StatusError(grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens < 0"))
        else:
            self.recorded.extend(numbers)
            answer.callback(auth_pb2.RecordUsageResponse(recorded=len(rows)))
        return answer


def test_invalidArgumentBatchHalvedUntilThePoisonRowIsAlone(tmp_path: Path) -> None:
    """
    An svc-auth that fails a whole batch with INVALID_ARGUMENT: the outbox
    sends halves of it at once (no backoff: nothing is down), sets the
    refused rows aside as "invalid" and records every other row, in
    order; the rows after it go in full batches again; a restart does not
    bring the refused rows back.
    """
    path = tmp_path / "usage.journal"
    sender, clock, metrics = PoisonSender(), Clock(), ProxyMetrics()
    box = Outbox(sender, clock, metrics, journal=Journal(str(path)), batchRows=100, linger=0.05)
    box.start()
    poisoned = {37, 38, 90}
    for number in range(1, 301):
        made = ledgerRow(number)
        if number in poisoned:
            made.prompt_tokens = -number
        box.record(made)
    clock.advance(0.05)
    assert box.waiting == 0 and box.hasRoom()
    assert sender.recorded == [number for number in range(1, 301) if number not in poisoned]
    assert [
        json_format.ParseDict(line["row"], auth_pb2.UsageRow()).prompt_tokens
        for line in rejects(tmp_path / "usage.journal.rejects")
    ] == [-37, -38, -90]
    assert {line["reason"] for line in rejects(tmp_path / "usage.journal.rejects")} == {"invalid"}
    assert rejectedSample(metrics, "invalid") == 3
    # Halving costs a few calls per poisoned row, not one per row.
    assert len(sender.batches) < 40
    # Once the refused rows are aside, batches are whole again.
    assert [len(batch) for batch in sender.batches[-3:]] == [100, 100, 10]
    assert not clock.getDelayedCalls()
    box.close()
    assert Journal(str(path)).open() == []


def test_invalidArgumentOfAOneRowBatch() -> None:
    """
    A batch of one row that svc-auth fails with INVALID_ARGUMENT is that
    row: set aside at once (logged, without a journal), the next row sent.
    """
    sender, clock, metrics = PoisonSender(), Clock(), ProxyMetrics()
    box = Outbox(sender, clock, metrics, linger=0.0)
    box.start()
    bad = ledgerRow(1)
    bad.prompt_tokens = -1
    box.record(bad)
    box.record(ledgerRow(2))
    assert sender.batches == [[-1], [2]]
    assert box.waiting == 0
    assert rejectedSample(metrics, "invalid") == 1


# The acknowledgement's key


def journalEntries(path: Path) -> list[tuple[int, bytes]]:
    data = journalRecords(path)
    entries, offset = [], 0
    while offset < len(data):
        kind, length, _ = struct.unpack_from(">BII", data, offset)
        offset += 9
        entries.append((kind, data[offset : offset + length]))
        offset += length
    return entries


def test_acknowledgementNamesTheLedgerID(tmp_path: Path) -> None:
    """
    The journal's acknowledgement names the last row by its ledger id (the
    ledger's key), not by the client's request id, which many rows may
    share; the replay matches it.
    """
    path = tmp_path / "usage.journal"
    sender = FakeSender()
    box = outbox(sender, Clock(), journal=Journal(str(path)))
    shared = "client-chose-this-one-id"
    for number in range(1, 4):
        box.record(ledgerRow(number, requestID=shared))
    sender.acknowledge()  # row 1
    sender.acknowledge()  # rows 2, 3
    box.record(ledgerRow(4, requestID=shared))
    acknowledgements = [payload for kind, payload in journalEntries(path) if kind == 2]
    assert acknowledgements == [
        struct.pack(">I", 1) + ledgerRow(1).ledger_id.encode(),
        struct.pack(">I", 2) + ledgerRow(3).ledger_id.encode(),
    ]
    assert [each.ledger_id for each in Journal(str(path)).open()] == [ledgerRow(4).ledger_id]


def oldRecord(kind: int, payload: bytes) -> bytes:
    return struct.pack(">BII", kind, len(payload), zlib.crc32(payload)) + payload


def test_oldJournalStillReplayed(tmp_path: Path) -> None:
    """
    A journal written before ledger ids (rows without one, acknowledgements
    naming the request id), then continued by this version, replays
    exactly its unacknowledged rows.
    """
    path = tmp_path / "usage.journal"
    old = [row(number) for number in range(1, 6)]
    path.write_bytes(
        JOURNAL_MAGIC
        + b"".join(oldRecord(1, each.SerializeToString()) for each in old[:3])
        + oldRecord(2, struct.pack(">I", 2) + old[1].request_id.encode())
        + b"".join(oldRecord(1, each.SerializeToString()) for each in old[3:])
    )
    sender = FakeSender()
    box = outbox(sender, Clock(), journal=Journal(str(path)))
    assert sender.ids(0) == ids(3, 5)
    box.record(ledgerRow(6))
    sender.acknowledge()  # the old rows 3 to 5, by request id
    sender.acknowledge()  # row 6, by its ledger id
    box.record(ledgerRow(7))
    # Killed: the next start finds only row 7 unacknowledged.
    assert [each.ledger_id for each in Journal(str(path)).open()] == [ledgerRow(7).ledger_id]

    # An old journal as it was left, replayed without this version's help.
    path.write_bytes(
        JOURNAL_MAGIC
        + b"".join(oldRecord(1, each.SerializeToString()) for each in old)
        + oldRecord(2, struct.pack(">I", 4) + old[3].request_id.encode())
    )
    assert [each.request_id for each in Journal(str(path)).open()] == ids(5, 5)


# Compaction by what was acknowledged


def test_journalBoundedUnderSteadyLoad(tmp_path: Path) -> None:
    """
    Under a steady load (2,000 rows/s, svc-auth answering each batch in
    30 ms, so that rows are always waiting and the outbox is never empty)
    the journal is rewritten whenever its acknowledged part passes the
    threshold: at every moment it is at most the threshold plus the rows
    waiting. After a kill, the next start replays exactly the rows that
    were not acknowledged.
    """
    path = tmp_path / "usage.journal"
    threshold = 64 * 1024
    clock = Clock()

    class Slow:
        answered = 0

        def recordUsage(self, rows: Sequence[auth_pb2.UsageRow]) -> Deferred[Any]:
            answer: Deferred[Any] = Deferred()

            def commit() -> None:
                Slow.answered += 1
                answer.callback(auth_pb2.RecordUsageResponse(recorded=len(rows)))

            clock.callLater(0.03, commit)
            return answer

    box = Outbox(Slow(), clock, ProxyMetrics(), journal=Journal(str(path), compactBytes=threshold))
    box.start()
    recordBytes: dict[str, int] = {}
    compactions = 0
    largest = previous = 0
    for number in range(1, 20_001):
        made = ledgerRow(number)
        recordBytes[made.ledger_id] = 9 + made.ByteSize()
        box.record(made)
        clock.advance(0.0005)
        size = path.stat().st_size
        waiting = sum(recordBytes[each.ledger_id] for each in box._queue)
        assert box.waiting > 0
        assert size <= len(JOURNAL_MAGIC) + threshold + waiting, (number, size, waiting)
        if size < previous:
            compactions += 1
        previous = size
        largest = max(largest, size)
    assert Slow.answered > 100
    # 20,000 rows of about 150 bytes: some 3 MB went through the journal.
    assert compactions >= 20 and largest < 2 * threshold
    # Killed now: exactly the rows not acknowledged come back.
    unacknowledged = [each.ledger_id for each in box._queue]
    assert unacknowledged
    assert [each.ledger_id for each in Journal(str(path)).open()] == unacknowledged


# One process per journal


HOLDER = """
import sys
from svcd.ledger.journal import Journal
try:
    Journal(sys.argv[1]).open()
except Exception as error:
    print("refused:", error, flush=True)
    raise SystemExit(1)
print("held", flush=True)
sys.stdin.read()
"""


def test_aJournalHeldByAnotherProcessIsRefused(tmp_path: Path) -> None:
    """
    While another process holds a journal, open() is refused with an
    error naming the journal and its lock file (and the holder's pid);
    once that process is gone, the journal opens.
    """
    path = tmp_path / "usage.journal"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(JournalError) as refused:
            Journal(str(path)).open()
        message = str(refused.value)
        assert repr(str(path)) in message and "held by another process" in message
        assert f"(pid {holder.pid})" in message and repr(str(path) + ".lock") in message
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    journal = Journal(str(path))
    assert journal.open() == []
    journal.close()


def test_theLockOutlivesCompaction(tmp_path: Path) -> None:
    """
    Compaction replaces the journal file by a rename; the lock (on a file
    of its own) still keeps another process out afterwards.
    """
    path = tmp_path / "usage.journal"
    sender = FakeSender()
    box = outbox(sender, Clock(), journal=Journal(str(path), compactBytes=100))
    for number in range(1, 5):
        box.record(ledgerRow(number))
    sender.acknowledge()
    sender.acknowledge()
    # Rewritten (through <path>.compacting, renamed over it).
    assert path.read_bytes() == JOURNAL_MAGIC
    other = subprocess.run(
        [sys.executable, "-c", HOLDER, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert other.returncode == 1
    assert "held by another process" in other.stdout
