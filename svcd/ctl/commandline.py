"""
What every command group of svcctl shares: the parser that refuses a
command line with one line on stderr and status 2, the error a command
reports on one line with status 1, UUID arguments, how ids and times are
printed, and the checks, as the schema owner, that an organization exists
and an agent is one of its own.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import uuid
from collections.abc import Callable
from typing import NoReturn

from svcd.auth.store import Store
from svcd.common.errors import rfc3339
from svcd.common.ids import parseUUID


class CommandError(Exception):
    """
    A failure to report on one stderr line.
    """


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def uuidArgument(what: str) -> Callable[[str], uuid.UUID]:
    """
    The type of a UUID option or argument named C{what}.
    """

    def parse(text: str) -> uuid.UUID:
        parsed = parseUUID(text.strip().lower())
        if parsed is None:
            raise argparse.ArgumentTypeError(f"{what} must be a UUID, got {text!r}")
        return parsed

    return parse


def timestamp(moment: datetime.datetime | None) -> str | None:
    return None if moment is None else rfc3339(moment)


def formatID(value: uuid.UUID | None) -> str | None:
    return None if value is None else str(value)


def requireOrganization(store: Store, orgID: uuid.UUID) -> None:
    if not store.organizationExists(orgID):
        raise CommandError(f"no organization {orgID}")


def requireAgent(store: Store, orgID: uuid.UUID, agentID: uuid.UUID | None) -> None:
    requireOrganization(store, orgID)
    if agentID is not None and store.agentInOrganization(orgID, agentID) is None:
        # The same words for an unknown agent and another organization's.
        raise CommandError(f"no agent {agentID} in organization {orgID}")
