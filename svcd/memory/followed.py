"""
What svc-memory's two caches (L{svcd.memory.vectorcache.VectorCache}, of
vectors and text indexes, and L{svcd.memory.recordcache.RecordCache}, of
records) share about the change listener (L{svcd.memory.listener}).

A cache may hold a scope only while the listener hears every change:
what it holds is then kept current, and nothing else could be. So each
cache starts empty whenever listening begins (changes may have been missed
before) and empties whenever it ends, and a load that began before either
is not installed: each change of state starts a new I{epoch}, and a load
carries the epoch it began in.

Listening is also a I{lease} (decisions D13, amended: "a replica that
cannot listen says so"): the listener renews it each time one of its own
beats comes back (L{FollowedCache.heard}), until the beat's sending time
plus C{lease} seconds, since every change committed before the beat was
sent has then been applied. A lease that runs out counts as the listener
lost, whatever its thread is doing (waiting on a silent socket, blocked
in a read of a frozen server, starved of the processor): the cache is
emptied at its next use and keeps nothing until the next beat comes back,
so nothing is answered from it more than C{lease} seconds after the
connection went silent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# How long a beat that came back vouches for the cache: D13's second.
LEASE_SECONDS = 1.0


class FollowedCache:
    """
    The listener's state and the epoch of a cache kept current by it;
    subclasses hold their entries under C{_lock} and say how they are
    cleared (L{_clear}), and call L{_expireIfLate} under it before they
    read or change their entries.

    @param monotonic: the clock of the lease.
    """

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._listening = False
        self._epoch = 0
        self._monotonic = monotonic
        self._until = float("inf")

    def isListening(self) -> bool:
        with self._lock:
            self._expireIfLate()
            return self._listening

    def listening(self, until: float = float("inf")) -> None:
        """
        The listener hears every change from now on: cache again, from
        empty (changes may have been missed before).

        @param until: when the lease runs out (monotonic), unless renewed
            (L{heard}); by default never (tests of the cache alone).
        """
        with self._lock:
            self._epoch += 1
            self._clear()
            self._listening = True
            self._until = until

    def heard(self, until: float) -> None:
        """
        One of the listener's beats came back, after every change
        committed before it was sent was applied: the lease runs until
        C{until}. A lease that ran out meanwhile starts again from empty:
        no change was lost (the connection kept listening), but searches
        were refused the cache and loads begun before are not trusted.
        """
        with self._lock:
            self._expireIfLate()
            if not self._listening:
                self._epoch += 1
                self._clear()
                self._listening = True
            self._until = until

    def notListening(self) -> None:
        """
        The listener lost PostgreSQL: forget everything and cache nothing
        until it is back.
        """
        with self._lock:
            self._epoch += 1
            self._clear()
            self._listening = False

    def _expireIfLate(self) -> None:
        """
        Empty the cache if the lease ran out (under C{_lock}).
        """
        if self._listening and self._monotonic() >= self._until:
            self._epoch += 1
            self._clear()
            self._listening = False

    def _isCurrent(self, epoch: int) -> bool:
        """
        Whether a load begun in C{epoch} may be installed now (under
        C{_lock}).
        """
        self._expireIfLate()
        return epoch == self._epoch and self._listening

    def _clear(self) -> None:
        """
        Drop every entry and load in progress, and report the size (under
        C{_lock}).
        """
        raise NotImplementedError
