"""
One provider's persistent connections and its bound on requests in
flight, as the forwarder (L{svcd.providers.upstream}) uses them: moved
out of it, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import attrs
from twisted.internet.defer import CancelledError, Deferred, DeferredSemaphore, TimeoutError

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.deferreds import timeoutDeferred
from svcd.metering.models import ANTHROPIC, Provider
from svcd.providers.faults import UpstreamFault, brokenFault, timeoutFault
from svcd.providers.http1 import BadAnswer, ConnectionPool, UpstreamAnswer
from svcd.providers.operations import Leg
from svcd.providers.relay import BodyReader, StreamFault

IDLE_CONNECTION_SECONDS = 4.0
_CHAT_COMPLETIONS_PATH = "/chat/completions"
_MESSAGES_PATH = "/messages"
_JSON = b"application/json"


@attrs.define
class Link:
    """
    One provider's pool of connections and bound on requests in flight.
    """

    reactor: Any
    clock: Clock
    provider: Provider
    pool: ConnectionPool = attrs.field(init=False)
    slots: DeferredSemaphore = attrs.field(init=False)
    # The path of the pool's own URL: chat completions, or an Anthropic
    # provider's messages (decisions D14).
    path: str = attrs.field(init=False)
    # The request target of each other path, by that path.
    targets: dict[str, bytes] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        fixed = {b"Content-Type": _JSON}
        key = self.provider.apiKey
        if self.provider.api == ANTHROPIC:
            self.path = _MESSAGES_PATH
            if key:
                fixed[b"x-api-key"] = key.encode("latin-1")
        else:
            self.path = _CHAT_COMPLETIONS_PATH
            if key:
                fixed[b"Authorization"] = b"Bearer " + key.encode("latin-1")
        self.pool = ConnectionPool(
            self.reactor,
            self.clock,
            self.provider.baseURL.rstrip("/") + self.path,
            fixed,
            IDLE_CONNECTION_SECONDS,
        )
        self.slots = DeferredSemaphore(self.provider.maxConnections)

    def target(self, leg: Leg) -> bytes | None:
        """
        Where C{leg} is posted on this provider's server: None for the
        pool's URL, else the base URL's path with the leg's appended.
        """
        if leg.path == self.path:
            return None
        target = self.targets.get(leg.path)
        if target is None:
            path = urlsplit(self.provider.baseURL).path.rstrip("/") + leg.path
            target = self.targets[leg.path] = path.encode("ascii")
        return target

    def send(
        self, body: bytes, headers: Mapping[bytes, bytes], target: bytes | None = None
    ) -> Deferred[UpstreamAnswer]:
        """
        POST C{body} (to C{target}, else to chat completions); fires with
        the answer, its body unread. Failures to connect or to get an
        answer become L{UpstreamFault}s.
        """
        sending = self.pool.post(body, headers, target)

        def failed(failure: Any) -> Any:
            if failure.check(CancelledError, UpstreamFault):
                # Cancelled in flight (its client went away, or its
                # deadline passed): not the provider's fault, and no
                # fallback may follow it.
                return failure
            if failure.check(BadAnswer):
                raise brokenFault("invalid") from None
            raise brokenFault("connect_error") from None

        return sending.addErrback(failed)

    async def exchange(
        self,
        body: bytes,
        headers: Mapping[bytes, bytes],
        target: bytes | None = None,
        onHead: Callable[[], None] | None = None,
    ) -> tuple[UpstreamAnswer, bytes]:
        """
        A whole exchange within a turn: the response and its whole body.
        C{onHead} is called when the response's head came (the try's first
        byte, decisions D15).
        """
        await self.slots.acquire()
        try:
            response = await self.send(body, headers, target)
            if onHead is not None:
                onHead()
            reader = BodyReader()
            response.deliverBody(reader)
            try:
                answer = await reader.finished
            except StreamFault as fault:
                raise brokenFault(fault.kind) from None
            return response, answer
        finally:
            self.slots.release()

    def turn(self, budget: float, clock: Clock) -> Turn:
        return Turn(self.slots, budget, clock)


class Turn:
    """
    A slot of a provider's bound, taken within C{budget} seconds; inside,
    C{remaining()} says how much of the budget is left.
    """

    def __init__(self, slots: DeferredSemaphore, budget: float, clock: Clock) -> None:
        self._slots = slots
        self._budget = budget
        self._clock = clock
        self._began = clock.seconds()

    def remaining(self) -> float:
        return max(0.001, self._budget - (self._clock.seconds() - self._began))

    async def __aenter__(self) -> Callable[[], float]:
        try:
            await timeoutDeferred(self._slots.acquire(), self._budget, asReactorTime(self._clock))
        except TimeoutError:
            raise timeoutFault() from None
        return self.remaining

    async def __aexit__(self, *exc: object) -> None:
        self._slots.release()
