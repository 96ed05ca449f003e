"""
Calls coalesced while one is in flight: the one rule behind a busy proxy's
recalls sharing their embedding's exchange and their search's call
(decisions D13, "Context assembly"; docs/design.rst, "Recalls share their
calls").

An item whose key has fewer than C{maxInFlight} calls in flight is sent at
once, alone: a quiet process waits for nothing, and its calls are the ones
it made before. Items that come while their key has that many are held,
and sent together (up to C{maxBatch} in one call) as soon as one of them
ends. So batches form only where calls pile up anyway, their size follows
the load, and no timer decides when a batch leaves. Keys never share a
call, so that one key's slow call holds back no other key's items.

What a call does with its items (their answers, their deadlines, one of
them cancelled) is the sender's: this module only decides what goes
together and when, and in which context (L{contextvars}: the current
span, which a call's trace context is read from). An item sent alone is
sent in its submitter's context, even when it was held first; a shared
call is sent in an empty one, since it belongs to no one request's trace.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Coalescer(Generic[K, T]):
    """
    Sends items by key, at most C{maxInFlight} calls in flight per key
    (see the module docstring).

    @param send: sends a key's items, one or more, as one call; the
        Deferred it returns fires (either way) when the call has ended, and
        its result is ignored here. It answers its items itself, and should
        not raise: an exception of a call made by L{submit} is raised to its
        caller; of a held batch's, logged (its items go unanswered).
    @param maxBatch: the most items of one call.
    @param maxInFlight: the most calls in flight per key.
    """

    log = Logger()

    def __init__(
        self, send: Callable[[K, list[T]], Deferred[Any]], maxBatch: int, maxInFlight: int = 1
    ) -> None:
        if maxBatch < 1:
            raise ValueError("a batch holds one item at least")
        if maxInFlight < 1:
            raise ValueError("one call at least must be in flight")
        self._send = send
        self._maxBatch = maxBatch
        self._maxInFlight = maxInFlight
        self._inFlight: dict[K, int] = {}
        self._held: dict[K, list[tuple[T, contextvars.Context]]] = {}

    def submit(self, key: K, item: T) -> None:
        """
        Send C{item} now, when C{key} has fewer than C{maxInFlight} calls in
        flight; else hold it for the next call of C{key}.
        """
        if self._inFlight.get(key, 0) >= self._maxInFlight:
            self._held.setdefault(key, []).append((item, contextvars.copy_context()))
        else:
            self._call(key, [item])

    def withdraw(self, key: K, item: T) -> bool:
        """
        Take back an item still held (its caller gave up on it): True when
        it was held (this very object), and will not be sent; False once
        sent.
        """
        held = self._held.get(key, [])
        for index, (each, _) in enumerate(held):
            if each is item:
                del held[index]
                if not held:
                    del self._held[key]
                return True
        return False

    def held(self, key: K) -> int:
        """
        How many items of C{key} wait for its call in flight.
        """
        return len(self._held.get(key, ()))

    def _call(self, key: K, items: list[T]) -> None:
        self._inFlight[key] = self._inFlight.get(key, 0) + 1
        try:
            ended = self._send(key, items)
        except BaseException:
            self._ended(None, key)
            raise
        ended.addBoth(self._ended, key)

    def _ended(self, result: object, key: K) -> None:
        if isinstance(result, Failure):
            # A sender answers its items and ends its call with nothing to
            # say; a failure here is a bug of its, which left them
            # unanswered.
            self.log.failure("A call of held items failed", failure=result)
        left = self._inFlight[key] - 1
        if left:
            self._inFlight[key] = left
        else:
            del self._inFlight[key]
        held = self._held.pop(key, None)
        if held:
            batch, rest = held[: self._maxBatch], held[self._maxBatch :]
            if rest:
                self._held[key] = rest
            if len(batch) == 1:
                [(_, context)] = batch
            else:
                context = contextvars.Context()
            try:
                context.run(self._call, key, [item for item, _ in batch])
            except Exception:
                # A sender must answer its items, even when it fails; one
                # that raised instead has left them unanswered. Said here,
                # rather than raised into the call that just ended.
                self.log.failure("Sending {count} held items failed", count=len(batch))
