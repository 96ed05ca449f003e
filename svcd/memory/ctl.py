"""
svcctl memory list|show|delete|purge (decisions D13): operators read and
forget an agent's memories, straight in PostgreSQL like every svcctl
command (L{svcd.auth.ctl}), which registers these; and svcctl memory jobs
[retry|drop]: the observations svc-worker has not done yet (waiting or
failed, with their attempts and reason, never their content), made due
again or dropped.

Unlike svcctl's other commands, which act as the schema owner, these run
as svc_memory_app in the named organization's row-level security context
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
from collections.abc import Callable
from typing import Any

import psycopg

from svcd.common.errors import rfc3339
from svcd.memory.records import SUBJECT_PATTERN, MemoryRecord
from svcd.memory.store import MemoryStore
from svcd.memory.store.base import APPLICATION_ROLE, MemoryForbidden, MemoryNotFound
from svcd.memory.store.jobs import ObservationJob
from svcd.memoryclient.records import Scope

MAX_LIST = 1000


class MemoryCommandError(Exception):
    """
    A failure to report on svcctl's one stderr line.
    """


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


def addMemoryCommands(
    commands: Any, parserClass: type[argparse.ArgumentParser], uuidOf: Callable[[str], Any]
) -> Any:
    """
    Add C{svcctl memory ...} to svcctl's subcommands; return the
    subcommands of C{svcctl memory}, to which svcctl adds C{settings}
    (L{svcd.auth.ctl}: the settings are svc-auth's tables, not these).

    @param uuidOf: svcctl's parser of a UUID option, by option name.
    """
    memory = commands.add_parser(
        "memory", help="agents' memories (svc-memory): list, show, delete, purge; settings"
    ).add_subparsers(dest="action", required=True, parser_class=parserClass)
    listing = memory.add_parser("list", help="an agent's memories, newest first")
    show = memory.add_parser("show", help="one memory")
    delete = memory.add_parser("delete", help="forget one memory")
    purge = memory.add_parser(
        "purge", help="forget every memory and observation of the agent, or of one subject"
    )
    for each in (listing, show, delete, purge):
        each.add_argument("--org", required=True, type=uuidOf("--org"))
        each.add_argument("--agent", required=True, type=uuidOf("--agent"))
        each.add_argument(
            "--subject",
            type=_subject,
            help="one subject of the agent ('' is the default subject); without it, all",
        )
    for each in (show, delete):
        each.add_argument("--id", required=True, type=uuidOf("--id"), dest="memory_id")
    listing.add_argument("--limit", type=_limit, default=100, help=f"1 to {MAX_LIST}; 100")
    listing.add_argument("--after", type=uuidOf("--after"), help="a memory id: list past it")
    jobs = memory.add_parser(
        "jobs",
        help="observations svc-worker has not done yet (never their content); retry makes"
        " one due now with its attempts from zero, drop deletes it",
    )
    jobs.add_argument("operation", nargs="?", choices=("retry", "drop"))
    jobs.add_argument("--org", required=True, type=uuidOf("--org"))
    jobs.add_argument("--agent", type=uuidOf("--agent"), help="only this agent's (listing)")
    jobs.add_argument("--id", type=uuidOf("--id"), dest="job_id", help="the job (retry, drop)")
    jobs.add_argument("--limit", type=_limit, default=100, help=f"1 to {MAX_LIST}; 100")
    return memory


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


def runMemory(
    arguments: argparse.Namespace,
    connection: psycopg.Connection[Any],
    requireAgent: Callable[[uuid.UUID, uuid.UUID | None], None],
) -> dict[str, Any]:
    """
    Carry out one C{svcctl memory} command on svcctl's connection.

    @param requireAgent: svcctl's check, as the owner, that the
        organization exists and the agent is one of its own (raising its
        error otherwise).
    """
    if arguments.action == "jobs":
        return _jobs(arguments, connection, requireAgent)
    orgID, agentID, subject = arguments.org, arguments.agent, arguments.subject
    requireAgent(orgID, agentID)
    # From here on as the service's role, in the organization's context.
    connection.execute(f"SET ROLE {APPLICATION_ROLE}")
    store = MemoryStore(lambda: contextlib.nullcontext(connection))
    if arguments.action == "list":
        try:
            records, more = store.listForOperator(
                orgID, agentID, subject, arguments.limit, arguments.after
            )
        except MemoryNotFound:
            raise MemoryCommandError(f"--after: no memory {arguments.after} here") from None
        return {
            "object": "list",
            "data": [memoryDocument(each) for each in records],
            "has_more": more,
        }
    if arguments.action == "purge":
        if subject is None:
            memories, observations = store.purge(orgID, agentID)
        else:
            memories, observations = store.deleteScope(Scope(orgID, agentID, subject))
        return {
            "org_id": str(orgID),
            "agent_id": str(agentID),
            "subject": subject,
            "memories_deleted": memories,
            "observations_deleted": observations,
        }
    memoryID: uuid.UUID = arguments.memory_id
    found = store.subjectOf(orgID, agentID, memoryID) if subject is None else subject
    if found is None:
        raise MemoryCommandError(f"no memory {memoryID} of agent {agentID}")
    scope = Scope(orgID, agentID, found)
    try:
        if arguments.action == "show":
            return memoryDocument(store.get(scope, memoryID))
        store.delete(scope, memoryID)
    except (MemoryNotFound, MemoryForbidden):
        # The same words whoever holds the id: the operator named the
        # agent and subject, and it is not theirs.
        raise MemoryCommandError(
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
    arguments: argparse.Namespace,
    connection: psycopg.Connection[Any],
    requireAgent: Callable[[uuid.UUID, uuid.UUID | None], None],
) -> dict[str, Any]:
    """
    svcctl memory jobs [retry|drop], as svc_memory_app in the
    organization's context.
    """
    orgID: uuid.UUID = arguments.org
    operation = arguments.operation
    if operation is None and arguments.job_id is not None:
        raise MemoryCommandError("--id is for retry and drop; the listing takes --agent")
    if operation is not None and arguments.job_id is None:
        raise MemoryCommandError(f"jobs {operation} needs --id")
    requireAgent(orgID, arguments.agent if operation is None else None)
    connection.execute(f"SET ROLE {APPLICATION_ROLE}")
    store = MemoryStore(lambda: contextlib.nullcontext(connection))
    if operation is None:
        jobs = store.listJobs(orgID, arguments.agent, arguments.limit)
        return {"data": [jobDocument(each) for each in jobs]}
    jobID: uuid.UUID = arguments.job_id
    try:
        if operation == "retry":
            return jobDocument(store.retryJob(orgID, jobID))
        store.dropJob(orgID, jobID)
    except MemoryNotFound:
        raise MemoryCommandError(f"no job {jobID} of organization {orgID}") from None
    return {"id": str(jobID), "dropped": True}
