"""
All SQL of svc-auth.

Every method blocks and so runs off the reactor thread: in grpcio's server
threads, in the HTTP side's dedicated database thread pool, or in svcctl.
Each call is one transaction that first names its tenant with
C{set_config('svc.org_id', ..., true)} (transaction-local, so a pooled
connection never carries one request's tenant into the next); row-level
security does the rest (sql/0002_row_level_security.sql).
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import attrs
import psycopg
from prometheus_client import Histogram
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

AGENT_STATUSES = ("active", "paused", "suspended", "archived")

T = TypeVar("T")

ConnectionSource = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]


APPLICATION_ROLE = "svc_auth_app"


def connectionPool(
    dsn: str,
    *,
    minimum: int,
    maximum: int,
    statementTimeout: float,
    applicationName: str,
) -> ConnectionPool:
    """
    svc-auth's pool of autocommit connections, not yet opened.

    Every connection acts as svc_auth_app, the role row-level security
    applies to, whatever role the DSN logs in as (decisions D7); and no
    statement runs longer than C{statementTimeout}, since a caller with a
    50 ms deadline has long given up by then.
    """
    statementTimeoutMs = int(statementTimeout * 1000)

    def configure(connection: psycopg.Connection[Any]) -> None:
        connection.execute(f"SET ROLE {APPLICATION_ROLE}")
        connection.execute(f"SET statement_timeout = {statementTimeoutMs}")

    return ConnectionPool(
        dsn,
        min_size=minimum,
        max_size=maximum,
        kwargs={"autocommit": True, "connect_timeout": 3, "application_name": applicationName},
        configure=configure,
        # A caller waits at most this long for a free connection.
        timeout=2.0,
        name=applicationName,
        open=False,
    )


class StoreUnavailable(Exception):
    """
    The database could not answer; the message is safe to show operators
    (it never quotes the DSN).
    """


class StoreRejected(Exception):
    """
    The database refused a change (a constraint such as a foreign key);
    the caller checked what it could, so this is the caller's mistake.
    """


class StoreValueRefused(Exception):
    """
    A value could not be stored or compared at all (psycopg's DataError: a
    NUL byte or a lone surrogate in a string, a number or a time out of
    range). The database is fine; the value is the caller's mistake.
    """


@attrs.frozen
class TokenRecord:
    """
    A stored token, including its argon2id hash: never leaves svc-auth.
    """

    tokenID: uuid.UUID
    orgID: uuid.UUID
    agentID: uuid.UUID | None
    userID: uuid.UUID | None
    name: str | None
    secretHash: str = attrs.field(repr=False)
    permissions: int
    expiresAt: datetime.datetime | None
    revokedAt: datetime.datetime | None
    createdAt: datetime.datetime


@attrs.frozen
class AgentRecord:
    agentID: uuid.UUID
    orgID: uuid.UUID
    status: str
    name: str | None


_TOKEN_COLUMNS = (
    "token_id, org_id, agent_id, user_id, name, secret_hash, permissions, "
    "expires_at, revoked_at, created_at"
)


def _token(row: dict[str, Any]) -> TokenRecord:
    return TokenRecord(
        tokenID=row["token_id"],
        orgID=row["org_id"],
        agentID=row["agent_id"],
        userID=row["user_id"],
        name=row["name"],
        secretHash=row["secret_hash"],
        permissions=row["permissions"],
        expiresAt=row["expires_at"],
        revokedAt=row["revoked_at"],
        createdAt=row["created_at"],
    )


_AGENT_COLUMNS = "agent_id, org_id, status, name"


@attrs.frozen
class LimitsRecord:
    """
    One row of the limits table (decisions D11): an organization's own
    (C{agentID} None) or one of its agents'. Each value is a positive
    integer, or None when unset; C{version} grows with every change of any
    row.
    """

    orgID: uuid.UUID
    agentID: uuid.UUID | None
    rpm: int | None
    tpm: int | None
    maxOutputTokens: int | None
    version: int


# The settable values of a limits row: svcctl's names and the columns'.
LIMIT_FIELDS = ("rpm", "tpm", "max_output_tokens")
# The largest value a limit can hold (bigint).
LARGEST_LIMIT = 2**63 - 1

_LIMITS_COLUMNS = "org_id, agent_id, rpm, tpm, max_output_tokens, version"


def _limits(row: dict[str, Any]) -> LimitsRecord:
    return LimitsRecord(
        orgID=row["org_id"],
        agentID=row["agent_id"],
        rpm=row["rpm"],
        tpm=row["tpm"],
        maxOutputTokens=row["max_output_tokens"],
        version=row["version"],
    )


@attrs.frozen
class BudgetRecord:
    """
    One budget (decisions D12): of an organization (C{agentID} None) or of
    one of its agents, at most C{nanoUSD} nano-dollars in a calendar
    C{period} (C{"day"} or C{"month"}, UTC); C{version} grows with every
    change of any budget.
    """

    orgID: uuid.UUID
    agentID: uuid.UUID | None
    nanoUSD: int
    period: str
    version: int


BUDGET_PERIODS = ("day", "month")

_BUDGET_COLUMNS = "org_id, agent_id, nano_usd, period, version"


def _budget(row: dict[str, Any]) -> BudgetRecord:
    return BudgetRecord(
        orgID=row["org_id"],
        agentID=row["agent_id"],
        nanoUSD=row["nano_usd"],
        period=row["period"],
        version=row["version"],
    )


@attrs.frozen
class MemorySettingsRecord:
    """
    The memory settings of an organization (C{agentID} None) or of one of
    its agents (decisions D13): C{recall} True (on), False (off) or None
    (inherit: an agent's from its organization, an organization's from the
    default, off); C{observe} one of L{OBSERVE_MODES} or None (inherit,
    likewise; sql/0016_observe_modes.sql); C{version} grows with every
    change of any row.
    """

    orgID: uuid.UUID
    agentID: uuid.UUID | None
    recall: bool | None
    observe: str | None
    version: int


# The settings of a row: svcctl's names. observe is held in the column
# observe_mode (the boolean observe beside it is the previous release's,
# kept in step by sql/0016_observe_modes.sql).
MEMORY_SETTINGS = ("recall", "observe")
_MEMORY_SETTINGS_COLUMN = {"recall": "recall", "observe": "observe_mode"}

# Decisions D13 amended, "Whose words": observe only requests that name a
# subject, also those that name none (into the subject ""), or none.
OBSERVE_ON = "on"
OBSERVE_ALL = "all"
OBSERVE_OFF = "off"
OBSERVE_MODES = (OBSERVE_ON, OBSERVE_ALL, OBSERVE_OFF)

_MEMORY_SETTINGS_COLUMNS = "org_id, agent_id, recall, observe_mode, version"


def _memorySettings(row: dict[str, Any]) -> MemorySettingsRecord:
    return MemorySettingsRecord(
        orgID=row["org_id"],
        agentID=row["agent_id"],
        recall=row["recall"],
        observe=row["observe_mode"],
        version=row["version"],
    )


@attrs.define
class UsageRecord:
    """
    One forwarded request as the ledger keeps it (decisions D12, the
    usage_ledger table of sql/0006_usage.sql, sql/0007 and sql/0008):
    identifiers, names and numbers, never a message's content. Costs are
    nano-dollars. C{ledgerID} is the key, made by the gateway (a UUID in
    its canonical lower-case text, as PostgreSQL and the JSON batch spell
    it; text is cheaper than a L{uuid.UUID} per row); C{requestID} the
    client's request id, which many rows may share. C{kind} is what the
    call was (chat, embedding, extraction: decisions D13) and
    C{parentRequestID} the request it was made for, None for a call a
    client made itself; both default to what every row was before D13.

    Not frozen, unlike the other records here: RecordUsage makes one per
    row, a thousand a call, and a frozen instance costs three times as
    much to make (about 1.4 us more a row, measured); nothing changes one
    once it is made.
    """

    ledgerID: str
    requestID: str
    orgID: uuid.UUID
    agentID: uuid.UUID | None
    tokenID: uuid.UUID | None
    modelRequested: str
    model: str
    provider: str
    upstreamModel: str
    stream: bool
    outcome: str
    promptTokens: int
    cachedTokens: int
    completionTokens: int
    reasoningTokens: int
    tokensFrom: str
    costNanoUSD: int
    priceVersion: str
    startedAt: datetime.datetime
    durationUS: int
    kind: str = "chat"
    parentRequestID: str | None = None
    # Decisions D13: memories a recall put in a chat's prompt; None
    # without recall (sql/0012_usage_memories.sql).
    memories: int | None = None


# The ledger's columns, in UsageRecord's order, with their types (see
# Store.recordUsage).
_LEDGER_COLUMNS = (
    ("ledger_id", "uuid"),
    ("request_id", "text"),
    ("org_id", "uuid"),
    ("agent_id", "uuid"),
    ("token_id", "uuid"),
    ("model_requested", "text"),
    ("model", "text"),
    ("provider", "text"),
    ("upstream_model", "text"),
    ("stream", "boolean"),
    ("outcome", "text"),
    ("prompt_tokens", "bigint"),
    ("cached_tokens", "bigint"),
    ("completion_tokens", "bigint"),
    ("reasoning_tokens", "bigint"),
    ("tokens_from", "text"),
    ("cost_nano_usd", "bigint"),
    ("price_version", "text"),
    ("started_at", "timestamptz"),
    ("duration_us", "bigint"),
    ("kind", "text"),
    ("parent_request_id", "text"),
    ("memories", "integer"),
)
_LEDGER_NAMES = ", ".join(name for name, _ in _LEDGER_COLUMNS)
# The amounts the rollup sums (sql/0007_ledger_key_and_rollup.sql).
_ROLLUP_SUMS = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost_nano_usd",
)
# The rollup's key, in its unique constraint's order (kind since
# sql/0008_usage_kind.sql).
_ROLLUP_KEY = "org_id, day, agent_id, token_id, model, kind, slot"
# How many rows (slots) one group of the rollup is striped over, and the
# slot of a transaction: its id, which differs between transactions that
# run at once, so that they rarely add to the same row (see the migration).
ROLLUP_SLOTS = 8
_SLOT = f"(txid_current() %% {ROLLUP_SLOTS})::smallint"

# One statement records a batch of one organization and keeps its rollup
# (decisions D12 amended).
#
# The batch travels as one JSON array of objects, unpacked by PostgreSQL:
# psycopg dumps one string in C, where arrays of 20 columns cost twice the
# CPU per row in Python (measured: 27 against 14 µs).
#
# The rows go in in the order of their key, and the rollup's groups in the
# order of theirs, so that two transactions writing the same keys or
# groups (two proxies, a batch resent while the first call still runs)
# take their locks in the same order and wait for each other rather than
# deadlock; a transaction adds to one slot of each group (ROLLUP_SLOTS),
# so that transactions at once seldom wait at all. Only rows the INSERT
# actually inserted come out of RETURNING, so a duplicate adds nothing to
# the rollup; and the rollup is changed in the rows' transaction, so it
# equals the ledger's sums at every commit.
# The statement answers how many rows it inserted.
_RECORD_USAGE = (
    "WITH batch AS (SELECT * FROM jsonb_to_recordset(%s::jsonb) AS batch("
    + ", ".join(f"{name} {kind}" for name, kind in _LEDGER_COLUMNS)
    + ")),"
    f" inserted AS (INSERT INTO usage_ledger ({_LEDGER_NAMES})"
    f" SELECT {_LEDGER_NAMES} FROM batch ORDER BY ledger_id"
    " ON CONFLICT (ledger_id) DO NOTHING"
    " RETURNING org_id, started_at, agent_id, token_id, model, kind,"
    f" {', '.join(_ROLLUP_SUMS)}),"
    f" rolled AS (INSERT INTO usage_rollup AS rollup ({_ROLLUP_KEY}, requests,"
    f" {', '.join(_ROLLUP_SUMS)})"
    " SELECT org_id, (started_at AT TIME ZONE 'UTC')::date, agent_id, token_id, model, kind,"
    f" {_SLOT}, count(*), {', '.join(f'sum({name})' for name in _ROLLUP_SUMS)}"
    " FROM inserted GROUP BY 1, 2, 3, 4, 5, 6 ORDER BY 1, 2, 3, 4, 5, 6"
    f" ON CONFLICT ({_ROLLUP_KEY}) DO UPDATE SET requests = rollup.requests + EXCLUDED.requests"
    + "".join(f", {name} = rollup.{name} + EXCLUDED.{name}" for name in _ROLLUP_SUMS)
    + ") SELECT count(*) AS inserted FROM inserted"
)

# The same without the rollup: the ledger's statement before sql/0007 (the
# benchmark compares the two; svc-auth never runs it).
INSERT_USAGE_WITHOUT_ROLLUP = (
    f"INSERT INTO usage_ledger ({_LEDGER_NAMES}) SELECT {_LEDGER_NAMES}"
    " FROM jsonb_to_recordset(%s::jsonb) AS batch("
    + ", ".join(f"{name} {kind}" for name, kind in _LEDGER_COLUMNS)
    + ") ON CONFLICT (ledger_id) DO NOTHING"
)


def _ledgerObject(row: UsageRecord) -> dict[str, object]:
    return {
        "ledger_id": row.ledgerID,
        "request_id": row.requestID,
        "org_id": str(row.orgID),
        "agent_id": None if row.agentID is None else str(row.agentID),
        "token_id": None if row.tokenID is None else str(row.tokenID),
        "model_requested": row.modelRequested,
        "model": row.model,
        "provider": row.provider,
        "upstream_model": row.upstreamModel,
        "stream": row.stream,
        "outcome": row.outcome,
        "prompt_tokens": row.promptTokens,
        "cached_tokens": row.cachedTokens,
        "completion_tokens": row.completionTokens,
        "reasoning_tokens": row.reasoningTokens,
        "tokens_from": row.tokensFrom,
        "cost_nano_usd": row.costNanoUSD,
        "price_version": row.priceVersion,
        "started_at": row.startedAt.isoformat(),
        "duration_us": row.durationUS,
        "kind": row.kind,
        "parent_request_id": row.parentRequestID,
        "memories": row.memories,
    }


def ledgerBatch(rows: Sequence[UsageRecord]) -> str:
    """
    Rows as the JSON array L{Store.recordUsage}'s statement unpacks.
    """
    # Compact: about 2 us a row less to write, and less for PostgreSQL to
    # parse.
    return json.dumps([_ledgerObject(each) for each in rows], separators=(",", ":"))


# UsageRecord's attribute of each ledger column, for comparing a row sent
# again with the row recorded.
_RECORD_ATTRIBUTES = tuple(
    zip(
        (name for name, _ in _LEDGER_COLUMNS),
        attrs.fields_dict(UsageRecord),
        strict=True,
    )
)


def _differences(sent: UsageRecord, stored: dict[str, Any]) -> list[str]:
    """
    The columns in which a recorded row differs from C{sent}.
    """
    return [
        column
        for column, attribute in _RECORD_ATTRIBUTES
        if stored[column] != getattr(sent, attribute)
    ]


@attrs.frozen
class UsageWritten:
    """
    What L{Store.recordUsage} did with a batch, once committed: how many
    rows it recorded now, how many were recorded already with the same
    content, and the rows it did not record, each by its position in the
    batch with why (C{conflicts}: the key is recorded with other content;
    C{refused}: the database refused a value).
    """

    recorded: int
    duplicates: int
    conflicts: list[tuple[int, str]]
    refused: list[tuple[int, str]]


# What a usage report may be grouped by, and the SQL of each key on the
# ledger and on the rollup (constants: never the caller's text). A day is
# the UTC calendar day; a kind is chat, embedding or extraction (decisions
# D13).
USAGE_GROUPINGS = {
    "day": "to_char(started_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
    "model": "model",
    "agent": "coalesce(agent_id::text, '')",
    "token": "coalesce(token_id::text, '')",
    "kind": "kind",
}
_ROLLUP_GROUPINGS = {
    "day": "to_char(day, 'YYYY-MM-DD')",
    "model": "model",
    "agent": "coalesce(agent_id::text, '')",
    "token": "coalesce(token_id::text, '')",
    "kind": "kind",
}


@attrs.frozen
class _SpanParts:
    """
    A span [since, until) as the rollup's whole UTC days [firstDay,
    endDay) and the ledger's partial days at its edges (each [start, end),
    possibly empty).
    """

    firstDay: datetime.date
    endDay: datetime.date
    edges: tuple[tuple[datetime.datetime, datetime.datetime], ...]


def _spanParts(since: datetime.datetime, until: datetime.datetime) -> _SpanParts:
    """
    Split [since, until) into the whole UTC days the rollup answers and
    the partial days at its edges, which only the ledger can: a day- or
    month-aligned span (what the proxies ask) has no edges at all.
    """
    since = since.astimezone(datetime.UTC)
    until = until.astimezone(datetime.UTC)
    firstDay = since.date()
    if since.time() != datetime.time(0):
        if firstDay == datetime.date.max:
            return _SpanParts(firstDay, firstDay, ((since, until),))
        firstDay += datetime.timedelta(days=1)
    endDay = until.date()
    if firstDay >= endDay:
        return _SpanParts(firstDay, firstDay, ((since, until),))
    edges = []
    head = _midnight(firstDay)
    if since < head:
        edges.append((since, head))
    tail = _midnight(endDay)
    if tail < until:
        edges.append((tail, until))
    return _SpanParts(firstDay, endDay, tuple(edges))


def _refusalDetail(error: Exception) -> str:
    """
    Why the database refused a row, for the operator: the constraint or
    column it names (which name the field), never the value.
    """
    if isinstance(error, psycopg.Error):
        named = error.diag.constraint_name or error.diag.column_name
        if named:
            return f"the database refused the row ({named})"
        return f"the database refused the row ({error.sqlstate or type(error).__name__})"
    return f"the database refused the row ({type(error).__name__})"


def _midnight(day: datetime.date) -> datetime.datetime:
    return datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.UTC)


@attrs.frozen
class UsageSums:
    """
    The sums of a group of ledger rows (a report's row, or its total with
    C{key} empty); the cost in nano-dollars.
    """

    key: str
    requests: int
    promptTokens: int
    cachedTokens: int
    completionTokens: int
    reasoningTokens: int
    costNanoUSD: int


def _rowIs(orgID: uuid.UUID, agentID: uuid.UUID | None) -> tuple[str, tuple[uuid.UUID, ...]]:
    """
    The condition naming the row of an organization (C{agentID} None) or of
    one of its agents in limits or budgets, written so that each kind of
    row is found through its own unique index.
    """
    if agentID is None:
        return "org_id = %s AND agent_id IS NULL", (orgID,)
    return "org_id = %s AND agent_id = %s", (orgID, agentID)


Cursor = psycopg.Cursor[dict[str, Any]]


def runTransaction(
    connections: ConnectionSource,
    operation: str,
    body: Callable[[Cursor], T],
    context: Sequence[tuple[str, str]],
    *,
    queryDuration: Histogram | None = None,
    dropDeadConnections: Callable[[], None] | None = None,
    binary: bool = False,
) -> T:
    """
    Run C{body} in one transaction whose first statement sets C{context}
    (settings such as C{svc.org_id}, which the row-level security policies
    read; local to the transaction), for svc-auth's and svc-memory's
    stores alike; its time observed in C{queryDuration} by C{operation}.

    A pooled connection may have died since its last use (a database
    restart); that shows on the first statement, before C{body} has done
    anything, and only then the transaction is tried once more on a fresh
    connection, once the pool has dropped its other dead ones
    (C{dropDeadConnections}).

    @raise StoreRejected: a constraint refused a write.
    @raise StoreValueRefused: the database cannot hold a value.
    @raise StoreUnavailable: any other failure of the database or the pool.
    """
    settings = ", ".join("set_config(%s, %s, true)" for _ in context)
    parameters = [each for pair in context for each in pair]
    started = time.perf_counter()
    try:
        for attempt in (1, 2):
            bodyStarted = False
            try:
                with connections() as connection, connection.transaction():
                    cursor = connection.cursor(row_factory=dict_row, binary=binary)
                    cursor.execute(f"SELECT {settings}", parameters)
                    bodyStarted = True
                    return body(cursor)
            except psycopg.OperationalError:
                if bodyStarted or attempt == 2:
                    raise
                if dropDeadConnections is not None:
                    # The other idle connections most likely died with
                    # this one: without this, the retry takes the next of
                    # them and the caller is answered UNAVAILABLE by a
                    # database that is up.
                    dropDeadConnections()
        raise AssertionError("unreachable")
    except psycopg.IntegrityError as error:
        raise StoreRejected(f"the database refused {operation}: {type(error).__name__}") from error
    except (psycopg.DataError, UnicodeEncodeError) as error:
        # Class 22 of SQLSTATE, or psycopg refusing to send the value (NUL
        # in text, a lone surrogate): never a sign of an outage.
        raise StoreValueRefused(
            f"the database cannot hold a value of {operation}: {type(error).__name__}"
        ) from error
    except psycopg.Error as error:
        raise StoreUnavailable(
            f"database error during {operation}: {type(error).__name__}"
        ) from error
    except PoolTimeout as error:
        raise StoreUnavailable(f"no database connection for {operation}") from error
    finally:
        if queryDuration is not None:
            queryDuration.labels(operation=operation).observe(time.perf_counter() - started)


R = TypeVar("R")


def _optional(convert: Callable[[dict[str, Any]], R], row: dict[str, Any] | None) -> R | None:
    return None if row is None else convert(row)


def _one(row: dict[str, Any] | None) -> dict[str, Any]:
    if row is None:
        raise StoreUnavailable("a RETURNING clause returned no row")
    return row


def _agent(row: dict[str, Any]) -> AgentRecord:
    return AgentRecord(
        agentID=row["agent_id"], orgID=row["org_id"], status=row["status"], name=row["name"]
    )


class Store:
    """
    The tenant-scoped queries of svc-auth over a source of connections.

    @param connections: returns a context manager yielding an autocommit
        connection; a psycopg_pool pool's C{connection} method for the
        daemon, one plain connection for svcctl.
    @param queryDuration: svc_db_query_duration_seconds, labelled by
        operation, or None.
    @param dropDeadConnections: called when a connection is found dead
        before a transaction has done anything (a database restart); the
        pool's C{check}, which replaces every idle connection that died
        with it, so that the retry does not take another dead one.
    """

    def __init__(
        self,
        connections: ConnectionSource,
        queryDuration: Histogram | None = None,
        dropDeadConnections: Callable[[], None] | None = None,
    ) -> None:
        self._connections = connections
        self._queryDuration = queryDuration
        self._dropDeadConnections = dropDeadConnections

    def _run(
        self,
        operation: str,
        body: Callable[[Cursor], T],
        *,
        orgID: uuid.UUID | None = None,
        lookupTokenID: uuid.UUID | None = None,
    ) -> T:
        """
        Run C{body} in one transaction in the given tenant context
        (L{runTransaction}).
        """
        return runTransaction(
            self._connections,
            operation,
            body,
            (
                ("svc.org_id", str(orgID) if orgID else ""),
                ("svc.token_id", str(lookupTokenID) if lookupTokenID else ""),
            ),
            queryDuration=self._queryDuration,
            dropDeadConnections=self._dropDeadConnections,
        )

    def ping(self) -> None:
        """
        A trivial round trip through the pool, for readiness.
        """
        self._run("ping", lambda cursor: cursor.execute("SELECT 1"))

    def tokenForAuthentication(self, tokenID: uuid.UUID) -> TokenRecord | None:
        """
        The one token a bearer names, read before its organization is known
        (the token_lookup policy allows exactly this row).
        """

        def query(cursor: Cursor) -> TokenRecord | None:
            cursor.execute(f"SELECT {_TOKEN_COLUMNS} FROM tokens WHERE token_id = %s", (tokenID,))
            return _optional(_token, cursor.fetchone())

        return self._run("token_lookup", query, lookupTokenID=tokenID)

    def knownTokenIDs(self) -> bytes:
        """
        The ids of every token that may be accepted (neither revoked nor
        expired), 16 bytes each, concatenated: the snapshot that begins a
        change feed stream (sql/0004_change_feed.sql). One bytea made by
        PostgreSQL, so a million ids cost no Python object each.
        """

        def query(cursor: Cursor) -> bytes:
            cursor.execute(
                "SELECT coalesce(string_agg(uuid_send(known), ''::bytea), ''::bytea) AS ids"
                " FROM svc_known_token_ids() AS known"
            )
            return bytes(_one(cursor.fetchone())["ids"])

        return self._run("known_token_ids", query)

    def allLimits(self) -> list[LimitsRecord]:
        """
        Every limits row of every organization (sql/0005_limits.sql):
        svc-auth's table of limits is loaded from this.
        """

        def query(cursor: Cursor) -> list[LimitsRecord]:
            cursor.execute(f"SELECT {_LIMITS_COLUMNS} FROM svc_limits_rows()")
            return [_limits(row) for row in cursor.fetchall()]

        return self._run("limits_all", query)

    def limits(self, orgID: uuid.UUID, agentID: uuid.UUID | None = None) -> LimitsRecord | None:
        """
        The limits row of an organization (C{agentID} None) or of one of its
        agents, read in the organization's context; None when there is none.
        """

        condition, parameters = _rowIs(orgID, agentID)

        def query(cursor: Cursor) -> LimitsRecord | None:
            cursor.execute(f"SELECT {_LIMITS_COLUMNS} FROM limits WHERE {condition}", parameters)
            return _optional(_limits, cursor.fetchone())

        return self._run("limits_lookup", query, orgID=orgID)

    def setLimits(
        self,
        orgID: uuid.UUID,
        agentID: uuid.UUID | None,
        changes: Mapping[str, int | None],
    ) -> LimitsRecord:
        """
        Create or change the limits row of an organization (C{agentID}
        None) or of one of its agents, in the organization's context.

        @param changes: the values to change, by L{LIMIT_FIELDS} name, each
            a positive integer or None to unset it; the others stay as they
            are (unset, for a new row). The row's version is taken anew even
            when nothing changes.
        @raise StoreRejected: the agent is not one of this organization's
            (or the organization does not exist).
        """
        unknown = set(changes) - set(LIMIT_FIELDS)
        if unknown:
            raise ValueError(f"not limits: {sorted(unknown)}")
        # Column names come from LIMIT_FIELDS only, never from the caller.
        updates = ", ".join(
            f"{field} = CASE WHEN %({field}_given)s THEN EXCLUDED.{field} ELSE limits.{field} END"
            for field in LIMIT_FIELDS
        )
        target = "(org_id) WHERE agent_id IS NULL"
        if agentID is not None:
            target = "(org_id, agent_id) WHERE agent_id IS NOT NULL"
        parameters: dict[str, Any] = {"org_id": orgID, "agent_id": agentID}
        for field in LIMIT_FIELDS:
            parameters[field] = changes.get(field)
            parameters[f"{field}_given"] = field in changes

        def upsert(cursor: Cursor) -> LimitsRecord:
            cursor.execute(
                "INSERT INTO limits (org_id, agent_id, rpm, tpm, max_output_tokens)"
                " VALUES (%(org_id)s, %(agent_id)s, %(rpm)s, %(tpm)s, %(max_output_tokens)s)"
                f" ON CONFLICT {target} DO UPDATE SET {updates}"
                f" RETURNING {_LIMITS_COLUMNS}",
                parameters,
            )
            return _limits(_one(cursor.fetchone()))

        return self._run("limits_set", upsert, orgID=orgID)

    def clearLimits(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None = None
    ) -> LimitsRecord | None:
        """
        Remove the limits row of an organization (C{agentID} None) or of one
        of its agents; the row as it was, or None when there was none.
        """

        condition, parameters = _rowIs(orgID, agentID)

        def delete(cursor: Cursor) -> LimitsRecord | None:
            cursor.execute(
                f"DELETE FROM limits WHERE {condition} RETURNING {_LIMITS_COLUMNS}", parameters
            )
            return _optional(_limits, cursor.fetchone())

        return self._run("limits_clear", delete, orgID=orgID)

    # Budgets (decisions D12), shaped as limits are.

    def allBudgets(self) -> list[BudgetRecord]:
        """
        Every budget of every organization (sql/0006_usage.sql): svc-auth's
        table of budgets is loaded from this.
        """

        def query(cursor: Cursor) -> list[BudgetRecord]:
            cursor.execute(f"SELECT {_BUDGET_COLUMNS} FROM svc_budget_rows()")
            return [_budget(row) for row in cursor.fetchall()]

        return self._run("budgets_all", query)

    def budget(self, orgID: uuid.UUID, agentID: uuid.UUID | None = None) -> BudgetRecord | None:
        """
        The budget of an organization (C{agentID} None) or of one of its
        agents, read in the organization's context; None when there is none.
        """
        condition, parameters = _rowIs(orgID, agentID)

        def query(cursor: Cursor) -> BudgetRecord | None:
            cursor.execute(f"SELECT {_BUDGET_COLUMNS} FROM budgets WHERE {condition}", parameters)
            return _optional(_budget, cursor.fetchone())

        return self._run("budget_lookup", query, orgID=orgID)

    def setBudget(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None, nanoUSD: int, period: str
    ) -> BudgetRecord:
        """
        Create or replace the budget of an organization (C{agentID} None) or
        of one of its agents; its version is taken anew.

        @raise StoreRejected: the agent is not one of this organization's
            (or the organization does not exist), or the amount or period
            is not one a budget can have.
        """
        target = "(org_id) WHERE agent_id IS NULL"
        if agentID is not None:
            target = "(org_id, agent_id) WHERE agent_id IS NOT NULL"

        def upsert(cursor: Cursor) -> BudgetRecord:
            cursor.execute(
                "INSERT INTO budgets (org_id, agent_id, nano_usd, period) VALUES (%s, %s, %s, %s)"
                f" ON CONFLICT {target} DO UPDATE"
                " SET nano_usd = EXCLUDED.nano_usd, period = EXCLUDED.period"
                f" RETURNING {_BUDGET_COLUMNS}",
                (orgID, agentID, nanoUSD, period),
            )
            return _budget(_one(cursor.fetchone()))

        return self._run("budget_set", upsert, orgID=orgID)

    def clearBudget(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None = None
    ) -> BudgetRecord | None:
        """
        Remove the budget of an organization (C{agentID} None) or of one of
        its agents; the budget as it was, or None when there was none.
        """
        condition, parameters = _rowIs(orgID, agentID)

        def delete(cursor: Cursor) -> BudgetRecord | None:
            cursor.execute(
                f"DELETE FROM budgets WHERE {condition} RETURNING {_BUDGET_COLUMNS}", parameters
            )
            return _optional(_budget, cursor.fetchone())

        return self._run("budget_clear", delete, orgID=orgID)

    # Memory settings (decisions D13), shaped as limits are.

    def allMemorySettings(self) -> list[MemorySettingsRecord]:
        """
        Every memory settings row of every organization
        (sql/0010_memory_settings.sql): svc-auth's table of memory settings
        is loaded from this.
        """

        def query(cursor: Cursor) -> list[MemorySettingsRecord]:
            cursor.execute(f"SELECT {_MEMORY_SETTINGS_COLUMNS} FROM svc_memory_settings_rows()")
            return [_memorySettings(row) for row in cursor.fetchall()]

        return self._run("memory_settings_all", query)

    def memorySettings(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None = None
    ) -> MemorySettingsRecord | None:
        """
        The memory settings row of an organization (C{agentID} None) or of
        one of its agents, read in the organization's context; None when
        there is none.
        """
        condition, parameters = _rowIs(orgID, agentID)

        def query(cursor: Cursor) -> MemorySettingsRecord | None:
            cursor.execute(
                f"SELECT {_MEMORY_SETTINGS_COLUMNS} FROM memory_settings WHERE {condition}",
                parameters,
            )
            return _optional(_memorySettings, cursor.fetchone())

        return self._run("memory_settings_lookup", query, orgID=orgID)

    def setMemorySettings(
        self,
        orgID: uuid.UUID,
        agentID: uuid.UUID | None,
        changes: Mapping[str, bool | str | None],
    ) -> MemorySettingsRecord:
        """
        Create or change the memory settings row of an organization
        (C{agentID} None) or of one of its agents, as L{setLimits} does.

        @param changes: the settings to change, by L{MEMORY_SETTINGS} name:
            C{recall} True (on), False (off) or None (inherit); C{observe}
            one of L{OBSERVE_MODES} or None (inherit). The others stay as
            they are (inherit, for a new row). The row's version is taken
            anew even when nothing changes.
        @raise StoreRejected: the agent is not one of this organization's
            (or the organization does not exist).
        @raise ValueError: a setting not named, or a value it does not take
            (C{observe} True or False among them: what the switch of the
            previous release meant is not what C{on} means now).
        """
        unknown = set(changes) - set(MEMORY_SETTINGS)
        if unknown:
            raise ValueError(f"not memory settings: {sorted(unknown)}")
        if "recall" in changes and not isinstance(changes["recall"], bool | None):
            raise ValueError(f"recall must be True, False or None, got {changes['recall']!r}")
        if "observe" in changes and changes["observe"] not in (*OBSERVE_MODES, None):
            raise ValueError(
                f"observe must be one of {OBSERVE_MODES} or None, got {changes['observe']!r}"
            )
        # Column names come from MEMORY_SETTINGS only, never from the caller.
        updates = ", ".join(
            f"{column} = CASE WHEN %({field}_given)s THEN EXCLUDED.{column}"
            f" ELSE memory_settings.{column} END"
            for field, column in _MEMORY_SETTINGS_COLUMN.items()
        )
        target = "(org_id) WHERE agent_id IS NULL"
        if agentID is not None:
            target = "(org_id, agent_id) WHERE agent_id IS NOT NULL"
        parameters: dict[str, Any] = {"org_id": orgID, "agent_id": agentID}
        for field in MEMORY_SETTINGS:
            parameters[field] = changes.get(field)
            parameters[f"{field}_given"] = field in changes

        def upsert(cursor: Cursor) -> MemorySettingsRecord:
            cursor.execute(
                "INSERT INTO memory_settings (org_id, agent_id, recall, observe_mode)"
                " VALUES (%(org_id)s, %(agent_id)s, %(recall)s, %(observe)s)"
                f" ON CONFLICT {target} DO UPDATE SET {updates}"
                f" RETURNING {_MEMORY_SETTINGS_COLUMNS}",
                parameters,
            )
            return _memorySettings(_one(cursor.fetchone()))

        return self._run("memory_settings_set", upsert, orgID=orgID)

    # The usage ledger (decisions D12).

    def recordUsage(self, rows: Sequence[UsageRecord]) -> UsageWritten:
        """
        Record C{rows} in the ledger, and their sums in the rollup, in one
        transaction; the answer comes once it is committed, so the caller
        may acknowledge the rows then, and not before.

        Each row is judged on its own by its key (decisions D12 amended): a
        key not yet recorded is recorded; a key recorded with the same
        content is a duplicate (a batch sent again); a key recorded with
        other content is a conflict, and the row stays as first recorded.
        A key recorded by another organization is invisible here (row-level
        security) and so, as it must be, a conflict too. A key twice in
        C{rows} is recorded from its first row, the second judged against
        it.

        Row-level security holds: the rows of each organization are
        written in that organization's context (svc.org_id is set anew,
        transaction-local, before each organization's statement), in the
        order of the organizations' ids so that concurrent batches lock in
        one order. Each organization's rows go in one statement (see
        L{_RECORD_USAGE}); only when it inserted fewer rows than it was
        given are the stored rows read back to tell duplicates from
        conflicts.

        Should the database refuse a value that the checks of
        L{svcd.auth.usage} let through, the batch is recorded again with
        each row in its own savepoint, and the refused rows are answered
        in C{refused}: one bad row never holds the others back.
        """
        if not rows:
            return UsageWritten(0, 0, [], [])
        try:
            return self._run("usage_record", lambda cursor: self._recordUsage(cursor, rows, False))
        except (StoreValueRefused, StoreRejected):
            return self._run(
                "usage_record_isolated", lambda cursor: self._recordUsage(cursor, rows, True)
            )

    def _recordUsage(
        self, cursor: Cursor, rows: Sequence[UsageRecord], isolated: bool
    ) -> UsageWritten:
        first: dict[str, int] = {}
        repeated: list[int] = []
        for position, row in enumerate(rows):
            if row.ledgerID in first:
                repeated.append(position)
            else:
                first[row.ledgerID] = position
        byOrganization: dict[uuid.UUID, list[int]] = {}
        for position in first.values():
            byOrganization.setdefault(rows[position].orgID, []).append(position)

        inserted = 0
        refused: dict[int, str] = {}
        toCompare: list[int] = []
        for orgID in sorted(byOrganization):
            positions = byOrganization[orgID]
            cursor.execute("SELECT set_config('svc.org_id', %s, true)", (str(orgID),))
            if isolated:
                done, bad = self._insertOneByOne(cursor, rows, positions)
                refused.update(bad)
                positions = [each for each in positions if each not in bad]
            else:
                cursor.execute(_RECORD_USAGE, (ledgerBatch([rows[each] for each in positions]),))
                done = int(_one(cursor.fetchone())["inserted"])
            inserted += done
            if done < len(positions):
                toCompare.extend(positions)
        for position in repeated:
            firstRefusal = refused.get(first[rows[position].ledgerID])
            if firstRefusal is None:
                toCompare.append(position)
            else:
                refused[position] = firstRefusal

        # Rows just inserted compare equal to themselves; the others that
        # match were recorded already: duplicates.
        conflicts = self._conflicts(cursor, rows, toCompare)
        return UsageWritten(
            recorded=inserted,
            duplicates=len(rows) - inserted - len(conflicts) - len(refused),
            conflicts=conflicts,
            refused=sorted(refused.items()),
        )

    def _insertOneByOne(
        self, cursor: Cursor, rows: Sequence[UsageRecord], positions: list[int]
    ) -> tuple[int, dict[int, str]]:
        """
        Insert each row in its own savepoint: how many were inserted, and
        the rows the database refused with why.
        """
        inserted = 0
        refused: dict[int, str] = {}
        for position in positions:
            try:
                with cursor.connection.transaction():
                    cursor.execute(_RECORD_USAGE, (ledgerBatch([rows[position]]),))
                    inserted += int(_one(cursor.fetchone())["inserted"])
            except (psycopg.DataError, psycopg.IntegrityError, UnicodeEncodeError) as error:
                refused[position] = _refusalDetail(error)
        return inserted, refused

    def _conflicts(
        self, cursor: Cursor, rows: Sequence[UsageRecord], positions: list[int]
    ) -> list[tuple[int, str]]:
        """
        Compare the rows at C{positions} with the rows recorded under their
        keys, each in its organization's context: the conflicts (no visible
        row, or one with other content) with why, by position.
        """
        conflicts: list[tuple[int, str]] = []
        byOrganization: dict[uuid.UUID, list[int]] = {}
        for position in positions:
            byOrganization.setdefault(rows[position].orgID, []).append(position)
        for orgID in sorted(byOrganization):
            group = byOrganization[orgID]
            cursor.execute("SELECT set_config('svc.org_id', %s, true)", (str(orgID),))
            cursor.execute(
                f"SELECT {_LEDGER_NAMES} FROM usage_ledger WHERE ledger_id = ANY(%s::uuid[])",
                ([rows[each].ledgerID for each in group],),
            )
            stored = {}
            for row in cursor.fetchall():
                row["ledger_id"] = str(row["ledger_id"])
                stored[row["ledger_id"]] = row
            for position in group:
                found = stored.get(rows[position].ledgerID)
                if found is None:
                    conflicts.append((position, "ledger_id is recorded with other content"))
                    continue
                differences = _differences(rows[position], found)
                if differences:
                    conflicts.append(
                        (
                            position,
                            "ledger_id is recorded with other content"
                            f" ({', '.join(differences)} differ)",
                        )
                    )
        return sorted(conflicts)

    def spend(
        self,
        orgID: uuid.UUID,
        agentID: uuid.UUID | None,
        since: datetime.datetime,
        until: datetime.datetime,
    ) -> int:
        """
        The cost in nano-dollars of an organization's rows (or one of its
        agents') that started in [since, until), exact (the sum may pass
        int64; the caller clamps what it must).

        The whole UTC days of the span come from the rollup, and only the
        partial days at its edges from the ledger (L{_spanParts}): the
        proxies ask whole days and months, which cost a few rollup rows per
        day at any number of ledger rows.
        """
        parts = _spanParts(since, until)
        agentCondition = "" if agentID is None else " AND agent_id = %(agent)s"
        parameters: dict[str, Any] = {
            "org": orgID,
            "agent": agentID,
            "firstDay": parts.firstDay,
            "endDay": parts.endDay,
        }
        terms = [
            "(SELECT coalesce(sum(cost_nano_usd), 0) FROM usage_rollup"
            " WHERE org_id = %(org)s AND day >= %(firstDay)s AND day < %(endDay)s"
            f"{agentCondition})"
        ]
        for index, (start, end) in enumerate(parts.edges):
            parameters[f"start{index}"], parameters[f"end{index}"] = start, end
            terms.append(
                "(SELECT coalesce(sum(cost_nano_usd), 0) FROM usage_ledger"
                f" WHERE org_id = %(org)s AND started_at >= %(start{index})s"
                f" AND started_at < %(end{index})s{agentCondition})"
            )

        def query(cursor: Cursor) -> int:
            cursor.execute(f"SELECT {' + '.join(terms)} AS cost", parameters)
            return int(_one(cursor.fetchone())["cost"])

        return self._run("usage_spend", query, orgID=orgID)

    def usageSums(
        self,
        orgID: uuid.UUID,
        agentID: uuid.UUID | None,
        since: datetime.datetime,
        until: datetime.datetime,
        by: str,
    ) -> list[UsageSums]:
        """
        The sums of an organization's rows (or one of its agents') that
        started in [since, until), grouped by C{by} (a key of
        L{USAGE_GROUPINGS}) in the order of their key: the one query behind
        both svcctl usage and GetUsage. Sums are exact (numeric in
        PostgreSQL, integers here), at any size.

        As L{spend}: the rollup for the span's whole UTC days, the ledger
        for the partial days at its edges.
        """
        parts = _spanParts(since, until)
        agentCondition = "" if agentID is None else " AND agent_id = %(agent)s"
        parameters: dict[str, Any] = {
            "org": orgID,
            "agent": agentID,
            "firstDay": parts.firstDay,
            "endDay": parts.endDay,
        }
        sources = [
            f"SELECT {_ROLLUP_GROUPINGS[by]} AS key, requests,"
            " prompt_tokens AS prompt, cached_tokens AS cached,"
            " completion_tokens AS completion, reasoning_tokens AS reasoning,"
            " cost_nano_usd AS cost FROM usage_rollup"
            " WHERE org_id = %(org)s AND day >= %(firstDay)s AND day < %(endDay)s"
            f"{agentCondition}"
        ]
        for index, (start, end) in enumerate(parts.edges):
            parameters[f"start{index}"], parameters[f"end{index}"] = start, end
            sources.append(
                f"SELECT {USAGE_GROUPINGS[by]} AS key, count(*) AS requests,"
                " sum(prompt_tokens) AS prompt, sum(cached_tokens) AS cached,"
                " sum(completion_tokens) AS completion, sum(reasoning_tokens) AS reasoning,"
                " sum(cost_nano_usd) AS cost FROM usage_ledger"
                f" WHERE org_id = %(org)s AND started_at >= %(start{index})s"
                f" AND started_at < %(end{index})s{agentCondition} GROUP BY 1"
            )

        def query(cursor: Cursor) -> list[UsageSums]:
            cursor.execute(
                "SELECT key, sum(requests) AS requests, sum(prompt) AS prompt,"
                " sum(cached) AS cached, sum(completion) AS completion,"
                " sum(reasoning) AS reasoning, sum(cost) AS cost"
                f" FROM ({' UNION ALL '.join(sources)}) AS parts GROUP BY key ORDER BY key",
                parameters,
            )
            return [
                UsageSums(
                    key=row["key"],
                    requests=int(row["requests"]),
                    promptTokens=int(row["prompt"]),
                    cachedTokens=int(row["cached"]),
                    completionTokens=int(row["completion"]),
                    reasoningTokens=int(row["reasoning"]),
                    costNanoUSD=int(row["cost"]),
                )
                for row in cursor.fetchall()
            ]

        return self._run("usage_report", query, orgID=orgID)

    def agentInOrganization(self, orgID: uuid.UUID, agentID: uuid.UUID) -> AgentRecord | None:
        """
        An agent as seen from one organization: None when it does not exist
        or belongs to another organization. Row-level security hides other
        organizations' agents from svc-auth; the condition on org_id does it
        for svcctl, which acts as the schema owner and sees every row.
        """

        def query(cursor: Cursor) -> AgentRecord | None:
            cursor.execute(
                f"SELECT {_AGENT_COLUMNS} FROM agents WHERE agent_id = %s AND org_id = %s",
                (agentID, orgID),
            )
            return _optional(_agent, cursor.fetchone())

        return self._run("agent_lookup", query, orgID=orgID)

    def organizationExists(self, orgID: uuid.UUID) -> bool:
        def query(cursor: Cursor) -> bool:
            cursor.execute("SELECT 1 FROM organizations WHERE org_id = %s", (orgID,))
            return cursor.fetchone() is not None

        return self._run("org_lookup", query, orgID=orgID)

    def createOrganization(self, name: str) -> uuid.UUID:
        orgID = uuid.uuid4()
        self._run(
            "org_create",
            lambda cursor: cursor.execute(
                "INSERT INTO organizations (org_id, name) VALUES (%s, %s)", (orgID, name)
            ),
            orgID=orgID,
        )
        return orgID

    def createAgent(
        self, orgID: uuid.UUID, name: str | None, status: str = "active"
    ) -> AgentRecord:
        agentID = uuid.uuid4()

        def insert(cursor: Cursor) -> AgentRecord:
            cursor.execute(
                "INSERT INTO agents (agent_id, org_id, name, status) VALUES (%s, %s, %s, %s)"
                f" RETURNING {_AGENT_COLUMNS}",
                (agentID, orgID, name, status),
            )
            return _agent(_one(cursor.fetchone()))

        return self._run("agent_create", insert, orgID=orgID)

    def setAgentStatus(
        self, agentID: uuid.UUID, status: str, orgID: uuid.UUID | None = None
    ) -> AgentRecord | None:
        """
        Change an agent's status; None when no visible agent has that id.
        Without C{orgID} only the schema owner (svcctl) sees any agent.
        """

        def update(cursor: Cursor) -> AgentRecord | None:
            cursor.execute(
                "UPDATE agents SET status = %s, updated_at = now() WHERE agent_id = %s"
                f" RETURNING {_AGENT_COLUMNS}",
                (status, agentID),
            )
            return _optional(_agent, cursor.fetchone())

        return self._run("agent_set_status", update, orgID=orgID)

    def createToken(
        self,
        *,
        tokenID: uuid.UUID,
        orgID: uuid.UUID,
        secretHash: str,
        permissions: int,
        agentID: uuid.UUID | None = None,
        userID: uuid.UUID | None = None,
        name: str | None = None,
        expiresAt: datetime.datetime | None = None,
        createdBy: uuid.UUID | None = None,
    ) -> TokenRecord:
        def insert(cursor: Cursor) -> TokenRecord:
            cursor.execute(
                "INSERT INTO tokens (token_id, org_id, agent_id, user_id, name, secret_hash,"
                " permissions, expires_at, created_by)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
                f" RETURNING {_TOKEN_COLUMNS}",
                (
                    tokenID,
                    orgID,
                    agentID,
                    userID,
                    name,
                    secretHash,
                    permissions,
                    expiresAt,
                    createdBy,
                ),
            )
            return _token(_one(cursor.fetchone()))

        return self._run("token_create", insert, orgID=orgID)

    def revokeToken(self, tokenID: uuid.UUID, orgID: uuid.UUID | None = None) -> TokenRecord | None:
        """
        Revoke a token (a second revocation keeps the first time); None when
        no visible token has that id.
        """

        def update(cursor: Cursor) -> TokenRecord | None:
            cursor.execute(
                "UPDATE tokens SET revoked_at = COALESCE(revoked_at, now()), updated_at = now()"
                f" WHERE token_id = %s RETURNING {_TOKEN_COLUMNS}",
                (tokenID,),
            )
            return _optional(_token, cursor.fetchone())

        return self._run("token_revoke", update, orgID=orgID)

    def listTokens(self, orgID: uuid.UUID) -> list[TokenRecord]:
        def query(cursor: Cursor) -> list[TokenRecord]:
            cursor.execute(
                f"SELECT {_TOKEN_COLUMNS} FROM tokens WHERE org_id = %s"
                " ORDER BY created_at, token_id",
                (orgID,),
            )
            return [_token(row) for row in cursor.fetchall()]

        return self._run("token_list", query, orgID=orgID)
