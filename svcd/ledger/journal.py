"""
The journal of an outbox (L{svcd.ledger.outbox}): the file that lets
records outlive the process until their daemon has committed them.
svc-proxy's usage rows for svc-auth (C{SVC_USAGE_JOURNAL}, decisions
D12) and its observations for svc-memory (C{SVC_MEMORY_JOURNAL}, D13)
each have one, of the same format and a first line of its own (the
format, the first lines and the lock are L{svcd.ledger.journalfile}'s).
What follows says "rows" and "svc-auth" for both.

What survives what:

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
  - The usage journal is rewritten with only the rows not yet
    acknowledged whenever the acknowledged part has passed its threshold,
    rows waiting or not: its size stays below the threshold plus the rows
    waiting.
  - The memory journal forgets (decisions D13, amended): its rows hold
    what users said, so it is rewritten with only the rows not yet
    acknowledged after every acknowledgement, within a second and at
    most a few times a second (L{Compactions}). A rewrite writes a new
    file (C{<journal>.compacting}), fsyncs it, renames it over the
    journal and fsyncs the directory; the old file's inode, acknowledged
    rows and all, is freed as the journal's descriptor on it is closed.
    Freed blocks are the filesystem's to reuse: their bytes may stay on
    the device until then (an encrypted volume is the answer for whom
    that matters). A kill before the rename leaves the old journal whole
    and a copy beside it, which the next start's own rewrite replaces; a
    rewrite that fails removes its copy.
  - A rewrite on the caller's thread (the usage journal's, the start's)
    runs from start to end there, so that no row is appended meanwhile: a
    row recorded before it is among the rows it keeps, one recorded after
    goes to the new file. The memory journal's are done mostly in a
    thread of their own (L{svcd.ledger.compactions}): a row recorded
    meanwhile goes to the old file and is carried over, as it is, with
    the acknowledgements recorded meanwhile, when the copy replaces it.
  - One process holds a journal: an exclusive C{flock} on C{<journal>.lock},
    held for the life of the process (compaction replaces the journal
    file itself, so the lock cannot be on it). A second process refuses
    to start, naming the file.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf import json_format
from twisted.logger import Logger

from svcd.ledger.compactions import JournalCopy, fsyncDirectory, writeAll
from svcd.ledger.journalfile import (
    ACK_COUNT,
    ACK_RECORD,
    JOURNAL_MAGIC,
    ROW_RECORD,
    JournalError,
    encodeRecord,
    holdJournalLock,
    journalKind,
    recordAt,
)
from svcd.ledger.words import USAGE_WORDS, OutboxWords
from svcd.pb.auth.v1 import auth_pb2

__all__ = ["COMPACT_JOURNAL_BYTES", "Journal", "usageRowKey"]

# The journal is rewritten with only the rows not yet acknowledged once its
# acknowledged part (rows svc-auth committed or set aside, and the
# acknowledgement records) is larger than this: some 55,000 rows' worth,
# about 27 s of 2,000 requests/s. Each rewrite copies the rows waiting
# (normally a batch or two) and costs two fsyncs, so a smaller threshold
# trades disk for more frequent flushes.
COMPACT_JOURNAL_BYTES = 16 * 1024 * 1024


def usageRowKey(row: auth_pb2.UsageRow) -> str:
    """
    The ledger's key of C{row}: its ledger id, or its request id for a row
    made before ledger ids (an old journal, an old proxy).
    """
    return row.ledger_id or row.request_id


class Journal:
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
        keyOf: Callable[[Any], str] = usageRowKey,
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
        self._rejectedAs = rejectedAs if rejectedAs is not None else _usageRowDocument
        self._compactBytes = compactBytes
        self._fd: int | None = None
        self._size = 0
        # Where the records of the rows in the file not yet acknowledged
        # are (offset, length), oldest first, and the sum of their
        # lengths: the part of the file a compaction keeps.
        self._waiting: deque[tuple[int, int]] = deque()
        self._waitingBytes = 0
        # Counts the files the journal was: a copy made in a thread for
        # an earlier one is not renamed over a later one.
        self._generation = 0
        # Rows acknowledged so far, in every file the journal was: how
        # many of a copy's rows were acknowledged while it was made.
        self._acknowledgedRows = 0

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
            parsed = recordAt(data, offset)
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
            if kind == ROW_RECORD:
                rows.append(self._rowType.FromString(payload))
            elif kind == ACK_RECORD:
                count = ACK_COUNT.unpack_from(payload)[0]
                lastKey = payload[ACK_COUNT.size :].decode("utf-8", "replace")
                end = acknowledged + count
                # The key is the ledger id; a journal written before ledger
                # ids names the request id, and its rows have no ledger id,
                # so usageRowKey gives the request id for them.
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

    def _rewrite(self, rows: Sequence[Any]) -> None:
        """
        Replace the journal with one holding C{rows}, atomically: a reader
        (the next start) sees the old file or the new one, never a mix.

        Runs on the caller's thread from start to end (the reactor's, in
        the proxy), so no row can be appended meanwhile: a row recorded
        after this returns goes to the new file, one recorded before is in
        C{rows} (the outbox passes every row it holds unacknowledged).
        """
        records = [encodeRecord(ROW_RECORD, row.SerializeToString()) for row in rows]
        self._replace(records, [len(record) for record in records])

    def _rewriteFromFile(self) -> bool:
        """
        L{_rewrite} with the rows the file holds unacknowledged, their
        records copied as they are: a rewrite for each acknowledgement
        (L{dropAcknowledged}) would otherwise serialize every row waiting
        again, which costs more than the rest when thousands wait.

        @return: False when the records could not be read (nothing was
            written).
        @raise JournalError: when the rewrite failed.
        """
        lengths = [length for _, length in self._waiting]
        runs = self._runs()
        try:
            with open(self.path, "rb") as existing:
                chunks = [os.pread(existing.fileno(), length, offset) for offset, length in runs]
        except OSError:
            return False
        if [len(chunk) for chunk in chunks] != [length for _, length in runs]:
            return False
        self._replace(chunks, lengths)
        return True

    def _runs(self) -> list[tuple[int, int]]:
        """
        The byte ranges (offset, length) of the rows waiting, adjacent
        records read at once: normally one run, broken only by
        acknowledgement records.
        """
        runs: list[list[int]] = []
        for offset, length in self._waiting:
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1][1] += length
            else:
                runs.append([offset, length])
        return [(offset, length) for offset, length in runs]

    def copyable(self, waiting: Sequence[Any]) -> bool:
        """
        Whether a rewrite with only C{waiting} can copy the rows' records
        from the file (L{startCopy}): something acknowledged is in it, it
        is open, and it holds every row of C{waiting} (a row the journal
        could not take, on a full disk, makes the outbox hold more).
        """
        return (
            self.acknowledgedBytes > 0
            and self._fd is not None
            and len(waiting) == len(self._waiting)
        )

    def startCopy(self) -> JournalCopy:
        """
        The first step of a rewrite in a thread (L{svcd.ledger.compactions}):
        note where the rows waiting are and take a descriptor to read the
        file by; on the caller's (reactor's) thread, microseconds. The journal is
        appended to and acknowledged as before until L{finishCopy}.

        @raise OSError: when the journal is not open.
        """
        if self._fd is None:
            raise OSError(0, f"the {journalKind(self._magic)} is not open")
        # A duplicate, not an open of the path: no lookup, no wait on the
        # filesystem's journal, on the reactor's thread.
        source = os.dup(self._fd)
        # Where each row goes in the copy is the thread's to work out: a
        # loop over thousands of rows is milliseconds of the reactor's.
        return JournalCopy(
            self.path,
            self._magic,
            source,
            list(self._waiting),
            self._waitingBytes,
            self._size,
            self._acknowledgedRows,
            self._generation,
        )

    def finishCopy(self, copy: JournalCopy) -> bool:
        """
        The last step of a rewrite in a thread, once C{copy} is written
        and fsynced: append what the journal gained since L{startCopy}
        (rows and acknowledgements, as they are) to the copy, rename it
        over the journal and append to it from now on. The old file has
        no name any more; its descriptors are left to
        L{JournalCopy.retire}, whose closing frees its inode, acknowledged
        rows and all. On the caller's (reactor's) thread: a write of the
        tail and a rename.

        @return: False when the journal was rewritten otherwise since
            C{copy} began (the copy is removed, nothing changed).
        @raise JournalError: when the tail could not be appended or the
            copy renamed (the copy is removed; the old journal is kept
            and appended to).
        """
        if copy.generation != self._generation or self._fd is None or copy.fd is None:
            copy.discard()
            return False
        assert copy.source is not None
        tail = self._size - copy.snapshotSize
        try:
            if tail:
                data = os.pread(copy.source, tail, copy.snapshotSize)
                if len(data) != tail:
                    raise OSError(0, "the journal is shorter than its records")
                writeAll(copy.fd, data)
            os.replace(copy.temporary, self.path)
        except OSError as error:
            copy.discard()
            raise JournalError(f"cannot write {self.path!r}: {error.strerror}") from None
        # The old file's descriptors are closed by JournalCopy.retire, in
        # the thread: the last close frees the inode, which for a file of
        # tens of MiB takes the kernel milliseconds to a tenth of a second.
        copy.retired = [self._fd, copy.source]
        self._fd, copy.fd, copy.source = copy.fd, None, None
        self._generation += 1
        # The rows waiting: those of the copy (their places worked out by
        # the thread) but the ones acknowledged since the snapshot, which
        # are its oldest, then those of the tail.
        waiting = copy.waiting
        acknowledged = self._acknowledgedRows - copy.acknowledgedRows
        for _ in range(min(acknowledged, len(waiting))):
            waiting.popleft()
        later = len(self._waiting) - len(waiting)
        shift = copy.copiedEnd - copy.snapshotSize
        if later > 0:
            recent = list(itertools.islice(reversed(self._waiting), later))
            waiting.extend((offset + shift, length) for offset, length in reversed(recent))
        self._waiting = waiting
        self._size = copy.copiedEnd + tail
        return True

    def _replace(self, chunks: Sequence[bytes], lengths: Sequence[int]) -> None:
        """
        Replace the journal with the magic line and C{chunks}, which hold
        row records of C{lengths}, in order (see L{_rewrite}).
        """
        content = self._magic + b"".join(chunks)
        temporary = self.path + ".compacting"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                writeAll(fd, content)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, self.path)
        except OSError as error:
            # The copy holds rows' content (observations: what users said):
            # not left behind once they are acknowledged. A kill before
            # this leaves it to the next start, whose own rewrite replaces
            # it.
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise JournalError(f"cannot write {self.path!r}: {error.strerror}") from None
        # The new file is the journal now, whatever follows: the old one's
        # descriptor is closed (its inode, acknowledged rows and all, is
        # freed with it), and appends go to the new one or, when it cannot
        # be opened, fail as on a full disk (the rows are held in memory).
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._generation += 1
        self._size = len(content)
        self._waiting = deque()
        offset = len(self._magic)
        for length in lengths:
            self._waiting.append((offset, length))
            offset += length
        self._waitingBytes = len(content) - len(self._magic)
        try:
            fsyncDirectory(self.path)
            # Read too: a rewrite in the thread copies from a duplicate.
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        except OSError as error:
            raise JournalError(f"cannot write {self.path!r}: {error.strerror}") from None

    def append(self, row: Any) -> None:
        """
        Add C{row}, written to the kernel before this returns.

        @raise OSError: when it could not be written (the file is left as
            it was).
        """
        record = encodeRecord(ROW_RECORD, row.SerializeToString())
        offset = self._size
        self._write(record)
        self._waiting.append((offset, len(record)))
        self._waitingBytes += len(record)

    def acknowledge(self, count: int, lastKey: str) -> None:
        """
        Record that svc-auth took the C{count} oldest rows not yet
        acknowledged (committed them, or refused them for good), the last
        of which has the key C{lastKey} (L{usageRowKey}).
        """
        # A row the journal could not take (a full disk) is in the outbox
        # but not here: never count below none. Counted before the record
        # is written: rows acknowledged are the compaction's to drop even
        # when their acknowledgement could not be journalled.
        taken = min(count, len(self._waiting))
        for _ in range(taken):
            self._waitingBytes -= self._waiting.popleft()[1]
        self._acknowledgedRows += taken
        payload = ACK_COUNT.pack(count) + lastKey.encode("utf-8")
        self._write(encodeRecord(ACK_RECORD, payload))

    def _write(self, record: bytes) -> None:
        if self._fd is None:
            raise OSError(f"the {journalKind(self._magic)} is not open")
        try:
            writeAll(self._fd, record)
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

    def dropAcknowledged(self, waiting: Sequence[Any] = ()) -> bool:
        """
        Rewrite the journal with only C{waiting} (as L{compactIfLarge})
        whenever it holds anything acknowledged, whatever its size: what
        L{Compactions} calls for a journal that forgets. The records of
        the rows are copied from the file when it holds every row of
        C{waiting}, else C{waiting} is written anew.

        @return: whether it was rewritten.
        @raise JournalError: when the rewrite failed.
        """
        if self.acknowledgedBytes <= 0:
            return False
        if len(waiting) == len(self._waiting) and self._fd is not None:
            # The same rows (a row the journal could not take would make
            # the outbox hold more): copied from the file, unless it
            # cannot be read.
            if self._rewriteFromFile():
                return True
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
            writeAll(fd, line.encode("utf-8") + b"\n")
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


def _usageRowDocument(row: auth_pb2.UsageRow) -> dict[str, Any]:
    """
    What the rejects file keeps of a usage row: all of it (ids and
    numbers, no content).
    """
    return {"row": json_format.MessageToDict(row, preserving_proto_field_name=True)}
