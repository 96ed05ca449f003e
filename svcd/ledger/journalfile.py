"""
A journal's file, apart from the journal that writes it
(L{svcd.ledger.journal}): its format (the first line that says which
journal it is, then framed records), the check of a path before the
daemon starts (L{checkJournalPath}), and the lock that lets one process
hold it (L{holdJournalLock}). A leaf, so that reading a daemon's
configuration imports no gRPC and no Twisted.
"""

from __future__ import annotations

import fcntl
import os
import struct
import zlib
from collections.abc import Mapping

from svcd.common.config import ConfigError

__all__ = [
    "ACK_COUNT",
    "ACK_RECORD",
    "JOURNAL_MAGIC",
    "MEMORY_JOURNAL_MAGIC",
    "RECORD_HEADER",
    "ROW_RECORD",
    "JournalError",
    "checkJournalPath",
    "encodeRecord",
    "holdJournalLock",
    "journalFromEnvironment",
    "journalKind",
    "recordAt",
]

# The first line of every usage journal (the records that follow it are
# described below).
JOURNAL_MAGIC = b"svc-usage-journal 1\n"
# The first line of a memory journal (SVC_MEMORY_JOURNAL: svc-proxy's
# observations for svc-memory, decisions D13): the same format with
# records of another type, so a first line of its own, that neither kind
# is ever read as the other.
MEMORY_JOURNAL_MAGIC = b"svc-memory-journal 1\n"

# What each first line says the file is, for the refusals' wording.
_KINDS = {JOURNAL_MAGIC: "usage journal", MEMORY_JOURNAL_MAGIC: "memory journal"}


class JournalError(Exception):
    """
    The journal cannot be used: not a journal of its kind, not readable or
    writable, or held by another process.
    """


def journalKind(magic: bytes) -> str:
    """
    What a journal with the first line C{magic} is called in refusals:
    C{usage journal} or C{memory journal}.
    """
    return _KINDS.get(magic, "journal")


def checkJournalPath(path: str, magic: bytes = JOURNAL_MAGIC) -> None:
    """
    Refuse a path that cannot be a journal, before the daemon starts: its
    directory must exist, and a file already there must be a journal of
    the kind C{magic} starts (a memory journal named as the usage journal,
    or the reverse, is refused by name rather than read).

    @raise JournalError: saying why.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise JournalError(f"the directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise JournalError(f"{path!r} is a directory")
    try:
        with open(path, "rb") as existing:
            start = existing.read(max(len(each) for each in _KINDS))
    except FileNotFoundError:
        return
    except OSError as error:
        raise JournalError(f"cannot read {path!r}: {error.strerror}") from None
    # A file cut inside its first line (a kill during the first compaction)
    # is the kind whose line it begins.
    if magic.startswith(start[: len(magic)]):
        return
    expected = journalKind(magic)
    for other, kind in _KINDS.items():
        if other != magic and start.startswith(other):
            raise JournalError(
                f"{path!r} is a {kind} of svc-proxy, not a {expected}: each needs a file of its own"
            )
    raise JournalError(f"{path!r} is not a {expected} of svc-proxy")


def journalFromEnvironment(
    environ: Mapping[str, str], name: str, magic: bytes = JOURNAL_MAGIC
) -> str | None:
    """
    The journal's path named by the variable C{name} (C{SVC_USAGE_JOURNAL},
    or C{SVC_MEMORY_JOURNAL} with the memory journal's C{magic}), or None
    when unset or empty.

    @raise ConfigError: when the path cannot be a journal (no such
        directory, a directory, another kind of file).
    """
    path = environ.get(name, "").strip()
    if not path:
        return None
    try:
        checkJournalPath(path, magic)
    except JournalError as error:
        raise ConfigError(name, str(error)) from None
    return path


# The records
#
# A magic line, then records: a header of the record's kind (one byte), its
# payload's length and the CRC-32 of its payload (four bytes each, big
# endian), then the payload. A row record's payload is a serialized
# UsageRow; an acknowledgement's is the number of rows acknowledged (four
# bytes) followed by the key of the last of them in UTF-8 (its ledger id,
# or its request id for a row without one, as every row of a journal
# written before ledger ids): the oldest unacknowledged rows of the file,
# in order.
RECORD_HEADER = struct.Struct(">BII")
ACK_COUNT = struct.Struct(">I")
ROW_RECORD = 1
ACK_RECORD = 2


def encodeRecord(kind: int, payload: bytes) -> bytes:
    """
    A record of C{kind} (L{ROW_RECORD} or L{ACK_RECORD}): its header, then
    C{payload}.
    """
    return RECORD_HEADER.pack(kind, len(payload), zlib.crc32(payload)) + payload


def recordAt(data: bytes, offset: int) -> tuple[int, bytes, int] | None:
    """
    The kind, payload and end of the record at C{offset} of C{data}, or
    None when it is cut short, damaged or of no kind known.
    """
    if offset + RECORD_HEADER.size > len(data):
        return None
    kind, length, checksum = RECORD_HEADER.unpack_from(data, offset)
    start = offset + RECORD_HEADER.size
    payload = data[start : start + length]
    if (
        kind not in (ROW_RECORD, ACK_RECORD)
        or len(payload) != length
        or zlib.crc32(payload) != checksum
    ):
        return None
    if kind == ACK_RECORD and length < ACK_COUNT.size:
        return None
    return kind, payload, start + length


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
