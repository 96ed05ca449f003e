"""
The memory journal forgets (decisions D13, amended, "Forgetting reaches
every copy"): svc-proxy's observation outbox (L{observationOutbox},
C{SVC_MEMORY_JOURNAL}) holds an observation's content in its journal only
until svc-memory has acknowledged it; within a second of the
acknowledgement no byte of it is left in the journal file, nor in a copy
beside it. Observations not yet acknowledged still outlive a restart and
a crash in the middle of a rewrite, each sent once.

The journal is a real file read as raw bytes; svc-memory is the test
double of tests/test_proxy_observe.py, whose answers the test gives, on
a L{Clock} (a real svc-memory: tests/test_gateway_observe.py).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from twisted.python.failure import Failure

from svcd.ledger.compactions import Compactions
from svcd.ledger.outbox import Outbox
from svcd.pb.memory.v1 import memory_pb2
from svcd.proxy.observe import (
    OBSERVATION_JOURNAL_COMPACT_SECONDS,
    OBSERVATION_JOURNAL_MAGIC,
    ObservationOutboxMetrics,
    observation,
    observationOutbox,
)

ROOT = Path(__file__).resolve().parent.parent


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

    def acknowledge(self) -> None:
        """
        Answer the last call: every observation of it queued.
        """
        observations, answer = self.calls[-1]
        queued = [memory_pb2.QueuedObservation(id=f"id-{o.request_id}") for o in observations]
        answer.callback(memory_pb2.QueueObservationsResponse(queued=queued))


def made(requestID: str, text: str) -> memory_pb2.Observation:
    """
    The observation of a chat whose user said C{text}.
    """
    observed = observation(
        "org", "agent", "", requestID, [{"role": "user", "content": text}], "ok", requestID
    )
    assert observed is not None
    return observed


def marker() -> str:
    """
    Words no other observation holds, to look for in the files' bytes.
    """
    return "zebrafact-" + uuid.uuid4().hex


def filesHolding(directory: Path, text: str) -> list[str]:
    """
    The files of C{directory} whose raw bytes hold C{text} (the journal,
    and any copy a rewrite left beside it).
    """
    needle = text.encode("utf-8")
    return sorted(
        each.name for each in directory.iterdir() if each.is_file() and needle in each.read_bytes()
    )


def outboxOn(path: Path, queue: FakeQueue, clock: Clock) -> Outbox:
    outbox = observationOutbox(
        queue, clock, ObservationOutboxMetrics(CollectorRegistry()), journalPath=str(path)
    )
    outbox.start()
    return outbox


def forgetWithin(clock: Clock, directory: Path, text: str, seconds: float = 1.0) -> float:
    """
    Advance C{clock} in steps of 50 ms until no file of C{directory} holds
    C{text}, for at most C{seconds}: how long it took.
    """
    waited = 0.0
    while filesHolding(directory, text):
        assert waited < seconds, f"still in {filesHolding(directory, text)} after {waited} s"
        clock.advance(0.05)
        waited += 0.05
    return waited


@pytest.fixture
def rewrites(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """
    The journals renamed into place by rewrites, as they happen.
    """
    done: list[str] = []
    replace = os.replace

    def counted(source: Any, target: Any) -> None:
        replace(source, target)
        done.append(str(target))

    monkeypatch.setattr(os, "replace", counted)
    yield done


def test_an_acknowledged_observation_leaves_the_journal_within_a_second(tmp_path: Path) -> None:
    """
    An observation svc-memory has acknowledged is gone from the journal's
    bytes within a second (at once here: no rewrite came before), and
    from every file beside it; one still waiting stays, sent again after
    a restart (a new outbox on the same file), alone and once.
    """
    path = tmp_path / "memory.journal"
    acked, waiting = marker(), marker()
    clock = Clock()
    queue = FakeQueue()
    outbox = outboxOn(path, queue, clock)
    outbox.record(made("r-acked", f"I am {acked}."))
    clock.advance(1)
    outbox.record(made("r-waiting", f"I am {waiting}."))
    assert filesHolding(tmp_path, acked) == ["memory.journal"]
    queue.acknowledge()
    forgetWithin(clock, tmp_path, acked)
    assert filesHolding(tmp_path, waiting) == ["memory.journal"]
    outbox.close()

    again = FakeQueue()
    restarted = outboxOn(path, again, Clock())
    assert [[each.request_id for each in call] for call, _ in again.calls] == [["r-waiting"]]
    assert again.calls[0][0][0].messages[0].content == f"I am {waiting}."
    again.acknowledge()
    restarted.close()
    assert filesHolding(tmp_path, acked) == []
    assert filesHolding(tmp_path, waiting) == []


def test_acknowledgements_share_a_rewrite(tmp_path: Path, rewrites: list[str]) -> None:
    """
    A busy proxy does not rewrite its journal per acknowledgement: those
    that follow a rewrite within OBSERVATION_JOURNAL_COMPACT_SECONDS share
    the next one, due that long after the last, so that the journal is
    rewritten at most four times a second, and each acknowledged
    observation still leaves the file well within the second. The rows
    recorded meanwhile, acknowledged or not, are in the right file.
    """
    assert OBSERVATION_JOURNAL_COMPACT_SECONDS == 0.25
    path = tmp_path / "memory.journal"
    clock = Clock()
    queue = FakeQueue()
    outbox = outboxOn(path, queue, clock)
    rewrites.clear()
    markers: list[str] = []
    # Ten observations a 50 ms, each batch acknowledged as it is sent,
    # for two seconds.
    for step in range(40):
        text = marker()
        markers.append(text)
        outbox.record(made(f"r-{step}", f"I am {text}."))
        clock.advance(0.05)
        queue.acknowledge()
    assert outbox.waiting == 0
    assert len(queue.calls) == 40
    # One rewrite at the first acknowledgement, then at most one a 0.25 s.
    assert 2 <= len(rewrites) <= 1 + 2 / 0.25
    # Acknowledged within the last quarter of a second: still in the file
    # until the rewrite due, then gone.
    assert filesHolding(tmp_path, markers[-1]) == ["memory.journal"]
    assert forgetWithin(clock, tmp_path, markers[-1]) <= 0.25
    assert not any(filesHolding(tmp_path, each) for each in markers)
    outbox.close()


def test_a_stop_forgets_what_was_acknowledged(tmp_path: Path) -> None:
    """
    A proxy stopped just after an acknowledgement, before the rewrite it
    called for was due, leaves no byte of the acknowledged observation in
    its journal: the stop rewrites it, keeping the one still waiting.
    """
    path = tmp_path / "memory.journal"
    first, second, waiting = marker(), marker(), marker()
    clock = Clock()
    queue = FakeQueue()
    outbox = outboxOn(path, queue, clock)
    outbox.record(made("r-1", f"I am {first}."))
    clock.advance(1)
    queue.acknowledge()
    outbox.record(made("r-2", f"I am {second}."))
    clock.advance(0.06)
    outbox.record(made("r-3", f"I am {waiting}."))
    queue.acknowledge()
    # The second acknowledgement came 60 ms after the first rewrite.
    assert filesHolding(tmp_path, second) == ["memory.journal"]
    outbox.close()
    assert filesHolding(tmp_path, second) == []
    assert filesHolding(tmp_path, waiting) == ["memory.journal"]
    again = FakeQueue()
    outboxOn(path, again, Clock()).close()
    assert [[each.request_id for each in call] for call, _ in again.calls] == [["r-3"]]


def test_a_failed_rewrite_leaves_no_copy_and_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    A rewrite that fails at its rename (a full disk, anything) removes the
    copy it wrote, which holds the observations still waiting, logs why
    without a word of the content, and is tried again: the acknowledged
    observation leaves the file then.
    """
    path = tmp_path / "memory.journal"
    acked, waiting = marker(), marker()
    clock = Clock()
    queue = FakeQueue()
    outbox = outboxOn(path, queue, clock)
    outbox.record(made("r-acked", f"I am {acked}."))
    clock.advance(1)
    outbox.record(made("r-waiting", f"I am {waiting}."))
    replace = os.replace
    failures: list[str] = []

    def failing(source: Any, target: Any) -> None:
        if not failures:
            failures.append(str(source))
            raise OSError(28, "No space left on device")
        replace(source, target)

    monkeypatch.setattr(os, "replace", failing)
    lines: list[str] = []

    def heard(event: dict[str, Any]) -> None:
        lines.append(formatEvent(event))

    globalLogPublisher.addObserver(cast(ILogObserver, heard))
    try:
        queue.acknowledge()
    finally:
        globalLogPublisher.removeObserver(cast(ILogObserver, heard))
    assert failures == [str(path) + ".compacting"]
    assert sorted(each.name for each in tmp_path.iterdir()) == [
        "memory.journal",
        "memory.journal.lock",
    ]
    assert any("No space left on device" in each for each in lines)
    assert not any(acked in each or waiting in each for each in lines)
    forgetWithin(clock, tmp_path, acked)
    assert filesHolding(tmp_path, waiting) == ["memory.journal"]
    outbox.close()


def test_a_crash_between_the_copy_and_the_rename_replays_correctly(tmp_path: Path) -> None:
    """
    A proxy killed in the middle of a rewrite, after the new copy is
    written and fsynced and before it replaces the journal, leaves the old
    journal whole: the next start sends every observation not
    acknowledged, once each and none that was, and its own rewrite
    replaces the copy left behind, so that no file holds the acknowledged
    observation once the proxy runs again.
    """
    path = tmp_path / "memory.journal"
    acked, waiting = marker(), marker()
    script = textwrap.dedent(
        """
        import os, sys
        sys.path.insert(0, sys.argv[2])
        from twisted.internet.task import Clock
        from test_proxy_memory_journal import FakeQueue, made, outboxOn

        clock = Clock()
        queue = FakeQueue()
        outbox = outboxOn(sys.argv[1], queue, clock)
        outbox.record(made("r-acked", "I am " + sys.argv[3] + "."))
        clock.advance(1)
        outbox.record(made("r-waiting", "I am " + sys.argv[4] + "."))

        def killed(source, target):
            os._exit(17)

        os.replace = killed
        queue.acknowledge()
        os._exit(3)
        """
    )
    killed = subprocess.run(
        [sys.executable, "-c", script, str(path), str(ROOT / "tests"), acked, waiting],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert killed.returncode == 17, killed.stderr.decode()
    # The copy holds only what waits; the journal still holds both.
    assert filesHolding(tmp_path, waiting) == ["memory.journal", "memory.journal.compacting"]
    assert filesHolding(tmp_path, acked) == ["memory.journal"]

    again = FakeQueue()
    restarted = outboxOn(path, again, Clock())
    assert [[each.request_id for each in call] for call, _ in again.calls] == [["r-waiting"]]
    assert filesHolding(tmp_path, acked) == []
    assert not (tmp_path / "memory.journal.compacting").exists()
    again.acknowledge()
    restarted.close()
    assert filesHolding(tmp_path, waiting) == []


class SlowJournal:
    """
    A journal whose rewrite takes C{took} seconds of C{clock}: it says
    when each rewrite began.
    """

    def __init__(self, clock: Clock, took: float) -> None:
        self.clock = clock
        self.took = took
        self.acknowledgedBytes = 0
        self.began: list[float] = []

    def dropAcknowledged(self, waiting: Any) -> bool:
        self.began.append(self.clock.seconds())
        self.clock.advance(self.took)
        self.acknowledgedBytes = 0
        return True


@pytest.mark.parametrize(
    ("took", "spacing"), [(0.005, 0.25), (0.15, 0.6), (0.35, 0.7), (0.6, 1.2), (1.5, 2.0)]
)
def test_rewrites_space_out_when_they_are_slow(took: float, spacing: float) -> None:
    """
    After svc-memory was away, thousands of observations may wait and a
    rewrite take a tenth of a second or more on the reactor's thread: the
    next one then begins four times as long after it, within what keeps
    the second (a rewrite of 0.35 s: 0.7 s), and never less than twice
    as long (0.6 s: 1.2 s), so that a draining proxy keeps most of its
    time for requests; never more than 2 s after it (the reactor's clock
    is the wall clock, which may jump). A quick one: every 0.25 s.
    """
    clock = Clock()
    journal = SlowJournal(clock, took)
    compactions = Compactions(cast(Any, journal), clock, 0.25, tuple, lambda error: None)
    journal.acknowledgedBytes = 100
    compactions.acknowledged()
    journal.acknowledgedBytes = 100
    compactions.acknowledged()
    compactions.acknowledged()
    assert compactions.pending
    clock.pump([0.01] * 400)
    assert len(journal.began) == 2
    assert journal.began[1] - journal.began[0] == pytest.approx(spacing, abs=0.011)


def test_a_row_the_journal_could_not_take_is_journalled_by_the_next_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    A rewrite copies the records of the rows waiting from the file, as
    they are; when the outbox holds a row the journal could not take (a
    full disk when it was recorded), the rewrite writes every row the
    outbox holds instead, so that the row outlives a restart from then
    on, and the acknowledged one is gone all the same.
    """
    path = tmp_path / "memory.journal"
    acked, missed = marker(), marker()
    clock = Clock()
    queue = FakeQueue()
    outbox = outboxOn(path, queue, clock)
    outbox.record(made("r-acked", f"I am {acked}."))
    clock.advance(1)
    write = os.write

    def full(fd: int, data: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    outbox.record(made("r-missed", f"I am {missed}."))
    monkeypatch.setattr(os, "write", write)
    assert outbox.waiting == 2
    assert filesHolding(tmp_path, missed) == []
    queue.acknowledge()
    forgetWithin(clock, tmp_path, acked)
    assert filesHolding(tmp_path, missed) == ["memory.journal"]
    outbox.close()
    again = FakeQueue()
    outboxOn(path, again, Clock()).close()
    assert [[each.request_id for each in call] for call, _ in again.calls] == [["r-missed"]]


class FakeThread:
    """
    The journal's one-thread pool, played by the test: each function
    given waits in C{queued} until L{run} calls it (on the test's
    thread, while the outbox goes on recording meanwhile, as it would on
    the reactor's), and its Deferred fires only at L{deliver}, as the
    reactor would learn of it a moment later.
    """

    def __init__(self) -> None:
        self.queued: list[tuple[Callable[[], Any], Deferred[Any]]] = []
        self.done: list[tuple[Deferred[Any], Any, BaseException | None]] = []

    def __call__(self, function: Callable[[], Any]) -> Deferred[Any]:
        result: Deferred[Any] = Deferred()
        self.queued.append((function, result))
        return result

    def run(self) -> None:
        function, result = self.queued.pop(0)
        try:
            self.done.append((result, function(), None))
        except BaseException as error:
            self.done.append((result, None, error))

    def deliver(self) -> None:
        result, value, error = self.done.pop(0)
        if error is None:
            result.callback(value)
        else:
            result.errback(Failure(error))

    def finish(self) -> None:
        """
        Deliver what was run, then run and deliver what is queued, and
        what that queues in turn.
        """
        while self.done:
            self.deliver()
        while self.queued:
            self.run()
            self.deliver()


def threadedOutbox(path: Path, queue: FakeQueue, clock: Clock, thread: FakeThread) -> Outbox:
    outbox = observationOutbox(
        queue,
        clock,
        ObservationOutboxMetrics(CollectorRegistry()),
        journalPath=str(path),
        inThread=thread,
    )
    outbox.start()
    return outbox


def replayed(path: Path, elsewhere: Path) -> list[list[str]]:
    """
    What a start on a copy of the journal at C{path} would send first:
    the request ids of its batches.
    """
    elsewhere.mkdir()
    shutil.copyfile(path, elsewhere / path.name)
    again = FakeQueue()
    outboxOn(elsewhere / path.name, again, Clock()).close()
    return [[each.request_id for each in call] for call, _ in again.calls]


def test_a_rewrite_in_the_thread_keeps_every_row_recorded_meanwhile(
    tmp_path: Path, rewrites: list[str]
) -> None:
    """
    With the journal's thread, a rewrite copies the rows waiting there
    while the reactor goes on recording and acknowledging, to the old
    file; the copy replaces the journal with what the old file gained
    meanwhile carried over, so that every row recorded is in the new
    file, the ones acknowledged meanwhile counted as such, and none is
    replayed twice or lost. The acknowledged row of the snapshot is gone
    at the rename; one acknowledged during the copy at the next rewrite,
    within the second.
    """
    path = tmp_path / "memory.journal"
    acked, during, late1, late2 = marker(), marker(), marker(), marker()
    clock = Clock()
    queue = FakeQueue()
    thread = FakeThread()
    outbox = threadedOutbox(path, queue, clock, thread)
    rewrites.clear()
    outbox.record(made("r-acked", f"I am {acked}."))
    clock.advance(1)
    outbox.record(made("r-during", f"I am {during}."))
    queue.acknowledge()
    # The rewrite began: its copy waits for the thread, nothing renamed.
    assert len(thread.queued) == 1 and rewrites == []
    clock.advance(0.06)
    outbox.record(made("r-late1", f"I am {late1}."))
    thread.run()
    # The copy is written; the reactor goes on: r-during is acknowledged
    # after the snapshot, r-late2 recorded after the copy.
    clock.advance(0.06)
    queue.acknowledge()
    assert [each.request_id for each in queue.calls[-1][0]] == ["r-during"]
    outbox.record(made("r-late2", f"I am {late2}."))
    assert filesHolding(tmp_path, acked) == ["memory.journal"]
    assert filesHolding(tmp_path, late1) == ["memory.journal"]
    thread.deliver()
    assert rewrites == [str(path)]
    assert filesHolding(tmp_path, acked) == []
    for each in (during, late1, late2):
        assert filesHolding(tmp_path, each) == ["memory.journal"]
    assert replayed(path, tmp_path / "copy") == [["r-late1", "r-late2"]]
    # The old file's closing and the directory's fsync, then the next
    # rewrite once it is due.
    thread.finish()
    waited = 0.0
    while filesHolding(tmp_path, during):
        assert waited < 1.0
        clock.advance(0.05)
        waited += 0.05
        thread.finish()
    assert rewrites.count(str(path)) == 2
    assert replayed(path, tmp_path / "again") == [["r-late1", "r-late2"]]
    outbox.close()
    assert not (tmp_path / "memory.journal.compacting").exists()


def test_a_stop_waits_for_the_rewrite_in_the_thread_then_makes_the_last(
    tmp_path: Path,
) -> None:
    """
    A stop (L{Outbox.settle}, before the close) while the thread
    copies waits for that rewrite, then makes the last one, so that the
    rows acknowledged during the copy leave the file too; only the row
    still waiting is replayed. A stop that cannot wait longer than its
    bound abandons the copy, which removes itself: the old journal is
    kept whole, and the next start drops what it holds acknowledged.
    """
    path = tmp_path / "memory.journal"
    first, second, waiting = marker(), marker(), marker()
    clock = Clock()
    queue = FakeQueue()
    thread = FakeThread()
    outbox = threadedOutbox(path, queue, clock, thread)
    outbox.record(made("r-1", f"I am {first}."))
    clock.advance(1)
    outbox.record(made("r-2", f"I am {second}."))
    queue.acknowledge()
    clock.advance(0.06)
    outbox.record(made("r-3", f"I am {waiting}."))
    queue.acknowledge()
    settled: list[object] = []
    outbox.settle(5.0).addCallback(settled.append)
    assert settled == []
    thread.run()
    thread.deliver()
    assert filesHolding(tmp_path, first) == []
    assert filesHolding(tmp_path, second) == ["memory.journal"]
    assert settled == []
    # The old file's closing and the directory's fsync, then the last
    # rewrite, in the thread too.
    thread.finish()
    assert settled == [None]
    outbox.close()
    assert filesHolding(tmp_path, second) == []
    assert filesHolding(tmp_path, waiting) == ["memory.journal"]
    assert replayed(path, tmp_path / "copy") == [["r-3"]]

    # Past its bound: the copy is abandoned.
    later = tmp_path / "later"
    later.mkdir()
    path = later / "memory.journal"
    clock = Clock()
    queue = FakeQueue()
    thread = FakeThread()
    outbox = threadedOutbox(path, queue, clock, thread)
    outbox.record(made("r-1", f"I am {first}."))
    clock.advance(1)
    outbox.record(made("r-2", f"I am {second}."))
    queue.acknowledge()
    abandoned: list[object] = []
    outbox.settle(2.0).addCallback(abandoned.append)
    clock.advance(2.1)
    assert abandoned == [None]
    outbox.close()
    thread.run()
    thread.deliver()
    assert sorted(each.name for each in later.iterdir()) == [
        "memory.journal",
        "memory.journal.lock",
    ]
    assert replayed(path, tmp_path / "restart") == [["r-2"]]
    assert filesHolding(tmp_path / "restart", first) == []


def test_a_failed_copy_in_the_thread_is_removed_and_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    A copy that fails in the thread (its fsync, here: a full disk, an
    I/O error) removes itself, is logged without a word of the content,
    and is tried again C{every} seconds later; the old journal, appended
    to meanwhile, loses nothing, and the acknowledged row leaves it at
    the retry.
    """
    path = tmp_path / "memory.journal"
    acked, waiting, meanwhile = marker(), marker(), marker()
    clock = Clock()
    queue = FakeQueue()
    thread = FakeThread()
    outbox = threadedOutbox(path, queue, clock, thread)
    outbox.record(made("r-acked", f"I am {acked}."))
    clock.advance(1)
    outbox.record(made("r-waiting", f"I am {waiting}."))
    queue.acknowledge()
    fsync = os.fsync
    failures: list[int] = []

    def failing(fd: int) -> None:
        if not failures:
            failures.append(fd)
            raise OSError(5, "Input/output error")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    lines: list[str] = []

    def heard(event: dict[str, Any]) -> None:
        lines.append(formatEvent(event))

    globalLogPublisher.addObserver(cast(ILogObserver, heard))
    try:
        thread.run()
        outbox.record(made("r-meanwhile", f"I am {meanwhile}."))
        thread.deliver()
    finally:
        globalLogPublisher.removeObserver(cast(ILogObserver, heard))
    assert failures
    assert sorted(each.name for each in tmp_path.iterdir()) == [
        "memory.journal",
        "memory.journal.lock",
    ]
    assert any("Input/output error" in each for each in lines)
    assert not any(acked in each or waiting in each for each in lines)
    assert filesHolding(tmp_path, acked) == ["memory.journal"]
    assert not thread.queued
    # Tried again OBSERVATION_JOURNAL_COMPACT_SECONDS later.
    clock.advance(OBSERVATION_JOURNAL_COMPACT_SECONDS)
    assert len(thread.queued) == 1
    thread.finish()
    assert filesHolding(tmp_path, acked) == []
    assert filesHolding(tmp_path, waiting) == ["memory.journal"]
    assert filesHolding(tmp_path, meanwhile) == ["memory.journal"]
    outbox.close()
    assert replayed(path, tmp_path / "copy") == [["r-waiting", "r-meanwhile"]]


def test_a_crash_at_the_rename_of_a_copy_made_in_the_thread_replays_correctly(
    tmp_path: Path,
) -> None:
    """
    A proxy killed as a copy made in the thread was to replace the
    journal, with a row recorded while the thread copied (in the old
    file, and carried over to the copy as its tail), leaves the old
    journal whole: the next start sends every observation not
    acknowledged, once each, and its own rewrite replaces the copy.
    """
    path = tmp_path / "memory.journal"
    acked, waiting, during = marker(), marker(), marker()
    script = textwrap.dedent(
        """
        import os, sys
        sys.path.insert(0, sys.argv[2])
        from twisted.internet.task import Clock
        from test_proxy_memory_journal import FakeQueue, FakeThread, made, threadedOutbox

        clock = Clock()
        queue = FakeQueue()
        thread = FakeThread()
        outbox = threadedOutbox(sys.argv[1], queue, clock, thread)
        outbox.record(made("r-acked", "I am " + sys.argv[3] + "."))
        clock.advance(1)
        outbox.record(made("r-waiting", "I am " + sys.argv[4] + "."))
        queue.acknowledge()
        thread.run()
        outbox.record(made("r-during", "I am " + sys.argv[5] + "."))

        def killed(source, target):
            os._exit(17)

        os.replace = killed
        thread.deliver()
        os._exit(3)
        """
    )
    killed = subprocess.run(
        [sys.executable, "-c", script, str(path), str(ROOT / "tests"), acked, waiting, during],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert killed.returncode == 17, killed.stderr.decode()
    assert filesHolding(tmp_path, acked) == ["memory.journal"]
    for each in (waiting, during):
        assert filesHolding(tmp_path, each) == ["memory.journal", "memory.journal.compacting"]

    again = FakeQueue()
    restarted = outboxOn(path, again, Clock())
    assert [[each.request_id for each in call] for call, _ in again.calls] == [
        ["r-waiting", "r-during"]
    ]
    assert filesHolding(tmp_path, acked) == []
    assert not (tmp_path / "memory.journal.compacting").exists()
    again.acknowledge()
    restarted.close()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kernelCopy", [True, False], ids=["copy_file_range", "pread"])
def test_rewrites_in_the_thread_keep_exactly_the_rows_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, kernelCopy: bool
) -> None:
    """
    Whatever interleaves with the rewrites in the thread (rows recorded,
    batches acknowledged, more than the copy held among them, before the
    thread copies, after, while the old file is closed), the journal
    replays, at every step, exactly the rows the outbox holds waiting, in
    order; and once all are acknowledged and the last rewrite made, it
    holds none. The same where the kernel cannot copy a file's range
    (C{copy_file_range} refused: read and written by the thread).
    """
    if not kernelCopy:

        def refused(*args: Any) -> int:
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refused)
    chance = random.Random(seed)
    path = tmp_path / "memory.journal"
    clock = Clock()
    queue = FakeQueue()
    thread = FakeThread()
    outbox = threadedOutbox(path, queue, clock, thread)
    number = 0
    for step in range(120):
        action = chance.random()
        if action < 0.4:
            outbox.record(made(f"r-{number}", f"I am {marker()}."))
            number += 1
        elif action < 0.6 and queue.calls and not queue.calls[-1][1].called:
            queue.acknowledge()
        elif action < 0.75 and thread.queued:
            thread.run()
        elif action < 0.9 and thread.done:
            thread.deliver()
        else:
            clock.advance(chance.choice([0.05, 0.1, 0.3]))
        if step % 10 == 9 and not thread.done:
            expected = [each.request_id for each in outbox._queue]
            again = replayed(path, tmp_path / f"step-{step}")
            assert [key for batch in again for key in batch] == expected
    thread.finish()
    while outbox.waiting:
        if queue.calls[-1][1].called:
            clock.advance(0.1)
        else:
            queue.acknowledge()
        thread.finish()
    clock.advance(1)
    thread.finish()
    outbox.close()
    assert replayed(path, tmp_path / "end") == []
    assert path.stat().st_size == len(OBSERVATION_JOURNAL_MAGIC)
