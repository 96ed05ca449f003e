"""
Observations of chat completions end to end (decisions D13, issue 33):
real svc-auth, svc-memory, svc-worker and svc-proxy daemons over
PostgreSQL and Redis, the scripted model server answering the chats (its
echo), the extraction (the first-person sentences of the user's turn) and
the embeddings; chats sent with the C{openai} SDK.

With observe all, a chat (plain or streamed) becomes an observation the
worker turns into memories; with observe off, or C{X-SVC-Memory: off},
nothing is queued. With observe on (decisions D13 amended, "Whose
words"), only a chat that names its subject is observed, into that
subject; one that names none is answered as usual, counted no_subject,
and nothing of it is queued. svc-memory down during a chat leaves the answer as it
is, and the observation reaches svc-memory once it is back; a proxy
stopped with observations unacknowledged keeps them in SVC_MEMORY_JOURNAL
and sends them at its next start, and sent again they are still stored
once. The facts carry a marker that no daemon's log may hold, nor the
proxy's memory journal once svc-memory has acknowledged them.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import openai
import pytest
from authfixtures import Tenant, makeTenant
from authhelpers import document, svcctl
from workerfixtures import WorkerRig, WorkerStack, runningWorkerStack, waitUntil

from svcd.devkit.daemons import Daemon
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.servers import freePort

# Starts real daemons (conftest.py, pytest.ini): left out of a quick run.
pytestmark = pytest.mark.e2e

# Only ever in what a user tells the gateway: no daemon's log may hold it,
# though it travels through the proxy, svc-memory and the worker.
MARKER = "quokkafact" + uuid.uuid4().hex[:10]


# Each chat's facts are told apart by words of their own (a UUID's five
# parts): the scripted embedding is a bag of words, under which facts that
# differ by one word are near enough for the worker to take them for one.
LABELS: dict[str, str] = {}


def label(name: str) -> str:
    return LABELS.setdefault(name, str(uuid.uuid4()))


def factsOf(name: str, count: int = 2) -> str:
    """
    A user's turn stating C{count} facts particular to C{name} (each
    carrying the marker), and a question, which extraction leaves out.
    """
    facts = " ".join(f"My fact number {n} is {MARKER}-{label(name)}-{n}." for n in range(count))
    return f"{facts} What do you think?"


def expectedFacts(names: list[str], count: int = 2) -> list[str]:
    return sorted(
        f"My fact number {n} is {MARKER}-{label(each)}-{n}." for each in names for n in range(count)
    )


# The proxies a test started, stopped after it whatever happened.
PROXIES: list[Daemon] = []


def startProxy(rig: WorkerRig, name: str, journal: Path, **more: str) -> Daemon:
    """
    An svc-proxy on the rig's svc-auth, svc-memory and Redis with memory
    on (the rig's providers file has a [memory] table; its C{extractor}
    model answers chats as the scripted echo) and SVC_MEMORY_JOURNAL, at
    DEBUG so that every line it can write is checked for the marker.
    """
    environment = {
        "SVC_HOST": "127.0.0.1",
        "SVC_PORT": str(freePort()),
        "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{rig.auth.environment['SVC_GRPC_PORT']}",
        "SVC_MEMORY_GRPC_ADDR": f"127.0.0.1:{rig.memory.environment['SVC_GRPC_PORT']}",
        "REDIS_URL": rig.redis.url,
        "SVC_PROVIDERS_FILE": str(rig.providers),
        "SVC_AUTH_VALIDATE_TIMEOUT": "5s",
        "SVC_RATE_LIMIT_DEFAULT_RPM": "1000000",
        "SVC_SHUTDOWN_TIMEOUT": "5s",
        "SVC_MEMORY_JOURNAL": str(journal),
        "SVC_USAGE_JOURNAL": str(journal.with_name(f"{name}-usage.journal")),
        "SVC_LOG_LEVEL": "DEBUG",
        **more,
    }
    daemon = Daemon("svc-proxy", environment, rig.workdir / f"{name}.log").start()
    PROXIES.append(daemon)
    daemon.waitForReady()
    return daemon


def client(proxy: Daemon, tenant: Tenant, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{proxy.httpPort}/v1",
        api_key=tenant.token,
        default_headers={"X-SVC-Agent-ID": str(tenant.agentID), **headers},
        max_retries=0,
        timeout=60,
    )


def chat(
    proxy: Daemon,
    tenant: Tenant,
    text: str,
    stream: bool = False,
    headers: dict[str, str] | None = None,
    requestID: str | None = None,
) -> tuple[str, str]:
    """
    One chat completion through the SDK, with a request id of our own (a
    new one unless given): that id and the answer's text (a stream's
    deltas joined).
    """
    requestID = requestID or str(uuid.uuid4())
    sdk = client(proxy, tenant, **{"X-Request-ID": requestID, **(headers or {})})
    messages: Any = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": text},
    ]
    if stream:
        chunks = sdk.chat.completions.create(model="extractor", messages=messages, stream=True)
        answer = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    else:
        completion = sdk.chat.completions.create(model="extractor", messages=messages)
        answer = completion.choices[0].message.content or ""
    assert answer.startswith("Scripted answer to 3 messages"), answer
    return requestID, answer


def metric(daemon: Daemon, line: str) -> float:
    """
    The value of the series named exactly C{line} on C{daemon}'s /metrics
    (0 when absent).
    """
    for each in daemon.get("/metrics")[1].decode().splitlines():
        name, _, value = each.rpartition(" ")
        if name == line:
            return float(value)
    return 0.0


FAULTY_MODELS = """
[[models]]
name = "failing"
provider = "scripted"
upstream_model = "status:500"

[[models]]
name = "broken-stream"
provider = "scripted"
upstream_model = "close-mid-stream"
"""

RECORDED = 'svc_proxy_memory_observations_total{outcome="recorded"}'
NO_SUBJECT = 'svc_proxy_memory_observations_total{outcome="no_subject"}'
SENT = "svc_proxy_memory_observations_sent_total"


def sourcesOf(rig: WorkerRig, tenant: Tenant | None = None) -> dict[str, list[str]]:
    """
    The memories of the tenant's agent by the request id they came from.
    """
    found: dict[str, list[str]] = {}
    for memory in rig.memories(tenant):
        found.setdefault(str(memory["source_request_id"]), []).append(memory["content"])
    return found


def journalsHolding(directory: Path, text: str) -> list[str]:
    """
    The files of the memory journal (C{memory.journal} and what a rewrite
    puts beside it) whose raw bytes hold C{text}.
    """
    needle = text.encode("utf-8")
    holding = []
    for each in directory.glob("memory.journal*"):
        try:
            if needle in each.read_bytes():
                holding.append(each.name)
        except FileNotFoundError:
            # A rewrite's copy, renamed as we looked.
            continue
    return sorted(holding)


def allLogs(rig: WorkerRig, *proxies: Daemon) -> str:
    return "\n".join([rig.logs(), *(each.output() for each in proxies)])


@pytest.fixture(scope="module")
def stack(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerStack]:
    """
    One svc-auth, svc-memory, Redis and scripted model server for the
    module's tests (as test_worker_daemon.py has): each test's rig has its
    own organization, providers file, worker and proxies. Started per
    test, the stack was a quarter of the module's CPU (9 of 42 s). A test
    that stops svc-memory starts it again, and the stack keeps that one
    (L{WorkerStack.rig}).
    """
    with runningWorkerStack(postgresServer, tmp_path_factory.mktemp("observestack")) as running:
        yield running


@pytest.fixture
def rig(stack: WorkerStack, tmp_path: Path) -> Iterator[WorkerRig]:
    """
    A rig on the module's stack with one svc-worker; the rig's tenant has
    observe all for its organization (its chats name no subject: an agent
    that serves one user), set before any proxy starts (a proxy starts
    from the change feed's snapshot, so it knows the setting from its
    first request). The scripted model server's record of requests starts
    empty, as it did with a stack of the test's own.
    """
    stack.upstream.clearRequests()
    with stack.rig(tmp_path) as running:
        # Two more chat models: one that fails, one whose stream breaks.
        with running.providers.open("a") as providers:
            providers.write(FAULTY_MODELS)
        running.owner.setMemorySettings(running.tenant.orgID, None, {"observe": "all"})
        running.startWorker()
        try:
            yield running
        finally:
            while PROXIES:
                PROXIES.pop().terminate()


def test_chatsBecomeMemoriesOnlyWhenObserved(rig: WorkerRig) -> None:
    """
    With observe all, a plain chat and a streamed one each become an
    observation (the user's turn after the last assistant message, under
    the chat's request id) that the worker turns into one memory per fact,
    source C{extracted}. A chat whose provider failed, a stream broken
    after its first byte, a chat that says C{X-SVC-Memory: off}, and one of
    an organization with observe off, queue nothing: the proxy counts only
    the observed ones, and once a later observed chat's memories are
    stored, the earlier unobserved ones are neither memories nor waiting.
    No daemon's log holds a word the user said.
    """
    proxy = startProxy(rig, "proxy", rig.workdir / "memory.journal")
    silent = makeTenant(rig.owner, "silent")
    plain, _ = chat(proxy, rig.tenant, factsOf("plain"))
    streamed, answer = chat(proxy, rig.tenant, factsOf("streamed"), stream=True)
    assert answer.startswith("Scripted answer")
    # Each fact is a memory of its own, added one after the other: waited
    # for whole.
    waitUntil(
        lambda: rig.contents() == expectedFacts(["plain", "streamed"]),
        "the observed chats' memories",
        60,
    )
    memories = rig.memories()
    assert set(sourcesOf(rig)) == {plain, streamed}
    assert {each["source"] for each in memories} == {"extracted"}
    assert sorted(sourcesOf(rig)[plain]) == expectedFacts(["plain"])

    # Answers that did not end ok are not observed: a provider's error,
    # and a stream broken after its first byte.
    sdk = client(proxy, rig.tenant)
    with pytest.raises(openai.APIStatusError):
        sdk.chat.completions.create(
            model="failing", messages=[{"role": "user", "content": factsOf("failing")}]
        )
    with pytest.raises(openai.APIError):
        for _ in sdk.chat.completions.create(
            model="broken-stream",
            messages=[{"role": "user", "content": factsOf("broken")}],
            stream=True,
        ):
            pass
    headerOff, _ = chat(proxy, rig.tenant, factsOf("header-off"), headers={"X-SVC-Memory": "off"})
    settingOff, _ = chat(proxy, silent, factsOf("setting-off"))
    later, _ = chat(proxy, rig.tenant, factsOf("later"))
    waitUntil(
        lambda: rig.contents() == expectedFacts(["plain", "streamed", "later"]),
        "the later chat's memories",
        60,
    )
    waitUntil(lambda: metric(proxy, SENT) == 3, "three observations acknowledged")
    # D13, amended: what svc-memory acknowledged leaves the proxy's memory
    # journal, and any copy beside it, within a second.
    waitUntil(
        lambda: not journalsHolding(rig.workdir, MARKER),
        "the acknowledged observations gone from the memory journal",
        1.0,
    )
    assert metric(proxy, RECORDED) == 3
    assert set(sourcesOf(rig)) == {plain, streamed, later}
    assert sourcesOf(rig, silent) == {}
    waiting = {str(each["request_id"]) for each in rig.observations()}
    waiting |= {str(each["request_id"]) for each in rig.observations(silent)}
    assert not waiting & {headerOff, settingOff}, waiting
    extractions = [
        each
        for each in rig.upstream.requests()
        if each.path.endswith("/chat/completions") and "response_format" in each.body
    ]
    assert len(extractions) == 3
    # The streamed answer's text, gathered from its deltas, is the
    # observation's assistant message; the turn before the last assistant
    # message is not observed.
    [streamedTurn] = [
        json.loads(each.body["messages"][1]["content"])["conversation"]
        for each in extractions
        if label("streamed") in each.body["messages"][1]["content"]
    ]
    assert streamedTurn == [
        {"role": "user", "content": factsOf("streamed")},
        {"role": "assistant", "content": answer},
    ]
    assert MARKER not in allLogs(rig, proxy)


def test_observeOnTakesOnlyChatsThatNameASubject(rig: WorkerRig) -> None:
    """
    Decisions D13 amended, "Whose words". An organization with observe on
    (its agent serves many users): a chat that names no subject, plain or
    streamed, is answered as usual and counted no_subject, and nothing of
    it is queued, extracted or remembered; one that names its subject
    becomes memories of that subject. An organization with observe all
    (its agent serves one user): a chat that names none becomes memories
    of the shared subject "". No daemon's log holds a word the user said.
    """
    strict = makeTenant(rig.owner, "many-users")
    rig.owner.setMemorySettings(strict.orgID, None, {"observe": "on"})
    single = makeTenant(rig.owner, "one-user")
    rig.owner.setMemorySettings(single.orgID, None, {"observe": "all"})
    proxy = startProxy(rig, "proxy", rig.workdir / "memory.journal")
    subject = {"X-SVC-Memory-Subject": "alice@example.com"}

    anonymous, answer = chat(proxy, strict, factsOf("anonymous"))
    assert answer.startswith("Scripted answer")
    assert (metric(proxy, NO_SUBJECT), metric(proxy, RECORDED)) == (1, 0)
    streamed, _ = chat(proxy, strict, factsOf("anonymous-stream"), stream=True)
    assert (metric(proxy, NO_SUBJECT), metric(proxy, RECORDED)) == (2, 0)
    named, _ = chat(proxy, strict, factsOf("named"), headers=subject)
    shared, _ = chat(proxy, single, factsOf("one-user"))
    assert (metric(proxy, NO_SUBJECT), metric(proxy, RECORDED)) == (2, 2)
    waitUntil(
        lambda: (
            rig.contents(strict, "alice@example.com") == expectedFacts(["named"])
            and rig.contents(single) == expectedFacts(["one-user"])
        ),
        "the observed chats' memories",
        60,
    )
    waitUntil(lambda: metric(proxy, SENT) == 2, "two observations acknowledged")
    assert rig.contents(strict) == []
    assert rig.observations(strict) == []
    processed = rig.query(
        "SELECT request_id FROM memory_observations_done WHERE org_id = %s", (strict.orgID,)
    )
    assert [each["request_id"] for each in processed] == [named]
    assert {each["source_request_id"] for each in rig.memories(single)} == {shared}
    extracted = [
        each.body["messages"][1]["content"]
        for each in rig.upstream.requests()
        if each.path.endswith("/chat/completions") and "response_format" in each.body
    ]
    assert len(extracted) == 2
    assert not [each for each in extracted if label("anonymous") in each]
    assert not [each for each in extracted if label("anonymous-stream") in each]
    assert {anonymous, streamed}.isdisjoint(each["request_id"] for each in rig.observations(strict))
    assert MARKER not in allLogs(rig, proxy)
    assert "alice@example.com" not in allLogs(rig, proxy)


def test_chatsThatShareAClientsRequestIDAreEachObserved(rig: WorkerRig) -> None:
    """
    Clients reuse request ids (an application hands its own inbound
    X-Request-ID to every call it makes): three chats that carry the same
    one, a plain one, a stream and one of another agent of the
    organization, are three observations, each becoming its memories;
    each memory names that request id as its source. Observations are
    keyed by the gateway's own id for each request (sql/0015); keyed by
    the client's, the second and third were answered as queued before and
    never processed.
    """
    proxy = startProxy(rig, "proxy", rig.workdir / "memory.journal")
    shared = str(uuid.uuid4())
    other = attrs.evolve(
        rig.tenant, agentID=rig.owner.createAgent(rig.tenant.orgID, "second").agentID
    )
    chat(proxy, rig.tenant, factsOf("first-turn"), requestID=shared)
    chat(proxy, rig.tenant, factsOf("second-turn"), stream=True, requestID=shared)
    chat(proxy, other, factsOf("other-agent"), requestID=shared)
    waitUntil(
        lambda: (
            rig.contents() == expectedFacts(["first-turn", "second-turn"])
            and rig.contents(other) == expectedFacts(["other-agent"])
        ),
        "every chat's memories",
        60,
    )
    assert set(sourcesOf(rig)) == {shared}
    assert set(sourcesOf(rig, other)) == {shared}
    waitUntil(lambda: metric(proxy, SENT) == 3, "three observations acknowledged")


def test_svcMemoryAwayAndProxyRestartsLoseNothingAndStoreOnce(rig: WorkerRig) -> None:
    """
    svc-memory down during a chat: the answer comes as usual, at once, and
    the observation waits in the proxy until svc-memory is back, then
    becomes its memories. Observations unacknowledged when the proxy stops
    stay in its memory journal and are sent at its next start; the same
    journal replayed once more (as after a kill before the acknowledgement
    was journalled) sends them again, and svc-memory, which remembers them
    as processed, queues none of them: no second extraction, every fact
    still one memory, the same one.
    """
    journal = rig.workdir / "memory.journal"
    proxy = startProxy(rig, "proxy", journal, SVC_SHUTDOWN_TIMEOUT="2s")
    memoryEnvironment = dict(rig.memory.environment)
    memoryLog = rig.memory.logFile

    def restartMemory() -> None:
        rig.memory = Daemon("svc-memory", memoryEnvironment, memoryLog).start()
        rig.memory.waitForReady()

    assert rig.memory.terminate() == 0
    began = time.monotonic()
    away, _ = chat(proxy, rig.tenant, factsOf("away"))
    # The answer waited for nothing of memory's (recall is off; observing
    # never waits): well within what svc-memory's absence could cost.
    assert time.monotonic() - began < 20
    waitUntil(
        lambda: "QueueObservations to svc-memory failed" in proxy.output(), "a failed send", 30
    )
    restartMemory()
    waitUntil(
        lambda: rig.contents() == expectedFacts(["away"]), "the observation made while away", 90
    )
    assert set(sourcesOf(rig)) == {away}
    waitUntil(lambda: "svc-memory took observation(s) again" in proxy.output(), "the resend logged")

    assert rig.memory.terminate() == 0
    stopped = [chat(proxy, rig.tenant, factsOf(f"stopped-{n}"))[0] for n in range(3)]
    assert proxy.terminate() == 0
    assert (
        "3 observation(s) not acknowledged by svc-memory at stop; kept in the journal"
        in proxy.output()
    )
    saved = rig.workdir / "memory.journal.saved"
    shutil.copyfile(journal, saved)
    restartMemory()
    again = startProxy(rig, "again", journal)
    # Info lines reach the log file in batches (svcd.common.logs.LineWriter).
    waitUntil(
        lambda: (
            "3 observation(s) not acknowledged by svc-memory; sending them first" in again.output()
        ),
        "the journal's waiting observations in the log",
    )
    expected = expectedFacts(["away", *(f"stopped-{n}" for n in range(3))])
    waitUntil(lambda: rig.contents() == expected, "the journalled observations", 90)
    assert set(stopped) <= set(sourcesOf(rig))
    first = {each["content"]: each["id"] for each in rig.memories()}
    waitUntil(lambda: metric(again, SENT) == 3, "the restarted proxy's acknowledgements")

    # As if the proxy had been killed before it journalled svc-memory's
    # acknowledgement: the same observations sent once more. svc-memory
    # remembers them as processed (SVC_MEMORY_DONE_RETENTION) and queues
    # none again: acknowledged, and nothing for the worker to extract.
    assert again.terminate() == 0
    rig.waitForDrained()
    # No worker from here on: an observation queued again would stay.
    assert rig.workers[0].terminate() == 0
    shutil.copyfile(saved, journal)
    replayed = startProxy(rig, "replayed", journal)
    waitUntil(lambda: metric(replayed, SENT) == 3, "the replayed observations sent")
    # Acknowledged means committed: anything queued would be here now.
    assert rig.observations() == []
    done = rig.query(
        "SELECT request_id FROM memory_observations_done WHERE org_id = %s",
        (rig.tenant.orgID,),
    )
    assert set(stopped) <= {each["request_id"] for each in done}
    assert {each["content"]: each["id"] for each in rig.memories()} == first
    replayed.terminate()
    assert MARKER not in allLogs(rig, proxy, again, replayed)


FORGOTTEN = 'svc_proxy_memory_observations_total{outcome="forgotten"}'


def test_anObservationReplayedAfterItsSubjectWasPurgedIsForgotten(rig: WorkerRig) -> None:
    """
    Forgetting reaches every copy (decisions D13, amended): an observation
    that could not reach svc-memory (svc-memory stopped) waits in the
    proxy's journal while the proxy is stopped; svc-memory comes back and
    the subject is purged (svcctl memory purge --subject); the proxy,
    restarted on the same journal, replays the observation, which
    svc-memory refuses as said before the purge: acknowledged (never sent
    again), counted C{forgotten}, never queued, never a memory, though the
    worker runs (a chat of the same subject after the purge becomes its
    memories).
    """
    journal = rig.workdir / "memory.journal"
    subject = "ann@example.com"
    headers = {"X-SVC-Memory-Subject": subject}
    proxy = startProxy(rig, "proxy", journal, SVC_SHUTDOWN_TIMEOUT="2s")
    memoryEnvironment = dict(rig.memory.environment)
    assert rig.memory.terminate() == 0
    chat(proxy, rig.tenant, factsOf("before-purge"), headers=headers)
    waitUntil(
        lambda: "QueueObservations to svc-memory failed" in proxy.output(), "a failed send", 30
    )
    assert proxy.terminate() == 0
    assert (
        "1 observation(s) not acknowledged by svc-memory at stop; kept in the journal"
        in proxy.output()
    )
    rig.memory = Daemon("svc-memory", memoryEnvironment, rig.memory.logFile).start()
    rig.memory.waitForReady()
    purged = document(
        svcctl(
            rig.dsn,
            "memory",
            "purge",
            "--org",
            str(rig.tenant.orgID),
            "--agent",
            str(rig.tenant.agentID),
            "--subject",
            subject,
        )
    )
    assert (purged["memories_deleted"], purged["observations_deleted"]) == (0, 0)

    again = startProxy(rig, "again", journal)
    waitUntil(lambda: metric(again, FORGOTTEN) == 1, "the replayed observation forgotten", 30)
    assert metric(again, SENT) == 1
    assert rig.observations() == []
    # The worker runs: what the subject says after the purge is kept.
    chat(again, rig.tenant, factsOf("after-purge"), headers=headers)
    waitUntil(
        lambda: rig.contents(subject=subject) == expectedFacts(["after-purge"]),
        "the later chat's memories",
        60,
    )
    rig.waitForDrained()
    assert again.terminate() == 0
    # Acknowledged for good: a third start has nothing to send.
    third = startProxy(rig, "third", journal)
    assert "not acknowledged by svc-memory; sending them first" not in third.output()
    assert metric(third, SENT) == 0 and metric(third, FORGOTTEN) == 0
    assert rig.contents(subject=subject) == expectedFacts(["after-purge"])
    assert MARKER not in allLogs(rig, proxy, again, third)
