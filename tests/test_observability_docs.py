"""
docs/operations.rst against the code: every variable the daemons read is
documented, every documented SVC_ variable is read, the documented
defaults are the code's, and every series the daemons export is in the
list of metrics.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from twisted.logger import LogLevel

from svcd.auth.callers import DenialLog
from svcd.auth.config import AuthConfig
from svcd.auth.grpcservice import AuthMetrics
from svcd.common import config
from svcd.common.gcmetrics import CollectorMetrics
from svcd.common.logs import logSettings
from svcd.common.metrics import processUpGauge
from svcd.common.tracing import TracingConfig
from svcd.memory.config import MemoryConfig
from svcd.memory.metrics import MemoryMetrics
from svcd.proxy.config import ProxyConfig
from svcd.proxy.metrics import ProxyMetrics
from svcd.proxy.observe import ObservationOutboxMetrics

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = (ROOT / "docs" / "operations.rst").read_text()
_VARIABLE = re.compile(r"\b((?:SVC|OTEL|POSTGRES|REDIS|GRPC)_[A-Z0-9_]*[A-Z0-9])\b")
# Names in the source that are not environment variables.
_NOT_VARIABLES = {"SVC_ENV_VALUES"}


def variablesReadByTheCode() -> set[str]:
    found: set[str] = set()
    for source in (ROOT / "svcd").rglob("*.py"):
        # The devkit's variables (dev/gateway's own, the private servers',
        # the tests' daemons') are not the daemons'.
        parts = source.relative_to(ROOT).parts
        if "devkit" in parts or "pb" in parts:
            continue
        found |= set(_VARIABLE.findall(source.read_text()))
    return found - _NOT_VARIABLES


def documentedDefaults() -> dict[str, str]:
    """
    The default column of the configuration tables: variable -> text.
    """
    rows = re.findall(r"^``([A-Z][A-Z0-9_]+)``\s{2,}(\S+(?: / \S+| \S+)?)\s{2,}", OPERATIONS, re.M)
    return {name: default.replace("``", "") for name, default in rows}


def readBySDK() -> set[str]:
    """
    The variables of the section on what the OpenTelemetry SDK reads.
    """
    section = OPERATIONS.split("Read by the OpenTelemetry SDK itself", 1)[1]
    section = section.split("\n\n\n", 1)[0]
    return set(_VARIABLE.findall(section))


def test_everyVariableIsDocumented() -> None:
    """
    Each SVC_, OTEL_, POSTGRES_, REDIS_ and GRPC_ variable named in svcd is in a
    configuration table of docs/operations.rst (or, for those the
    OpenTelemetry SDK reads itself, in their section).
    """
    documented = set(documentedDefaults()) | readBySDK()
    missing = sorted(variablesReadByTheCode() - documented)
    assert missing == []


def test_everyDocumentedVariableIsRead() -> None:
    """
    No table documents a variable that nothing reads.
    """
    assert sorted(set(documentedDefaults()) - variablesReadByTheCode()) == []


def _proxy() -> ProxyConfig:
    return ProxyConfig.fromEnvironment({"SVC_AUTH_GRPC_ADDR": "auth:9091"})


def _memory() -> MemoryConfig:
    return MemoryConfig.fromEnvironment({"POSTGRES_DSN": "postgresql://svc@db/svc"})


def _auth() -> AuthConfig:
    return AuthConfig.fromEnvironment({"POSTGRES_DSN": "postgresql://svc@db/svc"})


@pytest.mark.parametrize(
    ("variable", "actual"),
    [
        ("SVC_HOST", lambda: _proxy().host),
        ("SVC_AUTH_VALIDATE_TIMEOUT", lambda: _proxy().validateTimeout),
        ("SVC_RATE_LIMIT_DEFAULT_RPM", lambda: _proxy().defaultRPM),
        ("SVC_MAX_REQUEST_BODY_BYTES", lambda: _proxy().maxRequestBodyBytes),
        ("SVC_MAX_BUFFERED_BODY_BYTES", lambda: _proxy().maxBufferedBodyBytes),
        ("SVC_REQUEST_ID_HEADER", lambda: _proxy().requestIDHeader),
        ("SVC_TRACE_ID_HEADER", lambda: _proxy().traceIDHeader),
        ("SVC_SHUTDOWN_TIMEOUT", lambda: _proxy().shutdownTimeout),
        ("SVC_SHUTDOWN_TIMEOUT", lambda: _auth().shutdownTimeout),
        ("SVC_START_TIMEOUT", lambda: _proxy().startTimeout),
        ("SVC_REDIS_TIMEOUT", lambda: _proxy().redisTimeout),
        ("SVC_USAGE_OUTBOX_MAX", lambda: _proxy().usageOutboxMax),
        ("SVC_MEMORY_OUTBOX_MAX", lambda: _proxy().memoryOutboxMax),
        ("SVC_MEMORY_OUTBOX_MB", lambda: _proxy().memoryOutboxBytes // 2**20),
        ("SVC_ENV", lambda: _proxy().environment),
        ("SVC_ENV", lambda: _auth().environment),
        ("SVC_GRPC_HOST", lambda: _auth().grpcHost),
        ("SVC_GRPC_PORT", lambda: _auth().grpcPort),
        ("SVC_GRPC_WORKERS", lambda: _auth().grpcWorkers),
        ("SVC_GRPC_MAX_CALLS_PER_PEER", lambda: _auth().grpcMaxCallsPerPeer),
        ("SVC_DB_POOL_MIN", lambda: _auth().databasePoolMinimum),
        ("SVC_DB_POOL_MAX", lambda: _auth().databasePoolMaximum),
        ("SVC_DB_STATEMENT_TIMEOUT", lambda: _auth().statementTimeout),
        ("SVC_AUTH_VERIFY_CONCURRENCY", lambda: _auth().verifyConcurrency),
        ("OTEL_SAMPLE_RATIO", lambda: TracingConfig.fromEnvironment({}, "x").sampleRatio),
        ("SVC_LOG_FORMAT", lambda: logSettings({})[0]),
        ("SVC_MEMORY_MAX_PER_SCOPE", lambda: _memory().maxPerScope),
        ("SVC_MEMORY_CACHE_MB", lambda: _memory().cacheBytes // 2**20),
        ("SVC_MEMORY_FAILED_RETENTION", lambda: _memory().failedRetention),
    ],
)
def test_documentedDefaultIsTheCodes(variable: str, actual: object) -> None:
    """
    The documented default of each variable is what the code uses when it
    is unset.
    """
    assert callable(actual)
    value = actual()
    documented = documentedDefaults()[variable]
    if isinstance(value, float):
        assert config.duration({variable: documented}, variable, 0.0) == pytest.approx(value)
    else:
        assert documented == str(value)


def test_otherDefaults() -> None:
    """
    The defaults written in words: ports per daemon, the log level, the
    service names, and the variables that are required or empty.
    """
    documented = documentedDefaults()
    assert documented["SVC_PORT"] == f"{_proxy().port} / {_auth().port}"
    assert logSettings({})[1] is LogLevel.info and documented["SVC_LOG_LEVEL"] == "INFO"
    assert (_proxy().serviceName, _auth().serviceName) == ("svc-proxy", "svc-auth")
    assert TracingConfig.fromEnvironment({}, "svc-proxy").endpoint is None
    assert documented["OTEL_EXPORTER_OTLP_ENDPOINT"] == "empty"
    assert _proxy().redis is None and documented["REDIS_URL"] == "empty"
    assert _proxy().orgRPM == {} and documented["SVC_RATE_LIMIT_ORG_OVERRIDES"] == "empty"
    assert _proxy().providers is None and documented["SVC_PROVIDERS_FILE"] == "unset"
    assert _proxy().usageJournal is None and documented["SVC_USAGE_JOURNAL"] == "unset"
    assert _proxy().memoryJournal is None and documented["SVC_MEMORY_JOURNAL"] == "unset"
    assert _auth().internalSubjects is None
    assert documented["SVC_GRPC_INTERNAL_SUBJECTS"] == "unset"
    for required in ("POSTGRES_DSN", "SVC_AUTH_GRPC_ADDR"):
        assert documented[required] == "required"
    with pytest.raises(config.ConfigError):
        ProxyConfig.fromEnvironment({})


def exportedSeries() -> set[str]:
    """
    The names of the series the daemons export, as the text format writes
    them (a counter's with C{_total}).
    """
    proxy = ProxyMetrics().registry
    proxy.register(CollectorMetrics())
    ObservationOutboxMetrics(proxy)
    auth = CollectorRegistry()
    AuthMetrics(auth)
    DenialLog(auth)
    processUpGauge(auth)
    auth.register(CollectorMetrics())
    memory = CollectorRegistry()
    MemoryMetrics(memory)
    names = set()
    for registry in (proxy, auth, memory):
        for family in registry.collect():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_everySeriesIsDocumented() -> None:
    """
    Each series of svc-proxy, svc-auth and svc-memory is named in the list of metrics
    of docs/operations.rst (or its section on forwarding).
    """
    documented = set(re.findall(r"``(svc_[a-z0-9_]+)(?:\{[a-z_,]*\})?``", OPERATIONS))
    assert exportedSeries() >= {"svc_python_gc_pause_seconds", "svc_python_gc_collections_total"}
    assert sorted(exportedSeries() - documented) == []
