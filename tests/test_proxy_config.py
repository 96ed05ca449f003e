"""
svc-proxy's configuration from the environment (spec section 8, decisions
D1, D5): defaults, every variable, and one clear error naming the variable
for each bad value.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from svcd.common.config import ConfigError, RedisTarget, parseRedisURL
from svcd.proxy.config import ProxyConfig, parseOrgOverrides
from svcd.proxy.tap import Options

BASE = {"SVC_AUTH_GRPC_ADDR": "127.0.0.1:9091"}


def test_defaults() -> None:
    """
    Only SVC_AUTH_GRPC_ADDR is required; everything else has the spec's
    default.
    """
    config = ProxyConfig.fromEnvironment(BASE)
    assert config == ProxyConfig(authGrpcAddr="127.0.0.1:9091")
    assert (config.host, config.port) == ("0.0.0.0", 8080)
    assert config.validateTimeout == 0.05
    assert config.maxRequestBodyBytes == 1048576
    assert (config.requestIDHeader, config.traceIDHeader) == ("X-Request-ID", "X-Trace-ID")
    assert (config.defaultRPM, dict(config.orgRPM)) == (60, {})
    assert config.redis is None
    assert config.authTLS is None
    assert config.errorDocsBase is None
    assert config.reusePort is False


def test_everyVariable(tmp_path: Path) -> None:
    """
    Every variable is read.
    """
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"CA")
    orgID = str(uuid.uuid4())
    config = ProxyConfig.fromEnvironment(
        {
            "SVC_AUTH_GRPC_ADDR": "auth.internal:9091",
            "SVC_HOST": "127.0.0.1",
            "SVC_PORT": "18080",
            "SVC_REUSE_PORT": "True",
            "REDIS_URL": "redis://:s%40cret@redis.internal:6380/2",
            "SVC_AUTH_VALIDATE_TIMEOUT": "120ms",
            "SVC_MAX_REQUEST_BODY_BYTES": "2048",
            "SVC_ERROR_DOCS_BASE": "https://docs.example/errors",
            "SVC_REQUEST_ID_HEADER": "X-Correlation-ID",
            "SVC_TRACE_ID_HEADER": "X-Trace",
            "SVC_RATE_LIMIT_DEFAULT_RPM": "100",
            "SVC_RATE_LIMIT_ORG_OVERRIDES": f" {orgID.upper()} = 5 ,",
            "SVC_SHUTDOWN_TIMEOUT": "3s",
            "SVC_START_TIMEOUT": "750ms",
            "SVC_REDIS_TIMEOUT": "2s",
            "SVC_AUTH_GRPC_TLS_CA": str(ca),
            "SVC_ENV": "staging",
        }
    )
    assert (config.host, config.port, config.reusePort) == ("127.0.0.1", 18080, True)
    assert config.redis == RedisTarget(host="redis.internal", port=6380, db=2, password="s@cret")
    assert config.validateTimeout == pytest.approx(0.12)
    assert config.maxRequestBodyBytes == 2048
    assert config.errorDocsBase == "https://docs.example/errors"
    assert (config.requestIDHeader, config.traceIDHeader) == ("X-Correlation-ID", "X-Trace")
    assert (config.defaultRPM, dict(config.orgRPM)) == (100, {orgID: 5})
    assert config.shutdownTimeout == 3.0
    assert config.startTimeout == 0.75
    assert config.redisTimeout == 2.0
    assert config.authTLS is not None and config.authTLS.rootCertificates == b"CA"
    assert config.environment == "staging"
    assert "s@cret" not in repr(config)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SVC_AUTH_GRPC_ADDR", ""),
        ("SVC_AUTH_GRPC_ADDR", "has space:1"),
        ("SVC_PORT", "http"),
        ("SVC_PORT", "70000"),
        ("SVC_PORT", "\u00b2"),
        ("SVC_REUSE_PORT", "maybe"),
        ("SVC_MAX_REQUEST_BODY_BYTES", "\u0661\u0660"),
        ("SVC_RATE_LIMIT_DEFAULT_RPM", "\u00b9"),
        ("REDIS_URL", "http://redis:6379"),
        ("REDIS_URL", "redis://"),
        ("REDIS_URL", "redis://host:port"),
        ("REDIS_URL", "redis://host:6379/zero"),
        ("SVC_AUTH_VALIDATE_TIMEOUT", "fast"),
        ("SVC_AUTH_VALIDATE_TIMEOUT", "0ms"),
        ("SVC_MAX_REQUEST_BODY_BYTES", "-1"),
        ("SVC_MAX_REQUEST_BODY_BYTES", "1MB"),
        ("SVC_REQUEST_ID_HEADER", "X Request"),
        ("SVC_TRACE_ID_HEADER", "X-Trace:"),
        ("SVC_RATE_LIMIT_DEFAULT_RPM", "0"),
        ("SVC_RATE_LIMIT_ORG_OVERRIDES", "acme=5"),
        ("SVC_RATE_LIMIT_ORG_OVERRIDES", f"{uuid.uuid4()}"),
        ("SVC_RATE_LIMIT_ORG_OVERRIDES", f"{uuid.uuid4()}=0"),
        ("SVC_RATE_LIMIT_ORG_OVERRIDES", f"{uuid.uuid4()}=ten"),
        ("SVC_RATE_LIMIT_ORG_OVERRIDES", f"{uuid.uuid4()}=\u00b2"),
        ("SVC_SHUTDOWN_TIMEOUT", "soon"),
        ("SVC_START_TIMEOUT", "later"),
        ("SVC_START_TIMEOUT", "0s"),
        ("SVC_REDIS_TIMEOUT", "never"),
        ("SVC_REDIS_TIMEOUT", "0ms"),
        # Digits of other scripts, which float() reads: fullwidth, Arabic-Indic.
        ("SVC_REDIS_TIMEOUT", "\uff15s"),
        ("SVC_AUTH_VALIDATE_TIMEOUT", "\u0661\u0660\u0660ms"),
        ("SVC_ENV", "qa"),
        ("SVC_AUTH_GRPC_TLS_CA", "/no/such/ca.pem"),
        ("SVC_MEMORY_GRPC_ADDR", "has space:1"),
        ("SVC_MEMORY_GRPC_TLS_CA", "/no/such/ca.pem"),
        ("SVC_MEMORY_TIMEOUT", "0ms"),
        ("SVC_MEMORY_TIMEOUT", "soon"),
        ("SVC_MEMORY_MAX_IN_FLIGHT", "0"),
        ("SVC_MEMORY_MAX_IN_FLIGHT", "many"),
        ("SVC_MEMORY_MAX_IN_FLIGHT", "\uff18"),
        ("SVC_MEMORY_RECALL_CALLS", "0"),
        ("SVC_MEMORY_RECALL_CALLS", "-1"),
        ("SVC_MEMORY_RECALL_CALLS", "\uff14"),
    ],
)
def test_badValue(variable: str, value: str) -> None:
    """
    A bad value raises ConfigError naming its variable.
    """
    with pytest.raises(ConfigError) as caught:
        ProxyConfig.fromEnvironment({**BASE, variable: value})
    assert caught.value.variable == variable
    assert str(caught.value).startswith(variable + ": ")


def test_duplicateOverride() -> None:
    """
    One org listed twice is refused rather than guessed.
    """
    orgID = str(uuid.uuid4())
    with pytest.raises(ConfigError, match="listed twice"):
        parseOrgOverrides(f"{orgID}=1,{orgID.upper()}=2")


def test_clientCertificateNeedsKey(tmp_path: Path) -> None:
    """
    A client certificate without its key (or the other way round) is an
    error naming the missing variable.
    """
    pem = tmp_path / "x.pem"
    pem.write_bytes(b"PEM")
    with pytest.raises(ConfigError) as caught:
        ProxyConfig.fromEnvironment({**BASE, "SVC_AUTH_GRPC_TLS_CERT": str(pem)})
    assert caught.value.variable == "SVC_AUTH_GRPC_TLS_KEY"
    with pytest.raises(ConfigError) as caught:
        ProxyConfig.fromEnvironment({**BASE, "SVC_AUTH_GRPC_TLS_KEY": str(pem)})
    assert caught.value.variable == "SVC_AUTH_GRPC_TLS_CERT"


def test_memoryVariables(tmp_path: Path) -> None:
    """
    Decisions D13: memory is on only with both SVC_MEMORY_GRPC_ADDR and
    the providers file's [memory] table; svc-memory's client TLS has
    variables of its own, and SVC_MEMORY_TIMEOUT defaults to 300 ms.
    """
    pem = tmp_path / "x.pem"
    pem.write_bytes(b"PEM")
    providers = tmp_path / "providers.toml"
    providers.write_text(
        '[[providers]]\nname = "local"\nbase_url = "http://127.0.0.1:9/v1"\n'
        '[[models]]\nname = "embed"\nprovider = "local"\nkind = "embedding"\n'
    )
    plain = ProxyConfig.fromEnvironment({**BASE, "SVC_PROVIDERS_FILE": str(providers)})
    assert (plain.memoryGrpcAddr, plain.memoryTLS, plain.memoryTimeout) == (None, None, 0.3)
    assert plain.memoryMaxInFlight == 8
    assert plain.memory is None
    withoutTable = ProxyConfig.fromEnvironment(
        {
            **BASE,
            "SVC_PROVIDERS_FILE": str(providers),
            "SVC_MEMORY_GRPC_ADDR": "memory.internal:9092",
            "SVC_MEMORY_GRPC_TLS_CERT": str(pem),
            "SVC_MEMORY_GRPC_TLS_KEY": str(pem),
            "SVC_MEMORY_TIMEOUT": "150ms",
            "SVC_MEMORY_MAX_IN_FLIGHT": "12",
            "SVC_MEMORY_RECALL_CALLS": "2",
        }
    )
    assert withoutTable.memoryMaxInFlight == 12
    assert withoutTable.memoryRecallCalls == 2
    assert withoutTable.memoryGrpcAddr == "memory.internal:9092"
    assert withoutTable.memoryTLS is not None
    assert withoutTable.memoryTLS.certificateChain == b"PEM"
    assert withoutTable.memoryTimeout == pytest.approx(0.15)
    assert withoutTable.authTLS is None
    assert withoutTable.memory is None
    with providers.open("a") as more:
        more.write('[memory]\nembedding_model = "embed"\n')
    on = ProxyConfig.fromEnvironment(
        {**BASE, "SVC_PROVIDERS_FILE": str(providers), "SVC_MEMORY_GRPC_ADDR": "m:9092"}
    )
    assert on.memory is not None and on.memory.embeddingModel.name == "embed"
    off = ProxyConfig.fromEnvironment({**BASE, "SVC_PROVIDERS_FILE": str(providers)})
    assert off.memory is None
    with pytest.raises(ConfigError) as caught:
        ProxyConfig.fromEnvironment({**BASE, "SVC_MEMORY_GRPC_TLS_CERT": str(pem)})
    assert caught.value.variable == "SVC_MEMORY_GRPC_TLS_KEY"


def test_redisURL() -> None:
    """
    REDIS_URL: host, port (default 6379), database (default 0), optional
    user and password.
    """
    assert parseRedisURL("") is None
    assert parseRedisURL("redis://127.0.0.1") == RedisTarget("127.0.0.1", 6379, 0)
    assert parseRedisURL("redis://u:p@h:1/3") == RedisTarget("h", 1, 3, "p", "u")


def test_optionsExitOnBadConfiguration(capsys: pytest.CaptureFixture[str]) -> None:
    """
    The twistd options print one line naming the variable and exit 1 when
    the configuration is bad.
    """
    options = Options(environ={})
    with pytest.raises(SystemExit) as caught:
        options.parseOptions([])
    assert caught.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "svc-proxy: configuration error: SVC_AUTH_GRPC_ADDR: is required and not set\n"
    )


def test_optionsReadEnvironment() -> None:
    """
    Good options carry the configuration and the log settings.
    """
    options = Options(environ={**BASE, "SVC_LOG_FORMAT": "text", "SVC_LOG_LEVEL": "debug"})
    options.parseOptions([])
    assert options.config.authGrpcAddr == "127.0.0.1:9091"
    assert options.logFormat == "text"
    assert options.logLevel.name == "debug"


@pytest.mark.parametrize(
    "address",
    [
        "auth.internal:9091",
        "ipv4:10.0.0.5:9091,10.0.0.6:9091",
        "ipv6:[fd00::5]:9091,[fd00::6]:9091",
        "dns:///svc-auth.internal:9091",
    ],
)
def test_severalReplicas(address: str) -> None:
    """
    SVC_AUTH_GRPC_ADDR takes gRPC's target forms, so that a proxy can be
    given several svc-auth replicas: a list of addresses or a DNS name of
    several (docs/operations.rst, Running several svc-auth replicas).
    """
    assert ProxyConfig.fromEnvironment({"SVC_AUTH_GRPC_ADDR": address}).authGrpcAddr == address


def test_usageOutboxAndJournal(tmp_path: Path) -> None:
    """
    Decisions D12: SVC_USAGE_OUTBOX_MAX (default 100000) bounds the rows
    held; SVC_USAGE_JOURNAL names the journal (unset or empty: none).
    """
    config = ProxyConfig.fromEnvironment(BASE)
    assert (config.usageOutboxMax, config.usageJournal) == (100_000, None)
    journal = str(tmp_path / "usage.journal")
    config = ProxyConfig.fromEnvironment(
        {**BASE, "SVC_USAGE_OUTBOX_MAX": "250", "SVC_USAGE_JOURNAL": journal}
    )
    assert (config.usageOutboxMax, config.usageJournal) == (250, journal)
    assert ProxyConfig.fromEnvironment({**BASE, "SVC_USAGE_JOURNAL": " "}).usageJournal is None


@pytest.mark.parametrize("value", ["0", "-5", "many", "1e5", "\u00b2"])
def test_badOutboxMax(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ProxyConfig.fromEnvironment({**BASE, "SVC_USAGE_OUTBOX_MAX": value})
    assert str(caught.value).startswith("SVC_USAGE_OUTBOX_MAX: must be")


def test_badJournal(tmp_path: Path) -> None:
    """
    A journal in a directory that does not exist, a directory, or a file
    that is not a journal stops the daemon with a line saying which.
    """
    notes = tmp_path / "notes.txt"
    notes.write_text("not a journal\n")
    for path, problem in [
        (tmp_path / "missing" / "usage.journal", "does not exist"),
        (tmp_path, "is a directory"),
        (notes, "is not a usage journal of svc-proxy"),
    ]:
        with pytest.raises(ConfigError) as caught:
            ProxyConfig.fromEnvironment({**BASE, "SVC_USAGE_JOURNAL": str(path)})
        assert caught.value.variable == "SVC_USAGE_JOURNAL"
        assert problem in caught.value.problem
