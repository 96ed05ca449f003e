"""
svcctl as an operator runs it (decisions D2): one JSON document on stdout
and exit 0, or one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest
from authfixtures import secretOf

from svcd.auth.migrations import migrationFiles


def svcctl(dsn: str | None, *arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "POSTGRES_DSN"}
    if dsn is not None:
        environment["POSTGRES_DSN"] = dsn
    return subprocess.run(
        [sys.executable, "-m", "svcd.auth.ctl", *arguments],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
        check=False,
    )


def document(result: subprocess.CompletedProcess[str]) -> Any:
    """
    The one JSON document a successful command printed.
    """
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def failure(result: subprocess.CompletedProcess[str]) -> str:
    """
    The one stderr line of a failed command, which printed nothing on
    stdout.
    """
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


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
