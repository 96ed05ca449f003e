"""
Memory settings in svc-auth (decisions D13, "Settings";
sql/0010_memory_settings.sql, svcd/auth/limits.py): svcctl memory
settings, the table's rules and row-level security, validation answers
carrying the organization's and the agent's settings as they are now, and
the change feed's memory_settings_changed messages at the start of a
stream and within one second of a change; against a real grpcio server
and a real PostgreSQL, as the budgets tests do.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import psycopg
import pytest
from authfixtures import makeTenant, ownerStore
from authhelpers import FeedReader, document, failure, svcctl, validateAgent, validateToken
from authservice import RunningAuthService
from waiting import waitUntil

from svcd.auth.limits import MemorySettingsTable, memorySettingsChange, memorySettingsMessage
from svcd.auth.store import Store
from svcd.auth.store.base import APPLICATION_ROLE
from svcd.auth.store.memorysettings import MemorySettingsRecord
from svcd.common.migrations import migrate
from svcd.common.pgtransactions import StoreRejected
from svcd.pb.auth.v1 import auth_pb2

_SWITCHES = {"on": True, "off": False, "inherit": None}
# --observe's values as the store holds them (decisions D13 amended).
_OBSERVE = {"on": "on", "all": "all", "off": "off", "inherit": None}


def orgSettings(service: RunningAuthService, tenant: Any) -> auth_pb2.MemorySettings | None:
    answer = validateToken(service, tenant)
    return answer.org_memory_settings if answer.HasField("org_memory_settings") else None


def agentSettings(service: RunningAuthService, tenant: Any) -> auth_pb2.MemorySettings | None:
    answer = validateAgent(service, tenant)
    return answer.agent_memory_settings if answer.HasField("agent_memory_settings") else None


def recordOf(printed: dict[str, Any]) -> MemorySettingsRecord:
    """
    The row svcctl printed, as the store holds it.
    """
    return MemorySettingsRecord(
        uuid.UUID(printed["org_id"]),
        uuid.UUID(printed["agent_id"]) if printed["agent_id"] else None,
        _SWITCHES[printed["recall"]],
        _OBSERVE[printed["observe"]],
        printed["version"],
    )


def settings(dsn: str, *arguments: str) -> Any:
    return document(svcctl(dsn, "memory", "settings", *arguments))


def test_svcctlMemorySettings(migratedDSN: str, owner: Store) -> None:
    """
    Without a row, svcctl prints both settings as inherit and no version;
    each flag given changes only its own setting (the other stays as it
    was), every change takes a larger version, inherit is stored as NULL,
    a command with no flag only prints, and the organization's row and
    its agent's are apart.
    """
    tenant = makeTenant(owner)
    org, agent = str(tenant.orgID), str(tenant.agentID)
    assert settings(migratedDSN, "--org", org) == {
        "org_id": org,
        "agent_id": None,
        "recall": "inherit",
        "observe": "inherit",
        "version": None,
    }
    assert owner.memorySettings(tenant.orgID) is None

    first = settings(migratedDSN, "--org", org, "--recall", "on")
    assert first == {
        "org_id": org,
        "agent_id": None,
        "recall": "on",
        "observe": "inherit",
        "version": first["version"],
    }
    assert isinstance(first["version"], int)
    second = settings(migratedDSN, "--org", org, "--observe", "off")
    assert (second["recall"], second["observe"]) == ("on", "off")
    assert second["version"] > first["version"]
    # Case and spaces do not matter; the row is as printed.
    third = settings(migratedDSN, "--org", org, "--recall", " OFF ", "--observe", "On")
    assert (third["recall"], third["observe"]) == ("off", "on")
    assert owner.memorySettings(tenant.orgID) == recordOf(third)
    assert settings(migratedDSN, "--org", org) == third

    agentRow = settings(migratedDSN, "--org", org, "--agent", agent, "--recall", "on")
    assert agentRow == {
        "org_id": org,
        "agent_id": agent,
        "recall": "on",
        "observe": "inherit",
        "version": agentRow["version"],
    }
    assert agentRow["version"] > third["version"]
    assert owner.memorySettings(tenant.orgID, tenant.agentID) == recordOf(agentRow)

    cleared = settings(migratedDSN, "--org", org, "--recall", "inherit", "--observe", "inherit")
    assert (cleared["recall"], cleared["observe"]) == ("inherit", "inherit")
    assert cleared["version"] > agentRow["version"]
    stored = owner.memorySettings(tenant.orgID)
    assert stored is not None and (stored.recall, stored.observe) == (None, None)
    assert settings(migratedDSN, "--org", org, "--agent", agent) == agentRow


@pytest.mark.parametrize(
    "arguments, mentions",
    [
        (("--recall", "yes"), "--recall"),
        (("--observe", "true"), "--observe"),
        (("--observe", "everyone"), "--observe"),
        (("--recall", "all"), "--recall"),
        (("--recall", ""), "--recall"),
        (("--observe", "1"), "--observe"),
        (("--remember", "on"), "unrecognized"),
    ],
)
def test_svcctlMemorySettingsRefusesOtherValues(
    migratedDSN: str, owner: Store, arguments: tuple[str, ...], mentions: str
) -> None:
    """
    A value other than on, off and inherit (and all, for --observe only)
    is one line on stderr naming the flag, exit 2; nothing is stored.
    """
    tenant = makeTenant(owner)
    result = svcctl(migratedDSN, "memory", "settings", "--org", str(tenant.orgID), *arguments)
    assert mentions in failure(result)
    assert result.returncode == 2
    assert owner.memorySettings(tenant.orgID) is None


def test_svcctlMemorySettingsRefusesUnknownOrganizationsAndOtherAgents(
    migratedDSN: str, owner: Store
) -> None:
    """
    An unknown organization, or an agent of another organization, is one
    line on stderr and exit 1, whether setting or printing, in the words
    of the budget commands; nothing is stored.
    """
    tenant, other = makeTenant(owner, "a"), makeTenant(owner, "b")
    for extra in (("--recall", "on"), ()):
        unknown = svcctl(migratedDSN, "memory", "settings", "--org", str(uuid.uuid4()), *extra)
        assert failure(unknown).startswith("svcctl: error: no organization ")
        assert unknown.returncode == 1
        foreign = svcctl(
            migratedDSN,
            "memory",
            "settings",
            "--org",
            str(tenant.orgID),
            "--agent",
            str(other.agentID),
            *extra,
        )
        assert failure(foreign) == (
            f"svcctl: error: no agent {other.agentID} in organization {tenant.orgID}"
        )
        assert foreign.returncode == 1
    assert owner.memorySettings(tenant.orgID, other.agentID) is None
    assert owner.memorySettings(other.orgID, other.agentID) is None


def test_theTableKeepsItsRules(migratedDSN: str, owner: Store) -> None:
    """
    Whoever writes: one row per organization and per agent, an agent only
    with its own organization (StoreRejected through the store), and a new,
    larger version on every insert and update, even one that sets its own.
    """
    tenantA, tenantB = makeTenant(owner, "a"), makeTenant(owner, "b")
    with pytest.raises(StoreRejected):
        owner.setMemorySettings(tenantA.orgID, tenantB.agentID, {"recall": True})
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        connection.execute("INSERT INTO memory_settings (org_id) VALUES (%s)", (tenantA.orgID,))
        with pytest.raises(psycopg.errors.UniqueViolation):
            connection.execute("INSERT INTO memory_settings (org_id) VALUES (%s)", (tenantA.orgID,))
        connection.execute(
            "INSERT INTO memory_settings (org_id, agent_id) VALUES (%s, %s)",
            (tenantA.orgID, tenantA.agentID),
        )
        with pytest.raises(psycopg.errors.UniqueViolation):
            connection.execute(
                "INSERT INTO memory_settings (org_id, agent_id) VALUES (%s, %s)",
                (tenantA.orgID, tenantA.agentID),
            )
        before = owner.memorySettings(tenantA.orgID)
        assert before is not None and (before.recall, before.observe) == (None, None)
        connection.execute(
            "UPDATE memory_settings SET recall = true, version = 1"
            " WHERE org_id = %s AND agent_id IS NULL",
            (tenantA.orgID,),
        )
    after = owner.memorySettings(tenantA.orgID)
    assert after is not None and after.recall is True and after.version > before.version
    unchanged = owner.setMemorySettings(tenantA.orgID, None, {})
    assert unchanged.recall is True and unchanged.version > after.version
    with pytest.raises(ValueError):
        owner.setMemorySettings(tenantA.orgID, None, {"version": True})


def test_anotherOrganizationsSettingsAreNeverVisible(migratedDSN: str, owner: Store) -> None:
    """
    Row-level security is enabled and forced on the table. In org A's
    context, svc_auth_app sees A's rows (its own and its agent's) and none
    of B's, asked by id or not at all, and cannot write any row (svcctl,
    the owner, writes them); the one function that reads every row gives
    ids, switches and versions only. The store, in B's context, finds B's
    row and never A's.
    """
    tenantA, tenantB = makeTenant(owner, "a"), makeTenant(owner, "b")
    owner.setMemorySettings(tenantA.orgID, None, {"recall": True})
    owner.setMemorySettings(tenantA.orgID, tenantA.agentID, {"observe": "on"})
    owner.setMemorySettings(tenantB.orgID, None, {"recall": False})
    owner.setMemorySettings(tenantB.orgID, tenantB.agentID, {"observe": "off"})
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        flags = connection.execute(
            "SELECT relrowsecurity, relforcerowsecurity FROM pg_class"
            " WHERE relname = 'memory_settings'"
        ).fetchone()
        assert flags == (True, True)
    with psycopg.connect(migratedDSN, autocommit=False) as connection:
        connection.execute(f"SET ROLE {APPLICATION_ROLE}")
        connection.execute("SELECT set_config('svc.org_id', %s, true)", (str(tenantA.orgID),))
        seen = connection.execute("SELECT org_id, agent_id FROM memory_settings").fetchall()
        assert sorted(seen, key=str) == sorted(
            [(tenantA.orgID, None), (tenantA.orgID, tenantA.agentID)], key=str
        )
        assert connection.execute(
            "SELECT count(*) FROM memory_settings WHERE org_id = %s OR agent_id = %s",
            (tenantB.orgID, tenantB.agentID),
        ).fetchone() == (0,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute(
                "UPDATE memory_settings SET recall = true WHERE org_id = %s", (tenantA.orgID,)
            )
    with psycopg.connect(migratedDSN, autocommit=False) as connection:
        connection.execute(f"SET ROLE {APPLICATION_ROLE}")
        connection.execute("SELECT set_config('svc.org_id', %s, true)", (str(tenantA.orgID),))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute(
                "INSERT INTO memory_settings (org_id, recall) VALUES (%s, true)",
                (tenantA.orgID,),
            )
    with psycopg.connect(migratedDSN, autocommit=False) as connection:
        connection.execute(f"SET ROLE {APPLICATION_ROLE}")
        # No organization's context at all: nothing.
        assert connection.execute("SELECT count(*) FROM memory_settings").fetchone() == (0,)
        everything = connection.execute("SELECT * FROM svc_memory_settings_rows()")
        columns = [column.name for column in everything.description or ()]
        assert columns == ["org_id", "agent_id", "recall", "observe", "version", "observe_mode"]
        assert len(everything.fetchall()) == 4

    # svc-auth's own store, acting as svc_auth_app in the context of the
    # organization it is asked about.
    with psycopg.connect(migratedDSN, autocommit=True) as connection:
        connection.execute(f"SET ROLE {APPLICATION_ROLE}")
        store = Store(lambda: contextlib.nullcontext(connection))
        ofB = store.memorySettings(tenantB.orgID)
        assert ofB is not None and ofB.recall is False
        assert store.memorySettings(tenantA.orgID, tenantA.agentID) is not None
        assert store.memorySettings(tenantA.orgID, tenantB.agentID) is None


def test_everyChangeIsAnnounced(migratedDSN: str, owner: Store) -> None:
    """
    Each insert, update and delete of a row is announced on
    svc_auth_changes as memory_settings:<org_id>:<agent_id or empty>.
    """
    tenant = makeTenant(owner)
    with psycopg.connect(migratedDSN, autocommit=True) as listening:
        listening.execute("LISTEN svc_auth_changes")
        owner.setMemorySettings(tenant.orgID, None, {"recall": True})
        owner.setMemorySettings(tenant.orgID, None, {"observe": None})
        owner.setMemorySettings(tenant.orgID, tenant.agentID, {"recall": False})
        with psycopg.connect(migratedDSN, autocommit=True) as writer:
            writer.execute("DELETE FROM memory_settings WHERE org_id = %s", (tenant.orgID,))
        payloads = [
            each.payload
            for each in listening.notifies(timeout=5.0, stop_after=5)
            if each.payload.startswith("memory_settings:")
        ]
    org = f"memory_settings:{tenant.orgID}:"
    agent = f"memory_settings:{tenant.orgID}:{tenant.agentID}"
    assert payloads[:3] == [org, org, agent]
    assert sorted(payloads[3:]) == sorted([org, agent])


def test_answersCarrySettingsChangedWithinOneSecond(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    ValidateToken carries the organization's settings and ValidateAgent
    the agent's, as svcctl set and changed them, within one second,
    although the token and agent are answered from the validation cache
    meanwhile; a switch that inherits is absent from the message.
    """
    tenant = makeTenant(owner)
    org, agent = str(tenant.orgID), str(tenant.agentID)
    assert orgSettings(authService, tenant) is None
    assert agentSettings(authService, tenant) is None
    steps = [
        (("--org", org, "--recall", "on"), orgSettings),
        (("--org", org, "--observe", "off"), orgSettings),
        (("--org", org, "--agent", agent, "--recall", "off"), agentSettings),
        (("--org", org, "--recall", "inherit"), orgSettings),
    ]
    for arguments, answered in steps:
        expected = memorySettingsMessage(recordOf(settings(migratedDSN, *arguments)))
        waitUntil(lambda: answered(authService, tenant) == expected, limit=1.0)  # noqa: B023
    ofOrg = orgSettings(authService, tenant)
    assert ofOrg is not None and not ofOrg.HasField("recall")
    assert ofOrg.HasField("observe") and ofOrg.observe is False and ofOrg.observe_mode == "off"
    ofAgent = agentSettings(authService, tenant)
    assert ofAgent is not None and ofAgent.HasField("recall") and ofAgent.recall is False
    assert not ofAgent.HasField("observe")


def test_withoutTheListenerSettingsAreReadFromTheDatabase(migratedDSN: str, owner: Store) -> None:
    """
    With no change listener, answers carry settings read from the
    database, each kept at most one second.
    """
    service = RunningAuthService(migratedDSN, listen=False).start()
    try:
        tenant = makeTenant(owner)
        assert orgSettings(service, tenant) is None
        row = owner.setMemorySettings(tenant.orgID, None, {"recall": True})
        waitUntil(lambda: orgSettings(service, tenant) == memorySettingsMessage(row), limit=1.5)
        agentRow = owner.setMemorySettings(tenant.orgID, tenant.agentID, {"observe": "all"})
        waitUntil(
            lambda: agentSettings(service, tenant) == memorySettingsMessage(agentRow), limit=1.5
        )
    finally:
        service.stop()


def test_theFeedSendsEveryRowAtTheStartAndEachChangeWithinOneSecond(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    A stream starts with every memory settings row of every organization,
    after the token ids and before snapshot_complete; then each change
    made with svcctl arrives as a memory_settings_changed within one
    second.
    """
    first, second = makeTenant(owner, "a"), makeTenant(owner, "b")
    rows = [
        owner.setMemorySettings(first.orgID, None, {"recall": True, "observe": "off"}),
        owner.setMemorySettings(second.orgID, second.agentID, {"observe": "all"}),
    ]
    waitUntil(lambda: len(authService.memorySettings.rows()) == 2, limit=1.0)
    feed = FeedReader(authService)
    try:
        feed.snapshot()
        assert feed.memorySettings == {
            (first.orgID.bytes, b""): memorySettingsMessage(rows[0]),
            (second.orgID.bytes, second.agentID.bytes): memorySettingsMessage(rows[1]),
        }
        org, agent = str(first.orgID), str(first.agentID)
        for arguments in (
            ("--org", org, "--agent", agent, "--recall", "on"),
            ("--org", org, "--observe", "inherit"),
            ("--org", org, "--agent", agent, "--recall", "inherit"),
        ):
            printed = settings(migratedDSN, *arguments)
            row = recordOf(printed)
            expected = memorySettingsChange(row.orgID, row.agentID, row).memory_settings_changed
            feed.waitFor("memory_settings_changed", expected, limit=1.0)
    finally:
        feed.close()


def test_theTableIsLoadedAgainWhenTheListenerComesBack(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    Settings changed while the listener was not listening are in the table
    once it listens again.
    """
    tenant = makeTenant(owner)
    kept = owner.setMemorySettings(tenant.orgID, None, {"recall": True})
    waitUntil(lambda: kept in authService.memorySettings.rows(), limit=1.0)
    authService.listener.stop()
    assert not authService.memorySettings.isCurrent()
    changed = owner.setMemorySettings(tenant.orgID, None, {"recall": False})
    added = owner.setMemorySettings(tenant.orgID, tenant.agentID, {"observe": "on"})
    authService.listener.start()
    waitUntil(authService.memorySettings.isCurrent, limit=10.0)
    assert sorted(authService.memorySettings.rows(), key=lambda row: row.version) == [
        changed,
        added,
    ]


def test_memorySettingsMessages() -> None:
    """
    A row's message carries the switches that are set and the version,
    a switch that inherits absent; the feed's message names the
    organization and agent by their 16 bytes, the agent empty for the
    organization's own, and no settings when there is no row.
    """
    org, agent = uuid.uuid4(), uuid.uuid4()
    row = MemorySettingsRecord(org, agent, True, None, 3)
    message = memorySettingsMessage(row)
    assert message == auth_pb2.MemorySettings(recall=True, version=3)
    assert message.HasField("recall") and not message.HasField("observe")
    off = memorySettingsMessage(MemorySettingsRecord(org, None, False, "off", 4))
    assert off.HasField("recall") and off.HasField("observe")
    assert (off.recall, off.observe, off.observe_mode) == (False, False, "off")
    change = memorySettingsChange(org, agent, row).memory_settings_changed
    assert (change.org_id, change.agent_id, change.settings) == (org.bytes, agent.bytes, message)
    none = memorySettingsChange(org, None, None).memory_settings_changed
    assert none.agent_id == b"" and not none.HasField("settings")
    table = MemorySettingsTable(lambda: 0.0)
    table.replace([row])
    assert table.lookup(org, agent) == (True, row)
    assert table.lookup(org, None) == (True, None)


# Decisions D13 amended, "Whose words": observe is on, all, off or inherit.


def storedSwitches(dsn: str, orgID: uuid.UUID) -> tuple[Any, Any]:
    """
    The organization's row as the table holds it: (observe_mode, observe).
    """
    with psycopg.connect(dsn, autocommit=True) as connection:
        row = connection.execute(
            "SELECT observe_mode, observe FROM memory_settings"
            " WHERE org_id = %s AND agent_id IS NULL",
            (orgID,),
        ).fetchone()
    assert row is not None
    return row[0], row[1]


def test_svcctlObserveTakesOnAllOffAndInherit(migratedDSN: str, owner: Store) -> None:
    """
    --observe takes on, all, off and inherit (any case), prints the value
    as given, and stores it as the mode, with the previous release's
    boolean beside it kept equal: true for on and all, false for off,
    NULL for inherit. The store takes the modes and refuses a boolean.
    """
    tenant = makeTenant(owner)
    org = str(tenant.orgID)
    for given, printed, switch in [
        ("on", "on", True),
        ("ALL", "all", True),
        (" off ", "off", False),
        ("all", "all", True),
        ("Inherit", "inherit", None),
    ]:
        row = settings(migratedDSN, "--org", org, "--observe", given)
        assert row["observe"] == printed
        assert settings(migratedDSN, "--org", org) == row
        assert owner.memorySettings(tenant.orgID) == recordOf(row)
        assert storedSwitches(migratedDSN, tenant.orgID) == (_OBSERVE[printed], switch)
    for wrong in (True, False, "ON", "everyone"):
        with pytest.raises(ValueError):
            owner.setMemorySettings(tenant.orgID, None, {"observe": wrong})
    with pytest.raises(ValueError):
        owner.setMemorySettings(tenant.orgID, None, {"recall": "on"})


def test_messagesCarryTheObserveMode() -> None:
    """
    A row's message carries the mode as observe_mode, and the switch
    observe true for on and all (what a proxy of the previous release
    reads), false for off; inherit, neither.
    """
    org = uuid.uuid4()
    for mode, switch in (("on", True), ("all", True), ("off", False)):
        message = memorySettingsMessage(MemorySettingsRecord(org, None, None, mode, 1))
        assert message.HasField("observe") and not message.HasField("recall")
        assert (message.observe_mode, message.observe) == (mode, switch)
    inherit = memorySettingsMessage(MemorySettingsRecord(org, None, True, None, 2))
    assert inherit.observe_mode == "" and not inherit.HasField("observe")


def test_answersAndTheFeedCarryTheObserveMode(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    ValidateToken's and ValidateAgent's answers and the change feed carry
    each mode set with svcctl, all included, within one second.
    """
    tenant = makeTenant(owner)
    org, agent = str(tenant.orgID), str(tenant.agentID)
    feed = FeedReader(authService)
    try:
        feed.snapshot()
        for arguments, answered, mode in [
            (("--org", org, "--observe", "all"), orgSettings, "all"),
            (("--org", org, "--agent", agent, "--observe", "on"), agentSettings, "on"),
            (("--org", org, "--observe", "off"), orgSettings, "off"),
            (("--org", org, "--agent", agent, "--observe", "all"), agentSettings, "all"),
        ]:
            row = recordOf(settings(migratedDSN, *arguments))
            expected = memorySettingsChange(row.orgID, row.agentID, row).memory_settings_changed
            assert expected.settings.observe_mode == mode
            assert expected.settings.observe is (mode != "off")
            feed.waitFor("memory_settings_changed", expected, limit=1.0)
            waitUntil(
                lambda: answered(authService, tenant) == expected.settings,  # noqa: B023
                limit=1.0,
            )
    finally:
        feed.close()


def test_theMigrationMakesOnOfTheSwitchAndKeepsBothInStep(databaseDSN: str) -> None:
    """
    sql/0016 on settings written before it: observe true becomes on (the
    new, stricter meaning), false off, NULL inherit. After it, what the
    previous release writes to the switch moves the mode (true on, false
    off, NULL inherit; true on a row already all keeps all), what this
    release writes to the mode moves the switch, and that release's read
    of every row still works; a mode other than on, all and off is
    refused.
    """
    assert migrate(databaseDSN, through="0015_observation_key.sql")[-1] == (
        "0015_observation_key.sql"
    )
    store, connection = ownerStore(databaseDSN)
    try:
        tenants = [makeTenant(store, name) for name in ("on", "off", "inherit")]
        for tenant, switch in zip(tenants, (True, False, None), strict=True):
            connection.execute(
                "INSERT INTO memory_settings (org_id, recall, observe) VALUES (%s, true, %s)",
                (tenant.orgID, switch),
            )
        assert migrate(databaseDSN)[0] == "0016_observe_modes.sql"
        wasOn, wasOff, wasInherit = tenants
        assert storedSwitches(databaseDSN, wasOn.orgID) == ("on", True)
        assert storedSwitches(databaseDSN, wasOff.orgID) == ("off", False)
        assert storedSwitches(databaseDSN, wasInherit.orgID) == (None, None)
        assert [store.memorySettings(each.orgID).observe for each in tenants] == [  # type: ignore[union-attr]
            "on",
            "off",
            None,
        ]

        def earlier(statement: str, orgID: uuid.UUID) -> None:
            # What svcctl of the previous release writes: the switch only.
            connection.execute(statement, (orgID,))

        update = "UPDATE memory_settings SET observe = {} WHERE org_id = %s AND agent_id IS NULL"
        earlier(update.format("false"), wasOn.orgID)
        assert storedSwitches(databaseDSN, wasOn.orgID) == ("off", False)
        earlier(update.format("true"), wasInherit.orgID)
        assert storedSwitches(databaseDSN, wasInherit.orgID) == ("on", True)
        earlier(update.format("NULL"), wasInherit.orgID)
        assert storedSwitches(databaseDSN, wasInherit.orgID) == (None, None)
        store.setMemorySettings(wasOff.orgID, None, {"observe": "all"})
        assert storedSwitches(databaseDSN, wasOff.orgID) == ("all", True)
        earlier(update.format("true"), wasOff.orgID)
        assert storedSwitches(databaseDSN, wasOff.orgID) == ("all", True)
        store.setMemorySettings(wasOff.orgID, None, {"observe": None})
        assert storedSwitches(databaseDSN, wasOff.orgID) == (None, None)
        fresh = makeTenant(store, "fresh")
        connection.execute(
            "INSERT INTO memory_settings (org_id, agent_id, observe) VALUES (%s, %s, true)",
            (fresh.orgID, fresh.agentID),
        )
        assert store.memorySettings(fresh.orgID, fresh.agentID).observe == "on"  # type: ignore[union-attr]
        store.setMemorySettings(fresh.orgID, fresh.agentID, {"recall": True})
        assert store.memorySettings(fresh.orgID, fresh.agentID).observe == "on"  # type: ignore[union-attr]
        with pytest.raises(psycopg.errors.CheckViolation):
            connection.execute(
                "UPDATE memory_settings SET observe_mode = 'everyone' WHERE org_id = %s",
                (fresh.orgID,),
            )
        # The previous release's svc-auth reads every row by these columns.
        with psycopg.connect(databaseDSN, autocommit=True) as app:
            app.execute(f"SET ROLE {APPLICATION_ROLE}")
            rows = app.execute(
                "SELECT org_id, agent_id, recall, observe, version FROM svc_memory_settings_rows()"
                " WHERE org_id = %s",
                (wasOn.orgID,),
            ).fetchall()
        assert [row[3] for row in rows] == [False]
    finally:
        connection.close()
