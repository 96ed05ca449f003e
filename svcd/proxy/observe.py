"""
What of a chat completion becomes an observation (decisions D13,
"Observation and the worker"): the request's user messages after its
last assistant message, then the answer's text, each cut to
L{MAX_OBSERVED_MESSAGE_BYTES} on a character boundary.

Kept apart from the route and the relay so that the choice of messages
and the cuts are plain functions a test checks directly, and so that a
stream's text is gathered (L{AnswerText}) only when the request observes:
a request that does not observe pays nothing for it.

The chat route asks L{Observer} two things: at its handler, whether the
request observes (L{Observer.plan}: memory on, the org's or agent's
C{observe} C{all}, or C{on} and the request names a subject, no
C{X-SVC-Memory: off}); after an answer that ended C{ok}, to record its
observation (L{Observer.record}), which never fails and never waits: the
outbox (L{observationOutbox}, C{SVC_MEMORY_JOURNAL}) carries it to
svc-memory in the background.

Whose words (decisions D13 amended): with C{on}, a request that names no
subject is not observed, and its answer, once ok, is counted
C{no_subject}. Observed into the shared subject C{""}, the words of every
user of an agent that serves many would be recalled into the answers of
every other; only C{all}, set for an agent that serves one user, does so.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from svcd.common.clocks import Clock
from svcd.common.errors import rfc3339
from svcd.common.logthrottle import ThrottledWarning
from svcd.ledger.compactions import InThread
from svcd.ledger.journal import Journal
from svcd.ledger.journalfile import MEMORY_JOURNAL_MAGIC
from svcd.ledger.outbox import Outbox
from svcd.ledger.words import OutboxWords
from svcd.limits.book import LimitBook
from svcd.limits.records import OBSERVE_OFF, OBSERVE_ON
from svcd.memoryclient.records import MAX_OBSERVED_MESSAGE_BYTES, MAX_OBSERVED_MESSAGES
from svcd.pb.memory.v1 import memory_pb2
from svcd.proxy.config import OBSERVATION_OUTBOX_MAX, OBSERVATION_OUTBOX_MB
from svcd.proxy.memoryheaders import chatMemory
from svcd.proxy.recall import messageText

__all__ = [
    "AnswerText",
    "ObservationOutboxMetrics",
    "Observer",
    "Observing",
    "completionText",
    "cutText",
    "observation",
    "observationOutbox",
    "observedUserTexts",
]


# A surrogate code point in a Python string is a lone one: JSON's escaped
# pairs are joined into one character when parsed.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def cutText(text: str, limit: int = MAX_OBSERVED_MESSAGE_BYTES) -> str:
    """
    C{text} cut to at most C{limit} bytes of UTF-8, never inside a
    character (a cut inside one would make a string svc-memory cannot
    store). NUL characters are dropped: PostgreSQL's text cannot hold
    them, and an observation refused for one would be lost for a byte. A
    lone surrogate (JSON's C{"\\ud800"}, which a provider's answer may
    hold: the chat body's parser refuses it only in requests) becomes
    U+FFFD: protobuf cannot encode it, and the whole observation would be
    lost for it.
    """
    text = _LONE_SURROGATE.sub("\ufffd", text.replace("\x00", ""))
    encoded = text.encode("utf-8")
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
    key: str,
    endedAt: float | None = None,
) -> memory_pb2.Observation | None:
    """
    The observation of one chat completion that ended C{ok}, or None when
    there is nothing to observe (no user text in the turn, or an empty
    answer and no user text).

    @param key: what makes it idempotent: the request's ledger id, made by
        the gateway for each forwarded request, never the client's request
        id, which clients reuse (sql/0015_observation_key.sql).
    @param endedAt: when the answer ended, in seconds since the epoch by
        the proxy's clock: a deletion of the scope at or after it is final
        for the observation (decisions D13, amended); None: svc-memory
        takes the time it is queued.
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
        key=key,
        ended_at=endedAtText(endedAt) if endedAt is not None else "",
    )


def endedAtText(seconds: float) -> str:
    """
    Observation.ended_at of a time in seconds since the epoch: RFC 3339,
    UTC, to the millisecond.
    """
    return rfc3339(datetime.datetime.fromtimestamp(seconds, datetime.UTC))


class AnswerText:
    """
    The text of a streamed answer, gathered from its deltas as the relay
    parses them: C{choices[0].delta.content} of each chunk of chat
    completions, the C{text_delta}s of Anthropic's C{content_block_delta}
    events (decisions D14), whichever the stream is. Bounded: once
    L{MAX_OBSERVED_MESSAGE_BYTES} worth of characters are held, later
    deltas are not kept (a character is at most 4 bytes, so holding that
    many characters always suffices for the cut).
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
        if event.get("type") == "content_block_delta":
            delta = event.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta":
                self._add(delta.get("text"))
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
        self._add(delta.get("content"))

    def _add(self, content: object) -> None:
        if isinstance(content, str) and content:
            self._parts.append(content)
            self._held += len(content)

    def addData(self, data: bytes) -> None:
        """
        Take the data of one stream event as the relay found it (JSON, or
        anything else, ignored). Once the bound is held, nothing more is
        parsed: a long answer costs its first 16 KiB.
        """
        if self._held >= self._limit:
            return
        try:
            event = json.loads(data)
        except ValueError:
            return
        if isinstance(event, dict):
            self.addEvent(event)

    def text(self) -> str:
        return cutText("".join(self._parts))


def completionText(body: Mapping[str, Any]) -> str:
    """
    The text of a non-streamed answer: its first choice's message content,
    or an Anthropic message's text blocks (decisions D14).
    """
    if body.get("type") == "message":
        return messageText(body.get("content"))
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        if isinstance(message, dict):
            return messageText(message.get("content"))
    return ""


# The first line of the memory journal (SVC_MEMORY_JOURNAL): its own, so
# that a usage journal is never read as one, nor the reverse.
OBSERVATION_JOURNAL_MAGIC = MEMORY_JOURNAL_MAGIC
# Observations per QueueObservations call: svc-memory commits a batch in
# one transaction, and a batch must stay under svc-memory's 64 MiB receive
# limit even with every observation at its bound (50 x 64 x 16 KiB, some
# 52 MiB; a few KiB each in practice).
OBSERVATION_BATCH = 50


# The memory journal forgets (decisions D13, amended): an observation's
# content stays in the file only until svc-memory has acknowledged it.
# The journal is rewritten with only the observations waiting after an
# acknowledgement, at most once every so many seconds (the
# acknowledgements meanwhile share a rewrite): at most four rewrites a
# second, each a few milliseconds (two fsyncs, a batch or two copied, in
# the journal's own thread), and an acknowledged observation is gone from
# the file within about a quarter of a second
# (L{svcd.ledger.compactions.Compactions}).
OBSERVATION_JOURNAL_COMPACT_SECONDS = 0.25


# What the outbox's and the journal's log lines call observations.
OBSERVATION_WORDS = OutboxWords(
    records="observation(s)",
    record="observation",
    peer="svc-memory",
    call="QueueObservations",
    journal="Memory journal",
    variable="SVC_MEMORY_JOURNAL",
    keyField="observation_key",
)


def observationKey(observation: memory_pb2.Observation) -> str:
    """
    An observation's idempotence key: svc-memory queues one per key, the
    request's ledger id (its request id for one journalled by an earlier
    release, which had no key).
    """
    return str(observation.key or observation.request_id)


def observationIDs(observation: memory_pb2.Observation) -> dict[str, Any]:
    """
    What may be kept of an observation svc-memory refused for good: its
    organization, agent, request id and size (messages, bytes), and
    whether it named a subject; never its content nor the subject, which
    is personal data (often an email address) and, like content, is never
    logged (decisions D13, amended).
    """
    return {
        "org_id": observation.scope.org_id,
        "agent_id": observation.scope.agent_id,
        "subject_named": bool(observation.scope.subject),
        "request_id": observation.request_id,
        "key": observationKey(observation),
        "messages": len(observation.messages),
        "bytes": sum(
            len(each.content.encode("utf-8", "surrogatepass")) for each in observation.messages
        ),
    }


def describeObservation(observation: memory_pb2.Observation) -> str:
    """
    What the log may say of an observation svc-memory refused for good
    (L{observationIDs}, as one JSON object).
    """
    return json.dumps(observationIDs(observation), sort_keys=True, separators=(",", ":"))


def rejectedObservation(observation: memory_pb2.Observation) -> dict[str, Any]:
    """
    What the rejects file (C{<SVC_MEMORY_JOURNAL>.rejects}) keeps of an
    observation svc-memory refused for good: its ids and size, not its
    content. Sent again it would be refused again, so the content serves
    no one; kept, it would outlive what forgetting deletes (decisions
    D13: forgetting is deletion) in a file nothing reads.
    """
    return {"observation": observationIDs(observation)}


# The outcomes of svc_proxy_memory_observations_total: an observation
# recorded in the outbox; a request that observes with nothing to observe
# (no user text in its turn); one dropped because the outbox was full
# (svc-memory away for long), or because recording it failed; an answer
# left unobserved because its request named no subject while observe is
# on (decisions D13 amended, "Whose words"). Then, once svc-memory answers
# for one recorded (so counted a second time), one it refused for good
# (QueuedObservation.refused): its scope or agent was deleted after the
# answer ended, or its organization has too many observations waiting
# (decisions D13, amended).
OBSERVED = "recorded"
NOTHING_OBSERVED = "empty"
OUTBOX_FULL = "full"
OBSERVE_ERROR = "error"
NO_SUBJECT = "no_subject"
FORGOTTEN = "forgotten"
QUEUE_FULL = "queue_full"
REFUSALS = (FORGOTTEN, QUEUE_FULL)
OBSERVE_OUTCOMES = (
    OBSERVED,
    NOTHING_OBSERVED,
    OUTBOX_FULL,
    OBSERVE_ERROR,
    NO_SUBJECT,
    *REFUSALS,
)


class ObservationOutboxMetrics:
    """
    The series of observations, on svc-proxy's registry:
    C{svc_proxy_memory_observations_total{outcome}} (what became of each
    request that observes), and the outbox's
    C{svc_proxy_memory_observations_outbox} (waiting),
    C{svc_proxy_memory_observations_sent_total} and
    C{svc_proxy_memory_observations_rejected_total{reason}}.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._observations = Counter(
            "svc_proxy_memory_observations",
            "Chat completions that observe, by what became of their observation"
            " (no_subject: left unobserved, observe on and no subject named).",
            ["outcome"],
            registry=registry,
        )
        for outcome in OBSERVE_OUTCOMES:
            self._observations.labels(outcome=outcome)
        self.usageOutboxRows = Gauge(
            "svc_proxy_memory_observations_outbox",
            "Observations waiting to be committed by svc-memory.",
            registry=registry,
        )
        self.outboxBytes = Gauge(
            "svc_proxy_memory_observations_outbox_bytes",
            "The serialized bytes of the observations waiting (at most SVC_MEMORY_OUTBOX_MB).",
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

    def observed(self, outcome: str) -> None:
        """
        Count one request that observes by outcome (L{OBSERVE_OUTCOMES}).
        """
        self._observations.labels(outcome=outcome).inc()


def observationOutbox(
    queue: Callable[[Sequence[memory_pb2.Observation]], Deferred[Any]],
    clock: Clock,
    metrics: ObservationOutboxMetrics,
    journalPath: str | None = None,
    maxObservations: int = OBSERVATION_OUTBOX_MAX,
    maxBytes: int = OBSERVATION_OUTBOX_MB * 2**20,
    inThread: InThread | None = None,
) -> Outbox:
    """
    The outbox that carries observations to svc-memory: D12's outbox and
    journal (batched, bounded, journalled, resent until acknowledged),
    with C{queue} (L{svcd.memoryclient.client.MemoryClient.queueObservations})
    as the call that commits a batch. svc-memory queues one observation
    per key (L{observationKey}), so one sent twice is queued once. It holds at most
    C{maxObservations}, and at most C{maxBytes} of them serialized: their
    sizes range from a few hundred bytes to about 1 MiB. Its journal, when
    C{journalPath} is given, is the caller's to L{Journal.hold} as
    the daemon is built (L{Outbox.start} takes its lock too); it
    holds an observation only until svc-memory has acknowledged it
    (L{OBSERVATION_JOURNAL_COMPACT_SECONDS}); its rewrites' copies and
    fsyncs are done by C{inThread}, in the journal's one-thread pool,
    when it is given (L{svcd.ledger.compactions}), else on the reactor.

    An observation svc-memory answers refused (QueuedObservation.refused,
    L{REFUSALS}) is acknowledged like one queued, for good: it leaves the
    outbox and the journal and is never sent again (sent again it would be
    refused again, and a forgotten one must not linger in the journal);
    it is counted by its refusal.
    """
    journal = None
    if journalPath is not None:
        journal = Journal(
            journalPath,
            rowType=memory_pb2.Observation,
            keyOf=observationKey,
            magic=OBSERVATION_JOURNAL_MAGIC,
            words=OBSERVATION_WORDS,
            rejectedAs=rejectedObservation,
        )
    outbox = Outbox(
        None,
        clock,
        metrics,
        maxRows=maxObservations,
        journal=journal,
        batchRows=OBSERVATION_BATCH,
        send=_countingRefusals(queue, metrics),
        keyOf=observationKey,
        describe=describeObservation,
        words=OBSERVATION_WORDS,
        maxBytes=maxBytes,
        sizeOf=_serializedSize,
        compactEvery=OBSERVATION_JOURNAL_COMPACT_SECONDS,
        compactInThread=inThread,
    )
    metrics.outboxBytes.set_function(lambda: outbox.waitingBytes)
    return outbox


def _countingRefusals(
    queue: Callable[[Sequence[memory_pb2.Observation]], Deferred[Any]],
    metrics: ObservationOutboxMetrics,
) -> Callable[[Sequence[memory_pb2.Observation]], Deferred[Any]]:
    """
    C{queue}, whose answers' refused observations are counted by refusal
    (an unknown one as an error) before the outbox acknowledges them.
    """

    def count(answer: Any) -> Any:
        for each in getattr(answer, "queued", ()):
            refused = str(each.refused)
            if refused:
                metrics.observed(refused if refused in REFUSALS else OBSERVE_ERROR)
        return answer

    def send(batch: Sequence[memory_pb2.Observation]) -> Deferred[Any]:
        return queue(batch).addCallback(count)

    return send


def _serializedSize(observation: memory_pb2.Observation) -> int:
    return int(observation.ByteSize())


class ObservationLedger(Protocol):
    """
    Where observations go (L{observationOutbox}'s L{Outbox}).
    """

    def hasRoom(self) -> bool: ...

    def record(self, row: Any) -> None: ...


@attrs.define
class Observing:
    """
    A chat completion that observes, as its handler planned it: its
    memory subject, and for a stream the text gathered from its deltas.
    With C{unobserved} set (L{NO_SUBJECT}), it does not observe: its
    answer, once ok, is only counted under that outcome (and no text is
    gathered for it).
    """

    subject: str = attrs.field(repr=False)
    answer: AnswerText | None = None
    unobserved: str | None = None


# The plan of every request left unobserved for want of a subject: the
# same one for all, nothing of the request in it.
_NO_SUBJECT = Observing("", None, NO_SUBJECT)


class Observer:
    """
    Decides which chat completions observe, and records their
    observations (decisions D13).

    @param outbox: where observations go; it carries them to svc-memory.
    @param book: the memory settings (L{LimitBook.memoryFor}).
    @param metrics: counts what became of each request that observes.
    """

    log = Logger()

    def __init__(
        self,
        outbox: ObservationLedger,
        book: LimitBook,
        metrics: ObservationOutboxMetrics,
        clock: Clock,
    ) -> None:
        self._outbox = outbox
        self._book = book
        self._metrics = metrics
        self._clock = clock
        self._full = ThrottledWarning(self.log, clock)

    def plan(self, request: Any, orgID: str, agentID: str | None, stream: bool) -> Observing | None:
        """
        Whether this request observes: None when observe is off for it
        (its agent's or organization's settings, C{X-SVC-Memory: off}, no
        agent). With C{all} it observes into its subject, C{""} when it
        names none; with C{on} only when it names one: else the plan says
        so (L{Observing.unobserved}), and its answer is only counted. A
        stream that observes gets its L{AnswerText}, which the relay
        feeds.

        @raise ApiError: 400 VALIDATION_ERROR for a bad C{X-SVC-Memory} or
            C{X-SVC-Memory-Subject}, whatever the settings (the recall's
            plan has refused those already when memory is on).
        """
        _, observe, subject = chatMemory(request, self._book, orgID, agentID)
        if observe == OBSERVE_OFF or agentID is None:
            return None
        if observe == OBSERVE_ON and not subject:
            return _NO_SUBJECT
        return Observing(subject, AnswerText() if stream else None)

    def record(
        self,
        observing: Observing,
        orgID: str,
        agentID: str,
        requestID: str,
        messages: Sequence[Mapping[str, Any]],
        body: bytes,
        ledgerID: str,
    ) -> None:
        """
        Record the observation of an answer that ended C{ok}: the user's
        turn of C{messages} and the answer's text (a stream's gathered
        from its deltas, else the first choice's content of C{body}).
        Never raises and never waits: an observation that cannot be
        recorded (the outbox full, a fault) is counted and logged by its
        ids, and the answer goes on as if observe were off. A plan that
        does not observe (L{Observing.unobserved}) is only counted.
        """
        if observing.unobserved is not None:
            self._metrics.observed(observing.unobserved)
            return
        try:
            if observing.answer is not None:
                answer = observing.answer.text()
            else:
                parsed = json.loads(body)
                answer = completionText(parsed) if isinstance(parsed, dict) else ""
            made = observation(
                orgID,
                agentID,
                observing.subject,
                requestID,
                messages,
                answer,
                ledgerID,
                self._clock.seconds(),
            )
            if made is None:
                self._metrics.observed(NOTHING_OBSERVED)
                return
            if not self._outbox.hasRoom():
                self._metrics.observed(OUTBOX_FULL)
                self._full.warn(
                    "The observation outbox is full (svc-memory has not taken"
                    " observations for a while); observation of request {request_id}"
                    " dropped",
                    org_id=orgID,
                    request_id=requestID,
                )
                return
            self._outbox.record(made)
        except Exception as error:
            self._metrics.observed(OBSERVE_ERROR)
            # The error's type only: its message could quote a text.
            self.log.error(
                "Recording the observation of request {request_id} failed ({error_type});"
                " the answer is unaffected",
                org_id=orgID,
                request_id=requestID,
                error_type=type(error).__name__,
            )
            return
        self._metrics.observed(OBSERVED)
