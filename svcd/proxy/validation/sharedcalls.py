"""
Concurrent requests asking svc-auth the same question share one call, but
never a call that was sent before they asked.

Agents commonly send many requests at once with one token, and each would
cost a ValidateToken and a ValidateAgent round trip: on a busy proxy most
of those calls carry the very same request. L{SharedCalls} sends one call
per key at a time. A caller that arrives while a call for its key is in
flight does not join that call (its answer may predate the caller, say a
revocation committed in between); it waits for it to end and shares the
I{next} call with everyone else who arrived meanwhile. Every caller thus
gets an answer from a call sent after it asked, exactly as if it had sent
its own, so revocation and status changes take effect as promptly as
without sharing (decisions D7), while under load a batch of requests costs
one call.

An idle proxy is unaffected: a caller with no call in flight for its key
sends at once.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Batch(Generic[V]):
    """
    The callers that share one call, and that call once it is sent.

    C{send} and C{context} are the first caller's: the call is made in its
    context, so it carries that caller's trace.
    """

    def __init__(self, send: Callable[[], Deferred[V]], context: contextvars.Context) -> None:
        self.send = send
        self.context = context
        self.waiters: list[Deferred[V]] = []
        self.call: Deferred[V] | None = None

    def live(self) -> bool:
        return any(not waiter.called for waiter in self.waiters)

    def withdraw(self, waiter: Deferred[V]) -> None:
        if waiter in self.waiters:
            self.waiters.remove(waiter)


class _Key(Generic[V]):
    """
    One key's call in flight and the batch gathering for the next one.
    """

    def __init__(self) -> None:
        self.current: _Batch[V] | None = None
        self.next: _Batch[V] | None = None


class SharedCalls(Generic[K, V]):
    """
    At most one call in flight per key; callers that arrive meanwhile share
    the next one (see the module docstring).

    Cancelling a caller's Deferred withdraws that caller only; a call whose
    callers have all withdrawn is cancelled.
    """

    def __init__(self) -> None:
        self._keys: dict[K, _Key[V]] = {}

    def call(
        self, key: K, send: Callable[[], Deferred[V]], joinCurrent: bool = False
    ) -> Deferred[V]:
        """
        The outcome of C{send()}, or of an identical call another caller
        sends for C{key} after this one asked.

        @param send: starts the call; invoked at once when no call for
            C{key} is in flight, else later, in the caller's context, by
            whichever caller's turn it is.
        @param joinCurrent: the caller asked before the call now in flight
            for C{key} was sent (it is asking again after a call it shared
            failed, and calls for a key follow one another), so it may
            share that call instead of waiting for the next.
        """
        state = self._keys.get(key)
        if joinCurrent and state is not None and state.current is not None:
            return self._wait(state, state.current)
        if state is None:
            state = self._keys[key] = _Key()
            batch = _Batch(send, contextvars.copy_context())
            waiter = self._wait(state, batch)
            self._send(key, state, batch)
            return waiter
        if state.next is None:
            state.next = _Batch(send, contextvars.copy_context())
        return self._wait(state, state.next)

    def ask(
        self,
        key: K,
        send: Callable[[], Deferred[V]],
        failedWithoutAnswer: Callable[[BaseException], bool],
    ) -> Deferred[V]:
        """
        L{call}, except that a caller whose share was another caller's call
        that failed without an answer (C{failedWithoutAnswer}: a deadline,
        an unreachable server) tries once more.

        A missed deadline is a property of one call, and without sharing
        each of its sharers would have made a call of its own: one slow
        moment would otherwise fail every caller of a batch (26 at once,
        seen in a soak at 32 connections) where it failed one. The caller
        that sent the failed call gets its failure as always; the others
        share one more call, so a failure costs at most one extra call per
        key.
        """
        return Deferred.fromCoroutine(self._ask(key, send, failedWithoutAnswer))

    async def _ask(
        self,
        key: K,
        send: Callable[[], Deferred[V]],
        failedWithoutAnswer: Callable[[BaseException], bool],
    ) -> V:
        sent = False

        def sendOwn() -> Deferred[V]:
            nonlocal sent
            sent = True
            return send()

        try:
            return await self.call(key, sendOwn)
        except Exception as error:
            if sent or not failedWithoutAnswer(error):
                raise
        # Asked before any call now in flight for the key was sent: those
        # who shared the failed call retry together.
        return await self.call(key, send, joinCurrent=True)

    def inFlight(self) -> int:
        """
        How many keys have a call in flight.
        """
        return len(self._keys)

    def _wait(self, state: _Key[V], batch: _Batch[V]) -> Deferred[V]:
        def withdraw(waiter: Deferred[V]) -> None:
            batch.withdraw(waiter)
            if batch.live():
                return
            if batch is state.next:
                state.next = None
            elif batch.call is not None:
                batch.call.cancel()

        waiter: Deferred[V] = Deferred(withdraw)
        batch.waiters.append(waiter)
        return waiter

    def _send(self, key: K, state: _Key[V], batch: _Batch[V]) -> None:
        state.current = batch
        try:
            call = batch.context.run(batch.send)
        except BaseException:
            call = Deferred()
            call.errback()
        batch.call = call
        call.addBoth(self._ended, key, state, batch)

    def _ended(self, outcome: V | Failure, key: K, state: _Key[V], batch: _Batch[V]) -> None:
        state.current = None
        following, state.next = state.next, None
        if following is not None and following.live():
            # Sent before this batch hears its answer: those callers have
            # already waited a whole call.
            self._send(key, state, following)
        else:
            del self._keys[key]
        for waiter in tuple(batch.waiters):
            if waiter.called:
                continue
            if isinstance(outcome, Failure):
                waiter.errback(outcome.value)
            else:
                waiter.callback(outcome)
