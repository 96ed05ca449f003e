"""
The ledger keyed by the gateway and its rollup (decisions D12 amended,
sql/0007_ledger_key_and_rollup.sql, svcd/auth/store/ledger.py) and its kinds
(decisions D13, sql/0008_usage_kind.sql), against a real PostgreSQL and,
where the answer's shape matters, a real grpcio server: requests sharing a
request id are each one row; a key sent again is a duplicate with the same
content and a conflict with other content (another organization's key, or
another kind or parent, included); rows of each kind are summed by kind;
the rollup equals the ledger's sums by kind after any batches, concurrent
ones included; GetSpend and the reports equal a plain sum over the rows
for any span; sums past int64 never break an answer; and the migrations
work on a ledger that holds rows.
"""

from __future__ import annotations

import contextlib
import datetime
import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any, cast

import attrs
import psycopg
import pytest
from authfixtures import makeTenant
from authhelpers import JUNE, document, microseconds, record, recordAnswer, svcctl, usageRow
from authservice import RunningAuthService
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter
from twisted.logger import ILogObserver, Logger

from svcd.auth.grpcservice import RejectedRowsLog
from svcd.auth.store import Store
from svcd.auth.store.base import APPLICATION_ROLE
from svcd.auth.store.ledger import UsageRecord, UsageSums
from svcd.auth.usage import (
    INT64_MAX,
    KINDS,
    LATEST_UNIX_SECOND,
    MAXIMUM_ROW_AMOUNT,
    RejectedRow,
    keyOfRequestID,
)
from svcd.common.ids import uuid7Text
from svcd.common.migrations import migrate
from svcd.common.permissions import Permission
from svcd.pb.auth.v1 import auth_pb2

UTC = datetime.UTC
DAY = datetime.timedelta(days=1)
SUMMED = (
    "promptTokens",
    "cachedTokens",
    "completionTokens",
    "reasoningTokens",
    "costNanoUSD",
    "cacheWriteTokens",
)
# The rollup's sums before decisions D14 (sql/0020_usage_cache_writes.sql).
SUMMED_BEFORE_CACHE_WRITES = SUMMED[:-1]
# Each sum's column.
COLUMNS = {
    "promptTokens": "prompt_tokens",
    "cachedTokens": "cached_tokens",
    "completionTokens": "completion_tokens",
    "reasoningTokens": "reasoning_tokens",
    "costNanoUSD": "cost_nano_usd",
    "cacheWriteTokens": "cache_write_tokens",
}


@contextlib.contextmanager
def applicationStore(dsn: str) -> Iterator[Store]:
    """
    A store acting as svc_auth_app (row-level security applies), as the
    daemon's pool does, on one connection of its own.
    """
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute(f"SET ROLE {APPLICATION_ROLE}")
        yield Store(lambda: contextlib.nullcontext(connection))


@pytest.fixture
def appStore(migratedDSN: str) -> Iterator[Store]:
    with applicationStore(migratedDSN) as store:
        yield store


def usageRecord(orgID: uuid.UUID, **changes: Any) -> UsageRecord:
    fields: dict[str, Any] = {
        "ledgerID": uuid7Text(),
        "requestID": str(uuid.uuid4()),
        "orgID": orgID,
        "agentID": None,
        "tokenID": None,
        "modelRequested": "fast",
        "model": "fast",
        "provider": "local",
        "upstreamModel": "llama",
        "stream": False,
        "outcome": "ok",
        "promptTokens": 100,
        "cachedTokens": 10,
        "completionTokens": 50,
        "reasoningTokens": 5,
        "tokensFrom": "provider",
        "costNanoUSD": 1_000,
        "priceVersion": "v1",
        "startedAt": JUNE,
        "durationUS": 1,
    }
    fields.update(changes)
    return UsageRecord(**fields)


Group = tuple[uuid.UUID, datetime.date, uuid.UUID | None, uuid.UUID | None, str, str]


def expectedRollup(
    records: list[UsageRecord], summed: tuple[str, ...] = SUMMED
) -> dict[Group, tuple[int, ...]]:
    """
    What the rollup must hold for C{records}, summed here in Python.
    """
    sums: dict[Group, list[int]] = {}
    for each in records:
        key = (each.orgID, each.startedAt.astimezone(UTC).date(), each.agentID, each.tokenID)
        group = sums.setdefault((*key, each.model, each.kind), [0] * (len(summed) + 1))
        group[0] += 1
        for index, field in enumerate(summed, 1):
            group[index] += getattr(each, field)
    return {key: tuple(value) for key, value in sums.items()}


def _sums(summed: tuple[str, ...]) -> str:
    return ", ".join(f"sum({COLUMNS[field]})" for field in summed)


def storedRollup(
    dsn: str, orgIDs: list[uuid.UUID], summed: tuple[str, ...] = SUMMED
) -> dict[Group, tuple[int, ...]]:
    """
    The rollup's sums of each group, its slots added up.
    """
    with psycopg.connect(dsn, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT org_id, day, agent_id, token_id, model, kind, sum(requests),"
            f" {_sums(summed)} FROM usage_rollup"
            " WHERE org_id = ANY(%s) GROUP BY 1, 2, 3, 4, 5, 6",
            (orgIDs,),
        ).fetchall()
    return {tuple(row[:6]): tuple(int(each) for each in row[6:]) for row in rows}


def ledgerRollup(dsn: str, orgIDs: list[uuid.UUID]) -> dict[Group, tuple[int, ...]]:
    """
    The ledger's own sums, grouped as the rollup is.
    """
    with psycopg.connect(dsn, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT org_id, (started_at AT TIME ZONE 'UTC')::date, agent_id, token_id, model,"
            f" kind, count(*), {_sums(SUMMED)}"
            " FROM usage_ledger WHERE org_id = ANY(%s) GROUP BY 1, 2, 3, 4, 5, 6",
            (orgIDs,),
        ).fetchall()
    return {tuple(row[:6]): tuple(int(each) for each in row[6:]) for row in rows}


def storedRow(dsn: str, ledgerID: str) -> tuple[Any, ...]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        row = connection.execute(
            "SELECT org_id, request_id, cost_nano_usd, prompt_tokens FROM usage_ledger"
            " WHERE ledger_id = %s",
            (ledgerID,),
        ).fetchone()
    assert row is not None
    return tuple(row)


def rejections(service: RunningAuthService, reason: str) -> float:
    value = service.registry.get_sample_value(
        "svc_auth_usage_rows_rejected_total", {"reason": reason}
    )
    assert value is not None
    return value


# The key


def test_requestsSharingARequestIDAreEachOneRow(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    Rows that carry the same request id (the client's X-Request-ID) but
    their own ledger ids are each recorded: two in one organization, and
    one more in another organization, which can no longer suppress the
    first's rows by using its id first (issue 28, item 1).
    """
    first, second = makeTenant(owner, "a"), makeTenant(owner, "b")
    shared = str(uuid.uuid4())
    rows = [usageRow(first, request_id=shared), usageRow(first, request_id=shared)]
    assert record(authService, rows) == (2, 0)
    assert record(authService, [usageRow(second, request_id=shared)]) == (1, 0)
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        stored = connection.execute(
            "SELECT org_id, count(*) FROM usage_ledger WHERE request_id = %s GROUP BY org_id",
            (shared,),
        ).fetchall()
    assert {orgID: count for orgID, count in stored} == {first.orgID: 2, second.orgID: 1}
    spend = auth_pb2.GetSpendRequest(
        org_id=str(first.orgID),
        since_unix=int(JUNE.timestamp()),
        until_unix=int((JUNE + DAY).timestamp()),
    )
    assert authService.call("GetSpend", spend).cost_nano_usd == 2 * rows[0].cost_nano_usd


def test_aKeySentAgainIsADuplicateWithTheSameContentAndAConflictWithOther(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    A key sent again with the same content is a duplicate (a batch sent
    again); with other content it is rejected as a conflict naming the
    columns that differ, and the row stays as first recorded, its cost
    counted once. Another organization's row under a recorded key is a
    conflict too (invisible under row-level security, and never shown).
    A key twice in one batch with two contents: the first is recorded.
    """
    tenant, other = makeTenant(owner, "a"), makeTenant(owner, "b")
    row = usageRow(tenant)
    assert record(authService, [row]) == (1, 0)
    dearer = auth_pb2.UsageRow()
    dearer.CopyFrom(row)
    dearer.cost_nano_usd += 1
    dearer.prompt_tokens += 1
    stolen = usageRow(other, ledger_id=row.ledger_id)
    fresh = usageRow(tenant)
    recorded, duplicates, rejected = recordAnswer(authService, [row, dearer, stolen, fresh])
    assert (recorded, duplicates) == (1, 1)
    assert rejected == [
        (
            1,
            "conflict",
            "ledger_id is recorded with other content (prompt_tokens, cost_nano_usd differ)",
        ),
        (2, "conflict", "ledger_id is recorded with other content"),
    ]
    assert storedRow(migratedDSN, row.ledger_id) == (
        tenant.orgID,
        row.request_id,
        row.cost_nano_usd,
        row.prompt_tokens,
    )
    twice = usageRow(tenant)
    changed = auth_pb2.UsageRow()
    changed.CopyFrom(twice)
    changed.model = "slow"
    assert recordAnswer(authService, [twice, changed, twice]) == (
        1,
        1,
        [(1, "conflict", "ledger_id is recorded with other content (model differ)")],
    )
    assert rejections(authService, "conflict") == 3
    assert rejections(authService, "invalid") == 0
    spend = auth_pb2.GetSpendRequest(
        org_id=str(tenant.orgID),
        since_unix=int(JUNE.timestamp()),
        until_unix=int((JUNE + DAY).timestamp()),
    )
    assert authService.call("GetSpend", spend).cost_nano_usd == 3 * row.cost_nano_usd
    assert ledgerRollup(migratedDSN, [tenant.orgID, other.orgID]) == storedRollup(
        migratedDSN, [tenant.orgID, other.orgID]
    )


def test_anOlderProxysRowsAreKeyedByTheirRequestID(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    A row without a ledger id (from a proxy older than the key) is keyed
    by its request id, so that such a batch sent again is a duplicate; a
    request id that is not a UUID is keyed by its MD5, as the migration
    keys such rows.
    """
    tenant = makeTenant(owner)
    requestID = str(uuid.uuid4())
    old = usageRow(tenant, ledger_id="", request_id=requestID)
    odd = usageRow(tenant, ledger_id="", request_id="not-a-uuid")
    assert record(authService, [old, odd]) == (2, 0)
    assert record(authService, [old, odd]) == (0, 2)
    assert storedRow(migratedDSN, requestID)[1] == requestID
    assert storedRow(migratedDSN, str(keyOfRequestID("not-a-uuid")))[1] == "not-a-uuid"
    same = auth_pb2.UsageRow()
    same.CopyFrom(old)
    same.ledger_id = requestID
    assert record(authService, [same]) == (0, 1)


def test_aRowTheDatabaseRefusesIsSetAsideAlone(appStore: Store, migratedDSN: str) -> None:
    """
    Should the database refuse a row that the checks let through (here a
    record made without them), the batch is recorded again row by row:
    that row is refused, naming the constraint (so the field), and the
    others are recorded with their rollup.
    """
    orgID = uuid.uuid4()
    good = [usageRecord(orgID) for _ in range(3)]
    bad = usageRecord(orgID, promptTokens=-1)
    written = appStore.recordUsage([good[0], bad, good[1], bad, good[2]])
    assert (written.recorded, written.duplicates, written.conflicts) == (3, 0, [])
    assert written.refused == [
        (1, "the database refused the row (usage_ledger_prompt_tokens_check)"),
        (3, "the database refused the row (usage_ledger_prompt_tokens_check)"),
    ]
    assert storedRollup(migratedDSN, [orgID]) == expectedRollup(good)


# Kinds (decisions D13)


def storedKinds(dsn: str, ledgerIDs: list[str]) -> dict[str, tuple[str, str | None]]:
    """
    The kind and parent request id of each row, by ledger id.
    """
    with psycopg.connect(dsn, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT ledger_id::text, kind, parent_request_id FROM usage_ledger"
            " WHERE ledger_id = ANY(%s::uuid[])",
            (ledgerIDs,),
        ).fetchall()
    return {ledgerID: (kind, parent) for ledgerID, kind, parent in rows}


def test_rowsOfEachKindAreRecordedAndSummedByKind(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    Rows of each kind are recorded with their kind and parent request id
    (an empty parent is NULL); a row without a kind (a proxy older than
    the field) is chat. GetUsage by kind sums each kind from the rollup,
    exactly, keyed by the kind; GetSpend counts every kind; another
    organization's rows, of the same kinds on the same day, are in none of
    the sums.
    """
    tenant = makeTenant(
        owner, "a", permissions=int(Permission.ProxyChatCompletion | Permission.UsageRead)
    )
    other = makeTenant(owner, "b")
    chat = usageRow(tenant, kind="chat", cost_nano_usd=1_000)
    older = usageRow(tenant, cost_nano_usd=20_000)
    assert older.kind == ""
    recall = usageRow(
        tenant,
        kind="embedding",
        parent_request_id=chat.request_id,
        prompt_tokens=7,
        cached_tokens=0,
        completion_tokens=0,
        reasoning_tokens=0,
        cost_nano_usd=300,
    )
    embedded = usageRow(tenant, kind="embedding", completion_tokens=0, cost_nano_usd=4_000)
    extracted = usageRow(
        tenant, kind="extraction", parent_request_id="observation-1", cost_nano_usd=50_000
    )
    mine = [chat, older, recall, embedded, extracted]
    theirs = [usageRow(other, kind=kind, cost_nano_usd=10**9) for kind in KINDS]
    assert record(authService, [*mine, *theirs]) == (8, 0)

    assert storedKinds(migratedDSN, [each.ledger_id for each in mine]) == {
        chat.ledger_id: ("chat", None),
        older.ledger_id: ("chat", None),
        recall.ledger_id: ("embedding", chat.request_id),
        embedded.ledger_id: ("embedding", None),
        extracted.ledger_id: ("extraction", "observation-1"),
    }
    answer = authService.call(
        "GetUsage",
        auth_pb2.GetUsageRequest(since="2025-06-01", until="2025-07-01", by="kind"),
        bearer=tenant.token,
    )
    assert answer.by == "kind"
    assert [
        (
            each.key,
            each.requests,
            each.prompt_tokens,
            each.cached_tokens,
            each.completion_tokens,
            each.reasoning_tokens,
            each.cost_usd,
        )
        for each in answer.rows
    ] == [
        ("chat", 2, 200, 20, 100, 10, "0.000021"),
        ("embedding", 2, 107, 10, 0, 5, "0.0000043"),
        ("extraction", 1, 100, 10, 50, 5, "0.00005"),
    ]
    assert (answer.total.requests, answer.total.cost_usd) == (5, "0.0000753")
    spend = auth_pb2.GetSpendRequest(
        org_id=str(tenant.orgID),
        since_unix=int(JUNE.timestamp()),
        until_unix=int((JUNE + DAY).timestamp()),
    )
    assert authService.call("GetSpend", spend).cost_nano_usd == 75_300
    assert storedRollup(migratedDSN, [tenant.orgID, other.orgID]) == ledgerRollup(
        migratedDSN, [tenant.orgID, other.orgID]
    )


def test_memoriesAreRecordedAndPartOfARowsContent(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    A chat row's C{memories} (decisions D13: how many memories a recall put
    in its prompt) is recorded, absent is NULL (recall off, or a proxy
    older than the field), 0 is 0; a key sent again with another count is
    a conflict naming the column; a count past 100 or below 0 is refused
    as invalid, the batch's other rows recorded.
    """
    tenant = makeTenant(owner)
    recalled, failed, off = usageRow(tenant), usageRow(tenant), usageRow(tenant)
    recalled.memories = 3
    failed.memories = 0
    tooMany, negative = usageRow(tenant), usageRow(tenant)
    tooMany.memories = 101
    negative.memories = -1
    recorded, duplicates, rejected = recordAnswer(
        authService, [recalled, failed, off, tooMany, negative]
    )
    assert (recorded, duplicates) == (3, 0)
    assert rejected == [
        (3, "invalid", "memories must be between 0 and 100"),
        (4, "invalid", "memories must be between 0 and 100"),
    ]
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        stored: dict[str, int | None] = dict(
            connection.execute(
                "SELECT ledger_id::text, memories FROM usage_ledger WHERE org_id = %s",
                (tenant.orgID,),
            ).fetchall()
        )
    assert stored == {recalled.ledger_id: 3, failed.ledger_id: 0, off.ledger_id: None}
    again = auth_pb2.UsageRow()
    again.CopyFrom(recalled)
    again.memories = 2
    notAgain = auth_pb2.UsageRow()
    notAgain.CopyFrom(recalled)
    notAgain.ClearField("memories")
    recorded, duplicates, rejected = recordAnswer(authService, [again, notAgain, recalled])
    assert (recorded, duplicates) == (0, 1)
    detail = "ledger_id is recorded with other content (memories differ)"
    assert rejected == [(0, "conflict", detail), (1, "conflict", detail)]


def test_aRowSentAgainAsAnotherKindOrForAnotherParentIsAConflict(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    A kind and a parent are part of a row's content: a key sent again with
    another kind, or another parent (one added, changed or taken away), is
    rejected as a conflict naming the column, and the row stays as first
    recorded, its cost counted once under its first kind. A row sent again
    by an older proxy (no kind) matches a chat row, and the same row with
    its kind now spelled "chat" is a duplicate too.
    """
    tenant = makeTenant(owner)
    embedded = usageRow(tenant, kind="embedding", parent_request_id="parent-1")
    older = usageRow(tenant)
    assert record(authService, [embedded, older]) == (2, 0)

    def changed(row: auth_pb2.UsageRow, **fields: str) -> auth_pb2.UsageRow:
        copy = auth_pb2.UsageRow()
        copy.CopyFrom(row)
        for name, value in fields.items():
            setattr(copy, name, value)
        return copy

    batch = [
        changed(embedded, kind="chat"),
        changed(embedded, kind="extraction"),
        changed(embedded, parent_request_id="parent-2"),
        changed(embedded, parent_request_id=""),
        changed(older, parent_request_id="parent-1"),
        changed(older, kind="embedding"),
        embedded,
        changed(older, kind="chat"),
    ]
    recorded, duplicates, rejected = recordAnswer(authService, batch)
    assert (recorded, duplicates) == (0, 2)
    detail = "ledger_id is recorded with other content ({} differ)"
    assert rejected == [
        (0, "conflict", detail.format("kind")),
        (1, "conflict", detail.format("kind")),
        (2, "conflict", detail.format("parent_request_id")),
        (3, "conflict", detail.format("parent_request_id")),
        (4, "conflict", detail.format("parent_request_id")),
        (5, "conflict", detail.format("kind")),
    ]
    assert storedKinds(migratedDSN, [embedded.ledger_id, older.ledger_id]) == {
        embedded.ledger_id: ("embedding", "parent-1"),
        older.ledger_id: ("chat", None),
    }
    assert ledgerRollup(migratedDSN, [tenant.orgID]) == storedRollup(migratedDSN, [tenant.orgID])
    assert {
        group[5]: sums[0] for group, sums in storedRollup(migratedDSN, [tenant.orgID]).items()
    } == {
        "embedding": 1,
        "chat": 1,
    }


# The rollup


def test_theRollupIsUnderRowLevelSecurity(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    As svc_auth_app, each organization's context sees its own rollup rows
    only, no context sees any; the role may not write another
    organization's row, move a row (its key), or delete one.
    """
    first, second = makeTenant(owner, "a"), makeTenant(owner, "b")
    record(authService, [usageRow(first), usageRow(first, model="slow"), usageRow(second)])
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        connection.execute(f"SET ROLE {APPLICATION_ROLE}")

        def run(orgID: uuid.UUID | None, statement: str, *parameters: Any) -> Any:
            with connection.transaction():
                connection.execute(
                    "SELECT set_config('svc.org_id', %s, true)", (str(orgID) if orgID else "",)
                )
                return connection.execute(statement, parameters).fetchall()

        count = "SELECT count(*) FROM usage_rollup"
        assert run(first.orgID, count) == [(2,)]
        assert run(second.orgID, count) == [(1,)]
        assert run(uuid.uuid4(), count) == [(0,)]
        assert run(None, count) == [(0,)]
        for statement, parameters in [
            (
                "INSERT INTO usage_rollup (org_id, day, model, requests, prompt_tokens,"
                " cached_tokens, completion_tokens, reasoning_tokens, cost_nano_usd)"
                " VALUES (%s, '2025-06-01', 'm', 1, 0, 0, 0, 0, 0)",
                (second.orgID,),
            ),
            ("UPDATE usage_rollup SET org_id = %s", (second.orgID,)),
            ("UPDATE usage_rollup SET day = day + 1", ()),
            ("DELETE FROM usage_rollup", ()),
        ]:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                run(first.orgID, statement, *parameters)
        assert run(first.orgID, "UPDATE usage_rollup SET requests = requests RETURNING 1") == [
            (1,),
            (1,),
        ]


AGENTS = [uuid.UUID(int=1), uuid.UUID(int=2), None]
TOKENS = [uuid.UUID(int=3), None]
MIDNIGHT = int(JUNE.timestamp()) * 10**6

amounts = st.one_of(st.integers(0, 10_000), st.just(MAXIMUM_ROW_AMOUNT))
contents = st.fixed_dictionaries(
    {
        "organization": st.integers(0, 1),
        "agentID": st.sampled_from(AGENTS),
        "tokenID": st.sampled_from(TOKENS),
        "model": st.sampled_from(["fast", "slow"]),
        "kind": st.sampled_from(KINDS),
        "parentRequestID": st.sampled_from([None, "0190c6a2-0000-7000-8000-000000000001"]),
        # Two days either side of a midnight, its last and first
        # microseconds included.
        "startedAt": st.one_of(
            st.integers(MIDNIGHT - 2 * 86_400 * 10**6, MIDNIGHT + 2 * 86_400 * 10**6),
            st.sampled_from([MIDNIGHT - 1, MIDNIGHT, MIDNIGHT + 86_400 * 10**6 - 1]),
        ).map(
            lambda us: datetime.datetime.fromtimestamp(0, UTC) + datetime.timedelta(microseconds=us)
        ),
        **{field: amounts for field in SUMMED},
    }
)
# A row of a batch: a new one, or one recorded before (by its position in
# the rows made so far) sent again as it was, with another cost, under
# another organization, as another kind, with another parent, or with
# other cache writes.
actions = st.one_of(
    st.tuples(st.just("new"), contents),
    st.tuples(
        st.sampled_from(["same", "changed", "stolen", "rekinded", "reparented", "rewritten"]),
        st.integers(0, 10_000),
    ),
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batches=st.lists(st.lists(actions, min_size=1, max_size=12), min_size=1, max_size=6))
def test_theRollupEqualsTheLedgersSumsAfterAnyBatches(
    appStore: Store, migratedDSN: str, batches: list[list[tuple[str, Any]]]
) -> None:
    """
    After any batches of new rows of every kind, rows sent again, rows sent
    again with other content (another cost, kind, parent or count of cache
    writes) and keys taken
    by another organization, each row is recorded, a duplicate or a
    conflict exactly as a plain model of the ledger says, and the rollup
    holds exactly the sums of the rows recorded by organization, day,
    agent, token, model and kind (computed in Python, and by PostgreSQL
    from the ledger).
    """
    orgs = [uuid.uuid4(), uuid.uuid4()]
    ledger: dict[str, UsageRecord] = {}
    made: list[UsageRecord] = []
    for batch in batches:
        rows: list[UsageRecord] = []
        for kind, value in batch:
            if kind == "new":
                fields = dict(value)
                row = usageRecord(orgs[fields.pop("organization")], **fields)
                made.append(row)
            elif not made:
                continue
            else:
                row = made[value % len(made)]
                if kind == "changed":
                    cost = row.costNanoUSD + (1 if row.costNanoUSD < MAXIMUM_ROW_AMOUNT else -1)
                    row = attrs.evolve(row, costNanoUSD=cost)
                elif kind == "stolen":
                    row = attrs.evolve(row, orgID=orgs[1] if row.orgID == orgs[0] else orgs[0])
                elif kind == "rekinded":
                    row = attrs.evolve(row, kind=KINDS[(KINDS.index(row.kind) + 1) % len(KINDS)])
                elif kind == "reparented":
                    row = attrs.evolve(
                        row, parentRequestID=None if row.parentRequestID else row.requestID
                    )
                elif kind == "rewritten":
                    written = row.cacheWriteTokens
                    row = attrs.evolve(
                        row, cacheWriteTokens=written + (1 if written < MAXIMUM_ROW_AMOUNT else -1)
                    )
            rows.append(row)
        expected = {"recorded": 0, "duplicates": 0, "conflicts": []}
        for position, row in enumerate(rows):
            if row.ledgerID not in ledger:
                ledger[row.ledgerID] = row
                expected["recorded"] += 1  # type: ignore[operator]
            elif ledger[row.ledgerID] == row:
                expected["duplicates"] += 1  # type: ignore[operator]
            else:
                expected["conflicts"].append(position)  # type: ignore[attr-defined]
        written = appStore.recordUsage(rows)
        assert written.refused == []
        assert {
            "recorded": written.recorded,
            "duplicates": written.duplicates,
            "conflicts": [position for position, _ in written.conflicts],
        } == expected
    assert storedRollup(migratedDSN, orgs) == expectedRollup(list(ledger.values()))
    assert ledgerRollup(migratedDSN, orgs) == expectedRollup(list(ledger.values()))


def test_concurrentBatchesNeitherDeadlockNorMiscount(migratedDSN: str) -> None:
    """
    Four writers record overlapping batches at once (the same rollup
    groups in different orders, and each other's rows sent again, as two
    proxies and a resent batch do): no batch fails (the rows and groups
    are locked in one order, so no deadlock), every row is recorded once,
    and the rollup equals the ledger's sums.
    """
    orgs = [uuid.uuid4(), uuid.uuid4()]
    generator = random.Random(28)
    pool = [
        usageRecord(
            generator.choice(orgs),
            agentID=generator.choice(AGENTS),
            tokenID=generator.choice(TOKENS),
            model=generator.choice(["fast", "slow", "other"]),
            startedAt=JUNE + datetime.timedelta(hours=generator.randrange(-30, 30)),
            costNanoUSD=generator.randrange(10**6),
            kind=generator.choice(KINDS),
        )
        for _ in range(2_000)
    ]
    failures: list[BaseException] = []
    written = [0]
    lock = threading.Lock()

    def writer(seed: int) -> None:
        chooser = random.Random(seed)
        try:
            with applicationStore(migratedDSN) as store:
                for _ in range(15):
                    batch = chooser.sample(pool, 150)
                    outcome = store.recordUsage(batch)
                    assert outcome.conflicts == [] and outcome.refused == []
                    with lock:
                        written[0] += outcome.recorded
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    recorded = ledgerRollup(migratedDSN, orgs)
    assert sum(each[0] for each in recorded.values()) == written[0]
    assert storedRollup(migratedDSN, orgs) == recorded


# Spend and reports


REPORT_KEYS = {
    "day": lambda row: row.startedAt.astimezone(UTC).strftime("%Y-%m-%d"),
    "model": lambda row: row.model,
    "agent": lambda row: "" if row.agentID is None else str(row.agentID),
    "token": lambda row: "" if row.tokenID is None else str(row.tokenID),
    "kind": lambda row: row.kind,
}


def plainSums(rows: list[UsageRecord], by: str) -> list[UsageSums]:
    groups: dict[str, list[UsageRecord]] = {}
    for row in rows:
        groups.setdefault(REPORT_KEYS[by](row), []).append(row)
    return [
        UsageSums(
            key,
            len(members),
            *(sum(getattr(each, field) for each in members) for field in SUMMED),
        )
        for key, members in sorted(groups.items())
    ]


@pytest.fixture
def spreadRows(appStore: Store) -> tuple[uuid.UUID, list[UsageRecord]]:
    """
    400 rows of one organization over May 30 to June 3 2025 at random
    microseconds (some exactly at midnight), of every kind, and a few of
    another organization.
    """
    orgID = uuid.uuid4()
    generator = random.Random(12)
    start = JUNE - 2 * DAY
    rows = [
        usageRecord(
            orgID,
            agentID=generator.choice(AGENTS),
            tokenID=generator.choice(TOKENS),
            model=generator.choice(["fast", "slow"]),
            startedAt=start
            + datetime.timedelta(
                microseconds=generator.choice(
                    [
                        generator.randrange(5 * 86_400 * 10**6),
                        generator.randrange(5) * 86_400 * 10**6,
                    ]
                )
            ),
            promptTokens=generator.randrange(10**6),
            costNanoUSD=generator.randrange(10**9),
            kind=generator.choice(KINDS),
        )
        for _ in range(400)
    ]
    appStore.recordUsage(rows)
    appStore.recordUsage(
        [usageRecord(uuid.uuid4(), startedAt=JUNE, kind=kind) for kind in KINDS for _ in range(2)]
    )
    return orgID, rows


moments = st.integers(-3 * 86_400 * 10**6, 4 * 86_400 * 10**6).map(
    lambda us: JUNE + datetime.timedelta(microseconds=us)
)
# Whole days, whole hours and any microsecond.
bounds = st.one_of(
    st.integers(-3, 4).map(lambda days: JUNE + days * DAY),
    st.integers(-72, 96).map(lambda hours: JUNE + datetime.timedelta(hours=hours)),
    moments,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(since=bounds, until=bounds, agent=st.sampled_from(AGENTS))
def test_spendAndReportsEqualAPlainSumForAnySpan(
    appStore: Store,
    spreadRows: tuple[uuid.UUID, list[UsageRecord]],
    since: datetime.datetime,
    until: datetime.datetime,
    agent: uuid.UUID | None,
) -> None:
    """
    For spans aligned on days and not (within a day, across midnights,
    from one microsecond to another), GetSpend's and the reports' sums
    (whole days from the rollup, the edges from the ledger) equal a plain
    sum over the rows that started in [since, until), for the
    organization and for one agent, in every grouping.
    """
    orgID, rows = spreadRows
    inSpan = [row for row in rows if since <= row.startedAt < until]
    ofAgent = [row for row in inSpan if row.agentID == agent]
    assert appStore.spend(orgID, None, since, until) == sum(row.costNanoUSD for row in inSpan)
    if agent is not None:
        assert appStore.spend(orgID, agent, since, until) == sum(row.costNanoUSD for row in ofAgent)
    for by in REPORT_KEYS:
        assert appStore.usageSums(orgID, None, since, until, by) == plainSums(inSpan, by)
    if agent is not None:
        assert appStore.usageSums(orgID, agent, since, until, "model") == plainSums(
            ofAgent, "model"
        )


def test_spendAtTheEndOfTime(authService: RunningAuthService, owner: Store) -> None:
    """
    A span within the last day a timestamp can hold (no next midnight) is
    summed from the ledger, not refused.
    """
    tenant = makeTenant(owner)
    request = auth_pb2.GetSpendRequest(
        org_id=str(tenant.orgID),
        since_unix=LATEST_UNIX_SECOND - 3600,
        until_unix=LATEST_UNIX_SECOND,
    )
    assert authService.call("GetSpend", request).cost_nano_usd == 0


def test_sumsPastInt64NeverBreakAnAnswer(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    9,300 rows at the most a row may carry (each amount at
    MAXIMUM_ROW_AMOUNT, which is recorded) sum past int64 (issue 28, item
    8): GetSpend answers the largest int64 (past every budget, which is
    what the proxy needs to know), GetUsage clamps its token counts there
    and keeps cost_usd exact, and svcctl usage prints every sum exactly.
    """
    tenant = makeTenant(
        owner, "big", permissions=int(Permission.ProxyChatCompletion | Permission.UsageRead)
    )
    most = MAXIMUM_ROW_AMOUNT
    count = 9_300
    for first in range(0, count, 1_000):
        rows = [
            usageRow(
                tenant,
                prompt_tokens=most,
                cached_tokens=7,
                completion_tokens=most,
                reasoning_tokens=most,
                cost_nano_usd=most,
                cache_write_tokens=most,
                started_at_us=microseconds(JUNE) + index,
                duration_us=2**63 - 1,
            )
            for index in range(first, min(first + 1_000, count))
        ]
        assert record(authService, rows) == (len(rows), 0)
    spend = auth_pb2.GetSpendRequest(
        org_id=str(tenant.orgID),
        since_unix=int(JUNE.timestamp()),
        until_unix=int((JUNE + 30 * DAY).timestamp()),
    )
    assert authService.call("GetSpend", spend).cost_nano_usd == INT64_MAX
    usage = authService.call(
        "GetUsage",
        auth_pb2.GetUsageRequest(since="2025-06-01", until="2025-07-01", by="model"),
        bearer=tenant.token,
    )
    for each in (usage.rows[0], usage.total):
        assert each.requests == count
        assert each.prompt_tokens == INT64_MAX
        assert each.completion_tokens == INT64_MAX
        assert each.reasoning_tokens == INT64_MAX
        assert each.cached_tokens == 7 * count
        assert each.cache_write_tokens == INT64_MAX
        assert each.cost_usd == "9300000000.00"
    printed = document(
        svcctl(
            migratedDSN,
            "usage",
            "--org",
            str(tenant.orgID),
            "--since",
            "2025-06-01",
            "--until",
            "2025-07-01",
        )
    )
    assert printed["total"]["prompt_tokens"] == count * most
    assert printed["total"]["cache_write_tokens"] == count * most
    assert printed["total"]["cost_usd"] == "9300000000.00"


# The migration


def test_theMigrationKeysAndRollsUpALedgerHoldingRows(databaseDSN: str) -> None:
    """
    On a ledger written before sql/0007 (keyed by request id): every row
    keeps its columns and gets its request id as its ledger id (the MD5
    UUID for one that is not a UUID), the rollup holds the sums of every
    row, and after it an older proxy's batch sent again is a duplicate,
    while new rows may share a request id.
    """
    assert migrate(databaseDSN, through="0006_usage.sql")[-1] == "0006_usage.sql"
    orgs = [uuid.uuid4(), uuid.uuid4()]
    generator = random.Random(7)
    old: list[UsageRecord] = []
    for index in range(300):
        requestID = str(uuid.uuid4())
        if index == 0:
            requestID = "legacy-request"
        elif index == 1:
            requestID = requestID.upper()
        old.append(
            usageRecord(
                generator.choice(orgs),
                ledgerID=keyOfRequestID(requestID),
                requestID=requestID,
                agentID=generator.choice(AGENTS),
                model=generator.choice(["fast", "slow"]),
                startedAt=JUNE + datetime.timedelta(minutes=generator.randrange(-3000, 3000)),
                costNanoUSD=generator.randrange(10**9),
            )
        )
    with psycopg.connect(databaseDSN, autocommit=True) as connection:
        with connection.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO usage_ledger (request_id, org_id, agent_id, token_id,"
                " model_requested, model, provider, upstream_model, stream, outcome,"
                " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens,"
                " tokens_from, cost_nano_usd, price_version, started_at, duration_us)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,"
                " %s, %s)",
                [attrs.astuple(each)[1:20] for each in old],
            )
    assert migrate(databaseDSN, through="0007_ledger_key_and_rollup.sql") == [
        "0007_ledger_key_and_rollup.sql"
    ]
    migrate(databaseDSN)

    with psycopg.connect(databaseDSN, autocommit=True) as connection:
        keys: dict[str, str] = {
            requestID: str(ledgerID)
            for requestID, ledgerID in connection.execute(
                "SELECT request_id, ledger_id FROM usage_ledger"
            ).fetchall()
        }
    assert keys == {each.requestID: each.ledgerID for each in old}
    assert keys["legacy-request"] == keyOfRequestID("legacy-request")
    assert storedRollup(databaseDSN, orgs) == expectedRollup(old)

    with applicationStore(databaseDSN) as store:
        again = store.recordUsage(old)
        assert (again.recorded, again.duplicates, again.conflicts) == (0, len(old), [])
        sharing = [
            usageRecord(orgs[0], requestID=old[2].requestID),
            usageRecord(orgs[1], requestID=old[2].requestID),
        ]
        assert store.recordUsage(sharing).recorded == 2
        assert store.spend(orgs[0], None, JUNE - 5 * DAY, JUNE + 5 * DAY) == sum(
            each.costNanoUSD for each in [*old, *sharing] if each.orgID == orgs[0]
        )
    assert storedRollup(databaseDSN, orgs) == expectedRollup([*old, *sharing])


def test_theKindMigrationKeepsALedgerHoldingRowsAndItsSums(databaseDSN: str) -> None:
    """
    On a ledger and rollup written before sql/0008 (as sql/0007 left them):
    every row becomes chat with no parent, every rollup group chat with
    the same sums; the rollup's key holds the kind, so rows of other kinds
    in the same organization, day, agent, token and model are summed apart
    while the existing groups keep adding up; the old rows sent again are
    duplicates; both tables stay under forced row-level security, and the
    new columns' checks hold for rows written from now on.
    """
    assert migrate(databaseDSN, through="0007_ledger_key_and_rollup.sql")[-1] == (
        "0007_ledger_key_and_rollup.sql"
    )
    orgs = [uuid.uuid4(), uuid.uuid4()]
    generator = random.Random(8)
    old = [
        usageRecord(
            generator.choice(orgs),
            agentID=generator.choice(AGENTS),
            model=generator.choice(["fast", "slow"]),
            startedAt=JUNE + datetime.timedelta(minutes=generator.randrange(-3000, 3000)),
            costNanoUSD=generator.randrange(10**9),
        )
        for _ in range(200)
    ]
    with psycopg.connect(databaseDSN, autocommit=True) as connection:
        with connection.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO usage_ledger (ledger_id, request_id, org_id, agent_id, token_id,"
                " model_requested, model, provider, upstream_model, stream, outcome,"
                " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens,"
                " tokens_from, cost_nano_usd, price_version, started_at, duration_us)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,"
                " %s, %s, %s)",
                [attrs.astuple(each)[:20] for each in old],
            )
        # The rollup as sql/0007 builds it from a ledger.
        connection.execute(
            "INSERT INTO usage_rollup (org_id, day, agent_id, token_id, model, requests,"
            " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, cost_nano_usd)"
            " SELECT org_id, (started_at AT TIME ZONE 'UTC')::date, agent_id, token_id, model,"
            " count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens),"
            " sum(reasoning_tokens), sum(cost_nano_usd) FROM usage_ledger GROUP BY 1, 2, 3, 4, 5"
        )
    assert migrate(databaseDSN, through="0008_usage_kind.sql") == ["0008_usage_kind.sql"]

    assert storedKinds(databaseDSN, [each.ledgerID for each in old]) == {
        each.ledgerID: ("chat", None) for each in old
    }
    assert storedRollup(databaseDSN, orgs, SUMMED_BEFORE_CACHE_WRITES) == expectedRollup(
        old, SUMMED_BEFORE_CACHE_WRITES
    )
    with psycopg.connect(databaseDSN, autocommit=True) as connection:
        security = connection.execute(
            "SELECT relname, relrowsecurity, relforcerowsecurity FROM pg_class"
            " WHERE relname IN ('usage_ledger', 'usage_rollup') ORDER BY relname"
        ).fetchall()
        key = connection.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'usage_rollup_key'"
        ).fetchone()
    assert security == [("usage_ledger", True, True), ("usage_rollup", True, True)]
    assert key == (
        "UNIQUE NULLS NOT DISTINCT (org_id, day, agent_id, token_id, model, kind, slot)",
    )
    # The store writes the columns of every later migration too
    # (sql/0012_usage_memories.sql).
    migrate(databaseDSN)

    with applicationStore(databaseDSN) as store:
        again = store.recordUsage(old)
        assert (again.recorded, again.duplicates, again.conflicts) == (0, len(old), [])
        sameGroups = [
            attrs.evolve(each, ledgerID=uuid7Text(), kind=kind, parentRequestID=each.requestID)
            for each in old[:20]
            for kind in KINDS
        ]
        written = store.recordUsage(sameGroups)
        assert (written.recorded, written.conflicts, written.refused) == (60, [], [])
        assert store.usageSums(orgs[0], None, JUNE - 5 * DAY, JUNE + 5 * DAY, "kind") == (
            plainSums([each for each in [*old, *sameGroups] if each.orgID == orgs[0]], "kind")
        )
    assert storedRollup(databaseDSN, orgs) == expectedRollup([*old, *sameGroups])
    assert ledgerRollup(databaseDSN, orgs) == expectedRollup([*old, *sameGroups])

    with psycopg.connect(databaseDSN, autocommit=True) as connection:
        for column, value, check in [
            ("kind", "summary", "usage_ledger_kind_check"),
            ("parent_request_id", "", "usage_ledger_parent_request_id_check"),
            ("parent_request_id", "p" * 129, "usage_ledger_parent_request_id_check"),
        ]:
            with pytest.raises(psycopg.errors.CheckViolation) as refused:
                connection.execute(
                    f"UPDATE usage_ledger SET {column} = %s WHERE ledger_id = %s",
                    (value, old[0].ledgerID),
                )
            assert refused.value.diag.constraint_name == check
        with pytest.raises(psycopg.errors.CheckViolation):
            connection.execute("UPDATE usage_rollup SET kind = 'summary'")


def test_theCacheWritesMigrationKeepsALedgerHoldingRowsAndItsSums(databaseDSN: str) -> None:
    """
    On a ledger and rollup written before sql/0020 (decisions D14): every
    row and every rollup group reads no cache writes and keeps its sums;
    the old rows sent again are duplicates, and sent again with cache
    writes, conflicts naming the column; new rows' writes are summed in
    the rollup and the reports beside the old ones; both tables stay under
    forced row-level security, and the new columns' checks hold for rows
    written from now on.
    """
    assert migrate(databaseDSN, through="0019_notify_ids.sql")[-1] == "0019_notify_ids.sql"
    orgs = [uuid.uuid4(), uuid.uuid4()]
    generator = random.Random(14)
    old = [
        usageRecord(
            generator.choice(orgs),
            agentID=generator.choice(AGENTS),
            model=generator.choice(["fast", "slow"]),
            kind=generator.choice(KINDS),
            startedAt=JUNE + datetime.timedelta(minutes=generator.randrange(-3000, 3000)),
            costNanoUSD=generator.randrange(10**9),
        )
        for _ in range(200)
    ]
    with psycopg.connect(databaseDSN, autocommit=True) as connection:
        with connection.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO usage_ledger (ledger_id, request_id, org_id, agent_id, token_id,"
                " model_requested, model, provider, upstream_model, stream, outcome,"
                " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens,"
                " tokens_from, cost_nano_usd, price_version, started_at, duration_us, kind,"
                " parent_request_id, memories)"
                f" VALUES ({', '.join(['%s'] * 23)})",
                [attrs.astuple(each)[:23] for each in old],
            )
        # The rollup as the store kept it before sql/0020.
        connection.execute(
            "INSERT INTO usage_rollup (org_id, day, agent_id, token_id, model, kind, requests,"
            " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, cost_nano_usd)"
            " SELECT org_id, (started_at AT TIME ZONE 'UTC')::date, agent_id, token_id, model,"
            " kind, count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens),"
            " sum(reasoning_tokens), sum(cost_nano_usd) FROM usage_ledger"
            " GROUP BY 1, 2, 3, 4, 5, 6"
        )
    assert migrate(databaseDSN, through="0020_usage_cache_writes.sql") == [
        "0020_usage_cache_writes.sql"
    ]
    assert storedRollup(databaseDSN, orgs) == expectedRollup(old)
    assert ledgerRollup(databaseDSN, orgs) == expectedRollup(old)
    with psycopg.connect(databaseDSN, autocommit=True) as connection:
        security = connection.execute(
            "SELECT relname, relrowsecurity, relforcerowsecurity FROM pg_class"
            " WHERE relname IN ('usage_ledger', 'usage_rollup') ORDER BY relname"
        ).fetchall()
    assert security == [("usage_ledger", True, True), ("usage_rollup", True, True)]
    migrate(databaseDSN)

    with applicationStore(databaseDSN) as store:
        again = store.recordUsage(old)
        assert (again.recorded, again.duplicates, again.conflicts) == (0, len(old), [])
        rewritten = store.recordUsage([attrs.evolve(old[0], cacheWriteTokens=3)])
        assert rewritten.conflicts == [
            (0, "ledger_id is recorded with other content (cache_write_tokens differ)")
        ]
        sameGroups = [
            attrs.evolve(each, ledgerID=uuid7Text(), cacheWriteTokens=generator.randrange(1, 90))
            for each in old[:40]
        ]
        written = store.recordUsage(sameGroups)
        assert (written.recorded, written.conflicts, written.refused) == (40, [], [])
        for by in REPORT_KEYS:
            assert store.usageSums(orgs[0], None, JUNE - 5 * DAY, JUNE + 5 * DAY, by) == (
                plainSums([each for each in [*old, *sameGroups] if each.orgID == orgs[0]], by)
            )
    assert storedRollup(databaseDSN, orgs) == expectedRollup([*old, *sameGroups])
    assert ledgerRollup(databaseDSN, orgs) == expectedRollup([*old, *sameGroups])
    assert sum(each[-1] for each in storedRollup(databaseDSN, orgs).values()) == sum(
        each.cacheWriteTokens for each in sameGroups
    )

    with psycopg.connect(databaseDSN, autocommit=True) as connection:
        for table, check in [
            ("usage_ledger", "usage_ledger_cache_write_tokens_check"),
            ("usage_rollup", "usage_rollup_cache_write_tokens_check"),
        ]:
            with pytest.raises(psycopg.errors.CheckViolation) as refused:
                connection.execute(f"UPDATE {table} SET cache_write_tokens = -1")
            assert refused.value.diag.constraint_name == check


# The log


def test_rejectedRowsAreCountedAndLoggedOnceAMinutePerReason() -> None:
    """
    Every rejected row is counted by reason; the first of each reason is
    logged at once, with the row's ledger and organization ids, reason and
    detail as fields; later ones within a minute only counted, and the
    next line carries how many there were.
    """
    now = [1000.0]
    registry = CollectorRegistry()
    counter = Counter("svc_auth_usage_rows_rejected", "rejected", ["reason"], registry=registry)
    logged: list[dict[str, Any]] = []
    rejects = RejectedRowsLog(counter, clock=lambda: now[0])
    rejects.log = Logger(observer=cast(ILogObserver, logged.append))

    def row(index: int, reason: str) -> RejectedRow:
        return RejectedRow(index, reason, f"detail {index}", uuid7Text(), f"org-{index}")

    rejects.rejected([row(0, "invalid"), row(1, "invalid"), row(2, "conflict")])
    now[0] += 59.0
    rejects.rejected([row(3, "invalid")])
    now[0] += 1.5
    rejects.rejected([row(4, "invalid")])
    assert [
        (event["reason"], event["rejected"], event["org_id"], event["detail"]) for event in logged
    ] == [
        ("invalid", 2, "org-1", "detail 1"),
        ("conflict", 1, "org-2", "detail 2"),
        ("invalid", 2, "org-4", "detail 4"),
    ]
    assert all(len(event["ledger_id"]) == 36 for event in logged)
    assert (
        registry.get_sample_value("svc_auth_usage_rows_rejected_total", {"reason": "invalid"}) == 4
    )
    assert (
        registry.get_sample_value("svc_auth_usage_rows_rejected_total", {"reason": "conflict"}) == 1
    )
