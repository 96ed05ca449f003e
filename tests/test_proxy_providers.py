"""
The providers file of decisions D9 (svcd.providers.providersfile, and
the table it yields, svcd.providers.table): what a good file gives, the
order in which fallbacks are tried, which models an organization sees,
and one precise error per fault, naming the file and never a key.
Hypothesis then checks that no input, however odd, fails with anything
but ConfigError.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from svcd.common.config import ConfigError
from svcd.metering.models import CHAT, EMBEDDING, Model, Provider
from svcd.providers.providersfile import loadProviders
from svcd.providers.table import (
    MemoryConfig,
    ProviderTable,
    modelsDocument,
)
from svcd.proxy.config import ProxyConfig

ROOT = Path(__file__).resolve().parents[1]
NOW = 1_700_000_000.75
KEY = "sk-test-DO-NOT-PRINT-0123456789"
ORG = "5b0c6a9e-0000-4000-8000-000000000001"
OTHER_ORG = "0e8f7d6c-0000-4000-8000-000000000002"
LOCAL = {"name": "local", "base_url": "http://127.0.0.1:8000/v1"}
FAST = {"name": "fast", "provider": "local"}


def clock() -> float:
    return NOW


def tomlValue(value: Any) -> str:
    """
    A value written as TOML; strings as JSON strings, which TOML's basic
    strings read the same way.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else {math.inf: "inf", -math.inf: "-inf"}.get(value, repr(value))
        )
    if isinstance(value, str):
        # TOML wants DEL escaped too; JSON leaves it raw.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(tomlValue(item) for item in value) + "]"
    assert isinstance(value, dict)
    pairs = (f"{tomlValue(key)} = {tomlValue(item)}" for key, item in value.items())
    return "{" + ", ".join(pairs) + "}"


def tomlDocument(
    providers: list[dict[str, Any]], models: list[dict[str, Any]], top: dict[str, Any] | None = None
) -> str:
    """
    A providers file: C{top}'s keys, then one [[providers]] or [[models]]
    table per entry.
    """
    lines = [f"{tomlValue(key)} = {tomlValue(value)}" for key, value in (top or {}).items()]
    for section, tables in (("providers", providers), ("models", models)):
        for table in tables:
            lines.append(f"\n[[{section}]]")
            lines += [f"{tomlValue(key)} = {tomlValue(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def writeFile(directory: Path, content: str | bytes) -> str:
    path = directory / "providers.toml"
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return str(path)


def fault(path: str, environ: dict[str, str] | None = None) -> str:
    """
    The problem that loading C{path} reports, after checking the shape
    every fault shares: the variable, then the file, on one line, without
    the key.
    """
    with pytest.raises(ConfigError) as caught:
        loadProviders(path, environ or {"SVC_TEST_KEY": KEY}, clock)
    message = str(caught.value)
    assert caught.value.variable == "SVC_PROVIDERS_FILE"
    assert message.startswith(f"SVC_PROVIDERS_FILE: {path}: "), message
    assert "\n" not in message and "\r" not in message
    assert KEY not in message and "DO-NOT-PRINT" not in message
    return message.removeprefix(f"SVC_PROVIDERS_FILE: {path}: ")


def documentFault(
    tmp_path: Path,
    providers: list[dict[str, Any]],
    models: list[dict[str, Any]],
    top: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> str:
    return fault(writeFile(tmp_path, tomlDocument(providers, models, top)), environ)


def load(
    tmp_path: Path, providers: list[dict[str, Any]], models: list[dict[str, Any]]
) -> ProviderTable:
    path = writeFile(tmp_path, tomlDocument(providers, models))
    return loadProviders(path, {"SVC_TEST_KEY": f" {KEY}\n"}, clock)


def test_goodFile(tmp_path: Path) -> None:
    """
    Every key is read: the key from the environment (trimmed), base_url
    without its trailing slash, durations as strings or numbers, defaults
    where keys are left out, org ids in canonical lowercase, and the load
    time in whole seconds.
    """
    table = load(
        tmp_path,
        [
            {
                "name": "remote",
                "base_url": "HTTPS://api.example.com:8443/v1/",
                "api_key_env": "SVC_TEST_KEY",
                "timeout": "2m",
                "idle_timeout": 1.5,
                "max_connections": 64,
            },
            {"name": "local", "base_url": "http://[::1]:8000/v1", "timeout": 90},
        ],
        [
            {"name": "fast", "provider": "remote", "fallbacks": ["slow"]},
            {
                "name": "slow",
                "provider": "local",
                "upstream_model": "meta-llama/Llama-3.1-8B-Instruct",
                "orgs": [ORG.upper()],
            },
        ],
    )
    remote, local = table.providers["remote"], table.providers["local"]
    assert remote == Provider(
        name="remote",
        baseURL="https://api.example.com:8443/v1",
        apiKey=KEY,
        apiKeyEnv="SVC_TEST_KEY",
        timeout=120.0,
        idleTimeout=1.5,
        maxConnections=64,
    )
    assert remote.chatCompletionsURL == "https://api.example.com:8443/v1/chat/completions"
    assert local == Provider(name="local", baseURL="http://[::1]:8000/v1", timeout=90.0)
    assert (local.apiKey, local.idleTimeout, local.maxConnections) == (None, 30.0, 16)
    assert list(table.models) == ["fast", "slow"]
    assert table.models["fast"] == Model("fast", remote, "fast", None, ("slow",))
    assert table.models["slow"] == Model(
        "slow", local, "meta-llama/Llama-3.1-8B-Instruct", frozenset({ORG}), ()
    )
    assert (table.loadedAt, table.path) == (1_700_000_000, str(tmp_path / "providers.toml"))


def test_capFieldAndCeiling(tmp_path: Path) -> None:
    """
    Decisions D12, amended: cap_field is max_completion_tokens unless the
    model says max_tokens; the largest cap a request may name is the
    model's max_output_tokens, else 1,048,576.
    """
    table = load(
        tmp_path,
        [LOCAL],
        [
            FAST,
            {"name": "old", "provider": "local", "cap_field": "max_tokens"},
            {
                "name": "new",
                "provider": "local",
                "cap_field": "max_completion_tokens",
                "max_output_tokens": 8192,
            },
        ],
    )
    fast, old, new = (table.models[name] for name in ("fast", "old", "new"))
    assert (fast.capField, old.capField, new.capField) == (
        "max_completion_tokens",
        "max_tokens",
        "max_completion_tokens",
    )
    assert (fast.outputCeiling, old.outputCeiling, new.outputCeiling) == (
        1_048_576,
        1_048_576,
        8192,
    )


def test_keyNeverShown(tmp_path: Path) -> None:
    """
    The key read from the environment is in no repr, of the provider, its
    models or the whole table.
    """
    table = load(tmp_path, [{**LOCAL, "api_key_env": "SVC_TEST_KEY"}], [FAST])
    assert table.providers["local"].apiKey == KEY
    for shown in (table, table.providers["local"], table.models["fast"]):
        assert KEY not in repr(shown)


def _chainTable(tmp_path: Path) -> ProviderTable:
    """
    a -> [b, c]; b -> [d, c] (b only for OTHER_ORG); c -> [e]; d; e
    (only for ORG); f has no fallbacks.
    """
    return load(
        tmp_path,
        [LOCAL],
        [
            {"name": "a", "provider": "local", "fallbacks": ["b", "c"]},
            {"name": "b", "provider": "local", "fallbacks": ["d", "c"], "orgs": [OTHER_ORG]},
            {"name": "c", "provider": "local", "fallbacks": ["e"]},
            {"name": "d", "provider": "local"},
            {"name": "e", "provider": "local", "orgs": [ORG]},
            {"name": "f", "provider": "local"},
        ],
    )


def test_attemptsDepthFirst(tmp_path: Path) -> None:
    """
    The model, then each fallback followed at once by its own fallbacks,
    each model once: c is reached through b before a's own c.
    """
    table = _chainTable(tmp_path)
    names = lambda models: [model.name for model in models]  # noqa: E731
    anyOrg = str(uuid.uuid4())
    assert names(table.attempts(table.models["a"], OTHER_ORG)) == ["a", "b", "d", "c"]
    assert names(table.attempts(table.models["b"], OTHER_ORG)) == ["b", "d", "c"]
    assert names(table.attempts(table.models["c"], anyOrg)) == ["c"]
    assert names(table.attempts(table.models["f"], anyOrg)) == ["f"]


def test_attemptsFilteredByOrg(tmp_path: Path) -> None:
    """
    A model the organization may not use is left out, but the fallbacks
    reached through it stay in their place; an org id in capitals is the
    same org.
    """
    table = _chainTable(tmp_path)
    names = lambda models: [model.name for model in models]  # noqa: E731
    assert names(table.attempts(table.models["a"], ORG)) == ["a", "d", "c", "e"]
    assert names(table.attempts(table.models["a"], ORG.upper())) == ["a", "d", "c", "e"]
    assert names(table.attempts(table.models["a"], str(uuid.uuid4()))) == ["a", "d", "c"]


def test_attemptsOfAModelBuiltElsewhere(tmp_path: Path) -> None:
    """
    attempts() of a Model that is not the table's own object still follows
    the table's fallbacks.
    """
    table = _chainTable(tmp_path)
    copy = Model("c", table.providers["local"], fallbacks=("e",))
    assert [model.name for model in table.attempts(copy, ORG)] == ["c", "e"]


def test_modelFor(tmp_path: Path) -> None:
    """
    A listed model for an allowed org is found; an unlisted model, and a
    model listed for other orgs only, are both None (D9: both answer 501,
    with no hint that the model exists elsewhere).
    """
    table = _chainTable(tmp_path)
    assert table.modelFor("a", ORG) is table.models["a"]
    assert table.modelFor("e", ORG) is table.models["e"]
    assert table.modelFor("e", ORG.upper()) is table.models["e"]
    assert table.modelFor("e", OTHER_ORG) is None
    assert table.modelFor("gpt-4o", ORG) is None
    assert table.modelFor("A", ORG) is None


def test_modelsList(tmp_path: Path) -> None:
    """
    GET /v1/models' body: OpenAI's list shape, the org's models in the
    file's order, owned by their provider, created at the load time.
    """
    table = load(
        tmp_path,
        [LOCAL, {"name": "remote", "base_url": "https://api.example.com/v1"}],
        [
            {"name": "z-first", "provider": "remote"},
            {"name": "mine", "provider": "local", "orgs": [ORG]},
            {"name": "theirs", "provider": "local", "orgs": [OTHER_ORG]},
        ],
    )
    assert modelsDocument(table, ORG) == {
        "object": "list",
        "data": [
            {"id": "z-first", "object": "model", "created": 1_700_000_000, "owned_by": "remote"},
            {"id": "mine", "object": "model", "created": 1_700_000_000, "owned_by": "local"},
        ],
    }
    assert [model.name for model in table.modelsFor(OTHER_ORG)] == ["z-first", "theirs"]
    assert modelsDocument(table, str(uuid.uuid4()))["data"][0]["id"] == "z-first"
    assert len(modelsDocument(table, str(uuid.uuid4()))["data"]) == 1


def test_proxyConfig(tmp_path: Path) -> None:
    """
    ProxyConfig reads SVC_PROVIDERS_FILE with the clock it is given;
    unset or blank means no providers (Phase 1 exactly); a bad file is a
    ConfigError for SVC_PROVIDERS_FILE.
    """
    base = {"SVC_AUTH_GRPC_ADDR": "127.0.0.1:9091"}
    assert ProxyConfig.fromEnvironment(base).providers is None
    assert ProxyConfig.fromEnvironment({**base, "SVC_PROVIDERS_FILE": " "}).providers is None
    path = writeFile(tmp_path, tomlDocument([LOCAL], [FAST]))
    config = ProxyConfig.fromEnvironment({**base, "SVC_PROVIDERS_FILE": path}, clock)
    assert config.providers is not None
    assert (list(config.providers.models), config.providers.loadedAt) == (["fast"], 1_700_000_000)
    with pytest.raises(ConfigError) as caught:
        ProxyConfig.fromEnvironment({**base, "SVC_PROVIDERS_FILE": str(tmp_path / "none")})
    assert caught.value.variable == "SVC_PROVIDERS_FILE"


# One case per fault of the file's content: the tables, and the problem
# reported (after "SVC_PROVIDERS_FILE: <path>: ").
_LONG = "m" * 129
_PROVIDER_KEYS = "name, base_url, api_key_env, timeout, idle_timeout, max_connections"
_MODEL_KEYS = (
    "name, provider, upstream_model, orgs, fallbacks, max_output_tokens, price, cap_field,"
    " kind, dimensions"
)
_NAME_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit"
_MODEL_RULE = "letters, digits and . _ : / @ + -, starting with a letter or digit"
CONTENT_FAULTS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]], str]] = [
    # The file's shape.
    ("no providers", [], [FAST], "has no [[providers]] table"),
    ("no models", [LOCAL], [], "has no [[models]] table"),
    # Unknown keys: a typo never passes silently.
    (
        "typo in a provider",
        [{**LOCAL, "timout": "5s"}],
        [FAST],
        f'provider "local": unknown key "timout" (expected {_PROVIDER_KEYS})',
    ),
    (
        "typo in a model",
        [LOCAL],
        [{**FAST, "fallback": ["x"]}],
        f'model "fast": unknown key "fallback" (expected {_MODEL_KEYS})',
    ),
    (
        "key in the file",
        [{**LOCAL, "api_key": KEY}],
        [FAST],
        f'provider "local": unknown key "api_key" (expected {_PROVIDER_KEYS}); a key never '
        "sits in the file: name the environment variable that holds it with api_key_env",
    ),
    (
        "unnamed table with a typo",
        [{"base_url": "http://h/v1", "nmae": "x"}],
        [FAST],
        f'[[providers]] table 1: unknown key "nmae" (expected {_PROVIDER_KEYS})',
    ),
    # Names.
    (
        "provider without name",
        [{"base_url": "http://h"}],
        [FAST],
        "[[providers]] table 1: name is required",
    ),
    (
        "empty provider name",
        [{**LOCAL, "name": ""}],
        [FAST],
        "[[providers]] table 1: name must not be empty",
    ),
    (
        "provider name of another type",
        [{**LOCAL, "name": 5}],
        [FAST],
        "[[providers]] table 1: name must be a string, got an integer",
    ),
    (
        "provider name with a space",
        [{**LOCAL, "name": "my local"}],
        [FAST],
        f'[[providers]] table 1: name "my local" may hold only {_NAME_RULE}',
    ),
    (
        "provider name too long",
        [{**LOCAL, "name": "p" * 65}],
        [FAST],
        "[[providers]] table 1: name is longer than 64 characters",
    ),
    (
        "model name with a newline",
        [LOCAL],
        [{**FAST, "name": "fa\nst"}],
        f'[[models]] table 1: name "fa\\nst" may hold only {_MODEL_RULE}',
    ),
    (
        "model name too long",
        [LOCAL],
        [{**FAST, "name": _LONG}],
        "[[models]] table 1: name is longer than 128 characters",
    ),
    (
        "model name starting with a dash",
        [LOCAL],
        [{**FAST, "name": "-fast"}],
        f'[[models]] table 1: name "-fast" may hold only {_MODEL_RULE}',
    ),
    (
        "upstream model too long",
        [LOCAL],
        [{**FAST, "upstream_model": "u" * 257}],
        'model "fast": upstream_model is longer than 256 characters',
    ),
    (
        "upstream model with a space",
        [LOCAL],
        [{**FAST, "upstream_model": "llama 3"}],
        f'model "fast": upstream_model "llama 3" may hold only {_MODEL_RULE}',
    ),
    (
        "empty upstream model",
        [LOCAL],
        [{**FAST, "upstream_model": ""}],
        'model "fast": upstream_model must not be empty',
    ),
    # Duplicates and references.
    (
        "duplicate provider",
        [LOCAL, {**LOCAL, "base_url": "http://127.0.0.2/v1"}],
        [FAST],
        'provider "local" is defined twice',
    ),
    ("duplicate model", [LOCAL], [FAST, FAST], 'model "fast" is defined twice'),
    (
        "unknown provider",
        [LOCAL],
        [{**FAST, "provider": "nope"}],
        'model "fast": provider "nope" is not defined',
    ),
    ("model without provider", [LOCAL], [{"name": "fast"}], 'model "fast": provider is required'),
    (
        "provider of another type",
        [LOCAL],
        [{**FAST, "provider": 3}],
        'model "fast": provider must be a string, got an integer',
    ),
    (
        "unknown fallback",
        [LOCAL],
        [{**FAST, "fallbacks": ["slow"]}],
        'model "fast": fallback "slow" is not defined',
    ),
    (
        "fallback cycle",
        [LOCAL],
        [
            {**FAST, "fallbacks": ["slow"]},
            {"name": "slow", "provider": "local", "fallbacks": ["slower"]},
            {"name": "slower", "provider": "local", "fallbacks": ["slow"]},
        ],
        'fallbacks form a cycle: "slow" -> "slower" -> "slow"',
    ),
    (
        "fallback to itself",
        [LOCAL],
        [{**FAST, "fallbacks": ["fast"]}],
        'fallbacks form a cycle: "fast" -> "fast"',
    ),
    (
        "fallbacks of another type",
        [LOCAL],
        [{**FAST, "fallbacks": "slow"}],
        'model "fast": fallbacks must be an array of model names (strings)',
    ),
    (
        "fallback listed twice",
        [LOCAL],
        [{**FAST, "fallbacks": ["slow", "slow"]}, {"name": "slow", "provider": "local"}],
        'model "fast": fallbacks: "slow" is listed twice',
    ),
    (
        "too many fallbacks",
        [LOCAL],
        [{**FAST, "fallbacks": [f"m{number}" for number in range(17)]}],
        'model "fast": fallbacks lists more than 16 models',
    ),
    # base_url.
    ("no base_url", [{"name": "local"}], [FAST], 'provider "local": base_url is required'),
    (
        "base_url of another type",
        [{**LOCAL, "base_url": ["http://h"]}],
        [FAST],
        'provider "local": base_url must be a string, got an array',
    ),
    (
        "base_url with another scheme",
        [{**LOCAL, "base_url": "ftp://h/v1"}],
        [FAST],
        'provider "local": base_url must start with http:// or https://',
    ),
    (
        "base_url without scheme",
        [{**LOCAL, "base_url": "127.0.0.1:8000/v1"}],
        [FAST],
        'provider "local": base_url must start with http:// or https://',
    ),
    (
        "base_url without host",
        [{**LOCAL, "base_url": "http:///v1"}],
        [FAST],
        'provider "local": base_url has no host',
    ),
    (
        "base_url with a bad host",
        [{**LOCAL, "base_url": "http://a..b/v1"}],
        [FAST],
        'provider "local": base_url has a host that is neither a name nor an IP address',
    ),
    (
        "base_url with a query",
        [{**LOCAL, "base_url": f"https://h/v1?api_key={KEY}"}],
        [FAST],
        'provider "local": base_url must not have a query (?...)',
    ),
    (
        "base_url with a fragment",
        [{**LOCAL, "base_url": f"https://h/v1#{KEY}"}],
        [FAST],
        'provider "local": base_url must not have a fragment (#...)',
    ),
    (
        "base_url with credentials",
        [{**LOCAL, "base_url": f"https://user:{KEY}@h/v1"}],
        [FAST],
        'provider "local": base_url must not hold credentials (user:password@); the key '
        "belongs in the variable named by api_key_env",
    ),
    (
        "base_url with a bad port",
        [{**LOCAL, "base_url": "http://h:99999/v1"}],
        [FAST],
        'provider "local": base_url has a port that is not a number from 1 to 65535',
    ),
    (
        "base_url with an empty port",
        [{**LOCAL, "base_url": "http://h:/v1"}],
        [FAST],
        'provider "local": base_url has a port that is not a number from 1 to 65535',
    ),
    (
        "base_url with a space",
        [{**LOCAL, "base_url": "http://h/my v1"}],
        [FAST],
        'provider "local": base_url must be ASCII without spaces or control characters '
        "(write an international host name in its xn-- form)",
    ),
    (
        "base_url with the path of the call",
        [{**LOCAL, "base_url": "http://h/v1/chat/completions/"}],
        [FAST],
        'provider "local": base_url must not end with /chat/completions: the proxy appends '
        "it (write the base, such as http://127.0.0.1:8000/v1)",
    ),
    (
        "base_url too long",
        [{**LOCAL, "base_url": "http://h/" + "p" * 2048}],
        [FAST],
        'provider "local": base_url is longer than 2048 characters',
    ),
    # Durations.
    (
        "timeout in words",
        [{**LOCAL, "timeout": "fast"}],
        [FAST],
        'provider "local": timeout must be a duration such as 50ms, 2s or 1m, got "fast"',
    ),
    (
        "timeout in hours",
        [{**LOCAL, "timeout": "1h"}],
        [FAST],
        'provider "local": timeout must be a duration such as 50ms, 2s or 1m, got "1h"',
    ),
    (
        "zero timeout",
        [{**LOCAL, "timeout": "0s"}],
        [FAST],
        'provider "local": timeout must be greater than zero, got "0s"',
    ),
    (
        "negative idle timeout",
        [{**LOCAL, "idle_timeout": -1.5}],
        [FAST],
        'provider "local": idle_timeout must be greater than zero, got -1.5',
    ),
    (
        "timeout not a number",
        [{**LOCAL, "timeout": math.nan}],
        [FAST],
        'provider "local": timeout must be greater than zero, got nan',
    ),
    (
        "endless timeout",
        [{**LOCAL, "timeout": math.inf}],
        [FAST],
        'provider "local": timeout must be at most 3600s (one hour), got inf',
    ),
    (
        "timeout over an hour",
        [{**LOCAL, "idle_timeout": "61m"}],
        [FAST],
        'provider "local": idle_timeout must be at most 3600s (one hour), got "61m"',
    ),
    (
        "timeout in fullwidth digits",
        [{**LOCAL, "timeout": "\uff15s"}],
        [FAST],
        'provider "local": timeout must be a duration such as 50ms, 2s or 1m, got "\\uff15s"',
    ),
    (
        "max_output_tokens as a string",
        [LOCAL],
        [{**FAST, "max_output_tokens": "\uff11\uff10\uff12\uff14"}],
        'model "fast": max_output_tokens must be an integer, got a string',
    ),
    (
        "timeout of another type",
        [{**LOCAL, "timeout": True}],
        [FAST],
        'provider "local": timeout must be a duration such as "60s", got a boolean',
    ),
    # max_connections.
    (
        "no connections",
        [{**LOCAL, "max_connections": 0}],
        [FAST],
        'provider "local": max_connections must be from 1 to 1024, got 0',
    ),
    (
        "too many connections",
        [{**LOCAL, "max_connections": 2**70}],
        [FAST],
        'provider "local": max_connections must be from 1 to 1024, got a very large number',
    ),
    (
        "connections as a string",
        [{**LOCAL, "max_connections": "16"}],
        [FAST],
        'provider "local": max_connections must be an integer, got a string',
    ),
    (
        "connections as a float",
        [{**LOCAL, "max_connections": 1.5}],
        [FAST],
        'provider "local": max_connections must be an integer, got a float',
    ),
    # orgs.
    (
        "org not a UUID",
        [LOCAL],
        [{**FAST, "orgs": ["acme"]}],
        'model "fast": orgs: "acme" is not an organization UUID',
    ),
    (
        "org without hyphens",
        [LOCAL],
        [{**FAST, "orgs": [ORG.replace("-", "")]}],
        f'model "fast": orgs: "{ORG.replace("-", "")}" is not an organization UUID',
    ),
    (
        "org listed twice",
        [LOCAL],
        [{**FAST, "orgs": [ORG, ORG.upper()]}],
        f'model "fast": orgs: organization {ORG} is listed twice',
    ),
    (
        "no org",
        [LOCAL],
        [{**FAST, "orgs": []}],
        'model "fast": orgs is empty, so no organization could use the model (leave orgs '
        "out to allow every organization)",
    ),
    (
        "orgs of another type",
        [LOCAL],
        [{**FAST, "orgs": ORG}],
        'model "fast": orgs must be an array of organization UUIDs (strings)',
    ),
    # api_key_env.
    (
        "key variable unset",
        [{**LOCAL, "api_key_env": "SVC_TEST_UNSET"}],
        [FAST],
        'provider "local": api_key_env: SVC_TEST_UNSET is not set in the environment',
    ),
    (
        "key variable empty",
        [{**LOCAL, "api_key_env": "SVC_TEST_EMPTY"}],
        [FAST],
        'provider "local": api_key_env: SVC_TEST_EMPTY is empty in the environment',
    ),
    (
        "key with a space",
        [{**LOCAL, "api_key_env": "SVC_TEST_SPACED"}],
        [FAST],
        'provider "local": api_key_env: the value of SVC_TEST_SPACED cannot be sent as a key '
        "(at most 4096 visible ASCII characters, no spaces)",
    ),
    (
        "key with a newline",
        [{**LOCAL, "api_key_env": "SVC_TEST_NEWLINE"}],
        [FAST],
        'provider "local": api_key_env: the value of SVC_TEST_NEWLINE cannot be sent as a '
        "key (at most 4096 visible ASCII characters, no spaces)",
    ),
    (
        "key variable not a name",
        [{**LOCAL, "api_key_env": "1KEY"}],
        [FAST],
        'provider "local": api_key_env "1KEY" may hold only letters, digits and \'_\', '
        "not starting with a digit",
    ),
    (
        "key variable empty in the file",
        [{**LOCAL, "api_key_env": ""}],
        [FAST],
        'provider "local": api_key_env must not be empty',
    ),
    # Decisions D12, amended: the key the output cap is sent under.
    (
        "cap field of another name",
        [LOCAL],
        [{**FAST, "cap_field": "max_output_tokens"}],
        'model "fast": cap_field must be "max_completion_tokens" or "max_tokens",'
        ' got "max_output_tokens"',
    ),
    (
        "cap field in capitals",
        [LOCAL],
        [{**FAST, "cap_field": "MAX_TOKENS"}],
        'model "fast": cap_field must be "max_completion_tokens" or "max_tokens", got "MAX_TOKENS"',
    ),
    (
        "cap field not a string",
        [LOCAL],
        [{**FAST, "cap_field": 1}],
        'model "fast": cap_field must be a string, got an integer',
    ),
]


@pytest.mark.parametrize(
    ("providers", "models", "problem"),
    [case[1:] for case in CONTENT_FAULTS],
    ids=[case[0] for case in CONTENT_FAULTS],
)
def test_contentFault(
    tmp_path: Path, providers: list[dict[str, Any]], models: list[dict[str, Any]], problem: str
) -> None:
    """
    Each fault of the file's content is one ConfigError naming the file
    and the fault, never the key (nor a URL that may hold one).
    """
    environ = {
        "SVC_TEST_KEY": KEY,
        "SVC_TEST_EMPTY": " \t",
        "SVC_TEST_SPACED": f"{KEY} {KEY}",
        "SVC_TEST_NEWLINE": f"{KEY}\nX-Injected: 1",
    }
    assert documentFault(tmp_path, providers, models, environ=environ) == problem


@pytest.mark.parametrize(
    ("top", "problem"),
    [
        (
            {"provider": []},
            'unknown key "provider" (expected providers, models, memory)',
        ),
        ({"providers": "local"}, "providers must be written as [[providers]] tables, got a string"),
        (
            {"providers": {"name": "x"}},
            "providers must be written as [[providers]] tables, got a table",
        ),
        ({"providers": [1]}, "providers must be written as [[providers]] tables, got an array"),
        ({"providers": []}, "has no [[providers]] table"),
    ],
)
def test_topLevelFault(tmp_path: Path, top: dict[str, Any], problem: str) -> None:
    """
    The top level holds [[providers]] and [[models]] tables and nothing
    else.
    """
    models = [FAST] if "providers" in top else []
    providers = [] if "providers" in top else [LOCAL]
    assert documentFault(tmp_path, providers, models, top=top) == problem


def test_missingFile(tmp_path: Path) -> None:
    """
    A file that does not exist stops the proxy, with the system's reason.
    """
    path = str(tmp_path / "absent.toml")
    assert fault(path) == "cannot read the file: No such file or directory"


def test_directory(tmp_path: Path) -> None:
    """
    A directory is not a providers file.
    """
    assert fault(str(tmp_path)) == "cannot read the file: it is a directory"


def test_notARegularFile(tmp_path: Path) -> None:
    """
    A FIFO or a device is refused without being opened (opening a FIFO
    would wait for a writer forever).
    """
    fifo = tmp_path / "providers.fifo"
    os.mkfifo(fifo)
    assert fault(str(fifo)) == "cannot read the file: it is not a regular file"


def test_unreadableFile(tmp_path: Path) -> None:
    """
    A file the proxy may not read stops it. As root (which reads any
    file), the check runs in a child without the capabilities that let
    root ignore file permissions.
    """
    path = writeFile(tmp_path, tomlDocument([LOCAL], [FAST]))
    os.chmod(path, 0)
    program = (
        "import sys\n"
        "from svcd.common.config import ConfigError\n"
        "from svcd.providers.providersfile import loadProviders\n"
        "try:\n"
        "    loadProviders(sys.argv[1], {}, lambda: 0.0)\n"
        "except ConfigError as error:\n"
        "    print(error)\n"
    )
    command = [sys.executable, "-c", program, path]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv is not None, "setpriv is missing: install Debian's util-linux"
        command = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *command]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (
        f"SVC_PROVIDERS_FILE: {path}: cannot read the file: Permission denied\n"
    )


def test_notUTF8(tmp_path: Path) -> None:
    """
    Bytes that are not UTF-8 are refused with their line.
    """
    path = writeFile(tmp_path, b'# providers\n[[providers]]\nname = "caf\xe9"\n')
    assert fault(path) == "is not UTF-8 text (line 3)"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('[[providers]]\nname = "local\n', "Illegal character '\\n' (at line 2, column 14)"),
        (
            "[[providers]]\nname local\n",
            "Expected '=' after a key in a key/value pair (at line 2, column 6)",
        ),
        (
            "[[providers]\n",
            "Expected ']]' at the end of an array declaration (at line 1, column 12)",
        ),
        ("a = [1 2]\n", "Unclosed array (at line 1, column 8)"),
        ("a = " + "[" * 100_000, "arrays or tables are nested too deeply"),
        ("a = " + "9" * 5000, "a number has too many digits"),
    ],
    ids=["unterminated string", "no equals sign", "bad header", "unclosed array", "deep", "digits"],
)
def test_notTOML(tmp_path: Path, content: str, problem: str) -> None:
    """
    A file that is not TOML is refused with tomllib's words, line and
    column; tomllib's recursion and integer limits are faults too, not
    tracebacks.
    """
    assert fault(writeFile(tmp_path, content)) == f"is not valid TOML: {problem}"


def test_tomlMessageCut(tmp_path: Path) -> None:
    """
    tomllib quotes a key it cannot accept; a long one is cut, keeping the
    line and column.
    """
    key = "k" * 500
    problem = fault(writeFile(tmp_path, f"[{key}]\n[{key}]\n"))
    words = "Cannot declare ('" + "k" * (120 - len("Cannot declare ('")) + "..."
    assert problem == f"is not valid TOML: {words} (at line 2, column 502)"


def test_fileTooLarge(tmp_path: Path) -> None:
    """
    A file over 1 MiB is refused before it is parsed.
    """
    path = writeFile(tmp_path, "#" * (1024 * 1024) + "\n")
    assert fault(path) == "the file is larger than 1048576 bytes"


def test_oddPathShownOnOneLine(tmp_path: Path) -> None:
    """
    A path with a newline in it is shown escaped, so the error stays one
    line; a path with a NUL character is refused as a ConfigError too.
    """
    path = str(tmp_path / "a\nb.toml")
    with pytest.raises(ConfigError) as caught:
        loadProviders(path, {}, clock)
    assert str(caught.value) == (
        f"SVC_PROVIDERS_FILE: {path!a}: cannot read the file: No such file or directory"
    )
    with pytest.raises(ConfigError) as caught:
        loadProviders("a\x00b", {}, clock)
    assert str(caught.value) == (
        "SVC_PROVIDERS_FILE: 'a\\x00b': cannot read the file: the path is not valid"
    )


# Hypothesis: TOML-ish input, from raw text to good documents with a few
# odd values, never fails with anything but ConfigError.
_ENVIRON = {"KEY": KEY, "EMPTY": "", "SPACED": "a b"}
_scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_anything = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
_GOOD_PROVIDER = {
    "name": st.sampled_from(["local", "remote", "p.1", "P_2-x"]),
    "base_url": st.sampled_from(
        ["http://127.0.0.1:8000/v1", "https://h.example/v1/", "http://[::1]:80", "http://h"]
    ),
    "api_key_env": st.just("KEY"),
    "timeout": st.sampled_from(["60s", "500ms", "2m", "10", " 1.5s "]) | st.floats(0.001, 3600),
    "idle_timeout": st.sampled_from(["30s", "0.5"]) | st.integers(1, 3600),
    "max_connections": st.integers(1, 1024),
}
_ODD_VALUES = {
    "name": st.sampled_from(["", "x y", "-a", "a" * 129, "local"]),
    "base_url": st.sampled_from(
        [
            "http://[::1",
            "http://[::1]x",
            "http://[]",
            "http://[zz]",
            "http://h:0",
            "http://h:x",
            "http://h:",
            "http://@h",
            "ftp://h",
            "http://h/chat/completions",
            "http://h/v1/embeddings",
            "http://h/?",
            "http://",
            "http://é.example",
            "http://a..b",
            "",
        ]
    ),
    "api_key_env": st.sampled_from(["EMPTY", "SPACED", "UNSET", "1X", "", "K" * 129]),
    "timeout": st.sampled_from(["0", "-1s", "1h", "", "9" * 400, "61m", "1e3", "٣s"]),
    "idle_timeout": st.floats() | st.integers(-(2**70), 2**70),
    "max_connections": st.integers(-(2**70), 2**70),
    "upstream_model": st.sampled_from(["", "a b", "u" * 257]),
    "orgs": st.lists(st.sampled_from([ORG, ORG.upper(), "acme", ORG.replace("-", "")]), max_size=3),
    "fallbacks": st.lists(st.sampled_from(["m0", "m1", "m2", "m3", "nope", ""]), max_size=17),
    "provider": st.sampled_from(["nope", "", "LOCAL"]),
    # Decisions D13: an embedding model among chat ones (its fallbacks, a
    # chat model's fallback), and odd kinds and lengths.
    "kind": st.sampled_from(["embedding", "chat", "Embedding", ""]),
    "dimensions": st.integers(-(2**70), 2**70),
    "surplus": _anything,
    "api_key": st.just(KEY),
    # Decisions D15: deployments and how a request chooses among them.
    "deployments": st.lists(
        st.fixed_dictionaries(
            {"provider": st.sampled_from(["local", "remote", "nope", ""])},
            optional={
                "upstream_model": st.sampled_from(["m", "a b", ""]),
                "weight": st.sampled_from([0, -1, 1, 2.5, 10**7, "1", True]),
                "surplus": _anything,
            },
        ),
        max_size=34,
    ),
    "routing": st.sampled_from(["weighted", "least_busy", "latency", "fastest", ""]),
    "max_attempts": st.integers(-(2**70), 2**70),
    "first_byte_timeout": st.sampled_from(["0", "1s", "2h", ""]) | st.floats(),
    "cooldown": st.sampled_from(["0", "10s", "61m", ""]) | st.floats(),
    "cooldown_failures": st.integers(-(2**70), 2**70),
}


@st.composite
def _documents(draw: st.DrawFn) -> str:
    """
    A good document (providers, then models whose fallbacks only point
    further down, so there is no cycle), then a few keys given an odd
    value, another type or removed.
    """
    providers = draw(
        st.lists(
            st.fixed_dictionaries(
                {key: _GOOD_PROVIDER[key] for key in ("name", "base_url")},
                optional={
                    key: value
                    for key, value in _GOOD_PROVIDER.items()
                    if key not in ("name", "base_url")
                },
            ),
            min_size=1,
            max_size=3,
            unique_by=lambda table: table["name"],
        )
    )
    names = [table["name"] for table in providers]
    count = draw(st.integers(1, 4))
    models: list[dict[str, Any]] = []
    for number in range(count):
        model: dict[str, Any] = {"name": f"m{number}", "provider": draw(st.sampled_from(names))}
        later = [f"m{other}" for other in range(number + 1, count)]
        if len(later) > 0 and draw(st.booleans()):
            model["fallbacks"] = draw(st.lists(st.sampled_from(later), unique=True))
        if draw(st.booleans()):
            model["orgs"] = draw(
                st.lists(st.sampled_from([ORG, OTHER_ORG]), min_size=1, unique=True)
            )
        if draw(st.booleans()):
            model["upstream_model"] = draw(st.sampled_from(["llama3.1:8b", "org/m@v1"]))
        if draw(st.booleans()):
            # Decisions D15: the model served by several deployments.
            served = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
            model["deployments"] = [
                {"provider": name, "weight": draw(st.integers(1, 5))} for name in served
            ]
            del model["provider"]
        models.append(model)
    for _ in range(draw(st.integers(0, 2))):
        table = draw(st.sampled_from(providers + models))
        key = draw(st.sampled_from(sorted(_ODD_VALUES)))
        change = draw(st.sampled_from(["odd", "type", "remove"]))
        if change == "remove":
            table.pop(key, None)
        else:
            table[key] = draw(_ODD_VALUES[key] if change == "odd" else _anything)
    tops: list[dict[str, Any]] = [{}, {}, {}, {"other": 1}, {"providers": []}, {"models": {"a": 1}}]
    top = draw(st.sampled_from(tops))
    return tomlDocument(providers, models, top)


_fragments = st.sampled_from(
    [
        "[[providers]]",
        "[[models]]",
        "[providers]",
        'name = "local"',
        'name = "fast"',
        'provider = "local"',
        'base_url = "http://127.0.0.1/v1"',
        'fallbacks = ["fast"]',
        "timeout = 1e999",
        'api_key_env = "KEY"',
        "a = [",
        "]",
        "= 1",
        '"\\ud800"',
        "x = 1979-05-27T07:32:00Z",
        "\x00",
    ]
)
_texts = st.one_of(
    _documents(),
    st.lists(_fragments | st.text(max_size=10), max_size=12).map("\n".join),
    st.text(),
)


@settings(
    max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(_texts)
def test_onlyConfigErrors(tmp_path: Path, content: str) -> None:
    """
    Whatever the file holds, loading it gives a table or a ConfigError of
    one line naming the file, never the key; a table it gives is coherent
    (every fallback defined, attempts finite and starting with the model).
    """
    path = writeFile(tmp_path, content.encode("utf-8", "surrogatepass"))
    try:
        table = loadProviders(path, _ENVIRON, clock)
    except ConfigError as error:
        message = str(error)
        assert message.startswith(f"SVC_PROVIDERS_FILE: {path}: ")
        assert "\n" not in message and KEY not in message
        return
    for model in table.models.values():
        assert model.provider is table.providers[model.provider.name]
        assert model.deployments[0].provider is model.provider
        assert model.deployments[0].upstreamModel == model.upstreamModel
        for deployment in model.deployments:
            assert deployment.provider is table.providers[deployment.provider.name]
        assert len({deployment.name for deployment in model.deployments}) == len(model.deployments)
        assert all(name in table.models for name in model.fallbacks)
        chain = table.attempts(model, ORG)
        assert len(chain) <= len(table.models)
        assert (chain[:1] == (model,)) == model.allows(ORG)
        assert all(candidate.allows(ORG) for candidate in chain)


# Decisions D13: embedding models.

EMBED = {"name": "embed", "provider": "local", "kind": "embedding"}


def test_embeddingModels(tmp_path: Path) -> None:
    """
    kind is "chat" unless the file says "embedding"; an embedding model
    may give its dimensions and a price without output (0: it has no
    output tokens); fallbacks of an embedding model are embedding models.
    Each route finds only the models of its kind.
    """
    table = load(
        tmp_path,
        [LOCAL],
        [
            FAST,
            {**FAST, "name": "chatty", "kind": "chat"},
            {**EMBED, "dimensions": 1536, "price": {"input": "0.02"}, "fallbacks": ["spare"]},
            {**EMBED, "name": "spare", "upstream_model": "nomic-embed-text"},
        ],
    )
    fast, chatty, embed, spare = (
        table.models[name] for name in ("fast", "chatty", "embed", "spare")
    )
    assert (fast.kind, chatty.kind, embed.kind) == (CHAT, CHAT, EMBEDDING)
    assert (fast.dimensions, embed.dimensions, spare.dimensions) == (None, 1536, None)
    assert embed.price is not None
    assert (embed.price.input, embed.price.output, embed.price.cachedInput) == (
        20_000_000,
        0,
        20_000_000,
    )
    assert table.attempts(embed, ORG) == (embed, spare)
    assert table.modelFor("embed", ORG, EMBEDDING) is embed
    assert table.modelFor("embed", ORG) is None
    assert table.modelFor("fast", ORG) is fast
    assert table.modelFor("fast", ORG, EMBEDDING) is None
    assert fast.provider.embeddingsURL == "http://127.0.0.1:8000/v1/embeddings"


def test_theModelsListHoldsEveryKind(tmp_path: Path) -> None:
    """
    GET /v1/models lists embedding models beside chat models, in the same
    shape (OpenAI's list says nothing of a model's kind either).
    """
    table = load(tmp_path, [LOCAL], [FAST, EMBED])
    assert modelsDocument(table, ORG)["data"] == [
        {"id": "fast", "object": "model", "created": 1_700_000_000, "owned_by": "local"},
        {"id": "embed", "object": "model", "created": 1_700_000_000, "owned_by": "local"},
    ]


EMBEDDING_FAULTS: list[tuple[str, list[dict[str, Any]], str]] = [
    (
        "kind not a string",
        [{**FAST, "kind": 1}],
        'model "fast": kind must be a string, got an integer',
    ),
    (
        "unknown kind",
        [{**FAST, "kind": "completion"}],
        'model "fast": kind must be "chat" or "embedding", got "completion"',
    ),
    (
        "dimensions of a chat model",
        [{**FAST, "dimensions": 64}],
        'model "fast": dimensions is for embedding models only (kind = "embedding")',
    ),
    (
        "dimensions zero",
        [{**EMBED, "dimensions": 0}],
        'model "embed": dimensions must be from 1 to 65536, got 0',
    ),
    (
        "dimensions too many",
        [{**EMBED, "dimensions": 65537}],
        'model "embed": dimensions must be from 1 to 65536, got 65537',
    ),
    (
        "dimensions a float",
        [{**EMBED, "dimensions": 64.0}],
        'model "embed": dimensions must be an integer, got a float',
    ),
    (
        "dimensions a boolean",
        [{**EMBED, "dimensions": True}],
        'model "embed": dimensions must be an integer, got a boolean',
    ),
    (
        "an output cap on an embedding model",
        [{**EMBED, "max_output_tokens": 100}],
        'model "embed": max_output_tokens bounds a chat answer\'s output; an embedding model'
        " has none (leave it out)",
    ),
    (
        "a cap field on an embedding model",
        [{**EMBED, "cap_field": "max_tokens"}],
        'model "embed": cap_field bounds a chat answer\'s output; an embedding model'
        " has none (leave it out)",
    ),
    (
        "a chat fallback of an embedding model",
        [{**EMBED, "fallbacks": ["fast"]}, FAST],
        'model "embed": fallback "fast" is a chat model, and a fallback of an embedding'
        " model must be one too",
    ),
    (
        "an embedding fallback of a chat model",
        [{**FAST, "fallbacks": ["embed"]}, EMBED],
        'model "fast": fallback "embed" is an embedding model, and a fallback of a chat'
        " model must be one too",
    ),
    (
        "a chat price without output",
        [{**FAST, "price": {"input": "1"}}],
        'model "fast": price.output is required',
    ),
    (
        "an embedding price without input",
        [{**EMBED, "price": {"output": "1"}}],
        'model "embed": price.input is required',
    ),
]


@pytest.mark.parametrize(
    ("models", "problem"),
    [case[1:] for case in EMBEDDING_FAULTS],
    ids=[case[0] for case in EMBEDDING_FAULTS],
)
def test_embeddingModelFault(tmp_path: Path, models: list[dict[str, Any]], problem: str) -> None:
    """
    Each fault of an embedding model (or of a kind) stops the proxy with
    one line, as every other fault of the file.
    """
    assert documentFault(tmp_path, [LOCAL], models) == problem


def test_aBaseURLEndingWithTheEmbeddingsPathIsRefused(tmp_path: Path) -> None:
    """
    The proxy appends /embeddings as it appends /chat/completions: a base
    URL that already ends with it is a fault.
    """
    provider = {**LOCAL, "base_url": "http://127.0.0.1:8000/v1/embeddings/"}
    assert documentFault(tmp_path, [provider], [EMBED]) == (
        'provider "local": base_url must not end with /embeddings: the proxy appends it'
        " (write the base, such as http://127.0.0.1:8000/v1)"
    )


# Decisions D13: the [memory] table.
MEMORY_MODELS = [FAST, EMBED]


def loadMemory(tmp_path: Path, memory: Any) -> ProviderTable:
    path = writeFile(tmp_path, tomlDocument([LOCAL], MEMORY_MODELS, {"memory": memory}))
    return loadProviders(path, {}, clock)


def test_noMemoryTable(tmp_path: Path) -> None:
    """
    Without a [memory] table memory is off: the table has no settings.
    """
    assert load(tmp_path, [LOCAL], MEMORY_MODELS).memory is None


def test_memoryDefaults(tmp_path: Path) -> None:
    """
    Only embedding_model is required; every other setting has D13's
    default.
    """
    table = loadMemory(tmp_path, {"embedding_model": "embed"})
    memory = table.memory
    assert memory == MemoryConfig(embeddingModel=table.models["embed"])
    assert (
        memory.extractionModel,
        memory.recallK,
        memory.minScore,
        memory.maxContextTokens,
        memory.dedupeScore,
        memory.recallMode,
    ) == (None, 5, 0.25, 1000, 0.92, "vector")


def test_memoryEverySetting(tmp_path: Path) -> None:
    table = loadMemory(
        tmp_path,
        {
            "embedding_model": "embed",
            "extraction_model": "fast",
            "recall_k": 50,
            "min_score": -1,
            "max_context_tokens": 1,
            "dedupe_score": 1.0,
            "recall_mode": "vector",
        },
    )
    assert table.memory == MemoryConfig(
        embeddingModel=table.models["embed"],
        extractionModel=table.models["fast"],
        recallK=50,
        minScore=-1.0,
        maxContextTokens=1,
        dedupeScore=1.0,
    )
    assert isinstance(table.memory.minScore, float)


@pytest.mark.parametrize(
    ("memory", "problem"),
    [
        ("embed", "memory must be written as a [memory] table, got a string"),
        ({}, "[memory]: embedding_model is required (an embedding model's name)"),
        (
            {"embedding_model": "embed", "recal_k": 3},
            '[memory]: unknown key "recal_k" (expected embedding_model, extraction_model,'
            " recall_k, min_score, max_context_tokens, dedupe_score, recall_mode)",
        ),
        (
            {"embedding_model": 3},
            "[memory]: embedding_model must be a model's name, got an integer",
        ),
        (
            {"embedding_model": "nope"},
            '[memory]: embedding_model "nope" is not a model of this file',
        ),
        (
            {"embedding_model": "fast"},
            '[memory]: embedding_model "fast" is a chat model; it must be an embedding model',
        ),
        (
            {"embedding_model": "embed", "extraction_model": "embed"},
            '[memory]: extraction_model "embed" is an embedding model; it must be a chat model',
        ),
        (
            {"embedding_model": "embed", "recall_k": 0},
            "[memory]: recall_k must be from 1 to 50, got 0",
        ),
        (
            {"embedding_model": "embed", "recall_k": 5.0},
            "[memory]: recall_k must be an integer, got a float",
        ),
        (
            {"embedding_model": "embed", "recall_k": True},
            "[memory]: recall_k must be an integer, got a boolean",
        ),
        (
            {"embedding_model": "embed", "max_context_tokens": 1_000_001},
            "[memory]: max_context_tokens must be from 1 to 1,000,000, got 1000001",
        ),
        (
            {"embedding_model": "embed", "min_score": 1.5},
            "[memory]: min_score must be from -1 to 1, got 1.5",
        ),
        (
            {"embedding_model": "embed", "min_score": math.nan},
            "[memory]: min_score must be from -1 to 1, got nan",
        ),
        (
            {"embedding_model": "embed", "dedupe_score": "0.9"},
            "[memory]: dedupe_score must be a number, got a string",
        ),
        (
            {"embedding_model": "embed", "recall_mode": "semantic"},
            '[memory]: recall_mode must be one of "vector", "text", "hybrid", got "semantic"',
        ),
    ],
)
def test_memoryFault(tmp_path: Path, memory: Any, problem: str) -> None:
    """
    Each fault of the [memory] table stops the proxy at start with one
    line naming it, like the rest of the file.
    """
    path = writeFile(tmp_path, tomlDocument([LOCAL], MEMORY_MODELS, {"memory": memory}))
    assert fault(path) == problem
