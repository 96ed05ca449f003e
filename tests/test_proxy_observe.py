"""
Which parts of a chat completion become an observation (decisions D13,
"Observation and the worker"): L{svcd.proxy.observe}.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, formatEvent, globalLogPublisher

from svcd.ledger.journalfile import JournalError
from svcd.ledger.outbox import UsageJournal
from svcd.memory.records import MAX_OBSERVED_MESSAGE_BYTES
from svcd.pb.memory.v1 import memory_pb2
from svcd.proxy.observe import (
    AnswerText,
    ObservationOutboxMetrics,
    completionText,
    cutText,
    observation,
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
        "org", "agent", "alice", "req-1", [{"role": "user", "content": "hi"}], "hello"
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
    assert observation("o", "a", "", "r", [{"role": "system", "content": "x"}], "ok") is None


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
    made = observation("o", "a", "", "r", [{"role": "user", "content": long}], long)
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


def made(requestID: str, secret: str = "my secret fact") -> memory_pb2.Observation:
    observed = observation(
        "org", "agent", "", requestID, [{"role": "user", "content": secret}], "ok"
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
        UsageJournal(path).open()


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
