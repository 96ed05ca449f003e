"""
The usage journal's file, as the configuration sees it: the magic line
that starts every journal, and the check of a path before the daemon
starts (L{checkJournalPath}). Apart from the outbox that writes it
(L{svcd.ledger.outbox}) so that reading a daemon's configuration imports
no gRPC and no Twisted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from svcd.common.config import ConfigError

__all__ = ["JOURNAL_MAGIC", "JournalError", "checkJournalPath", "journalFromEnvironment"]

# The first line of every journal file (the format is described in
# svcd.ledger.outbox).
JOURNAL_MAGIC = b"svc-usage-journal 1\n"


class JournalError(Exception):
    """
    The journal cannot be used: not a journal of usage rows, not readable
    or writable, or held by another process.
    """


def checkJournalPath(path: str) -> None:
    """
    Refuse a path that cannot be a journal, before the daemon starts: its
    directory must exist, and a file already there must be a journal.

    @raise JournalError: saying why.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise JournalError(f"the directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise JournalError(f"{path!r} is a directory")
    try:
        with open(path, "rb") as existing:
            start = existing.read(len(JOURNAL_MAGIC))
    except FileNotFoundError:
        return
    except OSError as error:
        raise JournalError(f"cannot read {path!r}: {error.strerror}") from None
    if not JOURNAL_MAGIC.startswith(start):
        raise JournalError(f"{path!r} is not a usage journal of svc-proxy")


def journalFromEnvironment(environ: Mapping[str, str], name: str) -> str | None:
    """
    The journal's path named by the variable C{name} (C{SVC_USAGE_JOURNAL}),
    or None when unset or empty.

    @raise ConfigError: when the path cannot be a journal (no such
        directory, a directory, another kind of file).
    """
    path = environ.get(name, "").strip()
    if not path:
        return None
    try:
        checkJournalPath(path)
    except JournalError as error:
        raise ConfigError(name, str(error)) from None
    return path
