"""
What svc-memory's two caches (L{svcd.memory.vectors.VectorCache}, of
vectors and text indexes, and L{svcd.memory.recordcache.RecordCache}, of
records) share about the change listener (L{svcd.memory.listener}).

A cache may hold a scope only while the listener hears every change:
what it holds is then kept current, and nothing else could be. So each
cache starts empty whenever listening begins (changes may have been missed
before) and empties whenever it ends, and a load that began before either
is not installed: each change of state starts a new I{epoch}, and a load
carries the epoch it began in.
"""

from __future__ import annotations

import threading


class FollowedCache:
    """
    The listener's state and the epoch of a cache kept current by it;
    subclasses hold their entries under C{_lock} and say how they are
    cleared (L{_clear}).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listening = False
        self._epoch = 0

    def isListening(self) -> bool:
        return self._listening

    def listening(self) -> None:
        """
        The listener hears every change from now on: cache again, from
        empty (changes may have been missed before).
        """
        with self._lock:
            self._epoch += 1
            self._clear()
            self._listening = True

    def notListening(self) -> None:
        """
        The listener lost PostgreSQL: forget everything and cache nothing
        until it is back.
        """
        with self._lock:
            self._epoch += 1
            self._clear()
            self._listening = False

    def _isCurrent(self, epoch: int) -> bool:
        """
        Whether a load begun in C{epoch} may be installed now (under
        C{_lock}).
        """
        return epoch == self._epoch and self._listening

    def _clear(self) -> None:
        """
        Drop every entry and load in progress, and report the size (under
        C{_lock}).
        """
        raise NotImplementedError
