"""
The table the providers file yields (decisions D9; read and checked by
L{svcd.providers.providersfile}): the OpenAI-compatible providers that
svc-proxy forwards to (L{Provider}), the models clients may name
(L{Model}), the C{[memory]} table's settings (L{MemoryConfig}), and the
lookups every request makes of them (L{ProviderTable}: the model a client
named, the models to try in turn, the models an organization sees).

Fallbacks are transitive: when a model fails, its fallbacks are tried in
order, each followed by its own fallbacks (L{ProviderTable.attempts}). A
cycle would make that order endless, so it is a fault at load.

Nothing here reads a file or the environment: the records are values,
and so can be built by hand (the tests do) as well as from the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from svcd.providers.prices import Price

__all__ = [
    "CAP_FIELDS",
    "CHAT",
    "DEFAULT_MAX_OUTPUT_TOKENS",
    "EMBEDDING",
    "HYBRID",
    "MAX_COMPLETION_TOKENS",
    "MAX_TOKENS",
    "MODEL_KINDS",
    "RECALL_MODES",
    "TEXT",
    "VECTOR",
    "MemoryConfig",
    "Model",
    "Provider",
    "ProviderTable",
    "modelsDocument",
]

DEFAULT_TIMEOUT = 60.0
DEFAULT_IDLE_TIMEOUT = 30.0
DEFAULT_MAX_CONNECTIONS = 16

VECTOR = "vector"
TEXT = "text"
HYBRID = "hybrid"
# How recall ranks (decisions D13, "Hybrid search"), the default first.
RECALL_MODES = (VECTOR, TEXT, HYBRID)
# Decisions D12, amended: the largest output cap a request may name for a
# model whose entry gives no max_output_tokens. Bounded so that no cap can
# make a cost overflow int64 nano-dollars, far above any model's real one.
DEFAULT_MAX_OUTPUT_TOKENS = 1_048_576
# The keys a provider may take the output cap under.
MAX_COMPLETION_TOKENS = "max_completion_tokens"
MAX_TOKENS = "max_tokens"
CAP_FIELDS = (MAX_COMPLETION_TOKENS, MAX_TOKENS)
# Decisions D13: what a model answers, the route that may name it.
CHAT = "chat"
EMBEDDING = "embedding"
MODEL_KINDS = (CHAT, EMBEDDING)


@attrs.frozen
class Provider:
    """
    One OpenAI-compatible endpoint.

    @ivar baseURL: C{http(s)://host[:port][/path]} without a trailing
        slash; requests go to C{<baseURL>/chat/completions} and
        C{<baseURL>/embeddings} (D13).
    @ivar apiKey: read at load from the variable named C{apiKeyEnv}, sent
        as C{Authorization: Bearer}; None for a provider without a key.
        Never in a repr, a log line, an error or a span.
    @ivar timeout: seconds for a whole non-streaming answer.
    @ivar idleTimeout: seconds of the longest gap between stream events
        (the first one included).
    @ivar maxConnections: our extension of D9's shape: the bound of this
        provider's persistent connection pool.
    """

    name: str
    baseURL: str
    apiKey: str | None = attrs.field(default=None, repr=False)
    apiKeyEnv: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    idleTimeout: float = DEFAULT_IDLE_TIMEOUT
    maxConnections: int = DEFAULT_MAX_CONNECTIONS

    @property
    def chatCompletionsURL(self) -> str:
        """
        Where chat completions of this provider are sent (D9).
        """
        return self.baseURL + "/chat/completions"

    @property
    def embeddingsURL(self) -> str:
        """
        Where embeddings requests of this provider are sent (D13).
        """
        return self.baseURL + "/embeddings"


def _ownName(model: Model) -> str:
    return model.name


@attrs.frozen
class Model:
    """
    A model name that clients may send, and where it is served.

    @ivar upstreamModel: the C{model} sent to the provider.
    @ivar orgs: canonical lowercase ids of the organizations that may use
        it, or None for every organization.
    @ivar fallbacks: names of the models tried, in order, when this one
        fails before answering (see L{ProviderTable.attempts}).
    """

    name: str
    provider: Provider
    upstreamModel: str = attrs.field(default=attrs.Factory(_ownName, takes_self=True))
    orgs: frozenset[str] | None = None
    fallbacks: tuple[str, ...] = ()
    # The output cap assumed for a request that names none, when neither
    # its agent's nor its organization's limits row has one (D11).
    maxOutputTokens: int | None = None
    # What its tokens cost (D12); None when the file gives no price.
    price: Price | None = None
    # The key its provider takes the output cap under (D12, amended).
    capField: str = MAX_COMPLETION_TOKENS
    # What it answers (D13): CHAT or EMBEDDING, the route that may name it.
    kind: str = CHAT
    # An embedding model's vector length, when the file gives it (D13).
    dimensions: int | None = None

    @property
    def outputCeiling(self) -> int:
        """
        The largest output cap a request may name for this model (D12,
        amended): its C{max_output_tokens}, else
        L{DEFAULT_MAX_OUTPUT_TOKENS}.
        """
        if self.maxOutputTokens is not None:
            return self.maxOutputTokens
        return DEFAULT_MAX_OUTPUT_TOKENS

    def allows(self, orgID: str) -> bool:
        """
        May the organization C{orgID} use this model?
        """
        return self.orgs is None or orgID.lower() in self.orgs


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
