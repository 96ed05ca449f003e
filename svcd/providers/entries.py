"""
One entry of the providers file (L{svcd.providers.providersfile}) checked
into its record: a C{[[providers]]} table into a L{Provider}, a
C{[[models]]} table into a L{Model}, each key for its type and bounds.

A provider's key never sits in the file: C{api_key_env} names the
environment variable that holds it, read here at load. The key is kept out
of every repr, and no error repeats it, nor anything of C{base_url} (a URL
can carry credentials, which are refused but never echoed).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from svcd.common.ids import parseUUID
from svcd.metering.models import (
    ANTHROPIC,
    APIS,
    CAP_FIELDS,
    CHAT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    EMBEDDING,
    MAX_COMPLETION_TOKENS,
    MAX_TOKENS,
    MODEL_KINDS,
    OPENAI,
    Model,
    Provider,
)
from svcd.metering.prices import BadPrice, Price, parseDollars
from svcd.providers.fields import FieldChecker, quote, show, tomlType

__all__ = ["EntryChecker"]

# Bounds against the absurd, well above any sensible value.
MAX_CONNECTIONS = 1024
MAX_FALLBACKS = 16
MAX_ORGS = 10_000
MAX_URL_CHARACTERS = 2048
MAX_KEY_CHARACTERS = 4096
MAX_PROVIDER_NAME = 64
MAX_MODEL_NAME = 128
MAX_UPSTREAM_MODEL = 256
MAX_VARIABLE_NAME = 128

# Provider names become metric labels and owned_by; model names are what
# clients send and a metric label; upstream names follow providers' habits
# (org/model, model:tag, vendor.model-v1:0, name@version).
_PROVIDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_PROVIDER_NAME_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit"
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
_MODEL_NAME_RULE = "letters, digits and . _ : / @ + -, starting with a letter or digit"
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What an Authorization header can carry without surprise: visible ASCII.
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
_HOST_NAME = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.?")

_PROVIDER_KEYS = ("name", "base_url", "api_key_env", "timeout", "idle_timeout", "max_connections")
# Decisions D14: known, but not listed in the fault of an unknown key.
_PROVIDER_OPTIONS = ("api",)
# The largest output cap a model may declare (D11): far above any model's.
MAX_OUTPUT_TOKENS = 10_000_000
# The longest vectors an embedding model may declare: far above any
# model's (OpenAI's largest is 3,072).
MAX_DIMENSIONS = 65_536
_MODEL_KEYS = (
    "name",
    "provider",
    "upstream_model",
    "orgs",
    "fallbacks",
    "max_output_tokens",
    "price",
    "cap_field",
    "kind",
    "dimensions",
)
# The keys that bound a chat answer's output, meaningless for embeddings.
_CHAT_ONLY_KEYS = ("max_output_tokens", "cap_field")
_PRICE_KEYS = ("input", "output", "cached_input", "cache_write")


class EntryChecker(FieldChecker):
    """
    Turns a C{[[providers]]} or C{[[models]]} table into its record, or
    raises for its first fault.
    """

    def __init__(self, path: str, environ: Mapping[str, str]) -> None:
        super().__init__(path)
        self._environ = environ

    def provider(self, table: dict[str, Any], number: int) -> Provider:
        where = self.where("provider", table, number, _PROVIDER_NAME, MAX_PROVIDER_NAME)
        self.refuseUnknownKeys(table, _PROVIDER_KEYS, where, _PROVIDER_OPTIONS)
        name = self.requiredText(
            table, "name", where, _PROVIDER_NAME, MAX_PROVIDER_NAME, _PROVIDER_NAME_RULE
        )
        apiKeyEnv, apiKey = self.apiKey(table, where)
        api = self.api(table, where)
        return Provider(
            name=name,
            baseURL=self.baseURL(table, where, api),
            apiKey=apiKey,
            apiKeyEnv=apiKeyEnv,
            timeout=self.duration(table, "timeout", DEFAULT_TIMEOUT, where),
            idleTimeout=self.duration(table, "idle_timeout", DEFAULT_IDLE_TIMEOUT, where),
            maxConnections=self.maxConnections(table, where),
            api=api,
        )

    def api(self, table: dict[str, Any], where: str) -> str:
        """
        The dialect the provider speaks (decisions D14).
        """
        value = table.get("api")
        if value is None:
            return OPENAI
        if not isinstance(value, str):
            raise self.fault(f"{where}api must be a string, got {tomlType(value)}")
        if value not in APIS:
            raise self.fault(f'{where}api must be "{OPENAI}" or "{ANTHROPIC}", got {quote(value)}')
        return value

    def baseURL(self, table: dict[str, Any], where: str, api: str = OPENAI) -> str:
        """
        C{http(s)://host[:port][/path]}. The value is never quoted back: a
        URL can hold a password or a key in its query.
        """
        value = table.get("base_url")
        if value is None:
            raise self.fault(f"{where}base_url is required")
        if not isinstance(value, str):
            raise self.fault(f"{where}base_url must be a string, got {tomlType(value)}")
        if len(value) > MAX_URL_CHARACTERS:
            raise self.fault(f"{where}base_url is longer than {MAX_URL_CHARACTERS} characters")
        if not _VISIBLE_ASCII.fullmatch(value):
            raise self.fault(
                f"{where}base_url must be ASCII without spaces or control characters "
                "(write an international host name in its xn-- form)"
            )
        scheme, separator, rest = value.partition("://")
        if not separator or scheme.lower() not in ("http", "https"):
            raise self.fault(f"{where}base_url must start with http:// or https://")
        if "?" in value:
            raise self.fault(f"{where}base_url must not have a query (?...)")
        if "#" in value:
            raise self.fault(f"{where}base_url must not have a fragment (#...)")
        authority, _, path = rest.partition("/")
        if "@" in authority:
            raise self.fault(
                f"{where}base_url must not hold credentials (user:password@); "
                "the key belongs in the variable named by api_key_env"
            )
        host, port = _splitAuthority(authority)
        if not host:
            raise self.fault(f"{where}base_url has no host")
        if not _isHost(host):
            raise self.fault(f"{where}base_url has a host that is neither a name nor an IP address")
        if port is not None and not (port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
            raise self.fault(f"{where}base_url has a port that is not a number from 1 to 65535")
        baseURL = f"{scheme.lower()}://{authority}/{path}".rstrip("/")
        for route in ("/chat/completions", "/embeddings") if api == OPENAI else ("/messages",):
            if baseURL.lower().endswith(route):
                raise self.fault(
                    f"{where}base_url must not end with {route}: the proxy appends it "
                    "(write the base, such as http://127.0.0.1:8000/v1)"
                )
        return baseURL

    def apiKey(self, table: dict[str, Any], where: str) -> tuple[str | None, str | None]:
        """
        The variable named by C{api_key_env} and its value. The error
        names the variable, never its value.
        """
        variable = self.text(
            table,
            "api_key_env",
            where,
            _VARIABLE_NAME,
            MAX_VARIABLE_NAME,
            "letters, digits and '_', not starting with a digit",
        )
        if variable is None:
            return None, None
        value = self._environ.get(variable)
        if value is None:
            raise self.fault(f"{where}api_key_env: {variable} is not set in the environment")
        key = value.strip()
        if not key:
            raise self.fault(f"{where}api_key_env: {variable} is empty in the environment")
        if len(key) > MAX_KEY_CHARACTERS or not _VISIBLE_ASCII.fullmatch(key):
            raise self.fault(
                f"{where}api_key_env: the value of {variable} cannot be sent as a key "
                f"(at most {MAX_KEY_CHARACTERS} visible ASCII characters, no spaces)"
            )
        return variable, key

    def maxConnections(self, table: dict[str, Any], where: str) -> int:
        value = table.get("max_connections")
        if value is None:
            return DEFAULT_MAX_CONNECTIONS
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fault(f"{where}max_connections must be an integer, got {tomlType(value)}")
        if not 1 <= value <= MAX_CONNECTIONS:
            raise self.fault(
                f"{where}max_connections must be from 1 to {MAX_CONNECTIONS}, got {show(value)}"
            )
        return value

    def model(self, table: dict[str, Any], number: int, providers: Mapping[str, Provider]) -> Model:
        where = self.where("model", table, number, _MODEL_NAME, MAX_MODEL_NAME)
        self.refuseUnknownKeys(table, _MODEL_KEYS, where)
        name = self.requiredText(
            table, "name", where, _MODEL_NAME, MAX_MODEL_NAME, _MODEL_NAME_RULE
        )
        providerName = table.get("provider")
        if providerName is None:
            raise self.fault(f"{where}provider is required")
        if not isinstance(providerName, str):
            raise self.fault(f"{where}provider must be a string, got {tomlType(providerName)}")
        provider = providers.get(providerName)
        if provider is None:
            raise self.fault(f"{where}provider {quote(providerName)} is not defined")
        upstreamModel = self.text(
            table, "upstream_model", where, _MODEL_NAME, MAX_UPSTREAM_MODEL, _MODEL_NAME_RULE
        )
        kind = self.modelKind(table, where)
        if provider.api == ANTHROPIC:
            self.anthropicModel(table, where, kind)
        if kind == EMBEDDING:
            for key in _CHAT_ONLY_KEYS:
                if key in table:
                    raise self.fault(
                        f"{where}{key} bounds a chat answer's output; an embedding model"
                        " has none (leave it out)"
                    )
        elif "dimensions" in table:
            raise self.fault(
                f'{where}dimensions is for embedding models only (kind = "{EMBEDDING}")'
            )
        return Model(
            name=name,
            provider=provider,
            upstreamModel=upstreamModel or name,
            orgs=self.orgs(table, where),
            fallbacks=self.fallbacks(table, where),
            maxOutputTokens=self.maxOutputTokens(table, where),
            price=self.price(table, where, outputRequired=kind == CHAT),
            capField=self.capField(table, where),
            kind=kind,
            dimensions=self.dimensions(table, where),
        )

    def anthropicModel(self, table: dict[str, Any], where: str, kind: str) -> None:
        """
        What a model of an Anthropic provider may not say (decisions D14):
        Anthropic's API has no embeddings, and takes its output cap under
        C{max_tokens} only.
        """
        if kind == EMBEDDING:
            raise self.fault(
                f'{where}kind = "{EMBEDDING}" needs an OpenAI-compatible provider:'
                f' Anthropic\'s Messages API has no embeddings (provider api = "{ANTHROPIC}")'
            )
        if "cap_field" in table:
            raise self.fault(
                f"{where}cap_field is for OpenAI-compatible providers; an Anthropic"
                " provider always takes the output cap as max_tokens (leave it out)"
            )

    def modelKind(self, table: dict[str, Any], where: str) -> str:
        value = table.get("kind")
        if value is None:
            return CHAT
        if not isinstance(value, str):
            raise self.fault(f"{where}kind must be a string, got {tomlType(value)}")
        if value not in MODEL_KINDS:
            raise self.fault(f'{where}kind must be "{CHAT}" or "{EMBEDDING}", got {quote(value)}')
        return value

    def dimensions(self, table: dict[str, Any], where: str) -> int | None:
        value = table.get("dimensions")
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fault(f"{where}dimensions must be an integer, got {tomlType(value)}")
        if not 1 <= value <= MAX_DIMENSIONS:
            raise self.fault(
                f"{where}dimensions must be from 1 to {MAX_DIMENSIONS}, got {show(value)}"
            )
        return value

    def capField(self, table: dict[str, Any], where: str) -> str:
        value = table.get("cap_field")
        if value is None:
            return MAX_COMPLETION_TOKENS
        if not isinstance(value, str):
            raise self.fault(f"{where}cap_field must be a string, got {tomlType(value)}")
        if value not in CAP_FIELDS:
            raise self.fault(
                f'{where}cap_field must be "{MAX_COMPLETION_TOKENS}" or "{MAX_TOKENS}",'
                f" got {quote(value)}"
            )
        return value

    def price(self, table: dict[str, Any], where: str, outputRequired: bool = True) -> Price | None:
        """
        The model's price; C{output} may be left out (as 0) where
        C{outputRequired} is false: an embedding model's answer has no
        output tokens (D13).
        """
        value = table.get("price")
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fault(
                f'{where}price must be a table such as {{ input = "2.50", output = "10.00" }},'
                f" got {tomlType(value)}"
            )
        self.refuseUnknownKeys(value, _PRICE_KEYS, f"{where}price: ")
        dollars: dict[str, int] = {}
        for key in _PRICE_KEYS:
            text = value.get(key)
            if text is None:
                continue
            if not isinstance(text, str):
                raise self.fault(
                    f'{where}price.{key} must be a decimal string such as "2.50" (quoted:'
                    f" a TOML number would be a float), got {tomlType(text)}"
                )
            try:
                dollars[key] = parseDollars(text)
            except BadPrice as bad:
                raise self.fault(f"{where}price.{key} {bad}") from None
        for required in ("input", "output") if outputRequired else ("input",):
            if required not in dollars:
                raise self.fault(f"{where}price.{required} is required")
        return Price(
            input=dollars["input"],
            output=dollars.get("output", 0),
            cachedInput=dollars.get("cached_input", dollars["input"]),
            cacheWrite=dollars.get("cache_write", dollars["input"]),
        )

    def maxOutputTokens(self, table: dict[str, Any], where: str) -> int | None:
        value = table.get("max_output_tokens")
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fault(f"{where}max_output_tokens must be an integer, got {tomlType(value)}")
        if not 1 <= value <= MAX_OUTPUT_TOKENS:
            raise self.fault(
                f"{where}max_output_tokens must be from 1 to {MAX_OUTPUT_TOKENS}, got {show(value)}"
            )
        return value

    def orgs(self, table: dict[str, Any], where: str) -> frozenset[str] | None:
        entries = self.stringArray(table, "orgs", where, "organization UUIDs")
        if entries is None:
            return None
        if not entries:
            raise self.fault(
                f"{where}orgs is empty, so no organization could use the model "
                "(leave orgs out to allow every organization)"
            )
        if len(entries) > MAX_ORGS:
            raise self.fault(f"{where}orgs lists more than {MAX_ORGS} organizations")
        orgs: set[str] = set()
        for entry in entries:
            orgID = parseUUID(entry)
            if orgID is None:
                raise self.fault(f"{where}orgs: {quote(entry)} is not an organization UUID")
            if str(orgID) in orgs:
                raise self.fault(f"{where}orgs: organization {orgID} is listed twice")
            orgs.add(str(orgID))
        return frozenset(orgs)

    def fallbacks(self, table: dict[str, Any], where: str) -> tuple[str, ...]:
        entries = self.stringArray(table, "fallbacks", where, "model names")
        if entries is None:
            return ()
        if len(entries) > MAX_FALLBACKS:
            raise self.fault(f"{where}fallbacks lists more than {MAX_FALLBACKS} models")
        if len(set(entries)) != len(entries):
            twice = next(entry for entry in entries if entries.count(entry) > 1)
            raise self.fault(f"{where}fallbacks: {quote(twice)} is listed twice")
        return tuple(entries)


def _splitAuthority(authority: str) -> tuple[str, str | None]:
    """
    The host and port of C{host}, C{host:port}, C{[v6]} or C{[v6]:port};
    the host is empty when there is none to be found.
    """
    if authority.startswith("["):
        end = authority.find("]")
        if end < 2:
            return "", None
        rest = authority[end + 1 :]
        if rest and not rest.startswith(":"):
            return "", None
        return authority[1:end], rest[1:] if rest else None
    host, colon, port = authority.partition(":")
    return host, port if colon else None


def _isHost(host: str) -> bool:
    """
    A DNS name (letters, digits, '-', '_' and dots) or an IP address.
    """
    if _HOST_NAME.fullmatch(host):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
