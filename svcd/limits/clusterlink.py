"""
The limiter's connection to a Redis Cluster (decisions D16):
L{ClusterLink}, the Redis operations of L{svcd.limits.link.RedisCounters}
sent each to the master of its keys' hash slot, and L{keySlot}, Redis
Cluster's slot of a key.

Every script call of the limiter keeps to one slot: an organization's keys
carry it in braces, the hash tag (L{svcd.limits.keys}), and the parts that
could mix organizations split their calls per slot with L{ClusterLink.slotOf}
(L{svcd.limits.link.keySlots}). So a Cluster runs the same scripts as a
single server, atomically, with no cross-slot call.

The slot map comes from CLUSTER SLOTS, asked of any node that answers (the
URL's at first); it is asked again every few seconds, every half second
while a master is not connected (until a replica has taken over), and
after a MOVED reply, whose call is sent once more to the node named. An
ASK reply (a slot being migrated) sends the call once to the node named,
after ASKING. While a master is down the link is not L{connected}, and
a call of its slots fails at once: the limiter goes on unchecked, counted,
as for a single server down (decisions D12, amended).
"""

from __future__ import annotations

import math
from typing import Any, cast

import txredisapi
from twisted.internet.defer import Deferred, fail, gatherResults
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IReactorTCP
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.config import RedisTarget
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
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

SLOTS = 16384


def _crcTable() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return table


_CRC_TABLE = _crcTable()


def crc16(data: bytes) -> int:
    """
    CRC-16/XMODEM, the checksum of Redis Cluster's key slots.
    """
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC_TABLE[(crc >> 8) ^ byte]
    return crc


def _hashTag(key: str) -> str:
    """
    The part of C{key} that Redis Cluster hashes: between the first C{{}
    and the first C{}} after it when that is not empty, else the whole.
    """
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def keySlot(key: str) -> int:
    """
    Redis Cluster's hash slot of C{key}.
    """
    return crc16(_hashTag(key).encode("utf-8")) % SLOTS


class _Node:
    """
    One node's reconnecting txredisapi connection.
    """

    def __init__(self, address: tuple[str, int], factory: Any) -> None:
        self.address = address
        self.factory = factory

    @property
    def connected(self) -> bool:
        return bool(self.factory.size > 0)

    def connection(self) -> Any:
        """
        The protocol of the live connection, or None.
        """
        for protocol in self.factory.pool:
            if protocol.connected:
                return protocol
        return None


class ClusterLink:
    """
    One reconnecting txredisapi connection to each master of a Redis
    Cluster (and to the URL's nodes, to ask for the slots), and the map
    of which master serves each slot.

    As L{svcd.limits.link.RedisLink}, a call whose master is not connected
    fails at once instead of waiting in txredisapi's queue, so that the
    limiter fails open at once.
    """

    log = Logger()

    maxReconnectDelay = 2.0
    # Seconds between two readings of the slot map while all goes well,
    # and at least between two readings asked for by failed calls.
    refreshInterval = 5.0
    minRefreshInterval = 0.5
    _tick = 0.25

    def __init__(
        self,
        reactor: IReactorTCP,
        target: RedisTarget,
        connectTimeout: float = 1.0,
        replyTimeout: float = 2.0,
    ) -> None:
        self._reactor = reactor
        # The reactor provides IReactorTime as well.
        self._clock = cast(Clock, reactor)
        self._target = target
        self._connectTimeout = connectTimeout
        self._replyTimeout = replyTimeout
        self._seeds = frozenset(target.clusterNodes or ((target.host, target.port),))
        self._nodes: dict[tuple[str, int], _Node] = {}
        self._slots: list[_Node | None] = [None] * SLOTS
        self._masters: list[_Node] = []
        self._mapped = False
        self._stale = True
        self._lastRefresh = -math.inf
        self._refreshing: Deferred[None] | None = None
        self._unanswered = ThrottledWarning(self.log, self._clock, 10.0)
        self._loop: LoopingCall | None = None
        self._running = False
        # Hash tag -> slot: an organization's slot, worked out once.
        self._tagSlots: dict[str, int] = {}
        # Calls sent again after a MOVED or an ASK reply (tests and
        # operators' curiosity).
        self.redirected = {"MOVED": 0, "ASK": 0}

    @property
    def connected(self) -> bool:
        """
        The slot map is known and every master in it is connected: while
        one is not, the limiter goes on unchecked as for a single server
        down (its breaker is one for all masters: the calls of the others
        would not be checked for long either), and the map is read again
        every half second until a replica has taken over.
        """
        return self._mapped and all(node.connected for node in self._masters)

    def slotOf(self, key: str) -> int:
        """
        The hash slot of C{key} (L{svcd.limits.link.keySlots}).
        """
        tag = _hashTag(key)
        slot = self._tagSlots.get(tag)
        if slot is None:
            if len(self._tagSlots) >= 65536:
                self._tagSlots.clear()
            slot = self._tagSlots[tag] = crc16(tag.encode("utf-8")) % SLOTS
        return slot

    def addressOf(self, key: str) -> tuple[str, int] | None:
        """
        The master that serves C{key}'s slot, as the map says.
        """
        node = self._slots[self.slotOf(key)]
        return None if node is None else node.address

    def mastersUp(self) -> dict[tuple[str, int], bool]:
        """
        Each master of the map, and whether it is connected.
        """
        return {node.address: node.connected for node in self._masters}

    def start(self) -> None:
        self._running = True
        for address in sorted(self._seeds):
            self._node(address)
        loop = self._loop = LoopingCall(self._maybeRefresh)
        loop.clock = asReactorTime(self._clock)
        loop.start(self._tick, now=False)

    def stop(self) -> Deferred[None]:
        self._running = False
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        nodes, self._nodes = list(self._nodes.values()), {}
        self._masters, self._mapped = [], False
        self._slots = [None] * SLOTS
        done = gatherResults([node.factory.disconnect() for node in nodes], consumeErrors=True)
        return done.addBoth(lambda _: None)

    def _node(self, address: tuple[str, int]) -> _Node:
        node = self._nodes.get(address)
        if node is not None:
            return node
        host, port = address
        factory = txredisapi.RedisFactory(
            f"{host}:{port}",
            # No SELECT: a Cluster has database 0 only.
            None,
            1,
            isLazy=True,
            password=self._target.password,
            username=self._target.username,
            replyTimeout=self._replyTimeout,
        )
        factory.maxDelay = self.maxReconnectDelay
        factory.startConnecting(
            HostnameEndpoint(self._reactor, host, port, timeout=self._connectTimeout)
        )
        node = self._nodes[address] = _Node(address, factory)
        if factory.deferred is not None:
            # Connected: the map is asked for at once if still unknown.
            factory.deferred.addCallbacks(lambda _: self._maybeRefresh(), lambda _: None)
        return node

    # The slot map.

    def _maybeRefresh(self) -> None:
        if self._refreshing is not None or not self._running:
            return
        since = self._clock.seconds() - self._lastRefresh
        if since < self.minRefreshInterval:
            return
        if not self._stale and any(not node.connected for node in self._masters):
            self._stale = True
        if self._mapped and not self._stale and since < self.refreshInterval:
            return
        refreshing = self._refreshing = Deferred.fromCoroutine(self._refresh())
        refreshing.addErrback(self._refreshFailed)
        refreshing.addBoth(self._refreshed)

    def _refreshed(self, result: object) -> None:
        self._refreshing = None

    def _refreshFailed(self, failure: Any) -> None:
        self.log.failure("Reading the Redis Cluster's slot map failed", failure)

    async def _refresh(self) -> None:
        """
        Ask the masters (then the other nodes) for the slot map, the first
        that answers.
        """
        masters = set(self._masters)
        candidates = self._masters + [n for n in self._nodes.values() if n not in masters]
        failed: Exception | None = None
        for node in candidates:
            protocol = node.connection()
            if protocol is None:
                continue
            # Not before a node could be asked: a start asks at once.
            self._lastRefresh = self._clock.seconds()
            try:
                reply = await timeoutDeferred(
                    protocol.execute_command("CLUSTER", "SLOTS"),
                    self._replyTimeout,
                    asReactorTime(self._clock),
                )
            except Exception as error:
                failed = error
                continue
            if reply and self._running:
                self._apply(reply, node.address[0])
                return
        if failed is not None:
            self._unanswered.warn(
                "No node of the Redis Cluster told its slot map ({error_type}); asked again"
                " within a second",
                error_type=type(failed).__name__,
            )

    def _apply(self, reply: list[Any], askedHost: str) -> None:
        slots: list[_Node | None] = [None] * SLOTS
        masters: dict[tuple[str, int], _Node] = {}
        for entry in reply:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            if host in ("", "?"):
                # The node does not know its own address: the one asked.
                host = askedHost
            node = self._node((host, int(master[1])))
            masters[node.address] = node
            slots[start : end + 1] = [node] * (end + 1 - start)
        self._slots = slots
        self._masters = list(masters.values())
        self._mapped = True
        self._stale = False
        # Nodes that left (a master failed over, and gone): no more
        # reconnecting to them; the URL's stay, to ask for the map.
        for address, node in list(self._nodes.items()):
            if address not in masters and address not in self._seeds:
                del self._nodes[address]
                node.factory.disconnect().addErrback(lambda _: None)

    # Calls.

    def _eval(self, script: str, keys: list[str], arguments: list[Any]) -> Deferred[Any]:
        if keys:
            node = self._slots[self.slotOf(keys[0])]
        else:
            node = next((n for n in self._masters if n.connected), None)
        return self._evalOn(node, script, keys, arguments, True)

    def _evalOn(
        self, node: _Node | None, script: str, keys: list[str], arguments: list[Any], again: bool
    ) -> Deferred[Any]:
        if node is None or not node.connected:
            self._stale = True
            return fail(txredisapi.ConnectionError("no connection to the master of the slot"))
        result: Deferred[Any] = node.factory.handler.eval(script, keys, arguments)
        if again:
            result.addErrback(self._redirected, script, keys, arguments)
        return result

    def _redirected(self, failure: Any, script: str, keys: list[str], arguments: list[Any]) -> Any:
        """
        A MOVED or ASK reply: the call sent once more where it says.
        """
        failure.trap(txredisapi.ResponseError)
        kind, _, rest = str(failure.value).partition(" ")
        if kind not in ("MOVED", "ASK") or not self._running:
            return failure
        slotText, _, address = rest.partition(" ")
        host, _, portText = address.rpartition(":")
        try:
            slot, port = int(slotText), int(portText)
        except ValueError:
            return failure
        node = self._node((host.strip("[]"), port))
        self.redirected[kind] += 1
        if kind == "MOVED":
            self._slots[slot] = node
            self._stale = True
            return self._evalOn(node, script, keys, arguments, False)
        protocol = node.connection()
        if protocol is None:
            return fail(txredisapi.ConnectionError("no connection to the node asked"))
        # ASKING holds for the next command on this connection: both are
        # written at once, nothing comes between.
        protocol.execute_command("ASKING").addErrback(lambda _: None)
        asked: Deferred[Any] = protocol.execute_command(
            "EVAL", script, len(keys), *keys, *arguments
        )
        return asked

    def increment(self, key: str, hits: int, ttl: int) -> Deferred[int]:
        return self._eval(INCREMENT_SCRIPT, [key], [ttl, hits])

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
        return self._eval(ADMIT_SCRIPT, keys, packed).addCallback(parseAdmitReply)

    def renew(self, keys: list[str], leaseMs: int, triples: str) -> Deferred[object]:
        return self._eval(RENEW_SCRIPT, keys, [leaseMs, triples])

    def reconcile(self, key: str, t0: int, spent: int, ttl: int) -> Deferred[tuple[int, int, int]]:
        reply = self._eval(RECONCILE_SCRIPT, [key], [t0, spent, ttl])
        return reply.addCallback(parseReconcileReply)

    def redisTime(self, key: str = "") -> Deferred[int]:
        # The key only routes the call to its master, whose time it is.
        return self._eval(TIME_SCRIPT, [key] if key else [], [])

    def adjust(self, keys: list[str], deltas: list[int]) -> Deferred[object]:
        return self._eval(ADJUST_SCRIPT, keys, list(deltas))

    def seed(self, key: str, value: int, ttl: int) -> Deferred[object]:
        return self._eval(SEED_SCRIPT, [key], [value, ttl])

    def ping(self) -> Deferred[object]:
        """
        Every master answers PING (the /ready check: a master down is
        reported).
        """
        if not self._mapped:
            return fail(txredisapi.ConnectionError("the Redis Cluster's slots are not known"))
        down = [node for node in self._masters if not node.connected]
        if down:
            host, port = down[0].address
            return fail(txredisapi.ConnectionError(f"Redis Cluster master {host}:{port} is down"))
        answered: Deferred[object] = Deferred()
        pings = [node.factory.handler.ping() for node in self._masters]
        gatherResults(pings, consumeErrors=True).addCallbacks(answered.callback, answered.errback)
        return answered
