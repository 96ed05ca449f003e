"""
The operator files in etc/: systemd units that systemd itself accepts, and
example environments that the daemons accept.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from svcd.auth.config import AuthConfig
from svcd.memory.config import MemoryConfig
from svcd.proxy.config import ProxyConfig
from svcd.worker.config import WorkerConfig

ETC = Path(__file__).resolve().parents[1] / "etc"
UNITS = ("svc-auth", "svc-proxy", "svc-proxy@", "svc-memory", "svc-worker")


def readEnvironmentFile(path: Path) -> dict[str, str]:
    """
    KEY=value lines, as systemd's EnvironmentFile reads them (no quoting is
    used in our examples).
    """
    environment = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            environment[key] = value
    return environment


@pytest.mark.parametrize("unit", UNITS)
def test_unitsPassSystemdAnalyzeVerify(unit: str, tmp_path: Path) -> None:
    """
    systemd-analyze verify accepts each unit, with ExecStart pointed at
    this environment's twistd (verify insists the program exists), and the
    units keep their hardening.
    """
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is missing: install Debian's systemd package"
    text = (ETC / "systemd" / f"{unit}.service").read_text()
    daemon = unit.rstrip("@")
    for setting in (
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "User=svc",
        # Started once it serves (sd_notify READY=1): a rolling restart
        # that waits for each restart never stops the last worker serving.
        "Type=notify",
        f"EnvironmentFile=/etc/svc/{daemon}.env",
        f"--pidfile= {daemon}",
    ):
        assert setting in text
    if unit.endswith("@"):
        # The template's workers share the port.
        assert "Environment=SVC_REUSE_PORT=true" in text
    twistd = Path(sys.executable).parent / "twistd"
    assert twistd.exists()
    # A template is verified as one of its instances.
    local = tmp_path / (f"{unit}1.service" if unit.endswith("@") else f"{unit}.service")
    local.write_text(text.replace("/opt/svc/venv/bin/twistd", str(twistd)))
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(local)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == "", result.stderr


def test_exampleEnvironmentsAreValid() -> None:
    """
    The example environment files configure daemons that would start.
    """
    auth = AuthConfig.fromEnvironment(readEnvironmentFile(ETC / "svc" / "svc-auth.env"))
    assert auth.environment == "production" and auth.grpcHost == "127.0.0.1"
    proxy = ProxyConfig.fromEnvironment(readEnvironmentFile(ETC / "svc" / "svc-proxy.env"))
    assert proxy.authGrpcAddr == "127.0.0.1:9091"
    memory = MemoryConfig.fromEnvironment(readEnvironmentFile(ETC / "svc" / "svc-memory.env"))
    assert memory.environment == "production" and memory.grpcHost == "127.0.0.1"
    assert (memory.port, memory.grpcPort) == (8082, 9092)
    # svc-worker's names the example providers file, whose [memory] table it
    # needs, and a journal under systemd's StateDirectory.
    workerEnvironment = readEnvironmentFile(ETC / "svc" / "svc-worker.env")
    assert workerEnvironment["SVC_PROVIDERS_FILE"] == "/etc/svc/providers.toml"
    assert workerEnvironment["SVC_USAGE_JOURNAL"].startswith("/var/lib/svc/")
    worker = WorkerConfig.fromEnvironment(
        {
            **workerEnvironment,
            "SVC_PROVIDERS_FILE": str(ETC / "svc" / "providers.toml"),
            "SVC_USAGE_JOURNAL": "",
            "OPENAI_API_KEY": "sk-example",
        }
    )
    assert worker.environment == "production" and worker.port == 8083
    assert (worker.memoryGrpcAddr, worker.authGrpcAddr) == ("127.0.0.1:9092", "127.0.0.1:9091")
    assert worker.memory.embeddingModel.name == "embed"
    assert worker.memory.extractionModel is not None


def test_exampleProvidersFileIsValid(tmp_path: Path) -> None:
    """
    etc/svc/providers.toml, which svc-proxy.env names (commented out), is a
    providers file svc-proxy would start with once its hosted provider's
    key is set; its models and fallbacks are as its comments say; it shows
    every key; and its commented org allow-list loads too once uncommented:
    the example cannot rot.
    """
    example = ETC / "svc" / "providers.toml"
    assert (
        "#SVC_PROVIDERS_FILE=/etc/svc/providers.toml" in (ETC / "svc" / "svc-proxy.env").read_text()
    )
    environment = {
        **readEnvironmentFile(ETC / "svc" / "svc-proxy.env"),
        "SVC_PROVIDERS_FILE": str(example),
        "OPENAI_API_KEY": "sk-example",
    }
    providers = ProxyConfig.fromEnvironment(environment).providers
    assert providers is not None
    assert set(providers.providers) == {"local", "openai"}
    org = "5b0c6a9e-0000-4000-8000-000000000001"
    fast = providers.modelFor("fast", org)
    assert fast is not None and fast.upstreamModel == "llama-3.1-8b"
    assert [model.name for model in providers.attempts(fast, org)] == ["fast", "hosted"]
    assert providers.providers["openai"].apiKey == "sk-example"
    # Decisions D13: the embedding model answers the embeddings route only.
    embed = providers.modelFor("embed", org, "embedding")
    assert embed is not None and embed.dimensions == 1536
    assert providers.modelFor("embed", org) is None
    text = example.read_text()
    for key in (
        "name", "base_url", "api_key_env", "timeout", "idle_timeout", "max_connections",
        "provider", "upstream_model", "orgs", "fallbacks", "kind", "dimensions",
    ):  # fmt: skip
        assert re.search(rf"^(# )?{key} = ", text, re.M), key
    allowList = tmp_path / "providers.toml"
    allowList.write_text(text.replace("\n# orgs = ", "\norgs = "))
    environment["SVC_PROVIDERS_FILE"] = str(allowList)
    restricted = ProxyConfig.fromEnvironment(environment).providers
    assert restricted is not None and restricted.models["hosted"].orgs == frozenset({org})
