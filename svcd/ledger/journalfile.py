"""
The usage journal's file, as the configuration sees it: the magic line
that starts every journal, and the check of a path before the daemon
starts (L{checkJournalPath}). Apart from the journal that writes it
(L{svcd.ledger.journal}) so that reading a daemon's configuration imports
no gRPC and no Twisted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from svcd.common.config import ConfigError

__all__ = [
    "JOURNAL_MAGIC",
    "MEMORY_JOURNAL_MAGIC",
    "JournalError",
    "checkJournalPath",
    "journalFromEnvironment",
    "journalKind",
]

# The first line of every usage journal (the format is described in
# svcd.ledger.journal).
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
