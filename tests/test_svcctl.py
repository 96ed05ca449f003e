"""
svcctl as an operator runs it (decisions D2): one JSON document on stdout
and exit 0, or one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from authfixtures import makeTenant, secretOf
from authhelpers import document, failure, svcctl

from svcd.auth.store import Store
from svcd.common.migrations import migrationFiles


def test_migrateTwice(databaseDSN: str) -> None:
    """
    migrate lists what it applied; a second run applies nothing.
    """
    names = [each.name for each in migrationFiles()]
    assert document(svcctl(databaseDSN, "migrate")) == {"applied": names}
    assert document(svcctl(databaseDSN, "migrate")) == {"applied": []}


def test_wholeLifecycle(migratedDSN: str) -> None:
    """
    org create, agent create, agent set-status, token create, token list
    and token revoke print the documents of D2, and the token is printed
    once only: list shows no secret.
    """
    org = document(svcctl(migratedDSN, "org", "create", "--name", "acme"))
    assert org["name"] == "acme" and uuid.UUID(org["org_id"])
    agent = document(
        svcctl(migratedDSN, "agent", "create", "--org", org["org_id"], "--name", "bot")
    )
    assert agent == {"agent_id": agent["agent_id"], "org_id": org["org_id"], "status": "active"}
    paused = document(svcctl(migratedDSN, "agent", "set-status", agent["agent_id"], "paused"))
    assert paused["status"] == "paused"

    token = document(
        svcctl(
            migratedDSN,
            "token",
            "create",
            "--org",
            org["org_id"],
            "--agent",
            agent["agent_id"],
            "--permissions",
            "ProxyChatCompletion,TokenList",
            "--expires-in",
            "3600",
            "--name",
            "ci",
        )
    )
    assert set(token) == {"token", "token_id", "org_id", "agent_id", "permissions", "expires_at"}
    assert token["token"].startswith(f"svc_pat_{token['token_id']}_")
    assert token["permissions"] == 9
    assert token["expires_at"].endswith("Z")
    plain = document(svcctl(migratedDSN, "token", "create", "--org", org["org_id"]))
    assert plain["permissions"] == 1 and plain["agent_id"] is None and plain["expires_at"] is None

    listing = svcctl(migratedDSN, "token", "list", "--org", org["org_id"])
    tokens = document(listing)["tokens"]
    assert {each["token_id"] for each in tokens} == {token["token_id"], plain["token_id"]}
    assert set(tokens[0]) == {
        "token_id",
        "name",
        "agent_id",
        "permissions",
        "expires_at",
        "revoked",
        "created_at",
    }
    assert secretOf(token["token"]) not in listing.stdout

    assert document(svcctl(migratedDSN, "token", "revoke", token["token_id"])) == {
        "token_id": token["token_id"],
        "revoked": True,
    }
    tokens = document(svcctl(migratedDSN, "token", "list", "--org", org["org_id"]))["tokens"]
    assert {each["token_id"]: each["revoked"] for each in tokens} == {
        token["token_id"]: True,
        plain["token_id"]: False,
    }


@pytest.mark.parametrize(
    "arguments, mentions",
    [
        (("agent", "create", "--org", "not-a-uuid"), "--org"),
        (("agent", "create", "--org", str(uuid.uuid4())), "no organization"),
        (("agent", "set-status", str(uuid.uuid4()), "paused"), "no agent"),
        (("agent", "set-status", str(uuid.uuid4()), "sleeping"), "invalid choice"),
        (("token", "create", "--org", str(uuid.uuid4())), "no organization"),
        (("token", "revoke", str(uuid.uuid4())), "no token"),
        (("token", "create", "--org", str(uuid.uuid4()), "--permissions", "Root"), "Root"),
        (("org", "create"), "--name"),
        (("frobnicate",), "invalid choice"),
    ],
)
def test_errorsAreOneLineOnStderr(
    migratedDSN: str, arguments: tuple[str, ...], mentions: str
) -> None:
    """
    Bad arguments and missing objects give one stderr line, no stdout and
    a non-zero exit.
    """
    assert mentions in failure(svcctl(migratedDSN, *arguments))


def test_missingOrUnreachableDatabase() -> None:
    """
    Without POSTGRES_DSN, or with an unreachable server, svcctl says so in
    one line, without a traceback or the DSN's password.
    """
    assert "POSTGRES_DSN" in failure(svcctl(None, "migrate"))
    line = failure(
        svcctl(
            "postgresql://svc:hunter2@127.0.0.1:1/svc", "token", "list", "--org", str(uuid.uuid4())
        )
    )
    assert "hunter2" not in line
    assert "database" in line


# Limits (decisions D11)


def nothingSet(orgID: str, agentID: str | None = None) -> dict[str, Any]:
    return {
        "org_id": orgID,
        "agent_id": agentID,
        "rpm": None,
        "tpm": None,
        "max_output_tokens": None,
        "version": None,
    }


def test_limitsSetShowAndClear(migratedDSN: str) -> None:
    """
    limits set changes only the values it is given (none unsets one) and
    prints the row with a version that grows with every change; show
    prints the same, or every value null without a row; an agent's row is
    apart from its organization's; clear prints the row it removed, or
    nulls and "cleared": false when there was none.
    """
    org = document(svcctl(migratedDSN, "org", "create", "--name", "acme"))["org_id"]
    agent = document(svcctl(migratedDSN, "agent", "create", "--org", org))["agent_id"]
    assert document(svcctl(migratedDSN, "limits", "show", "--org", org)) == nothingSet(org)

    first = document(svcctl(migratedDSN, "limits", "set", "--org", org, "--rpm", "60"))
    assert isinstance(first["version"], int)
    assert first == {**nothingSet(org), "rpm": 60, "version": first["version"]}
    second = document(
        svcctl(
            migratedDSN,
            "limits",
            "set",
            "--org",
            org,
            "--tpm",
            "100000",
            "--max-output-tokens",
            "2048",
        )
    )
    assert second == {
        **nothingSet(org),
        "rpm": 60,
        "tpm": 100000,
        "max_output_tokens": 2048,
        "version": second["version"],
    }
    assert second["version"] > first["version"]
    third = document(svcctl(migratedDSN, "limits", "set", "--org", org, "--rpm", "none"))
    assert third == {**second, "rpm": None, "version": third["version"]}
    assert third["version"] > second["version"]
    assert document(svcctl(migratedDSN, "limits", "show", "--org", org)) == third

    agentRow = document(
        svcctl(
            migratedDSN,
            "limits",
            "set",
            "--org",
            org,
            "--agent",
            agent,
            "--rpm",
            "10",
            "--tpm",
            str(2**63 - 1),
        )
    )
    assert agentRow == {
        **nothingSet(org, agent),
        "rpm": 10,
        "tpm": 2**63 - 1,
        "version": agentRow["version"],
    }
    assert document(svcctl(migratedDSN, "limits", "show", "--org", org)) == third
    shown = svcctl(migratedDSN, "limits", "show", "--org", org, "--agent", agent)
    assert document(shown) == agentRow

    cleared = svcctl(migratedDSN, "limits", "clear", "--org", org, "--agent", agent)
    assert document(cleared) == {**agentRow, "cleared": True}
    shown = svcctl(migratedDSN, "limits", "show", "--org", org, "--agent", agent)
    assert document(shown) == nothingSet(org, agent)
    again = svcctl(migratedDSN, "limits", "clear", "--org", org, "--agent", agent)
    assert document(again) == {**nothingSet(org, agent), "cleared": False}
    assert document(svcctl(migratedDSN, "limits", "clear", "--org", org)) == {
        **third,
        "cleared": True,
    }
    assert document(svcctl(migratedDSN, "limits", "show", "--org", org)) == nothingSet(org)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--rpm", "0"),
        ("--tpm", "-1"),
        ("--max-output-tokens", "abc"),
        ("--rpm", "1.5"),
        ("--tpm", "1e3"),
        ("--max-output-tokens", "+5"),
        ("--rpm", ""),
        ("--tpm", str(2**63)),
        ("--max-output-tokens", "\u0665"),
        ("--rpm", "\uff12\uff10"),
        ("--tpm", "1_000"),
        ("--max-output-tokens", "4_096"),
    ],
)
def test_limitsValuesArePositiveIntegersOrNone(
    migratedDSN: str, owner: Store, flag: str, value: str
) -> None:
    """
    Anything but a positive integer a bigint holds, or none, is refused
    with one line naming the flag; nothing is stored.
    """
    tenant = makeTenant(owner)
    line = failure(
        svcctl(migratedDSN, "limits", "set", "--org", str(tenant.orgID), f"{flag}={value}")
    )
    assert flag in line and "positive integer" in line
    assert owner.limits(tenant.orgID) is None


def test_limitsRefusals(migratedDSN: str, owner: Store) -> None:
    """
    set with no value is refused ("nothing to set"); an unknown
    organization is refused; an agent of another organization is refused
    in the very words used for an agent that does not exist, by set, show
    and clear alike (and by token create), and nothing of the other
    organization is touched.
    """
    mine = makeTenant(owner, "mine")
    theirs = makeTenant(owner, "theirs")
    owner.setLimits(theirs.orgID, theirs.agentID, {"rpm": 7})
    org = str(mine.orgID)

    assert "nothing to set" in failure(svcctl(migratedDSN, "limits", "set", "--org", org))
    nowhere = str(uuid.uuid4())
    assert "no organization" in failure(
        svcctl(migratedDSN, "limits", "set", "--org", nowhere, "--rpm", "5")
    )
    assert "no organization" in failure(svcctl(migratedDSN, "limits", "show", "--org", nowhere))
    assert "--agent" in failure(
        svcctl(migratedDSN, "limits", "show", "--org", org, "--agent", "bot")
    )
    unknown = str(uuid.uuid4())
    for action in (("set", "--rpm", "5"), ("show",), ("clear",)):
        foreign = failure(
            svcctl(migratedDSN, "limits", *action, "--org", org, "--agent", str(theirs.agentID))
        )
        missing = failure(svcctl(migratedDSN, "limits", *action, "--org", org, "--agent", unknown))
        assert foreign.replace(str(theirs.agentID), "ID") == missing.replace(unknown, "ID")
        assert str(theirs.orgID) not in foreign
    # token create refuses another organization's agent in the same words.
    foreign = failure(
        svcctl(migratedDSN, "token", "create", "--org", org, "--agent", str(theirs.agentID))
    )
    missing = failure(svcctl(migratedDSN, "token", "create", "--org", org, "--agent", unknown))
    assert foreign.replace(str(theirs.agentID), "ID") == missing.replace(unknown, "ID")
    theirRow = owner.limits(theirs.orgID, theirs.agentID)
    assert theirRow is not None and theirRow.rpm == 7
    assert owner.limits(mine.orgID) is None


@pytest.mark.parametrize(
    "command, flags, mentions",
    [
        (("token", "create"), ("--expires-in", "\uff16\uff10"), "--expires-in"),
        (("token", "create"), ("--expires-in", "6_0"), "--expires-in"),
        (("token", "create"), ("--permissions", "\uff11"), "unknown permission"),
        (("usage",), ("--since", "\uff12\uff10\uff12\uff15-06-01"), "--since"),
        (("usage",), ("--until", "\u0662\u0660\u0662\u0666-01-01"), "--until"),
    ],
    ids=["expires-fullwidth", "expires-underscore", "permissions", "since", "until"],
)
def test_numbersAreASCIIDigits(
    migratedDSN: str,
    owner: Store,
    command: tuple[str, ...],
    flags: tuple[str, ...],
    mentions: str,
) -> None:
    """
    Every number svcctl reads is ASCII digits: int() and strptime also
    read other scripts' digits (a fullwidth "60" as 60) and int() underscores, which
    an operator never means. Refused in one line naming the flag, nothing
    done (no token made, no report).
    """
    tenant = makeTenant(owner)
    result = svcctl(migratedDSN, *command, "--org", str(tenant.orgID), *flags)
    assert mentions in failure(result)
    assert len(owner.listTokens(tenant.orgID)) == 1
