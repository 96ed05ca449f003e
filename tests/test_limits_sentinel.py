"""
The limiter's link to a Redis master found through Sentinel (decisions
D16, L{svcd.limits.sentinellink}): the C{redis+sentinel://} URL, a server
that says it is a replica never used, a READONLY answer dropping the
connection, each sentinel tried in turn, and, with real sentinels
(Debian's redis-sentinel), a master killed under load followed without a
restart and checked again within a second of the new master answering.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import pytest_twisted
import trustme
from limitshelpers import waitFor
from twisted.internet import protocol
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.ssl import PrivateCertificate
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from svcd.common.config import (
    ConfigError,
    RedisTarget,
    SentinelTarget,
    parseRedisTarget,
)
from svcd.devkit.redis import RedisServer
from svcd.devkit.sentinel import SentinelGroup, command, info
from svcd.devkit.servers import LOOPBACK, MissingBinaries, freePort
from svcd.limits.calls import UNCHECKED_REASONS
from svcd.limits.limiter import RedisRateLimiter, makeRateLimiter
from svcd.limits.sentinellink import SentinelLink
from svcd.proxy.config import ProxyConfig
from svcd.proxy.tap import Options
from svcd.worker.config import WorkerConfig

# The URL forms, and what each malformed one says.


def test_sentinelURLs() -> None:
    """
    C{redis+sentinel://} names the sentinels (port 26379 by default) and
    the master; the user and password, the database and TLS are optional.
    C{redis://} is parsed as before.
    """
    assert parseRedisTarget("redis+sentinel://a:1,b,[::1]:3/main") == SentinelTarget(
        (("a", 1), ("b", 26379), ("::1", 3)), "main"
    )
    parsed = parseRedisTarget("rediss+sentinel://svc:s%40cret@a:1/my%20master?db=3")
    assert parsed == SentinelTarget(
        (("a", 1),), "my master", db=3, password="s@cret", username="svc", tls=True
    )
    assert parseRedisTarget("redis+sentinel://:pw@a:1/m") == SentinelTarget(
        (("a", 1),), "m", password="pw"
    )
    assert "pw" not in repr(parseRedisTarget("redis+sentinel://:pw@a:1/m"))
    assert parseRedisTarget("redis://u:p@h:1/3") == RedisTarget("h", 1, 3, "p", "u")


def test_sentinelCertificateAuthority(tmp_path: Path) -> None:
    """
    With TLS, C{ca=} names a PEM file read at start; a file that cannot be
    read is a configuration error, and so is C{ca=} without TLS.
    """
    pem = tmp_path / "ca.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    parsed = parseRedisTarget(f"rediss+sentinel://a:1/m?ca={pem}")
    assert isinstance(parsed, SentinelTarget) and parsed.caPEM == pem.read_bytes()
    with pytest.raises(ConfigError, match="ca: cannot read"):
        parseRedisTarget(f"rediss+sentinel://a:1/m?ca={tmp_path / 'missing.pem'}")
    with pytest.raises(ConfigError, match="unknown parameter 'ca'"):
        parseRedisTarget(f"redis+sentinel://a:1/m?ca={pem}")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+sentinel://a:1", "must name the master"),
        ("redis+sentinel://a:1/", "must name the master"),
        ("redis+sentinel:///m", "needs one or more sentinels"),
        ("redis+sentinel://a:1,,b:2/m", "needs one or more sentinels"),
        ("redis+sentinel://a:1/m/x", "the master's name alone"),
        ("redis+sentinel://a:x/m", "the port must be a number"),
        ("redis+sentinel://a:0/m", "the port must be a number"),
        ("redis+sentinel://a:65536/m", "the port must be a number"),
        ("redis+sentinel://a:/m", "is not a host:port address"),
        ("redis+sentinel://[::1/m", "is not a host:port address"),
        ("redis+sentinel://a:1:2/m", "is not a host:port address"),
        ("redis+sentinel://a:1/m?db=x", "db must be a database number"),
        ("redis+sentinel://a:1/m?db=1&db=2", "db is given twice"),
        ("redis+sentinel://a:1/m?timeout=1", "unknown parameter 'timeout'"),
        ("redis+sentinel://a:1/m?db", "the query must be such as"),
        ("redis+sentinel://a:1/m#x", "must not have a fragment"),
        ("redis+sentinel://a 1/m", "must not contain spaces"),
        ("redis+sentinel://user@a:1/m", "a user needs a password"),
        ("redis+sentinel:a:1/m", "must be a URL such as redis+sentinel://"),
    ],
)
def test_malformedSentinelURLs(url: str, problem: str) -> None:
    """
    Every malformed form is one line naming REDIS_URL and what is wrong.
    """
    with pytest.raises(ConfigError) as caught:
        parseRedisTarget(url)
    assert caught.value.variable == "REDIS_URL"
    assert problem in caught.value.problem
    assert "\n" not in str(caught.value)


def test_daemonsTakeSentinelURLs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """
    svc-proxy and svc-worker read a Sentinel C{REDIS_URL}; a malformed one
    stops svc-proxy with one line naming the variable.
    """
    url = "redis+sentinel://:pw@10.0.0.1,10.0.0.2:26380/main?db=2"
    expected = SentinelTarget(
        (("10.0.0.1", 26379), ("10.0.0.2", 26380)), "main", db=2, password="pw"
    )
    proxy = ProxyConfig.fromEnvironment({"SVC_AUTH_GRPC_ADDR": "a:1", "REDIS_URL": url})
    assert proxy.redis == expected
    providers = tmp_path / "providers.toml"
    providers.write_text(
        '[[providers]]\nname = "p"\nbase_url = "http://127.0.0.1:9/v1"\n\n'
        '[[models]]\nname = "embed"\nprovider = "p"\nkind = "embedding"\n\n'
        '[memory]\nembedding_model = "embed"\n'
    )
    worker = WorkerConfig.fromEnvironment(
        {
            "SVC_MEMORY_GRPC_ADDR": "a:2",
            "SVC_AUTH_GRPC_ADDR": "a:1",
            "SVC_PROVIDERS_FILE": str(providers),
            "REDIS_URL": url,
        }
    )
    assert worker.redis == expected
    options = Options(environ={"SVC_AUTH_GRPC_ADDR": "a:1", "REDIS_URL": "redis+sentinel://a"})
    with pytest.raises(SystemExit):
        options.parseOptions([])
    assert capsys.readouterr().err == (
        "svc-proxy: configuration error: REDIS_URL: must name the master after the"
        " sentinels, such as redis+sentinel://host:26379,host2:26379/mymaster\n"
    )


def test_theLinkIsChosenByTheURL() -> None:
    """
    A Sentinel URL gives the limiter a L{SentinelLink}; redis:// the plain
    link, as before.
    """
    from twisted.internet import reactor

    target = parseRedisTarget("redis+sentinel://127.0.0.1:1/m")
    limiter = makeRateLimiter(reactor, reactor, target, 60, {})
    assert isinstance(limiter, RedisRateLimiter)
    assert isinstance(limiter._counters, SentinelLink)
    plain = makeRateLimiter(reactor, reactor, parseRedisTarget("redis://127.0.0.1:1/0"), 60, {})
    assert isinstance(plain, RedisRateLimiter)
    assert not isinstance(plain._counters, SentinelLink)


# A sentinel the test controls: which master it names, and whether it has
# a password of its own.


class _FakeSentinel(protocol.Protocol):
    def __init__(self, owner: FakeSentinel) -> None:
        self._owner = owner
        self._buffer = b""

    def dataReceived(self, data: bytes) -> None:
        self._buffer += data
        while True:
            words = self._parse()
            if words is None:
                return
            assert self.transport is not None
            self.transport.write(self._owner.answer(words))

    def _parse(self) -> list[str] | None:
        lines = self._buffer.split(b"\r\n")
        if len(lines) < 2 or not lines[0].startswith(b"*"):
            return None
        count = int(lines[0][1:])
        if len(lines) < 2 * count + 2:
            return None
        words = [lines[2 + 2 * index].decode() for index in range(count)]
        self._buffer = b"\r\n".join(lines[2 * count + 1 :])
        return words


class FakeSentinel(protocol.Factory):
    """
    Answers C{SENTINEL get-master-addr-by-name} with L{address}, and AUTH as
    a sentinel without a password does.
    """

    def __init__(self) -> None:
        self.address: tuple[str, int] | None = None
        self.asked = 0

    def buildProtocol(self, addr: Any) -> _FakeSentinel:
        return _FakeSentinel(self)

    def answer(self, words: list[str]) -> bytes:
        verb = words[0].upper()
        if verb == "AUTH":
            return (
                b"-ERR AUTH <password> called without any password configured for the"
                b" default user. Are you sure your configuration is correct?\r\n"
            )
        if verb == "SENTINEL" and words[1].upper() == "GET-MASTER-ADDR-BY-NAME":
            self.asked += 1
            if self.address is None:
                return b"*-1\r\n"
            host, port = self.address[0].encode(), str(self.address[1]).encode()
            return b"*2\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(host), host, len(port), port)
        if verb == "SUBSCRIBE":
            return b"*3\r\n$9\r\nsubscribe\r\n$14\r\n+switch-master\r\n:1\r\n"
        return b"-ERR unknown command\r\n"


def evalCalls(server: RedisServer, password: str | None = None) -> int:
    """
    EVAL and EVALSHA commands C{server} was sent, answered or refused.
    """
    stats = info(server.port, "commandstats", password=password)
    total = 0
    for name in ("cmdstat_eval", "cmdstat_evalsha"):
        fields = dict(part.split("=") for part in stats.get(name, "calls=0").split(","))
        total += int(fields["calls"]) + int(fields.get("rejected_calls", "0"))
    return total


@pytest.fixture
def twoServers(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    servers = (RedisServer.create(tmp_path / "one"), RedisServer.create(tmp_path / "two"))
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.destroy()


@pytest_twisted.ensureDeferred
async def test_aReplicaIsNeverWrittenTo(twoServers: tuple[RedisServer, RedisServer]) -> None:
    """
    The sentinels are tried in turn (the first is down); a server one names
    that says it is a replica is not used, and no command reaches it; the
    master it names next is used within a retry; a master demoted with the
    connection open answers READONLY, which drops it; the password is the
    master's, and a sentinel without one accepts the connection.
    """
    from twisted.internet import reactor

    one, two = twoServers
    password = "s3cret"
    # "one" is a replica (of a server that is not there); "two" the master.
    command(one.port, "REPLICAOF", LOOPBACK, str(freePort()))
    for server in twoServers:
        command(server.port, "CONFIG", "SET", "requirepass", password)
    fake = FakeSentinel()
    listening = reactor.listenTCP(0, fake, interface=LOOPBACK)  # type: ignore[arg-type]
    closedPort = freePort()
    target = parseRedisTarget(
        f"redis+sentinel://:{password}@{LOOPBACK}:{closedPort},"
        f"{LOOPBACK}:{cast(IPv4Address, listening.getHost()).port}/svcmaster"
    )
    assert isinstance(target, SentinelTarget)
    link = SentinelLink(reactor, reactor, target)
    fake.address = (LOOPBACK, one.port)
    link.start()
    try:
        await waitFor(lambda: link.replicasRefused >= 3)
        assert not link.connected
        assert evalCalls(one, password) == 0
        with pytest.raises(Exception, match="no Redis master is known"):
            await link.increment("k", 1, 60)

        fake.address = (LOOPBACK, two.port)
        switched = time.monotonic()
        await waitFor(lambda: link.connected)
        # Within the longest retry delay, and a loaded machine's margin.
        assert time.monotonic() - switched < link.maxRetryDelay + 0.5
        assert await link.increment("k", 1, 60) == 1
        assert link.masterAddress == (LOOPBACK, two.port)

        # "two" demoted under the open connection: the next write is
        # refused, and the connection dropped.
        command(two.port, "REPLICAOF", LOOPBACK, str(freePort()), password=password)
        with pytest.raises(Exception, match="READONLY"):
            await link.increment("k", 1, 60)
        assert link.readOnlyAnswers == 1
        assert not link.connected
        fake.address = (LOOPBACK, one.port)
        command(one.port, "REPLICAOF", "NO", "ONE", password=password)
        await waitFor(lambda: link.connected)
        assert await link.increment("k", 1, 60) == 1
        assert link.masterAddress == (LOOPBACK, one.port)
    finally:
        await link.stop()
        await maybeDeferred(listening.stopListening)
    assert not link.connected


@pytest_twisted.ensureDeferred
async def test_tlsToTheSentinelsAndTheMaster(tmp_path: Path) -> None:
    """
    C{rediss+sentinel://}: the sentinel and the master are reached over
    TLS, their certificates checked against the authority C{ca=} names;
    with another authority nothing is used.
    """
    from twisted.internet import reactor

    authority, stranger = trustme.CA(), trustme.CA()
    issued = authority.issue_cert(LOOPBACK)
    files = {
        "cert": tmp_path / "cert.pem",
        "key": tmp_path / "key.pem",
        "ca": tmp_path / "ca.pem",
        "stranger": tmp_path / "stranger.pem",
    }
    issued.cert_chain_pems[0].write_to_path(str(files["cert"]))
    issued.private_key_pem.write_to_path(str(files["key"]))
    authority.cert_pem.write_to_path(str(files["ca"]))
    stranger.cert_pem.write_to_path(str(files["stranger"]))
    server = RedisServer.create(tmp_path / "redis")
    server.start()
    tlsPort = freePort()
    for name, value in (
        ("tls-cert-file", files["cert"]),
        ("tls-key-file", files["key"]),
        ("tls-ca-cert-file", files["ca"]),
        ("tls-auth-clients", "no"),
        ("tls-port", tlsPort),
    ):
        assert command(server.port, "CONFIG", "SET", name, str(value)) == b"OK"
    fake = FakeSentinel()
    fake.address = (LOOPBACK, tlsPort)
    identity = PrivateCertificate.loadPEM(files["key"].read_text() + files["cert"].read_text())
    listening = reactor.listenSSL(  # type: ignore[attr-defined]
        0, fake, identity.options(), interface=LOOPBACK
    )
    sentinel = f"{LOOPBACK}:{listening.getHost().port}"
    links = []
    try:
        for ca in ("stranger", "ca"):
            target = parseRedisTarget(f"rediss+sentinel://{sentinel}/svcmaster?ca={files[ca]}")
            assert isinstance(target, SentinelTarget) and target.tls
            link = SentinelLink(reactor, reactor, target)
            links.append(link)
            link.start()
        untrusting, trusting = links
        await waitFor(lambda: trusting.connected)
        assert await trusting.increment("k", 2, 60) == 2
        # The untrusting link asked the sentinel no question: the
        # handshake failed first.
        asked = fake.asked
        await deferLater(reactor, 0.5, lambda: None)
        assert not untrusting.connected
        assert fake.asked == asked
    finally:
        for link in links:
            await link.stop()
        await maybeDeferred(listening.stopListening)
        server.destroy()


# With real sentinels.


@pytest.fixture
def sentinelGroup(tmp_path: Path) -> Iterator[SentinelGroup]:
    """
    A master, a replica and three sentinels; skipped, with the reason,
    where Debian's redis-sentinel is not installed.
    """
    try:
        group = SentinelGroup(tmp_path / "sentinel")
    except MissingBinaries as missing:
        pytest.skip(str(missing))
    try:
        group.start()
        yield group
    finally:
        group.destroy()


class Tally:
    """
    A labelled counter, as C{svc_proxy_unchecked_admissions_total}.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def labels(self, *labelvalues: str) -> Tally._Child:
        (reason,) = labelvalues
        return Tally._Child(self, reason)

    class _Child:
        def __init__(self, tally: Tally, reason: str) -> None:
            self._tally, self._reason = tally, reason

        def inc(self, amount: float = 1) -> None:
            self._tally.counts[self._reason] = self._tally.counts.get(self._reason, 0) + 1


class Load:
    """
    Hits of the limiter one after the other while L{running}: when each was
    sent, and whether it was checked (a decision) or let through unchecked.
    """

    def __init__(self, limiter: RedisRateLimiter) -> None:
        self.limiter = limiter
        self.running = True
        self.hits: list[tuple[float, bool]] = []
        self.orgID = str(uuid.uuid4())

    async def run(self) -> None:
        from twisted.internet import reactor

        while self.running:
            sent = time.monotonic()
            decision = await self.limiter.hit(self.orgID, None)
            self.hits.append((sent, decision is not None))
            await deferLater(reactor, 0.005, lambda: None)

    def checkedSince(self, moment: float) -> list[bool]:
        return [checked for sent, checked in self.hits if sent >= moment]


async def followedFailover(
    group: SentinelGroup, limiter: RedisRateLimiter, link: SentinelLink, tally: Tally
) -> float:
    """
    Under load, SIGKILL the master; return how long after the new master
    answered (a sentinel names it and it says it is the master) the first
    hit was checked again. Every hit from a second after it on is checked.
    """
    loads = [Load(limiter) for _ in range(2)]
    running = [Deferred.fromCoroutine(load.run()) for load in loads]
    try:
        await waitFor(lambda: all(sum(c for _, c in load.hits) >= 20 for load in loads))
        old = group.master()
        assert link.masterAddress == (LOOPBACK, old.port)
        group.kill(old)
        killed = time.monotonic()
        newPort = await deferToThread(group.waitForFailover, old.port, 30.0)
        answered = time.monotonic()
        await waitFor(lambda: all(any(load.checkedSince(answered + 1.5)) for load in loads))
    finally:
        for load in loads:
            load.running = False
        for each in running:
            await each
    assert link.masterAddress == (LOOPBACK, newPort)
    hits = [hit for load in loads for hit in load.hits]
    # The window: hits let through unchecked, counted by reason.
    assert any(not checked for sent, checked in hits if killed <= sent < answered)
    assert sum(tally.counts.values()) == sum(1 for _, checked in hits if not checked)
    assert set(tally.counts) <= set(UNCHECKED_REASONS)
    # Checked again within a second of the new master answering.
    assert all(checked for sent, checked in hits if sent >= answered + 1.0), [
        (round(sent - answered, 3), checked) for sent, checked in hits if sent >= answered
    ]
    return min(sent for sent, checked in hits if checked and sent >= killed) - answered


@pytest_twisted.ensureDeferred
async def test_aKilledMasterIsFollowed(sentinelGroup: SentinelGroup) -> None:
    """
    With one sentinel down the link finds the master through the others
    and every hit is checked; the master SIGKILLed under load, the
    sentinels promote the replica and the link follows it without a
    restart: hits go on unchecked (counted) meanwhile, and are checked
    again within a second of the new master answering. No command ever
    reached the replica before it was promoted.
    """
    from twisted.internet import reactor

    group = sentinelGroup
    group.sentinels[0].stop()
    target = parseRedisTarget(group.url)
    assert isinstance(target, SentinelTarget)
    link = SentinelLink(reactor, reactor, target)
    tally = Tally()
    limiter = RedisRateLimiter(link, reactor, 10**9, {}, timeout=2.0, unchecked=tally)
    replica = group.servers[1]
    limiter.start()
    try:
        await waitFor(lambda: link.connected)
        for _ in range(20):
            assert await limiter.hit(str(uuid.uuid4()), None) is not None
        assert tally.counts == {}
        assert evalCalls(replica) == 0
        delay = await followedFailover(group, limiter, link, tally)
        assert delay < 1.0
        assert group.master() is replica
        assert link.masters == 2
        # Every EVAL the promoted server got came after it was promoted:
        # none was refused READONLY, nor failed.
        stats = info(replica.port, "commandstats")
        for name in ("cmdstat_eval", "cmdstat_evalsha"):
            if name in stats:
                assert "rejected_calls=0,failed_calls=0" in stats[name], stats[name]
        assert evalCalls(replica) > 0
        assert link.readOnlyAnswers == 0
    finally:
        await limiter.stop()


@pytest_twisted.ensureDeferred
async def test_aGracefulFailoverIsFollowed(sentinelGroup: SentinelGroup) -> None:
    """
    SENTINEL FAILOVER demotes a live master: the link leaves it (the
    sentinels close its clients and announce +switch-master) and follows
    the new one; checked again within a second, and the demoted server
    gets no command from a second after the new master answered.
    """
    from twisted.internet import reactor

    group = sentinelGroup
    target = parseRedisTarget(group.url)
    assert isinstance(target, SentinelTarget)
    link = SentinelLink(reactor, reactor, target)
    tally = Tally()
    limiter = RedisRateLimiter(link, reactor, 10**9, {}, timeout=2.0, unchecked=tally)
    limiter.start()
    old = group.master()
    loads = [Load(limiter) for _ in range(2)]
    running: list[Deferred[None]] = []
    try:
        await waitFor(lambda: link.connected)
        running = [Deferred.fromCoroutine(load.run()) for load in loads]
        await waitFor(lambda: all(sum(c for _, c in load.hits) >= 20 for load in loads))
        assert command(group.sentinels[0].port, "SENTINEL", "FAILOVER", "svcmaster") == b"OK"
        newPort = await deferToThread(group.waitForFailover, old.port, 30.0)
        answered = time.monotonic()
        await deferLater(reactor, 1.0, lambda: None)
        evalsOnOld = evalCalls(old)
        await waitFor(lambda: all(any(load.checkedSince(answered + 2.0)) for load in loads))
        assert link.masterAddress == (LOOPBACK, newPort)
    finally:
        for load in loads:
            load.running = False
        for each in running:
            await each
        await limiter.stop()
    assert evalCalls(old) == evalsOnOld
    hits = [hit for load in loads for hit in load.hits]
    assert all(checked for sent, checked in hits if sent >= answered + 1.0), (
        tally.counts,
        [round(sent - answered, 3) for sent, checked in hits if not checked],
    )
    assert newPort != old.port
