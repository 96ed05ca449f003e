"""
The thread pool of a daemon's grpcio server (L{svcd.common.grpcserver}):
a call goes to the thread that finished a call last, not to the one idle
longest.

Why: C{concurrent.futures.ThreadPoolExecutor} hands each item to whichever
of its idle threads wakes first from its queue, and it starts a new thread
whenever none has said it is idle yet, which at one connection is most
calls (grpcio sends a call's status before its thread is back at the
queue, so the next call is submitted before the pool knows the thread is
free). So a server at one call at a time grew its pool towards its bound
and its calls went round every thread in turn: each call's Python ran on
a thread whose stack and data the core's caches had long dropped. Here
the most recently idle thread takes the next call (a stack of idle
threads, each woken by a lock of its own), so a server taking one call
at a time runs it on one hot thread, and threads are started only when
every one is busy.

Only what grpcio uses of an executor is kept: C{submit}, returning a
C{concurrent.futures.Future}, and C{shutdown}. Past C{maxWorkers} busy
threads, calls wait in order (grpcio's C{maximum_concurrent_rpcs}, set to
the pool's size, refuses them before that).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _Worker:
    """
    An idle thread's mailbox: the item it is given, and the lock it waits
    on (held while it has nothing to do).
    """

    __slots__ = ("item", "wake")

    def __init__(self) -> None:
        self.item: _Item | None = None
        self.wake = threading.Lock()
        self.wake.acquire()


class StackedThreadPool(Executor):
    """
    An executor of at most C{maxWorkers} threads, started as needed, whose
    most recently idle thread takes the next item (see the module
    docstring). Its threads are daemon threads: a server stops its calls
    (with its grace period) before the process ends, and an idle thread
    must not hold the interpreter's exit.
    """

    def __init__(self, maxWorkers: int, threadNamePrefix: str) -> None:
        if maxWorkers < 1:
            raise ValueError("maxWorkers must be at least 1")
        self._maxWorkers = maxWorkers
        self._prefix = threadNamePrefix
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._waiting: deque[_Item] = deque()
        self._threads: list[threading.Thread] = []
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        item: _Item = (future, fn, args, kwargs)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._idle:
                worker = self._idle.pop()
                worker.item = item
                worker.wake.release()
                return future
            if len(self._threads) < self._maxWorkers:
                # The item goes in the mailbox, not in the thread's
                # arguments: a Thread keeps those until it ends, and grpcio's
                # call would then live (and hold its HTTP/2 stream, counted
                # against the connection's limit) as long as the thread.
                worker = _Worker()
                worker.item = item
                thread = threading.Thread(
                    target=self._work,
                    args=(worker,),
                    name=f"{self._prefix}_{len(self._threads)}",
                    daemon=True,
                )
                self._threads.append(thread)
                try:
                    thread.start()
                except BaseException:
                    # Its place given back; the caller learns it, as with
                    # ThreadPoolExecutor.
                    self._threads.remove(thread)
                    raise
            else:
                self._waiting.append(item)
        return future

    def _work(self, worker: _Worker) -> None:
        item, worker.item = worker.item, None
        while item is not None:
            _run(item)
            item = None
            with self._lock:
                if self._waiting:
                    item = self._waiting.popleft()
                    continue
                if self._shutdown:
                    return
                self._idle.append(worker)
            worker.wake.acquire()
            item, worker.item = worker.item, None

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._waiting:
                    self._waiting.popleft()[0].cancel()
            idle, self._idle = self._idle, []
            threads = list(self._threads)
        for worker in idle:
            worker.item = None
            worker.wake.release()
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()


def _run(item: _Item) -> None:
    future, fn, args, kwargs = item
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as error:
        future.set_exception(error)
    else:
        future.set_result(result)
