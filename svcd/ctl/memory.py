"""
svcctl memory list|show|delete|purge (decisions D13): operators read and
forget an agent's memories, straight in PostgreSQL like every svcctl
command (L{svcd.ctl}); svcctl memory jobs [retry|drop]: the observations
svc-worker has not done yet (waiting or failed, with their attempts and
reason, never their content), made due again or dropped; and svcctl
memory settings: whether an organization's or agent's memories are
recalled and its exchanges observed, held in svc-auth's tables.

Unlike svcctl's other commands (memory settings among them), which act as
the schema owner, these run as svc_memory_app in the named organization's row-level security context
(C{SET ROLE} on svcctl's connection, after the organization and agent are
checked as the owner): a mistyped id can never reach another
organization's memories. Every change is announced to the replicas by the
table's trigger, as any change is, so a memory deleted here leaves every
replica's cache within a second.

Prints one JSON document, as every svcctl command. A memory is shown as
the proxy shows it (content, metadata, subject, times), plus the model
that embedded it; never its vector.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import uuid
from typing import Any

import psycopg

from svcd.auth.store import Store
from svcd.auth.store.memorysettings import MEMORY_SETTINGS, OBSERVE_MODES, MemorySettingsRecord
from svcd.common.errors import rfc3339
from svcd.ctl.commandline import CommandError, Parser, formatID, requireAgent, uuidArgument
from svcd.memory.records import SUBJECT_PATTERN, MemoryRecord
from svcd.memory.store import MemoryStore
from svcd.memory.store.base import APPLICATION_ROLE, MemoryForbidden, MemoryNotFound
from svcd.memory.store.jobs import ObservationJob
from svcd.memoryclient.records import Scope

MAX_LIST = 1000


def _subject(text: str) -> str:
    if SUBJECT_PATTERN.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(
            "must be empty or 1 to 128 characters of A-Z a-z 0-9 . _ : @ -"
        )
    return text


def _limit(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_LIST:
        raise argparse.ArgumentTypeError(f"must be a number from 1 to {MAX_LIST}, got {text!r}")
    return int(text)


# A memory setting as svcctl takes and prints it, and as the table holds
# it (None: inherit).
_SWITCHES: dict[str, bool | None] = {"on": True, "off": False, "inherit": None}


def _switch(text: str) -> bool | None:
    """
    The value of --recall or --observe. (argparse names the flag in its
    message.)
    """
    try:
        return _SWITCHES[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"must be on, off or inherit; got {text!r}") from None


def _switchName(value: bool | None) -> str:
    return "inherit" if value is None else "on" if value else "off"


# --observe (decisions D13 amended, "Whose words"): a mode, or inherit.
_OBSERVE_VALUES: dict[str, str | None] = {**{mode: mode for mode in OBSERVE_MODES}, "inherit": None}


def _observeMode(text: str) -> str | None:
    """
    The value of --observe: on (requests that name a subject), all (those
    that name none too, into the agent's shared subject), off or inherit.
    """
    try:
        return _OBSERVE_VALUES[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"must be on, all, off or inherit; got {text!r}") from None


def _observeName(value: str | None) -> str:
    return "inherit" if value is None else value


def addCommands(commands: Any) -> None:
    """
    Add C{svcctl memory ...} to svcctl's subcommands: the memories and
    jobs, then C{settings}.
    """
    memory = commands.add_parser(
        "memory", help="agents' memories (svc-memory): list, show, delete, purge; settings"
    ).add_subparsers(dest="action", required=True, parser_class=Parser)
    listing = memory.add_parser("list", help="an agent's memories, newest first")
    show = memory.add_parser("show", help="one memory")
    delete = memory.add_parser("delete", help="forget one memory")
    purge = memory.add_parser(
        "purge", help="forget every memory and observation of the agent, or of one subject"
    )
    for each in (listing, show, delete, purge):
        each.add_argument("--org", required=True, type=uuidArgument("--org"))
        each.add_argument("--agent", required=True, type=uuidArgument("--agent"))
        each.add_argument(
            "--subject",
            type=_subject,
            help="one subject of the agent ('' is the default subject); without it, all",
        )
    for each in (show, delete):
        each.add_argument("--id", required=True, type=uuidArgument("--id"), dest="memory_id")
    listing.add_argument("--limit", type=_limit, default=100, help=f"1 to {MAX_LIST}; 100")
    listing.add_argument("--after", type=uuidArgument("--after"), help="a memory id: list past it")
    jobs = memory.add_parser(
        "jobs",
        help="observations svc-worker has not done yet (never their content); retry makes"
        " one due now with its attempts from zero, drop deletes it",
    )
    jobs.add_argument("operation", nargs="?", choices=("retry", "drop"))
    jobs.add_argument("--org", required=True, type=uuidArgument("--org"))
    jobs.add_argument("--agent", type=uuidArgument("--agent"), help="only this agent's (listing)")
    jobs.add_argument(
        "--id", type=uuidArgument("--id"), dest="job_id", help="the job (retry, drop)"
    )
    jobs.add_argument("--limit", type=_limit, default=100, help=f"1 to {MAX_LIST}; 100")
    _addSettings(memory)


def _addSettings(memory: Any) -> None:
    """
    Add C{svcctl memory settings} (decisions D13) to the subcommands of
    C{svcctl memory}.
    """
    settings = memory.add_parser(
        "settings",
        help="show or set whether memory is recalled and observed for an organization "
        "or one of its agents",
    )
    settings.add_argument("--org", required=True, type=uuidArgument("--org"))
    settings.add_argument(
        "--agent",
        type=uuidArgument("--agent"),
        help="an agent of the organization, whose settings win over its organization's; "
        "without it, the organization's own",
    )
    inherit = " (inherit: the organization's, for an agent; off, for an organization)"
    settings.add_argument(
        "--recall",
        dest="recall",
        type=_switch,
        help="memories recalled into the prompts of chat completions" + inherit,
        # Absent from the namespace unless given: not given keeps it.
        default=argparse.SUPPRESS,
        metavar="on|off|inherit",
    )
    settings.add_argument(
        "--observe",
        dest="observe",
        type=_observeMode,
        help="answered exchanges kept to make memories from: on, only of requests that "
        "name a subject (X-SVC-Memory-Subject); all, of those that name none too, into "
        "the agent's shared subject (an agent that serves one user); off" + inherit,
        default=argparse.SUPPRESS,
        metavar="on|all|off|inherit",
    )


def memoryDocument(record: MemoryRecord) -> dict[str, Any]:
    return {
        "id": str(record.memoryID),
        "object": "memory",
        "org_id": str(record.orgID),
        "agent_id": str(record.agentID),
        "subject": record.subject,
        "content": record.content,
        "metadata": json.loads(record.metadata),
        "source": record.source,
        "source_request_id": record.sourceRequestID,
        "embedding_model": record.embeddingModel,
        "dimensions": record.dimensions,
        "created_at": rfc3339(record.createdAt),
        "updated_at": rfc3339(record.updatedAt),
    }


def run(
    store: Store, connection: psycopg.Connection[Any], arguments: argparse.Namespace
) -> dict[str, Any]:
    """
    Carry out one C{svcctl memory} command on svcctl's connection, whose
    C{store} is svc-auth's tables as the schema owner.
    """
    if arguments.action == "settings":
        return _settings(store, arguments)
    if arguments.action == "jobs":
        return _jobs(store, connection, arguments)
    orgID, agentID, subject = arguments.org, arguments.agent, arguments.subject
    requireAgent(store, orgID, agentID)
    # From here on as the service's role, in the organization's context.
    connection.execute(f"SET ROLE {APPLICATION_ROLE}")
    memories = MemoryStore(lambda: contextlib.nullcontext(connection))
    if arguments.action == "list":
        try:
            records, more = memories.listForOperator(
                orgID, agentID, subject, arguments.limit, arguments.after
            )
        except MemoryNotFound:
            raise CommandError(f"--after: no memory {arguments.after} here") from None
        return {
            "object": "list",
            "data": [memoryDocument(each) for each in records],
            "has_more": more,
        }
    if arguments.action == "purge":
        if subject is None:
            deleted, observations = memories.purge(orgID, agentID)
        else:
            deleted, observations = memories.deleteScope(Scope(orgID, agentID, subject))
        return {
            "org_id": str(orgID),
            "agent_id": str(agentID),
            "subject": subject,
            "memories_deleted": deleted,
            "observations_deleted": observations,
        }
    memoryID: uuid.UUID = arguments.memory_id
    found = memories.subjectOf(orgID, agentID, memoryID) if subject is None else subject
    if found is None:
        raise CommandError(f"no memory {memoryID} of agent {agentID}")
    scope = Scope(orgID, agentID, found)
    try:
        if arguments.action == "show":
            return memoryDocument(memories.get(scope, memoryID))
        memories.delete(scope, memoryID)
    except (MemoryNotFound, MemoryForbidden):
        # The same words whoever holds the id: the operator named the
        # agent and subject, and it is not theirs.
        raise CommandError(
            f"no memory {memoryID} of agent {agentID}"
            + ("" if subject is None else f" and subject {subject!r}")
        ) from None
    return {"id": str(memoryID), "object": "memory", "deleted": True}


def jobDocument(job: ObservationJob) -> dict[str, Any]:
    """
    A job as svcctl prints it (decisions D13): never the observation's
    messages.
    """
    return {
        "id": str(job.observationID),
        "agent_id": str(job.agentID),
        "subject": job.subject,
        "state": job.state,
        "attempts": job.attempts,
        "reason": job.reason,
        "next_attempt_at": rfc3339(job.nextAttemptAt),
    }


def _jobs(
    store: Store, connection: psycopg.Connection[Any], arguments: argparse.Namespace
) -> dict[str, Any]:
    """
    svcctl memory jobs [retry|drop], as svc_memory_app in the
    organization's context.
    """
    orgID: uuid.UUID = arguments.org
    operation = arguments.operation
    if operation is None and arguments.job_id is not None:
        raise CommandError("--id is for retry and drop; the listing takes --agent")
    if operation is not None and arguments.job_id is None:
        raise CommandError(f"jobs {operation} needs --id")
    requireAgent(store, orgID, arguments.agent if operation is None else None)
    connection.execute(f"SET ROLE {APPLICATION_ROLE}")
    memories = MemoryStore(lambda: contextlib.nullcontext(connection))
    if operation is None:
        jobs = memories.listJobs(orgID, arguments.agent, arguments.limit)
        return {"data": [jobDocument(each) for each in jobs]}
    jobID: uuid.UUID = arguments.job_id
    try:
        if operation == "retry":
            return jobDocument(memories.retryJob(orgID, jobID))
        memories.dropJob(orgID, jobID)
    except MemoryNotFound:
        raise CommandError(f"no job {jobID} of organization {orgID}") from None
    return {"id": str(jobID), "dropped": True}


def _settings(store: Store, arguments: argparse.Namespace) -> dict[str, Any]:
    """
    svcctl memory settings (decisions D13): set what is given, then print
    the row as stored; with nothing given, only print it.
    """
    orgID, agentID = arguments.org, arguments.agent
    changes = {field: getattr(arguments, field) for field in MEMORY_SETTINGS if field in arguments}
    requireAgent(store, orgID, agentID)
    if changes:
        row: MemorySettingsRecord | None = store.setMemorySettings(orgID, agentID, changes)
    else:
        row = store.memorySettings(orgID, agentID)
    return {
        "org_id": str(orgID),
        "agent_id": formatID(agentID),
        "recall": _switchName(None if row is None else row.recall),
        "observe": _observeName(None if row is None else row.observe),
        "version": None if row is None else row.version,
    }
