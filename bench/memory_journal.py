"""
What the memory journal's forgetting costs svc-proxy (decisions D13,
amended: an observation's content leaves SVC_MEMORY_JOURNAL within a
second of svc-memory's acknowledgement). The real observation outbox
and journal, on a real file in this checkout's .data/ (a real disk, not
a tmpfs) and the real reactor; svc-memory is a double that acknowledges
each batch C{--latency} seconds after it is sent.

    python bench/memory_journal.py [--seconds 10] [--rate 200] [--size 4096]
        [--latency 0.01] [--backlog 10000]

Six runs, in one process: C{steady}, observations recorded at C{--rate}
a second, the journal forgetting with its rewrites on the reactor (what
svc-proxy did before its journal had a thread); C{steady+th}, the same
with the copies and fsyncs in a one-thread pool (what svc-proxy does
now); C{threshold}, the journal compacted only past 16 MiB (what the
usage journal still does); C{drain} and C{drain+th}, a backlog of
C{--backlog} observations (svc-memory was away) acknowledged as fast as
the double answers, the journal forgetting on the reactor, then in the
thread; C{drain-thr}, the same with the 16 MiB threshold (no rewrite: the
reactor's lateness of the drain itself, on this machine). For each: the
rewrites (how many a second, the reactor's time of each, the whole of
each from the snapshot to the rename, and in the thread the reactor's
two steps apart), the reactor time they took, the process's CPU time,
the longest an acknowledged observation's bytes stayed in the file (from
the acknowledgement to the end of the rewrite that dropped them: the
first whose snapshot came after it, once the old file is closed) and the
reactor's worst lateness (a 10 ms timer's: its longest stall) and its
99th percentile.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry  # noqa: E402
from twisted.internet import task  # noqa: E402
from twisted.internet.defer import Deferred, ensureDeferred  # noqa: E402
from twisted.internet.threads import deferToThreadPool  # noqa: E402
from twisted.python.threadpool import ThreadPool  # noqa: E402

from svcd.ledger import compactions  # noqa: E402
from svcd.ledger import journal as journalModule  # noqa: E402
from svcd.ledger.outbox import Outbox  # noqa: E402
from svcd.pb.memory.v1 import memory_pb2  # noqa: E402
from svcd.proxy import observe  # noqa: E402


class Measured:
    """
    The rewrites of one run, the acknowledgements they dropped, and the
    reactor's lateness.
    """

    def __init__(self) -> None:
        # The reactor's time of each rewrite, and each one's whole
        # length (the same, on the reactor; from the snapshot to the
        # rename, in the thread).
        self.rewrites: list[float] = []
        self.threaded: list[float] = []
        # In the thread: the reactor's two steps of each, apart.
        self.starts: list[float] = []
        self.finishes: list[float] = []
        self.acknowledged: list[float] = []
        self.residency: list[float] = []
        self.lateness: list[float] = []


# The run being measured.
CURRENT = Measured()


def install() -> None:
    """
    Time every rewrite of a forgetting journal (the whole of one on the
    reactor; the reactor's two steps of one in the thread, and the
    thread's copy between them), and note when each acknowledgement was
    journalled, into L{CURRENT}.
    """
    journalClass = journalModule.Journal
    rewrite = journalClass.dropAcknowledged
    acknowledge = journalClass.acknowledge
    startCopy = journalClass.startCopy
    finishCopy = journalClass.finishCopy
    # By copy: when it began, its reactor time so far, and the
    # acknowledgements it drops (those journalled before its snapshot).
    copies: dict[int, tuple[float, float, list[float]]] = {}
    retiring: dict[int, tuple[Measured, list[float]]] = {}
    retire = compactions.JournalCopy.retire

    def timedRewrite(self: Any, waiting: Sequence[Any] = ()) -> bool:
        measured = CURRENT
        began = time.perf_counter()
        if not rewrite(self, waiting):
            return False
        ended = time.perf_counter()
        measured.rewrites.append(ended - began)
        measured.threaded.append(ended - began)
        measured.residency.extend(ended - each for each in measured.acknowledged)
        measured.acknowledged.clear()
        return True

    def timedStartCopy(self: Any) -> Any:
        began = time.perf_counter()
        copy = startCopy(self)
        dropping = list(CURRENT.acknowledged)
        CURRENT.acknowledged.clear()
        copies[id(copy)] = (began, time.perf_counter() - began, dropping)
        CURRENT.starts.append(copies[id(copy)][1])
        return copy

    def timedFinishCopy(self: Any, copy: Any) -> bool:
        measured = CURRENT
        began = time.perf_counter()
        first, held, dropping = copies.pop(id(copy))
        try:
            switched = finishCopy(self, copy)
        except BaseException:
            measured.acknowledged[:0] = dropping
            raise
        ended = time.perf_counter()
        if not switched:
            measured.acknowledged[:0] = dropping
            return False
        measured.rewrites.append(held + ended - began)
        measured.finishes.append(ended - began)
        measured.threaded.append(ended - first)
        # Gone from the file at the rename, from the disk once the old
        # file's descriptors are closed, in the thread: measured then.
        retiring[id(copy)] = (measured, dropping)
        return True

    def timedRetire(self: Any) -> None:
        retire(self)
        ended = time.perf_counter()
        measured, dropping = retiring.pop(id(self), (CURRENT, []))
        measured.residency.extend(ended - each for each in dropping)

    def notedAcknowledge(self: Any, count: int, lastKey: str) -> None:
        acknowledge(self, count, lastKey)
        CURRENT.acknowledged.append(time.perf_counter())

    journalClass.dropAcknowledged = timedRewrite  # type: ignore[method-assign]
    journalClass.startCopy = timedStartCopy  # type: ignore[method-assign]
    journalClass.finishCopy = timedFinishCopy  # type: ignore[method-assign]
    journalClass.acknowledge = notedAcknowledge  # type: ignore[method-assign]
    compactions.JournalCopy.retire = timedRetire  # type: ignore[method-assign]


def percentile(values: Sequence[float], share: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def observationOf(number: int, size: int) -> memory_pb2.Observation:
    half = "x" * (size // 2)
    return memory_pb2.Observation(
        scope=memory_pb2.Scope(org_id="org", agent_id="agent", subject="alice"),
        request_id=f"r-{number}",
        key=f"k-{number}",
        messages=[
            memory_pb2.ObservedMessage(role="user", content=f"{number} {half}"),
            memory_pb2.ObservedMessage(role="assistant", content=half),
        ],
    )


def removeJournal(directory: str, path: str) -> int:
    """
    Remove the run's journal and its directory: the journal's size at the
    end, first.
    """
    left = os.path.getsize(path)
    for each in os.listdir(directory):
        os.unlink(os.path.join(directory, each))
    os.rmdir(directory)
    return left


async def run(
    reactor: Any, name: str, options: argparse.Namespace, forget: bool, thread: bool = False
) -> None:
    global CURRENT
    measured = CURRENT = Measured()
    away = name.startswith("drain")

    def queue(observations: Sequence[memory_pb2.Observation]) -> Deferred[Any]:
        answer: Deferred[Any] = Deferred()
        response = memory_pb2.QueueObservationsResponse(
            queued=[memory_pb2.QueuedObservation(id=each.key) for each in observations]
        )
        if away:
            answer.addTimeout(0.2, reactor)
        else:
            reactor.callLater(options.latency, answer.callback, response)
        return answer

    directory = tempfile.mkdtemp(prefix="memory-journal-", dir=ROOT / ".data")
    path = os.path.join(directory, "memory.journal")
    threads = ThreadPool(minthreads=1, maxthreads=1, name="memory-journal")
    inThread = None
    if thread:
        threads.start()
        inThread = functools.partial(deferToThreadPool, reactor, threads)
    outbox: Outbox = observe.observationOutbox(
        queue,
        reactor,
        observe.ObservationOutboxMetrics(CollectorRegistry()),
        journalPath=path,
        maxObservations=options.backlog + 1,
        maxBytes=2**40,
        inThread=inThread,
    )
    if not forget:
        outbox._compactions = None
    outbox.start()
    previous = time.perf_counter()

    def tick() -> None:
        nonlocal previous
        now = time.perf_counter()
        measured.lateness.append(now - previous - 0.01)
        previous = now

    ticking = task.LoopingCall(tick)
    ticking.clock = reactor
    ticking.start(0.01)
    cpu = time.process_time()
    began = time.perf_counter()
    if away:
        for number in range(options.backlog):
            outbox.record(observationOf(number, options.size))
        await task.deferLater(reactor, 0.3)
        away = False
        measured.rewrites.clear()
        measured.threaded.clear()
        measured.starts.clear()
        measured.finishes.clear()
        # Recording the backlog held the reactor: not the drain's.
        measured.lateness.clear()
        previous = time.perf_counter()
        began = time.perf_counter()
        cpu = time.process_time()
        while outbox.waiting:
            await task.deferLater(reactor, 0.01)
    else:
        recorded = 0
        while time.perf_counter() - began < options.seconds:
            due = int((time.perf_counter() - began) * options.rate)
            while recorded < due:
                outbox.record(observationOf(recorded, options.size))
                recorded += 1
            await task.deferLater(reactor, 0.005)
        await task.deferLater(reactor, 1.5)
    elapsed = time.perf_counter() - began
    cpu = time.process_time() - cpu
    ticking.stop()
    await outbox.settle(10.0)
    outbox.close()
    if thread:
        threads.stop()
    rewrites = measured.rewrites
    stayed = f"{max(measured.residency, default=0):5.3f} s"
    if measured.acknowledged:
        stayed = f"for ever ({len(measured.acknowledged)} acknowledgements' rows left)"
    left = removeJournal(directory, path)
    print(
        f"{name:10}  {elapsed:5.1f} s  rewrites {len(rewrites) / elapsed:5.2f}/s"
        f"  each median {1000 * statistics.median(rewrites) if rewrites else 0:6.2f} ms"
        f"  max {1000 * max(rewrites, default=0):7.2f} ms"
        f"  whole max {1000 * max(measured.threaded, default=0):7.2f} ms"
        f" (reactor: snapshot max {1000 * max(measured.starts, default=0):6.2f} ms,"
        f" tail and rename max {1000 * max(measured.finishes, default=0):6.2f} ms)"
        f"  reactor share {100 * sum(rewrites) / elapsed:5.2f} %"
        f"  cpu {100 * cpu / elapsed:5.1f} %"
        f"  acknowledged bytes stayed max {stayed}"
        f"  reactor late max {1000 * max(measured.lateness, default=0):6.1f} ms"
        f" p99 {1000 * percentile(measured.lateness, 0.99):6.1f} ms"
        f"  journal at end {left} B"
    )


def main(reactor: Any, options: argparse.Namespace) -> Deferred[None]:
    async def runs() -> None:
        print(
            f"{options.rate}/s observations of {options.size} B, svc-memory answering"
            f" in {options.latency} s; backlog {options.backlog}"
        )
        await run(reactor, "steady", options, forget=True)
        await run(reactor, "steady+th", options, forget=True, thread=True)
        await run(reactor, "threshold", options, forget=False)
        await run(reactor, "drain", options, forget=True)
        await run(reactor, "drain+th", options, forget=True, thread=True)
        await run(reactor, "drain-thr", options, forget=False)

    return ensureDeferred(runs())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--latency", type=float, default=0.01)
    parser.add_argument("--backlog", type=int, default=10_000)
    (ROOT / ".data").mkdir(exist_ok=True)
    install()
    task.react(main, [parser.parse_args()])
