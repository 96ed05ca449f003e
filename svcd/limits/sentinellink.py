"""
The limiter's link to a Redis master found through Sentinel (decisions
D16): L{SentinelLink}, a L{svcd.limits.link.RedisLink} whose one
connection goes to whichever server the sentinels name as the master, and
follows a failover without a restart.

It does what Redis's guidelines for Sentinel clients ask: the sentinels
are asked in turn (C{SENTINEL get-master-addr-by-name}), the first to
answer is asked first next time, and the server named is asked C{ROLE}
before the first command: one that says it is a replica is never used.
When the connection is lost (Sentinel itself closes the clients of a
master it demotes), when a command answers C{READONLY}, or when a sentinel
announces C{+switch-master}, the connection is dropped and the sentinels
asked again, at once and then every C{maxRetryDelay} at most.

While no master is known the link says it is not L{connected}: the
limiter then lets requests through unchecked and counts them (decisions
D12 amended, reason C{redis_unavailable}). A command is never queued for
a master to come: txredisapi's factory would, so this link drives
txredisapi's protocol itself, one connection at a time.

txredisapi has a C{Sentinel} of its own; it is not used because it asks
every sentinel for its whole C{SENTINEL MASTERS} table at once and takes
the first answer, waits ten seconds for a master, connects without TLS
and with the global reactor, and does not notice a C{READONLY} answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import txredisapi
from twisted.internet.defer import CancelledError, Deferred, fail, maybeDeferred, succeed
from twisted.internet.endpoints import HostnameEndpoint, connectProtocol, wrapClientTLS
from twisted.internet.interfaces import IDelayedCall, IReactorTCP, IStreamClientEndpoint
from twisted.internet.ssl import Certificate, optionsForClientTLS, platformTrust
from twisted.logger import Logger
from twisted.python.failure import Failure

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.config import SentinelTarget
from svcd.common.deferreds import timeoutDeferred
from svcd.common.logthrottle import ThrottledWarning
from svcd.limits.link import RedisLink

# What a sentinel without a password of its own answers an AUTH: the
# sentinels then take the connection without one (the URL's password is
# the master's, and the sentinels' when they have one).
_NO_PASSWORD_SET = ("without any password configured", "no password is set")


class NotMaster(Exception):
    """
    The server the sentinels named is not (or no longer) a master.
    """


class NoMasterKnown(Exception):
    """
    No master is known now: the sentinels are being asked.
    """


class SentinelLink(RedisLink):
    """
    One connection to the master of a Sentinel group (see the module
    docstring), with the same operations as L{RedisLink}.

    It shares L{RedisLink}'s operations (each a script, through
    L{_eval}) but not its connection, so it does not call
    C{RedisLink.__init__}.

    @ivar masters: masters connected to so far (the first, then one per
        failover followed).
    @ivar replicasRefused: servers named by a sentinel that said they were
        replicas, and were not used.
    @ivar readOnlyAnswers: commands a server answered C{READONLY} (the
        connection was then dropped).
    """

    log = Logger()

    # The sentinels are asked again at once when the master is lost, then
    # after 50 ms, doubling up to this: a new master is in use within this
    # much of a sentinel naming it, even when no +switch-master came.
    maxRetryDelay = 0.5
    firstRetryDelay = 0.05

    def __init__(
        self,
        reactor: IReactorTCP,
        clock: Clock,
        target: SentinelTarget,
        connectTimeout: float = 1.0,
        replyTimeout: float = 2.0,
        askTimeout: float = 0.5,
    ) -> None:
        self._reactor = reactor
        self._clock = clock
        self._sentinelTarget = target
        self._connectTimeout = connectTimeout
        self._replyTimeout = replyTimeout
        self._askTimeout = askTimeout
        # The sentinels in the order they are asked: one that answered
        # goes first.
        self._sentinels = list(target.sentinels)
        self._trustRoot: Any = None
        if target.tls:
            self._trustRoot = (
                Certificate.loadPEM(target.caPEM) if target.caPEM is not None else platformTrust()
            )
        self._running = False
        self._master: txredisapi.RedisProtocol | None = None
        self._masterAddress: tuple[str, int] | None = None
        self._finding: Deferred[None] | None = None
        self._retry: IDelayedCall | None = None
        self._attempts = 0
        self._watch: txredisapi.SubscriberProtocol | None = None
        self._watching: Deferred[None] | None = None
        self._trouble = ThrottledWarning(self.log, clock, 10.0)
        self._listeners: list[Callable[[], None]] = []
        self.masters = 0
        self.replicasRefused = 0
        self.readOnlyAnswers = 0

    @property
    def connected(self) -> bool:
        master = self._master
        return master is not None and bool(master.connected)

    @property
    def masterAddress(self) -> tuple[str, int] | None:
        """
        The master in use, or None while none is known.
        """
        return self._masterAddress if self.connected else None

    def onMaster(self, listener: Callable[[], None]) -> None:
        """
        Call C{listener} each time a master is found (at start, and after
        each failover followed).
        """
        self._listeners.append(listener)

    def start(self) -> None:
        self._running = True
        self._find()

    def stop(self) -> Deferred[None]:
        self._running = False
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        for pending in (self._finding, self._watching):
            if pending is not None:
                pending.cancel()
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.transport.loseConnection()
        master, self._master = self._master, None
        if master is None or not master.connected:
            return succeed(None)
        gone: Deferred[Any] = master.whenDisconnected()
        master.transport.loseConnection()
        return gone.addCallback(lambda _: None)

    # The operations (RedisLink's), on the master in use.

    def _eval(self, script: str, keys: list[str], arguments: list[Any]) -> Deferred[Any]:
        return self._command(lambda master: master.eval(script, keys, arguments))

    def ping(self) -> Deferred[object]:
        return self._command(lambda master: master.ping())

    def _command(self, send: Callable[[txredisapi.RedisProtocol], Deferred[Any]]) -> Deferred[Any]:
        master = self._master
        if master is None:
            return fail(NoMasterKnown("no Redis master is known; the sentinels are being asked"))
        sent: Deferred[Any] = maybeDeferred(send, master)
        return sent.addErrback(self._refused, master)

    def _refused(self, failure: Failure, master: txredisapi.RedisProtocol) -> Failure:
        """
        A server that answers READONLY is a replica now (its master was
        demoted with the connection still open): drop it and ask the
        sentinels again. The command fails as any failed command does.
        """
        if failure.check(txredisapi.ResponseError) and _isReadOnly(failure.value):
            self.readOnlyAnswers += 1
            if master is self._master:
                self.log.warn(
                    "The Redis master {address} answered READONLY: it is a replica now;"
                    " asking the sentinels for the new master",
                    address=_shown(self._masterAddress),
                )
                self._drop()
        return failure

    # Finding the master.

    def _drop(self) -> None:
        """
        Stop using the master, and find it again.
        """
        master, self._master = self._master, None
        if master is not None:
            master.transport.abortConnection()
        self._attempts = 0
        self._find()

    def _find(self) -> None:
        """
        Ask the sentinels now, unless that is under way already.
        """
        if not self._running or self._finding is not None or self._master is not None:
            return
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        finding = self._finding = Deferred.fromCoroutine(self._findOnce())
        finding.addBoth(self._found)

    async def _findOnce(self) -> None:
        """
        Ask each sentinel in turn for the master's address until one names
        a server that says it is the master; use it.
        """
        problems: list[str] = []
        tried: set[tuple[str, int]] = set()
        for sentinel in list(self._sentinels):
            try:
                address = await self._ask(sentinel)
            except CancelledError:
                raise
            except Exception as error:
                problems.append(f"sentinel {_shown(sentinel)}: {_describe(error)}")
                continue
            if address is None:
                problems.append(f"sentinel {_shown(sentinel)} knows no such master")
                continue
            # The first sentinel that answers is asked first next time.
            self._sentinels.remove(sentinel)
            self._sentinels.insert(0, sentinel)
            if address in tried:
                continue
            tried.add(address)
            try:
                master = await self._connectMaster(address)
            except CancelledError:
                raise
            except Exception as error:
                problems.append(f"master {_shown(address)}: {_describe(error)}")
                continue
            if master.connected:
                self._use(master, address, sentinel)
                return
            problems.append(f"master {_shown(address)}: closed the connection")
        raise NoMasterKnown("; ".join(problems))

    def _found(self, result: object) -> None:
        self._finding = None
        if not isinstance(result, Failure):
            self._attempts = 0
            return
        if result.check(CancelledError) or not self._running:
            return
        self._trouble.warn(
            "No Redis master found through the sentinels ({problems}); requests go on"
            " without rate limits or budgets until one is, asked again within {delay} s",
            problems=result.getErrorMessage(),
            delay=self.maxRetryDelay,
        )
        delay = min(self.maxRetryDelay, self.firstRetryDelay * 2**self._attempts)
        self._attempts += 1
        self._retry = self._clock.callLater(delay, self._find)

    def _use(
        self,
        master: txredisapi.RedisProtocol,
        address: tuple[str, int],
        sentinel: tuple[str, int],
    ) -> None:
        if not self._running:
            master.transport.loseConnection()
            return
        previous = self._masterAddress
        self._master = master
        self._masterAddress = address
        self.masters += 1
        master.whenDisconnected().addCallback(self._lost)
        if previous is None or previous != address:
            self.log.info(
                "Using the Redis master {address}, named by the sentinel {sentinel}",
                address=_shown(address),
                sentinel=_shown(sentinel),
            )
        self._watchSentinel(sentinel)
        for listener in self._listeners:
            listener()

    def _lost(self, master: txredisapi.RedisProtocol) -> None:
        if master is not self._master:
            return
        self._master = None
        if self._running:
            self.log.warn(
                "Lost the connection to the Redis master {address}; requests go on without"
                " rate limits or budgets while the sentinels are asked for the master",
                address=_shown(self._masterAddress),
            )
            self._find()

    async def _ask(self, sentinel: tuple[str, int]) -> tuple[str, int] | None:
        """
        The master's address as C{sentinel} knows it (None: it knows no
        master of that name), within C{askTimeout}.
        """
        asking = Deferred.fromCoroutine(self._askOnce(sentinel))
        return await timeoutDeferred(asking, self._askTimeout, asReactorTime(self._clock))

    async def _askOnce(self, sentinel: tuple[str, int]) -> tuple[str, int] | None:
        protocol = await self._connect(sentinel, txredisapi.RedisProtocol)
        try:
            await self._authenticate(protocol, sentinel=True)
            reply = await protocol.sentinel_get_master_addr_by_name(self._sentinelTarget.masterName)
        finally:
            protocol.transport.loseConnection()
        if not reply:
            return None
        host, port = reply[0], reply[1]
        return (host.decode() if isinstance(host, bytes) else str(host)), int(port)

    async def _connectMaster(self, address: tuple[str, int]) -> txredisapi.RedisProtocol:
        """
        A connection to C{address}, authenticated, asked C{ROLE} (a replica
        is refused: L{NotMaster}) and on the target's database.
        """
        master = await self._connect(address, txredisapi.RedisProtocol)
        try:
            await self._authenticate(master, sentinel=False)
            role = await master.role()
            if not role or _text(role[0]) != "master":
                self.replicasRefused += 1
                raise NotMaster(f"it says it is a {_text(role[0]) if role else 'nothing'}")
            if self._sentinelTarget.db:
                await master.select(self._sentinelTarget.db)
        except BaseException:
            master.transport.abortConnection()
            raise
        return master

    async def _connect(self, address: tuple[str, int], kind: type[Any]) -> Any:
        host, port = address
        endpoint: IStreamClientEndpoint = HostnameEndpoint(
            self._reactor, host, port, timeout=self._connectTimeout
        )
        if self._trustRoot is not None:
            endpoint = wrapClientTLS(optionsForClientTLS(host, trustRoot=self._trustRoot), endpoint)
        return await connectProtocol(endpoint, kind(replyTimeout=self._replyTimeout))

    async def _authenticate(self, protocol: txredisapi.RedisProtocol, sentinel: bool) -> None:
        target = self._sentinelTarget
        if target.password is None:
            return
        try:
            reply = await protocol.auth(target.password, target.username)
            if isinstance(reply, Exception):
                raise reply
        except txredisapi.ResponseError as error:
            if sentinel and any(text in str(error) for text in _NO_PASSWORD_SET):
                return
            raise

    # +switch-master: a sentinel tells at once of a failover, before the
    # old master's connection is closed or answers READONLY.

    def _watchSentinel(self, sentinel: tuple[str, int]) -> None:
        if (self._watch is not None and self._watch.connected) or self._watching is not None:
            return
        watching = self._watching = Deferred.fromCoroutine(self._subscribe(sentinel))
        watching.addBoth(self._subscribed)

    async def _subscribe(self, sentinel: tuple[str, int]) -> None:
        watch = await self._connect(sentinel, _SwitchWatch)
        try:
            await self._authenticate(watch, sentinel=True)
            watch.switched = self._switched
            await watch.subscribe("+switch-master")
        except BaseException:
            watch.transport.abortConnection()
            raise
        if not self._running:
            watch.transport.loseConnection()
            return
        self._watch = watch

    def _subscribed(self, result: object) -> None:
        self._watching = None
        if isinstance(result, Failure) and not result.check(CancelledError):
            # Not needed to follow a failover, only quicker: the next master
            # found tries again.
            self.log.info(
                "Could not subscribe to a sentinel's +switch-master ({error})",
                error=result.getErrorMessage(),
            )

    def _switched(self, message: str) -> None:
        """
        C{+switch-master}: C{<name> <old ip> <old port> <new ip> <new port>}.
        """
        words = message.split()
        if len(words) != 5 or words[0] != self._sentinelTarget.masterName:
            return
        if self._master is None:
            # Lost, and being looked for: ask now rather than at the next
            # retry.
            self._attempts = 0
            self._find()
        elif self._masterAddress != (words[3], _port(words[4])):
            self.log.info(
                "A sentinel announced a new Redis master {address}; switching to it",
                address=f"{words[3]}:{words[4]}",
            )
            self._drop()


class _SwitchWatch(txredisapi.SubscriberProtocol):  # type: ignore[misc]
    """
    A subscription to a sentinel's C{+switch-master} channel.
    """

    switched: Callable[[str], None] | None = None

    def messageReceived(self, pattern: object, channel: object, message: object) -> None:
        if self.switched is not None:
            self.switched(_text(message))


def _isReadOnly(error: object) -> bool:
    # Redis says READONLY for a command, and (7.0) for a write inside a
    # script, whose message then carries the script's name after it.
    return str(error).lstrip("-").startswith("READONLY")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _port(text: str) -> int:
    return int(text) if text.isascii() and text.isdigit() else -1


def _shown(address: tuple[str, int] | None) -> str:
    if address is None:
        return "-"
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
