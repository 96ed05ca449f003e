"""
The providers file (decisions D9): the OpenAI-compatible providers that
svc-proxy forwards to, and the models clients may name.

C{SVC_PROVIDERS_FILE} names a TOML file, read once at start with the
standard library's C{tomllib} and checked whole before the proxy listens:
a fault found later would be a request failing at 3 a.m. instead of a
deploy failing at once. Every fault raises L{ConfigError} naming the file
and the fault, which the tap turns into one line on stderr and exit
status 1. Unknown keys are faults too, so that a typo (C{timout}) cannot
silently leave a default in place.

A provider's key never sits in the file: C{api_key_env} names the
environment variable that holds it, read here at load. The key is kept out
of every repr, and no error repeats it, nor anything of C{base_url} (a URL
can carry credentials, which are refused but never echoed).

Fallbacks are transitive: when a model fails, its fallbacks are tried in
order, each followed by its own fallbacks (L{ProviderTable.attempts}). A
cycle would make that order endless, so it is a fault at load.

Our one extension of D9's shape is C{max_connections} (per provider,
default 16): how many requests go to that provider at once, over as many
persistent connections (L{svcd.providers.upstream}). Decisions D11
add C{max_output_tokens} to a model (optional): the output cap its token
reservation assumes when a request names none; decisions D12 add its
C{price} (optional): C{{ input = "2.50", output = "10.00", cached_input =
"1.25" }}, US dollars per million tokens as decimal strings, read exactly
(L{svcd.metering.prices}). Decisions D12, amended, add C{cap_field}
(optional): the key under which the gateway sends the output cap a budget
assumed when the request named none, C{"max_completion_tokens"} (the
default, OpenAI's) or C{"max_tokens"} (for providers that know only the
older key); and make C{max_output_tokens} (default
L{svcd.metering.models.DEFAULT_MAX_OUTPUT_TOKENS}) the largest cap a
request may name.
Decisions D13 add a model's C{kind} (C{"chat"}, the default, or
C{"embedding"}: a model answers only the route of its kind) and, for an
embedding model, C{dimensions} (optional): the length of the vectors it
makes, the most a request may ask for. An embedding model's fallbacks are
embedding models and a chat model's chat models; its price needs no
C{output} (embeddings have no output tokens); C{max_output_tokens} and
C{cap_field}, which bound an answer's output, are for chat models only.
They also add the optional C{[memory]} table (L{MemoryConfig}): the
embedding model that memory uses (required in the table; without the
table, memory is off; memory uses it alone, never its fallbacks), the
worker's extraction model, and recall's settings, each checked here like
the rest of the file.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
import tomllib
from collections.abc import Callable, Iterator, Mapping
from datetime import date, time
from typing import Any

import attrs

from svcd.common.config import ConfigError, parseDuration
from svcd.common.ids import parseUUID
from svcd.metering.models import (
    CAP_FIELDS,
    CHAT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    EMBEDDING,
    MAX_COMPLETION_TOKENS,
    MAX_TOKENS,
    MODEL_KINDS,
    Model,
    Provider,
)
from svcd.metering.prices import BadPrice, Price, parseDollars

__all__ = [
    "VARIABLE",
    "ProviderTable",
    "loadProviders",
    "modelsDocument",
    "providersFromEnvironment",
]

VARIABLE = "SVC_PROVIDERS_FILE"

# Bounds against the absurd, well above any sensible value.
MAX_FILE_BYTES = 1024 * 1024
MAX_DURATION = 3600.0
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
_TOML_POSITION = re.compile(r"(.*?)\s*(\((?:at line \d+, column \d+|at end of document)\))", re.S)

_TOP_KEYS = ("providers", "models", "memory")
# Decisions D13: the [memory] table's keys and their defaults.
_MEMORY_KEYS = (
    "embedding_model",
    "extraction_model",
    "recall_k",
    "min_score",
    "max_context_tokens",
    "dedupe_score",
    "recall_mode",
)
# The most memories a recall may ask for: POST /v1/memories/search's k.
MAX_RECALL_K = 50
# Far above any context window, low enough that no estimate overflows.
MAX_CONTEXT_TOKENS = 1_000_000
VECTOR = "vector"
TEXT = "text"
HYBRID = "hybrid"
# How recall ranks (decisions D13, "Hybrid search"), the default first.
RECALL_MODES = (VECTOR, TEXT, HYBRID)
_PROVIDER_KEYS = ("name", "base_url", "api_key_env", "timeout", "idle_timeout", "max_connections")
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
_PRICE_KEYS = ("input", "output", "cached_input")
# Unknown keys that look like someone putting a key in the file.
_SECRET_LIKE = frozenset(
    {"api_key", "apikey", "key", "token", "secret", "password", "authorization"}
)


@attrs.frozen
class MemoryConfig:
    """
    The providers file's C{[memory]} table (decisions D13): the models
    memory uses and how recall behaves, the same for every organization.

    @ivar embeddingModel: the C{kind = "embedding"} model that embeds
        every memory and every query; memory is off without it. Alone:
        memory never tries its fallbacks (decisions D13 amended, "Vectors
        never mix"), which still answer for it on C{POST /v1/embeddings}.
    @ivar extractionModel: the chat model the worker asks for memories, or
        None (then an observation's user text is its one memory).
    @ivar recallK: how many memories a recall asks for.
    @ivar minScore: the least cosine similarity a recalled memory has
        (vector mode only).
    @ivar maxContextTokens: the most tokens (D11's estimate) the message of
        recalled memories may take.
    @ivar dedupeScore: the similarity at or above which the worker's new
        memory replaces the scope's nearest one instead of adding to it.
    @ivar recallMode: how recall ranks: C{"vector"}, C{"text"} or
        C{"hybrid"} (decisions D13, "Hybrid search").
    """

    embeddingModel: Model
    extractionModel: Model | None = None
    recallK: int = 5
    minScore: float = 0.25
    maxContextTokens: int = 1000
    dedupeScore: float = 0.92
    recallMode: str = VECTOR


@attrs.frozen
class ProviderTable:
    """
    The checked content of the providers file.

    @ivar providers: by name, in the file's order.
    @ivar models: by name, in the file's order.
    @ivar path: the file it was read from.
    @ivar loadedAt: when it was read, in whole Unix seconds: the
        C{created} of every model in GET /v1/models.
    """

    providers: Mapping[str, Provider]
    models: Mapping[str, Model]
    path: str
    loadedAt: int
    # Decisions D13: the [memory] table, None when the file has none.
    memory: MemoryConfig | None = None
    # The fallback order of each model, before any org filtering, worked
    # out once here rather than on each request.
    _chains: Mapping[str, tuple[Model, ...]] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        chains = {name: _chain(model, self.models) for name, model in self.models.items()}
        object.__setattr__(self, "_chains", chains)

    def modelFor(self, name: str, orgID: str, kind: str = CHAT) -> Model | None:
        """
        The model a client named on the route of C{kind}, or None when the
        file does not list it, lists it for other organizations only, or
        lists it with another kind (D13: a chat route naming an embedding
        model, or the reverse): all answer 501 PROVIDER_NOT_CONFIGURED,
        never a hint that it exists elsewhere.
        """
        model = self.models.get(name)
        if model is None or model.kind != kind or not model.allows(orgID):
            return None
        return model

    def attempts(self, model: Model, orgID: str) -> tuple[Model, ...]:
        """
        The models to try, in order, for a request naming C{model}: the
        model, then each of its fallbacks in order, each followed at once
        by its own fallbacks (depth first); each model at most once, and
        only those C{orgID} may use.

        A model the organization may not use is left out, but its own
        fallbacks are still reached through it: the order does not depend
        on the organization, only what is taken from it.
        """
        chain = self._chains.get(model.name)
        if chain is None or chain[0] is not model:
            chain = _chain(model, self.models)
        return tuple(candidate for candidate in chain if candidate.allows(orgID))

    def modelsFor(self, orgID: str) -> tuple[Model, ...]:
        """
        The models C{orgID} may use, in the file's order.
        """
        return tuple(model for model in self.models.values() if model.allows(orgID))


def modelsDocument(table: ProviderTable, orgID: str) -> dict[str, Any]:
    """
    The body of GET /v1/models (D9): OpenAI's list shape with the models
    the caller's organization may use, owned by their provider's name,
    created when the file was read.
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

    @param path: the file (the value of C{SVC_PROVIDERS_FILE}).
    @param environ: where the variables named by C{api_key_env} are read.
    @param clock: the current time in Unix seconds (C{time.time}, or a
        reactor's C{seconds}); the table records when it was read.
    @raise ConfigError: for C{SVC_PROVIDERS_FILE}, naming the file and the
        first fault found.
    """
    document = _parseTOML(path, _readFile(path))
    return _Checker(path, environ).table(document, int(clock()))


def providersFromEnvironment(
    environ: Mapping[str, str], clock: Callable[[], float]
) -> ProviderTable | None:
    """
    The table of the file C{SVC_PROVIDERS_FILE} names, or None when it is
    unset or empty: no provider, every valid chat request answers 501 as
    in Phase 1.
    """
    path = environ.get(VARIABLE, "").strip()
    return loadProviders(path, environ, clock) if path else None


def _fault(path: str, problem: str) -> ConfigError:
    shownPath = path if path.isprintable() else ascii(path)
    return ConfigError(VARIABLE, f"{shownPath}: {problem}")


def _readFile(path: str) -> bytes:
    """
    The file's bytes. Opened without blocking, so that a FIFO named by
    mistake is refused instead of waiting for a writer forever; its type is
    then checked on the descriptor itself, not on a path that could change
    in between.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            status = os.fstat(descriptor)
            if stat.S_ISDIR(status.st_mode):
                raise _fault(path, "cannot read the file: it is a directory")
            if not stat.S_ISREG(status.st_mode):
                raise _fault(path, "cannot read the file: it is not a regular file")
            with os.fdopen(descriptor, "rb", closefd=False) as providersFile:
                data = providersFile.read(MAX_FILE_BYTES + 1)
        finally:
            os.close(descriptor)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise _fault(path, f"cannot read the file: {reason}") from None
    except ValueError:
        # os.open refuses a path with a NUL character.
        raise _fault(path, "cannot read the file: the path is not valid") from None
    if len(data) > MAX_FILE_BYTES:
        raise _fault(path, f"the file is larger than {MAX_FILE_BYTES} bytes")
    return data


def _parseTOML(path: str, data: bytes) -> dict[str, Any]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise _fault(path, f"is not UTF-8 text (line {line})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise _fault(path, f"is not valid TOML: {_tomlProblem(error)}") from None
    except ValueError:
        # int() refuses a literal of more than 4300 digits.
        raise _fault(path, "is not valid TOML: a number has too many digits") from None
    except RecursionError:
        # tomllib recurses once per level of nested arrays or tables.
        raise _fault(path, "is not valid TOML: arrays or tables are nested too deeply") from None


def _tomlProblem(error: tomllib.TOMLDecodeError) -> str:
    """
    tomllib's own words with its line and column, the words cut short: a
    few of them quote a key of the file, which could be long.
    """
    message = str(error)
    match = _TOML_POSITION.fullmatch(message)
    words, position = (match.group(1), " " + match.group(2)) if match else (message, "")
    if len(words) > 120:
        words = words[:120] + "..."
    return words.replace("\n", " ") + position


def _quote(text: str, limit: int = 64) -> str:
    """
    A value of the file as it may appear in an error: double-quoted,
    escaped to one line of ASCII, and cut short.
    """
    if len(text) > limit:
        return json.dumps(text[:limit])[:-1] + '..."'
    return json.dumps(text)


def _kind(value: object) -> str:
    """
    The TOML type of a value, for an error that says what was found.
    """
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, (date, time)):
        return "a date or time"
    return type(value).__name__


def _show(value: object) -> str:
    """
    A scalar of the file as it may appear in an error. An integer of
    thousands of digits is not written out: str() refuses it.
    """
    if isinstance(value, str):
        return _quote(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value) if abs(value) < 10**18 else "a very large number"
    if isinstance(value, float):
        return repr(value)
    return _kind(value)


class _Checker:
    """
    Turns the parsed document into a L{ProviderTable}, or raises for its
    first fault, in the file's order.
    """

    def __init__(self, path: str, environ: Mapping[str, str]) -> None:
        self._path = path
        self._environ = environ

    def fault(self, problem: str) -> ConfigError:
        return _fault(self._path, problem)

    def table(self, document: dict[str, Any], loadedAt: int) -> ProviderTable:
        self.refuseUnknownKeys(document, _TOP_KEYS, "")
        providerTables = self.arrayOfTables(document, "providers")
        modelTables = self.arrayOfTables(document, "models")
        providers: dict[str, Provider] = {}
        for number, providerTable in enumerate(providerTables, 1):
            provider = self.provider(providerTable, number)
            if provider.name in providers:
                raise self.fault(f"provider {_quote(provider.name)} is defined twice")
            providers[provider.name] = provider
        models: dict[str, Model] = {}
        for number, modelTable in enumerate(modelTables, 1):
            model = self.model(modelTable, number, providers)
            if model.name in models:
                raise self.fault(f"model {_quote(model.name)} is defined twice")
            models[model.name] = model
        for model in models.values():
            for fallback in model.fallbacks:
                if fallback not in models:
                    raise self.fault(
                        f"model {_quote(model.name)}: fallback {_quote(fallback)} is not defined"
                    )
                if models[fallback].kind != model.kind:
                    # D13: a fallback answers the same route, so the same kind.
                    raise self.fault(
                        f"model {_quote(model.name)}: fallback {_quote(fallback)} is"
                        f" {_article(models[fallback].kind)} model, and a fallback of"
                        f" {_article(model.kind)} model must be one too"
                    )
        cycle = _fallbackCycle(models)
        if cycle is not None:
            raise self.fault("fallbacks form a cycle: " + " -> ".join(map(_quote, cycle)))
        memory = self.memory(document, models)
        return ProviderTable(
            providers=providers, models=models, path=self._path, loadedAt=loadedAt, memory=memory
        )

    def memory(self, document: dict[str, Any], models: Mapping[str, Model]) -> MemoryConfig | None:
        """
        The C{[memory]} table (decisions D13), checked against the models
        it names; None when the file has none.
        """
        table = document.get("memory")
        if table is None:
            return None
        if not isinstance(table, dict):
            raise self.fault(f"memory must be written as a [memory] table, got {_kind(table)}")
        where = "[memory]: "
        self.refuseUnknownKeys(table, _MEMORY_KEYS, where)
        embedding = self.memoryModel(table, "embedding_model", EMBEDDING, models, where)
        if embedding is None:
            raise self.fault(f"{where}embedding_model is required (an embedding model's name)")
        mode = table.get("recall_mode", VECTOR)
        if mode not in RECALL_MODES:
            raise self.fault(
                f"{where}recall_mode must be one of "
                + ", ".join(f'"{each}"' for each in RECALL_MODES)
                + ", got "
                + (_quote(mode) if isinstance(mode, str) else _kind(mode))
            )
        return MemoryConfig(
            embeddingModel=embedding,
            extractionModel=self.memoryModel(table, "extraction_model", CHAT, models, where),
            recallK=self.boundedInteger(table, "recall_k", 5, 1, MAX_RECALL_K, where),
            minScore=self.score(table, "min_score", 0.25, where),
            maxContextTokens=self.boundedInteger(
                table, "max_context_tokens", 1000, 1, MAX_CONTEXT_TOKENS, where
            ),
            dedupeScore=self.score(table, "dedupe_score", 0.92, where),
            recallMode=mode,
        )

    def memoryModel(
        self,
        table: dict[str, Any],
        key: str,
        kind: str,
        models: Mapping[str, Model],
        where: str,
    ) -> Model | None:
        value = table.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fault(f"{where}{key} must be a model's name, got {_kind(value)}")
        model = models.get(value)
        if model is None:
            raise self.fault(f"{where}{key} {_quote(value)} is not a model of this file")
        if model.kind != kind:
            raise self.fault(
                f"{where}{key} {_quote(value)} is {_article(model.kind)} model;"
                f" it must be {_article(kind)} model"
            )
        return model

    def boundedInteger(
        self, table: dict[str, Any], key: str, default: int, least: int, most: int, where: str
    ) -> int:
        value = table.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fault(f"{where}{key} must be an integer, got {_kind(value)}")
        if not least <= value <= most:
            raise self.fault(f"{where}{key} must be from {least} to {most:,}, got {_show(value)}")
        return value

    def score(self, table: dict[str, Any], key: str, default: float, where: str) -> float:
        """
        A cosine similarity: a number from -1 to 1 (an integer is taken as
        the number it is).
        """
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fault(f"{where}{key} must be a number, got {_kind(value)}")
        if not -1.0 <= value <= 1.0:
            raise self.fault(f"{where}{key} must be from -1 to 1, got {_show(value)}")
        return float(value)

    def refuseUnknownKeys(self, table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
        for key in table:
            if key in known:
                continue
            hint = ""
            if key.lower() in _SECRET_LIKE:
                hint = (
                    "; a key never sits in the file: name the environment variable "
                    "that holds it with api_key_env"
                )
            raise self.fault(
                f"{where}unknown key {_quote(key)} (expected {', '.join(known)}){hint}"
            )

    def arrayOfTables(self, document: dict[str, Any], key: str) -> list[dict[str, Any]]:
        value = document.get(key)
        if value is None or value == []:
            raise self.fault(f"has no [[{key}]] table")
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise self.fault(f"{key} must be written as [[{key}]] tables, got {_kind(value)}")
        return value

    def where(
        self,
        kind: str,
        table: dict[str, Any],
        number: int,
        pattern: re.Pattern[str],
        maxLength: int,
    ) -> str:
        """
        How errors name a table: by its name when that is valid, else by
        its place in the file.
        """
        name = table.get("name")
        if isinstance(name, str) and len(name) <= maxLength and pattern.fullmatch(name):
            return f"{kind} {_quote(name)}: "
        return f"[[{kind}s]] table {number}: "

    def text(
        self,
        table: dict[str, Any],
        key: str,
        where: str,
        pattern: re.Pattern[str],
        maxLength: int,
        rule: str,
    ) -> str | None:
        """
        An optional string key that must follow C{pattern}; None when
        absent.
        """
        value = table.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fault(f"{where}{key} must be a string, got {_kind(value)}")
        if not value.strip():
            raise self.fault(f"{where}{key} must not be empty")
        if len(value) > maxLength:
            raise self.fault(f"{where}{key} is longer than {maxLength} characters")
        if not pattern.fullmatch(value):
            raise self.fault(f"{where}{key} {_quote(value)} may hold only {rule}")
        return value

    def requiredText(
        self,
        table: dict[str, Any],
        key: str,
        where: str,
        pattern: re.Pattern[str],
        maxLength: int,
        rule: str,
    ) -> str:
        value = self.text(table, key, where, pattern, maxLength, rule)
        if value is None:
            raise self.fault(f"{where}{key} is required")
        return value

    def provider(self, table: dict[str, Any], number: int) -> Provider:
        where = self.where("provider", table, number, _PROVIDER_NAME, MAX_PROVIDER_NAME)
        self.refuseUnknownKeys(table, _PROVIDER_KEYS, where)
        name = self.requiredText(
            table, "name", where, _PROVIDER_NAME, MAX_PROVIDER_NAME, _PROVIDER_NAME_RULE
        )
        apiKeyEnv, apiKey = self.apiKey(table, where)
        return Provider(
            name=name,
            baseURL=self.baseURL(table, where),
            apiKey=apiKey,
            apiKeyEnv=apiKeyEnv,
            timeout=self.duration(table, "timeout", DEFAULT_TIMEOUT, where),
            idleTimeout=self.duration(table, "idle_timeout", DEFAULT_IDLE_TIMEOUT, where),
            maxConnections=self.maxConnections(table, where),
        )

    def baseURL(self, table: dict[str, Any], where: str) -> str:
        """
        C{http(s)://host[:port][/path]}. The value is never quoted back: a
        URL can hold a password or a key in its query.
        """
        value = table.get("base_url")
        if value is None:
            raise self.fault(f"{where}base_url is required")
        if not isinstance(value, str):
            raise self.fault(f"{where}base_url must be a string, got {_kind(value)}")
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
        for route in ("/chat/completions", "/embeddings"):
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

    def duration(self, table: dict[str, Any], key: str, default: float, where: str) -> float:
        """
        A duration written as the variables' (C{60s}, C{500ms}, C{2m}, a
        bare number of seconds), as a string or a TOML number.
        """
        value = table.get(key)
        if value is None:
            return default
        if isinstance(value, str):
            try:
                seconds = parseDuration(value)
            except ValueError as error:
                raise self.fault(f"{where}{key} {error}, got {_show(value)}") from None
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if not value > 0:
                raise self.fault(f"{where}{key} must be greater than zero, got {_show(value)}")
            seconds = value
        else:
            raise self.fault(f'{where}{key} must be a duration such as "60s", got {_kind(value)}')
        if seconds > MAX_DURATION:
            raise self.fault(
                f"{where}{key} must be at most {MAX_DURATION:.0f}s (one hour), got {_show(value)}"
            )
        return float(seconds)

    def maxConnections(self, table: dict[str, Any], where: str) -> int:
        value = table.get("max_connections")
        if value is None:
            return DEFAULT_MAX_CONNECTIONS
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fault(f"{where}max_connections must be an integer, got {_kind(value)}")
        if not 1 <= value <= MAX_CONNECTIONS:
            raise self.fault(
                f"{where}max_connections must be from 1 to {MAX_CONNECTIONS}, got {_show(value)}"
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
            raise self.fault(f"{where}provider must be a string, got {_kind(providerName)}")
        provider = providers.get(providerName)
        if provider is None:
            raise self.fault(f"{where}provider {_quote(providerName)} is not defined")
        upstreamModel = self.text(
            table, "upstream_model", where, _MODEL_NAME, MAX_UPSTREAM_MODEL, _MODEL_NAME_RULE
        )
        kind = self.modelKind(table, where)
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

    def modelKind(self, table: dict[str, Any], where: str) -> str:
        value = table.get("kind")
        if value is None:
            return CHAT
        if not isinstance(value, str):
            raise self.fault(f"{where}kind must be a string, got {_kind(value)}")
        if value not in MODEL_KINDS:
            raise self.fault(f'{where}kind must be "{CHAT}" or "{EMBEDDING}", got {_quote(value)}')
        return value

    def dimensions(self, table: dict[str, Any], where: str) -> int | None:
        value = table.get("dimensions")
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fault(f"{where}dimensions must be an integer, got {_kind(value)}")
        if not 1 <= value <= MAX_DIMENSIONS:
            raise self.fault(
                f"{where}dimensions must be from 1 to {MAX_DIMENSIONS}, got {_show(value)}"
            )
        return value

    def capField(self, table: dict[str, Any], where: str) -> str:
        value = table.get("cap_field")
        if value is None:
            return MAX_COMPLETION_TOKENS
        if not isinstance(value, str):
            raise self.fault(f"{where}cap_field must be a string, got {_kind(value)}")
        if value not in CAP_FIELDS:
            raise self.fault(
                f'{where}cap_field must be "{MAX_COMPLETION_TOKENS}" or "{MAX_TOKENS}",'
                f" got {_quote(value)}"
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
                f" got {_kind(value)}"
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
                    f" a TOML number would be a float), got {_kind(text)}"
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
        )

    def maxOutputTokens(self, table: dict[str, Any], where: str) -> int | None:
        value = table.get("max_output_tokens")
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fault(f"{where}max_output_tokens must be an integer, got {_kind(value)}")
        if not 1 <= value <= MAX_OUTPUT_TOKENS:
            raise self.fault(
                f"{where}max_output_tokens must be from 1 to {MAX_OUTPUT_TOKENS},"
                f" got {_show(value)}"
            )
        return value

    def stringArray(
        self, table: dict[str, Any], key: str, where: str, what: str
    ) -> list[str] | None:
        value = table.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.fault(f"{where}{key} must be an array of {what} (strings)")
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
                raise self.fault(f"{where}orgs: {_quote(entry)} is not an organization UUID")
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
            raise self.fault(f"{where}fallbacks: {_quote(twice)} is listed twice")
        return tuple(entries)


def _article(kind: str) -> str:
    """
    C{kind} with its indefinite article, for an error: "a chat", "an
    embedding".
    """
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


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


def _fallbackCycle(models: Mapping[str, Model]) -> list[str] | None:
    """
    The first cycle of fallbacks in the file's order (C{["a", "b", "a"]}),
    or None. Walked with an explicit stack: a long chain of fallbacks must
    not reach Python's recursion limit.
    """
    onPath: set[str] = set()
    done: set[str] = set()
    for start in models:
        if start in done:
            continue
        path = [start]
        pending: list[Iterator[str]] = [iter(models[start].fallbacks)]
        onPath.add(start)
        while pending:
            following = next(pending[-1], None)
            if following is None:
                finished = path.pop()
                onPath.discard(finished)
                done.add(finished)
                pending.pop()
            elif following in onPath:
                return [*path[path.index(following) :], following]
            elif following not in done:
                path.append(following)
                onPath.add(following)
                pending.append(iter(models[following].fallbacks))
    return None


def _chain(model: Model, models: Mapping[str, Model]) -> tuple[Model, ...]:
    """
    C{model} and its fallbacks, depth first, each once (see
    L{ProviderTable.attempts}); names that C{models} lacks are passed over.
    """
    order: list[Model] = []
    seen: set[str] = set()
    stack = [model]
    while stack:
        current = stack.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        order.append(current)
        stack.extend(models[name] for name in reversed(current.fallbacks) if name in models)
    return tuple(order)
