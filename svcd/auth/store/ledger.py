"""
The usage ledger (decisions D12, D12 amended): the rows the proxies and
workers record, each judged on its own by its key, the rollup kept in the
same transaction, and the spend and sums read from both.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import psycopg

from svcd.auth.store.base import StoreBase, oneRow
from svcd.common.pgtransactions import Cursor, StoreRejected, StoreValueRefused


@attrs.define
class UsageRecord:
    """
    One forwarded request as the ledger keeps it (decisions D12, the
    usage_ledger table of sql/0006_usage.sql, sql/0007, sql/0008, sql/0012
    and sql/0020):
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
    # Decisions D14: the prompt's tokens written to the provider's cache,
    # part of promptTokens (sql/0020_usage_cache_writes.sql).
    cacheWriteTokens: int = 0


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
    ("cache_write_tokens", "bigint"),
)
_LEDGER_NAMES = ", ".join(name for name, _ in _LEDGER_COLUMNS)
# The amounts the rollup sums (sql/0007_ledger_key_and_rollup.sql; cache
# writes since sql/0020_usage_cache_writes.sql).
_ROLLUP_SUMS = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost_nano_usd",
    "cache_write_tokens",
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
        "cache_write_tokens": row.cacheWriteTokens,
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
    C{key} empty); the cost in nano-dollars. C{cacheWriteTokens}
    (decisions D14) is part of C{promptTokens}, as C{cachedTokens} is.
    """

    key: str
    requests: int
    promptTokens: int
    cachedTokens: int
    completionTokens: int
    reasoningTokens: int
    costNanoUSD: int
    cacheWriteTokens: int = 0


class LedgerStore(StoreBase):
    """
    The usage ledger and its rollup (sql/0006_usage.sql, sql/0007, sql/0008,
    sql/0020).
    """

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
                done = int(oneRow(cursor.fetchone())["inserted"])
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
                    inserted += int(oneRow(cursor.fetchone())["inserted"])
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
            return int(oneRow(cursor.fetchone())["cost"])

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
            " cost_nano_usd AS cost, cache_write_tokens AS written FROM usage_rollup"
            " WHERE org_id = %(org)s AND day >= %(firstDay)s AND day < %(endDay)s"
            f"{agentCondition}"
        ]
        for index, (start, end) in enumerate(parts.edges):
            parameters[f"start{index}"], parameters[f"end{index}"] = start, end
            sources.append(
                f"SELECT {USAGE_GROUPINGS[by]} AS key, count(*) AS requests,"
                " sum(prompt_tokens) AS prompt, sum(cached_tokens) AS cached,"
                " sum(completion_tokens) AS completion, sum(reasoning_tokens) AS reasoning,"
                " sum(cost_nano_usd) AS cost, sum(cache_write_tokens) AS written"
                " FROM usage_ledger"
                f" WHERE org_id = %(org)s AND started_at >= %(start{index})s"
                f" AND started_at < %(end{index})s{agentCondition} GROUP BY 1"
            )

        def query(cursor: Cursor) -> list[UsageSums]:
            cursor.execute(
                "SELECT key, sum(requests) AS requests, sum(prompt) AS prompt,"
                " sum(cached) AS cached, sum(completion) AS completion,"
                " sum(reasoning) AS reasoning, sum(cost) AS cost, sum(written) AS written"
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
                    cacheWriteTokens=int(row["written"]),
                )
                for row in cursor.fetchall()
            ]

        return self._run("usage_report", query, orgID=orgID)
