"""
Recall in chat completions end to end (decisions D13, issue 32): real
svc-auth, svc-memory and svc-proxy daemons over PostgreSQL and Redis,
driven with the C{openai} SDK; the scripted upstream answers chat (and
records the body it received: the assembled messages) and embeddings
(hashed bags of words: texts sharing words are near).

The memories are stored straight into svc-memory over gRPC, with the
scripted upstream's own vectors under the [memory] model's name, so these
tests need nothing of the memory routes.

Five proxies share svc-auth, svc-memory and the database: C{memory}, where
recall works (a generous SVC_MEMORY_TIMEOUT, so that a loaded machine does
not make it time out); and one per fault, each at SVC_MEMORY_TIMEOUT=300ms:
C{slow} (its embedding model answers after 20 s), C{failing} (its
embedding model answers 500, and its fallback is never asked: decisions
D13 amended, "Vectors never mix"), C{down} (SVC_MEMORY_GRPC_ADDR where nothing
listens: svc-memory down) and C{unreachable} (an address that does not
answer at all). Each test works in an organization of its own, since the
settings are per organization and agent.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import grpc
import openai
import psycopg
import pytest
from authfixtures import Tenant, makeTenant
from gatewayfixtures import request, waitFor

from svcd.auth.store import Store
from svcd.common.permissions import Permission
from svcd.devkit.daemons import Daemon, authEnvironment, memoryEnvironment
from svcd.devkit.pgtemplate import migratedDatabase
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import RecordedRequest, ScriptedUpstream
from svcd.devkit.upstream.content import DEFAULT_EMBEDDING_DIMENSIONS, embeddingOf
from svcd.pb.memory.v1 import memory_pb2, memory_pb2_grpc
from svcd.proxy.recall import HEADING

# Starts real daemons (conftest.py, pytest.ini): left out of a quick run.
pytestmark = pytest.mark.e2e

# Never written anywhere but in a memory's content: no daemon's log may
# hold it, though recall put it in prompts.
MARKER = "zebracorn" + uuid.uuid4().hex[:12]

# The fault proxies' SVC_MEMORY_TIMEOUT, and the slow embedding's delay: an
# answer that waited for the embedding would take that long.
FAULT_TIMEOUT_MS = 300
SLOW_EMBEDDING_MS = 20_000
# The batched proxy's embedding model answers after this long: the recalls
# that come meanwhile wait to share the next call.
SHARED_EMBEDDING_MS = 2_000
# A bound on what a recall out of time may take, reactor lateness on a
# loaded machine included: far below SLOW_EMBEDDING_MS.
FAULT_BOUND_MS = 2_000

PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[models]]
name = "chat"
provider = "scripted"
upstream_model = "echo"
price = {{ input = "1", output = "2" }}

[[models]]
name = "embed"
provider = "scripted"
upstream_model = "{embedding}"
kind = "embedding"
price = {{ input = "0.5" }}
fallbacks = ["embed-spare"]

[[models]]
name = "embed-spare"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
price = {{ input = "0.5" }}

[memory]
embedding_model = "embed"
recall_k = 3
max_context_tokens = 200
"""

# The money test's provider answers the most each request allows (every
# byte of the body a prompt token, the output cap it was sent), and the
# embedding is the dear part: a recall's embedding costs thousands of times
# what its chat does, so a reservation without it would admit far more.
MONEY_PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[models]]
name = "chat"
provider = "scripted"
upstream_model = "usage-at-cap"
max_output_tokens = 8
price = {{ input = "1", output = "1" }}

[[models]]
name = "embed"
provider = "scripted"
upstream_model = "usage-at-cap"
kind = "embedding"
price = {{ input = "100000" }}

[memory]
embedding_model = "embed"
max_context_tokens = 200
"""


@attrs.frozen
class Stack:
    dsn: str
    redis: RedisServer
    owner: Store
    auth: Daemon
    memory: Daemon
    proxies: dict[str, Daemon]
    upstream: ScriptedUpstream

    def tenant(self, name: str) -> Tenant:
        return makeTenant(
            self.owner,
            f"{name}-{uuid.uuid4().hex[:8]}",
            permissions=int(Permission.ProxyChatCompletion),
        )

    def client(
        self,
        tenant: Tenant,
        proxy: str = "memory",
        headers: dict[str, str] | None = None,
        agent: uuid.UUID | None = None,
    ) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.proxies[proxy].httpPort}/v1",
            api_key=tenant.token,
            default_headers={"X-SVC-Agent-ID": str(agent or tenant.agentID), **(headers or {})},
            max_retries=0,
            timeout=60,
        )

    def remember(self, tenant: Tenant, *contents: str, subject: str = "") -> None:
        """
        Store C{contents} as memories of C{tenant}'s agent (and
        C{subject}), embedded as the proxy's [memory] model would.
        """
        address = f"127.0.0.1:{self.memory.environment['SVC_GRPC_PORT']}"
        with grpc.insecure_channel(address) as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            for content in contents:
                _, vector = embeddingOf(content, DEFAULT_EMBEDDING_DIMENSIONS)
                stub.AddMemory(
                    memory_pb2.AddMemoryRequest(
                        scope=memory_pb2.Scope(
                            org_id=str(tenant.orgID), agent_id=str(tenant.agentID), subject=subject
                        ),
                        content=content,
                        source="api",
                        embedding=memory_pb2.Embedding(model="embed", vector=vector),
                    ),
                    timeout=30,
                )

    def recallOn(self, tenant: Tenant, agent: bool | None = None, org: bool | None = True) -> None:
        """
        Set the organization's and the agent's recall switches (None:
        inherit).
        """
        self.owner.setMemorySettings(tenant.orgID, None, {"recall": org})
        self.owner.setMemorySettings(tenant.orgID, tenant.agentID, {"recall": agent})

    def proxyLines(self, proxy: str = "memory") -> list[dict[str, Any]]:
        return [
            json.loads(line)
            for line in self.proxies[proxy].output().splitlines()
            if line.startswith("{")
        ]

    def accessLine(self, requestID: str, proxy: str = "memory") -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def logged() -> bool:
            found[:] = [
                line
                for line in self.proxyLines(proxy)
                if line.get("request_id") == requestID and "status" in line
            ]
            return bool(found)

        waitFor(logged, 10)
        return found[0]

    def rows(self, requestID: str, count: int) -> list[dict[str, Any]]:
        """
        The ledger rows of C{requestID} (its own and those it caused),
        once there are C{count}.
        """
        found: list[dict[str, Any]] = []

        def recorded() -> bool:
            with psycopg.connect(self.dsn, autocommit=True) as connection:
                cursor = connection.execute(
                    "SELECT kind, parent_request_id, model, outcome, prompt_tokens,"
                    " completion_tokens, cost_nano_usd, memories FROM usage_ledger"
                    " WHERE request_id = %s",
                    (requestID,),
                )
                names = [column.name for column in cursor.description or ()]
                found[:] = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
            return len(found) >= count

        waitFor(recorded, 30)
        assert len(found) == count, found
        return found

    def received(self, requestID: str, path: str) -> list[RecordedRequest]:
        return [
            each
            for each in self.upstream.requests()
            if each.path.endswith(path) and each.header("x-request-id") == requestID
        ]

    def chatReceived(self, requestID: str) -> RecordedRequest:
        found: list[RecordedRequest] = []

        def arrived() -> bool:
            found[:] = self.received(requestID, "/chat/completions")
            return bool(found) and found[0].ended is not None

        waitFor(arrived, 10)
        [chat] = found
        return chat


def startProxy(
    name: str,
    workdir: Path,
    auth: Daemon,
    redis: RedisServer,
    providers: Path,
    memoryAddress: str,
    timeout: str,
    **more: str,
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
        "SVC_MEMORY_GRPC_ADDR": memoryAddress,
        "SVC_MEMORY_TIMEOUT": timeout,
        # Every line the proxy can write, for the content check.
        "SVC_LOG_LEVEL": "DEBUG",
        **more,
    }
    return Daemon("svc-proxy", environment, workdir / f"proxy-{name}.log").start()


@pytest.fixture(scope="module")
def stack(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("recall")
    name = f"recall_{uuid.uuid4().hex[:12]}"
    dsn = migratedDatabase(postgresServer, name)
    redis = RedisServer.create(workdir / "redis")
    redis.start()
    upstream = ScriptedUpstream(workdir / "upstream").start()
    connection = psycopg.connect(dsn, autocommit=True)
    owner = Store(lambda: contextlib.nullcontext(connection))
    daemons: list[Daemon] = []
    try:
        auth = Daemon("svc-auth", authEnvironment(dsn), workdir / "auth.log").start()
        daemons.append(auth)
        memory = Daemon(
            "svc-memory", memoryEnvironment(dsn, SVC_LOG_LEVEL="DEBUG"), workdir / "memory.log"
        ).start()
        daemons.append(memory)
        memoryAddress = f"127.0.0.1:{memory.environment['SVC_GRPC_PORT']}"
        files = {}
        for kind, embedding in (
            ("memory", "echo"),
            ("slow", f"slow:{SLOW_EMBEDDING_MS}"),
            ("failing", "status:500"),
            ("batched", f"slow:{SHARED_EMBEDDING_MS}"),
        ):
            files[kind] = workdir / f"providers-{kind}.toml"
            files[kind].write_text(PROVIDERS.format(base=upstream.baseURL, embedding=embedding))
        files["money"] = workdir / "providers-money.toml"
        files["money"].write_text(MONEY_PROVIDERS.format(base=upstream.baseURL))
        fault = f"{FAULT_TIMEOUT_MS}ms"
        proxies = {
            "memory": startProxy(
                "memory", workdir, auth, redis, files["memory"], memoryAddress, "30s"
            ),
            "slow": startProxy("slow", workdir, auth, redis, files["slow"], memoryAddress, fault),
            "failing": startProxy(
                "failing", workdir, auth, redis, files["failing"], memoryAddress, fault
            ),
            "down": startProxy(
                "down", workdir, auth, redis, files["memory"], f"127.0.0.1:{freePort()}", fault
            ),
            "money": startProxy(
                "money",
                workdir,
                auth,
                redis,
                files["money"],
                memoryAddress,
                "30s",
                SVC_BUDGET_RECONCILE_INTERVAL="1s",
            ),
            # One recall call in flight per organization: what comes
            # meanwhile shares the next.
            "batched": startProxy(
                "batched",
                workdir,
                auth,
                redis,
                files["batched"],
                memoryAddress,
                "30s",
                SVC_MEMORY_RECALL_CALLS="1",
            ),
            # TEST-NET-1 (RFC 5737): routed nowhere, so nothing ever answers.
            "unreachable": startProxy(
                "unreachable", workdir, auth, redis, files["memory"], "192.0.2.1:9092", fault
            ),
        }
        daemons += proxies.values()
        for daemon in daemons:
            daemon.waitForReady()
        yield Stack(dsn, redis, owner, auth, memory, proxies, upstream)
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
        upstream.stop()
        redis.destroy()
        connection.close()
        postgresServer.dropDatabase(name)
    for daemon in daemons:
        assert "Traceback" not in daemon.output(), daemon.output()


def ask(
    client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool = False
) -> tuple[dict[str, str], str]:
    """
    A chat completion through the SDK: the answer's headers (lower-case
    names) and its text (a stream's deltas joined).
    """
    raw = client.chat.completions.with_raw_response.create(
        model="chat",
        messages=messages,  # type: ignore[arg-type]
        stream=stream,
    )
    headers = {name.lower(): value for name, value in raw.headers.items()}
    parsed: Any = raw.parse()
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in parsed if chunk.choices)
    else:
        text = parsed.choices[0].message.content or ""
    return headers, text


def waitForRecall(stack: Stack, client: openai.OpenAI, on: bool) -> None:
    """
    Wait for a settings change to reach the proxy (the change feed, within
    a second): until an answer carries X-SVC-Memories (or no longer does).
    """

    def reached() -> bool:
        headers, _ = ask(client, [{"role": "user", "content": "hello"}])
        return ("x-svc-memories" in headers) is on

    waitFor(reached, 15)


def memoryLines(content: str) -> list[str]:
    """
    The memories of a message of memories (decisions D13, amended), best
    first, after checking its shape: the heading, the block's two tag
    lines, one JSON object a line between them dated today (UTC: every
    memory here was just written), the contents as they were stored.
    """
    lines = content.split("\n")
    assert lines[:2] == [HEADING, "<memories>"] and lines[-1] == "</memories>"
    today = datetime.datetime.now(datetime.UTC).date()
    found = []
    for line in lines[2:-1]:
        memory = json.loads(line)
        assert set(memory) == {"date", "memory"}
        written = datetime.date.fromisoformat(memory["date"])
        # Written earlier in this test run, perhaps just before midnight.
        assert today - datetime.timedelta(days=1) <= written <= today
        found.append(memory["memory"])
    return found


def test_recallAssemblesTheMemories(stack: Stack) -> None:
    """
    With recall on, the provider receives one system message of the
    memories near the last user message, after the leading system and
    developer messages, best first, each one JSON line of the block; the
    answer says how many (X-SVC-Memories); the query's embedding is one
    ledger row of kind embedding whose parent is the chat's request id;
    the access log says memories and memory_ms.
    """
    tenant = stack.tenant("assembles")
    stack.remember(
        tenant,
        f"the user drinks green tea every morning {MARKER}",
        "the user\nlikes green apples",
        "quantum chromodynamics lecture notes",
    )
    stack.recallOn(tenant)
    client = stack.client(tenant)
    waitForRecall(stack, client, on=True)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "which green tea does the user drink every morning"},
    ]
    headers, _ = ask(client, messages)
    requestID = headers["x-request-id"]
    assert headers["x-svc-memories"] == "2"
    sent = stack.chatReceived(requestID).body
    assert sent["messages"][:2] == messages[:2]
    assert sent["messages"][3:] == messages[2:]
    inserted = sent["messages"][2]
    assert inserted["role"] == "system"
    assert memoryLines(inserted["content"]) == [
        f"the user drinks green tea every morning {MARKER}",
        "the user\nlikes green apples",
    ]
    [embedded] = stack.received(requestID, "/embeddings")
    assert embedded.body["input"] == ["which green tea does the user drink every morning"]
    byKind = {row["kind"]: row for row in stack.rows(requestID, 2)}
    assert byKind["embedding"]["parent_request_id"] == requestID
    assert byKind["embedding"]["model"] == "embed"
    assert byKind["embedding"]["outcome"] == "ok"
    assert byKind["chat"]["parent_request_id"] is None
    assert (byKind["chat"]["memories"], byKind["embedding"]["memories"]) == (2, None)
    line = stack.accessLine(requestID)
    assert (line["memories"], line["memory_outcome"]) == (2, "ok")
    assert 0 <= line["memory_ms"] < 30_000
    assert 0 <= line["memory_embedding_ms"] <= line["memory_ms"]


def test_recallInStreams(stack: Stack) -> None:
    """
    A stream recalls alike: the header is among the stream's first bytes,
    and the provider receives the assembled messages (here the message of
    memories goes first: the request has no system message).
    """
    tenant = stack.tenant("streams")
    stack.remember(tenant, "the user owns a red bicycle")
    stack.recallOn(tenant)
    client = stack.client(tenant)
    waitForRecall(stack, client, on=True)
    headers, text = ask(client, [{"role": "user", "content": "which bicycle"}], stream=True)
    assert text.startswith("Scripted answer to 2 messages")
    assert headers["x-svc-memories"] == "1"
    sent = stack.chatReceived(headers["x-request-id"]).body
    assert sent["stream"] is True
    first, user = sent["messages"]
    assert memoryLines(first["content"]) == ["the user owns a red bicycle"]
    assert user == {"role": "user", "content": "which bicycle"}


def test_settingsAndHeader(stack: Stack) -> None:
    """
    Recall follows the settings, an agent's winning over its
    organization's, and X-SVC-Memory: off turns it off for one request:
    without recall, no embedding, no header and the messages as sent.
    """
    tenant = stack.tenant("settings")
    stack.remember(tenant, "the user speaks Italian")
    question = [{"role": "user", "content": "what does the user speak"}]
    client = stack.client(tenant)
    # Another agent of the organization, which inherits: it shows when the
    # organization's setting has reached the proxy.
    other = stack.client(
        tenant, agent=stack.owner.createAgent(tenant.orgID, "settings-other").agentID
    )
    # Organization on, agent off: off. (The agent's row first: the change
    # feed keeps the commit order.)
    stack.owner.setMemorySettings(tenant.orgID, tenant.agentID, {"recall": False})
    stack.owner.setMemorySettings(tenant.orgID, None, {"recall": True})
    waitForRecall(stack, other, on=True)
    headers, _ = ask(client, question)
    assert "x-svc-memories" not in headers
    assert stack.received(headers["x-request-id"], "/embeddings") == []
    assert stack.chatReceived(headers["x-request-id"]).body["messages"] == question
    # Organization off, agent on: on.
    stack.owner.setMemorySettings(tenant.orgID, tenant.agentID, {"recall": True})
    stack.owner.setMemorySettings(tenant.orgID, None, {"recall": False})
    waitForRecall(stack, other, on=False)
    headers, _ = ask(client, question)
    assert headers["x-svc-memories"] == "1"
    # The request's own off.
    headers, _ = ask(stack.client(tenant, headers={"X-SVC-Memory": "off"}), question)
    assert "x-svc-memories" not in headers
    assert stack.received(headers["x-request-id"], "/embeddings") == []
    assert stack.chatReceived(headers["x-request-id"]).body["messages"] == question
    # Any other value is refused, nothing forwarded.
    with pytest.raises(openai.BadRequestError) as refused:
        ask(stack.client(tenant, headers={"X-SVC-Memory": "on"}), question)
    assert refused.value.body["code"] == "VALIDATION_ERROR"  # type: ignore[index]
    # Both off again: off.
    stack.recallOn(tenant, org=None, agent=None)
    waitForRecall(stack, client, on=False)


def test_subjectsAndNothingToRecall(stack: Stack) -> None:
    """
    A subject's memories are recalled for that subject only; a request
    without a user message's text recalls nothing (0, no embedding); a
    bad subject header is 400.
    """
    tenant = stack.tenant("subjects")
    stack.remember(tenant, "the user collects stamps", subject="user-1")
    stack.recallOn(tenant)
    client = stack.client(tenant)
    waitForRecall(stack, client, on=True)
    question = [{"role": "user", "content": "what does the user collect"}]
    headers, _ = ask(stack.client(tenant, headers={"X-SVC-Memory-Subject": "user-1"}), question)
    assert headers["x-svc-memories"] == "1"
    headers, _ = ask(stack.client(tenant, headers={"X-SVC-Memory-Subject": "user-2"}), question)
    assert headers["x-svc-memories"] == "0"
    headers, _ = ask(client, question)
    assert headers["x-svc-memories"] == "0"
    headers, _ = ask(client, [{"role": "system", "content": "Say hello."}])
    assert headers["x-svc-memories"] == "0"
    assert stack.received(headers["x-request-id"], "/embeddings") == []
    # Nothing was asked of memory: no outcome.
    line = stack.accessLine(headers["x-request-id"])
    assert (line["memories"], line["memory_outcome"], line["memory_embedding_ms"]) == (
        0,
        None,
        None,
    )
    with pytest.raises(openai.BadRequestError):
        ask(stack.client(tenant, headers={"X-SVC-Memory-Subject": "no spaces"}), question)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("proxy", ["slow", "failing", "down", "unreachable"])
def test_faultsNeverBlock(stack: Stack, proxy: str, stream: bool) -> None:
    """
    The embedding model slow past SVC_MEMORY_TIMEOUT or failing (its
    fallback, whose vectors are not the memories', never asked: it
    answered, and the recall searched with its vector),
    svc-memory down or its address unreachable: the chat is answered as if
    memory were off (the messages as sent), with X-SVC-Memories:
    unavailable, the recall taking no longer than its deadline.
    """
    tenant = stack.tenant(f"{proxy}-{stream}")
    stack.recallOn(tenant)
    client = stack.client(tenant, proxy=proxy)
    question = [{"role": "user", "content": "what does the user like"}]

    def reached() -> bool:
        headers, _ = ask(client, question)
        return "x-svc-memories" in headers

    waitFor(reached, 15)
    started = time.monotonic()
    headers, text = ask(client, question, stream=stream)
    elapsed = (time.monotonic() - started) * 1000
    assert headers["x-svc-memories"] == "unavailable"
    assert text.startswith("Scripted answer to 1 messages")
    requestID = headers["x-request-id"]
    assert stack.chatReceived(requestID).body["messages"] == question
    line = stack.accessLine(requestID, proxy)
    assert line["status"] == 200
    # The access log and the chat's row agree that no memory went in
    # (decisions D13: the memories injected); the log also says why: out
    # of time (a silent address: its call's own deadline, a hair later
    # than the recall's, may be delivered first) or failed.
    assert line["memories"] == 0
    assert line["memory_outcome"] in {
        "slow": ("timeout",),
        "unreachable": ("timeout", "error"),
    }.get(proxy, ("error",))
    assert line["memory_ms"] < FAULT_BOUND_MS
    assert elapsed < SLOW_EMBEDDING_MS / 2
    # The embedding's row says how it ended (cancelled at the deadline,
    # failed, or made before svc-memory failed).
    byKind = {row["kind"]: row for row in stack.rows(requestID, 2)}
    assert byKind["chat"]["memories"] == 0
    assert byKind["embedding"]["outcome"] == {
        "slow": "client_gone",
        "failing": "upstream_error",
    }.get(proxy, "ok")
    assert byKind["embedding"]["model"] == "embed"
    if proxy == "slow":
        # Out of time, not failed: the deadline passed.
        assert line["memory_ms"] >= FAULT_TIMEOUT_MS * 0.9


def test_busyRecallsShareTheirCalls(stack: Stack) -> None:
    """
    Recalls that come while their organization's embedding is in flight
    (SVC_MEMORY_RECALL_CALLS=1 here) wait for it and then share one
    embedding request and one SearchMany: each chat still gets its own
    query's memory, each has its one embedding row (its parent the chat),
    and the shared request's rows add up to the tokens the provider
    counted for it.
    """
    tenant = stack.tenant("shares")
    topics = ["violin", "kayak", "pottery", "telescope", "origami"]
    # The first memory carries the marker that no daemon's log may hold
    # (test_memoryContentNeverLogged): recalls that share calls log no
    # more of it than the others.
    contents = {topic: f"the user practises {topic} on sundays" for topic in topics}
    contents[topics[0]] += f" {MARKER}"
    stack.remember(tenant, *contents.values())
    stack.recallOn(tenant)
    client = stack.client(tenant, proxy="batched")
    waitForRecall(stack, client, on=True)
    stack.upstream.clearRequests()

    def embeddingsOf(texts: set[str]) -> list[RecordedRequest]:
        return [
            each
            for each in stack.upstream.requests()
            if each.path.endswith("/embeddings") and set(each.body["input"]) & texts
        ]

    # Each question is nearest its own memory, and near the others.
    questions = [f"the user practises {topic}" for topic in topics]
    with ThreadPoolExecutor(len(topics)) as pool:
        first = pool.submit(ask, client, [{"role": "user", "content": questions[0]}])
        # The others are sent while the first's embedding is in flight.
        waitFor(lambda: bool(embeddingsOf({questions[0]})), 10)
        rest = [
            pool.submit(ask, client, [{"role": "user", "content": question}])
            for question in questions[1:]
        ]
        answers = [first.result()] + [each.result() for each in rest]
    for topic, (headers, _) in zip(topics, answers, strict=True):
        # recall_k memories, its own question's first.
        assert headers["x-svc-memories"] == "3"
        sent = stack.chatReceived(headers["x-request-id"]).body
        lines = memoryLines(sent["messages"][0]["content"])
        assert lines[0] == contents[topic]
        assert len(lines) == 3
    embedded = embeddingsOf(set(questions))
    inputs = [text for each in embedded for text in each.body["input"]]
    assert sorted(inputs) == sorted(questions)
    shared = [each for each in embedded if len(each.body["input"]) > 1]
    assert shared, [each.body["input"] for each in embedded]
    rowsByQuestion = {}
    for question, (headers, _) in zip(questions, answers, strict=True):
        requestID = headers["x-request-id"]
        byKind = {row["kind"]: row for row in stack.rows(requestID, 2)}
        assert byKind["embedding"]["parent_request_id"] == requestID
        assert byKind["embedding"]["outcome"] == "ok"
        assert byKind["chat"]["memories"] == 3
        rowsByQuestion[question] = byKind["embedding"]
    for sharedRequest in shared:
        # The scripted provider counts every word of the inputs.
        counted = sum(len(text.split()) for text in sharedRequest.body["input"])
        assert (
            sum(rowsByQuestion[text]["prompt_tokens"] for text in sharedRequest.body["input"])
            == counted
        )


def redisCLI(redis: RedisServer, *words: str) -> str:
    cli = shutil.which("redis-cli")
    assert cli is not None, "redis-cli (Debian's redis-tools, beside redis-server)"
    done = subprocess.run(
        [cli, "-h", "127.0.0.1", "-p", str(redis.port), "--raw", *words],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return done.stdout.strip()


def budgetCounter(stack: Stack, tenant: Tenant) -> int | None:
    """
    The Redis count of the organization's monthly budget.
    """
    today = datetime.datetime.now(datetime.UTC)
    start = datetime.datetime(today.year, today.month, 1, tzinfo=datetime.UTC)
    value = redisCLI(
        stack.redis, "GET", f"budget:{{{tenant.orgID}}}:month:{int(start.timestamp())}"
    )
    return int(value) if value else None


def orgSpend(stack: Stack, tenant: Tenant) -> tuple[int, int]:
    """
    The organization's rows in the ledger and their total cost.
    """
    with psycopg.connect(stack.dsn, autocommit=True) as connection:
        count, total = connection.execute(
            "SELECT count(*), coalesce(sum(cost_nano_usd), 0) FROM usage_ledger WHERE org_id = %s",
            (tenant.orgID,),
        ).fetchone() or (0, 0)
    return int(count), int(total)


def test_aBudgetCountsTheRecallsEmbedding(stack: Stack) -> None:
    """
    Decisions D12 amended and D13: a recall's embedding is the
    organization's spend, reserved with its chat at admission and settled
    with it. The provider answers each call at its worst case and the
    embedding is the dear part: a budget of three and a half recalling
    requests admits three of twelve sent at once (were the embedding not
    reserved, each would reserve a thousandth of what it costs, and all
    twelve would pass), and the ledger (chat and embedding rows)
    stays within it. The budget's counter then equals the ledger: the
    embedding, held under the chat's reservation until the chat's row is
    recorded, is counted once.
    """
    question = {
        "model": "chat",
        "messages": [{"role": "user", "content": "which tea does the user like"}],
    }
    body = json.dumps(question).encode()

    def post(tenant: Tenant) -> Any:
        return request(
            stack.proxies["money"].httpPort,
            "POST",
            "/v1/chat/completions",
            {
                "Authorization": f"Bearer {tenant.token}",
                "X-SVC-Agent-ID": str(tenant.agentID),
                "Content-Type": "application/json",
            },
            body,
            timeout=60,
        )

    # What one recalling request costs, at the worst its provider answers.
    probe = stack.tenant("money-probe")
    stack.remember(probe, "the user likes jasmine tea")
    stack.recallOn(probe)
    stack.owner.setBudget(probe.orgID, None, 10**15, "month")

    def probed() -> bool:
        return bool(post(probe).headers.get("x-svc-memories") == "1")

    waitFor(probed, 15)
    requestID = post(probe).headers["x-request-id"]
    # The body a budget measured at admission is not the one sent once
    # memories went in: the provider receives the assembled messages.
    sent = stack.chatReceived(requestID).body
    assert memoryLines(sent["messages"][0]["content"]) == ["the user likes jasmine tea"]
    assert sent["messages"][1:] == question["messages"]
    costs = {row["kind"]: row["cost_nano_usd"] for row in stack.rows(requestID, 2)}
    each = costs["chat"] + costs["embedding"]
    assert costs["embedding"] > 1000 * costs["chat"], costs

    tenant = stack.tenant("money")
    stack.remember(tenant, "the user likes jasmine tea")
    stack.recallOn(tenant)
    # Room for three and a half: the reservation is a little more than
    # what a request costs (the message of memories at its bound).
    budget = 3 * each + each // 2
    stack.owner.setBudget(tenant.orgID, None, budget, "month")
    # The budget has reached the proxy once a limits row set after it has
    # (the change feed keeps the commit order), which the auth probe's
    # X-RateLimit-Limit shows without spending anything.
    stack.owner.setLimits(tenant.orgID, None, {"rpm": 12345})

    def seen() -> bool:
        answer = request(
            stack.proxies["money"].httpPort,
            "GET",
            "/v1/internal/auth-probe",
            {"Authorization": f"Bearer {tenant.token}", "X-SVC-Agent-ID": str(tenant.agentID)},
        )
        return bool(answer.headers.get("x-ratelimit-limit") == "12345")

    waitFor(seen, 15)
    ready = threading.Barrier(12)

    def send(_: int) -> Any:
        ready.wait(timeout=30)
        return post(tenant)

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(send, range(12)))
    admitted = [answer for answer in answers if answer.status == 200]
    for answer in answers:
        if answer.status != 200:
            assert answer.status == 429, answer.body
            assert answer.json()["error"]["code"] == "BUDGET_EXCEEDED"
    assert len(admitted) == 3, [answer.status for answer in answers]
    assert all(answer.headers["x-svc-memories"] == "1" for answer in admitted)
    rows = 0
    total = 0

    def recorded() -> bool:
        nonlocal rows, total
        rows, total = orgSpend(stack, tenant)
        return rows == 2 * len(admitted)

    waitFor(recorded, 30)
    assert total <= budget
    # Counted once: the counter comes to the ledger's total and stays
    # there through reconciliations (every second on this proxy).
    waitFor(lambda: budgetCounter(stack, tenant) == total, 15)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert budgetCounter(stack, tenant) == total
        time.sleep(0.2)


def test_recallMetrics(stack: Stack) -> None:
    """
    svc_proxy_memory_recalls_total counts each recall by outcome.
    """

    def count(proxy: str, outcome: str) -> float:
        answer = request(stack.proxies[proxy].httpPort, "GET", "/metrics")
        for line in answer.body.decode().splitlines():
            if line.startswith(f'svc_proxy_memory_recalls_total{{outcome="{outcome}"}}'):
                return float(line.split()[-1])
        raise AssertionError(f"no series for {outcome}")

    assert count("memory", "ok") >= 1
    assert count("memory", "empty") >= 1
    assert count("slow", "timeout") >= 1
    assert count("failing", "error") >= 1
    assert count("down", "error") >= 1


def test_memoryContentNeverLogged(stack: Stack) -> None:
    """
    The marker stored in a memory, which recall put in prompts above, is
    in no daemon's log (run last in this module).
    """
    for daemon in (stack.auth, stack.memory, *stack.proxies.values()):
        assert MARKER not in daemon.output(), daemon.plugin
