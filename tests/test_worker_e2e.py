"""
svc-worker's behaviour driven from outside (decisions D13, issue 33):
C{twistd -n svc-worker} beside real svc-auth and svc-memory daemons, Redis
and the scripted model server. Observations queued as the proxy queues
them become memories, each fact once however the worker is stopped,
killed, paused past its lease or doubled; a budget's refusal makes an
observation wait uncharged; failures back off and end failed.

Moved out of tests/test_worker_daemon.py (which keeps twistd's part: the
plugin ready, SIGTERM with work in hand, a configuration refused,
daemonised) so that dev/floor can leave these out as it leaves out the
gateway driven from outside (tests/floorselection.py): the Twisted they
run is the worker's loop and lease, which test_worker_lease and
test_worker_units run in-process on the floor's Twisted, and twistd's,
which test_worker_daemon runs there.
"""

from __future__ import annotations

import datetime
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from authhelpers import document, svcctl
from workerfixtures import (
    WorkerRig,
    WorkerStack,
    expectedFacts,
    factsOf,
    newRequestIDs,
    runningWorkerStack,
    waitForMetric,
    waitUntil,
)

from svcd.devkit.daemons import Daemon
from svcd.devkit.postgres import PostgresServer

# Starts real daemons (conftest.py, pytest.ini): left out of a quick run.
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerStack]:
    """
    One svc-auth, svc-memory, Redis and scripted upstream for the module's
    tests, as in test_worker_daemon.py: each test's rig has its own
    organization, models and workers (L{WorkerStack.rig}).
    """
    with runningWorkerStack(postgresServer, tmp_path_factory.mktemp("workerstack")) as running:
        yield running


def test_withoutAnExtractionModelTheUsersTextIsTheMemory(
    stack: WorkerStack, tmp_path: Path
) -> None:
    """
    Without an extraction_model the user's text is the one memory, and
    the only provider call is the embedding (one row).
    """
    with stack.rig(tmp_path, extraction=False) as rig:
        rig.startWorker()
        [requestID] = newRequestIDs(1)
        rig.queue({requestID: "I prefer tea to coffee."})
        rig.waitForDrained()
        assert rig.contents() == ["I prefer tea to coffee."]
        waitUntil(lambda: len(rig.ledger()) == 1, "one ledger row")
        assert [(row["kind"], row["parent_request_id"]) for row in rig.ledger()] == [
            ("embedding", requestID)
        ]


def test_processingAgainNeverAddsAMemoryTwice(stack: WorkerStack, tmp_path: Path) -> None:
    """
    An observation processed, then queued and processed again (as when a
    copy arrives after svc-memory's record of it expired): its facts are each
    still one memory, the same ids, updated in place (the search finds
    each at similarity 1, at or above dedupe_score).
    """
    with stack.rig(tmp_path) as rig:
        worker = rig.startWorker()
        [requestID] = newRequestIDs(1)
        rig.queue({requestID: factsOf(requestID, 3)})
        rig.waitForDrained()
        first = {each["content"]: each["id"] for each in rig.memories()}
        assert sorted(first) == expectedFacts([requestID], 3)
        # Queued again after svc-memory forgot it was processed (as past
        # SVC_MEMORY_DONE_RETENTION; within it the copy would not be queued).
        forgotten = rig.query(
            "DELETE FROM memory_observations_done WHERE request_id = %s RETURNING request_id",
            (requestID,),
        )
        assert forgotten == [{"request_id": requestID}]
        rig.queue({requestID: factsOf(requestID, 3)})
        rig.waitForDrained()
        again = {each["content"]: each["id"] for each in rig.memories()}
        assert again == first
        waitForMetric(rig, worker, 'svc_worker_memories_total{action="updated"}', 3)


def test_killedMidBatchAndRestartedStoresEachFactOnce(stack: WorkerStack, tmp_path: Path) -> None:
    """
    A worker C{kill -9}ed while it holds a batch (the model slow, so that
    some observations are done and others in hand), then started again:
    once its leases have run out, every observation is processed and every
    fact is stored exactly once.
    """
    with stack.rig(tmp_path, extractor="slow:300") as rig:
        worker = rig.startWorker(SVC_WORKER_LEASE="5s", SVC_WORKER_CONCURRENCY="4")
        requestIDs = newRequestIDs(12)
        rig.queue({each: factsOf(each) for each in requestIDs})
        waitUntil(lambda: 2 <= len(rig.memories()), "some memories stored")
        assert rig.observations(), "every observation was done before the kill"
        worker.signal(signal.SIGKILL)
        assert worker.process is not None and worker.process.wait(10) == -signal.SIGKILL
        rig.startWorker("restarted", SVC_WORKER_LEASE="5s", SVC_WORKER_CONCURRENCY="4")
        rig.waitForDrained(seconds=90)
        contents = [each["content"] for each in rig.memories()]
        assert sorted(contents) == expectedFacts(requestIDs)


def test_twoWorkersNeverProcessAnObservationTwice(stack: WorkerStack, tmp_path: Path) -> None:
    """
    Two workers drain one queue together: each observation's extraction
    is asked for once (one extraction row per observation, no more), both
    workers did some, and every fact is stored once.
    """
    with stack.rig(tmp_path, extractor="slow:50") as rig:
        first = rig.startWorker("first", SVC_WORKER_CONCURRENCY="4")
        second = rig.startWorker("second", SVC_WORKER_CONCURRENCY="4")
        requestIDs = newRequestIDs(40)
        rig.queue({each: factsOf(each) for each in requestIDs})
        rig.waitForDrained(seconds=120)
        assert sorted(each["content"] for each in rig.memories()) == expectedFacts(requestIDs)
        waitUntil(lambda: len(rig.ledger()) == 80, "eighty ledger rows")
        extractions = [
            row["parent_request_id"] for row in rig.ledger() if row["kind"] == "extraction"
        ]
        assert sorted(extractions) == sorted(requestIDs)
        done = [
            rig.metric(each, 'svc_worker_observations_total{outcome="done"}')
            for each in (first, second)
        ]
        assert sum(done) == 40 and all(done), done


def setDailyBudget(rig: WorkerRig, usd: str) -> None:
    """
    The rig's organization's budget for a day, C{usd} dollars, set with
    svcctl as an operator does.
    """
    document(
        svcctl(
            rig.dsn,
            "budget",
            "set",
            "--org",
            str(rig.tenant.orgID),
            "--usd",
            usd,
            "--period",
            "day",
        )
    )


def test_aBudgetsRefusalWaitsUnchargedAndUncounted(stack: WorkerStack, tmp_path: Path) -> None:
    """
    An organization whose day's budget cannot hold the extraction's worst
    case: the observation is refused, released with no attempt counted and
    its reason, due again after the refusal's Retry-After (at most 5
    minutes), with no ledger row and no memory. Once the budget is raised
    and the job retried (svcctl memory jobs retry), it is processed.
    """

    def tinyBudget(rig: WorkerRig) -> None:
        setDailyBudget(rig, "0.000001")

    with stack.rig(tmp_path, prepare=tinyBudget) as rig:
        worker = rig.startWorker()
        [requestID] = newRequestIDs(1)
        rig.queue({requestID: factsOf(requestID)})
        waitUntil(
            lambda: rig.metric(worker, 'svc_worker_observations_total{outcome="deferred"}') >= 1,
            "a deferral",
        )
        [row] = rig.observations()
        assert (row["state"], row["attempts"], row["lease_owner"]) == ("waiting", 0, None)
        assert row["reason"].startswith("BUDGET_EXCEEDED")
        wait = (row["next_attempt_at"] - row["now"]).total_seconds()
        midnight = (row["now"] + datetime.timedelta(days=1)).replace(
            hour=0, minute=0, second=0, microsecond=0
        )
        assert 0 < wait <= min(300, (midnight - row["now"]).total_seconds() + 1)
        assert rig.ledger() == [] and rig.memories() == []
        setDailyBudget(rig, "100")
        # The feed carries the new budget to the worker within a second: the
        # job is made due again until a claim finds the budget raised.
        retryUntilProcessed(rig, worker)
        assert rig.contents() == expectedFacts([requestID])
        assert rig.metric(worker, 'svc_worker_observations_total{outcome="retry"}') == 0
        assert {row["kind"] for row in rig.ledger()} <= {"extraction", "embedding"}


def retryUntilProcessed(rig: WorkerRig, worker: Daemon) -> None:
    """
    svcctl memory jobs retry the one waiting job, again after each new
    deferral, until it is processed (bounded).
    """
    deferrals = [rig.metric(worker, 'svc_worker_observations_total{outcome="deferred"}')]

    def retry() -> None:
        for row in rig.observations():
            svcctl(
                rig.dsn,
                "memory",
                "jobs",
                "retry",
                "--org",
                str(rig.tenant.orgID),
                "--id",
                str(row["id"]),
            )

    def processed() -> bool:
        if not rig.observations():
            return True
        now = rig.metric(worker, 'svc_worker_observations_total{outcome="deferred"}')
        if now > deferrals[0]:
            deferrals[0] = now
            retry()
        return False

    retry()
    waitUntil(processed, "the job processed once the budget was raised", 30)


def test_failuresBackOffThenEndFailed(stack: WorkerStack, tmp_path: Path) -> None:
    """
    An extraction model whose answer is not {"memories": [...]}: each
    attempt fails and is counted, the next due 1 s, then 2 s ... later,
    and at SVC_WORKER_MAX_ATTEMPTS the observation is kept as failed with
    its reason (never content); each attempt's call is in the ledger.
    """
    with stack.rig(tmp_path, extractor="bytes:10") as rig:
        worker = rig.startWorker(SVC_WORKER_MAX_ATTEMPTS="3")
        [requestID] = newRequestIDs(1)
        rig.queue({requestID: factsOf(requestID)})
        waitUntil(lambda: _state(rig) == "failed", "the observation failed", 30)
        [row] = rig.observations()
        assert row["attempts"] == 3
        assert row["reason"] == "extraction: the answer's text is not JSON"
        waitForMetric(rig, worker, 'svc_worker_observations_total{outcome="retry"}', 2)
        waitForMetric(rig, worker, 'svc_worker_observations_total{outcome="failed"}', 1)
        waitUntil(lambda: len(rig.ledger()) == 3, "three ledger rows")
        extractions = [row for row in rig.ledger() if row["kind"] == "extraction"]
        assert len(extractions) == 3 and rig.memories() == []
        starts = sorted(row["started_at"] for row in extractions)
        # Backoff: 1 s after the first failure, 2 s after the second.
        assert (starts[1] - starts[0]).total_seconds() >= 1.0
        assert (starts[2] - starts[1]).total_seconds() >= 2.0


@pytest.mark.parametrize("embedder", ["vectors:huge", "vectors:short"])
def test_aVectorMemoryCannotUseIsAFailedAttempt(
    stack: WorkerStack, tmp_path: Path, embedder: str
) -> None:
    """
    Vectors memory cannot use (a JSON number beyond float32, which raised
    OverflowError out of the embedder: "internal error of svc-worker" with
    a traceback; one value fewer than the model's dimensions, which was
    stored) are the provider's fault (decisions D13 amended): a failed
    attempt like any other, nothing stored, the embedding's row kept with
    what the provider counted, nothing logged as unexpected.
    """
    with stack.rig(tmp_path, extraction=False, embedder=embedder) as rig:
        worker = rig.startWorker(SVC_WORKER_MAX_ATTEMPTS="1")
        [requestID] = newRequestIDs(1)
        rig.queue({requestID: "I prefer tea to coffee."})
        waitUntil(lambda: _state(rig) == "failed", "the observation failed", 30)
        [row] = rig.observations()
        assert row["attempts"] == 1
        assert row["reason"].startswith("embedding: UPSTREAM_ERROR: "), row["reason"]
        waitUntil(lambda: len(rig.ledger()) == 1, "the embedding's row")
        [charged] = rig.ledger()
        assert (charged["kind"], charged["outcome"], charged["prompt_tokens"]) == (
            "embedding",
            "upstream_error",
            5,
        )
        assert rig.memories() == []
        waitForMetric(rig, worker, 'svc_worker_observations_total{outcome="failed"}', 1)
        assert "Fault processing observation" not in worker.output()


def _state(rig: WorkerRig) -> str | None:
    rows = rig.observations()
    return rows[0]["state"] if rows else None


def test_anExtractionSlowerThanTheLeaseSucceedsOnce(stack: WorkerStack, tmp_path: Path) -> None:
    """
    A model slower than SVC_WORKER_LEASE (12 s against 5 s): the worker
    renews the observation's lease while it waits, so a second worker
    running beside it never claims the observation; the extraction is
    asked for once (one extraction row, ok) and its facts are stored once.
    """
    with stack.rig(tmp_path, extractor="slow:12000") as rig:
        first = rig.startWorker("first", SVC_WORKER_LEASE="5s")
        second = rig.startWorker("second", SVC_WORKER_LEASE="5s")
        [requestID] = newRequestIDs(1)
        rig.queue({requestID: factsOf(requestID)})
        rig.waitForDrained(seconds=60)
        assert rig.contents() == expectedFacts([requestID])
        waitUntil(lambda: len(rig.ledger()) == 2, "the extraction's and embedding's rows")
        assert sorted((row["kind"], row["outcome"]) for row in rig.ledger()) == [
            ("embedding", "ok"),
            ("extraction", "ok"),
        ]
        done = [
            rig.metric(each, 'svc_worker_observations_total{outcome="done"}')
            for each in (first, second)
        ]
        assert sorted(done) == [0, 1], done
        renewals = sum(
            rig.metric(each, "svc_worker_lease_renewals_total") for each in (first, second)
        )
        assert renewals >= 3, renewals
        for each in (first, second):
            assert rig.metric(each, 'svc_worker_observations_total{outcome="lost"}') == 0


def test_aLostLeaseIsAbandonedWithoutStoringAnything(stack: WorkerStack, tmp_path: Path) -> None:
    """
    A worker paused (SIGSTOP) while its model answers, past its lease: a
    second worker claims the observation and stores its facts. Resumed,
    the first finds its lease renewed by no one but taken by the other
    claim: it abandons the observation (outcome lost) without embedding
    or storing anything, and every fact is stored once.
    """
    with stack.rig(tmp_path, extractor="slow:3000") as rig:
        paused = rig.startWorker("paused", SVC_WORKER_LEASE="5s")
        [requestID] = newRequestIDs(1)
        rig.queue({requestID: factsOf(requestID)})
        waitUntil(
            lambda: rig.metric(paused, "svc_worker_observations_in_flight") > 0,
            "the observation in hand",
        )
        paused.signal(signal.SIGSTOP)
        try:
            other = rig.startWorker("other", SVC_WORKER_LEASE="5s")
            rig.waitForDrained(seconds=60)
            stored = {each["content"]: each["id"] for each in rig.memories()}
            assert sorted(stored) == expectedFacts([requestID])
        finally:
            paused.signal(signal.SIGCONT)
        waitUntil(
            lambda: rig.metric(paused, 'svc_worker_observations_total{outcome="lost"}') == 1,
            "the paused worker abandoned its observation",
        )
        assert {each["content"]: each["id"] for each in rig.memories()} == stored
        for action in ("added", "updated"):
            assert rig.metric(paused, f'svc_worker_memories_total{{action="{action}"}}') == 0
        assert rig.metric(paused, 'svc_worker_observations_total{outcome="done"}') == 0
        waitForMetric(rig, other, 'svc_worker_observations_total{outcome="done"}', 1)
        waitUntil(lambda: len(rig.ledger()) == 3, "two extraction rows and one embedding row")
        kinds = sorted(row["kind"] for row in rig.ledger())
        assert kinds == ["embedding", "extraction", "extraction"], kinds
