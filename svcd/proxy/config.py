"""
The whole configuration of svc-proxy, read once from the environment
(spec section 8, decisions D1 and D5).

A missing or bad value raises L{ConfigError} naming the variable; the tap
turns it into one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping

import attrs

from svcd.common import config
from svcd.common.config import (
    ConfigError,
    GrpcTLS,
    RedisTarget,
    SentinelTarget,
    budgetTiming,
    grpcAddress,
    grpcTLS,
    optionalGrpcAddress,
    parseRedisTarget,
)
from svcd.common.ids import parseUUID
from svcd.ledger.journalfile import MEMORY_JOURNAL_MAGIC, journalFromEnvironment
from svcd.providers.providersfile import providersFromEnvironment
from svcd.providers.table import MemoryConfig, ProviderTable

# RFC 9110 token characters: what a header name may be made of.
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


# The observations held at most (SVC_MEMORY_OUTBOX_MAX's default): an
# observation is at most some 1 MiB (64 messages of 16 KiB), usually a few
# KiB; 10,000 of them bound what a proxy holds while svc-memory is away.
OBSERVATION_OUTBOX_MAX = 10_000
# And their bytes at most, serialized (SVC_MEMORY_OUTBOX_MB's default, in
# MiB): 10,000 observations of a few KiB fit, 10,000 at their 1 MiB bound
# (some 10 GiB) do not; the memory they take is about twice this.
OBSERVATION_OUTBOX_MB = 128


@attrs.frozen
class ProxyConfig:
    """
    Everything svc-proxy reads from its environment.
    """

    authGrpcAddr: str
    host: str = "0.0.0.0"
    port: int = 8080
    reusePort: bool = False
    authTLS: GrpcTLS | None = None
    redis: RedisTarget | SentinelTarget | None = None
    validateTimeout: float = 0.05
    authMaxInFlight: int = 16
    authQueueTimeout: float = 1.0
    # Decisions D8: the validation cache; a size of 0 turns it off.
    authCacheSize: int = 100_000
    authCacheTTL: float = 60.0
    authWrongSecretsPerSecond: int = 5
    maxRequestBodyBytes: int = 1024 * 1024
    # Decisions D10: request bodies held across all connections.
    maxBufferedBodyBytes: int = 256 * 1024 * 1024
    errorDocsBase: str | None = None
    requestIDHeader: str = "X-Request-ID"
    traceIDHeader: str = "X-Trace-ID"
    defaultRPM: int = 60
    orgRPM: Mapping[str, int] = attrs.field(factory=dict)
    shutdownTimeout: float = 10.0
    # How long a starting proxy waits for svc-auth, Redis and the change
    # feed before it listens anyway.
    startTimeout: float = 5.0
    # How long a Redis call of the limiter may take before it fails open.
    redisTimeout: float = 0.1
    serviceName: str = "svc-proxy"
    environment: str = "development"
    # Decisions D9: SVC_PROVIDERS_FILE; None is Phase 1 (no provider).
    providers: ProviderTable | None = None
    # Decisions D12: the usage rows held until svc-auth has committed them,
    # and the file that keeps them across a kill (None: memory only).
    usageOutboxMax: int = 100_000
    usageJournal: str | None = None
    # Decisions D12, amended: how budget counters converge to the ledger
    # (svcd.limits.limiter): the lease of a reservation in flight,
    # how long a settled one stays counted before its row is recorded, and
    # the time between reconciliations.
    budgetLease: float = 30.0
    budgetRecordGrace: float = 300.0
    budgetReconcileInterval: float = 30.0
    # Decisions D13: where svc-memory answers (an address list like
    # SVC_AUTH_GRPC_ADDR; None: memory is off), its client TLS, and the
    # time a recall's embedding and search have together.
    memoryGrpcAddr: str | None = None
    memoryTLS: GrpcTLS | None = None
    memoryTimeout: float = 0.3
    # Calls to svc-memory at once; the others wait their turn within their
    # deadline. Half svc-memory's SVC_GRPC_MAX_CALLS_PER_PEER (16 by
    # default): a client at the bound meets its refusals in a race (a stream
    # freed on one side a moment before the other), measured as 0.1% of
    # adds answered 503 at 16 in flight and none at 8, which also stored
    # more per second (bench/README.rst, "memory-add").
    memoryMaxInFlight: int = 8
    # An organization's recall embeddings (and, apart, its recall searches)
    # in flight before the next ones wait to share a call (decisions D13,
    # "Context assembly"; svcd.common.coalesce). Measured at 32 connections
    # (bench/README.rst, nineteenth round): forward-recall served 60 to 66%
    # of forward's requests a second with 1 or 2, 53 to 58% with 4; 2 still
    # lets a slow provider's recalls overlap.
    memoryRecallCalls: int = 2
    # Decisions D13: the observations of chat completions held until
    # svc-memory has committed them, and the file that keeps them across
    # a kill (None: memory only), as the usage rows' (D12).
    memoryOutboxMax: int = OBSERVATION_OUTBOX_MAX
    memoryOutboxBytes: int = OBSERVATION_OUTBOX_MB * 2**20  # SVC_MEMORY_OUTBOX_MB, in bytes
    memoryJournal: str | None = None

    @property
    def memory(self) -> MemoryConfig | None:
        """
        The providers file's [memory] settings when memory is on (decisions
        D13): both SVC_MEMORY_GRPC_ADDR and a [memory] table are given.
        None otherwise: the memory routes answer 501 MEMORY_NOT_CONFIGURED
        and chat completions are as before.
        """
        if self.memoryGrpcAddr is None or self.providers is None:
            return None
        return self.providers.memory

    @classmethod
    def fromEnvironment(
        cls, environ: Mapping[str, str], clock: Callable[[], float] = time.time
    ) -> ProxyConfig:
        """
        Read and check every variable, and the providers file.

        @param clock: the current time in Unix seconds, recorded as the
            providers file's load time (the C{created} of GET /v1/models).

        @raise ConfigError: naming the first variable that is missing or
            has a value we cannot use.
        """
        return cls(
            authGrpcAddr=grpcAddress(environ, "SVC_AUTH_GRPC_ADDR"),
            host=config.text(environ, "SVC_HOST", "0.0.0.0") or "0.0.0.0",
            port=config.port(_asciiDigits(environ, "SVC_PORT"), "SVC_PORT", 8080),
            reusePort=config.flag(environ, "SVC_REUSE_PORT", False),
            authTLS=grpcTLS(environ),
            memoryGrpcAddr=optionalGrpcAddress(environ, "SVC_MEMORY_GRPC_ADDR"),
            memoryTLS=grpcTLS(
                environ,
                ("SVC_MEMORY_GRPC_TLS_CA", "SVC_MEMORY_GRPC_TLS_CERT", "SVC_MEMORY_GRPC_TLS_KEY"),
            ),
            memoryTimeout=config.duration(environ, "SVC_MEMORY_TIMEOUT", 0.3),
            memoryMaxInFlight=config.positiveInteger(
                _asciiDigits(environ, "SVC_MEMORY_MAX_IN_FLIGHT"), "SVC_MEMORY_MAX_IN_FLIGHT", 8
            ),
            memoryRecallCalls=config.positiveInteger(
                _asciiDigits(environ, "SVC_MEMORY_RECALL_CALLS"), "SVC_MEMORY_RECALL_CALLS", 2
            ),
            redis=parseRedisTarget(config.text(environ, "REDIS_URL", "")),
            validateTimeout=config.duration(environ, "SVC_AUTH_VALIDATE_TIMEOUT", 0.05),
            authMaxInFlight=config.positiveInteger(environ, "SVC_AUTH_MAX_IN_FLIGHT", 16),
            authQueueTimeout=config.duration(environ, "SVC_AUTH_QUEUE_TIMEOUT", 1.0),
            authCacheSize=config.nonNegativeInteger(
                _asciiDigits(environ, "SVC_AUTH_CACHE_SIZE"), "SVC_AUTH_CACHE_SIZE", 100_000
            ),
            authCacheTTL=config.duration(environ, "SVC_AUTH_CACHE_TTL", 60.0),
            authWrongSecretsPerSecond=config.positiveInteger(
                _asciiDigits(environ, "SVC_AUTH_WRONG_SECRETS_PER_SECOND"),
                "SVC_AUTH_WRONG_SECRETS_PER_SECOND",
                5,
            ),
            maxRequestBodyBytes=config.positiveInteger(
                _asciiDigits(environ, "SVC_MAX_REQUEST_BODY_BYTES"),
                "SVC_MAX_REQUEST_BODY_BYTES",
                1024 * 1024,
            ),
            maxBufferedBodyBytes=config.positiveInteger(
                _asciiDigits(environ, "SVC_MAX_BUFFERED_BODY_BYTES"),
                "SVC_MAX_BUFFERED_BODY_BYTES",
                256 * 1024 * 1024,
            ),
            errorDocsBase=config.text(environ, "SVC_ERROR_DOCS_BASE", "") or None,
            requestIDHeader=_headerName(environ, "SVC_REQUEST_ID_HEADER", "X-Request-ID"),
            traceIDHeader=_headerName(environ, "SVC_TRACE_ID_HEADER", "X-Trace-ID"),
            defaultRPM=config.positiveInteger(
                _asciiDigits(environ, "SVC_RATE_LIMIT_DEFAULT_RPM"),
                "SVC_RATE_LIMIT_DEFAULT_RPM",
                60,
            ),
            orgRPM=parseOrgOverrides(config.text(environ, "SVC_RATE_LIMIT_ORG_OVERRIDES", "")),
            shutdownTimeout=config.duration(environ, "SVC_SHUTDOWN_TIMEOUT", 10.0),
            startTimeout=config.duration(environ, "SVC_START_TIMEOUT", 5.0),
            redisTimeout=config.duration(environ, "SVC_REDIS_TIMEOUT", 0.1),
            serviceName=config.text(environ, "SVC_SERVICE_NAME", "svc-proxy") or "svc-proxy",
            environment=config.choice(
                environ, "SVC_ENV", "development", ("development", "staging", "production")
            ),
            providers=providersFromEnvironment(environ, clock),
            usageOutboxMax=config.positiveInteger(
                _asciiDigits(environ, "SVC_USAGE_OUTBOX_MAX"), "SVC_USAGE_OUTBOX_MAX", 100_000
            ),
            usageJournal=journalFromEnvironment(environ, "SVC_USAGE_JOURNAL"),
            memoryOutboxMax=config.positiveInteger(
                _asciiDigits(environ, "SVC_MEMORY_OUTBOX_MAX"),
                "SVC_MEMORY_OUTBOX_MAX",
                OBSERVATION_OUTBOX_MAX,
            ),
            memoryOutboxBytes=config.positiveInteger(
                _asciiDigits(environ, "SVC_MEMORY_OUTBOX_MB"),
                "SVC_MEMORY_OUTBOX_MB",
                OBSERVATION_OUTBOX_MB,
            )
            * 2**20,
            memoryJournal=_memoryJournal(environ),
            **budgetTiming(environ),
        )


def _memoryJournal(environ: Mapping[str, str]) -> str | None:
    """
    C{SVC_MEMORY_JOURNAL}: a memory journal's path (its first line its
    own, L{MEMORY_JOURNAL_MAGIC}), never the usage journal's: the two
    would lock each other out, and each would read the other's records.
    """
    path = journalFromEnvironment(environ, "SVC_MEMORY_JOURNAL", MEMORY_JOURNAL_MAGIC)
    usage = environ.get("SVC_USAGE_JOURNAL", "").strip()
    if path is not None and usage and os.path.realpath(path) == os.path.realpath(usage):
        raise ConfigError(
            "SVC_MEMORY_JOURNAL", f"{path!r} is SVC_USAGE_JOURNAL's file; each needs its own"
        )
    return path


def _asciiDigits(environ: Mapping[str, str], name: str) -> Mapping[str, str]:
    """
    C{environ}, after refusing a numeric variable with non-ASCII digits
    (such as "²"): str.isdigit accepts them and int() does not, which would
    end the daemon with a traceback instead of one line.
    """
    raw = environ.get(name, "").strip()
    if raw and raw.isdigit() and not raw.isascii():
        raise ConfigError(name, f"must be written with the digits 0-9, got {raw!r}")
    return environ


def _headerName(environ: Mapping[str, str], name: str, default: str) -> str:
    value = config.text(environ, name, default) or default
    if not _HEADER_NAME.match(value):
        raise ConfigError(name, f"must be an HTTP header name, got {value!r}")
    return value


def parseOrgOverrides(text: str, name: str = "SVC_RATE_LIMIT_ORG_OVERRIDES") -> dict[str, int]:
    """
    C{<org_uuid>=<rpm>,...}: per-organization requests per minute, keyed by
    the canonical lowercase org id. Empty entries (a trailing comma) are
    ignored; anything else that is not such a pair stops the daemon.
    """
    overrides: dict[str, int] = {}
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        orgText, equals, rpmText = entry.partition("=")
        orgID = parseUUID(orgText.strip())
        rpmText = rpmText.strip()
        validRPM = rpmText.isascii() and rpmText.isdigit() and int(rpmText) >= 1
        if not equals or orgID is None or not validRPM:
            raise ConfigError(name, f"entries must be <org_uuid>=<positive rpm>, got {entry!r}")
        if str(orgID) in overrides:
            raise ConfigError(name, f"organization {orgID} is listed twice")
        overrides[str(orgID)] = int(rpmText)
    return overrides
