"""
The proxy's usage outbox and journal (decisions D12), on a fake clock with
a fake RecordUsage: batches of at most 500 rows, in order, one call at a
time; a failed batch tried again, the same rows, after a capped backoff;
nothing dropped before svc-auth acknowledged it; the bound that makes the
edge refuse; the journal's replay, torn tail and compaction; the flush of
a graceful stop.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher

from svcd.pb.auth.v1 import auth_pb2
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.usage.outbox import (
    JOURNAL_MAGIC,
    JournalError,
    UsageJournal,
    UsageOutbox,
    checkJournalPath,
)


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
    journal: UsageJournal | None = None,
    metrics: ProxyMetrics | None = None,
    **keywords: Any,
) -> UsageOutbox:
    made = UsageOutbox(
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

    box = UsageOutbox(Instant(), Clock(), ProxyMetrics(), linger=0.0)
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
    errors = [
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
    box = UsageOutbox(sender, clock, ProxyMetrics(), random=lambda: 0.0, linger=0.0)
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
    globalLogPublisher.addObserver(events.append)
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
        globalLogPublisher.removeObserver(events.append)
    ours = [event for event in events if "RecordUsage" in event.get("log_format", "")]
    assert [event["log_level"] for event in ours] == [LogLevel.warn, LogLevel.warn]
    assert ours[0]["grpc_status"] == "unavailable" and ours[0]["rows"] == 1
    assert ours[1]["suppressed"] == 3
    [back] = [event for event in events if "took usage rows again" in event.get("log_format", "")]
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
    assert flushed.called and flushed.result == 0
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
    assert flushed.called and flushed.result == 2
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
    box = outbox(sender, clock, journal=UsageJournal(str(path)))
    for number in range(1, 6):
        box.record(row(number))
    sender.acknowledge()  # row 1
    sender.acknowledge()  # rows 2..5
    for number in range(6, 9):
        box.record(row(number))
    sender.fail()
    # Killed: nothing more happens to this outbox.

    again, clock = FakeSender(), Clock()
    restarted = outbox(again, clock, journal=UsageJournal(str(path)))
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
    box = outbox(sender, Clock(), journal=UsageJournal(str(path)))
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
    box = outbox(sender, Clock(), journal=UsageJournal(str(path)))
    for number in range(1, 4):
        box.record(row(number))
    sender.acknowledge()
    sender.acknowledge()
    box.record(row(4))
    grown = path.stat().st_size
    journal = UsageJournal(str(path))
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
    journal = UsageJournal(str(path), compactBytes=1000)
    box = outbox(sender, Clock(), journal=journal)
    for number in range(1, 40):
        box.record(row(number))
    sender.acknowledge()
    assert path.stat().st_size > 1000
    sender.acknowledge()
    assert path.read_bytes() == JOURNAL_MAGIC
    box.record(row(40))
    assert UsageJournal(str(path)).open()[0].request_id == row(40).request_id


def test_tornTailIgnoredAndTruncated(tmp_path: Path) -> None:
    """
    A record cut short by a kill -9 at the end of the journal is ignored,
    logged once, and gone after the start's rewrite; the rows before it
    are replayed.
    """
    path = tmp_path / "usage.journal"
    journal = UsageJournal(str(path))
    journal.open()
    journal.append(row(1))
    journal.append(row(2))
    journal.close()
    whole = path.read_bytes()
    with path.open("ab") as torn:
        torn.write(whole[len(JOURNAL_MAGIC) : len(JOURNAL_MAGIC) + 12])
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(events.append)
    try:
        replayed = UsageJournal(str(path)).open()
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert [each.request_id for each in replayed] == ids(1, 2)
    [warning] = [event for event in events if "torn" in event.get("log_format", "")]
    assert warning["log_level"] == LogLevel.warn and warning["dropped"] == 12
    assert path.read_bytes() == whole


def test_damagedRecordEndsTheReplay(tmp_path: Path) -> None:
    """
    A record whose checksum does not match is treated as the torn end.
    """
    path = tmp_path / "usage.journal"
    journal = UsageJournal(str(path))
    journal.open()
    journal.append(row(1))
    journal.append(row(2))
    journal.close()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert [each.request_id for each in UsageJournal(str(path)).open()] == ids(1, 1)


def test_doubtfulAcknowledgementIgnored(tmp_path: Path) -> None:
    """
    An acknowledgement that does not match the rows before it is ignored:
    those rows are sent again (a harmless duplicate), never dropped.
    """
    path = tmp_path / "usage.journal"
    journal = UsageJournal(str(path))
    journal.open()
    journal.append(row(1))
    journal.append(row(2))
    journal.acknowledge(1, row(2).request_id)
    journal.acknowledge(3, row(2).request_id)
    journal.close()
    assert [each.request_id for each in UsageJournal(str(path)).open()] == ids(1, 2)


def test_journalKilledDuringItsFirstWrite(tmp_path: Path) -> None:
    path = tmp_path / "usage.journal"
    path.write_bytes(JOURNAL_MAGIC[:5])
    assert UsageJournal(str(path)).open() == []
    assert path.read_bytes() == JOURNAL_MAGIC


def test_notAJournal(tmp_path: Path) -> None:
    """
    A file that is not a journal is refused, not overwritten.
    """
    path = tmp_path / "notes.txt"
    path.write_text("my notes\n")
    with pytest.raises(JournalError, match="is not a usage journal"):
        UsageJournal(str(path)).open()
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
    journal = UsageJournal(str(path))
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
