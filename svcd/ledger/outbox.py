"""
The proxy's side of the usage ledger (decisions D12): the rows of forwarded
requests wait here, in order, until svc-auth has committed them.

L{Outbox} is the L{svcd.ledger.rows.UsageLedger} the edge
writes to. A row is journalled first (when C{SVC_USAGE_JOURNAL} names a
file), then queued in memory; one RecordUsage call at a time carries the
oldest rows (at most L{BATCH_ROWS}) to svc-auth, which answers only after
it has committed them; only then do they leave the queue. A failed call
(svc-auth or PostgreSQL down, a deadline missed, anything) is tried again,
the same rows, after a capped exponential backoff with jitter. svc-auth
keys rows by ledger id (decisions D12, amended), so a row sent twice (an
answer lost on the way, an acknowledgement the journal had not recorded
before a kill) is recorded once.

No row stalls the others (D12, amended): rows svc-auth answers as
C{rejected} leave the queue with the batch and are set aside in the
rejects file beside the journal (C{<journal>.rejects}), counted and
logged. An svc-auth that fails a whole batch with INVALID_ARGUMENT (an
older one, or a batch it cannot take as a whole) is sent the batch in
halves until the row it refuses is alone; that row is set aside as
C{invalid} and the rest go on.

The same outbox and journal carry svc-proxy's observations to svc-memory
(decisions D13, L{svcd.proxy.observe.observationOutbox}): another record
type, key, call, journal magic and wording (L{OutboxWords}), the same
promises. What follows says "rows" and "svc-auth" for both.

The journal (L{svcd.ledger.journal.Journal}) is the file that lets
rows outlive the process; its module says what survives what.
"""

from __future__ import annotations

import contextvars
import json
import random
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any, Protocol

import grpc
from google.protobuf import json_format
from prometheus_client import Counter, Gauge
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.ledger.compactions import Compactions, InThread
from svcd.ledger.journal import Journal, usageRowKey
from svcd.ledger.journalfile import JournalError
from svcd.ledger.words import USAGE_WORDS, OutboxWords
from svcd.pb.auth.v1 import auth_pb2

__all__ = ["BATCH_ROWS", "Outbox", "OutboxMetrics", "UsageSender"]

# Rows per RecordUsage call: svc-auth commits a batch in one transaction;
# 500 rows are about 100 KB on the wire, far below gRPC's 4 MB limit.
BATCH_ROWS = 500
# How long a row waits for others before a batch smaller than BATCH_ROWS
# is sent: each RecordUsage call costs the proxy and svc-auth a few hundred
# microseconds and svc-auth a commit, so a batch per row would cost
# forwarding a third of its throughput; 50 ms makes a batch of 100 rows at
# 2,000 requests/s, and a row is in the ledger well within a second.
LINGER_SECONDS = 0.05
# The backoff between attempts of a failed batch: the first wait, doubled
# after each failure up to the last; each wait is drawn between half and
# all of that (jitter), so that proxies that lost svc-auth together do not
# come back in step.
FIRST_RETRY_SECONDS = 0.1
LAST_RETRY_SECONDS = 5.0
# SVC_USAGE_OUTBOX_MAX's default.
OUTBOX_MAX_ROWS = 100_000
# The reasons of RejectedUsageRow that are label values of
# svc_proxy_usage_rows_rejected_total; any other is counted as "other" (a
# newer svc-auth), so that svc-auth cannot inflate the number of series.
REJECT_REASONS = frozenset({"invalid", "conflict"})
# What a reject's detail may take in the log and the rejects file.
DETAIL_CHARS = 500


class UsageSender(Protocol):
    """
    Where batches of rows go: svc-auth's RecordUsage
    (L{svcd.ledger.sender.LedgerSender.recordUsage}). The
    Deferred fires once svc-auth has committed every row of the batch that
    it does not list as rejected.
    """

    def recordUsage(
        self, rows: Sequence[auth_pb2.UsageRow]
    ) -> Deferred[auth_pb2.RecordUsageResponse]: ...


class OutboxMetrics(Protocol):
    """
    What the outbox counts, on the metrics of the daemon that holds it
    (svc-proxy's L{svcd.proxy.metrics.ProxyMetrics} exports them as
    C{svc_proxy_usage_outbox_rows}, C{svc_proxy_usage_rows_sent} and
    C{svc_proxy_usage_rows_rejected}): a Protocol, so that this package
    imports no daemon's metrics.
    """

    usageOutboxRows: Gauge
    usageRowsSent: Counter

    def usageRowRejected(self, reason: str) -> None:
        """
        Count one row svc-auth refused for good, by C{reason}.
        """


def _statusOf(failure: Failure) -> tuple[str, str]:
    error = failure.value
    if isinstance(error, grpc.Call):
        return str(error.code().name).lower(), str(error.details())
    return "error", type(error).__name__


def _unimplemented(failure: Failure) -> bool:
    error = failure.value
    return isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNIMPLEMENTED


def _usageRowJSON(row: auth_pb2.UsageRow) -> str:
    return json.dumps(
        json_format.MessageToDict(row, preserving_proto_field_name=True),
        sort_keys=True,
        separators=(",", ":"),
    )


def _invalidArgument(failure: Failure) -> bool:
    error = failure.value
    return isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.INVALID_ARGUMENT


class Outbox:
    """
    L{svcd.ledger.rows.UsageLedger} that sends rows to svc-auth (see
    the module docstring); given C{send}, C{keyOf}, C{describe} and
    C{words}, the outbox of another record (svc-proxy's observations,
    L{svcd.proxy.observe.observationOutbox}).

    @param sender: RecordUsage.
    @param clock: the time of the backoff and of L{flush}'s bound.
    @param maxRows: rows held before L{hasRoom} says no
        (C{SVC_USAGE_OUTBOX_MAX}).
    @param journal: the journal (C{SVC_USAGE_JOURNAL}), or None.
    @param random: a number in [0, 1) for the jitter.
    @param linger: how long a row waits for others to share its batch
        (L{LINGER_SECONDS}); 0 sends at once.
    @param maxBytes: with C{sizeOf}, the bytes of the rows held before
        L{hasRoom} says no, beside C{maxRows} (svc-proxy's observations,
        whose size varies a thousandfold); None: rows are counted only.
    @param sizeOf: a row's size in bytes (its serialized size).
    @param onRecorded: called after each acknowledgement with the ledger
        ids of the rows svc-auth committed (recorded or duplicate, not
        rejected; rows without a ledger id left out): the rate limiter's
        C{recorded}, which learns that their spend is in the ledger.
    @param compactEvery: None (the usage ledger): the journal is rewritten
        right after an acknowledgement once its acknowledged part has
        passed its threshold (L{Journal.compactIfLarge}). A number of
        seconds (the memory journal, whose rows hold what users said):
        the journal forgets, rewritten after every acknowledgement within
        a second and at most once every C{compactEvery} seconds
        (L{Compactions}).
    @param compactInThread: with C{compactEvery}, runs a function in the
        journal's one-thread pool, where the rewrites' copies and fsyncs
        are done (L{svcd.ledger.compactions}); None: on the reactor.
    """

    log = Logger()

    def __init__(
        self,
        sender: UsageSender | None,
        clock: Clock,
        metrics: OutboxMetrics,
        maxRows: int = OUTBOX_MAX_ROWS,
        journal: Journal | None = None,
        batchRows: int = BATCH_ROWS,
        firstRetry: float = FIRST_RETRY_SECONDS,
        lastRetry: float = LAST_RETRY_SECONDS,
        random: Callable[[], float] = random.random,
        linger: float = LINGER_SECONDS,
        onRecorded: Callable[[Sequence[str]], None] | None = None,
        send: Callable[[Sequence[Any]], Deferred[Any]] | None = None,
        keyOf: Callable[[Any], str] = usageRowKey,
        describe: Callable[[Any], str] | None = None,
        words: OutboxWords = USAGE_WORDS,
        maxBytes: int | None = None,
        sizeOf: Callable[[Any], int] | None = None,
        compactEvery: float | None = None,
        compactInThread: InThread | None = None,
    ) -> None:
        # send, keyOf, describe and words carry another kind of record
        # (svc-proxy's observations, decisions D13): the call that commits a
        # batch, the record's idempotence key, what the log may say of a
        # record set aside (an observation's content must never be logged)
        # and what the log calls them.
        self.words = words
        if send is None:
            if sender is None:
                raise TypeError("Outbox needs a sender or send")
            send = sender.recordUsage
        self._send = send
        self._keyOf = keyOf
        self._describe = describe if describe is not None else _usageRowJSON
        self._onRecorded = onRecorded
        self._linger = linger
        self._lingering: IDelayedCall | None = None
        # While a stop waits for the rows: no batch waits for others.
        self._flushing = False
        self._clock = clock
        self._metrics = metrics
        self._maxRows = maxRows
        if (maxBytes is None) != (sizeOf is None):
            raise TypeError("maxBytes and sizeOf go together")
        self._maxBytes = maxBytes
        self._sizeOf = sizeOf
        # The bytes of the rows in self._queue, by sizeOf (0 without it).
        self._bytes = 0
        self._journal = journal
        self._batchRows = batchRows
        self._firstRetry = firstRetry
        self._lastRetry = lastRetry
        self._random = random
        # Every row not yet acknowledged, oldest first; the batch in flight
        # (or waiting to be tried again) is its first self._batch rows.
        self._queue: deque[Any] = deque()
        self._batch = 0
        # After svc-auth failed a batch with INVALID_ARGUMENT: how many rows
        # at the head of the queue hold the row it refuses. Batches are then
        # the first half of those, until the row is alone (and set aside)
        # or they all went through.
        self._suspect = 0
        self._call: Deferred[Any] | None = None
        self._retry: IDelayedCall | None = None
        self._failures = 0
        self._sending = False
        self._again = False
        self._closed = False
        self._emptied: list[Deferred[None]] = []
        self._failing = ThrottledWarning(self.log, clock)
        self._journalFailing = ThrottledWarning(self.log, clock)
        self._rejecting = ThrottledWarning(self.log, clock)
        self._halving = ThrottledWarning(self.log, clock)
        self._compactions: Compactions | None = None
        if journal is not None and compactEvery is not None:
            self._compactions = Compactions(
                journal,
                clock,
                compactEvery,
                lambda: self._queue,
                self._journalUnwritable,
                inThread=compactInThread,
            )
        metrics.usageOutboxRows.set_function(lambda: len(self._queue))

    @property
    def waiting(self) -> int:
        """
        Rows not yet acknowledged by svc-auth.
        """
        return len(self._queue)

    @property
    def waitingBytes(self) -> int:
        """
        The bytes of the rows not yet acknowledged, by C{sizeOf} (0
        without one).
        """
        return self._bytes

    def start(self) -> None:
        """
        Take the rows the journal holds unacknowledged (before any new
        row: the proxy calls this before it listens), and send them.

        @raise JournalError: when the journal cannot be used.
        """
        if self._journal is not None:
            replayed = self._journal.open()
            self._queue.extendleft(reversed(replayed))
            self._countBytes(replayed, 1)
        self._sendSoon()

    def hasRoom(self) -> bool:
        if len(self._queue) >= self._maxRows:
            return False
        return self._maxBytes is None or self._bytes < self._maxBytes

    def _countBytes(self, rows: Sequence[Any], sign: int) -> None:
        """
        Add (C{sign} 1) or take away (-1) the bytes of C{rows}: nothing to
        do for usage rows, which are counted only (no C{sizeOf}).
        """
        sizeOf = self._sizeOf
        if sizeOf is not None:
            self._bytes += sign * sum(sizeOf(row) for row in rows)

    def record(self, row: Any) -> None:
        journal = self._journal
        if journal is not None:
            try:
                journal.append(row)
            except OSError as error:
                # Kept in memory all the same: lost only if the proxy is
                # killed before svc-auth has it, as without a journal.
                self._journalUnwritable(error)
        self._queue.append(row)
        if self._sizeOf is not None:
            self._bytes += self._sizeOf(row)
        self._sendAfterLinger()

    def _sendAfterLinger(self) -> None:
        """
        Send a full batch at once, a smaller one once it has waited
        C{linger} for more rows (one timer for the batch, not one per row).
        """
        if (
            len(self._queue) >= self._batchRows
            or self._linger <= 0
            or self._flushing
            or self._suspect
        ):
            # A batch being halved is sent at once: its rows waited already.
            self._sendSoon()
        elif self._lingering is None and self._call is None and self._retry is None:
            self._lingering = self._clock.callLater(self._linger, self._lingerOver)

    def _lingerOver(self) -> None:
        self._lingering = None
        self._sendSoon()

    def _stopLingering(self) -> None:
        if self._lingering is not None and self._lingering.active():
            self._lingering.cancel()
        self._lingering = None

    def _sendSoon(self) -> None:
        """
        Send the next batch unless one is in flight or waiting for its
        retry. Rows recorded meanwhile ride with the next batch: under load
        batches grow by themselves, with no timer.
        """
        if self._sending:
            # Called back from within the loop below (an answer that came
            # at once): let the loop go round again.
            self._again = True
            return
        self._sending = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._sendBatch()
        finally:
            self._sending = False

    def _sendBatch(self) -> None:
        if self._closed or self._call is not None or self._retry is not None or not self._queue:
            return
        self._stopLingering()
        if not self._batch:
            limit = (self._suspect + 1) // 2 if self._suspect else self._batchRows
            self._batch = min(limit, len(self._queue))
        batch = list(islice(self._queue, self._batch))
        # In a context of its own: the batch belongs to no request, so its
        # call and log lines carry no request's ids or trace.
        call = contextvars.Context().run(self._callSender, batch)
        self._call = call
        call.addCallbacks(self._acknowledged, self._failed)

    def _callSender(self, batch: list[Any]) -> Deferred[Any]:
        try:
            return self._send(batch)
        except Exception as error:
            failed: Deferred[Any] = Deferred()
            failed.errback(error)
            return failed

    def _acknowledged(self, response: Any) -> None:
        self._call = None
        count = self._batch
        if self._suspect:
            # These went through: the refused row is among the rest.
            self._suspect = max(0, self._suspect - count)
        if self._failures:
            self.log.info(
                "{peer} took {records} again after {attempts} failed attempt(s);"
                " {rows} {records} waiting",
                **self.words.fields(),
                attempts=self._failures,
                rows=len(self._queue) - count,
            )
            self._failures = 0
        rejected = list(getattr(response, "rejected", ()))
        recorded = getattr(response, "recorded", count - len(rejected))
        duplicates = getattr(response, "duplicates", 0)
        if recorded + duplicates + len(rejected) != count:
            # svc-auth answers only after committing the batch: the rows
            # are in. A count that disagrees says its accounting is off.
            self.log.warn(
                "{call} acknowledged a batch of {rows} {records} as {recorded} recorded,"
                " {duplicates} duplicate(s) and {rejected} rejected",
                **self.words.fields(),
                rows=count,
                recorded=recorded,
                duplicates=duplicates,
                rejected=len(rejected),
            )
        self._settle(rejected)

    def _settle(self, rejected: Sequence[Any]) -> None:
        """
        The batch in flight is done with: svc-auth committed its rows but
        the C{rejected} ones (L{auth_pb2.RejectedUsageRow}s, by index in
        the batch), which are set aside. Every row of the batch leaves the
        queue and the journal; none is sent again.
        """
        count, self._batch = self._batch, 0
        batch = [self._queue.popleft() for _ in range(count)]
        self._countBytes(batch, -1)
        refused: dict[int, tuple[str, str]] = {}
        for each in rejected:
            index = int(each.index)
            if 0 <= index < count and index not in refused:
                refused[index] = (str(each.reason), str(each.detail)[:DETAIL_CHARS])
            else:
                self.log.warn(
                    "{call} rejected a {record} at index {index} of a batch of {rows}"
                    " {records}; ignored",
                    **self.words.fields(),
                    index=index,
                    rows=count,
                )
        for index, (reason, detail) in sorted(refused.items()):
            self._setAside(batch[index], reason, detail)
        self._metrics.usageRowsSent.inc(count - len(refused))
        journal = self._journal
        if journal is not None and not self._closed:
            try:
                # After the rejects file: a kill in between sends the
                # refused rows again, and they are refused again.
                journal.acknowledge(count, self._keyOf(batch[-1]))
                if self._compactions is None:
                    journal.compactIfLarge(self._queue)
            except (OSError, JournalError) as error:
                # The rows will be sent again at the next start: harmless.
                self._journalUnwritable(error)
            if self._compactions is not None:
                # Even when the acknowledgement could not be journalled:
                # the rewrite drops the rows all the same.
                self._compactions.acknowledged()
        if self._onRecorded is not None:
            committed = [
                row.ledger_id
                for index, row in enumerate(batch)
                if index not in refused and row.ledger_id
            ]
            if committed:
                try:
                    self._onRecorded(committed)
                except Exception:
                    self.log.failure("onRecorded failed for {rows} row(s)", rows=len(committed))
        if self._queue:
            self._sendAfterLinger()
        else:
            self._fireEmptied()

    def _journalUnwritable(self, error: Exception) -> None:
        journal = self._journal
        self._journalFailing.warn(
            "{journal} {path} cannot be written ({reason}); {records} are held in memory only",
            **self.words.fields(),
            path=journal.path if journal is not None else "",
            reason=str(error),
        )

    def _setAside(self, row: Any, reason: str, detail: str) -> None:
        """
        Keep C{row}, which its daemon will never commit, where an operator
        finds it: the rejects file beside the journal, or without one (or
        when it cannot be written) the log itself, as C{describe} tells it
        (a usage row whole: its ids and numbers; an observation by its ids
        and size, never its content).
        """
        label = reason if reason in REJECT_REASONS else "other"
        self._metrics.usageRowRejected(label)
        ids = self._ids(row)
        journal = self._journal
        if journal is not None:
            try:
                journal.reject(row, reason, detail, self._clock.seconds())
            except OSError as error:
                self.log.error(
                    "Rejects file {path} cannot be written ({error}); {record}"
                    " {key} rejected by {peer} ({reason}: {detail}): {row}",
                    **self.words.fields(),
                    **ids,
                    path=journal.rejectsPath,
                    error=str(error),
                    reason=reason,
                    detail=detail,
                    row=self._describe(row),
                )
            else:
                self._rejecting.warn(
                    "{peer} rejected {record} {key} ({reason}: {detail}); set aside in {path}",
                    **self.words.fields(),
                    **ids,
                    reason=reason,
                    detail=detail,
                    path=journal.rejectsPath,
                )
            return
        # Every such line, not throttled: it is the only trace of the row.
        self.log.error(
            "{peer} rejected {record} {key} ({reason}: {detail}); without"
            " {variable} it is kept only here: {row}",
            **self.words.fields(),
            **ids,
            reason=reason,
            detail=detail,
            row=self._describe(row),
        )

    def _ids(self, row: Any) -> dict[str, str]:
        """
        The log fields that name C{row}: its key (also under the words'
        C{keyField}) and its request id.
        """
        key = self._keyOf(row)
        return {"key": key, self.words.keyField: key, "request_id": str(row.request_id)}

    def _failed(self, failure: Failure) -> None:
        self._call = None
        if self._closed:
            return
        if _invalidArgument(failure):
            self._refused(failure)
            return
        self._failures += 1
        ceiling = min(self._lastRetry, self._firstRetry * 2 ** min(self._failures - 1, 32))
        delay = ceiling / 2 + self._random() * ceiling / 2
        status, details = _statusOf(failure)
        self._failing.warn(
            "{call} to {peer} failed ({grpc_status}: {grpc_details}); {rows} {records}"
            " waiting, trying again in {delay:.2f} s",
            **self.words.fields(),
            grpc_status=status,
            grpc_details=details,
            rows=len(self._queue),
            delay=delay,
        )
        self._retry = self._clock.callLater(delay, self._retryNow)
        if _unimplemented(failure):
            # An svc-auth without RecordUsage will not gain it while a stop
            # waits: end the flush now rather than at its bound.
            self._fireEmptied()

    def _refused(self, failure: Failure) -> None:
        """
        svc-auth failed the whole batch with INVALID_ARGUMENT: an svc-auth
        older than per-row rejects, or a batch it cannot take as a whole.
        Asked again, it answers the same, so the batch would stall the
        ledger for ever: send its first half (at once: no backoff, nothing
        is down), and so on, until the row it refuses is alone; that row is
        set aside as C{invalid}, and the rest go on.
        """
        count, self._batch = self._batch, 0
        _, details = _statusOf(failure)
        if count <= 1:
            self._suspect = 0
            self._batch = 1
            refusal = auth_pb2.RejectedUsageRow(
                index=0, reason="invalid", detail=details[:DETAIL_CHARS]
            )
            self._settle([refusal])
            return
        self._suspect = count
        self._halving.warn(
            "{call} refused a batch of {rows} {records} as invalid"
            " ({grpc_details}); sending it in halves to find the {record} it refuses",
            **self.words.fields(),
            rows=count,
            grpc_details=details[:DETAIL_CHARS],
        )
        self._sendSoon()

    def _retryNow(self) -> None:
        self._retry = None
        self._sendSoon()

    def _fireEmptied(self) -> None:
        waiting, self._emptied = self._emptied, []
        for each in waiting:
            each.callback(None)

    def flush(self, timeout: float) -> Deferred[int]:
        """
        Send every row waiting, for at most C{timeout} seconds (a graceful
        stop, once no request is left to record). A batch waiting out its
        backoff is tried at once.

        @return: a Deferred that fires with the number of rows still not
            acknowledged at the end (0 when all were).
        """
        if not self._queue:
            return succeed(0)
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
            self._retry = None
        self._flushing = True
        emptied: Deferred[None] = Deferred()
        self._emptied.append(emptied)
        self._sendSoon()
        bounded = timeoutDeferred(emptied, timeout, asReactorTime(self._clock))

        def leftOver(_: object) -> int:
            return len(self._queue)

        def timedOut(failure: Failure) -> int:
            failure.trap(TimeoutError, CancelledError)
            return len(self._queue)

        return bounded.addCallbacks(leftOver, timedOut)

    def settle(self, timeout: float) -> Deferred[None]:
        """
        Before L{close}, at a stop: let a journal that forgets finish the
        rewrite its thread is doing and make the last, for at most
        C{timeout} seconds (L{Compactions.settle}); at once otherwise.
        """
        if self._compactions is None or self._closed:
            return succeed(None)
        return self._compactions.settle(timeout)

    def close(self) -> int:
        """
        Stop sending (the call in flight is cancelled) and close the
        journal; say how many rows were left and where they are.

        @return: that number.
        """
        if self._closed:
            return len(self._queue)
        self._closed = True
        self._stopLingering()
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if self._call is not None:
            self._call.cancel()
        left = len(self._queue)
        if left and self._journal is not None:
            self.log.warn(
                "{rows} {records} not acknowledged by {peer} at stop; kept in the"
                " journal {path}, sent at the next start",
                **self.words.fields(),
                rows=left,
                path=self._journal.path,
            )
        elif left:
            self.log.error(
                "{rows} {records} not acknowledged by {peer} at stop and lost"
                " ({variable} is not set)",
                **self.words.fields(),
                rows=left,
            )
        if self._compactions is not None:
            # Rows acknowledged just before the stop leave the file now,
            # not at the next start.
            self._compactions.stop()
        if self._journal is not None:
            try:
                self._journal.close()
            except OSError as error:
                self.log.error(
                    "{journal} {path}: cannot close ({reason})",
                    **self.words.fields(),
                    path=self._journal.path,
                    reason=str(error),
                )
        return left
