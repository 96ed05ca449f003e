"""
The providers file (decisions D9): which OpenAI-compatible providers the
proxy forwards to, and which models it offers on them, read once at start
from the TOML file named by C{SVC_PROVIDERS_FILE} with the standard
library's C{tomllib} and checked whole before the proxy starts.

Provider keys come only from the environment (C{api_key_env} names the
variable); they are never in the file, never logged, never in an error.
"""

from __future__ import annotations

import re
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from svcd.common import config
from svcd.common.config import ConfigError
from svcd.common.ids import parseUUID

VARIABLE = "SVC_PROVIDERS_FILE"
DEFAULT_TIMEOUT = 60.0
DEFAULT_IDLE_TIMEOUT = 30.0
DEFAULT_MAX_CONNECTIONS = 16
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}$")
_ENVIRONMENT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
_PROVIDER_KEYS = frozenset(
    {"name", "base_url", "api_key_env", "timeout", "idle_timeout", "max_connections"}
)
_MODEL_KEYS = frozenset({"name", "provider", "upstream_model", "orgs", "fallbacks"})


@attrs.frozen
class Provider:
    """
    One OpenAI-compatible provider: requests go to C{baseURL +
    "/chat/completions"}.
    """

    name: str
    baseURL: str
    apiKey: str | None = attrs.field(default=None, repr=False)
    apiKeyEnv: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    idleTimeout: float = DEFAULT_IDLE_TIMEOUT
    maxConnections: int = DEFAULT_MAX_CONNECTIONS


@attrs.frozen
class Model:
    """
    A model clients may name: served by C{provider} as C{upstreamModel},
    to the organizations of C{orgs} (None: every one).
    """

    name: str
    provider: Provider
    upstreamModel: str
    orgs: frozenset[str] | None = None
    fallbacks: tuple[str, ...] = ()

    def allows(self, orgID: str) -> bool:
        return self.orgs is None or orgID in self.orgs


@attrs.frozen
class ProviderTable:
    """
    The whole file: providers and models by name, in the file's order.
    """

    path: str
    providers: Mapping[str, Provider]
    models: Mapping[str, Model]
    loadedAt: int

    def modelFor(self, name: str, orgID: str) -> Model | None:
        """
        The model C{name} for C{orgID}; None when the file does not list it
        or lists it for other organizations only (both answer 501).
        """
        model = self.models.get(name)
        if model is None or not model.allows(orgID):
            return None
        return model

    def attempts(self, model: Model, orgID: str) -> tuple[Model, ...]:
        """
        C{model}, then its fallbacks in order, each followed by its own
        (depth first), each model once, those not allowed to C{orgID} left
        out.
        """
        chain: list[Model] = []
        seen: set[str] = set()

        def visit(each: Model) -> None:
            if each.name in seen:
                return
            seen.add(each.name)
            if each.allows(orgID):
                chain.append(each)
            for fallback in each.fallbacks:
                visit(self.models[fallback])

        visit(model)
        return tuple(chain)

    def modelsFor(self, orgID: str) -> tuple[Model, ...]:
        return tuple(model for model in self.models.values() if model.allows(orgID))


def modelsDocument(table: ProviderTable, orgID: str) -> dict[str, Any]:
    """
    The body of GET /v1/models for C{orgID}, in OpenAI's list shape.
    """
    return {
        "object": "list",
        "data": [
            {
                "id": model.name,
                "object": "model",
                "created": table.loadedAt,
                "owned_by": model.provider.name,
            }
            for model in table.modelsFor(orgID)
        ],
    }


def loadProviders(
    path: str, environ: Mapping[str, str], clock: Callable[[], float]
) -> ProviderTable:
    """
    Read and check the providers file.

    @raise ConfigError: naming C{SVC_PROVIDERS_FILE}, the file and the
        fault.
    """

    def fault(problem: str) -> ConfigError:
        return ConfigError(VARIABLE, f"{path}: {problem}")

    try:
        with open(path, "rb") as source:
            document = tomllib.load(source)
    except OSError as error:
        raise fault(f"cannot read it ({error.strerror})") from None
    except UnicodeDecodeError:
        raise fault("it is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise fault(f"it is not TOML ({error})") from None
    unknown = set(document) - {"providers", "models"}
    if unknown:
        raise fault(f"unknown top-level key(s) {', '.join(sorted(unknown))}")
    providerTables = _tables(document, "providers", fault)
    modelTables = _tables(document, "models", fault)

    providers: dict[str, Provider] = {}
    for index, table in enumerate(providerTables):
        provider = _provider(index, table, environ, fault)
        if provider.name in providers:
            raise fault(f'provider "{provider.name}" is defined twice')
        providers[provider.name] = provider

    models: dict[str, Model] = {}
    for index, table in enumerate(modelTables):
        model = _model(index, table, providers, fault)
        if model.name in models:
            raise fault(f'model "{model.name}" is defined twice')
        models[model.name] = model
    for model in models.values():
        for fallback in model.fallbacks:
            if fallback not in models:
                raise fault(f'model "{model.name}": fallback "{fallback}" is not a model')
    _refuseCycles(models, fault)
    return ProviderTable(path, providers, models, int(clock()))


def _tables(
    document: Mapping[str, Any], key: str, fault: Callable[[str], ConfigError]
) -> list[Mapping[str, Any]]:
    tables = document.get(key)
    if not isinstance(tables, list) or not tables:
        raise fault(f"needs at least one [[{key}]] table")
    if not all(isinstance(table, dict) for table in tables):
        raise fault(f"{key} must be tables ([[{key}]])")
    return tables


def _text(
    table: Mapping[str, Any], key: str, where: str, fault: Callable[[str], ConfigError]
) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value.strip():
        raise fault(f"{where}: {key} must be a non-empty string")
    return value.strip()


def _name(
    table: Mapping[str, Any], key: str, where: str, fault: Callable[[str], ConfigError]
) -> str:
    value = _text(table, key, where, fault)
    if not _NAME.match(value):
        raise fault(
            f"{where}: {key} {value!r} may hold letters, digits and . _ : / @ + - only"
            " (at most 256 characters)"
        )
    return value


def _provider(
    index: int,
    table: Mapping[str, Any],
    environ: Mapping[str, str],
    fault: Callable[[str], ConfigError],
) -> Provider:
    where = f"providers[{index}]"
    name = _name(table, "name", where, fault)
    where = f'provider "{name}"'
    unknown = set(table) - _PROVIDER_KEYS
    if unknown:
        raise fault(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    baseURL = _baseURL(_text(table, "base_url", where, fault), where, fault)
    apiKeyEnv = table.get("api_key_env")
    apiKey = None
    if apiKeyEnv is not None:
        if not isinstance(apiKeyEnv, str) or not _ENVIRONMENT_NAME.match(apiKeyEnv):
            raise fault(f"{where}: api_key_env must name an environment variable")
        apiKey = environ.get(apiKeyEnv, "").strip()
        if not apiKey:
            raise fault(f"{where}: the variable {apiKeyEnv} (api_key_env) is unset or empty")
    maxConnections = table.get("max_connections", DEFAULT_MAX_CONNECTIONS)
    if (
        not isinstance(maxConnections, int)
        or isinstance(maxConnections, bool)
        or not 1 <= maxConnections <= 10_000
    ):
        raise fault(f"{where}: max_connections must be a whole number from 1 to 10000")
    return Provider(
        name=name,
        baseURL=baseURL,
        apiKey=apiKey,
        apiKeyEnv=apiKeyEnv,
        timeout=_duration(table, "timeout", DEFAULT_TIMEOUT, where, fault),
        idleTimeout=_duration(table, "idle_timeout", DEFAULT_IDLE_TIMEOUT, where, fault),
        maxConnections=maxConnections,
    )


def _baseURL(value: str, where: str, fault: Callable[[str], ConfigError]) -> str:
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise fault(f"{where}: base_url {value!r} is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise fault(f"{where}: base_url must be an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise fault(f"{where}: base_url must not hold credentials (use api_key_env)")
    if parts.query or parts.fragment:
        raise fault(f"{where}: base_url must have no query or fragment")
    if not value.isascii() or any(character.isspace() for character in value):
        raise fault(f"{where}: base_url must be ASCII without spaces")
    return value.rstrip("/")


def _duration(
    table: Mapping[str, Any],
    key: str,
    default: float,
    where: str,
    fault: Callable[[str], ConfigError],
) -> float:
    value = table.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise fault(f"{where}: {key} must be a duration such as 30s, 500ms or 2m")
    try:
        return config.duration({key: str(value)}, key, default)
    except ConfigError as error:
        raise fault(f"{where}: {key} {error.problem}") from None


def _model(
    index: int,
    table: Mapping[str, Any],
    providers: Mapping[str, Provider],
    fault: Callable[[str], ConfigError],
) -> Model:
    where = f"models[{index}]"
    name = _name(table, "name", where, fault)
    where = f'model "{name}"'
    unknown = set(table) - _MODEL_KEYS
    if unknown:
        raise fault(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    providerName = _text(table, "provider", where, fault)
    provider = providers.get(providerName)
    if provider is None:
        raise fault(f'{where}: provider "{providerName}" is not defined')
    upstreamModel = name
    if "upstream_model" in table:
        upstreamModel = _text(table, "upstream_model", where, fault)
        if len(upstreamModel) > 256:
            raise fault(f"{where}: upstream_model is longer than 256 characters")
    orgs = None
    if "orgs" in table:
        listed = table["orgs"]
        if not isinstance(listed, list) or not listed:
            raise fault(f"{where}: orgs must be a non-empty list of organization ids")
        parsed = set()
        for org in listed:
            orgID = parseUUID(org) if isinstance(org, str) else None
            if orgID is None:
                raise fault(f"{where}: orgs holds {org!r}, which is not a UUID")
            parsed.add(str(orgID))
        orgs = frozenset(parsed)
    fallbacks = table.get("fallbacks", [])
    if not isinstance(fallbacks, list) or not all(isinstance(each, str) for each in fallbacks):
        raise fault(f"{where}: fallbacks must be a list of model names")
    return Model(name, provider, upstreamModel, orgs, tuple(fallbacks))


def _refuseCycles(models: Mapping[str, Model], fault: Callable[[str], ConfigError]) -> None:
    """
    Fallbacks are followed transitively, so a model reachable from itself
    would be a loop: refused, naming the loop.
    """
    done: set[str] = set()

    def walk(name: str, path: list[str]) -> None:
        if name in path:
            loop = " -> ".join([*path[path.index(name) :], name])
            raise fault(f"fallbacks form a cycle: {loop}")
        if name in done:
            return
        for fallback in models[name].fallbacks:
            walk(fallback, [*path, name])
        done.add(name)

    for name in models:
        walk(name, [])


def providersFromEnvironment(
    environ: Mapping[str, str], clock: Callable[[], float]
) -> ProviderTable | None:
    """
    The table of C{SVC_PROVIDERS_FILE}, or None when it is unset or empty
    (Phase 1: no provider).
    """
    path = environ.get(VARIABLE, "").strip()
    if not path:
        return None
    return loadProviders(path, environ, clock)
