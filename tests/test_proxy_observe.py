"""
Which parts of a chat completion become an observation (decisions D13,
"Observation and the worker"): L{svcd.proxy.observe}.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from twisted.web.test.requesthelper import DummyRequest

from svcd.common.config import ConfigError
from svcd.common.errors import ApiError
from svcd.ledger.journal import Journal
from svcd.ledger.journalfile import JournalError, checkJournalPath
from svcd.limits.book import LimitBook, MemorySettingsRow
from svcd.limits.records import MemorySettings
from svcd.memoryclient.records import MAX_OBSERVED_MESSAGE_BYTES
from svcd.pb.memory.v1 import memory_pb2
from svcd.providers.relay import StreamFault, StreamRelay
from svcd.proxy.config import ProxyConfig
from svcd.proxy.observe import (
    OBSERVATION_JOURNAL_MAGIC,
    AnswerText,
    ObservationOutboxMetrics,
    Observer,
    completionText,
    cutText,
    observation,
    observationKey,
    observationOutbox,
    observedUserTexts,
)


def test_user_messages_after_the_last_assistant_message() -> None:
    """
    Only the user's turn is observed: the user messages after the last
    assistant message, in order; system, developer and tool messages are
    left out, and so is everything before that assistant message.
    """
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "old question"},
        {"role": "assistant", "content": "old answer"},
        {"role": "tool", "content": "tool output"},
        {"role": "user", "content": "I live in Lyon."},
        {"role": "developer", "content": "hint"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "   "},
    ]
    assert observedUserTexts(messages) == ["I live in Lyon.", "a\nb"]


def test_no_assistant_message_takes_every_user_message() -> None:
    """
    A first turn (no assistant message yet) is observed whole.
    """
    messages = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    assert observedUserTexts(messages) == ["one", "two"]


def test_observation_carries_scope_request_and_answer() -> None:
    """
    The observation holds the scope, the request id, the user's texts and
    then the answer's text as an assistant message.
    """
    made = observation(
        "org", "agent", "alice", "req-1", [{"role": "user", "content": "hi"}], "hello", "ledger-1"
    )
    assert made is not None
    assert (made.scope.org_id, made.scope.agent_id, made.scope.subject) == (
        "org",
        "agent",
        "alice",
    )
    assert made.request_id == "req-1"
    assert [(m.role, m.content) for m in made.messages] == [
        ("user", "hi"),
        ("assistant", "hello"),
    ]


def test_nothing_to_observe_without_user_text() -> None:
    """
    A turn with no user text is not observed.
    """
    assert observation("o", "a", "", "r", [{"role": "system", "content": "x"}], "ok", "k") is None


def test_cut_on_a_character_boundary() -> None:
    """
    A text longer than 16 KiB of UTF-8 is cut to at most 16 KiB, never
    inside a character; a shorter one is kept whole.
    """
    assert MAX_OBSERVED_MESSAGE_BYTES == 16 * 1024
    # 3-byte characters: 16,384 is not a multiple of 3.
    text = "€" * 6000
    cut = cutText(text)
    assert len(cut.encode("utf-8")) <= MAX_OBSERVED_MESSAGE_BYTES
    assert len(cut.encode("utf-8")) > MAX_OBSERVED_MESSAGE_BYTES - 3
    assert text.startswith(cut)
    assert cutText("short") == "short"
    assert cutText("a\x00b") == "ab"


def test_user_text_and_answer_are_cut() -> None:
    """
    Both the user's messages and the answer are cut to 16 KiB each.
    """
    long = "x" * (MAX_OBSERVED_MESSAGE_BYTES + 100)
    made = observation("o", "a", "", "r", [{"role": "user", "content": long}], long, "k")
    assert made is not None
    assert [len(m.content) for m in made.messages] == [MAX_OBSERVED_MESSAGE_BYTES] * 2


def test_stream_text_from_deltas() -> None:
    """
    A stream's answer is the concatenation of the content deltas of its
    first choice; role-only deltas, other choices and events without
    choices (usage) add nothing.
    """
    gathered = AnswerText()
    events: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 1, "delta": {"content": "other"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [], "usage": {"prompt_tokens": 1}},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    for event in events:
        gathered.addEvent(event)
    assert gathered.text() == "Hello"


def test_stream_text_is_bounded() -> None:
    """
    A long stream holds no more than the cut needs, and its text is cut.
    """
    gathered = AnswerText()
    for _ in range(100):
        gathered.addEvent({"choices": [{"index": 0, "delta": {"content": "é" * 1000}}]})
    assert len(gathered.text().encode("utf-8")) <= MAX_OBSERVED_MESSAGE_BYTES
    assert sum(len(part) for part in gathered._parts) < MAX_OBSERVED_MESSAGE_BYTES + 1000


def test_completion_text() -> None:
    """
    A non-streamed answer's text is its first choice's message content.
    """
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "yes"}}]}
    assert completionText(body) == "yes"
    assert completionText({"choices": []}) == ""


class FakeQueue:
    """
    QueueObservations whose answers the test gives: each call waits in
    C{calls} as (observations, Deferred).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[list[memory_pb2.Observation], Deferred[Any]]] = []

    def __call__(self, observations: Sequence[memory_pb2.Observation]) -> Deferred[Any]:
        answer: Deferred[Any] = Deferred()
        self.calls.append((list(observations), answer))
        return answer

    def acknowledge(self, index: int = -1) -> None:
        observations, answer = self.calls[index]
        queued = [memory_pb2.QueuedObservation(id=f"id-{o.request_id}") for o in observations]
        answer.callback(memory_pb2.QueueObservationsResponse(queued=queued))


# An end user's subject: personal data, never in a log or a rejects file.
SUBJECT = "ada.lovelace@example.org"


def made(
    requestID: str, secret: str = "my secret fact", subject: str = ""
) -> memory_pb2.Observation:
    observed = observation(
        "org",
        "agent",
        subject,
        requestID,
        [{"role": "user", "content": secret}],
        "ok",
        requestID,
    )
    assert observed is not None
    return observed


def test_outbox_resends_until_acknowledged() -> None:
    """
    Observations leave in a batch; a failed call is tried again, the same
    observations, after the backoff; only an acknowledgement empties the
    outbox.
    """
    clock = Clock()
    queue = FakeQueue()
    metrics = ObservationOutboxMetrics(CollectorRegistry())
    outbox = observationOutbox(queue, clock, metrics)
    outbox.start()
    outbox.record(made("r1"))
    outbox.record(made("r2"))
    clock.advance(1)
    assert [o.request_id for o in queue.calls[0][0]] == ["r1", "r2"]
    queue.calls[0][1].errback(RuntimeError("svc-memory away"))
    assert outbox.waiting == 2
    clock.advance(10)
    assert len(queue.calls) == 2
    assert [o.request_id for o in queue.calls[1][0]] == ["r1", "r2"]
    queue.acknowledge()
    assert outbox.waiting == 0
    assert metrics.usageRowsSent._value.get() == 2


def test_journal_keeps_unacknowledged_observations(tmp_path: Path) -> None:
    """
    With a journal, observations not acknowledged when the proxy stops
    are sent first at the next start; acknowledged ones are not. The
    journal is not a usage journal: SVC_USAGE_JOURNAL's reader refuses it.
    """
    path = str(tmp_path / "memory.journal")
    clock = Clock()
    queue = FakeQueue()
    outbox = observationOutbox(
        queue, clock, ObservationOutboxMetrics(CollectorRegistry()), journalPath=path
    )
    outbox.start()
    outbox.record(made("r1"))
    clock.advance(1)
    queue.acknowledge()
    outbox.record(made("r2"))
    outbox.close()
    again = FakeQueue()
    restarted = observationOutbox(
        again, Clock(), ObservationOutboxMetrics(CollectorRegistry()), journalPath=path
    )
    restarted.start()
    assert [o.request_id for o in again.calls[0][0]] == ["r2"]
    assert again.calls[0][0][0].messages[0].content == "my secret fact"
    with pytest.raises(JournalError):
        Journal(path).open()


def test_outbox_holds_at_most_its_bytes(tmp_path: Path) -> None:
    """
    Beside its count, the outbox bounds the bytes it holds
    (SVC_MEMORY_OUTBOX_MB): an observation's size ranges from a few
    hundred bytes to about 1 MiB, so a count alone would let a proxy hold
    some 10 GiB while svc-memory is away. Past the bound it has no room
    (the observer then drops new observations, counted C{full}); an
    acknowledgement makes room again; observations the journal gives back
    at a start count as they did before the stop.
    """
    path = str(tmp_path / "memory.journal")
    clock = Clock()
    queue = FakeQueue()
    registry = CollectorRegistry()
    big = made("r-big", "x" * 6_000)
    small = made("r-small")
    outbox = observationOutbox(
        queue, clock, ObservationOutboxMetrics(registry), journalPath=path, maxBytes=10_000
    )
    outbox.start()
    outbox.record(big)
    assert outbox.hasRoom()
    outbox.record(small)
    held = big.ByteSize() + small.ByteSize()
    assert outbox.waitingBytes == held
    assert registry.get_sample_value("svc_proxy_memory_observations_outbox_bytes") == held
    outbox.record(made("r-over", "y" * 6_000))
    assert not outbox.hasRoom()
    assert outbox.waiting == 3
    outbox.close()
    restarted = observationOutbox(
        FakeQueue(),
        Clock(),
        ObservationOutboxMetrics(CollectorRegistry()),
        journalPath=path,
        maxBytes=10_000,
    )
    restarted.start()
    assert (restarted.waiting, restarted.hasRoom()) == (3, False)
    assert restarted.waitingBytes == held + made("r-over", "y" * 6_000).ByteSize()
    restarted.close()
    fresh = observationOutbox(
        queue, clock, ObservationOutboxMetrics(CollectorRegistry()), maxBytes=10_000
    )
    fresh.start()
    fresh.record(big)
    fresh.record(made("r-2", "z" * 6_000))
    assert not fresh.hasRoom()
    clock.advance(1)
    queue.acknowledge()
    assert (fresh.waiting, fresh.waitingBytes, fresh.hasRoom()) == (0, 0, True)


def test_a_full_outbox_of_bytes_drops_the_observation_not_the_answer() -> None:
    """
    Through the observer: once the outbox holds its bytes, the next
    observation is dropped, counted C{full}; the one before was recorded.
    """
    queue = FakeQueue()
    outbox = observationOutbox(
        queue, Clock(), ObservationOutboxMetrics(CollectorRegistry()), maxBytes=5_000
    )
    outbox.start()
    making, registry = observer(cast(Outbox, outbox))
    planned = making.plan(request(), ORG, AGENT, stream=False)
    assert planned is not None
    long = [{"role": "user", "content": "w" * 6_000}]
    making.record(planned, ORG, AGENT, "r-1", long, ANSWER, "ledger-r-1")
    making.record(planned, ORG, AGENT, "r-2", long, ANSWER, "ledger-r-2")
    assert [observedCount(registry, each) for each in ("recorded", "full")] == [1, 1]
    assert outbox.waiting == 1


def test_rejected_observation_is_logged_without_content() -> None:
    """
    An observation svc-memory refuses for good (INVALID_ARGUMENT alone in
    its batch) is set aside in the log by its ids, never its content.
    """
    lines: list[str] = []

    def observer(event: dict[str, Any]) -> None:
        lines.append(formatEvent(event))

    clock = Clock()
    queue = FakeQueue()
    outbox = observationOutbox(queue, clock, ObservationOutboxMetrics(CollectorRegistry()))
    outbox.start()
    globalLogPublisher.addObserver(cast(ILogObserver, observer))
    try:
        outbox.record(made("r1", secret="launch code 1234"))
        clock.advance(1)
        queue.calls[0][1].errback(StatusError(grpc.StatusCode.INVALID_ARGUMENT))
    finally:
        globalLogPublisher.removeObserver(cast(ILogObserver, observer))
    assert outbox.waiting == 0
    assert any("r1" in line for line in lines)
    assert not any("launch code" in line for line in lines)


class StatusError(grpc.RpcError):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__("scripted")
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "scripted"


grpc.Call.register(StatusError)


ORG = "0190a000-0000-7000-8000-000000000001"
AGENT = "0190a000-0000-7000-8000-000000000002"


def request(**headers: str) -> DummyRequest:
    made = DummyRequest([b""])
    for name, value in headers.items():
        made.requestHeaders.setRawHeaders(name.replace("_", "-"), [value])
    return made


class Outbox:
    """
    The observations' outbox as the observer sees it.
    """

    def __init__(self, room: bool = True) -> None:
        self.room = room
        self.recorded: list[memory_pb2.Observation] = []

    def hasRoom(self) -> bool:
        return self.room

    def record(self, row: Any) -> None:
        self.recorded.append(row)


def observer(
    outbox: Outbox, observe: str | None = "all", agentObserve: str | None = None
) -> tuple[Observer, CollectorRegistry]:
    book = LimitBook()
    book.changed(MemorySettingsRow(ORG, None, MemorySettings(observe=observe)))
    if agentObserve is not None:
        book.changed(MemorySettingsRow(ORG, AGENT, MemorySettings(observe=agentObserve)))
    registry = CollectorRegistry()
    return Observer(outbox, book, ObservationOutboxMetrics(registry), Clock()), registry


def observedCount(registry: CollectorRegistry, outcome: str) -> float:
    value = registry.get_sample_value("svc_proxy_memory_observations_total", {"outcome": outcome})
    return value or 0.0


def test_plan_follows_settings_and_headers() -> None:
    """
    A request observes when its organization (or its agent, which wins)
    has observe all (or on, below) and it did not say X-SVC-Memory: off;
    its subject is X-SVC-Memory-Subject's, "" without one; a stream gets a
    gatherer of its text, a plain answer none. A bad header is a 400
    whatever the settings.
    """
    on, _ = observer(Outbox(), observe="all")
    planned = on.plan(request(X_SVC_Memory_Subject="alice"), ORG, AGENT, stream=False)
    assert planned is not None and planned.subject == "alice" and planned.answer is None
    streamed = on.plan(request(), ORG, AGENT, stream=True)
    assert streamed is not None and streamed.subject == "" and streamed.answer is not None
    assert on.plan(request(X_SVC_Memory="off"), ORG, AGENT, stream=False) is None
    assert on.plan(request(), ORG, None, stream=False) is None
    off, _ = observer(Outbox(), observe="off")
    assert off.plan(request(), ORG, AGENT, stream=False) is None
    agentOff, _ = observer(Outbox(), observe="all", agentObserve="off")
    assert agentOff.plan(request(), ORG, AGENT, stream=False) is None
    agentOn, _ = observer(Outbox(), observe="off", agentObserve="all")
    assert agentOn.plan(request(), ORG, AGENT, stream=False) is not None
    for bad in ({"X_SVC_Memory": "on"}, {"X_SVC_Memory_Subject": "no spaces"}):
        with pytest.raises(ApiError):
            off.plan(request(**bad), ORG, AGENT, stream=False)


ANSWER = (
    b'{"choices":[{"index":0,"message":{"role":"assistant","content":"Noted, Lyon."}}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2}}'
)


TURN = [{"role": "user", "content": "I live in Lyon."}]


def test_on_observes_only_requests_that_name_a_subject() -> None:
    """
    Decisions D13 amended, "Whose words": with observe on, a request that
    names a subject observes into it, stream or not; one that names none
    is planned unobserved (no gatherer of its text either), and its
    answer, ended ok, is counted no_subject and puts nothing in the
    outbox. The agent's mode wins over its organization's either way.
    """
    outbox = Outbox()
    on, registry = observer(outbox, observe="on")
    assert observedCount(registry, "no_subject") == 0
    named = on.plan(request(X_SVC_Memory_Subject="alice"), ORG, AGENT, stream=True)
    assert named is not None and named.unobserved is None
    assert (named.subject, named.answer is not None) == ("alice", True)
    for stream in (False, True):
        unnamed = on.plan(request(), ORG, AGENT, stream=stream)
        assert unnamed is not None
        assert (unnamed.unobserved, unnamed.answer) == ("no_subject", None)
        on.record(unnamed, ORG, AGENT, "req-anon", TURN, ANSWER, f"ledger-anon-{stream}")
    assert outbox.recorded == []
    assert observedCount(registry, "no_subject") == 2
    assert observedCount(registry, "recorded") == 0
    # X-SVC-Memory: off, or no agent: not observed, and not counted.
    assert on.plan(request(X_SVC_Memory="off"), ORG, AGENT, stream=False) is None
    assert on.plan(request(), ORG, None, stream=False) is None

    agentOn, _ = observer(Outbox(), observe="all", agentObserve="on")
    agentPlan = agentOn.plan(request(), ORG, AGENT, stream=False)
    assert agentPlan is not None and agentPlan.unobserved == "no_subject"
    agentAll, _ = observer(Outbox(), observe="on", agentObserve="all")
    allPlan = agentAll.plan(request(), ORG, AGENT, stream=False)
    assert allPlan is not None and allPlan.unobserved is None and allPlan.subject == ""


def test_all_observes_requests_without_a_subject_into_the_shared_one() -> None:
    """
    With observe all, a request that names no subject is observed into
    the agent's shared subject "", counted recorded; one that names a
    subject, into its own.
    """
    outbox = Outbox()
    making, registry = observer(outbox, observe="all")
    for subject, headers in (("", {}), ("bob", {"X_SVC_Memory_Subject": "bob"})):
        planned = making.plan(request(**headers), ORG, AGENT, stream=False)
        assert planned is not None and planned.unobserved is None
        making.record(planned, ORG, AGENT, "req-" + subject, TURN, ANSWER, "ledger-" + subject)
    assert [made.scope.subject for made in outbox.recorded] == ["", "bob"]
    assert observedCount(registry, "recorded") == 2
    assert observedCount(registry, "no_subject") == 0


def test_record_puts_the_observation_in_the_outbox() -> None:
    """
    A plain answer's observation: the user's turn and the first choice's
    content, under the request id and subject, keyed by the request's
    ledger id (which the gateway makes; the client's request id may
    repeat); counted C{recorded}.
    """
    outbox = Outbox()
    making, registry = observer(outbox)
    planned = making.plan(request(X_SVC_Memory_Subject="bob"), ORG, AGENT, stream=False)
    assert planned is not None and planned.unobserved is None
    making.record(
        planned,
        ORG,
        AGENT,
        "req-1",
        [{"role": "user", "content": "I live in Lyon."}],
        ANSWER,
        "ledger-1",
    )
    [made] = outbox.recorded
    assert (made.scope.org_id, made.scope.agent_id, made.scope.subject) == (ORG, AGENT, "bob")
    assert (made.request_id, made.key, observationKey(made)) == ("req-1", "ledger-1", "ledger-1")
    # One journalled by an earlier release has no key: its request id is.
    assert observationKey(memory_pb2.Observation(request_id="req-0")) == "req-0"
    assert [(m.role, m.content) for m in made.messages] == [
        ("user", "I live in Lyon."),
        ("assistant", "Noted, Lyon."),
    ]
    assert observedCount(registry, "recorded") == 1


def test_record_of_a_stream_takes_the_gathered_text() -> None:
    """
    A stream's observation holds the text its deltas carried, as the
    relay fed them; the (empty) body is not read.
    """
    outbox = Outbox()
    making, _ = observer(outbox)
    planned = making.plan(request(), ORG, AGENT, stream=True)
    assert planned is not None and planned.answer is not None
    for piece in ("Noted", ", Ly", "on."):
        delta = {"choices": [{"index": 0, "delta": {"content": piece}}]}
        planned.answer.addData(json.dumps(delta).encode())
    planned.answer.addData(b"not json")
    making.record(
        planned, ORG, AGENT, "req-2", [{"role": "user", "content": "hi"}], b"", "ledger-req-2"
    )
    [made] = outbox.recorded
    assert made.messages[-1].content == "Noted, Lyon."


def test_record_never_fails_the_answer() -> None:
    """
    Nothing to observe (no user text) is counted C{empty}; a full outbox
    drops the observation, counted C{full} and logged by request id; an
    answer that cannot be read is counted C{error}: none of them raises,
    and no line holds a text of the conversation.
    """
    lines: list[str] = []

    def heard(event: dict[str, Any]) -> None:
        lines.append(formatEvent(event))

    outbox = Outbox()
    making, registry = observer(outbox)
    planned = making.plan(request(), ORG, AGENT, stream=False)
    assert planned is not None
    secret = [{"role": "user", "content": "my pin is 4321"}]
    globalLogPublisher.addObserver(cast(ILogObserver, heard))
    try:
        making.record(
            planned, ORG, AGENT, "r-empty", [{"role": "system", "content": "x"}], ANSWER, "l-1"
        )
        outbox.room = False
        making.record(planned, ORG, AGENT, "r-full", secret, ANSWER, "l-2")
        outbox.room = True
        making.record(planned, ORG, AGENT, "r-broken", secret, b"\xff not json 4321", "l-3")
    finally:
        globalLogPublisher.removeObserver(cast(ILogObserver, heard))
    assert outbox.recorded == []
    assert [observedCount(registry, each) for each in ("empty", "full", "error")] == [1, 1, 1]
    assert any("r-full" in line for line in lines)
    assert any("r-broken" in line for line in lines)
    assert not any("4321" in line for line in lines)


def test_answer_text_parses_no_more_than_its_bound() -> None:
    """
    Once the bound is held, later events are not even parsed.
    """
    text = AnswerText(limit=4)
    text.addData(b'{"choices":[{"index":0,"delta":{"content":"abcd"}}]}')
    text.addData(b'{"choices":[{"index":0,"delta":{"content":"efgh"}}]}')
    text.addData(b"[" * 100_000)
    assert text.text() == "abcd"


def test_relay_feeds_event_data_and_survives_its_faults() -> None:
    """
    The relay gives each relayed event's data (not [DONE]) to onData; an
    onData that fails is not called again, and the stream is relayed
    whole all the same.
    """
    fed: list[bytes] = []
    written: list[bytes] = []

    def failing(data: bytes) -> None:
        fed.append(data)
        raise RecursionError("nested too deep")

    def errorEvent(fault: StreamFault) -> bytes:
        return b"data: error\n\n"

    relay = StreamRelay(Clock(), 5, 5, lambda: None, written.append, errorEvent, False, failing)
    relay.dataReceived(b"data: one\n\ndata: two\n\ndata: [DONE]\n\n")
    assert fed == [b"one"]
    assert b"".join(written) == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    assert relay.finished.called
    gathered: list[bytes] = []
    relay = StreamRelay(
        Clock(), 5, 5, lambda: None, written.append, errorEvent, False, gathered.append
    )
    relay.dataReceived(b"data: one\n\n: comment\n\ndata: two\n\ndata: [DONE]\n\n")
    assert gathered == [b"one", b"two"]


def test_rejected_observation_leaves_ids_not_content_in_the_rejects_file(
    tmp_path: Path,
) -> None:
    """
    With a journal, an observation svc-memory refuses for good is set
    aside in <journal>.rejects (0600) by its ids, size and reason, without
    its content; the log line names it by request id, and says
    QueueObservations and svc-memory, not RecordUsage and svc-auth.
    """
    path = tmp_path / "memory.journal"
    lines: list[str] = []

    def heard(event: dict[str, Any]) -> None:
        lines.append(formatEvent(event))

    clock = Clock()
    queue = FakeQueue()
    outbox = observationOutbox(
        queue, clock, ObservationOutboxMetrics(CollectorRegistry()), journalPath=str(path)
    )
    outbox.start()
    globalLogPublisher.addObserver(cast(ILogObserver, heard))
    try:
        outbox.record(made("r1", secret="launch code 1234", subject=SUBJECT))
        clock.advance(1)
        queue.calls[0][1].errback(StatusError(grpc.StatusCode.UNAVAILABLE))
        clock.advance(10)
        queue.calls[1][1].errback(StatusError(grpc.StatusCode.INVALID_ARGUMENT))
    finally:
        globalLogPublisher.removeObserver(cast(ILogObserver, heard))
    rejects = Path(str(path) + ".rejects")
    assert rejects.stat().st_mode & 0o777 == 0o600
    [line] = [json.loads(each) for each in rejects.read_text().splitlines()]
    assert line["observation"]["request_id"] == "r1"
    assert line["observation"]["messages"] == 2
    assert line["reason"] == "invalid"
    assert "launch code" not in rejects.read_text()
    assert any(
        "QueueObservations to svc-memory failed" in each and "observation(s) waiting" in each
        for each in lines
    )
    assert any("svc-memory rejected observation r1" in each for each in lines)
    assert not any("svc-auth" in each or "usage" in each.lower() for each in lines)
    assert not any("launch code" in each for each in lines)
    # The subject is personal data, like the content (decisions D13,
    # amended): neither the rejects file nor the log names it.
    assert line["observation"]["subject_named"] is True
    assert SUBJECT not in rejects.read_text()
    assert not any(SUBJECT in each for each in lines)


def test_journals_of_the_two_kinds_are_never_confused(tmp_path: Path) -> None:
    """
    A memory journal named as the usage journal (or the reverse) is
    refused by name before the daemon starts, and so is one file named as
    both; each kind's own file, or none yet, is taken.
    """
    memoryJournal = tmp_path / "memory.journal"
    outbox = observationOutbox(
        FakeQueue(),
        Clock(),
        ObservationOutboxMetrics(CollectorRegistry()),
        journalPath=str(memoryJournal),
    )
    outbox.start()
    outbox.close()
    usageJournal = tmp_path / "usage.journal"
    Journal(str(usageJournal)).open()
    base = {"SVC_AUTH_GRPC_ADDR": "auth.test:9091"}
    taken = ProxyConfig.fromEnvironment(
        {
            **base,
            "SVC_USAGE_JOURNAL": str(usageJournal),
            "SVC_MEMORY_JOURNAL": str(memoryJournal),
        }
    )
    assert (taken.usageJournal, taken.memoryJournal) == (str(usageJournal), str(memoryJournal))
    assert taken.memoryOutboxMax == 10_000
    assert taken.memoryOutboxBytes == 128 * 2**20
    assert (
        ProxyConfig.fromEnvironment({**base, "SVC_MEMORY_OUTBOX_MB": "2"}).memoryOutboxBytes
        == 2 * 2**20
    )
    with pytest.raises(ConfigError) as caught:
        ProxyConfig.fromEnvironment({**base, "SVC_MEMORY_OUTBOX_MB": "0"})
    assert caught.value.variable == "SVC_MEMORY_OUTBOX_MB"
    with pytest.raises(ConfigError) as caught:
        ProxyConfig.fromEnvironment({**base, "SVC_USAGE_JOURNAL": str(memoryJournal)})
    assert caught.value.variable == "SVC_USAGE_JOURNAL"
    assert "is a memory journal of svc-proxy, not a usage journal" in caught.value.problem
    with pytest.raises(ConfigError) as caught:
        ProxyConfig.fromEnvironment({**base, "SVC_MEMORY_JOURNAL": str(usageJournal)})
    assert caught.value.variable == "SVC_MEMORY_JOURNAL"
    assert "is a usage journal of svc-proxy, not a memory journal" in caught.value.problem
    fresh = str(tmp_path / "fresh.journal")
    with pytest.raises(ConfigError) as caught:
        ProxyConfig.fromEnvironment(
            {**base, "SVC_USAGE_JOURNAL": fresh, "SVC_MEMORY_JOURNAL": fresh}
        )
    assert caught.value.variable == "SVC_MEMORY_JOURNAL"
    with pytest.raises(JournalError, match="not a memory journal"):
        checkJournalPath(str(usageJournal), OBSERVATION_JOURNAL_MAGIC)
    with pytest.raises(ConfigError):
        ProxyConfig.fromEnvironment({**base, "SVC_MEMORY_OUTBOX_MAX": "0"})


def test_lone_surrogates_do_not_lose_the_observation() -> None:
    """
    An answer holding a lone surrogate (a provider's C{"\\ud800"}) is
    observed with U+FFFD in its place: protobuf could not encode it, and
    the observation, the user's facts with it, would be lost.
    """
    outbox = Outbox()
    making, registry = observer(outbox)
    planned = making.plan(request(), ORG, AGENT, stream=False)
    assert planned is not None
    body = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"a\\ud800b"}}]}'
    making.record(
        planned, ORG, AGENT, "r-1", [{"role": "user", "content": "I am here."}], body, "ledger-r-1"
    )
    [made] = outbox.recorded
    assert made.messages[-1].content == "a\ufffdb"
    assert observedCount(registry, "recorded") == 1
    assert cutText("\ud83d\ude00") == "\ufffd\ufffd"
    assert cutText("\U0001f600" * 3, limit=9) == "\U0001f600\U0001f600"


def test_refused_observations_are_acknowledged_for_good_and_counted(tmp_path: Path) -> None:
    """
    An observation svc-memory answers refused (its scope was deleted after
    the answer ended, or its organization's queue is full) leaves the
    outbox and the journal like one queued: never sent again, not even at
    the next start; it is counted by its refusal (decisions D13, amended).
    """
    path = str(tmp_path / "memory.journal")
    clock = Clock()
    queue = FakeQueue()
    registry = CollectorRegistry()
    outbox = observationOutbox(queue, clock, ObservationOutboxMetrics(registry), journalPath=path)
    outbox.start()
    for each in ("r1", "r2", "r3"):
        outbox.record(made(each))
    clock.advance(1)
    [(_, answer)] = queue.calls
    answer.callback(
        memory_pb2.QueueObservationsResponse(
            queued=[
                memory_pb2.QueuedObservation(request_id="r1", key="r1", refused="forgotten"),
                memory_pb2.QueuedObservation(request_id="r2", key="r2", refused="queue_full"),
                memory_pb2.QueuedObservation(request_id="r3", key="r3", id="id-r3"),
            ]
        )
    )
    assert outbox.waiting == 0
    assert observedCount(registry, "forgotten") == 1
    assert observedCount(registry, "queue_full") == 1
    assert registry.get_sample_value("svc_proxy_memory_observations_rejected_total") is None
    clock.advance(60)
    assert len(queue.calls) == 1
    outbox.close()
    again = FakeQueue()
    restarted = observationOutbox(
        again, Clock(), ObservationOutboxMetrics(CollectorRegistry()), journalPath=path
    )
    restarted.start()
    assert again.calls == [] and restarted.waiting == 0
    restarted.close()


def test_an_observation_says_when_its_answer_ended() -> None:
    """
    An observation carries the time its answer ended, by the proxy's
    clock, in RFC 3339 UTC: svc-memory drops it if its scope is deleted
    at or after that time.
    """
    outbox = Outbox()
    book = LimitBook()
    book.changed(MemorySettingsRow(ORG, None, MemorySettings(observe="all")))
    clock = Clock()
    clock.advance(1_796_000_000.25)
    making = Observer(outbox, book, ObservationOutboxMetrics(CollectorRegistry()), clock)
    planned = making.plan(request(), ORG, AGENT, stream=False)
    assert planned is not None
    making.record(
        planned, ORG, AGENT, "req-1", [{"role": "user", "content": "I live in Lyon."}], ANSWER, "l"
    )
    [observed] = outbox.recorded
    assert observed.ended_at == "2026-11-30T00:53:20.250Z"
