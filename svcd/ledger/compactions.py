"""
The memory journal's rewrites (decisions D13, amended, "Forgetting
reaches every copy"): when they happen (L{Compactions}) and, given a
thread of their own, the part of each done there (L{JournalCopy}).

A rewrite copies the records of the rows waiting into a new file,
fsyncs it and renames it over the journal. After svc-memory was away,
thousands of rows wait (40 MiB and more): the copy and its fsync then
take a tenth of a second to more than a second, which on the reactor's
thread is a stall of every request and, since acknowledgements keep
coming meanwhile, breaks the one second an acknowledged observation may
stay in the file. So, given a one-thread pool (C{inThread}), a rewrite
is done in three steps:

  1. On the reactor (L{Journal.startCopy}): the journal's size and
     the byte ranges of the rows waiting are noted (a snapshot: the file
     only grows, so those bytes do not change), and the file is opened
     for reading. Microseconds.
  2. In the thread (L{JournalCopy.copy}): those ranges are copied into
     C{<journal>.compacting} after the magic line, in the kernel
     (C{copy_file_range}: the thread seldom needs the GIL, which the
     reactor holds while it works), and it is fsynced.
     Rows are appended and acknowledged meanwhile on the reactor, to the
     old file.
  3. On the reactor (L{Journal.finishCopy}): what the old file
     gained since the snapshot (its tail: rows and acknowledgement
     records, normally a few KiB) is appended to the copy as it is, the
     copy renamed over the journal and made the file appended to. Then,
     in the thread again (L{JournalCopy.retire}), the old file's
     descriptors are closed, which frees its inode (for tens of MiB, up
     to a tenth of a second of the kernel's), and the directory fsynced.

The copy's replay is the old file's: the rows it copied are the ones
waiting at the snapshot, in order, and the acknowledgement records of
the tail count the oldest rows waiting, whichever file holds them. Rows
acknowledged while the thread copied are in the new file still, until
the next rewrite, which follows at once when the last one took longer
than the spacing. A kill at any step leaves the old journal whole, or
the new one whole (the rename is atomic); a copy left beside it is
replaced by the next start's own rewrite. A copy that fails removes
itself, and the rewrite is tried again later: the old journal, still
the one appended to, has lost nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred, TimeoutError, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.ledger.journalfile import JournalError

if TYPE_CHECKING:
    from svcd.ledger.journal import Journal

__all__ = ["COPY_CHUNK_BYTES", "Compactions", "InThread", "JournalCopy"]

# What the thread copies at once: it looks whether the copy was
# abandoned (a stop past its bound) between two.
COPY_CHUNK_BYTES = 8 * 1024 * 1024

# Runs a function in the journal's thread pool: a Deferred of its
# result, fired on the reactor's thread (deferToThreadPool with the
# reactor and the pool bound).
InThread = Callable[[Callable[[], Any]], "Deferred[Any]"]


class CopyAbandoned(Exception):
    """
    The copy was abandoned while the thread wrote it: a stop that could
    wait no longer.
    """


class JournalCopy:
    """
    The part of a rewrite that runs in a thread of its own (see the
    module docstring): a new file holding the magic line and the
    records at C{entries} (offset, length) of the journal open at
    C{source}, fsynced. Made by L{Journal.startCopy} on the
    reactor; its descriptors are the reactor's to close, after the
    thread is done with them (L{discard}, or the journal takes the copy
    on in L{Journal.finishCopy}).

    @ivar snapshotSize: the journal's size when the copy was decided:
        what the old file gains past it is the tail.
    @ivar copiedEnd: the copy's size once the thread is done.
    @ivar acknowledgedRows: the journal's count of rows acknowledged at
        the snapshot.
    @ivar generation: the journal's generation at the snapshot: a
        rewrite since then makes the copy stale.
    """

    def __init__(
        self,
        path: str,
        magic: bytes,
        source: int,
        entries: Sequence[tuple[int, int]],
        waitingBytes: int,
        snapshotSize: int,
        acknowledgedRows: int,
        generation: int,
    ) -> None:
        self.path = path
        self.temporary = path + ".compacting"
        self.source: int | None = source
        self.fd: int | None = None
        self.snapshotSize = snapshotSize
        self.acknowledgedRows = acknowledgedRows
        self.generation = generation
        self._magic = magic
        self._entries = entries
        self.copiedEnd = len(magic) + waitingBytes
        # The rows' records in the copy, (offset, length), oldest first:
        # worked out by the thread.
        self.waiting: deque[tuple[int, int]] = deque()
        self._abandoned = threading.Event()
        # The old file's descriptors, once the copy replaced it.
        self.retired: list[int] = []

    @property
    def abandoned(self) -> bool:
        return self._abandoned.is_set()

    def abandon(self) -> None:
        """
        Ask the thread to stop copying and remove its copy (a stop that
        waited for it long enough); from any thread.
        """
        self._abandoned.set()

    def copy(self) -> None:
        """
        Write and fsync the copy: in the journal's thread, touching no
        state of the journal. On any failure the copy is removed before
        this raises.

        @raise OSError: when it could not be written or the journal
            read.
        @raise CopyAbandoned: when L{abandon} was called meanwhile.
        """
        assert self.source is not None
        try:
            # Without O_APPEND while copying: copy_file_range refuses it.
            fd = self.fd = os.open(
                self.temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
            )
            writeAll(fd, self._magic)
            runs: list[list[int]] = []
            place = len(self._magic)
            for offset, length in self._entries:
                self.waiting.append((place, length))
                place += length
                # Adjacent records read at once: normally one run, broken
                # only by acknowledgement records.
                if runs and runs[-1][0] + runs[-1][1] == offset:
                    runs[-1][1] += length
                else:
                    runs.append([offset, length])
            if place != self.copiedEnd:
                raise OSError(0, "the rows' records do not add up")
            place = len(self._magic)
            for offset, length in runs:
                while length:
                    if self._abandoned.is_set():
                        raise CopyAbandoned()
                    copied = _copyRange(
                        self.source, fd, min(length, COPY_CHUNK_BYTES), offset, place
                    )
                    offset += copied
                    place += copied
                    length -= copied
            # The journal's rows are appended to it once it replaces it.
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
            os.fsync(fd)
        except BaseException:
            self._removeCopy()
            raise

    def _removeCopy(self) -> None:
        # The copy holds rows' content (observations: what users said).
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self.temporary)

    def discard(self) -> None:
        """
        Remove the copy and close the journal's descriptor: on the
        reactor, once the thread is done (or never started).
        """
        self._removeCopy()
        self.closeSource()

    def retire(self) -> None:
        """
        Once the copy replaced the journal (L{Journal.finishCopy}):
        close the old file's descriptors, which frees its inode, and
        fsync the directory, so that the rename outlives a power loss. In
        the journal's thread (or the caller's, without one).

        @raise OSError: when the directory could not be fsynced (the old
            file is freed all the same).
        """
        retired, self.retired = self.retired, []
        for fd in retired:
            with contextlib.suppress(OSError):
                os.close(fd)
        fsyncDirectory(self.path)

    def closeSource(self) -> None:
        source, self.source = self.source, None
        if source is not None:
            with contextlib.suppress(OSError):
                os.close(source)


def _copyRange(source: int, target: int, count: int, offset: int, place: int) -> int:
    """
    Copy at most C{count} bytes of C{source} at C{offset} to C{target} at
    C{place}: in the kernel (C{copy_file_range}, one call, no bytes
    through Python, so that the thread seldom waits for the reactor's
    GIL), or by C{pread} and C{pwrite} where the kernel or the
    filesystem cannot.

    @return: how many were copied (at least one).
    @raise OSError: when the journal is shorter than its records.
    """
    try:
        copied = os.copy_file_range(source, target, count, offset, place)
    except OSError as error:
        if error.errno not in _NO_COPY_RANGE:
            raise
        copied = -1
    if copied < 0:
        chunk = os.pread(source, count, offset)
        view = memoryview(chunk)
        while view:
            written = os.pwrite(target, view, place)
            view = view[written:]
            place += written
        copied = len(chunk)
    if copied <= 0:
        raise OSError(0, "the journal is shorter than its records")
    return copied


# What copy_file_range says where it cannot copy (an old kernel, across
# filesystems, a filesystem without it).
_NO_COPY_RANGE = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP})


def writeAll(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsyncDirectory(path: str) -> None:
    """
    fsync the directory of C{path}, so that a rename into it outlives a
    power loss.
    """
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Compactions:
    """
    When a journal that forgets is rewritten: the memory journal
    (C{SVC_MEMORY_JOURNAL}), which holds what users said, must hold an
    observation only until svc-memory has acknowledged it (decisions D13,
    amended: within a second, no byte of it is left in the file).

    After an acknowledgement that leaves acknowledged bytes in the file,
    the journal is rewritten with only the rows still waiting: at once
    when the last rewrite began at least C{every} seconds ago (and is
    over), else when it is that old; the acknowledgements meanwhile share
    that one rewrite. A busy proxy thus rewrites at most 1/C{every} times
    a second.

    With C{inThread} (the proxy's one-thread pool), the copy and its
    fsyncs are done there (L{JournalCopy}, the module docstring): the
    reactor holds a rewrite for the snapshot and the tail, well under a
    millisecond when thousands wait. Without it (or when the file does
    not hold every row waiting, after a full disk), the rewrite runs on
    the caller's thread from start to end (L{Journal.dropAcknowledged}).
    Either way the next rewrite waits four times as long as the last one
    held the reactor, within what keeps the second, never less than twice
    it nor more than 2 s, so that the proxy keeps most of its time for
    requests.

    A rewrite that fails (a full disk) is logged by C{failed}, its copy
    removed, and tried again C{every} seconds later. L{settle} (a stop)
    waits for the rewrite in the thread, bounded, then makes the last;
    L{stop} rewrites at once on the caller's thread what is still due,
    so that a proxy stopped just after an acknowledgement leaves no
    acknowledged row behind.

    @param journal: the journal, open.
    @param clock: when rewrites are due and how long one took (the
        reactor's clock is the wall clock, read afresh).
    @param every: the least spacing of rewrites, in seconds.
    @param waiting: every row not yet acknowledged, oldest first: what
        a rewrite keeps (the outbox's queue).
    @param failed: told of a rewrite that failed.
    @param inThread: runs a function in the journal's own thread pool
        (one thread), or None.
    """

    log = Logger()

    # A rewrite is due at most this long after the acknowledgement that
    # called for it, when the last one was quick (D13, amended: one
    # second, less the rewrite's own time).
    WITHIN = 1.0
    # The longest spacing, whatever a rewrite seemed to take (the
    # reactor's clock is the wall clock, which may jump).
    LONGEST = 2.0

    def __init__(
        self,
        journal: Journal,
        clock: Clock,
        every: float,
        waiting: Callable[[], Sequence[Any]],
        failed: Callable[[Exception], None],
        inThread: InThread | None = None,
    ) -> None:
        self._journal = journal
        self._clock = clock
        self._every = every
        self._spacing = every
        self._waiting = waiting
        self._failed = failed
        self._inThread = inThread
        self._last: float | None = None
        self._due: IDelayedCall | None = None
        self._stopped = False
        # While a stop waits for the thread: no rewrite starts by itself.
        self._settling = False
        # The rewrite whose copy the thread is doing, and who waits for
        # it to end.
        self._copy: JournalCopy | None = None
        self._busy: Deferred[None] | None = None
        self._idle: list[Deferred[None]] = []

    @property
    def pending(self) -> bool:
        """
        Whether a rewrite is waiting for its time.
        """
        return self._due is not None

    @property
    def busy(self) -> bool:
        """
        Whether the thread is making a rewrite's copy.
        """
        return self._busy is not None

    def acknowledged(self) -> None:
        """
        Rows were acknowledged: rewrite now, or when the spacing allows
        (and the rewrite in the thread, if any, is over).
        """
        if (
            self._stopped
            or self._settling
            or self._due is not None
            or self._busy is not None
            or self._journal.acknowledgedBytes <= 0
        ):
            return
        wait = 0.0
        if self._last is not None:
            wait = self._last + self._spacing - self._clock.seconds()
        if wait <= 0:
            self._rewrite()
        else:
            self._due = self._clock.callLater(wait, self._dueNow)

    def _dueNow(self) -> None:
        self._due = None
        self._rewrite()

    def _rewrite(self) -> None:
        started = self._clock.seconds()
        self._last = started
        journal = self._journal
        if self._inThread is not None and journal.copyable(self._waiting()):
            try:
                copy = journal.startCopy()
            except OSError as error:
                self._retryLater(error)
                return
            self._copy = copy
            held = max(0.0, self._clock.seconds() - started)
            self._busy = busy = self._inThread(copy.copy)
            busy.addCallbacks(
                self._copied, self._copyFailed, callbackArgs=(copy, held), errbackArgs=(copy,)
            )
            return
        try:
            journal.dropAcknowledged(self._waiting())
        except (OSError, JournalError) as error:
            self._retryLater(error)
            return
        self._space(max(0.0, self._clock.seconds() - started))

    def _space(self, held: float) -> None:
        """
        Space the next rewrite after one that held the reactor C{held}
        seconds.
        """
        spacing = max(self._every, 2 * held, min(4 * held, self.WITHIN - held))
        self._spacing = min(spacing, max(self._every, self.LONGEST))

    def _retryLater(self, error: Exception) -> None:
        self._failed(error)
        if not self._stopped:
            self._due = self._clock.callLater(self._every, self._dueNow)

    def _copied(self, _: object, copy: JournalCopy, held: float) -> None:
        """
        The thread wrote and fsynced the copy: on the reactor, append the
        old file's tail, rename, switch (L{Journal.finishCopy}); then
        the old file's closing and the directory's fsync are left to the
        thread (L{JournalCopy.retire}), and the rewrite is over.
        """
        self._copy = None
        if copy.abandoned:
            copy.discard()
            self._over()
            return
        began = self._clock.seconds()
        try:
            switched = self._journal.finishCopy(copy)
        except (OSError, JournalError) as error:
            self._busy = None
            self._retryLater(error)
            self._over()
            return
        self._space(held + max(0.0, self._clock.seconds() - began))
        if switched and self._inThread is not None:
            # Not waited for: the thread does one thing at a time, so it
            # is done before the next copy begins, and before the pool
            # stops. The next rewrite, due now when acknowledgements came
            # during this one, saves a round trip through the reactor.
            self._inThread(copy.retire).addErrback(self._retireFailed)
        self._over()

    def _copyFailed(self, failure: Failure, copy: JournalCopy) -> None:
        self._copy = None
        copy.discard()
        self._busy = None
        if not failure.check(CopyAbandoned):
            error = failure.value
            self._retryLater(error if isinstance(error, Exception) else RuntimeError(str(error)))
        self._over()

    def _retireFailed(self, failure: Failure) -> None:
        # The directory's fsync: the rename is done and the old file
        # freed; only its outliving a power loss is in doubt, until the
        # next rewrite's.
        error = failure.value
        self._failed(error if isinstance(error, Exception) else RuntimeError(str(error)))

    def _over(self) -> None:
        """
        The thread is done with the rewrite: tell who waits, and rewrite
        again when the acknowledgements meanwhile call for it.
        """
        self._busy = None
        waiting, self._idle = self._idle, []
        for each in waiting:
            each.callback(None)
        if self._due is None:
            self.acknowledged()

    def _whenIdle(self, timeout: float) -> Deferred[None]:
        if self._busy is None:
            return succeed(None)
        idle: Deferred[None] = Deferred()
        self._idle.append(idle)
        return timeoutDeferred(idle, timeout, asReactorTime(self._clock))

    def settle(self, timeout: float) -> Deferred[None]:
        """
        A stop: wait for the rewrite in the thread, for at most
        C{timeout} seconds, then make the last rewrite (in the thread
        too, within what is left of C{timeout}), so that nothing
        acknowledged is left in the file. Nothing is scheduled any more;
        past the bound, the copy is abandoned (and removes itself), and
        L{stop} does what it can.
        """
        return Deferred.fromCoroutine(self._settle(bound=timeout))

    async def _settle(self, bound: float) -> None:
        self._settling = True
        self._cancelDue()
        deadline = self._clock.seconds() + bound
        try:
            await self._whenIdle(bound)
            self._cancelDue()
            if not self._stopped and self._journal.acknowledgedBytes > 0:
                self._rewrite()
                self._cancelDue()
                await self._whenIdle(max(0.0, deadline - self._clock.seconds()))
        except TimeoutError:
            self.log.warn(
                "{path}: a rewrite of the journal was still running after {timeout} s"
                " at stop; abandoned",
                path=self._journal.path,
                timeout=bound,
            )
        finally:
            self._stopped = True
            self._cancelDue()
            if self._copy is not None:
                self._copy.abandon()

    def _cancelDue(self) -> None:
        if self._due is not None:
            if self._due.active():
                self._due.cancel()
            self._due = None

    def stop(self) -> None:
        """
        Rewrite now, on the caller's thread, if anything acknowledged is
        left in the file, and schedule nothing more (the outbox stops;
        the journal is closed next). A copy still in the thread (a
        L{settle} past its bound, or none made) is abandoned instead: the
        next start's rewrite drops what it would have.
        """
        self._stopped = True
        self._cancelDue()
        if self._copy is not None:
            self._copy.abandon()
            return
        if self._journal.acknowledgedBytes > 0:
            try:
                self._journal.dropAcknowledged(self._waiting())
            except (OSError, JournalError) as error:
                self._failed(error)
