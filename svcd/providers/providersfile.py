"""
The providers file (decisions D9): the OpenAI-compatible providers that
svc-proxy forwards to, and the models clients may name.

C{SVC_PROVIDERS_FILE} names a TOML file, read once at start with the
standard library's C{tomllib} and checked whole before the proxy listens:
a fault found later would be a request failing at 3 a.m. instead of a
deploy failing at once. Every fault raises
L{svcd.common.config.ConfigError} naming the file and the fault, which
the tap turns into one line on stderr and exit status 1. Unknown keys
are faults too, so that a typo (C{timout}) cannot silently leave a
default in place.

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
request may name. Decisions D13 add a model's C{kind} (C{"chat"}, the default, or
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
the rest of the file. Decisions D14 add a provider's C{api}: C{"openai"}
(the default) or C{"anthropic"}, a provider of Anthropic's Messages API
(its base URL without C{/messages}, its models chat models without a
C{cap_field}). Decisions D15 let a model name C{deployments} instead of
one C{provider} (L{svcd.providers.entries}), and say how a request
chooses among them and retries: C{routing}, C{max_attempts},
C{first_byte_timeout}, C{cooldown} and C{cooldown_failures} (what they
do is L{svcd.providers.routing}'s); a model with a deployment of an
Anthropic provider is held to what a model of one is.

Here the file is read and its document checked whole (its tables, the
names fallbacks and C{[memory]} give, the cycles); each C{[[providers]]}
and C{[[models]]} entry is checked by L{svcd.providers.entries}, each
value by the checks of L{svcd.providers.fields}; what they make is
L{svcd.providers.table}'s. A leaf: it imports neither Twisted nor gRPC,
so that reading a daemon's configuration loads neither.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from svcd.metering.models import ANTHROPIC, CHAT, EMBEDDING, Model, Provider
from svcd.providers.entries import EntryChecker
from svcd.providers.fields import VARIABLE, article, fault, quote, tomlType
from svcd.providers.table import (
    RECALL_MODES,
    VECTOR,
    MemoryConfig,
    ProviderTable,
)

__all__ = ["VARIABLE", "loadProviders", "providersFromEnvironment"]

# Bounds against the absurd, well above any sensible value.
MAX_FILE_BYTES = 1024 * 1024
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
    if not path:
        return None
    table = loadProviders(path, environ, clock)
    return table


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
                raise fault(path, "cannot read the file: it is a directory")
            if not stat.S_ISREG(status.st_mode):
                raise fault(path, "cannot read the file: it is not a regular file")
            with os.fdopen(descriptor, "rb", closefd=False) as providersFile:
                data = providersFile.read(MAX_FILE_BYTES + 1)
        finally:
            os.close(descriptor)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise fault(path, f"cannot read the file: {reason}") from None
    except ValueError:
        # os.open refuses a path with a NUL character.
        raise fault(path, "cannot read the file: the path is not valid") from None
    if len(data) > MAX_FILE_BYTES:
        raise fault(path, f"the file is larger than {MAX_FILE_BYTES} bytes")
    return data


def _parseTOML(path: str, data: bytes) -> dict[str, Any]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise fault(path, f"is not UTF-8 text (line {line})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise fault(path, f"is not valid TOML: {_tomlProblem(error)}") from None
    except ValueError:
        # int() refuses a literal of more than 4300 digits.
        raise fault(path, "is not valid TOML: a number has too many digits") from None
    except RecursionError:
        # tomllib recurses once per level of nested arrays or tables.
        raise fault(path, "is not valid TOML: arrays or tables are nested too deeply") from None


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


class _Checker(EntryChecker):
    """
    Turns the parsed document into a L{ProviderTable}, or raises for its
    first fault, in the file's order.
    """

    def table(self, document: dict[str, Any], loadedAt: int) -> ProviderTable:
        self.refuseUnknownKeys(document, _TOP_KEYS, "")
        providerTables = self.arrayOfTables(document, "providers")
        modelTables = self.arrayOfTables(document, "models")
        providers: dict[str, Provider] = {}
        for number, providerTable in enumerate(providerTables, 1):
            provider = self.provider(providerTable, number)
            if provider.name in providers:
                raise self.fault(f"provider {quote(provider.name)} is defined twice")
            providers[provider.name] = provider
        models: dict[str, Model] = {}
        for number, modelTable in enumerate(modelTables, 1):
            model = self.model(modelTable, number, providers)
            if model.name in models:
                raise self.fault(f"model {quote(model.name)} is defined twice")
            models[model.name] = model
        for model in models.values():
            for fallback in model.fallbacks:
                if fallback not in models:
                    raise self.fault(
                        f"model {quote(model.name)}: fallback {quote(fallback)} is not defined"
                    )
                if models[fallback].kind != model.kind:
                    # D13: a fallback answers the same route, so the same kind.
                    raise self.fault(
                        f"model {quote(model.name)}: fallback {quote(fallback)} is"
                        f" {article(models[fallback].kind)} model, and a fallback of"
                        f" {article(model.kind)} model must be one too"
                    )
        cycle = _fallbackCycle(models)
        if cycle is not None:
            raise self.fault("fallbacks form a cycle: " + " -> ".join(map(quote, cycle)))
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
            raise self.fault(f"memory must be written as a [memory] table, got {tomlType(table)}")
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
                + (quote(mode) if isinstance(mode, str) else tomlType(mode))
            )
        return MemoryConfig(
            embeddingModel=embedding,
            extractionModel=self.extractionModel(table, models, where),
            recallK=self.boundedInteger(table, "recall_k", 5, 1, MAX_RECALL_K, where),
            minScore=self.score(table, "min_score", 0.25, where),
            maxContextTokens=self.boundedInteger(
                table, "max_context_tokens", 1000, 1, MAX_CONTEXT_TOKENS, where
            ),
            dedupeScore=self.score(table, "dedupe_score", 0.92, where),
            recallMode=mode,
        )

    def extractionModel(
        self, table: dict[str, Any], models: Mapping[str, Model], where: str
    ) -> Model | None:
        """
        The worker's extraction model: a chat model of an OpenAI-compatible
        provider (decisions D14): extraction asks for a JSON object
        (C{response_format}), which Anthropic's Messages API has no
        counterpart for, so that every extraction would be refused.
        """
        model = self.memoryModel(table, "extraction_model", CHAT, models, where)
        if model is not None and any(
            deployment.provider.api == ANTHROPIC for deployment in model.deployments
        ):
            raise self.fault(
                f"{where}extraction_model {quote(model.name)} is a model of an Anthropic"
                " provider; extraction asks for JSON output (response_format), which"
                " Anthropic's Messages API cannot be asked for: name a model of an"
                " OpenAI-compatible provider"
            )
        return model

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
            raise self.fault(f"{where}{key} must be a model's name, got {tomlType(value)}")
        model = models.get(value)
        if model is None:
            raise self.fault(f"{where}{key} {quote(value)} is not a model of this file")
        if model.kind != kind:
            raise self.fault(
                f"{where}{key} {quote(value)} is {article(model.kind)} model;"
                f" it must be {article(kind)} model"
            )
        return model


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
