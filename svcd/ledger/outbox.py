"""
The proxy's side of the usage ledger (decisions D12): the rows of forwarded
requests wait here, in order, until svc-auth has committed them.

L{UsageOutbox} is the L{svcd.ledger.rows.UsageLedger} the edge
writes to. A row is journalled first (when C{SVC_USAGE_JOURNAL} names a
file), then queued in memory; one RecordUsage call at a time carries the
oldest rows (at most L{BATCH_ROWS}) to svc-auth, which answers only after
it has committed them; only then do they leave the queue. A failed call
(svc-auth or PostgreSQL down, a deadline missed, anything) is tried again,
the same rows, after a capped exponential backoff with jitter. svc-auth
keys rows by ledger id (decisions D12, amended), so a row sent twice (an
answer lost on the way, an acknowledgement the journal had not recorded
before a kill) is recorded once.

No row stalls the others (D12, amended): rows svc-auth answers as
C{rejected} leave the queue with the batch and are set aside in the
rejects file beside the journal (C{<journal>.rejects}), counted and
logged. An svc-auth that fails a whole batch with INVALID_ARGUMENT (an
older one, or a batch it cannot take as a whole) is sent the batch in
halves until the row it refuses is alone; that row is set aside as
C{invalid} and the rest go on.

The same outbox and journal carry svc-proxy's observations to svc-memory
(decisions D13, L{svcd.proxy.observe.observationOutbox}): another record
type, key, call, journal magic and wording (L{OutboxWords}), the same
promises. What follows says "rows" and "svc-auth" for both.

L{UsageJournal} is the file that lets rows outlive the process. What
survives what:

  - Each row is written with one C{os.write} (no buffer in the process)
    before it is queued, so a C{kill -9}, a crash or the OOM killer loses
    no row: the kernel holds what was written.
  - It is not C{fsync}ed row by row (that would cost a disk flush per
    request): a power loss or a kernel crash may lose the rows the kernel
    had not yet written back (Linux writes dirty pages back within about
    30 s). Compactions are fsynced, file and directory, before they
    replace the journal.
  - An acknowledgement is journalled after svc-auth answered; one lost to a
    kill only means its rows are sent again at the next start, harmlessly.
  - The journal is rewritten with only the rows not yet acknowledged
    whenever the acknowledged part has passed its threshold, rows waiting
    or not: its size stays below the threshold plus the rows waiting.
  - One process holds a journal: an exclusive C{flock} on C{<journal>.lock},
    held for the life of the process (compaction replaces the journal
    file itself, so the lock cannot be on it). A second process refuses
    to start, naming the file.
"""

from __future__ import annotations

import contextvars
import datetime
import fcntl
import json
import os
import random
import struct
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any, Protocol

import attrs
import grpc
from google.protobuf import json_format
from prometheus_client import Counter, Gauge
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.ledger.journalfile import JOURNAL_MAGIC, JournalError, journalKind
from svcd.pb.auth.v1 import auth_pb2

# Rows per RecordUsage call: svc-auth commits a batch in one transaction;
# 500 rows are about 100 KB on the wire, far below gRPC's 4 MB limit.
BATCH_ROWS = 500
# How long a row waits for others before a batch smaller than BATCH_ROWS
# is sent: each RecordUsage call costs the proxy and svc-auth a few hundred
# microseconds and svc-auth a commit, so a batch per row would cost
# forwarding a third of its throughput; 50 ms makes a batch of 100 rows at
# 2,000 requests/s, and a row is in the ledger well within a second.
LINGER_SECONDS = 0.05
# The backoff between attempts of a failed batch: the first wait, doubled
# after each failure up to the last; each wait is drawn between half and
# all of that (jitter), so that proxies that lost svc-auth together do not
# come back in step.
FIRST_RETRY_SECONDS = 0.1
LAST_RETRY_SECONDS = 5.0
# SVC_USAGE_OUTBOX_MAX's default.
OUTBOX_MAX_ROWS = 100_000
# The journal is rewritten with only the rows not yet acknowledged once its
# acknowledged part (rows svc-auth committed or set aside, and the
# acknowledgement records) is larger than this: some 55,000 rows' worth,
# about 27 s of 2,000 requests/s. Each rewrite copies the rows waiting
# (normally a batch or two) and costs two fsyncs, so a smaller threshold
# trades disk for more frequent flushes.
COMPACT_JOURNAL_BYTES = 16 * 1024 * 1024
# The reasons of RejectedUsageRow that are label values of
# svc_proxy_usage_rows_rejected_total; any other is counted as "other" (a
# newer svc-auth), so that svc-auth cannot inflate the number of series.
REJECT_REASONS = frozenset({"invalid", "conflict"})
# What a reject's detail may take in the log and the rejects file.
DETAIL_CHARS = 500


@attrs.frozen
class OutboxWords:
    """
    What an outbox carries, to whom and through which journal, in the
    words of its log lines and refusals: the usage ledger's by default
    (L{USAGE_WORDS}); svc-proxy's observations for svc-memory
    (decisions D13) have theirs, so that an operator reading
    "RecordUsage to svc-auth failed" knows it is the ledger, and
    "QueueObservations to svc-memory failed" that it is not.

    @ivar records: records in a count (C{"{rows} usage row(s) waiting"}).
    @ivar record: one record (C{"rejected usage row {key}"}).
    @ivar peer: the daemon that commits them.
    @ivar call: its gRPC method.
    @ivar journal: the journal's name at the start of a line.
    @ivar variable: the variable that names the journal.
    @ivar keyField: the log field that carries a record's key, besides
        C{key} (C{ledger_id} for usage rows, as before).
    """

    records: str = "usage row(s)"
    record: str = "usage row"
    peer: str = "svc-auth"
    call: str = "RecordUsage"
    journal: str = "Usage journal"
    variable: str = "SVC_USAGE_JOURNAL"
    keyField: str = "ledger_id"

    def fields(self) -> dict[str, str]:
        """
        The log fields of every line that names what is carried.
        """
        return {
            "records": self.records,
            "record": self.record,
            "peer": self.peer,
            "call": self.call,
            "journal": self.journal,
            "variable": self.variable,
        }


USAGE_WORDS = OutboxWords()


class UsageSender(Protocol):
    """
    Where batches of rows go: svc-auth's RecordUsage
    (L{svcd.ledger.sender.LedgerSender.recordUsage}). The
    Deferred fires once svc-auth has committed every row of the batch that
    it does not list as rejected.
    """

    def recordUsage(
        self, rows: Sequence[auth_pb2.UsageRow]
    ) -> Deferred[auth_pb2.RecordUsageResponse]: ...


class OutboxMetrics(Protocol):
    """
    What the outbox counts, on the metrics of the daemon that holds it
    (svc-proxy's L{svcd.proxy.metrics.ProxyMetrics} exports them as
    C{svc_proxy_usage_outbox_rows}, C{svc_proxy_usage_rows_sent} and
    C{svc_proxy_usage_rows_rejected}): a Protocol, so that this package
    imports no daemon's metrics.
    """

    usageOutboxRows: Gauge
    usageRowsSent: Counter

    def usageRowRejected(self, reason: str) -> None:
        """
        Count one row svc-auth refused for good, by C{reason}.
        """


# The journal file
#
# A magic line, then records: a header of the record's kind (one byte), its
# payload's length and the CRC-32 of its payload (four bytes each, big
# endian), then the payload. A row record's payload is a serialized
# UsageRow; an acknowledgement's is the number of rows acknowledged (four
# bytes) followed by the key of the last of them in UTF-8 (its ledger id,
# or its request id for a row without one, as every row of a journal
# written before ledger ids): the oldest unacknowledged rows of the file,
# in order.
_HEADER = struct.Struct(">BII")
_ACK_COUNT = struct.Struct(">I")
_ROW = 1
_ACK = 2


def _record(kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload), zlib.crc32(payload)) + payload


def rowKey(row: auth_pb2.UsageRow) -> str:
    """
    The ledger's key of C{row}: its ledger id, or its request id for a row
    made before ledger ids (an old journal, an old proxy).
    """
    return row.ledger_id or row.request_id


# The lock files this process holds, by (device, inode), each with its open
# descriptor: held until the process ends. A flock belongs to an open file
# description, so a second open of the same lock file in this process
# would be refused by the first; one process is one holder (a journal
# reopened in the same process, as the tests do to play a restart, is the
# same holder).
_HELD_LOCKS: dict[tuple[int, int], int] = {}


def holdJournalLock(journalPath: str, kind: str = "usage journal") -> str:
    """
    Take the exclusive lock of the journal at C{journalPath} for the rest
    of this process's life: C{flock} on C{<journalPath>.lock}, a file of its
    own, since compaction replaces the journal file by a rename (a lock on
    it would be left on the replaced file). The lock file holds the pid of
    its holder, for the operator.

    @param kind: what the journal is called in a refusal.
    @return: the lock file's path.
    @raise JournalError: when another process holds it (naming the
        journal, the lock file and, when it says so, the holder's pid), or
        when the lock file cannot be opened.
    """
    lockPath = journalPath + ".lock"
    for _ in range(3):
        try:
            fd = os.open(lockPath, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise JournalError(
                f"cannot open the lock file {lockPath!r} of the {kind}: {error.strerror}"
            ) from None
        status = os.fstat(fd)
        key = (status.st_dev, status.st_ino)
        if key in _HELD_LOCKS:
            os.close(fd)
            return lockPath
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lockHolder(fd)
            os.close(fd)
            raise JournalError(
                f"the {kind} {journalPath!r} is held by another process{holder}"
                f" (lock file {lockPath!r}); each svc-proxy process needs a journal of its own"
            ) from None
        except OSError as error:
            os.close(fd)
            raise JournalError(f"cannot lock {lockPath!r}: {error.strerror}") from None
        # A lock file removed or replaced between our open and our flock
        # locks nothing another process would see: take the new one.
        try:
            current = os.stat(lockPath)
        except FileNotFoundError:
            os.close(fd)
            continue
        if (current.st_dev, current.st_ino) != key:
            os.close(fd)
            continue
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            # Only a courtesy to the operator; the lock is what counts.
            pass
        _HELD_LOCKS[key] = fd
        return lockPath
    raise JournalError(f"cannot lock {lockPath!r}: it keeps being replaced")


def _lockHolder(fd: int) -> str:
    try:
        content = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {content})" if content.isdigit() else ""


class UsageJournal:
    """
    The append-only file of rows and acknowledgements (see the module
    docstring for what survives what), and the rejects file beside it.
    One process at a time: L{open} takes the journal's lock.

    L{open} reads what a previous run left, keeps the rows not
    acknowledged, and rewrites the file with only those; then L{append} and
    L{acknowledge} add records, and L{compactIfLarge} rewrites the file
    once its acknowledged part has passed C{compactBytes}.
    """

    log = Logger()

    def __init__(
        self,
        path: str,
        compactBytes: int = COMPACT_JOURNAL_BYTES,
        rowType: Any = auth_pb2.UsageRow,
        keyOf: Callable[[Any], str] = rowKey,
        magic: bytes = JOURNAL_MAGIC,
        words: OutboxWords = USAGE_WORDS,
        rejectedAs: Callable[[Any], dict[str, Any]] | None = None,
    ) -> None:
        # rowType, keyOf and magic make the same journal carry another
        # record that must reach a daemon at least once (svc-proxy's
        # observations for svc-memory, decisions D13): a protobuf message
        # class, the record's idempotence key, and a first line of its own
        # so that one kind of journal is never read as the other. words
        # name them in the log; rejectedAs is what the rejects file keeps of
        # a record set aside (a usage row whole, by default: ids and
        # numbers; an observation holds message content, which it must not
        # keep).
        self.path = path
        self._rowType = rowType
        self._keyOf = keyOf
        self._magic = magic
        self._words = words
        self._rejectedAs = rejectedAs if rejectedAs is not None else _rowDocument
        self._compactBytes = compactBytes
        self._fd: int | None = None
        self._size = 0
        # The record sizes of the rows in the file not yet acknowledged,
        # oldest first, and their sum: the part of the file a compaction
        # keeps.
        self._waiting: deque[int] = deque()
        self._waitingBytes = 0

    @property
    def size(self) -> int:
        return self._size

    @property
    def acknowledgedBytes(self) -> int:
        """
        The part of the file a compaction would drop: rows acknowledged,
        the acknowledgement records.
        """
        return self._size - len(self._magic) - self._waitingBytes

    @property
    def rejectsPath(self) -> str:
        """
        Where records their daemon refused are set aside: JSON lines.
        """
        return self.path + ".rejects"

    @property
    def lockPath(self) -> str:
        return self.path + ".lock"

    def hold(self) -> None:
        """
        Take the journal's lock for the rest of the process's life (see
        L{holdJournalLock}); L{open} does too. The daemon calls this as it
        is built, so that a second proxy on the same journal stops before
        anything starts.

        @raise JournalError: when another process holds it.
        """
        holdJournalLock(self.path, journalKind(self._magic))

    def open(self) -> list[Any]:
        """
        Take the journal's lock, read the journal, rewrite it with only the
        rows not acknowledged and open it for appending.

        @return: those rows, oldest first.
        @raise JournalError: when another process holds the journal, or the
            file is not a journal or cannot be read or written.
        """
        self.hold()
        try:
            with open(self.path, "rb") as existing:
                data = existing.read()
        except FileNotFoundError:
            data = b""
        except OSError as error:
            raise JournalError(f"cannot read {self.path!r}: {error.strerror}") from None
        rows = self._replay(data)
        self._rewrite(rows)
        return rows

    def _replay(self, data: bytes) -> list[Any]:
        if not data:
            return []
        if not data.startswith(self._magic):
            if self._magic.startswith(data):
                # Killed while the first compaction wrote its magic line.
                return []
            raise JournalError(f"{self.path!r} is not a {journalKind(self._magic)} of svc-proxy")
        rows: list[Any] = []
        acknowledged = 0
        offset = len(self._magic)
        while offset < len(data):
            parsed = self._recordAt(data, offset)
            if parsed is None:
                # A record cut short by a kill (or damaged): what follows
                # cannot be trusted either. Rows that were in it were never
                # queued, so never answered to anyone's knowledge.
                self.log.warn(
                    "{journal} {path}: ignored a torn or damaged record at byte"
                    " {offset} ({dropped} byte(s) dropped)",
                    **self._words.fields(),
                    path=self.path,
                    offset=offset,
                    dropped=len(data) - offset,
                )
                break
            kind, payload, offset = parsed
            if kind == _ROW:
                rows.append(self._rowType.FromString(payload))
            elif kind == _ACK:
                count = _ACK_COUNT.unpack_from(payload)[0]
                lastKey = payload[_ACK_COUNT.size :].decode("utf-8", "replace")
                end = acknowledged + count
                # The key is the ledger id; a journal written before ledger
                # ids names the request id, and its rows have no ledger id,
                # so rowKey gives the request id for them.
                if 0 < count and end <= len(rows) and self._keyOf(rows[end - 1]) == lastKey:
                    acknowledged = end
                else:
                    # Never drop a row on a doubtful acknowledgement: sent
                    # again, it is a harmless duplicate.
                    self.log.error(
                        "{journal} {path}: an acknowledgement of {count} {records} up to"
                        " {last_key} does not match the {records} before it; ignored",
                        **self._words.fields(),
                        path=self.path,
                        count=count,
                        last_key=lastKey,
                    )
        waiting = rows[acknowledged:]
        if waiting:
            self.log.info(
                "{journal} {path}: {rows} {records} not acknowledged by {peer}; sending them first",
                **self._words.fields(),
                path=self.path,
                rows=len(waiting),
            )
        return waiting

    @staticmethod
    def _recordAt(data: bytes, offset: int) -> tuple[int, bytes, int] | None:
        if offset + _HEADER.size > len(data):
            return None
        kind, length, checksum = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        payload = data[start : start + length]
        if kind not in (_ROW, _ACK) or len(payload) != length or zlib.crc32(payload) != checksum:
            return None
        if kind == _ACK and length < _ACK_COUNT.size:
            return None
        return kind, payload, start + length

    def _rewrite(self, rows: Sequence[Any]) -> None:
        """
        Replace the journal with one holding C{rows}, atomically: a reader
        (the next start) sees the old file or the new one, never a mix.

        Runs on the caller's thread from start to end (the reactor's, in
        the proxy), so no row can be appended meanwhile: a row recorded
        after this returns goes to the new file, one recorded before is in
        C{rows} (the outbox passes every row it holds unacknowledged).
        """
        records = [_record(_ROW, row.SerializeToString()) for row in rows]
        content = self._magic + b"".join(records)
        temporary = self.path + ".compacting"
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _writeAll(fd, content)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, self.path)
            directoryFD = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(directoryFD)
            finally:
                os.close(directoryFD)
            appending = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as error:
            raise JournalError(f"cannot write {self.path!r}: {error.strerror}") from None
        if self._fd is not None:
            os.close(self._fd)
        self._fd = appending
        self._size = len(content)
        self._waiting = deque(len(record) for record in records)
        self._waitingBytes = len(content) - len(self._magic)

    def append(self, row: Any) -> None:
        """
        Add C{row}, written to the kernel before this returns.

        @raise OSError: when it could not be written (the file is left as
            it was).
        """
        record = _record(_ROW, row.SerializeToString())
        self._write(record)
        self._waiting.append(len(record))
        self._waitingBytes += len(record)

    def acknowledge(self, count: int, lastKey: str) -> None:
        """
        Record that svc-auth took the C{count} oldest rows not yet
        acknowledged (committed them, or refused them for good), the last
        of which has the key C{lastKey} (L{rowKey}).
        """
        payload = _ACK_COUNT.pack(count) + lastKey.encode("utf-8")
        self._write(_record(_ACK, payload))
        # A row the journal could not take (a full disk) is in the outbox
        # but not here: never count below none.
        for _ in range(min(count, len(self._waiting))):
            self._waitingBytes -= self._waiting.popleft()

    def _write(self, record: bytes) -> None:
        if self._fd is None:
            raise OSError(f"the {journalKind(self._magic)} is not open")
        try:
            _writeAll(self._fd, record)
        except OSError:
            # A record half written (a full disk) would hide every record
            # after it from the next start: cut it off.
            os.ftruncate(self._fd, self._size)
            raise
        self._size += len(record)

    def compactIfLarge(self, waiting: Sequence[Any] = ()) -> bool:
        """
        Rewrite the journal with only C{waiting} (every row the outbox
        holds unacknowledged, oldest first) once its acknowledged part has
        grown past its threshold; called after each acknowledgement, so
        that the file stays below the threshold plus the rows waiting.

        @return: whether it was rewritten.
        @raise JournalError: when the rewrite failed (the old journal is
            kept and appended to).
        """
        if self.acknowledgedBytes <= self._compactBytes:
            return False
        self._rewrite(waiting)
        return True

    def reject(self, row: Any, reason: str, detail: str, when: float) -> None:
        """
        Set C{row} aside in the rejects file: one JSON line with what
        C{rejectedAs} keeps of it (a usage row whole, in protobuf's JSON
        mapping, which C{json_format.ParseDict} reads back), the reason,
        the refusing daemon's detail and the time, written to the kernel
        with one C{write} before this returns, as a journal row is.

        @raise OSError: when it could not be written.
        """
        line = json.dumps(
            {
                **self._rejectedAs(row),
                "reason": reason,
                "detail": detail,
                "time": _rfc3339(when),
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        fd = os.open(self.rejectsPath, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            _writeAll(fd, line.encode("utf-8") + b"\n")
        finally:
            os.close(fd)

    def close(self) -> None:
        """
        fsync and close the journal. Its lock stays held until the process
        ends (see L{holdJournalLock}).
        """
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _rfc3339(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _writeAll(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _statusOf(failure: Failure) -> tuple[str, str]:
    error = failure.value
    if isinstance(error, grpc.Call):
        return str(error.code().name).lower(), str(error.details())
    return "error", type(error).__name__


def _unimplemented(failure: Failure) -> bool:
    error = failure.value
    return isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNIMPLEMENTED


def _rowDocument(row: auth_pb2.UsageRow) -> dict[str, Any]:
    """
    What the rejects file keeps of a usage row: all of it (ids and
    numbers, no content).
    """
    return {"row": json_format.MessageToDict(row, preserving_proto_field_name=True)}


def _rowJSON(row: auth_pb2.UsageRow) -> str:
    return json.dumps(
        json_format.MessageToDict(row, preserving_proto_field_name=True),
        sort_keys=True,
        separators=(",", ":"),
    )


def _invalidArgument(failure: Failure) -> bool:
    error = failure.value
    return isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.INVALID_ARGUMENT


class UsageOutbox:
    """
    L{svcd.ledger.rows.UsageLedger} that sends rows to svc-auth (see
    the module docstring).

    @param sender: RecordUsage.
    @param clock: the time of the backoff and of L{flush}'s bound.
    @param maxRows: rows held before L{hasRoom} says no
        (C{SVC_USAGE_OUTBOX_MAX}).
    @param journal: the journal (C{SVC_USAGE_JOURNAL}), or None.
    @param random: a number in [0, 1) for the jitter.
    @param linger: how long a row waits for others to share its batch
        (L{LINGER_SECONDS}); 0 sends at once.
    @param maxBytes: with C{sizeOf}, the bytes of the rows held before
        L{hasRoom} says no, beside C{maxRows} (svc-proxy's observations,
        whose size varies a thousandfold); None: rows are counted only.
    @param sizeOf: a row's size in bytes (its serialized size).
    @param onRecorded: called after each acknowledgement with the ledger
        ids of the rows svc-auth committed (recorded or duplicate, not
        rejected; rows without a ledger id left out): the rate limiter's
        C{recorded}, which learns that their spend is in the ledger.
    """

    log = Logger()

    def __init__(
        self,
        sender: UsageSender | None,
        clock: Clock,
        metrics: OutboxMetrics,
        maxRows: int = OUTBOX_MAX_ROWS,
        journal: UsageJournal | None = None,
        batchRows: int = BATCH_ROWS,
        firstRetry: float = FIRST_RETRY_SECONDS,
        lastRetry: float = LAST_RETRY_SECONDS,
        random: Callable[[], float] = random.random,
        linger: float = LINGER_SECONDS,
        onRecorded: Callable[[Sequence[str]], None] | None = None,
        send: Callable[[Sequence[Any]], Deferred[Any]] | None = None,
        keyOf: Callable[[Any], str] = rowKey,
        describe: Callable[[Any], str] | None = None,
        words: OutboxWords = USAGE_WORDS,
        maxBytes: int | None = None,
        sizeOf: Callable[[Any], int] | None = None,
    ) -> None:
        # send, keyOf, describe and words carry another kind of record
        # (svc-proxy's observations, decisions D13): the call that commits a
        # batch, the record's idempotence key, what the log may say of a
        # record set aside (an observation's content must never be logged)
        # and what the log calls them.
        self.words = words
        if send is None:
            if sender is None:
                raise TypeError("UsageOutbox needs a sender or send")
            send = sender.recordUsage
        self._send = send
        self._keyOf = keyOf
        self._describe = describe if describe is not None else _rowJSON
        self._onRecorded = onRecorded
        self._linger = linger
        self._lingering: IDelayedCall | None = None
        # While a stop waits for the rows: no batch waits for others.
        self._flushing = False
        self._clock = clock
        self._metrics = metrics
        self._maxRows = maxRows
        if (maxBytes is None) != (sizeOf is None):
            raise TypeError("maxBytes and sizeOf go together")
        self._maxBytes = maxBytes
        self._sizeOf = sizeOf
        # The bytes of the rows in self._queue, by sizeOf (0 without it).
        self._bytes = 0
        self._journal = journal
        self._batchRows = batchRows
        self._firstRetry = firstRetry
        self._lastRetry = lastRetry
        self._random = random
        # Every row not yet acknowledged, oldest first; the batch in flight
        # (or waiting to be tried again) is its first self._batch rows.
        self._queue: deque[Any] = deque()
        self._batch = 0
        # After svc-auth failed a batch with INVALID_ARGUMENT: how many rows
        # at the head of the queue hold the row it refuses. Batches are then
        # the first half of those, until the row is alone (and set aside)
        # or they all went through.
        self._suspect = 0
        self._call: Deferred[Any] | None = None
        self._retry: IDelayedCall | None = None
        self._failures = 0
        self._sending = False
        self._again = False
        self._closed = False
        self._emptied: list[Deferred[None]] = []
        self._failing = ThrottledWarning(self.log, clock)
        self._journalFailing = ThrottledWarning(self.log, clock)
        self._rejecting = ThrottledWarning(self.log, clock)
        self._halving = ThrottledWarning(self.log, clock)
        metrics.usageOutboxRows.set_function(lambda: len(self._queue))

    @property
    def waiting(self) -> int:
        """
        Rows not yet acknowledged by svc-auth.
        """
        return len(self._queue)

    @property
    def waitingBytes(self) -> int:
        """
        The bytes of the rows not yet acknowledged, by C{sizeOf} (0
        without one).
        """
        return self._bytes

    def start(self) -> None:
        """
        Take the rows the journal holds unacknowledged (before any new
        row: the proxy calls this before it listens), and send them.

        @raise JournalError: when the journal cannot be used.
        """
        if self._journal is not None:
            replayed = self._journal.open()
            self._queue.extendleft(reversed(replayed))
            self._countBytes(replayed, 1)
        self._sendSoon()

    def hasRoom(self) -> bool:
        if len(self._queue) >= self._maxRows:
            return False
        return self._maxBytes is None or self._bytes < self._maxBytes

    def _countBytes(self, rows: Sequence[Any], sign: int) -> None:
        """
        Add (C{sign} 1) or take away (-1) the bytes of C{rows}: nothing to
        do for usage rows, which are counted only (no C{sizeOf}).
        """
        sizeOf = self._sizeOf
        if sizeOf is not None:
            self._bytes += sign * sum(sizeOf(row) for row in rows)

    def record(self, row: Any) -> None:
        journal = self._journal
        if journal is not None:
            try:
                journal.append(row)
            except OSError as error:
                # Kept in memory all the same: lost only if the proxy is
                # killed before svc-auth has it, as without a journal.
                self._journalFailing.warn(
                    "{journal} {path} cannot be written ({reason}); {records} are"
                    " held in memory only",
                    **self.words.fields(),
                    path=journal.path,
                    reason=str(error),
                )
        self._queue.append(row)
        if self._sizeOf is not None:
            self._bytes += self._sizeOf(row)
        self._sendAfterLinger()

    def _sendAfterLinger(self) -> None:
        """
        Send a full batch at once, a smaller one once it has waited
        C{linger} for more rows (one timer for the batch, not one per row).
        """
        if (
            len(self._queue) >= self._batchRows
            or self._linger <= 0
            or self._flushing
            or self._suspect
        ):
            # A batch being halved is sent at once: its rows waited already.
            self._sendSoon()
        elif self._lingering is None and self._call is None and self._retry is None:
            self._lingering = self._clock.callLater(self._linger, self._lingerOver)

    def _lingerOver(self) -> None:
        self._lingering = None
        self._sendSoon()

    def _stopLingering(self) -> None:
        if self._lingering is not None and self._lingering.active():
            self._lingering.cancel()
        self._lingering = None

    def _sendSoon(self) -> None:
        """
        Send the next batch unless one is in flight or waiting for its
        retry. Rows recorded meanwhile ride with the next batch: under load
        batches grow by themselves, with no timer.
        """
        if self._sending:
            # Called back from within the loop below (an answer that came
            # at once): let the loop go round again.
            self._again = True
            return
        self._sending = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._sendBatch()
        finally:
            self._sending = False

    def _sendBatch(self) -> None:
        if self._closed or self._call is not None or self._retry is not None or not self._queue:
            return
        self._stopLingering()
        if not self._batch:
            limit = (self._suspect + 1) // 2 if self._suspect else self._batchRows
            self._batch = min(limit, len(self._queue))
        batch = list(islice(self._queue, self._batch))
        # In a context of its own: the batch belongs to no request, so its
        # call and log lines carry no request's ids or trace.
        call = contextvars.Context().run(self._callSender, batch)
        self._call = call
        call.addCallbacks(self._acknowledged, self._failed)

    def _callSender(self, batch: list[Any]) -> Deferred[Any]:
        try:
            return self._send(batch)
        except Exception as error:
            failed: Deferred[Any] = Deferred()
            failed.errback(error)
            return failed

    def _acknowledged(self, response: Any) -> None:
        self._call = None
        count = self._batch
        if self._suspect:
            # These went through: the refused row is among the rest.
            self._suspect = max(0, self._suspect - count)
        if self._failures:
            self.log.info(
                "{peer} took {records} again after {attempts} failed attempt(s);"
                " {rows} {records} waiting",
                **self.words.fields(),
                attempts=self._failures,
                rows=len(self._queue) - count,
            )
            self._failures = 0
        rejected = list(getattr(response, "rejected", ()))
        recorded = getattr(response, "recorded", count - len(rejected))
        duplicates = getattr(response, "duplicates", 0)
        if recorded + duplicates + len(rejected) != count:
            # svc-auth answers only after committing the batch: the rows
            # are in. A count that disagrees says its accounting is off.
            self.log.warn(
                "{call} acknowledged a batch of {rows} {records} as {recorded} recorded,"
                " {duplicates} duplicate(s) and {rejected} rejected",
                **self.words.fields(),
                rows=count,
                recorded=recorded,
                duplicates=duplicates,
                rejected=len(rejected),
            )
        self._settle(rejected)

    def _settle(self, rejected: Sequence[Any]) -> None:
        """
        The batch in flight is done with: svc-auth committed its rows but
        the C{rejected} ones (L{auth_pb2.RejectedUsageRow}s, by index in
        the batch), which are set aside. Every row of the batch leaves the
        queue and the journal; none is sent again.
        """
        count, self._batch = self._batch, 0
        batch = [self._queue.popleft() for _ in range(count)]
        self._countBytes(batch, -1)
        refused: dict[int, tuple[str, str]] = {}
        for each in rejected:
            index = int(each.index)
            if 0 <= index < count and index not in refused:
                refused[index] = (str(each.reason), str(each.detail)[:DETAIL_CHARS])
            else:
                self.log.warn(
                    "{call} rejected a {record} at index {index} of a batch of {rows}"
                    " {records}; ignored",
                    **self.words.fields(),
                    index=index,
                    rows=count,
                )
        for index, (reason, detail) in sorted(refused.items()):
            self._setAside(batch[index], reason, detail)
        self._metrics.usageRowsSent.inc(count - len(refused))
        journal = self._journal
        if journal is not None and not self._closed:
            try:
                # After the rejects file: a kill in between sends the
                # refused rows again, and they are refused again.
                journal.acknowledge(count, self._keyOf(batch[-1]))
                journal.compactIfLarge(self._queue)
            except (OSError, JournalError) as error:
                # The rows will be sent again at the next start: harmless.
                self._journalFailing.warn(
                    "{journal} {path} cannot be written ({reason}); {records} are"
                    " held in memory only",
                    **self.words.fields(),
                    path=journal.path,
                    reason=str(error),
                )
        if self._onRecorded is not None:
            committed = [
                row.ledger_id
                for index, row in enumerate(batch)
                if index not in refused and row.ledger_id
            ]
            if committed:
                try:
                    self._onRecorded(committed)
                except Exception:
                    self.log.failure("onRecorded failed for {rows} row(s)", rows=len(committed))
        if self._queue:
            self._sendAfterLinger()
        else:
            self._fireEmptied()

    def _setAside(self, row: Any, reason: str, detail: str) -> None:
        """
        Keep C{row}, which its daemon will never commit, where an operator
        finds it: the rejects file beside the journal, or without one (or
        when it cannot be written) the log itself, as C{describe} tells it
        (a usage row whole: its ids and numbers; an observation by its ids
        and size, never its content).
        """
        label = reason if reason in REJECT_REASONS else "other"
        self._metrics.usageRowRejected(label)
        ids = self._ids(row)
        journal = self._journal
        if journal is not None:
            try:
                journal.reject(row, reason, detail, self._clock.seconds())
            except OSError as error:
                self.log.error(
                    "Rejects file {path} cannot be written ({error}); {record}"
                    " {key} rejected by {peer} ({reason}: {detail}): {row}",
                    **self.words.fields(),
                    **ids,
                    path=journal.rejectsPath,
                    error=str(error),
                    reason=reason,
                    detail=detail,
                    row=self._describe(row),
                )
            else:
                self._rejecting.warn(
                    "{peer} rejected {record} {key} ({reason}: {detail}); set aside in {path}",
                    **self.words.fields(),
                    **ids,
                    reason=reason,
                    detail=detail,
                    path=journal.rejectsPath,
                )
            return
        # Every such line, not throttled: it is the only trace of the row.
        self.log.error(
            "{peer} rejected {record} {key} ({reason}: {detail}); without"
            " {variable} it is kept only here: {row}",
            **self.words.fields(),
            **ids,
            reason=reason,
            detail=detail,
            row=self._describe(row),
        )

    def _ids(self, row: Any) -> dict[str, str]:
        """
        The log fields that name C{row}: its key (also under the words'
        C{keyField}) and its request id.
        """
        key = self._keyOf(row)
        return {"key": key, self.words.keyField: key, "request_id": str(row.request_id)}

    def _failed(self, failure: Failure) -> None:
        self._call = None
        if self._closed:
            return
        if _invalidArgument(failure):
            self._refused(failure)
            return
        self._failures += 1
        ceiling = min(self._lastRetry, self._firstRetry * 2 ** min(self._failures - 1, 32))
        delay = ceiling / 2 + self._random() * ceiling / 2
        status, details = _statusOf(failure)
        self._failing.warn(
            "{call} to {peer} failed ({grpc_status}: {grpc_details}); {rows} {records}"
            " waiting, trying again in {delay:.2f} s",
            **self.words.fields(),
            grpc_status=status,
            grpc_details=details,
            rows=len(self._queue),
            delay=delay,
        )
        self._retry = self._clock.callLater(delay, self._retryNow)
        if _unimplemented(failure):
            # An svc-auth without RecordUsage will not gain it while a stop
            # waits: end the flush now rather than at its bound.
            self._fireEmptied()

    def _refused(self, failure: Failure) -> None:
        """
        svc-auth failed the whole batch with INVALID_ARGUMENT: an svc-auth
        older than per-row rejects, or a batch it cannot take as a whole.
        Asked again, it answers the same, so the batch would stall the
        ledger for ever: send its first half (at once: no backoff, nothing
        is down), and so on, until the row it refuses is alone; that row is
        set aside as C{invalid}, and the rest go on.
        """
        count, self._batch = self._batch, 0
        _, details = _statusOf(failure)
        if count <= 1:
            self._suspect = 0
            self._batch = 1
            refusal = auth_pb2.RejectedUsageRow(
                index=0, reason="invalid", detail=details[:DETAIL_CHARS]
            )
            self._settle([refusal])
            return
        self._suspect = count
        self._halving.warn(
            "{call} refused a batch of {rows} {records} as invalid"
            " ({grpc_details}); sending it in halves to find the {record} it refuses",
            **self.words.fields(),
            rows=count,
            grpc_details=details[:DETAIL_CHARS],
        )
        self._sendSoon()

    def _retryNow(self) -> None:
        self._retry = None
        self._sendSoon()

    def _fireEmptied(self) -> None:
        waiting, self._emptied = self._emptied, []
        for each in waiting:
            each.callback(None)

    def flush(self, timeout: float) -> Deferred[int]:
        """
        Send every row waiting, for at most C{timeout} seconds (a graceful
        stop, once no request is left to record). A batch waiting out its
        backoff is tried at once.

        @return: a Deferred that fires with the number of rows still not
            acknowledged at the end (0 when all were).
        """
        if not self._queue:
            return succeed(0)
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
            self._retry = None
        self._flushing = True
        emptied: Deferred[None] = Deferred()
        self._emptied.append(emptied)
        self._sendSoon()
        bounded = timeoutDeferred(emptied, timeout, asReactorTime(self._clock))

        def leftOver(_: object) -> int:
            return len(self._queue)

        def timedOut(failure: Failure) -> int:
            failure.trap(TimeoutError, CancelledError)
            return len(self._queue)

        return bounded.addCallbacks(leftOver, timedOut)

    def close(self) -> int:
        """
        Stop sending (the call in flight is cancelled) and close the
        journal; say how many rows were left and where they are.

        @return: that number.
        """
        if self._closed:
            return len(self._queue)
        self._closed = True
        self._stopLingering()
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if self._call is not None:
            self._call.cancel()
        left = len(self._queue)
        if left and self._journal is not None:
            self.log.warn(
                "{rows} {records} not acknowledged by {peer} at stop; kept in the"
                " journal {path}, sent at the next start",
                **self.words.fields(),
                rows=left,
                path=self._journal.path,
            )
        elif left:
            self.log.error(
                "{rows} {records} not acknowledged by {peer} at stop and lost"
                " ({variable} is not set)",
                **self.words.fields(),
                rows=left,
            )
        if self._journal is not None:
            try:
                self._journal.close()
            except OSError as error:
                self.log.error(
                    "{journal} {path}: cannot close ({reason})",
                    **self.words.fields(),
                    path=self._journal.path,
                    reason=str(error),
                )
        return left
