"""
A daemon's database side as one twistd service, for every daemon that
keeps a PostgreSQL pool and a change listener (svc-auth, svc-memory).
"""

from __future__ import annotations

from typing import Protocol

from psycopg_pool import ConnectionPool
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool


class ChangeListening(Protocol):
    """
    A change listener: a thread of its own, started and stopped.
    """

    def start(self) -> None: ...

    def stop(self, timeout: float = 2.0) -> None: ...


class DatabaseService(Service):
    """
    Owns the database side: the connection pool, the change listener, and
    the thread pool in which the HTTP side runs its database checks.

    The pool opens without waiting, so the daemon starts (and /ready says
    why it is not ready) while PostgreSQL is still down. A stop closes the
    listener and the pool on that thread pool, never on the reactor's
    thread, then stops the threads.
    """

    log = Logger()

    def __init__(
        self,
        reactor: IReactorThreads,
        pool: ConnectionPool,
        listener: ChangeListening,
        threads: ThreadPool,
    ) -> None:
        self._reactor = reactor
        self._pool = pool
        self._listener = listener
        self.threads = threads

    def startService(self) -> None:
        super().startService()
        self.threads.start()
        self._pool.open(wait=False)
        self._listener.start()

    def stopService(self) -> Deferred[None]:
        super().stopService()

        def close() -> None:
            self._listener.stop()
            self._pool.close(timeout=5.0)

        closing: Deferred[None] = deferToThreadPool(self._reactor, self.threads, close)

        def stopThreads(result: object) -> object:
            self.threads.stop()
            self.log.info("Database pool closed")
            return result

        closing.addBoth(stopThreads)
        return closing
