"""
Providers of Anthropic's Messages API in the providers file (decisions
D14): C{api = "anthropic"} on a C{[[providers]]} entry, its default, the
records it makes, and one precise fault per mistake (a file that uses none
of it reads as before: tests/test_proxy_providers.py, unchanged).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from svcd.common.config import ConfigError
from svcd.metering.models import ANTHROPIC, OPENAI, Provider
from svcd.providers.providersfile import loadProviders
from svcd.providers.table import ProviderTable

KEY = "sk-ant-test-DO-NOT-PRINT-0123456789"
NOW = 1_700_000_000.0

CLAUDE = {
    "name": "claude",
    "base_url": "https://api.anthropic.example/v1/",
    "api_key_env": "SVC_TEST_KEY",
    "api": "anthropic",
}
LOCAL = {"name": "local", "base_url": "http://127.0.0.1:8000/v1"}
SONNET = {"name": "sonnet", "provider": "claude", "upstream_model": "claude-sonnet-4-5"}


def clock() -> float:
    return NOW


def tomlValue(value: Any) -> str:
    # Strings as JSON strings, which TOML's basic strings read alike.
    if isinstance(value, list):
        return "[" + ", ".join(tomlValue(item) for item in value) + "]"
    return json.dumps(value)


def writeFile(
    tmp_path: Path,
    providers: list[dict[str, Any]],
    models: list[dict[str, Any]],
    memory: dict[str, Any] | None = None,
) -> str:
    lines = []
    if memory is not None:
        lines.append("[memory]")
        lines += [f"{key} = {tomlValue(value)}" for key, value in memory.items()]
    for section, tables in (("providers", providers), ("models", models)):
        for table in tables:
            lines.append(f"\n[[{section}]]")
            lines += [f"{key} = {tomlValue(value)}" for key, value in table.items()]
    path = tmp_path / "providers.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def load(
    tmp_path: Path, providers: list[dict[str, Any]], models: list[dict[str, Any]]
) -> ProviderTable:
    return loadProviders(writeFile(tmp_path, providers, models), {"SVC_TEST_KEY": KEY}, clock)


def documentFault(
    tmp_path: Path,
    providers: list[dict[str, Any]],
    models: list[dict[str, Any]],
    memory: dict[str, Any] | None = None,
) -> str:
    """
    The one line of the fault that loading the file reports, without the
    variable and the file's path it starts with, and never the key.
    """
    path = writeFile(tmp_path, providers, models, memory)
    with pytest.raises(ConfigError) as caught:
        loadProviders(path, {"SVC_TEST_KEY": KEY}, clock)
    message = str(caught.value)
    assert message.startswith(f"SVC_PROVIDERS_FILE: {path}: "), message
    assert "\n" not in message and KEY not in message
    return message.removeprefix(f"SVC_PROVIDERS_FILE: {path}: ")


def test_anthropicProvider(tmp_path: Path) -> None:
    """
    api = "anthropic" makes a provider of Anthropic's Messages API, its
    messages at <base_url>/messages; without api a provider is OpenAI's.
    Its models fall back to either kind.
    """
    table = load(
        tmp_path,
        [CLAUDE, {**LOCAL, "api": "openai"}, {**LOCAL, "name": "plain"}],
        [
            {**SONNET, "fallbacks": ["gpt"], "max_output_tokens": 64000},
            {"name": "gpt", "provider": "local"},
            {"name": "other", "provider": "plain"},
        ],
    )
    claude = table.models["sonnet"].provider
    assert claude == Provider(
        "claude", "https://api.anthropic.example/v1", KEY, "SVC_TEST_KEY", api=ANTHROPIC
    )
    assert claude.messagesURL == "https://api.anthropic.example/v1/messages"
    assert table.models["gpt"].provider.api == OPENAI
    assert table.models["other"].provider.api == OPENAI
    assert [model.name for model in table.attempts(table.models["sonnet"], "")] == [
        "sonnet",
        "gpt",
    ]
    assert table.models["sonnet"].outputCeiling == 64000


FAULTS = [
    (
        "an unknown api",
        [{**CLAUDE, "api": "bedrock"}],
        [SONNET],
        'provider "claude": api must be "openai" or "anthropic", got "bedrock"',
    ),
    (
        "an api that is no string",
        [{**CLAUDE, "api": 1}],
        [SONNET],
        'provider "claude": api must be a string, got an integer',
    ),
    (
        "a base URL ending with /messages",
        [{**CLAUDE, "base_url": "https://api.anthropic.example/v1/messages"}],
        [SONNET],
        'provider "claude": base_url must not end with /messages: the proxy appends it'
        " (write the base, such as http://127.0.0.1:8000/v1)",
    ),
    (
        "an embedding model",
        [CLAUDE],
        [{**SONNET, "kind": "embedding"}],
        'model "sonnet": kind = "embedding" needs an OpenAI-compatible provider:'
        ' Anthropic\'s Messages API has no embeddings (provider api = "anthropic")',
    ),
    (
        "a cap field",
        [CLAUDE],
        [{**SONNET, "cap_field": "max_tokens"}],
        'model "sonnet": cap_field is for OpenAI-compatible providers; an Anthropic'
        " provider always takes the output cap as max_tokens (leave it out)",
    ),
]


@pytest.mark.parametrize(
    ("providers", "models", "problem"),
    [case[1:] for case in FAULTS],
    ids=[case[0] for case in FAULTS],
)
def test_anthropicFault(
    tmp_path: Path, providers: list[dict[str, Any]], models: list[dict[str, Any]], problem: str
) -> None:
    """
    Each mistake stops the proxy with one line naming it, as every other
    fault of the file.
    """
    assert documentFault(tmp_path, providers, models) == problem


def test_openAIBaseURLMayEndWithMessages(tmp_path: Path) -> None:
    """
    Only an Anthropic provider's base URL may not end with /messages (an
    OpenAI-compatible one may have any path but its own routes).
    """
    table = load(
        tmp_path, [{**LOCAL, "base_url": "http://h/messages"}], [{**SONNET, "provider": "local"}]
    )
    assert table.models["sonnet"].provider.baseURL == "http://h/messages"


def test_extractionModelOfAnOpenAIProvider(tmp_path: Path) -> None:
    """
    The worker's extraction asks for JSON output (response_format), which
    Anthropic's API cannot be asked for: its model is an OpenAI-compatible
    provider's, or the file is refused at start rather than every
    extraction later.
    """
    embed = {"name": "embed", "provider": "local", "kind": "embedding"}
    memory = {"embedding_model": "embed", "extraction_model": "sonnet"}
    assert documentFault(tmp_path, [CLAUDE, LOCAL], [SONNET, embed], memory) == (
        '[memory]: extraction_model "sonnet" is a model of an Anthropic provider; extraction'
        " asks for JSON output (response_format), which Anthropic's Messages API cannot be"
        " asked for: name a model of an OpenAI-compatible provider"
    )
