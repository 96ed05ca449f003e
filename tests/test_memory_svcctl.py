"""
svcctl memory list|show|delete|purge (decisions D13), run as operators run
it, against a real PostgreSQL: one JSON document each, the org's row-level
security context, and a change every replica hears.
"""

from __future__ import annotations

import time
import uuid

from authfixtures import Tenant
from authhelpers import document, failure, svcctl
from memoryfixtures import embedding, query, scopeOf
from memoryservice import RunningMemoryService

from svcd.auth.store import Store
from svcd.memory.records import NewObservation
from svcd.memory.store import MemoryStore
from svcd.memory.store.leases import ObservationRelease
from svcd.memoryclient.records import ObservedMessage, Scope


def add(store: MemoryStore, scope: Scope, content: str) -> uuid.UUID:
    return store.add(scope, content, '{"k":1}', "api", None, embedding([1.0, 0.0]), 100).memoryID


def test_listShowDeleteAndPurge(
    memoryStore: MemoryStore, migratedDSN: str, owner: Store, acme: Tenant
) -> None:
    """
    list shows an agent's memories newest first (every subject, or one),
    show one memory by id (found without its subject), delete forgets it,
    purge forgets a subject's memories and observations, or the agent's.
    """
    org, agent = str(acme.orgID), str(acme.agentID)
    first = add(memoryStore, scopeOf(acme, "alice"), "alice likes tea")
    second = add(memoryStore, scopeOf(acme, "bob"), "bob likes coffee")
    third = add(memoryStore, scopeOf(acme, "bob"), "bob plays chess")
    listed = document(svcctl(migratedDSN, "memory", "list", "--org", org, "--agent", agent))
    assert [each["id"] for each in listed["data"]] == [str(third), str(second), str(first)]
    assert listed["has_more"] is False
    assert listed["data"][0]["content"] == "bob plays chess"
    assert listed["data"][0]["metadata"] == {"k": 1}
    assert "vector" not in listed["data"][0]
    bob = document(
        svcctl(
            migratedDSN,
            "memory",
            "list",
            "--org",
            org,
            "--agent",
            agent,
            "--subject",
            "bob",
            "--limit",
            "1",
        )
    )
    assert [each["id"] for each in bob["data"]] == [str(third)] and bob["has_more"]
    shown = document(
        svcctl(migratedDSN, "memory", "show", "--org", org, "--agent", agent, "--id", str(first))
    )
    assert (shown["subject"], shown["content"], shown["embedding_model"]) == (
        "alice",
        "alice likes tea",
        "embed-test",
    )
    deleted = document(
        svcctl(migratedDSN, "memory", "delete", "--org", org, "--agent", agent, "--id", str(first))
    )
    assert deleted == {"id": str(first), "object": "memory", "deleted": True}
    memoryStore.queueObservations(
        [NewObservation(scopeOf(acme, "bob"), "r1", (ObservedMessage("user", "hi"),))]
    )
    purged = document(
        svcctl(migratedDSN, "memory", "purge", "--org", org, "--agent", agent, "--subject", "bob")
    )
    assert (purged["memories_deleted"], purged["observations_deleted"]) == (2, 1)
    add(memoryStore, scopeOf(acme, "carol"), "carol")
    purged = document(svcctl(migratedDSN, "memory", "purge", "--org", org, "--agent", agent))
    assert (purged["subject"], purged["memories_deleted"]) == (None, 1)


def test_anotherOrganizationsMemoryIsNotReachable(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant, globex: Tenant
) -> None:
    """
    Naming globex and its agent with an id of acme's memory finds nothing
    (run in globex's row-level security context), and deletes nothing; an
    agent of another organization is refused as svcctl refuses it
    everywhere.
    """
    memoryID = add(memoryStore, scopeOf(acme), "acme's secret")
    org, agent = str(globex.orgID), str(globex.agentID)
    for action in ("show", "delete"):
        message = failure(
            svcctl(
                migratedDSN, "memory", action, "--org", org, "--agent", agent, "--id", str(memoryID)
            )
        )
        assert f"no memory {memoryID}" in message
    assert memoryStore.get(scopeOf(acme), memoryID).content == "acme's secret"
    message = failure(
        svcctl(migratedDSN, "memory", "list", "--org", org, "--agent", str(acme.agentID))
    )
    assert f"no agent {acme.agentID} in organization {org}" in message
    listed = document(svcctl(migratedDSN, "memory", "list", "--org", org, "--agent", agent))
    assert listed["data"] == []


def test_aDeleteReachesEveryReplica(
    memoryStore: MemoryStore, migratedDSN: str, acme: Tenant
) -> None:
    """
    A memory deleted with svcctl leaves the cache of a replica that holds
    its scope, within a second, like any change.
    """
    scope = scopeOf(acme)
    memoryID = add(memoryStore, scope, "to forget")
    service = RunningMemoryService(migratedDSN).start()
    try:
        service.parts.searcher.search(scope, query([1.0, 0.0]), 5, None)
        [vectors] = [service.cache.lookup(key) for key in list(service.cache._scopes)]
        assert vectors is not None and vectors.count == 1
        document(
            svcctl(
                migratedDSN,
                "memory",
                "delete",
                "--org",
                str(acme.orgID),
                "--agent",
                str(acme.agentID),
                "--id",
                str(memoryID),
            )
        )
        deadline = time.monotonic() + 1.0
        while vectors.count:
            assert time.monotonic() < deadline, "the replica still holds the deleted memory"
            time.sleep(0.01)
    finally:
        service.stop()


def test_jobsListRetryAndDrop(
    memoryStore: MemoryStore, migratedDSN: str, owner: Store, acme: Tenant, globex: Tenant
) -> None:
    """
    svcctl memory jobs lists the organization's observations not yet done
    (waiting first, failed last) with their attempts, reason and next
    attempt, never their content; retry makes a failed one due now with
    its attempts from zero; drop deletes one; another organization's job
    is no job of this one.
    """
    org = str(acme.orgID)
    queued = memoryStore.queueObservations(
        [
            NewObservation(
                scopeOf(acme, subject), f"req-{subject}", (ObservedMessage("user", "secret fact"),)
            )
            for subject in ("alice", "bob")
        ]
    )
    alice, bob = (each.observationID for each in queued)
    claimed = memoryStore.claimObservations("worker-1", 60, 10)
    assert alice in {each.observationID for each in claimed}
    memoryStore.releaseObservation(
        acme.orgID, alice, "worker-1", ObservationRelease(0, True, True, "extraction: bad answer")
    )
    printed = svcctl(migratedDSN, "memory", "jobs", "--org", org)
    assert "secret fact" not in printed.stdout
    listed = document(printed)["data"]
    assert [(each["id"], each["state"], each["attempts"]) for each in listed] == [
        (str(bob), "waiting", 0),
        (str(alice), "failed", 1),
    ]
    assert listed[1]["reason"] == "extraction: bad answer"
    assert set(listed[0]) == {
        "id",
        "agent_id",
        "subject",
        "state",
        "attempts",
        "reason",
        "next_attempt_at",
    }
    assert listed[0]["agent_id"] == str(acme.agentID) and listed[0]["subject"] == "bob"
    retried = document(
        svcctl(migratedDSN, "memory", "jobs", "retry", "--org", org, "--id", str(alice))
    )
    assert (retried["state"], retried["attempts"], retried["reason"]) == ("waiting", 0, None)
    assert document(
        svcctl(migratedDSN, "memory", "jobs", "drop", "--org", org, "--id", str(bob))
    ) == {"id": str(bob), "dropped": True}
    assert [
        each["id"] for each in document(svcctl(migratedDSN, "memory", "jobs", "--org", org))["data"]
    ] == [str(alice)]
    other = svcctl(
        migratedDSN, "memory", "jobs", "drop", "--org", str(globex.orgID), "--id", str(alice)
    )
    assert other.returncode != 0 and f"no job {alice}" in other.stderr
    assert document(svcctl(migratedDSN, "memory", "jobs", "--org", str(globex.orgID))) == {
        "data": []
    }
    missing = svcctl(migratedDSN, "memory", "jobs", "retry", "--org", org)
    assert missing.returncode != 0 and "--id" in missing.stderr
