"""
The limiter's connection to Redis: L{RedisCounters}, the Redis operations
the limiter uses (each one call of a script of L{svcd.limits.scripts}, or
PING), L{RedisLink}, the real one over txredisapi, and L{linkFor}, the
link of a target (a Redis Cluster's: L{svcd.limits.clusterlink}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import txredisapi
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IReactorTCP

from svcd.common.config import RedisTarget
from svcd.limits.clusterlink import ClusterLink
from svcd.limits.scripts import (
    ADJUST_SCRIPT,
    ADMIT_SCRIPT,
    INCREMENT_SCRIPT,
    RECONCILE_SCRIPT,
    RENEW_SCRIPT,
    SEED_SCRIPT,
    TIME_SCRIPT,
    LedgerWork,
    packAdmitArguments,
    parseAdmitReply,
    parseReconcileReply,
)


class RedisCounters(Protocol):
    """
    The Redis operations the limiter uses; L{RedisLink} is the real one.
    """

    @property
    def connected(self) -> bool: ...

    def increment(self, key: str, hits: int, ttl: int) -> Deferred[int]:
        """
        Add C{hits} to the counter C{key} (giving a new key C{ttl}
        seconds to live); fires with the count after them.
        """

    def admit(
        self,
        keys: list[str],
        arguments: list[int],
        adjustments: list[int] | None = None,
        ledger: LedgerWork | None = None,
    ) -> Deferred[list[list[int]]]:
        """
        Run the admission script (C{ADMIT_SCRIPT}) over C{keys} with
        C{arguments}; fires with its answer for each request.
        """

    def renew(self, keys: list[str], leaseMs: int, triples: str) -> Deferred[object]:
        """
        Push the leases of members still in flight (C{RENEW_SCRIPT}).
        """

    def reconcile(self, key: str, t0: int, spent: int, ttl: int) -> Deferred[tuple[int, int, int]]:
        """
        Bring a budget's counter back to the ledger (C{RECONCILE_SCRIPT}).
        """

    def redisTime(self, key: str = "") -> Deferred[int]:
        """
        Redis's own time, in ms: of the server holding C{key} (a Redis
        Cluster's nodes each have a clock of their own).
        """

    def adjust(self, keys: list[str], deltas: list[int]) -> Deferred[object]:
        """
        Add each delta to its key, where the key still exists.
        """

    def seed(self, key: str, value: int, ttl: int) -> Deferred[object]:
        """
        Set C{key} to C{value} for C{ttl} seconds unless it exists.
        """

    def ping(self) -> Deferred[object]: ...

    def start(self) -> None: ...

    def stop(self) -> Deferred[None]: ...


def keySlots(counters: object) -> Callable[[str], int] | None:
    """
    The hash slot of a key, for counters each of whose calls must keep to
    one slot (a Redis Cluster's, L{svcd.limits.clusterlink}: they have
    C{slotOf}); None for a single server, where any keys go together.

    The limiter's parts split what they send per slot with it (decisions
    D16): settlements ride only on an admission of their slot, renewals
    and settlements sent alone go in one call per slot. Asked once, when a
    part is made, so that a single server's calls cost nothing more.
    """
    slotOf = getattr(counters, "slotOf", None)
    return slotOf if callable(slotOf) else None


class RedisLink:
    """
    One reconnecting txredisapi connection to Redis.

    txredisapi queues a command made while disconnected until a connection
    comes back; a request must not wait for that, so L{connected} lets the
    limiter fail open at once instead.
    """

    # Reconnect attempts back off up to this many seconds, so the limiter
    # is back within seconds of Redis returning.
    maxReconnectDelay = 2.0

    def __init__(
        self,
        reactor: IReactorTCP,
        target: RedisTarget,
        connectTimeout: float = 1.0,
        replyTimeout: float = 2.0,
    ) -> None:
        self._reactor = reactor
        self._target = target
        self._connectTimeout = connectTimeout
        self._replyTimeout = replyTimeout
        self._factory: Any = None

    @property
    def connected(self) -> bool:
        return self._factory is not None and self._factory.size > 0

    def start(self) -> None:
        factory = txredisapi.RedisFactory(
            f"{self._target.host}:{self._target.port}",
            self._target.db,
            1,
            isLazy=True,
            password=self._target.password,
            username=self._target.username,
            # A reply that never comes means a broken connection: drop it
            # and reconnect rather than queue every later command behind it.
            replyTimeout=self._replyTimeout,
        )
        factory.maxDelay = self.maxReconnectDelay
        factory.startConnecting(
            HostnameEndpoint(
                self._reactor, self._target.host, self._target.port, timeout=self._connectTimeout
            )
        )
        self._factory = factory

    def stop(self) -> Deferred[None]:
        factory, self._factory = self._factory, None
        if factory is None:
            return succeed(None)
        done: Deferred[None] = factory.disconnect()
        return done

    def _eval(self, script: str, keys: list[str], arguments: list[Any]) -> Deferred[Any]:
        """
        Run C{script} (EVALSHA once cached): the one way every operation
        reaches Redis, so that a link over another topology
        (L{svcd.limits.sentinellink}) changes only this.
        """
        result: Deferred[Any] = self._factory.handler.eval(script, keys, arguments)
        return result

    def increment(self, key: str, hits: int, ttl: int) -> Deferred[int]:
        result: Deferred[int] = self._eval(INCREMENT_SCRIPT, [key], [ttl, hits])
        return result

    def admit(
        self,
        keys: list[str],
        arguments: list[int],
        adjustments: list[int] | None = None,
        ledger: LedgerWork | None = None,
    ) -> Deferred[list[list[int]]]:
        packed = [packAdmitArguments(arguments), packAdmitArguments(adjustments or [])]
        if ledger is not None:
            packed += ledger.arguments()
        reply: Deferred[str | bytes] = self._eval(ADMIT_SCRIPT, keys, packed)
        return reply.addCallback(parseAdmitReply)

    def renew(self, keys: list[str], leaseMs: int, triples: str) -> Deferred[object]:
        result: Deferred[object] = self._eval(RENEW_SCRIPT, keys, [leaseMs, triples])
        return result

    def reconcile(self, key: str, t0: int, spent: int, ttl: int) -> Deferred[tuple[int, int, int]]:
        reply: Deferred[str | bytes] = self._eval(RECONCILE_SCRIPT, [key], [t0, spent, ttl])
        return reply.addCallback(parseReconcileReply)

    def redisTime(self, key: str = "") -> Deferred[int]:
        result: Deferred[int] = self._eval(TIME_SCRIPT, [], [])
        return result

    def adjust(self, keys: list[str], deltas: list[int]) -> Deferred[object]:
        result: Deferred[object] = self._eval(ADJUST_SCRIPT, keys, deltas)
        return result

    def seed(self, key: str, value: int, ttl: int) -> Deferred[object]:
        result: Deferred[object] = self._eval(SEED_SCRIPT, [key], [value, ttl])
        return result

    def ping(self) -> Deferred[object]:
        result: Deferred[object] = self._factory.handler.ping()
        return result


def linkFor(reactor: IReactorTCP, target: RedisTarget) -> RedisCounters:
    """
    The link to C{target}: to each master of a Redis Cluster
    (redis+cluster://, decisions D16), else to one server.
    """
    if target.clusterNodes:
        return ClusterLink(reactor, target)
    return RedisLink(reactor, target)
