"""
What the developer asked of a C{dev/gateway} run: L{Settings}, from the
environment and the command line (L{ENVIRONMENT_HELP} says which
variables).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs

from svcd.devkit.gateway.children import DevStackError
from svcd.providers.providersfile import VARIABLE as PROVIDERS_VARIABLE

ENVIRONMENT_HELP = """\
environment variables:
  POSTGRES_DSN         use this PostgreSQL database instead of a private server
  REDIS_URL            use this Redis instead of a private server
  SVC_PROXY_PORT       svc-proxy's HTTP port (default 8080)
  SVC_AUTH_PORT        svc-auth's HTTP port for /health, /ready, /metrics (default 8081)
  SVC_AUTH_GRPC_PORT   svc-auth's gRPC port (default 9091)
  SVC_MEMORY_PORT      svc-memory's HTTP port (default 8082), when the
                       providers file has a [memory] table
  SVC_MEMORY_GRPC_PORT svc-memory's gRPC port (default 9092)
  SVC_WORKER_PORT      svc-worker's HTTP port for /health, /ready, /metrics
                       (default 8083); the worker runs beside svc-memory
  SVC_HOST             the address the daemons listen on (default 127.0.0.1)
  SVC_AUTH_VALIDATE_TIMEOUT
                       svc-proxy's deadline on calls to svc-auth (default
                       here 1s: the daemons' 50ms is meant for a server that
                       does nothing else)
  SVC_PROVIDERS_FILE   a providers file: svc-proxy forwards chat requests to
                       its models, and the commands printed at the end use
                       the first one (and its first embedding model, if
                       any; for Anthropic's Messages API, its first model
                       of an Anthropic provider, if any). Unset: the
                       scripted model server of the tests answers the models
                       "demo", "demo-claude" (an Anthropic provider) and
                       "demo-embed" (.data/providers.toml), and memory is
                       on with "demo-embed" (svc-memory and svc-worker run
                       beside the others).
                       With a file of your own, they run when the
                       file has a [memory] table.
                       Set but empty: no provider, chat requests answer 501
  Every other variable is passed on to every daemon (SVC_LOG_FORMAT=text
  for readable logs, SVC_LOG_LEVEL=DEBUG, ...).
"""


def _port(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise DevStackError(f"{name} must be a port number from 1 to 65535, got {raw!r}")
    return int(raw)


@attrs.frozen
class Settings:
    """
    What the developer asked for, from the environment and the command line.
    """

    dataDirectory: Path
    proxyPort: int
    authPort: int
    authGrpcPort: int
    memoryPort: int
    memoryGrpcPort: int
    workerPort: int
    postgresDSN: str | None
    redisURL: str | None
    # No SVC_PROVIDERS_FILE at all (an empty one is a choice: no provider).
    scriptedModelServer: bool

    @classmethod
    def fromEnvironment(cls, environ: Mapping[str, str], dataDirectory: Path) -> Settings:
        return cls(
            dataDirectory=dataDirectory,
            proxyPort=_port(environ, "SVC_PROXY_PORT", 8080),
            authPort=_port(environ, "SVC_AUTH_PORT", 8081),
            authGrpcPort=_port(environ, "SVC_AUTH_GRPC_PORT", 9091),
            memoryPort=_port(environ, "SVC_MEMORY_PORT", 8082),
            memoryGrpcPort=_port(environ, "SVC_MEMORY_GRPC_PORT", 9092),
            workerPort=_port(environ, "SVC_WORKER_PORT", 8083),
            postgresDSN=environ.get("POSTGRES_DSN", "").strip() or None,
            redisURL=environ.get("REDIS_URL", "").strip() or None,
            scriptedModelServer=PROVIDERS_VARIABLE not in environ,
        )
