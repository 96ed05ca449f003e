"""
The memory routes end to end (decisions D13, issue 31): real svc-auth,
svc-memory and svc-proxy daemons over PostgreSQL and Redis, the proxy
embedding with the scripted upstream (whose vectors are hashed bags of
words: texts sharing words are near).

Three proxies share the database, svc-auth and svc-memory: C{memory}, the
one memory is on for; C{failing}, whose [memory] embedding model always
fails (503 upstream) and is offered to the main organization only;
C{off}, with the same providers file but no SVC_MEMORY_GRPC_ADDR.
svc-memory keeps at most L{MAX_PER_SCOPE} memories per agent and subject,
so each test works in a subject of its own.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import openai
import psycopg
import pytest
from authfixtures import Tenant, makeTenant
from gatewayfixtures import Answer, assertEnvelope, request, waitFor
from ledgerfixtures import ledgerRows

from svcd.auth.authority import issueToken
from svcd.auth.store import Store
from svcd.common.permissions import Permission
from svcd.devkit.daemons import Daemon, authEnvironment, memoryEnvironment
from svcd.devkit.pgtemplate import migratedDatabase
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import ScriptedUpstream

# Starts real daemons (conftest.py, pytest.ini): left out of a quick run.
pytestmark = pytest.mark.e2e

MAX_PER_SCOPE = 3
# SVC_MEMORY_MAX_WAITING_PER_ORG of the stack's svc-memory: no test but
# test_aFullQueueIs429 queues so many for one organization.
MAX_WAITING_PER_ORG = 20
EVERYTHING = int(
    Permission.ProxyChatCompletion
    | Permission.ProxyEmbeddings
    | Permission.MemoryRead
    | Permission.MemoryWrite
)
# Never written anywhere but in a memory's content and a search's query:
# no daemon's log may hold it.
MARKER = "zebracorn" + uuid.uuid4().hex[:12]

PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[models]]
name = "chat"
provider = "scripted"
upstream_model = "echo"

[[models]]
name = "embed"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
price = {{ input = "0.02" }}

[[models]]
name = "embed-failing"
provider = "scripted"
upstream_model = "status:503"
kind = "embedding"
orgs = ["{main}"]
fallbacks = ["embed"]

[memory]
embedding_model = "{memoryModel}"
"""


@attrs.frozen
class Stack:
    dsn: str
    owner: Store
    auth: Daemon
    memory: Daemon
    proxies: dict[str, Daemon]
    upstream: ScriptedUpstream
    tenants: dict[str, Tenant]
    # A second agent of the main organization.
    secondAgent: uuid.UUID

    def port(self, proxy: str = "memory") -> int:
        return self.proxies[proxy].httpPort


def headersOf(
    tenant: Tenant,
    subject: str | None = None,
    agent: uuid.UUID | None = None,
    token: str | None = None,
) -> dict[str, str]:
    headers = {
        "Authorization": f"Bearer {token or tenant.token}",
        "X-SVC-Agent-ID": str(agent or tenant.agentID),
        "Content-Type": "application/json",
    }
    if subject is not None:
        headers["X-SVC-Memory-Subject"] = subject
    return headers


def call(
    stack: Stack,
    method: str,
    path: str,
    tenant: str = "main",
    body: object = None,
    proxy: str = "memory",
    **options: Any,
) -> Answer:
    return request(
        stack.port(proxy),
        method,
        path,
        headersOf(stack.tenants[tenant], **options),
        json.dumps(body).encode() if body is not None else None,
        timeout=30,
    )


def add(stack: Stack, content: str, subject: str, **options: Any) -> dict[str, Any]:
    answer = call(
        stack, "POST", "/v1/memories", body={"content": content}, subject=subject, **options
    )
    assert answer.status == 201, answer.body
    memory: dict[str, Any] = answer.json()
    return memory


def search(stack: Stack, query: str, subject: str, **fields: Any) -> list[dict[str, Any]]:
    answer = call(
        stack,
        "POST",
        "/v1/memories/search",
        body={"query": query, **fields},
        subject=subject,
    )
    assert answer.status == 200, answer.body
    assert answer.json()["object"] == "list"
    results: list[dict[str, Any]] = answer.json()["data"]
    return results


def embeddingRequests(stack: Stack, requestID: str) -> list[Any]:
    return [
        each
        for each in stack.upstream.requests()
        if each.path.endswith("/embeddings") and each.header("x-request-id") == requestID
    ]


def waitForRow(stack: Stack, requestID: str) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}

    def arrived() -> bool:
        nonlocal rows
        rows = ledgerRows(stack.dsn, "request_id = %s", (requestID,))
        return bool(rows)

    waitFor(arrived, 30)
    [row] = rows.values()
    return row


def startProxy(
    name: str,
    workdir: Path,
    auth: Daemon,
    redis: RedisServer,
    providers: Path,
    memory: Daemon | None,
) -> Daemon:
    environment = {
        "SVC_HOST": "127.0.0.1",
        "SVC_PORT": str(freePort()),
        "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}",
        "REDIS_URL": redis.url,
        "SVC_PROVIDERS_FILE": str(providers),
        "SVC_AUTH_VALIDATE_TIMEOUT": "5s",
        "SVC_RATE_LIMIT_DEFAULT_RPM": "1000000",
        "SVC_SHUTDOWN_TIMEOUT": "5s",
        # Every line the proxy can write, for the content checks.
        "SVC_LOG_LEVEL": "DEBUG",
    }
    if memory is not None:
        environment["SVC_MEMORY_GRPC_ADDR"] = f"127.0.0.1:{memory.environment['SVC_GRPC_PORT']}"
    return Daemon("svc-proxy", environment, workdir / f"proxy-{name}.log").start()


@pytest.fixture(scope="module")
def stack(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("memories")
    name = f"memories_{uuid.uuid4().hex[:12]}"
    dsn = migratedDatabase(postgresServer, name)
    redis = RedisServer.create(workdir / "redis")
    redis.start()
    upstream = ScriptedUpstream(workdir / "upstream").start()
    connection = psycopg.connect(dsn, autocommit=True)
    owner = Store(lambda: contextlib.nullcontext(connection))
    tenants = {
        "main": makeTenant(owner, "main", permissions=EVERYTHING),
        "other": makeTenant(owner, "other", permissions=EVERYTHING),
        "reader": makeTenant(owner, "reader", permissions=int(Permission.MemoryRead)),
        "writer": makeTenant(owner, "writer", permissions=int(Permission.MemoryWrite)),
        "crowded": makeTenant(owner, "crowded", permissions=EVERYTHING),
    }
    secondAgent = owner.createAgent(tenants["main"].orgID, "main-second").agentID
    daemons: list[Daemon] = []
    try:
        auth = Daemon("svc-auth", authEnvironment(dsn), workdir / "auth.log").start()
        daemons.append(auth)
        memory = Daemon(
            "svc-memory",
            memoryEnvironment(
                dsn,
                SVC_MEMORY_MAX_PER_SCOPE=str(MAX_PER_SCOPE),
                SVC_MEMORY_MAX_WAITING_PER_ORG=str(MAX_WAITING_PER_ORG),
                SVC_LOG_LEVEL="DEBUG",
            ),
            workdir / "memory.log",
        ).start()
        daemons.append(memory)
        files = {}
        for kind, model in (("memory", "embed"), ("failing", "embed-failing")):
            files[kind] = workdir / f"providers-{kind}.toml"
            files[kind].write_text(
                PROVIDERS.format(
                    base=upstream.baseURL, main=tenants["main"].orgID, memoryModel=model
                )
            )
        proxies = {
            "memory": startProxy("memory", workdir, auth, redis, files["memory"], memory),
            "failing": startProxy("failing", workdir, auth, redis, files["failing"], memory),
            "off": startProxy("off", workdir, auth, redis, files["memory"], None),
        }
        daemons += proxies.values()
        for daemon in daemons:
            daemon.waitForReady()
        stack = Stack(dsn, owner, auth, memory, proxies, upstream, tenants, secondAgent)
        # svc-memory may have come up after a proxy's first try to connect:
        # its channel tries again within a second (calls fail at once
        # meanwhile, as svc-auth's do).
        for proxy in ("memory", "failing"):
            waitFor(
                lambda: call(stack, "GET", "/v1/memories", proxy=proxy).status == 200,  # noqa: B023
                30,
            )
        yield stack
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
        upstream.stop()
        redis.destroy()
        connection.close()
        postgresServer.dropDatabase(name)
    for daemon in daemons:
        assert "Traceback" not in daemon.output(), daemon.output()


def test_addThenSearchFindsIt(stack: Stack) -> None:
    """
    A memory added is 201 with the memory (never its vector), embedded in
    one request to the embedding model whose ledger row is of kind
    embedding; a search whose query shares its words finds it first, best
    first, with its score, and its own embedding is a row of its own.
    """
    subject = "search-user"
    memory = add(stack, "the user likes green tea in the morning", subject)
    tenant = stack.tenants["main"]
    assert set(memory) == {
        "id",
        "object",
        "agent_id",
        "subject",
        "content",
        "metadata",
        "source",
        "created_at",
        "updated_at",
    }
    assert (memory["object"], memory["agent_id"], memory["subject"], memory["source"]) == (
        "memory",
        str(tenant.agentID),
        subject,
        "api",
    )
    assert (memory["content"], memory["metadata"]) == (
        "the user likes green tea in the morning",
        {},
    )
    add(stack, "quantum chromodynamics lecture notes", subject)
    answer = call(
        stack,
        "POST",
        "/v1/memories/search",
        body={"query": "what tea does the user like", "k": 2},
        subject=subject,
    )
    assert answer.status == 200, answer.body
    first, second = answer.json()["data"]
    assert first["memory"] == memory
    assert 1 >= first["score"] > second["score"] >= -1
    # min_score leaves out what scores below it.
    [only] = search(stack, "what tea does the user like", subject, min_score=first["score"] - 1e-4)
    assert only["memory"]["id"] == memory["id"]
    requestID = answer.headers["x-request-id"]
    [sent] = embeddingRequests(stack, requestID)
    assert sent.body == {
        "model": "echo",
        "input": ["what tea does the user like"],
        "encoding_format": "base64",
    }
    row = waitForRow(stack, requestID)
    assert (row["kind"], row["outcome"], row["model"], row["parent_request_id"]) == (
        "embedding",
        "ok",
        "embed",
        None,
    )
    assert row["prompt_tokens"] == 6 and row["completion_tokens"] == 0
    assert row["token_id"] == tenant.tokenID


def test_theAddsRowIsOfKindEmbedding(stack: Stack) -> None:
    """
    Adding writes one ledger row, kind embedding, under the request's id,
    the provider's prompt tokens at the model's price.
    """
    answer = call(
        stack,
        "POST",
        "/v1/memories",
        body={"content": "one two three four", "metadata": {"topic": "numbers"}},
        subject="ledger-user",
    )
    assert answer.status == 201, answer.body
    assert answer.json()["metadata"] == {"topic": "numbers"}
    row = waitForRow(stack, answer.headers["x-request-id"])
    assert (row["kind"], row["prompt_tokens"], row["cost_nano_usd"]) == ("embedding", 4, 4 * 20)


def test_listPagesNewestFirst(stack: Stack) -> None:
    """
    GET /v1/memories lists the scope's memories newest first, limit at a
    time, after the id given, saying whether more follow.
    """
    subject = "list-user"
    added = [add(stack, f"memory number {n}", subject) for n in range(3)]
    first = call(stack, "GET", "/v1/memories?limit=2", subject=subject)
    assert first.status == 200, first.body
    page = first.json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [each["id"] for each in page["data"]] == [added[2]["id"], added[1]["id"]]
    rest = call(stack, "GET", f"/v1/memories?limit=2&after={page['last_id']}", subject=subject)
    assert [each["id"] for each in rest.json()["data"]] == [added[0]["id"]]
    assert rest.json()["has_more"] is False
    for query in ("limit=0", "limit=101", "limit=x", "after=nope"):
        assertEnvelope(
            call(stack, "GET", f"/v1/memories?{query}", subject=subject), 400, "VALIDATION_ERROR"
        )


def test_patchReEmbedsAChangedContent(stack: Stack) -> None:
    """
    PATCH with a new content embeds it (the search finds it by its new
    words, not its old ones) and keeps the id; with the same content, or
    metadata only, nothing is embedded.
    """
    subject = "patch-user"
    memory = add(stack, "the cat sat on the mat", subject)
    path = f"/v1/memories/{memory['id']}"
    changed = call(
        stack, "PATCH", path, body={"content": "loves hiking mountains"}, subject=subject
    )
    assert changed.status == 200, changed.body
    assert changed.json()["id"] == memory["id"]
    assert changed.json()["content"] == "loves hiking mountains"
    assert len(embeddingRequests(stack, changed.headers["x-request-id"])) == 1
    [found] = search(stack, "hiking mountains", subject, k=1)
    assert found["memory"]["content"] == "loves hiking mountains"
    assert found["score"] > 0.5
    assert search(stack, "cat mat", subject, min_score=0.5) == []
    for body in ({"content": "loves hiking mountains"}, {"metadata": {"mood": "good"}}):
        same = call(stack, "PATCH", path, body=body, subject=subject)
        assert same.status == 200, same.body
        assert embeddingRequests(stack, same.headers["x-request-id"]) == []
    assert same.json()["metadata"] == {"mood": "good"}
    assertEnvelope(call(stack, "PATCH", path, body={}, subject=subject), 400, "VALIDATION_ERROR")


def test_deleteForgets(stack: Stack) -> None:
    """
    A deleted memory is gone: GET is 404, a search no longer finds it, a
    second DELETE is 404.
    """
    subject = "delete-user"
    memory = add(stack, "remember the secret garden", subject)
    path = f"/v1/memories/{memory['id']}"
    deleted = call(stack, "DELETE", path, subject=subject)
    assert deleted.status == 200, deleted.body
    assert deleted.json() == {"id": memory["id"], "object": "memory", "deleted": True}
    assertEnvelope(call(stack, "GET", path, subject=subject), 404, "NOT_FOUND")
    assert search(stack, "secret garden", subject) == []
    assertEnvelope(call(stack, "DELETE", path, subject=subject), 404, "NOT_FOUND")
    assertEnvelope(
        call(stack, "GET", f"/v1/memories/{uuid.uuid4()}", subject=subject), 404, "NOT_FOUND"
    )
    assertEnvelope(
        call(stack, "GET", "/v1/memories/not-an-id", subject=subject), 400, "VALIDATION_ERROR"
    )


def test_deleteScopeForgetsTheSubject(stack: Stack) -> None:
    """
    DELETE /v1/memories forgets every memory of the agent and subject
    (and its waiting observations), and nothing of another subject.
    """
    add(stack, "alpha memory", "scope-a")
    add(stack, "beta memory", "scope-a")
    kept = add(stack, "gamma memory", "scope-b")
    queued = call(
        stack,
        "POST",
        "/v1/memories",
        body={"messages": [{"role": "user", "content": "I live in Lisbon"}]},
        subject="scope-a",
    )
    assert queued.status == 202, queued.body
    answer = call(stack, "DELETE", "/v1/memories", subject="scope-a")
    assert answer.status == 200, answer.body
    assert answer.json() == {"deleted": 2}
    assert call(stack, "GET", "/v1/memories", subject="scope-a").json()["data"] == []
    assert [
        each["id"] for each in call(stack, "GET", "/v1/memories", subject="scope-b").json()["data"]
    ] == [kept["id"]]
    with psycopg.connect(stack.dsn, autocommit=True) as connection:
        [(waiting,)] = connection.execute(
            "SELECT count(*) FROM memory_observations WHERE id = %s", (queued.json()["id"],)
        ).fetchall()
    assert waiting == 0


def test_messagesAreQueuedOnceForTheWorker(stack: Stack) -> None:
    """
    {"messages"} answers 202 with the observation's id once svc-memory
    has it; the same X-Request-ID and conversation queue nothing twice
    (the same id), while another conversation or subject under that
    request id is queued as its own; its user and assistant texts are
    kept, other roles skipped.
    """
    requestID = str(uuid.uuid4())
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "I moved to Porto"}]},
            {"role": "assistant", "content": "Nice!"},
        ]
    }
    answers = [
        request(
            stack.port(),
            "POST",
            "/v1/memories",
            {**headersOf(stack.tenants["main"], "observe-user"), "X-Request-ID": requestID},
            json.dumps(body).encode(),
        )
        for _ in range(2)
    ]
    for answer in answers:
        assert answer.status == 202, answer.body
        assert set(answer.json()) == {"object", "id", "status"}
        assert answer.json()["object"] == "memory.observation"
        assert answer.json()["status"] == "queued"
    assert answers[0].json()["id"] == answers[1].json()["id"]
    # The same X-Request-ID on another conversation, or another subject's,
    # is an observation of its own (a client reusing its request ids).
    others = [
        request(
            stack.port(),
            "POST",
            "/v1/memories",
            {**headersOf(stack.tenants["main"], subject), "X-Request-ID": requestID},
            json.dumps(sent).encode(),
        )
        for subject, sent in (
            ("observe-user", {"messages": [{"role": "user", "content": "I moved to Faro"}]}),
            ("observe-other", body),
        )
    ]
    assert [each.status for each in others] == [202, 202]
    assert len({answers[0].json()["id"], *(each.json()["id"] for each in others)}) == 3
    with psycopg.connect(stack.dsn, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT subject, request_id, messages FROM memory_observations WHERE id = %s",
            (answers[0].json()["id"],),
        ).fetchall()
    assert rows == [
        (
            "observe-user",
            requestID,
            [
                {"role": "user", "content": "I moved to Porto"},
                {"role": "assistant", "content": "Nice!"},
            ],
        )
    ]
    assertEnvelope(
        call(
            stack,
            "POST",
            "/v1/memories",
            body={"messages": [{"role": "assistant", "content": "x"}]},
        ),
        400,
        "VALIDATION_ERROR",
    )


def test_aFullQueueIs429(stack: Stack) -> None:
    """
    Past SVC_MEMORY_MAX_WAITING_PER_ORG observations of one organization
    waiting, a conversation posted is 429 MEMORY_QUEUE_FULL with
    Retry-After, and not queued; one queued before, sent again, is 202
    with its id; another organization still has room.
    """

    def post(tenant: str, requestID: str, text: str) -> Answer:
        return request(
            stack.port(),
            "POST",
            "/v1/memories",
            {**headersOf(stack.tenants[tenant], "crowd"), "X-Request-ID": requestID},
            json.dumps({"messages": [{"role": "user", "content": text}]}).encode(),
        )

    sent = [str(uuid.uuid4()) for _ in range(MAX_WAITING_PER_ORG)]
    answers = [post("crowded", requestID, f"I moved {n} times") for n, requestID in enumerate(sent)]
    assert [each.status for each in answers] == [202] * MAX_WAITING_PER_ORG
    full = post("crowded", str(uuid.uuid4()), "one too many")
    assertEnvelope(full, 429, "MEMORY_QUEUE_FULL")
    assert full.headers["retry-after"] == "60"
    again = post("crowded", sent[0], "I moved 0 times")
    assert again.status == 202
    assert again.json()["id"] == answers[0].json()["id"]
    assert post("other", str(uuid.uuid4()), "I have room").status == 202
    with psycopg.connect(stack.dsn, autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*) FROM memory_observations WHERE org_id = %s",
            (stack.tenants["crowded"].orgID,),
        ).fetchone()
    assert row == (MAX_WAITING_PER_ORG,)


def test_anotherOrganizationsOrAgentsMemoryIs403(stack: Stack) -> None:
    """
    Another organization's memory, or another agent's of the same
    organization, is 403 on every route that names it, never 404, and
    never in their list or search.
    """
    memory = add(stack, "the launch code is orange", "tenancy")
    path = f"/v1/memories/{memory['id']}"
    for options in ({"tenant": "other"}, {"agent": stack.secondAgent}):
        for method, body in (("GET", None), ("PATCH", {"metadata": {}}), ("DELETE", None)):
            answer = call(stack, method, path, body=body, subject="tenancy", **options)
            assertEnvelope(answer, 403, "INSUFFICIENT_PERMISSIONS")
        listed = call(stack, "GET", "/v1/memories", subject="tenancy", **options)
        assert listed.json()["data"] == []
        found = call(
            stack,
            "POST",
            "/v1/memories/search",
            body={"query": "launch code orange"},
            subject="tenancy",
            **options,
        )
        assert found.json()["data"] == []
    assert call(stack, "GET", path, subject="tenancy").status == 200


def test_subjectsAreIsolated(stack: Stack) -> None:
    """
    A subject's memory is not another subject's (nor the agent's own, with
    no header): not listed, not found, 403 by id; a bad subject header is
    400 naming it.
    """
    memory = add(stack, "allergic to peanuts", "alice@example.com")
    assert memory["subject"] == "alice@example.com"
    for subject in ("bob@example.com", None):
        listed = call(stack, "GET", "/v1/memories", subject=subject).json()["data"]
        assert memory["id"] not in [each["id"] for each in listed]
        found = call(
            stack, "POST", "/v1/memories/search", body={"query": "peanuts"}, subject=subject
        )
        assert memory["id"] not in [each["memory"]["id"] for each in found.json()["data"]]
        assertEnvelope(
            call(stack, "GET", f"/v1/memories/{memory['id']}", subject=subject),
            403,
            "INSUFFICIENT_PERMISSIONS",
        )
    for bad in ("", "x" * 129, "has space", "ünïcode"):
        answer = call(stack, "GET", "/v1/memories", subject=bad)
        assertEnvelope(answer, 400, "VALIDATION_ERROR")
        assert answer.json()["error"]["field_errors"][0]["field"] == "X-SVC-Memory-Subject"


def test_permissionsAreMemoryReadAndWrite(stack: Stack) -> None:
    """
    MemoryRead reads and searches and cannot write; MemoryWrite writes and
    cannot read or search; a token with neither (chat only) can do none.
    """
    reads = [("GET", "/v1/memories", None), ("POST", "/v1/memories/search", {"query": "x"})]
    writes = [
        ("POST", "/v1/memories", {"content": "x"}),
        ("DELETE", "/v1/memories", None),
        ("PATCH", f"/v1/memories/{uuid.uuid4()}", {"content": "x"}),
        ("DELETE", f"/v1/memories/{uuid.uuid4()}", None),
    ]
    for method, path, body in reads:
        assert call(stack, method, path, "reader", body).status == 200
        assertEnvelope(call(stack, method, path, "writer", body), 403, "INSUFFICIENT_PERMISSIONS")
    for method, path, body in writes:
        assert call(stack, method, path, "writer", body).status in (200, 201, 404)
        assertEnvelope(call(stack, method, path, "reader", body), 403, "INSUFFICIENT_PERMISSIONS")
    chatOnly = makeTenant(stack.owner, "chat-only")
    for method, path, body in [*reads, *writes]:
        answer = request(
            stack.port(),
            method,
            path,
            headersOf(chatOnly),
            json.dumps(body).encode() if body else None,
        )
        assertEnvelope(answer, 403, "INSUFFICIENT_PERMISSIONS")


def test_aFullScopeIs409(stack: Stack) -> None:
    """
    Past SVC_MEMORY_MAX_PER_SCOPE memories of one agent and subject, an
    add is 409 MEMORY_FULL; another subject still has room.
    """
    for n in range(MAX_PER_SCOPE):
        add(stack, f"filling memory {n}", "full-user")
    answer = call(
        stack, "POST", "/v1/memories", body={"content": "one too many"}, subject="full-user"
    )
    assertEnvelope(answer, 409, "MEMORY_FULL")
    add(stack, "room elsewhere", "roomy-user")


def test_aFailingEmbeddingStoresNothing(stack: Stack) -> None:
    """
    When the embedding model fails, adding and searching answer the
    provider's fault as decisions D9 maps it (503 upstream: 502
    UPSTREAM_ERROR), and nothing is stored; the failed call is a row of
    kind embedding too, the model's: its fallback is never asked
    (decisions D13 amended, "Vectors never mix"; it answered, and the
    memory was stored under its name, never found by the model's queries).
    """
    answer = call(
        stack,
        "POST",
        "/v1/memories",
        body={"content": "never stored"},
        subject="failing-user",
        proxy="failing",
    )
    assertEnvelope(answer, 502, "UPSTREAM_ERROR")
    row = waitForRow(stack, answer.headers["x-request-id"])
    assert (row["kind"], row["outcome"], row["model"]) == (
        "embedding",
        "upstream_error",
        "embed-failing",
    )
    assert (
        call(stack, "GET", "/v1/memories", subject="failing-user", proxy="failing").json()["data"]
        == []
    )
    searched = call(
        stack,
        "POST",
        "/v1/memories/search",
        body={"query": "x"},
        subject="failing-user",
        proxy="failing",
    )
    assertEnvelope(searched, 502, "UPSTREAM_ERROR")


def test_memoryNotConfiguredIs501(stack: Stack) -> None:
    """
    Without SVC_MEMORY_GRPC_ADDR every memory route is 501
    MEMORY_NOT_CONFIGURED, after its steps and its body's checks; with an
    embedding model not offered to the organization, the routes that
    embed are 501 while reading stays possible.
    """
    for method, path, body in (
        ("POST", "/v1/memories", {"content": "x"}),
        ("GET", "/v1/memories", None),
        ("DELETE", "/v1/memories", None),
        ("POST", "/v1/memories/search", {"query": "x"}),
        ("GET", f"/v1/memories/{uuid.uuid4()}", None),
        ("PATCH", f"/v1/memories/{uuid.uuid4()}", {"content": "x"}),
        ("DELETE", f"/v1/memories/{uuid.uuid4()}", None),
    ):
        answer = call(stack, method, path, body=body, proxy="off")
        assertEnvelope(answer, 501, "MEMORY_NOT_CONFIGURED")
        assert "x-ratelimit-limit" in answer.headers
    assertEnvelope(
        call(stack, "POST", "/v1/memories", body={"content": ""}, proxy="off"),
        400,
        "VALIDATION_ERROR",
    )
    for method, path, body in (
        ("POST", "/v1/memories", {"content": "x"}),
        ("POST", "/v1/memories/search", {"query": "x"}),
    ):
        answer = call(stack, method, path, "other", body, proxy="failing")
        assertEnvelope(answer, 501, "MEMORY_NOT_CONFIGURED")
    assert call(stack, "GET", "/v1/memories", "other", proxy="failing").status == 200


def test_aRevokedTokenReadsNothingWithinASecond(stack: Stack) -> None:
    """
    A token revoked (as svcctl token revoke does) reads no memory within a
    second of its revocation.
    """
    tenant = stack.tenants["main"]
    token, record = issueToken(stack.owner, orgID=tenant.orgID, permissions=EVERYTHING)
    add(stack, "revocation test memory", "revoked-user", token=token)
    assert call(stack, "GET", "/v1/memories", subject="revoked-user", token=token).status == 200
    stack.owner.revokeToken(record.tokenID)
    revoked = time.monotonic()
    waitFor(
        lambda: (
            call(stack, "GET", "/v1/memories", subject="revoked-user", token=token).status == 401
        ),
        5,
    )
    assert time.monotonic() - revoked < 1.0


def sdk(stack: Stack, tenant: str = "main") -> openai.OpenAI:
    chosen = stack.tenants[tenant]
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.port()}/v1",
        api_key=chosen.token,
        default_headers={"X-SVC-Agent-ID": str(chosen.agentID)},
        max_retries=0,
        timeout=30.0,
    )


def test_theSDKReachesTheRoutes(stack: Stack) -> None:
    """
    The openai SDK's generic calls reach the routes as any client's: a
    memory added and found, with the subject as a header.
    """
    client = sdk(stack)
    options: Any = {"headers": {"X-SVC-Memory-Subject": "sdk-user"}}
    added: Any = client.post(
        "/memories",
        body={"content": "prefers window seats on planes"},
        cast_to=object,
        options=options,
    )
    assert added["object"] == "memory" and added["subject"] == "sdk-user"
    found: Any = client.post(
        "/memories/search",
        body={"query": "window seats"},
        cast_to=object,
        options=options,
    )
    assert found["data"][0]["memory"]["id"] == added["id"]
    with pytest.raises(openai.PermissionDeniedError):
        sdk(stack, "other").get(
            f"/memories/{added['id']}",
            cast_to=object,
            options=options,
        )


def test_theContentIsNeverLogged(stack: Stack) -> None:
    """
    A marker stored as a memory's content, changed, and searched for,
    appears in no daemon's log (each at DEBUG).
    """
    memory = add(stack, f"the password hint is {MARKER}", "logged-user")
    call(
        stack,
        "PATCH",
        f"/v1/memories/{memory['id']}",
        body={"content": f"{MARKER} again", "metadata": {"note": MARKER}},
        subject="logged-user",
    )
    assert search(stack, MARKER, "logged-user")[0]["memory"]["id"] == memory["id"]
    call(
        stack,
        "POST",
        "/v1/memories",
        body={"messages": [{"role": "user", "content": MARKER}]},
        subject="logged-user",
    )
    for daemon in (stack.auth, stack.memory, *stack.proxies.values()):
        assert MARKER not in daemon.output(), daemon.plugin


def test_memoryDownIs503AndChatGoesOn(stack: Stack) -> None:
    """
    With svc-memory stopped, the memory routes answer 503
    SERVICE_DEGRADED within svc-memory's deadline, while chat completions
    (through the openai SDK) and /ready are unaffected; once it is back,
    the memories are there again.
    """
    memory = add(stack, "survives a restart", "restart-user")
    assert stack.memory.terminate() == 0
    try:
        began = time.monotonic()
        answer = call(stack, "GET", "/v1/memories", subject="restart-user")
        assertEnvelope(answer, 503, "SERVICE_DEGRADED")
        assert time.monotonic() - began < 5
        assertEnvelope(
            call(stack, "POST", "/v1/memories/search", body={"query": "x"}, subject="restart-user"),
            503,
            "SERVICE_DEGRADED",
        )
        completion = sdk(stack).chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hello"}]
        )
        assert completion.choices[0].message.content
        assert request(stack.port(), "GET", "/ready").status == 200
    finally:
        stack.memory.start()
        stack.memory.waitForReady()

    def back() -> bool:
        answer = call(stack, "GET", f"/v1/memories/{memory['id']}", subject="restart-user")
        return answer.status == 200

    waitFor(back, 30)
