"""
What of a chat completion becomes an observation (decisions D13,
"Observation and the worker"): the request's user messages after its
last assistant message, then the answer's text, each cut to
L{MAX_OBSERVED_MESSAGE_BYTES} on a character boundary.

Kept apart from the route and the relay so that the choice of messages
and the cuts are plain functions a test checks directly, and so that a
stream's text is gathered (L{AnswerText}) only when the request observes:
a request that does not observe pays nothing for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from twisted.internet.defer import Deferred

from svcd.common.clocks import Clock
from svcd.ledger.outbox import UsageJournal, UsageOutbox
from svcd.memory.records import MAX_OBSERVED_MESSAGE_BYTES, MAX_OBSERVED_MESSAGES
from svcd.pb.memory.v1 import memory_pb2
from svcd.proxy.recall import messageText

__all__ = [
    "AnswerText",
    "ObservationOutboxMetrics",
    "completionText",
    "cutText",
    "observation",
    "observationOutbox",
    "observedUserTexts",
]


def cutText(text: str, limit: int = MAX_OBSERVED_MESSAGE_BYTES) -> str:
    """
    C{text} cut to at most C{limit} bytes of UTF-8, never inside a
    character (a cut inside one would make a string svc-memory cannot
    store). NUL characters are dropped: PostgreSQL's text cannot hold
    them, and an observation refused for one would be lost for a byte.
    """
    text = text.replace("\x00", "")
    encoded = text.encode("utf-8", "surrogatepass")
    if len(encoded) <= limit:
        return text
    # "ignore" drops the partial character the byte cut leaves at the end.
    return encoded[:limit].decode("utf-8", "ignore")


def observedUserTexts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """
    The texts of the C{user} messages after the last C{assistant} message
    (the user's turn: what came before was observed with earlier
    answers), each cut by L{cutText}; blank ones left out.
    """
    start = 0
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "assistant":
            start = index + 1
            break
    texts = []
    for message in messages[start:]:
        if message.get("role") != "user":
            continue
        text = cutText(messageText(message.get("content")))
        if text.strip():
            texts.append(text)
    # The answer takes one of svc-memory's MAX_OBSERVED_MESSAGES places;
    # the latest of the user's messages are the ones kept.
    return texts[-(MAX_OBSERVED_MESSAGES - 1) :]


def observation(
    orgID: str,
    agentID: str,
    subject: str,
    requestID: str,
    messages: Sequence[Mapping[str, Any]],
    answer: str,
) -> memory_pb2.Observation | None:
    """
    The observation of one chat completion that ended C{ok}, or None when
    there is nothing to observe (no user text in the turn, or an empty
    answer and no user text).
    """
    users = observedUserTexts(messages)
    if not users:
        return None
    observed = [memory_pb2.ObservedMessage(role="user", content=text) for text in users]
    answerText = cutText(answer)
    if answerText.strip():
        observed.append(memory_pb2.ObservedMessage(role="assistant", content=answerText))
    return memory_pb2.Observation(
        scope=memory_pb2.Scope(org_id=orgID, agent_id=agentID, subject=subject),
        request_id=requestID,
        messages=observed,
    )


class AnswerText:
    """
    The text of a streamed answer, gathered from its deltas
    (C{choices[0].delta.content} of each event) as the relay parses them.
    Bounded: once L{MAX_OBSERVED_MESSAGE_BYTES} worth of characters are
    held, later deltas are not kept (a character is at most 4 bytes, so
    holding that many characters always suffices for the cut).
    """

    def __init__(self, limit: int = MAX_OBSERVED_MESSAGE_BYTES) -> None:
        self._parts: list[str] = []
        self._held = 0
        self._limit = limit

    def addEvent(self, event: Mapping[str, Any]) -> None:
        """
        Take the content delta of the first choice of one parsed stream
        event; anything else in it is ignored.
        """
        if self._held >= self._limit:
            return
        choices = event.get("choices")
        if not isinstance(choices, list) or not choices:
            return
        first = choices[0]
        if not isinstance(first, dict) or first.get("index", 0) != 0:
            return
        delta = first.get("delta")
        if not isinstance(delta, dict):
            return
        content = delta.get("content")
        if isinstance(content, str) and content:
            self._parts.append(content)
            self._held += len(content)

    def text(self) -> str:
        return cutText("".join(self._parts))


def completionText(body: Mapping[str, Any]) -> str:
    """
    The text of a non-streamed answer: its first choice's message content.
    """
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        if isinstance(message, dict):
            return messageText(message.get("content"))
    return ""


# The first line of an observation journal (the memory journal D13 names;
# its variable is not read yet): its own, so that a usage journal is never
# read as one, nor the reverse.
OBSERVATION_JOURNAL_MAGIC = b"svc-memory-journal 1\n"
# The observations held at most (a bound the configuration will take): an
# observation is at most some 1 MiB
# (64 messages of 16 KiB), usually a few KiB; 10,000 of them bound what a
# proxy holds while svc-memory is away.
OBSERVATION_OUTBOX_MAX = 10_000
# Observations per QueueObservations call: svc-memory commits a batch in
# one transaction, and a batch must stay under gRPC's 4 MB message limit
# even with observations cut to their bound (2 x 16 KiB each in practice).
OBSERVATION_BATCH = 50


def observationKey(observation: memory_pb2.Observation) -> str:
    """
    An observation's idempotence key: svc-memory queues one per request id.
    """
    return str(observation.request_id)


def describeObservation(observation: memory_pb2.Observation) -> str:
    """
    What the log may say of an observation svc-memory refused for good:
    its scope, request id and size, never its content.
    """
    return json.dumps(
        {
            "org_id": observation.scope.org_id,
            "agent_id": observation.scope.agent_id,
            "subject": observation.scope.subject,
            "request_id": observation.request_id,
            "messages": len(observation.messages),
        },
        sort_keys=True,
        separators=(",", ":"),
    )


class ObservationOutboxMetrics:
    """
    The outbox's series for observations, on svc-proxy's registry:
    C{svc_proxy_memory_observations_outbox} (waiting),
    C{svc_proxy_memory_observations_sent_total} and
    C{svc_proxy_memory_observations_rejected_total{reason}}.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.usageOutboxRows = Gauge(
            "svc_proxy_memory_observations_outbox",
            "Observations waiting to be committed by svc-memory.",
            registry=registry,
        )
        self.usageRowsSent = Counter(
            "svc_proxy_memory_observations_sent",
            "Observations committed by svc-memory.",
            registry=registry,
        )
        self._rejected = Counter(
            "svc_proxy_memory_observations_rejected",
            "Observations svc-memory refused for good, by reason.",
            ["reason"],
            registry=registry,
        )

    def usageRowRejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason).inc()


def observationOutbox(
    queue: Callable[[Sequence[memory_pb2.Observation]], Deferred[Any]],
    clock: Clock,
    metrics: ObservationOutboxMetrics,
    journalPath: str | None = None,
    maxObservations: int = OBSERVATION_OUTBOX_MAX,
) -> UsageOutbox:
    """
    The outbox that carries observations to svc-memory: D12's outbox and
    journal (batched, bounded, journalled, resent until acknowledged),
    with C{queue} (L{svcd.memory.client.MemoryClient.queueObservations})
    as the call that commits a batch. svc-memory queues one observation
    per request id, so one sent twice is queued once.
    """
    journal = None
    if journalPath is not None:
        journal = UsageJournal(
            journalPath,
            rowType=memory_pb2.Observation,
            keyOf=observationKey,
            magic=OBSERVATION_JOURNAL_MAGIC,
        )
    return UsageOutbox(
        None,
        clock,
        metrics,
        maxRows=maxObservations,
        journal=journal,
        batchRows=OBSERVATION_BATCH,
        send=queue,
        keyOf=observationKey,
        describe=describeObservation,
    )
