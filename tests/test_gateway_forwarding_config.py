"""
The providers file at the edges of forwarding (decisions D9): a gateway
without SVC_PROVIDERS_FILE answers exactly as in Phase 1, and a file the
proxy cannot use stops `twistd -n svc-proxy` before it starts, with one
line on stderr naming the file and the fault, and status 1.

tests/test_gateway_forwarding.py has the forwarding itself.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import openai
import pytest
from gatewayfixtures import runningGateway

from svcd.devkit.daemons import twistdCommand
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.servers import freePort

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e


def test_withoutProvidersFileAsPhase1(postgresServer: PostgresServer, tmp_path: Path) -> None:
    """
    Without SVC_PROVIDERS_FILE a valid chat request still answers 501
    PROVIDER_NOT_CONFIGURED (the SDK's InternalServerError), streaming or
    not, and GET /v1/models is 404 NOT_FOUND (the SDK's NotFoundError).
    """
    with runningGateway(
        postgresServer, tmp_path, proxyEnvironment={"SVC_AUTH_VALIDATE_TIMEOUT": "5s"}
    ) as gateway:
        tenant = gateway.tenants["main"]
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{gateway.port}/v1",
            api_key=tenant.token,
            default_headers={"X-SVC-Agent-ID": str(tenant.agentID)},
            max_retries=0,
            timeout=30,
        )
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as raised:
                client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=stream
                )
            assert raised.value.status_code == 501
            body = raised.value.body
            assert isinstance(body, dict)
            assert body["code"] == "PROVIDER_NOT_CONFIGURED"
            headers = raised.value.response.headers
            assert body["request_id"] == headers["x-request-id"]
            assert "x-svc-upstream-model" not in headers
            assert int(headers["x-ratelimit-limit"]) == 60
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.list()
        assert missing.value.status_code == 404
        missingBody = missing.value.body
        assert isinstance(missingBody, dict)
        assert missingBody["code"] == "NOT_FOUND"


PROVIDER = '[[providers]]\nname = "local"\nbase_url = "http://127.0.0.1:9/v1"\n'

# name: (the file's text, or None for no file; the fault after "<path>: ")
BAD_FILES: dict[str, tuple[str | None, str]] = {
    "missing": (None, "cannot read the file: No such file or directory"),
    "unknown-provider": (
        PROVIDER.replace("\n", '\napi_key_env = "SVC_TEST_SET_KEY"\n', 1)
        + '[[models]]\nname = "fast"\nprovider = "ghost"\n',
        'model "fast": provider "ghost" is not defined',
    ),
    "fallback-cycle": (
        PROVIDER
        + '[[models]]\nname = "a"\nprovider = "local"\nfallbacks = ["b"]\n'
        + '[[models]]\nname = "b"\nprovider = "local"\nfallbacks = ["c"]\n'
        + '[[models]]\nname = "c"\nprovider = "local"\nfallbacks = ["a"]\n',
        'fallbacks form a cycle: "a" -> "b" -> "c" -> "a"',
    ),
    "unset-key": (
        PROVIDER.replace("\n", '\napi_key_env = "SVC_TEST_UNSET_KEY"\n', 1)
        + '[[models]]\nname = "fast"\nprovider = "local"\n',
        'provider "local": api_key_env: SVC_TEST_UNSET_KEY is not set in the environment',
    ),
    "not-toml": ("[[providers]\n", "is not valid TOML"),
}


def test_badProvidersFileStopsTheProxy(tmp_path: Path) -> None:
    """
    A missing file, a model on an unknown provider, a fallback cycle, an
    api_key_env that is unset, a file that is not TOML: each stops `twistd
    -n svc-proxy` with status 1 and one line on stderr naming the variable,
    the file and the fault (no traceback), never a key's value.
    """
    key = "sk-never-shown-" + os.urandom(8).hex()
    variables = {
        name: value for name, value in os.environ.items() if not name.startswith(("SVC_", "REDIS"))
    }
    running = {}
    for name, (text, _) in BAD_FILES.items():
        path = tmp_path / f"{name}.toml"
        if text is not None:
            path.write_text(text)
        # Every case at once: each is a Python start-up.
        running[name] = subprocess.Popen(
            twistdCommand("svc-proxy"),
            env={
                **variables,
                "SVC_AUTH_GRPC_ADDR": "127.0.0.1:1",
                "SVC_HOST": "127.0.0.1",
                "SVC_PORT": str(freePort()),
                "SVC_PROVIDERS_FILE": str(path),
                "SVC_TEST_SET_KEY": key,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=60)
        fault = BAD_FILES[name][1]
        path = tmp_path / f"{name}.toml"
        assert process.returncode == 1, (name, stdout, stderr)
        prefix = f"svc-proxy: configuration error: SVC_PROVIDERS_FILE: {path}: "
        assert stderr.startswith(prefix + fault), (name, stderr)
        assert stderr.count("\n") == 1 and stderr.endswith("\n"), (name, stderr)
        assert "Traceback" not in stdout + stderr
        assert key not in stdout + stderr
