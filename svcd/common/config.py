"""
Reading configuration from the environment.

Every daemon reads its whole configuration once, at start, through these
helpers; a bad value raises L{ConfigError} naming the variable, which the
tap turns into one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping

import attrs

# ASCII digits only: \d also matches other scripts' digits, which float()
# reads (a fullwidth "5s", U+FF15 "s", would be five seconds).
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m)?\s*$")


def _isDecimal(raw: str) -> bool:
    """
    Only ASCII digits: str.isdigit() also accepts characters such as "²"
    that int() then refuses.
    """
    return raw.isascii() and raw.isdigit()


class ConfigError(Exception):
    """
    A configuration variable is missing or has a value we cannot use.
    """

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"{variable}: {problem}")
        self.variable = variable
        self.problem = problem


def text(environ: Mapping[str, str], name: str, default: str) -> str:
    """
    A string variable; an unset variable takes C{default}.
    """
    return environ.get(name, default).strip()


def required(environ: Mapping[str, str], name: str) -> str:
    """
    A variable that must be set to a non-empty value.
    """
    value = environ.get(name, "").strip()
    if not value:
        raise ConfigError(name, "is required and not set")
    return value


def port(environ: Mapping[str, str], name: str, default: int) -> int:
    """
    A TCP port number (0 asks the kernel for a free port, which tests use).
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not _isDecimal(raw) or int(raw) > 65535:
        raise ConfigError(name, f"must be a port number from 0 to 65535, got {raw!r}")
    return int(raw)


def positiveInteger(environ: Mapping[str, str], name: str, default: int) -> int:
    """
    An integer of at least 1.
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not _isDecimal(raw) or int(raw) < 1:
        raise ConfigError(name, f"must be a positive integer, got {raw!r}")
    return int(raw)


def nonNegativeInteger(environ: Mapping[str, str], name: str, default: int) -> int:
    """
    An integer of at least 0 (0 typically turns something off).
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not _isDecimal(raw):
        raise ConfigError(name, f"must be a whole number of 0 or more, got {raw!r}")
    return int(raw)


def duration(environ: Mapping[str, str], name: str, default: float) -> float:
    """
    A duration in seconds, written C{50ms}, C{1.5s}, C{2m} or a bare
    number of seconds.
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parseDuration(raw)
    except ValueError as error:
        raise ConfigError(name, f"{error}, got {raw!r}") from None


def parseDuration(raw: str) -> float:
    """
    The seconds of a duration written as for L{duration}, for values that
    do not come from a variable (such as the providers file).

    @raise ValueError: saying what is wrong, without repeating C{raw}, so
        that each caller words the context and quotes the value its own way.
    """
    match = _DURATION.match(raw)
    if match is None:
        raise ValueError("must be a duration such as 50ms, 2s or 1m")
    number, unit = float(match.group(1)), match.group(2) or "s"
    seconds = number * {"ms": 0.001, "s": 1.0, "m": 60.0}[unit]
    if seconds <= 0:
        raise ValueError("must be greater than zero")
    return seconds


def choice(environ: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    """
    One of a fixed set of words, compared without regard to case.
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    lowered = raw.lower()
    for candidate in allowed:
        if candidate.lower() == lowered:
            return candidate
    raise ConfigError(name, f"must be one of {', '.join(allowed)}, got {raw!r}")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """
    A yes/no variable: C{true}/C{false} (also 1/0, yes/no, on/off, in any
    case).
    """
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(name, f"must be true or false, got {raw!r}")


@attrs.frozen
class GrpcTLS:
    """
    Client side of mutual TLS on a gRPC link, to svc-auth for instance
    (decisions D1, L{svcd.authclient.channel}): the PEM bytes read at
    start, so a wrong path stops the daemon at once.
    """

    rootCertificates: bytes | None
    certificateChain: bytes | None
    privateKey: bytes | None = attrs.field(repr=False)


@attrs.frozen
class RedisTarget:
    """
    A Redis server, parsed from a URL such as REDIS_URL (where the limits
    and budgets keep their counters, L{svcd.limits.limiter}).
    """

    host: str
    port: int
    db: int
    password: str | None = attrs.field(default=None, repr=False)
    username: str | None = None
    # A Redis Cluster's nodes to ask for its slots (redis+cluster://,
    # L{parseRedisClusterURL}); empty for a single server.
    clusterNodes: tuple[tuple[str, int], ...] = ()


@attrs.frozen
class SentinelTarget:
    """
    A Redis master found through a group of Sentinels (decisions D16),
    parsed from C{redis+sentinel://} (C{rediss+sentinel://}: TLS to the
    sentinels and to the master). The user and password are the master's
    and the sentinels' alike: a sentinel without a password of its own
    accepts the connection all the same (L{svcd.limits.sentinellink}).
    """

    sentinels: tuple[tuple[str, int], ...]
    masterName: str
    db: int = 0
    password: str | None = attrs.field(default=None, repr=False)
    username: str | None = None
    tls: bool = False
    # With TLS: the certificates (PEM) of the authorities to trust, read
    # from the file C{?ca=} names at start; None: the system's.
    caPEM: bytes | None = attrs.field(default=None, repr=False)


SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
# A sentinel's port when the URL names none.
SENTINEL_DEFAULT_PORT = 26379
_SENTINEL_EXAMPLE = "such as redis+sentinel://host:26379,host2:26379/mymaster"


def parseRedisTarget(url: str, name: str = "REDIS_URL") -> RedisTarget | SentinelTarget | None:
    """
    What C{REDIS_URL} may name: one server (L{parseRedisURL}) or a
    Sentinel group (L{parseSentinelURL}); empty means no Redis.
    """
    if url.split(":", 1)[0].lower() in SENTINEL_SCHEMES:
        return parseSentinelURL(url, name)
    return parseRedisURL(url, name)


def parseRedisURL(url: str, name: str = "REDIS_URL") -> RedisTarget | None:
    """
    C{redis://[[user]:password@]host[:port][/db]}; empty means no Redis
    (for svc-proxy: rate limiting is then a no-op and /ready reports redis
    failed).
    """
    if not url:
        return None
    if url.startswith(CLUSTER_SCHEME):
        return parseRedisClusterURL(url, name)
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or 6379
    except ValueError:
        raise ConfigError(name, "must be a URL such as redis://host:6379/0") from None
    if parts.scheme != "redis" or not parts.hostname:
        raise ConfigError(name, "must be a URL such as redis://host:6379/0")
    dbText = parts.path.lstrip("/") or "0"
    if not (dbText.isascii() and dbText.isdigit()):
        raise ConfigError(name, "the path must be a database number such as /0")
    return RedisTarget(
        host=parts.hostname,
        port=port,
        db=int(dbText),
        password=urllib.parse.unquote(parts.password) if parts.password else None,
        username=urllib.parse.unquote(parts.username) if parts.username else None,
    )


def parseSentinelURL(url: str, name: str = "REDIS_URL") -> SentinelTarget:
    """
    C{redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<master
    name>[?db=N]}, and C{rediss+sentinel://} for TLS (with C{&ca=<PEM
    file>} to trust other authorities than the system's); a sentinel's
    port defaults to 26379. Every malformed form is one L{ConfigError}
    saying what is wrong.
    """
    scheme, separator, rest = url.partition("://")
    tls = SENTINEL_SCHEMES.get(scheme.lower())
    if not separator or tls is None:
        raise ConfigError(name, f"must be a URL {_SENTINEL_EXAMPLE}")
    if any(character.isspace() for character in url):
        raise ConfigError(name, "must not contain spaces")
    if "#" in rest:
        raise ConfigError(name, "must not have a fragment (#...)")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon and secret else None
        if password is None and username is not None:
            raise ConfigError(name, "a user needs a password (user:password@)")
    sentinels = tuple(_sentinelAddress(name, address) for address in hosts.split(","))
    masterName = urllib.parse.unquote(path)
    if not slash or not masterName:
        raise ConfigError(name, f"must name the master after the sentinels, {_SENTINEL_EXAMPLE}")
    if "/" in masterName:
        raise ConfigError(name, "the path must be the master's name alone, such as /mymaster")
    db = 0
    caPEM = None
    try:
        fields = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(name, "the query must be such as ?db=0") from None
    seen: set[str] = set()
    for field, value in fields:
        if field in seen:
            raise ConfigError(name, f"{field} is given twice")
        seen.add(field)
        if field == "db":
            if not _isDecimal(value):
                raise ConfigError(name, "db must be a database number such as ?db=0")
            db = int(value)
        elif field == "ca" and tls:
            try:
                with open(value, "rb") as pem:
                    caPEM = pem.read()
            except OSError as error:
                raise ConfigError(name, f"ca: cannot read {value!r}: {error.strerror}") from None
        else:
            allowed = "db and ca" if tls else "db"
            raise ConfigError(name, f"unknown parameter {field!r} (only {allowed} are allowed)")
    return SentinelTarget(
        sentinels=sentinels,
        masterName=masterName,
        db=db,
        password=password,
        username=username,
        tls=tls,
        caPEM=caPEM,
    )


def _sentinelAddress(name: str, address: str) -> tuple[str, int]:
    """
    One C{host[:port]} of a Sentinel URL (C{[v6 address]:port} too).
    """
    if not address:
        raise ConfigError(name, f"needs one or more sentinels, {_SENTINEL_EXAMPLE}")
    if address.startswith("["):
        host, bracket, after = address[1:].partition("]")
        if not bracket or not host or (after and not after.startswith(":")):
            raise ConfigError(name, f"{address!r} is not a host:port address")
        portText = after[1:] if after else ""
    else:
        host, colon, portText = address.partition(":")
        if not host or (colon and not portText) or ":" in portText:
            raise ConfigError(name, f"{address!r} is not a host:port address")
    if not portText:
        return host, SENTINEL_DEFAULT_PORT
    if not _isDecimal(portText) or not 0 < int(portText) < 65536:
        raise ConfigError(name, f"{address!r}: the port must be a number from 1 to 65535")
    return host, int(portText)


CLUSTER_SCHEME = "redis+cluster://"
_CLUSTER_EXAMPLE = "must be a URL such as redis+cluster://host:7000,host:7001"


def parseRedisClusterURL(url: str, name: str = "REDIS_URL") -> RedisTarget:
    """
    C{redis+cluster://[[user]:password@]host:port[,host:port...]}: a Redis
    Cluster (decisions D16), whose slots the limiter asks of any of these
    nodes (L{svcd.limits.clusterlink}); a Cluster has database 0 only, so
    a path may only be C{/0}. The target's host and port are the first
    node's.
    """
    rest = url[len(CLUSTER_SCHEME) :]
    rest, _, path = rest.partition("/")
    if path not in ("", "0") or "?" in rest or "#" in rest:
        raise ConfigError(name, "a Redis Cluster has database 0 only; " + _CLUSTER_EXAMPLE)
    userInfo, _, hosts = rest.rpartition("@")
    username = password = None
    if userInfo:
        user, colon, secret = userInfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
    nodes: list[tuple[str, int]] = []
    for node in hosts.split(","):
        try:
            parts = urllib.parse.urlsplit("//" + node.strip())
            host, port = parts.hostname, parts.port or 6379
        except ValueError:
            raise ConfigError(name, _CLUSTER_EXAMPLE) from None
        if not host or parts.path or parts.username is not None:
            raise ConfigError(name, _CLUSTER_EXAMPLE)
        nodes.append((host, port))
    return RedisTarget(
        host=nodes[0][0],
        port=nodes[0][1],
        db=0,
        password=password,
        username=username,
        clusterNodes=tuple(nodes),
    )


# Clients of the gateway's gRPC services (svc-proxy and svc-worker): where
# svc-auth and svc-memory answer, and the client side of their TLS.


def grpcAddress(environ: Mapping[str, str], name: str) -> str:
    """
    A required gRPC target: C{host:port}, or an address list grpcio takes
    (C{ipv4:a:port,b:port}).
    """
    return _checkedGrpcAddress(name, required(environ, name))


def optionalGrpcAddress(environ: Mapping[str, str], name: str) -> str | None:
    """
    An address that may be left unset or empty (None then).
    """
    value = text(environ, name, "")
    return _checkedGrpcAddress(name, value) if value else None


def _checkedGrpcAddress(name: str, value: str) -> str:
    if any(character.isspace() for character in value) or "/" in value.split(":", 1)[0]:
        raise ConfigError(name, f"must be a host:port address, got {value!r}")
    return value


def readPEM(environ: Mapping[str, str], name: str) -> bytes | None:
    """
    The bytes of the PEM file the variable C{name} names; None when unset.
    """
    path = text(environ, name, "")
    if not path:
        return None
    try:
        with open(path, "rb") as pemFile:
            return pemFile.read()
    except OSError as error:
        raise ConfigError(name, f"cannot read {path!r}: {error.strerror}") from None


def grpcTLS(
    environ: Mapping[str, str],
    names: tuple[str, str, str] = (
        "SVC_AUTH_GRPC_TLS_CA",
        "SVC_AUTH_GRPC_TLS_CERT",
        "SVC_AUTH_GRPC_TLS_KEY",
    ),
) -> GrpcTLS | None:
    """
    The variables C{names} of a CA, a client certificate and its key
    (SVC_AUTH_GRPC_TLS_* for svc-auth, SVC_MEMORY_GRPC_TLS_* for
    svc-memory): all unset means plaintext; a client certificate needs its
    key and the other way round.
    """
    caName, certName, keyName = names
    ca = readPEM(environ, caName)
    cert = readPEM(environ, certName)
    key = readPEM(environ, keyName)
    if cert is not None and key is None:
        raise ConfigError(keyName, f"is required when {certName} is set")
    if key is not None and cert is None:
        raise ConfigError(certName, f"is required when {keyName} is set")
    if ca is None and cert is None:
        return None
    return GrpcTLS(rootCertificates=ca, certificateChain=cert, privateKey=key)


def budgetTiming(environ: Mapping[str, str]) -> dict[str, float]:
    """
    How budget counters converge to the ledger (decisions D12, amended), for
    any daemon that admits provider calls: SVC_BUDGET_LEASE (more than 0),
    SVC_BUDGET_RECORD_GRACE (at least the lease: a settled reservation must
    outlive one in flight) and SVC_BUDGET_RECONCILE_INTERVAL (durations:
    more than 0), as the keyword arguments C{budgetLease},
    C{budgetRecordGrace} and C{budgetReconcileInterval}.
    """
    lease = duration(environ, "SVC_BUDGET_LEASE", 30.0)
    if lease <= 0:
        raise ConfigError("SVC_BUDGET_LEASE", "must be more than 0")
    grace = duration(environ, "SVC_BUDGET_RECORD_GRACE", 300.0)
    if grace < lease:
        raise ConfigError("SVC_BUDGET_RECORD_GRACE", "must be at least SVC_BUDGET_LEASE")
    return {
        "budgetLease": lease,
        "budgetRecordGrace": grace,
        "budgetReconcileInterval": duration(environ, "SVC_BUDGET_RECONCILE_INTERVAL", 30.0),
    }
