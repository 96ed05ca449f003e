"""
A model served by several deployments in the providers file (decisions
D15): C{deployments = [{provider, upstream_model?, weight?}, ...]} instead
of one C{provider}, C{routing}, C{max_attempts}, C{first_byte_timeout},
C{cooldown} and C{cooldown_failures}; the records they make (a model of
one provider is a model of one deployment of weight 1, its
C{provider} and C{upstreamModel} its first deployment's) and one precise
fault per mistake. A file that uses none of it reads as before
(tests/test_proxy_providers.py, unchanged but for D15's keys among its
odd values).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import pytest

from svcd.common.config import ConfigError
from svcd.metering.models import (
    LATENCY,
    LEAST_BUSY,
    WEIGHTED,
    Deployment,
    Model,
    Provider,
)
from svcd.providers.providersfile import loadProviders, providersFromEnvironment
from svcd.providers.table import ProviderTable, modelsDocument

NOW = 1_700_000_000.0
ORG = "5b0c6a9e-0000-4000-8000-000000000001"
LOCAL = {"name": "local", "base_url": "http://127.0.0.1:8000/v1"}
EAST = {"name": "east", "base_url": "https://east.example/v1"}
WEST = {"name": "west", "base_url": "https://west.example/v1", "timeout": "20s"}
CLAUDE = {"name": "claude", "base_url": "https://api.anthropic.example/v1", "api": "anthropic"}
PROVIDERS = [LOCAL, EAST, WEST, CLAUDE]
POOL = {
    "name": "pool",
    "deployments": [{"provider": "east"}, {"provider": "west", "weight": 2}],
}


def clock() -> float:
    return NOW


def tomlValue(value: Any) -> str:
    """
    A value written as TOML: strings as JSON strings (which TOML's basic
    strings read alike), inline tables, and inf and nan as TOML says them.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, list):
        return "[" + ", ".join(tomlValue(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {tomlValue(item)}" for key, item in value.items()) + "}"
    return json.dumps(value)


def writeFile(
    tmp_path: Path, models: list[dict[str, Any]], memory: dict[str, Any] | None = None
) -> str:
    """
    A providers file of L{PROVIDERS}, C{models} and C{memory}.
    """
    lines = []
    if memory is not None:
        lines.append(f"memory = {tomlValue(memory)}")
    for section, tables in (("providers", PROVIDERS), ("models", models)):
        for table in tables:
            lines.append(f"\n[[{section}]]")
            lines += [f"{key} = {tomlValue(value)}" for key, value in table.items()]
    path = tmp_path / "providers.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def load(tmp_path: Path, models: list[dict[str, Any]]) -> ProviderTable:
    return loadProviders(writeFile(tmp_path, models), {}, clock)


def problem(
    tmp_path: Path, models: list[dict[str, Any]], memory: dict[str, Any] | None = None
) -> str:
    """
    The one-line fault that loading a file of C{models} reports, less its
    prefix (the variable and the file).
    """
    path = writeFile(tmp_path, models, memory)
    with pytest.raises(ConfigError) as caught:
        loadProviders(path, {}, clock)
    message = str(caught.value)
    assert message.startswith(f"SVC_PROVIDERS_FILE: {path}: "), message
    assert "\n" not in message
    return message.removeprefix(f"SVC_PROVIDERS_FILE: {path}: ")


def test_deployments(tmp_path: Path) -> None:
    """
    Each deployment's provider, upstream model (its own, else the model's
    upstream_model, else the model's name) and weight (1 by default, an
    integer or a float); the model's provider and upstream model are the
    first deployment's; a deployment is named by its provider, or by
    provider/upstream_model where the model has another on the same
    provider.
    """
    table = load(
        tmp_path,
        [
            POOL,
            {
                "name": "gpt",
                "upstream_model": "gpt-4o",
                "deployments": [
                    {"provider": "east", "weight": 0.5},
                    {"provider": "west"},
                    {"provider": "west", "upstream_model": "gpt-4o-2024-08-06", "weight": 3},
                ],
            },
        ],
    )
    east, west = table.providers["east"], table.providers["west"]
    pool, gpt = table.models["pool"], table.models["gpt"]
    assert pool.deployments == (
        Deployment(east, "pool", 1.0, "east"),
        Deployment(west, "pool", 2.0, "west"),
    )
    assert (pool.provider, pool.upstreamModel) == (east, "pool")
    assert gpt.deployments == (
        Deployment(east, "gpt-4o", 0.5, "east"),
        Deployment(west, "gpt-4o", 1.0, "west/gpt-4o"),
        Deployment(west, "gpt-4o-2024-08-06", 3.0, "west/gpt-4o-2024-08-06"),
    )
    assert (gpt.provider, gpt.upstreamModel) == (east, "gpt-4o")
    for model in (pool, gpt):
        for deployment in model.deployments:
            assert deployment.provider is table.providers[deployment.provider.name]


def test_defaults(tmp_path: Path) -> None:
    """
    A model of one provider is a model of one deployment of weight 1,
    named by its provider, equal to one built by hand without
    deployments; the routing keys' defaults: weighted, one try of each
    deployment and fallback, the provider's timeouts, a 10 s cooldown
    after 3 failures.
    """
    table = load(tmp_path, [{"name": "fast", "provider": "local", "upstream_model": "llama"}, POOL])
    local = table.providers["local"]
    fast = table.models["fast"]
    assert fast.deployments == (Deployment(local, "llama", 1.0, "local"),)
    assert fast == Model("fast", local, "llama")
    for model in (fast, table.models["pool"]):
        assert (model.routing, model.maxAttempts, model.firstByteTimeout) == (WEIGHTED, None, None)
        assert (model.cooldown, model.cooldownFailures) == (10.0, 3)


def test_routingKeys(tmp_path: Path) -> None:
    """
    routing, max_attempts, first_byte_timeout (a duration, as a string or
    a number), cooldown and cooldown_failures are read, for a model of
    deployments and for a model of one provider alike.
    """
    table = load(
        tmp_path,
        [
            {
                **POOL,
                "routing": "least_busy",
                "max_attempts": 3,
                "first_byte_timeout": "1500ms",
                "cooldown": "30s",
                "cooldown_failures": 5,
            },
            {"name": "one", "provider": "local", "routing": "latency", "first_byte_timeout": 2},
        ],
    )
    pool, one = table.models["pool"], table.models["one"]
    assert (pool.routing, pool.maxAttempts, pool.firstByteTimeout) == (LEAST_BUSY, 3, 1.5)
    assert (pool.cooldown, pool.cooldownFailures) == (30.0, 5)
    assert (one.routing, one.firstByteTimeout, len(one.deployments)) == (LATENCY, 2.0, 1)


def test_atDeployment(tmp_path: Path) -> None:
    """
    A try on a deployment sees the model with that deployment's provider
    and upstream model and everything else the model's; the first
    deployment's is the model itself (a model of one provider is its own
    only view).
    """
    table = load(
        tmp_path,
        [
            {
                **POOL,
                "upstream_model": "m",
                "price": {"input": "1.00", "output": "2.00"},
                "fallbacks": ["fast"],
                "orgs": [ORG],
            },
            {"name": "fast", "provider": "local"},
        ],
    )
    pool, fast = table.models["pool"], table.models["fast"]
    assert pool.atDeployment(0) is pool
    assert fast.atDeployment(0) is fast
    second = pool.atDeployment(1)
    assert (second.name, second.provider, second.upstreamModel) == (
        "pool",
        table.providers["west"],
        "m",
    )
    assert (second.price, second.fallbacks, second.orgs) == (pool.price, ("fast",), pool.orgs)
    assert second.deployments == (pool.deployments[1],)
    with pytest.raises(IndexError):
        pool.atDeployment(2)


def test_modelRecordChecks() -> None:
    """
    A Model built by hand keeps its provider and upstream model its first
    deployment's, and has 1 to 32 deployments.
    """
    east = Provider("east", "https://east.example/v1")
    west = Provider("west", "https://west.example/v1")
    Model("m", east, "u", deployments=(Deployment(east, "u"), Deployment(west, "u")))
    with pytest.raises(ValueError, match="first deployment"):
        Model("m", east, "u", deployments=(Deployment(west, "u"),))
    with pytest.raises(ValueError, match="first deployment"):
        Model("m", east, "u", deployments=(Deployment(east, "v"),))
    with pytest.raises(ValueError, match="1 to 32"):
        Model("m", east, "u", deployments=())
    with pytest.raises(ValueError, match="1 to 32"):
        Model("m", east, "u", deployments=(Deployment(east, "u"),) * 33)
    assert attrs.evolve(Model("m", east), maxAttempts=2).deployments == (Deployment(east, "m"),)


def test_modelsListOwnedByTheFirstDeployment(tmp_path: Path) -> None:
    """
    GET /v1/models names a model of deployments as owned by its first
    deployment's provider.
    """
    table = load(tmp_path, [POOL])
    assert modelsDocument(table, ORG)["data"][0]["owned_by"] == "east"


def test_anthropicDeployments(tmp_path: Path) -> None:
    """
    A model may mix providers of both dialects; what a model of an
    Anthropic provider may not say, a model with one Anthropic deployment
    may not either, and the worker's extraction model has no Anthropic
    deployment.
    """
    mixed = {"name": "mixed", "deployments": [{"provider": "local"}, {"provider": "claude"}]}
    table = load(tmp_path, [mixed])
    assert [each.provider.api for each in table.models["mixed"].deployments] == [
        "openai",
        "anthropic",
    ]
    assert problem(tmp_path, [{**mixed, "cap_field": "max_tokens"}]) == (
        'model "mixed": cap_field is for OpenAI-compatible providers; an Anthropic provider'
        " always takes the output cap as max_tokens (leave it out)"
    )
    assert problem(tmp_path, [{**mixed, "kind": "embedding"}]) == (
        'model "mixed": kind = "embedding" needs an OpenAI-compatible provider:'
        ' Anthropic\'s Messages API has no embeddings (provider api = "anthropic")'
    )
    embed = {"name": "embed", "provider": "local", "kind": "embedding"}
    assert problem(
        tmp_path, [mixed, embed], memory={"embedding_model": "embed", "extraction_model": "mixed"}
    ).startswith('[memory]: extraction_model "mixed" is a model of an Anthropic provider;')


def test_embeddingDeployments(tmp_path: Path) -> None:
    """
    An embedding model may have deployments too.
    """
    table = load(
        tmp_path,
        [
            {
                "name": "embed",
                "kind": "embedding",
                "dimensions": 8,
                "deployments": [{"provider": "local"}, {"provider": "east"}],
            }
        ],
    )
    assert len(table.models["embed"].deployments) == 2


_D = [{"provider": "east"}, {"provider": "west"}]
FAULTS: list[tuple[str, dict[str, Any], str]] = [
    (
        "provider and deployments",
        {"provider": "local", "deployments": _D},
        "provider and deployments are exclusive: name one provider, or list every deployment",
    ),
    (
        "deployments not an array",
        {"deployments": "east"},
        'deployments must be an array of tables such as [{ provider = "a" },'
        ' { provider = "b", weight = 2 }], got a string',
    ),
    (
        "deployments of strings",
        {"deployments": ["east", "west"]},
        'deployments must be an array of tables such as [{ provider = "a" },'
        ' { provider = "b", weight = 2 }], got an array',
    ),
    (
        "no deployment",
        {"deployments": []},
        "deployments is empty (list 1 to 32 deployments, or name one provider)",
    ),
    (
        "too many deployments",
        {"deployments": [{"provider": "east", "upstream_model": f"m{n}"} for n in range(33)]},
        "deployments lists more than 32 deployments",
    ),
    (
        "deployment without provider",
        {"deployments": [{"provider": "east"}, {"weight": 2}]},
        "deployment 2: provider is required",
    ),
    (
        "deployment of an unknown provider",
        {"deployments": [{"provider": "north"}]},
        'deployment 1: provider "north" is not defined',
    ),
    (
        "deployment provider not a string",
        {"deployments": [{"provider": 1}]},
        "deployment 1: provider must be a string, got an integer",
    ),
    (
        "unknown key in a deployment",
        {"deployments": [{"provider": "east", "wieght": 2}]},
        'deployment 1: unknown key "wieght" (expected provider, upstream_model, weight)',
    ),
    (
        "key in a deployment",
        {"deployments": [{"provider": "east", "api_key": "sk-x"}]},
        'deployment 1: unknown key "api_key" (expected provider, upstream_model, weight);'
        " a key never sits in the file: name the environment variable that holds it with"
        " api_key_env",
    ),
    (
        "bad upstream model",
        {"deployments": [{"provider": "east", "upstream_model": "a b"}]},
        'deployment 1: upstream_model "a b" may hold only letters, digits and . _ : / @ + -,'
        " starting with a letter or digit",
    ),
    (
        "the same deployment twice",
        {"upstream_model": "m", "deployments": [{"provider": "east"}, *_D]},
        'deployment 2: provider "east" with upstream_model "m" is listed twice'
        " (a weight says how much more to use it)",
    ),
    (
        "weight zero",
        {"deployments": [{"provider": "east", "weight": 0}]},
        "deployment 1: weight must be greater than zero and at most 1,000,000, got 0",
    ),
    (
        "weight negative",
        {"deployments": [{"provider": "east", "weight": -1.5}]},
        "deployment 1: weight must be greater than zero and at most 1,000,000, got -1.5",
    ),
    (
        "weight not a number",
        {"deployments": [{"provider": "east", "weight": "2"}]},
        "deployment 1: weight must be a number, got a string",
    ),
    (
        "weight a boolean",
        {"deployments": [{"provider": "east", "weight": True}]},
        "deployment 1: weight must be a number, got a boolean",
    ),
    (
        "weight infinite",
        {"deployments": [{"provider": "east", "weight": float("inf")}]},
        "deployment 1: weight must be greater than zero and at most 1,000,000, got inf",
    ),
    (
        "weight nan",
        {"deployments": [{"provider": "east", "weight": float("nan")}]},
        "deployment 1: weight must be greater than zero and at most 1,000,000, got nan",
    ),
    (
        "unknown routing",
        {"deployments": _D, "routing": "round_robin"},
        'routing must be one of "weighted", "least_busy", "latency", got "round_robin"',
    ),
    (
        "routing not a string",
        {"deployments": _D, "routing": 1},
        "routing must be a string, got an integer",
    ),
    (
        "max_attempts zero",
        {"deployments": _D, "max_attempts": 0},
        "max_attempts must be from 1 to 100, got 0",
    ),
    (
        "max_attempts not an integer",
        {"deployments": _D, "max_attempts": "3"},
        "max_attempts must be an integer, got a string",
    ),
    (
        "first_byte_timeout zero",
        {"deployments": _D, "first_byte_timeout": 0},
        "first_byte_timeout must be greater than zero, got 0",
    ),
    (
        "first_byte_timeout unreadable",
        {"deployments": _D, "first_byte_timeout": "soon"},
        'first_byte_timeout must be a duration such as 50ms, 2s or 1m, got "soon"',
    ),
    (
        "cooldown too long",
        {"deployments": _D, "cooldown": "61m"},
        'cooldown must be at most 3600s (one hour), got "61m"',
    ),
    (
        "cooldown_failures zero",
        {"deployments": _D, "cooldown_failures": 0},
        "cooldown_failures must be from 1 to 1,000, got 0",
    ),
    (
        "cooldown_failures a float",
        {"deployments": _D, "cooldown_failures": 2.5},
        "cooldown_failures must be an integer, got a float",
    ),
]


@pytest.mark.parametrize(
    ("model", "expected"), [case[1:] for case in FAULTS], ids=[case[0] for case in FAULTS]
)
def test_fault(tmp_path: Path, model: dict[str, Any], expected: str) -> None:
    """
    Each mistake is one line naming the model and the fault.
    """
    assert problem(tmp_path, [{"name": "pool", **model}]) == f'model "pool": {expected}'


def test_unknownKeyFaultReadsAsBefore(tmp_path: Path) -> None:
    """
    D15's keys are known, but the fault of an unknown key lists the keys
    it always did (a file that uses none of D15 reads as before).
    """
    assert problem(tmp_path, [{**POOL, "routnig": "latency"}]) == (
        'model "pool": unknown key "routnig" (expected name, provider, upstream_model, orgs,'
        " fallbacks, max_output_tokens, price, cap_field, kind, dimensions)"
    )


def test_modelWithoutProviderReadsAsBefore(tmp_path: Path) -> None:
    """
    A model with neither provider nor deployments is told provider is
    required, as before.
    """
    assert problem(tmp_path, [{"name": "pool"}]) == 'model "pool": provider is required'


def test_daemonsServeSeveralDeployments(tmp_path: Path) -> None:
    """
    A daemon reads its file through providersFromEnvironment, which loads
    a model of several deployments (the forwarder balances over them,
    tests/test_providers_wiring.py) as it loads a model of one deployment,
    written either way.
    """
    one = {"name": "solo", "deployments": [{"provider": "east"}], "routing": "latency"}
    path = writeFile(tmp_path, [one, {"name": "plain", "provider": "local"}, POOL])
    table = providersFromEnvironment({"SVC_PROVIDERS_FILE": path}, clock)
    assert table is not None and set(table.models) == {"solo", "plain", "pool"}
    pool = table.models["pool"]
    assert [deployment.provider.name for deployment in pool.deployments] == ["east", "west"]
    assert [deployment.weight for deployment in pool.deployments] == [1.0, 2.0]
