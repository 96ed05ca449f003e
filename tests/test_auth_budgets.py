"""
Budgets in svc-auth (decisions D12, sql/0006_usage.sql, svcd/auth/limits.py):
svcctl budget set|show|clear, validation answers carrying the
organization's and the agent's budget as they are now, and the change
feed's budget_changed messages at the start of a stream and within one
second of a change; against a real grpcio server and a real PostgreSQL,
as the limits tests do.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from authfixtures import makeTenant
from authhelpers import FeedReader, document, failure, svcctl, validateAgent, validateToken
from authservice import RunningAuthService
from waiting import waitUntil

from svcd.auth.limits import BudgetsTable, budgetChange, budgetMessage
from svcd.auth.store import Store
from svcd.auth.store.budgets import BudgetRecord
from svcd.pb.auth.v1 import auth_pb2


def orgBudget(service: RunningAuthService, tenant: Any) -> auth_pb2.Budget | None:
    answer = validateToken(service, tenant)
    return answer.org_budget if answer.HasField("org_budget") else None


def agentBudget(service: RunningAuthService, tenant: Any) -> auth_pb2.Budget | None:
    answer = validateAgent(service, tenant)
    return answer.agent_budget if answer.HasField("agent_budget") else None


def printedBudget(printed: dict[str, Any]) -> auth_pb2.Budget:
    return auth_pb2.Budget(
        nano_usd=printed["nano_usd"], period=printed["period"], version=printed["version"]
    )


def test_svcctlBudgetSetShowClear(migratedDSN: str, owner: Store) -> None:
    """
    set prints the budget (exact dollars and nano-dollars, the period, a
    new version each time); show prints it; clear removes it and says
    whether there was one; the organization's and the agent's are apart.
    """
    tenant = makeTenant(owner)
    org, agent = str(tenant.orgID), str(tenant.agentID)
    first = document(
        svcctl(migratedDSN, "budget", "set", "--org", org, "--usd", "250", "--period", "month")
    )
    assert first == {
        "org_id": org,
        "agent_id": None,
        "usd": "250.00",
        "nano_usd": 250 * 10**9,
        "period": "month",
        "version": first["version"],
    }
    changed = document(
        svcctl(
            migratedDSN, "budget", "set", "--org", org, "--usd", "0.000000001", "--period", "day"
        )
    )
    assert (changed["usd"], changed["nano_usd"], changed["period"]) == ("0.000000001", 1, "day")
    assert changed["version"] > first["version"]
    agentRow = document(
        svcctl(
            migratedDSN,
            "budget",
            "set",
            "--org",
            org,
            "--agent",
            agent,
            "--usd",
            "12.345",
            "--period",
            "day",
        )
    )
    assert (agentRow["agent_id"], agentRow["nano_usd"]) == (agent, 12_345_000_000)
    assert document(svcctl(migratedDSN, "budget", "show", "--org", org)) == changed
    assert owner.budget(tenant.orgID, tenant.agentID) == BudgetRecord(
        tenant.orgID, tenant.agentID, 12_345_000_000, "day", agentRow["version"]
    )

    cleared = document(svcctl(migratedDSN, "budget", "clear", "--org", org, "--agent", agent))
    assert cleared == {**agentRow, "cleared": True}
    assert document(svcctl(migratedDSN, "budget", "show", "--org", org, "--agent", agent)) == {
        "org_id": org,
        "agent_id": agent,
        "usd": None,
        "nano_usd": None,
        "period": None,
        "version": None,
    }
    again = document(svcctl(migratedDSN, "budget", "clear", "--org", org, "--agent", agent))
    assert again["cleared"] is False
    assert document(svcctl(migratedDSN, "budget", "show", "--org", org)) == changed


@pytest.mark.parametrize(
    "arguments, mentions, code",
    [
        (("--usd", "ten", "--period", "day"), "--usd", 2),
        (("--usd", "1e3", "--period", "day"), "--usd", 2),
        (("--usd", "-5", "--period", "day"), "--usd", 2),
        (("--usd", "0", "--period", "day"), "more than zero", 2),
        (("--usd", "0.0000000001", "--period", "day"), "--usd", 2),
        (("--usd", "9000000.000000001", "--period", "day"), "at most", 2),
        # Amounts of money are ASCII decimals (decisions D12, amended):
        # fullwidth and Arabic-Indic "20" would be read as 20 dollars.
        (("--usd", "\uff12\uff10", "--period", "day"), "decimal string", 2),
        (("--usd", "\u0662\u0660", "--period", "day"), "decimal string", 2),
        (("--usd", "1_000", "--period", "day"), "decimal string", 2),
        (("--usd", "5", "--period", "week"), "invalid choice", 2),
        (
            (
                "--usd",
                "5",
            ),
            "--period",
            2,
        ),
    ],
)
def test_svcctlBudgetRefusesBadAmounts(
    migratedDSN: str, owner: Store, arguments: tuple[str, ...], mentions: str, code: int
) -> None:
    """
    An amount that is not exact decimal dollars above zero, or a period
    other than day and month, is one line on stderr and exit 2; nothing is
    stored.
    """
    tenant = makeTenant(owner)
    result = svcctl(migratedDSN, "budget", "set", "--org", str(tenant.orgID), *arguments)
    assert mentions in failure(result)
    assert result.returncode == code
    assert owner.budget(tenant.orgID) is None


def test_svcctlBudgetRefusesUnknownOrganizationsAndOtherAgents(
    migratedDSN: str, owner: Store
) -> None:
    """
    An unknown organization, or an agent of another organization, is one
    line on stderr, for set, show and clear alike.
    """
    tenant, other = makeTenant(owner, "a"), makeTenant(owner, "b")
    amount = ("--usd", "5", "--period", "day")
    for action, extra in (("set", amount), ("show", ()), ("clear", ())):
        unknown = svcctl(migratedDSN, "budget", action, "--org", str(uuid.uuid4()), *extra)
        assert "no organization" in failure(unknown)
        foreign = svcctl(
            migratedDSN,
            "budget",
            action,
            "--org",
            str(tenant.orgID),
            "--agent",
            str(other.agentID),
            *extra,
        )
        assert "no agent" in failure(foreign)
    assert owner.budget(tenant.orgID, other.agentID) is None


def test_answersCarryBudgetsChangedWithinOneSecond(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    ValidateToken carries the organization's budget and ValidateAgent the
    agent's, as svcctl set, changed and cleared them, within one second,
    although the token and agent are answered from the validation cache
    meanwhile.
    """
    tenant = makeTenant(owner)
    org, agent = str(tenant.orgID), str(tenant.agentID)
    assert orgBudget(authService, tenant) is None
    assert agentBudget(authService, tenant) is None
    steps = [
        (("--org", org, "--usd", "100", "--period", "month"), orgBudget),
        (("--org", org, "--usd", "5.5", "--period", "day"), orgBudget),
        (("--org", org, "--agent", agent, "--usd", "1", "--period", "day"), agentBudget),
    ]
    for arguments, answered in steps:
        expected = printedBudget(document(svcctl(migratedDSN, "budget", "set", *arguments)))
        waitUntil(lambda: answered(authService, tenant) == expected, limit=1.0)  # noqa: B023
    org5 = orgBudget(authService, tenant)
    assert org5 is not None and (org5.nano_usd, org5.period) == (5_500_000_000, "day")
    document(svcctl(migratedDSN, "budget", "clear", "--org", org, "--agent", agent))
    waitUntil(lambda: agentBudget(authService, tenant) is None, limit=1.0)
    assert orgBudget(authService, tenant) is not None
    document(svcctl(migratedDSN, "budget", "clear", "--org", org))
    waitUntil(lambda: orgBudget(authService, tenant) is None, limit=1.0)


def test_withoutTheListenerBudgetsAreReadFromTheDatabase(migratedDSN: str, owner: Store) -> None:
    """
    With no change listener, answers carry budgets read from the database,
    each kept at most one second.
    """
    service = RunningAuthService(migratedDSN, listen=False).start()
    try:
        tenant = makeTenant(owner)
        assert orgBudget(service, tenant) is None
        row = owner.setBudget(tenant.orgID, None, 7, "day")
        waitUntil(lambda: orgBudget(service, tenant) == budgetMessage(row), limit=1.5)
        agentRow = owner.setBudget(tenant.orgID, tenant.agentID, 9, "month")
        waitUntil(lambda: agentBudget(service, tenant) == budgetMessage(agentRow), limit=1.5)
    finally:
        service.stop()


def test_theFeedSendsEveryBudgetAtTheStartAndEachChangeWithinOneSecond(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    A stream starts with every budget of every organization, after the
    token ids and before snapshot_complete; then each set, change and
    clear made with svcctl arrives as a budget_changed within one second
    (a clear without a budget).
    """
    first, second = makeTenant(owner, "a"), makeTenant(owner, "b")
    rows = [
        owner.setBudget(first.orgID, None, 10**9, "month"),
        owner.setBudget(second.orgID, second.agentID, 42, "day"),
    ]
    waitUntil(lambda: len(authService.budgets.rows()) == 2, limit=1.0)
    feed = FeedReader(authService)
    try:
        kinds: list[str] = []
        budgets: dict[tuple[bytes, bytes], auth_pb2.Budget] = {}
        while True:
            change = feed.next()
            assert isinstance(change, auth_pb2.Change), change
            kind = change.WhichOneof("kind")
            assert kind is not None
            kinds.append(kind)
            if kind == "snapshot_complete":
                break
            if kind == "budget_changed":
                budgets[(change.budget_changed.org_id, change.budget_changed.agent_id)] = (
                    change.budget_changed.budget
                )
        assert kinds[0] == "known_token_ids" and kinds[-3:] == ["budget_changed"] * 2 + [
            "snapshot_complete"
        ]
        assert budgets == {
            (first.orgID.bytes, b""): budgetMessage(rows[0]),
            (second.orgID.bytes, second.agentID.bytes): budgetMessage(rows[1]),
        }

        org, agent = str(first.orgID), str(first.agentID)
        for action, arguments in (
            ("set", ("--org", org, "--agent", agent, "--usd", "3", "--period", "day")),
            ("set", ("--org", org, "--usd", "4", "--period", "day")),
            ("clear", ("--org", org, "--agent", agent)),
        ):
            printed = document(svcctl(migratedDSN, "budget", action, *arguments))
            agentID = uuid.UUID(printed["agent_id"]) if printed["agent_id"] else None
            expected = budgetChange(
                first.orgID,
                agentID,
                None
                if action == "clear"
                else BudgetRecord(
                    first.orgID,
                    agentID,
                    printed["nano_usd"],
                    printed["period"],
                    printed["version"],
                ),
            ).budget_changed
            feed.waitFor("budget_changed", expected, limit=1.0)
    finally:
        feed.close()


def test_theBudgetsTableIsLoadedAgainWhenTheListenerComesBack(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    Budgets changed while the listener was not listening are in the table
    once it listens again.
    """
    tenant = makeTenant(owner)
    kept = owner.setBudget(tenant.orgID, None, 1, "day")
    waitUntil(lambda: kept in authService.budgets.rows(), limit=1.0)
    authService.listener.stop()
    assert not authService.budgets.isCurrent()
    changed = owner.setBudget(tenant.orgID, None, 2, "month")
    added = owner.setBudget(tenant.orgID, tenant.agentID, 3, "day")
    authService.listener.start()
    waitUntil(authService.budgets.isCurrent, limit=10.0)
    assert sorted(authService.budgets.rows(), key=lambda row: row.version) == [changed, added]


def test_budgetMessages() -> None:
    """
    A budget's message carries nano-dollars, period and version; the
    feed's message names the organization and agent by their 16 bytes,
    the agent empty for the organization's own, and no budget once
    cleared.
    """
    org, agent = uuid.uuid4(), uuid.uuid4()
    row = BudgetRecord(org, agent, 5, "day", 3)
    assert budgetMessage(row) == auth_pb2.Budget(nano_usd=5, period="day", version=3)
    change = budgetChange(org, agent, row).budget_changed
    assert (change.org_id, change.agent_id, change.budget) == (
        org.bytes,
        agent.bytes,
        budgetMessage(row),
    )
    cleared = budgetChange(org, None, None).budget_changed
    assert cleared.agent_id == b"" and not cleared.HasField("budget")
    table = BudgetsTable(lambda: 0.0)
    table.replace([row])
    assert table.lookup(org, agent) == (True, row)
    assert table.lookup(org, None) == (True, None)
