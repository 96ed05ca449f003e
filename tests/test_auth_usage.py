"""
The usage ledger in svc-auth (decisions D12 and D12 amended,
sql/0006_usage.sql, sql/0007_ledger_key_and_rollup.sql, svcd/auth/usage.py;
the kinds of decisions D13, sql/0008_usage_kind.sql): RecordUsage checks
each row on its own, records the good ones in one transaction and is
idempotent by ledger id, rows live under row-level security, GetSpend and
GetUsage sum them to the nano-dollar, and svcctl usage prints the same
sums as JSON or CSV, grouped by day, model, agent, token or kind; against
a real grpcio server and a real PostgreSQL. The pure rules (rows, spans, dollars) are unit-tested at
the end. The key, conflicts, the rollup and the migration of a ledger
holding rows are tested in test_auth_ledger.py.
"""

from __future__ import annotations

import csv
import datetime
import io
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import psycopg
import pytest
from authfixtures import Tenant, makeTenant, ownerStore
from authhelpers import (
    JUNE,
    UTC,
    document,
    failure,
    microseconds,
    record,
    recordAnswer,
    svcctl,
    usageRow,
)
from authservice import RunningAuthService
from waiting import waitUntil

from svcd.auth.store import Store
from svcd.auth.store.base import APPLICATION_ROLE
from svcd.auth.store.ledger import UsageSums
from svcd.auth.usage import (
    KINDS,
    MAXIMUM_ROW_AMOUNT,
    MAXIMUM_USAGE_BATCH,
    BadUsage,
    checkBatch,
    parseMoment,
    reportCSV,
    reportSpan,
    usageRecord,
)
from svcd.common.migrations import migrate
from svcd.common.permissions import Permission
from svcd.devkit.postgres import PostgresServer
from svcd.ledger import rows as proxyRows
from svcd.pb.auth.v1 import auth_pb2


def ledgerCount(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as connection:
        row = connection.execute("SELECT count(*) FROM usage_ledger").fetchone()
        assert row is not None
        return int(row[0])


def refusal(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


# RecordUsage


def test_aBatchSentTwiceIsRecordedOnce(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    Sending a batch again records nothing new: every row is a duplicate,
    and the ledger holds one row per ledger id. A row twice in one batch is
    recorded once too.
    """
    tenant = makeTenant(owner)
    rows = [usageRow(tenant) for _ in range(5)]
    assert record(authService, rows) == (5, 0)
    assert record(authService, rows) == (0, 5)
    assert ledgerCount(migratedDSN) == 5
    again = usageRow(tenant)
    assert record(authService, [again, again, rows[0]]) == (1, 2)
    assert ledgerCount(migratedDSN) == 6
    assert record(authService, []) == (0, 0)


def test_aRowKeepsEveryField(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    Every field of a row is stored as sent, the start as a timestamp to
    the microsecond, and empty agent and token ids as NULL; an empty kind
    (a proxy older than the field) as chat, an empty parent request id as
    NULL.
    """
    tenant = makeTenant(owner)
    started = JUNE + datetime.timedelta(seconds=7, microseconds=123456)
    full = usageRow(
        tenant,
        stream=True,
        outcome="client_gone",
        tokens_from="reservation",
        kind="extraction",
        parent_request_id="p" * 128,
        cache_write_tokens=40,
    )
    full.started_at_us = microseconds(started)
    bare = usageRow(tenant, agent_id="", token_id="", price_version="", cost_nano_usd=0)
    assert record(authService, [full, bare]) == (2, 0)
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        stored = connection.execute(
            "SELECT org_id, agent_id, token_id, model_requested, model, provider,"
            " upstream_model, stream, outcome, prompt_tokens, cached_tokens,"
            " completion_tokens, reasoning_tokens, tokens_from, cost_nano_usd,"
            " price_version, started_at, duration_us, recorded_at IS NOT NULL, request_id,"
            " kind, parent_request_id, cache_write_tokens FROM usage_ledger"
            " WHERE ledger_id = %s",
            (full.ledger_id,),
        ).fetchone()
        empty = connection.execute(
            "SELECT agent_id, token_id, price_version, kind, parent_request_id,"
            " cache_write_tokens FROM usage_ledger WHERE ledger_id = %s",
            (bare.ledger_id,),
        ).fetchone()
    assert stored == (
        tenant.orgID,
        tenant.agentID,
        tenant.tokenID,
        "fast",
        "fast",
        "local",
        "llama-3.1-8b",
        True,
        "client_gone",
        100,
        10,
        50,
        5,
        "reservation",
        1_234_567,
        "0123456789abcdef",
        started,
        250_000,
        True,
        full.request_id,
        "extraction",
        "p" * 128,
        40,
    )
    # A row without cache writes (or from a proxy older than the field).
    assert empty == (None, None, "", "chat", None, 0)


@pytest.mark.parametrize(
    "changes, mentions",
    [
        ({"org_id": "not-a-uuid"}, "org_id"),
        ({"org_id": ""}, "org_id"),
        ({"agent_id": "12345"}, "agent_id"),
        ({"token_id": "x" * 36}, "token_id"),
        ({"ledger_id": "not-a-uuid"}, "ledger_id"),
        ({"ledger_id": "{" + str(uuid.uuid4()) + "}"}, "ledger_id"),
        ({"outcome": "fine"}, "outcome"),
        ({"tokens_from": "guess"}, "tokens_from"),
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"reasoning_tokens": -5}, "reasoning_tokens"),
        ({"cost_nano_usd": -1}, "cost_nano_usd"),
        ({"duration_us": -1}, "duration_us"),
        ({"started_at_us": -1}, "started_at_us"),
        ({"started_at_us": 2**62}, "started_at_us"),
        ({"request_id": ""}, "request_id"),
        ({"request_id": "r" * 129}, "request_id"),
        ({"model": "m\x00"}, "model"),
        ({"provider": "p" * 257}, "provider"),
        ({"prompt_tokens": MAXIMUM_ROW_AMOUNT + 1}, "prompt_tokens"),
        ({"cached_tokens": MAXIMUM_ROW_AMOUNT + 1}, "cached_tokens"),
        ({"completion_tokens": 2**63 - 1}, "completion_tokens"),
        ({"reasoning_tokens": MAXIMUM_ROW_AMOUNT + 1}, "reasoning_tokens"),
        ({"cost_nano_usd": MAXIMUM_ROW_AMOUNT + 1}, "cost_nano_usd"),
        ({"cache_write_tokens": -1}, "cache_write_tokens"),
        ({"cache_write_tokens": MAXIMUM_ROW_AMOUNT + 1}, "cache_write_tokens"),
        ({"kind": "summary"}, "kind"),
        ({"kind": "Chat"}, "kind"),
        ({"kind": " chat"}, "kind"),
        ({"parent_request_id": "r" * 129}, "parent_request_id"),
        ({"parent_request_id": "parent\x00"}, "parent_request_id"),
    ],
)
def test_aBadRowIsRejectedAndTheOthersRecorded(
    authService: RunningAuthService,
    owner: Store,
    migratedDSN: str,
    changes: dict[str, Any],
    mentions: str,
) -> None:
    """
    A row the ledger cannot hold is rejected as invalid, by its index,
    with a detail naming the field, and counted by reason; the good rows
    around it are recorded (one bad row never holds the others back). Sent
    again, the good rows are duplicates and the bad one rejected again.
    """
    tenant = makeTenant(owner)
    rows = [usageRow(tenant), usageRow(tenant, **changes), usageRow(tenant)]
    recorded, duplicates, rejected = recordAnswer(authService, rows)
    assert (recorded, duplicates) == (2, 0)
    ((index, reason, detail),) = rejected
    assert (index, reason) == (1, "invalid")
    assert detail.startswith(mentions), detail
    assert ledgerCount(migratedDSN) == 2
    assert recordAnswer(authService, rows) == (0, 2, rejected)
    assert (
        authService.registry.get_sample_value(
            "svc_auth_usage_rows_rejected_total", {"reason": "invalid"}
        )
        == 2
    )
    assert (
        authService.registry.get_sample_value(
            "svc_auth_usage_rows_rejected_total", {"reason": "conflict"}
        )
        == 0
    )


def test_aBatchPastTheBoundIsRefused(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    At most MAXIMUM_USAGE_BATCH rows a call: one more is INVALID_ARGUMENT
    and nothing is recorded; exactly the bound is recorded.
    """
    tenant = makeTenant(owner)
    rows = [usageRow(tenant) for _ in range(MAXIMUM_USAGE_BATCH + 1)]
    error = refusal(lambda: record(authService, rows))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(MAXIMUM_USAGE_BATCH) in (error.details() or "")
    assert ledgerCount(migratedDSN) == 0
    assert record(authService, rows[:MAXIMUM_USAGE_BATCH]) == (MAXIMUM_USAGE_BATCH, 0)


def test_rowsAreUnderRowLevelSecurity(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    One batch may hold several organizations' rows; as svc_auth_app, each
    organization's context sees its own rows only, no context sees none,
    and the role cannot write a row of another organization, or change or
    delete any.
    """
    first, second = makeTenant(owner, "a"), makeTenant(owner, "b")
    rows = [usageRow(first), usageRow(second), usageRow(first)]
    assert record(authService, rows) == (3, 0)
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        connection.execute(f"SET ROLE {APPLICATION_ROLE}")

        def visible(orgID: uuid.UUID | None) -> int:
            with connection.transaction():
                connection.execute(
                    "SELECT set_config('svc.org_id', %s, true)", (str(orgID) if orgID else "",)
                )
                row = connection.execute("SELECT count(*) FROM usage_ledger").fetchone()
                assert row is not None
                return int(row[0])

        assert visible(first.orgID) == 2
        assert visible(second.orgID) == 1
        assert visible(uuid.uuid4()) == 0
        assert visible(None) == 0
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            with connection.transaction():
                connection.execute("SELECT set_config('svc.org_id', %s, true)", (str(first.orgID),))
                connection.execute(
                    "INSERT INTO usage_ledger (ledger_id, request_id, org_id, model_requested,"
                    " model, provider, upstream_model, stream, outcome, prompt_tokens,"
                    " cached_tokens, completion_tokens, reasoning_tokens, tokens_from,"
                    " cost_nano_usd, price_version, started_at, duration_us) VALUES"
                    " (gen_random_uuid(), 'x', %s, '', '', '', '', false, 'ok', 0, 0, 0, 0,"
                    " 'provider', 0, '', now(), 0)",
                    (second.orgID,),
                )
        for statement in ("UPDATE usage_ledger SET cost_nano_usd = 0", "DELETE FROM usage_ledger"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                with connection.transaction():
                    connection.execute(
                        "SELECT set_config('svc.org_id', %s, true)", (str(first.orgID),)
                    )
                    connection.execute(statement)


def test_recordUsageIsUnavailableWhilePostgreSQLIsDownAndRecordsOnceBack(
    privatePostgres: PostgresServer,
) -> None:
    """
    With PostgreSQL stopped, RecordUsage answers UNAVAILABLE (which the
    proxy retries) and records nothing; once it is back, the same batch is
    recorded, once.
    """
    dsn = privatePostgres.createDatabase("ledger")
    migrate(dsn)
    store, connection = ownerStore(dsn)
    tenant = makeTenant(store)
    connection.close()
    service = RunningAuthService(dsn).start()
    try:
        rows = [usageRow(tenant) for _ in range(3)]
        privatePostgres.stop()
        error = refusal(lambda: record(service, rows))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        privatePostgres.start()
        outcomes: list[tuple[int, int]] = []

        def recorded() -> bool:
            try:
                outcomes.append(record(service, rows))
            except grpc.RpcError as failed:
                assert failed.code() == grpc.StatusCode.UNAVAILABLE
                return False
            return True

        waitUntil(recorded, limit=15.0, interval=0.2)
        assert outcomes == [(3, 0)]
        assert record(service, rows) == (0, 3)
        assert ledgerCount(dsn) == 3
    finally:
        service.stop()


# GetSpend


def test_getSpendSumsAnOrganizationAndAnAgentInTheirSpan(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    GetSpend sums cost_nano_usd to the nano-dollar, for the organization
    or one of its agents, over rows that started in [since, until): a row
    at since counts, one at until does not, another organization's never.
    """
    tenant, other = makeTenant(owner, "a"), makeTenant(owner, "b")
    secondAgent = owner.createAgent(tenant.orgID, "second").agentID
    start = int(JUNE.timestamp())
    rows = [
        usageRow(tenant, cost_nano_usd=1, started_at_us=start * 10**6),
        usageRow(tenant, cost_nano_usd=20, started_at_us=(start + 59) * 10**6 + 999_999),
        usageRow(
            tenant,
            agent_id=str(secondAgent),
            cost_nano_usd=300,
            started_at_us=(start + 30) * 10**6,
        ),
        usageRow(tenant, cost_nano_usd=4_000, started_at_us=(start + 60) * 10**6),
        usageRow(tenant, cost_nano_usd=50_000, started_at_us=(start - 1) * 10**6),
        usageRow(other, cost_nano_usd=600_000, started_at_us=(start + 1) * 10**6),
    ]
    record(authService, rows)

    def spend(orgID: uuid.UUID, agentID: uuid.UUID | None, since: int, until: int) -> int:
        request = auth_pb2.GetSpendRequest(
            org_id=str(orgID),
            agent_id=str(agentID) if agentID else "",
            since_unix=since,
            until_unix=until,
        )
        return int(authService.call("GetSpend", request).cost_nano_usd)

    assert spend(tenant.orgID, None, start, start + 60) == 321
    assert spend(tenant.orgID, tenant.agentID, start, start + 60) == 21
    assert spend(tenant.orgID, secondAgent, start, start + 60) == 300
    assert spend(tenant.orgID, None, start - 1, start + 61) == 54_321
    assert spend(other.orgID, None, start, start + 60) == 600_000
    assert spend(other.orgID, tenant.agentID, start, start + 60) == 0
    assert spend(tenant.orgID, None, start + 60, start) == 0
    assert spend(uuid.uuid4(), None, start, start + 60) == 0
    for bad in (
        auth_pb2.GetSpendRequest(org_id="nope", since_unix=0, until_unix=1),
        auth_pb2.GetSpendRequest(org_id=str(tenant.orgID), agent_id="x", until_unix=1),
        auth_pb2.GetSpendRequest(org_id=str(tenant.orgID), since_unix=-1, until_unix=1),
        auth_pb2.GetSpendRequest(org_id=str(tenant.orgID), until_unix=2**62),
    ):
        error = refusal(lambda: authService.call("GetSpend", bad))  # noqa: B023
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


# GetUsage and svcctl usage


@pytest.fixture
def reported(
    authService: RunningAuthService, owner: Store
) -> Iterator[tuple[Tenant, Tenant, uuid.UUID, list[auth_pb2.UsageRow]]]:
    """
    An organization with a UsageRead token and a second agent, rows over
    two days, two models and every kind in June 2025 (one on June 30; one
    from a proxy older than kinds, so chat; two with cache writes), and
    another organization with rows of its own.
    """
    tenant = makeTenant(
        owner, "acme", permissions=int(Permission.ProxyChatCompletion | Permission.UsageRead)
    )
    other = makeTenant(owner, "other", permissions=int(Permission.UsageRead))
    secondAgent = owner.createAgent(tenant.orgID, "second").agentID
    day = datetime.timedelta(days=1)
    rows = [
        usageRow(
            tenant,
            cost_nano_usd=1_500_000_000,
            cache_write_tokens=30,
            started_at_us=microseconds(JUNE),
        ),
        usageRow(
            tenant,
            model="slow",
            kind="embedding",
            cost_nano_usd=7,
            prompt_tokens=1000,
            cached_tokens=0,
            started_at_us=microseconds(JUNE + day),
        ),
        usageRow(
            tenant,
            agent_id=str(secondAgent),
            token_id="",
            kind="extraction",
            parent_request_id="observation-1",
            cost_nano_usd=250_000_000,
            reasoning_tokens=0,
            started_at_us=microseconds(JUNE + day + datetime.timedelta(hours=23)),
        ),
        usageRow(
            tenant,
            kind="chat",
            cost_nano_usd=99,
            cache_write_tokens=7,
            started_at_us=microseconds(JUNE + 29 * day),
        ),
        usageRow(other, kind="embedding", cost_nano_usd=10**12, started_at_us=microseconds(JUNE)),
    ]
    record(authService, rows)
    yield tenant, other, secondAgent, rows


def expectedSums(rows: list[auth_pb2.UsageRow], key: Any) -> dict[str, dict[str, Any]]:
    """
    What a report of C{rows} grouped by C{key} must say, summed here in
    Python; cost_usd in nano-dollars for comparison.
    """
    sums: dict[str, dict[str, Any]] = {}
    for row in rows:
        group = sums.setdefault(
            key(row),
            {
                "requests": 0,
                "prompt_tokens": 0,
                "cached_tokens": 0,
                "completion_tokens": 0,
                "reasoning_tokens": 0,
                "cost_usd": 0,
                "cache_write_tokens": 0,
            },
        )
        group["requests"] += 1
        for field in (
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "reasoning_tokens",
            "cache_write_tokens",
        ):
            group[field] += getattr(row, field)
        group["cost_usd"] += row.cost_nano_usd
    return sums


def nano(dollars: str) -> int:
    whole, _, fraction = dollars.partition(".")
    return int(whole) * 10**9 + int(fraction.ljust(9, "0"))


def dayOf(row: auth_pb2.UsageRow) -> str:
    moment = datetime.datetime.fromtimestamp(row.started_at_us / 10**6, UTC)
    return moment.strftime("%Y-%m-%d")


KEYS = {
    "day": dayOf,
    "model": lambda row: row.model,
    "agent": lambda row: row.agent_id,
    "token": lambda row: row.token_id,
    "kind": lambda row: row.kind or "chat",
}


@pytest.mark.parametrize("by", list(KEYS))
def test_getUsageSumsTheCallersOrganization(
    authService: RunningAuthService,
    reported: tuple[Tenant, Tenant, uuid.UUID, list[auth_pb2.UsageRow]],
    by: str,
) -> None:
    """
    GetUsage answers the sums of the caller's own organization in June,
    grouped as asked, cost_usd exact dollars; never another
    organization's rows, never a row outside the span.
    """
    tenant, _, _, rows = reported
    june = [row for row in rows[:3]]
    answer = authService.call(
        "GetUsage",
        auth_pb2.GetUsageRequest(since="2025-06-01", until="2025-06-30", by=by),
        bearer=tenant.token,
    )
    assert (answer.org_id, answer.since, answer.until, answer.by) == (
        str(tenant.orgID),
        "2025-06-01T00:00:00Z",
        "2025-06-30T00:00:00Z",
        by,
    )
    got = {
        each.key: {
            "requests": each.requests,
            "prompt_tokens": each.prompt_tokens,
            "cached_tokens": each.cached_tokens,
            "completion_tokens": each.completion_tokens,
            "reasoning_tokens": each.reasoning_tokens,
            "cost_usd": nano(each.cost_usd),
            "cache_write_tokens": each.cache_write_tokens,
        }
        for each in answer.rows
    }
    assert got == expectedSums(june, KEYS[by])
    assert [each.key for each in answer.rows] == sorted(got)
    assert answer.total.key == ""
    assert answer.total.requests == 3
    assert answer.total.cost_usd == "1.750000007"
    assert answer.total.cache_write_tokens == 30


def test_getUsageOfOneAgentAndItsDefaultSpan(
    authService: RunningAuthService,
    reported: tuple[Tenant, Tenant, uuid.UUID, list[auth_pb2.UsageRow]],
) -> None:
    """
    With agent_id, only that agent's rows; without since and until, the
    current UTC month (so none of June 2025's rows), grouped by day.
    """
    tenant, _, secondAgent, _ = reported
    answer = authService.call(
        "GetUsage",
        auth_pb2.GetUsageRequest(agent_id=str(secondAgent), since="2025-06-01T00:00:00+02:00"),
        bearer=tenant.token,
    )
    assert answer.since == "2025-05-31T22:00:00Z"
    assert [(each.key, each.cost_usd) for each in answer.rows] == [("2025-06-02", "0.25")]
    current = authService.call("GetUsage", auth_pb2.GetUsageRequest(), bearer=tenant.token)
    now = datetime.datetime.now(UTC)
    assert current.since == now.strftime("%Y-%m-01T00:00:00Z")
    assert current.by == "day" and list(current.rows) == []
    assert current.total.cost_usd == "0.00"


def test_getUsageNeedsUsageReadAndItsOwnOrganization(
    authService: RunningAuthService,
    owner: Store,
    reported: tuple[Tenant, Tenant, uuid.UUID, list[auth_pb2.UsageRow]],
) -> None:
    """
    Without UsageRead: PERMISSION_DENIED. Another organization's agent id,
    or an unknown one: PERMISSION_DENIED, never NotFound. A token bound to
    an agent sees that agent's usage only. Bad spans and groupings are
    INVALID_ARGUMENT; no token is UNAUTHENTICATED.
    """
    tenant, other, secondAgent, _ = reported
    june = {"since": "2025-06-01", "until": "2025-07-01"}
    plain = makeTenant(owner, "plain")

    def usage(bearer: str | None, **fields: str) -> Any:
        return authService.call("GetUsage", auth_pb2.GetUsageRequest(**fields), bearer=bearer)

    for bearer, fields, code in [
        (plain.token, {}, grpc.StatusCode.PERMISSION_DENIED),
        (tenant.token, {"agent_id": str(other.agentID)}, grpc.StatusCode.PERMISSION_DENIED),
        (tenant.token, {"agent_id": str(uuid.uuid4())}, grpc.StatusCode.PERMISSION_DENIED),
        (other.token, {"agent_id": str(tenant.agentID)}, grpc.StatusCode.PERMISSION_DENIED),
        (tenant.token, {"agent_id": "nope"}, grpc.StatusCode.INVALID_ARGUMENT),
        (tenant.token, {"since": "June"}, grpc.StatusCode.INVALID_ARGUMENT),
        (tenant.token, {"until": "2025-06-01T00:00:00"}, grpc.StatusCode.INVALID_ARGUMENT),
        (
            tenant.token,
            {"since": "2025-07-01", "until": "2025-06-01"},
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (tenant.token, {"by": "week"}, grpc.StatusCode.INVALID_ARGUMENT),
        (None, {}, grpc.StatusCode.UNAUTHENTICATED),
    ]:
        error = refusal(lambda: usage(bearer, **fields))  # noqa: B023
        assert error.code() == code, (fields, error.details())

    assert usage(other.token, **june).total.cost_usd == "1000.00"
    bound = makeTenant(owner, "bound", permissions=int(Permission.UsageRead), bindAgent=True)
    assert usage(bound.token, **june).total.requests == 0
    error = refusal(lambda: usage(bound.token, agent_id=str(uuid.uuid4()), **june))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert usage(tenant.token, agent_id=str(secondAgent), **june).total.requests == 1


@pytest.mark.parametrize("by", list(KEYS))
def test_svcctlUsagePrintsTheSameSumsAsJSONAndCSV(
    migratedDSN: str,
    reported: tuple[Tenant, Tenant, uuid.UUID, list[auth_pb2.UsageRow]],
    by: str,
) -> None:
    """
    svcctl usage prints D12's document, or the rows as CSV with a header
    line, summed exactly from the ledger over [since, until).
    """
    tenant, _, _, rows = reported
    span = ("--since", "2025-06-01", "--until", "2025-07-01T00:00:00Z", "--by", by)
    printed = document(svcctl(migratedDSN, "usage", "--org", str(tenant.orgID), *span))
    assert set(printed) == {"org_id", "since", "until", "by", "rows", "total"}
    assert (printed["org_id"], printed["since"], printed["until"], printed["by"]) == (
        str(tenant.orgID),
        "2025-06-01T00:00:00Z",
        "2025-07-01T00:00:00Z",
        by,
    )
    expected = expectedSums(rows[:4], KEYS[by])
    got = {
        each.pop("key"): {**each, "cost_usd": nano(each["cost_usd"])} for each in printed["rows"]
    }
    assert got == expected
    assert printed["total"] == {
        "requests": 4,
        "prompt_tokens": sum(row.prompt_tokens for row in rows[:4]),
        "cached_tokens": sum(row.cached_tokens for row in rows[:4]),
        "completion_tokens": sum(row.completion_tokens for row in rows[:4]),
        "reasoning_tokens": sum(row.reasoning_tokens for row in rows[:4]),
        "cost_usd": "1.750000106",
        "cache_write_tokens": 37,
    }

    result = svcctl(migratedDSN, "usage", "--org", str(tenant.orgID), *span, "--format", "csv")
    assert result.returncode == 0 and result.stderr == ""
    lines = list(csv.reader(io.StringIO(result.stdout)))
    assert lines[0] == [
        "key",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "reasoning_tokens",
        "cost_usd",
        "cache_write_tokens",
    ]
    assert lines[1:] == [
        [each["key"], *(str(value) for key, value in each.items() if key != "key")]
        for each in document(svcctl(migratedDSN, "usage", "--org", str(tenant.orgID), *span))[
            "rows"
        ]
    ]


def test_svcctlUsageOfOneAgent(
    migratedDSN: str,
    reported: tuple[Tenant, Tenant, uuid.UUID, list[auth_pb2.UsageRow]],
) -> None:
    """
    --agent limits the sums to that agent's rows; an agent of another
    organization is refused as unknown.
    """
    tenant, other, secondAgent, _ = reported
    org = str(tenant.orgID)
    printed = document(
        svcctl(
            migratedDSN,
            "usage",
            "--org",
            org,
            "--agent",
            str(secondAgent),
            "--since",
            "2025-06-01",
            "--until",
            "2025-07-01",
            "--by",
            "agent",
        )
    )
    assert printed["rows"] == [
        {
            "key": str(secondAgent),
            "requests": 1,
            "prompt_tokens": 100,
            "cached_tokens": 10,
            "completion_tokens": 50,
            "reasoning_tokens": 0,
            "cost_usd": "0.25",
            "cache_write_tokens": 0,
        }
    ]
    line = failure(svcctl(migratedDSN, "usage", "--org", org, "--agent", str(other.agentID)))
    assert "no agent" in line


def test_svcctlUsageByKind(
    migratedDSN: str,
    reported: tuple[Tenant, Tenant, uuid.UUID, list[auth_pb2.UsageRow]],
) -> None:
    """
    svcctl usage --by kind prints one row per kind in June, keyed by the
    kind (the row without one counted as chat), as JSON and as CSV; the
    other organization's embedding, on the same day, is not in the sums;
    --agent narrows them to that agent's kinds.
    """
    tenant, _, secondAgent, _ = reported
    org = str(tenant.orgID)
    span = ("--since", "2025-06-01", "--until", "2025-07-01", "--by", "kind")
    printed = document(svcctl(migratedDSN, "usage", "--org", org, *span))
    assert printed["by"] == "kind"
    assert printed["rows"] == [
        {
            "key": "chat",
            "requests": 2,
            "prompt_tokens": 200,
            "cached_tokens": 20,
            "completion_tokens": 100,
            "reasoning_tokens": 10,
            "cost_usd": "1.500000099",
            "cache_write_tokens": 37,
        },
        {
            "key": "embedding",
            "requests": 1,
            "prompt_tokens": 1000,
            "cached_tokens": 0,
            "completion_tokens": 50,
            "reasoning_tokens": 5,
            "cost_usd": "0.000000007",
            "cache_write_tokens": 0,
        },
        {
            "key": "extraction",
            "requests": 1,
            "prompt_tokens": 100,
            "cached_tokens": 10,
            "completion_tokens": 50,
            "reasoning_tokens": 0,
            "cost_usd": "0.25",
            "cache_write_tokens": 0,
        },
    ]
    assert printed["total"]["cost_usd"] == "1.750000106"
    result = svcctl(migratedDSN, "usage", "--org", org, *span, "--format", "csv")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.splitlines() == [
        "key,requests,prompt_tokens,cached_tokens,completion_tokens,reasoning_tokens,cost_usd,"
        "cache_write_tokens",
        "chat,2,200,20,100,10,1.500000099,37",
        "embedding,1,1000,0,50,5,0.000000007,0",
        "extraction,1,100,10,50,0,0.25,0",
    ]
    ofAgent = document(
        svcctl(migratedDSN, "usage", "--org", org, "--agent", str(secondAgent), *span)
    )
    assert [(each["key"], each["requests"]) for each in ofAgent["rows"]] == [("extraction", 1)]


@pytest.mark.parametrize(
    "arguments, mentions, code",
    [
        (("--since", "yesterday"), "--since", 2),
        (("--until", "2025-13-01"), "--until", 2),
        (("--until", "2025-06-01T00:00:00"), "--until", 2),
        (("--since", "2025-07-01", "--until", "2025-06-01"), "must come before", 2),
        (("--by", "week"), "invalid choice", 2),
        (("--format", "xml"), "invalid choice", 2),
    ],
)
def test_svcctlUsageErrorsAreOneLine(
    migratedDSN: str, owner: Store, arguments: tuple[str, ...], mentions: str, code: int
) -> None:
    """
    Bad dates, spans and choices are one line on stderr and exit 2, never
    a traceback; an unknown organization is one line too.
    """
    tenant = makeTenant(owner)
    result = svcctl(migratedDSN, "usage", "--org", str(tenant.orgID), *arguments)
    assert mentions in failure(result)
    assert result.returncode == code
    unknown = svcctl(migratedDSN, "usage", "--org", str(uuid.uuid4()))
    assert "no organization" in failure(unknown)


# The pure rules.


def test_parseMoment() -> None:
    """
    A date is midnight UTC; an RFC 3339 time needs its offset and is
    turned to UTC; anything else is refused naming the field.
    """
    assert parseMoment("2025-06-01", "since") == JUNE
    assert parseMoment("2025-06-01T00:00:00Z", "since") == JUNE
    assert parseMoment("2025-06-01t02:00:00.5+02:00", "since") == JUNE + datetime.timedelta(
        microseconds=500_000
    )
    for bad in (
        "2025-6-1",
        "2025-06-01T00:00:00",
        "2025-02-30",
        "now",
        "",
        "20250601",
        # Digits of other scripts (decisions D12 amended: ASCII only).
        "\uff12\uff10\uff12\uff15-06-01",
        "2025-06-01T0\uff10:00:00Z",
        "\u0662\u0660\u0662\u0665-06-01T00:00:00Z",
    ):
        with pytest.raises(BadUsage, match="since"):
            parseMoment(bad, "since")


def test_reportSpanDefaultsToTheCurrentMonth() -> None:
    """
    Without bounds, the span is the current UTC month, December included.
    """
    december = datetime.datetime(2025, 12, 31, 23, 59, tzinfo=UTC)
    assert reportSpan(None, None, december) == (
        datetime.datetime(2025, 12, 1, tzinfo=UTC),
        datetime.datetime(2026, 1, 1, tzinfo=UTC),
    )
    with pytest.raises(BadUsage, match="must come before"):
        reportSpan("2026-01-01", None, december)


def test_costsAreExactDollars() -> None:
    """
    cost_usd is exact to the nano-dollar, with no exponent, whatever the
    size of the sum.
    """
    huge = UsageSums("m", 1, 0, 0, 0, 0, 123_456_789_012_345_678_901)
    tiny = UsageSums("n", 1, 0, 0, 0, 0, 1)
    lines = list(csv.DictReader(io.StringIO(reportCSV([huge, tiny]))))
    assert lines[0]["cost_usd"] == "123456789012.345678901"
    assert lines[1]["cost_usd"] == "0.000000001"


def test_checkBatchChecksEachRow() -> None:
    """
    A batch past the bound is refused before any row is read; otherwise
    each row is checked on its own, the bad ones listed by index with the
    field at fault. A row's start becomes an aware UTC time to the
    microsecond; its ledger id is its key, and without one (an older
    proxy) its request id is, as a UUID. Without a kind it is chat, and
    without a parent request id it has none (None).
    """
    tenant = Tenant(uuid.uuid4(), uuid.uuid4(), "", uuid.uuid4())
    with pytest.raises(BadUsage, match="at most"):
        checkBatch([usageRow(tenant)] * (MAXIMUM_USAGE_BATCH + 1))
    good = usageRow(tenant, started_at_us=microseconds(JUNE) + 1, agent_id="", token_id="")
    bad = usageRow(tenant, outcome="fine", ledger_id="x" * 100)
    checked = checkBatch([bad, good, bad])
    assert checked.indices == [1]
    assert [(each.index, each.reason, each.ledgerID) for each in checked.invalid] == [
        (0, "invalid", repr("x" * 40)),
        (2, "invalid", repr("x" * 40)),
    ]
    (converted,) = checked.records
    assert converted.startedAt == JUNE + datetime.timedelta(microseconds=1)
    assert (converted.agentID, converted.tokenID) == (None, None)
    assert converted.ledgerID == good.ledger_id
    upper = usageRow(tenant, org_id=str(tenant.orgID).upper())
    assert usageRecord(upper).orgID == tenant.orgID
    requestID = str(uuid.uuid4())
    older = usageRow(tenant, ledger_id="", request_id=requestID.upper())
    assert usageRecord(older).ledgerID == requestID
    assert (converted.kind, converted.parentRequestID) == ("chat", None)
    recall = usageRow(tenant, kind="embedding", parent_request_id="parent-1")
    assert (usageRecord(recall).kind, usageRecord(recall).parentRequestID) == (
        "embedding",
        "parent-1",
    )


def test_svcAuthKnowsTheKindsTheProxyWrites() -> None:
    """
    svc-auth keeps its own list of kinds (it imports nothing of the
    proxy's ledger side), and it is the proxy's, in the same order; chat
    first, the default of both.
    """
    assert KINDS == proxyRows.KINDS
    assert KINDS[0] == proxyRows.CHAT
