"""
The settings svc-auth and svc-memory read alike (svcd.common.serversettings's
readDatabaseServer): each daemon's defaults, and the same refusals in both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from svcd.auth.config import AuthConfig
from svcd.common.config import ConfigError
from svcd.memory.config import MemoryConfig

DAEMONS: list[Callable[[Mapping[str, str]], Any]] = [
    AuthConfig.fromEnvironment,
    MemoryConfig.fromEnvironment,
]


def test_eachDaemonKeepsItsDefaults() -> None:
    """
    Without settings beyond the DSN, each daemon has its own ports, thread
    bounds, statement timeout and service name; the rest is common.
    """
    environ = {"POSTGRES_DSN": "host=x dbname=svc"}
    auth = AuthConfig.fromEnvironment(environ)
    memory = MemoryConfig.fromEnvironment(environ)
    assert (auth.port, auth.grpcPort, auth.grpcWorkers, auth.grpcMaxCallsPerPeer) == (
        8081,
        9091,
        64,
        32,
    )
    assert (memory.port, memory.grpcPort, memory.grpcWorkers, memory.grpcMaxCallsPerPeer) == (
        8082,
        9092,
        32,
        16,
    )
    assert (auth.statementTimeout, memory.statementTimeout) == (2.0, 5.0)
    assert (auth.serviceName, memory.serviceName) == ("svc-auth", "svc-memory")
    for settings in (auth, memory):
        assert settings.postgresDSN == "host=x dbname=svc"
        assert (settings.host, settings.grpcHost) == ("0.0.0.0", "127.0.0.1")
        assert (settings.databasePoolMinimum, settings.databasePoolMaximum) == (2, 10)
        assert settings.shutdownTimeout == 10.0
        assert settings.environment == "development"
        assert settings.errorDocsBase is None
        assert settings.tls is None and settings.internalSubjects is None


@pytest.mark.parametrize("read", DAEMONS)
def test_theSameSettingsAreReadTheSameWay(read: Callable[[Mapping[str, str]], Any]) -> None:
    settings = read(
        {
            "POSTGRES_DSN": "host=x",
            "SVC_PORT": "7001",
            "SVC_GRPC_PORT": "7002",
            "SVC_GRPC_WORKERS": "3",
            "SVC_GRPC_MAX_CALLS_PER_PEER": "2",
            "SVC_DB_POOL_MIN": "4",
            "SVC_DB_POOL_MAX": "4",
            "SVC_DB_STATEMENT_TIMEOUT": "750ms",
            "SVC_SHUTDOWN_TIMEOUT": "3s",
            "SVC_ENV": "staging",
            "SVC_SERVICE_NAME": "replica-2",
            "SVC_ERROR_DOCS_BASE": "https://docs.example/errors",
        }
    )
    assert (settings.port, settings.grpcPort) == (7001, 7002)
    assert (settings.grpcWorkers, settings.grpcMaxCallsPerPeer) == (3, 2)
    assert (settings.databasePoolMinimum, settings.databasePoolMaximum) == (4, 4)
    assert (settings.statementTimeout, settings.shutdownTimeout) == (0.75, 3.0)
    assert (settings.environment, settings.serviceName) == ("staging", "replica-2")
    assert settings.errorDocsBase == "https://docs.example/errors"


@pytest.mark.parametrize("read", DAEMONS)
@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({}, "POSTGRES_DSN"),
        ({"POSTGRES_DSN": "host=x =nonsense"}, "POSTGRES_DSN"),
        (
            {"POSTGRES_DSN": "host=x", "SVC_DB_POOL_MIN": "5", "SVC_DB_POOL_MAX": "4"},
            "SVC_DB_POOL_MAX",
        ),
        ({"POSTGRES_DSN": "host=x", "SVC_ENV": "prod"}, "SVC_ENV"),
        ({"POSTGRES_DSN": "host=x", "SVC_GRPC_WORKERS": "0"}, "SVC_GRPC_WORKERS"),
        (
            {"POSTGRES_DSN": "host=x", "SVC_ENV": "production", "SVC_GRPC_HOST": "0.0.0.0"},
            "SVC_GRPC_HOST",
        ),
    ],
)
def test_theSameRefusals(
    read: Callable[[Mapping[str, str]], Any], environ: dict[str, str], variable: str
) -> None:
    """
    A missing or unusable setting stops either daemon, naming the same
    variable.
    """
    with pytest.raises(ConfigError) as raised:
        read(environ)
    assert raised.value.variable == variable
