"""
Limits in svc-auth (decisions D11, svcd/auth/limits.py): validation answers
carry the organization's and the agent's rows as they are now, a change
made with svcctl shows in them within one second (the validation cache
never freezes them), and without its change listener svc-auth reads the
rows from the database instead; against a real grpcio server and a real
PostgreSQL. The table's own rules are unit-tested below.
"""

from __future__ import annotations

import time
import uuid

from authfixtures import Tenant, makeTenant
from authhelpers import document, svcctl, validateAgent, validateToken
from authservice import RunningAuthService
from waiting import waitUntil

from svcd.auth.limits import LimitsTable, limitsChange, limitsMessage
from svcd.auth.store import Store
from svcd.auth.store.limits import LimitsRecord
from svcd.pb.auth.v1 import auth_pb2


def orgLimits(service: RunningAuthService, tenant: Tenant) -> auth_pb2.Limits | None:
    answer = validateToken(service, tenant)
    return answer.org_limits if answer.HasField("org_limits") else None


def agentLimits(service: RunningAuthService, tenant: Tenant) -> auth_pb2.Limits | None:
    answer = validateAgent(service, tenant)
    return answer.agent_limits if answer.HasField("agent_limits") else None


def expected(printed: dict[str, object]) -> auth_pb2.Limits:
    """
    The Limits message of a row as svcctl printed it.
    """
    message = auth_pb2.Limits()
    message.version = int(str(printed["version"]))
    for field in ("rpm", "tpm", "max_output_tokens"):
        if printed[field] is not None:
            setattr(message, field, printed[field])
    return message


def test_answersCarryTheRowsOfTheOrganizationAndTheAgent(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    Without rows, answers carry no limits. ValidateToken carries the
    organization's row and ValidateAgent the agent's (never the other),
    unset values absent and the version set.
    """
    tenant = makeTenant(owner)
    assert orgLimits(authService, tenant) is None
    assert agentLimits(authService, tenant) is None

    org = owner.setLimits(tenant.orgID, None, {"rpm": 60, "max_output_tokens": 1024})
    agent = owner.setLimits(tenant.orgID, tenant.agentID, {"tpm": 5000})
    waitUntil(lambda: orgLimits(authService, tenant) is not None, limit=1.0)
    waitUntil(lambda: agentLimits(authService, tenant) is not None, limit=1.0)

    fromToken = orgLimits(authService, tenant)
    assert fromToken == auth_pb2.Limits(rpm=60, max_output_tokens=1024, version=org.version)
    assert fromToken is not None and not fromToken.HasField("tpm")
    fromAgent = agentLimits(authService, tenant)
    assert fromAgent == auth_pb2.Limits(tpm=5000, version=agent.version)
    assert fromAgent is not None and not fromAgent.HasField("rpm")


def test_aChangeMadeWithSvcctlShowsInAnswersWithinOneSecond(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    Rows set, changed and cleared with svcctl show in the answers within
    one second, although the token and the agent are answered from
    svc-auth's validation cache meanwhile: limits are taken from the table
    of limits at answer time, never from a cached validation.
    """
    tenant = makeTenant(owner)
    org, agent = str(tenant.orgID), str(tenant.agentID)
    validateToken(authService, tenant)
    validateAgent(authService, tenant)

    steps = [
        (("set", "--org", org, "--rpm", "30"), orgLimits),
        (("set", "--org", org, "--rpm", "none", "--tpm", "900"), orgLimits),
        (("set", "--org", org, "--agent", agent, "--max-output-tokens", "77"), agentLimits),
        (("set", "--org", org, "--agent", agent, "--rpm", "3"), agentLimits),
    ]
    rows = []
    for arguments, answered in steps:
        row = expected(document(svcctl(migratedDSN, "limits", *arguments)))
        waitUntil(lambda: answered(authService, tenant) == row, limit=1.0)  # noqa: B023
        rows.append(row)
    assert rows[1] == auth_pb2.Limits(tpm=900, version=rows[1].version)
    assert rows[3] == auth_pb2.Limits(rpm=3, max_output_tokens=77, version=rows[3].version)

    document(svcctl(migratedDSN, "limits", "clear", "--org", org, "--agent", agent))
    waitUntil(lambda: agentLimits(authService, tenant) is None, limit=1.0)
    assert orgLimits(authService, tenant) == rows[1]
    document(svcctl(migratedDSN, "limits", "clear", "--org", org))
    waitUntil(lambda: orgLimits(authService, tenant) is None, limit=1.0)


def test_withoutTheListenerRowsAreReadAndLiveAtMostOneSecond(
    migratedDSN: str, owner: Store
) -> None:
    """
    With no change listener (its connection lost), the table vouches for
    nothing: answers carry rows read from the database, each kept at most
    one second, so a change still shows within a second.
    """
    service = RunningAuthService(migratedDSN, listen=False).start()
    try:
        tenant = makeTenant(owner)
        assert orgLimits(service, tenant) is None
        row = owner.setLimits(tenant.orgID, None, {"rpm": 11})
        waitUntil(
            lambda: orgLimits(service, tenant) == auth_pb2.Limits(rpm=11, version=row.version),
            limit=1.5,
        )
        agentRow = owner.setLimits(tenant.orgID, tenant.agentID, {"rpm": 2})
        waitUntil(
            lambda: (
                agentLimits(service, tenant) == auth_pb2.Limits(rpm=2, version=agentRow.version)
            ),
            limit=1.5,
        )
        owner.clearLimits(tenant.orgID)
        waitUntil(lambda: orgLimits(service, tenant) is None, limit=1.5)
    finally:
        service.stop()


def test_theTableIsLoadedAgainWhenTheListenerComesBack(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    Changes made while the listener was not listening (so never announced
    to it) are in the table once it listens again: it loads the whole
    table each time it starts.
    """
    tenant = makeTenant(owner)
    kept = owner.setLimits(tenant.orgID, None, {"rpm": 1})
    waitUntil(lambda: kept in authService.limits.rows(), limit=1.0)
    authService.listener.stop()
    assert not authService.limits.isCurrent()
    changed = owner.setLimits(tenant.orgID, None, {"rpm": 2})
    added = owner.setLimits(tenant.orgID, tenant.agentID, {"tpm": 3})
    authService.listener.start()
    waitUntil(authService.limits.isCurrent, limit=10.0)
    assert sorted(authService.limits.rows(), key=lambda row: row.version) == [changed, added]


# The table alone.


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def row(orgID: uuid.UUID, agentID: uuid.UUID | None = None, version: int = 1) -> LimitsRecord:
    return LimitsRecord(orgID, agentID, rpm=10, tpm=None, maxOutputTokens=None, version=version)


def test_aCurrentTableAnswersEveryLookup() -> None:
    """
    Loaded, the table answers for every row, present or not, and keeps up
    with puts and clears.
    """
    table = LimitsTable(FakeMonotonic())
    org, agent = uuid.uuid4(), uuid.uuid4()
    assert table.lookup(org, None) == (False, None)
    table.replace([row(org)])
    assert table.isCurrent()
    assert table.lookup(org, None) == (True, row(org))
    assert table.lookup(org, agent) == (True, None)
    table.put(org, agent, row(org, agent, 2))
    assert table.lookup(org, agent) == (True, row(org, agent, 2))
    table.put(org, None, None)
    assert table.lookup(org, None) == (True, None)
    assert table.rows() == [row(org, agent, 2)]


def test_rowsReadWhileNotCurrentLiveAtMostTheTTL() -> None:
    """
    Not current, the table answers only with rows remembered less than
    untrustedTTL ago (measured from when their read began); loading it
    again makes it current and forgets them; a row remembered while
    current is not kept.
    """
    clock = FakeMonotonic()
    table = LimitsTable(clock, untrustedTTL=1.0, maximumRemembered=2)
    org = uuid.uuid4()
    readAt = table.now()
    clock.now += 0.5
    table.remember(org, None, row(org), readAt)
    assert table.lookup(org, None) == (True, row(org))
    clock.now += 0.5
    assert table.lookup(org, None) == (False, None)

    table.remember(org, None, None, table.now())
    assert table.lookup(org, None) == (True, None)
    others = [uuid.uuid4(), uuid.uuid4()]
    for other in others:
        table.remember(other, None, row(other), table.now())
    assert table.lookup(org, None) == (False, None)

    table.replace([])
    table.remember(org, None, row(org), table.now())
    table.notCurrent()
    assert table.lookup(org, None) == (False, None)
    assert table.lookup(others[0], None) == (False, None)


def test_messagesLeaveUnsetValuesAbsent() -> None:
    """
    A row's message has only the values set, and its version; the feed's
    message names the organization and agent by their 16 bytes, the agent
    empty for the organization's row, and has no limits for a cleared row.
    """
    org, agent = uuid.uuid4(), uuid.uuid4()
    full = LimitsRecord(org, agent, rpm=1, tpm=2, maxOutputTokens=3, version=9)
    assert limitsMessage(full) == auth_pb2.Limits(rpm=1, tpm=2, max_output_tokens=3, version=9)
    bare = limitsMessage(LimitsRecord(org, None, None, None, None, version=4))
    assert [field.name for field, _ in bare.ListFields()] == ["version"]

    change = limitsChange(org, agent, full).limits_changed
    assert (change.org_id, change.agent_id) == (org.bytes, agent.bytes)
    assert change.limits == limitsMessage(full)
    cleared = limitsChange(org, None, None).limits_changed
    assert cleared.agent_id == b"" and not cleared.HasField("limits")


def test_rowsIsACopy() -> None:
    """
    What rows() returned does not change with the table.
    """
    table = LimitsTable(time.monotonic)
    org = uuid.uuid4()
    table.replace([row(org)])
    copy = table.rows()
    table.put(org, None, None)
    assert copy == [row(org)]
