"""
The table the providers file yields (decisions D9; read and checked by
L{svcd.providers.providersfile}): the OpenAI-compatible providers that
svc-proxy forwards to (L{Provider}), the models clients may name
(L{Model}), the C{[memory]} table's settings (L{MemoryConfig}), and the
lookups every request makes of them (L{ProviderTable}: the model a client
named, the models to try in turn, the models an organization sees).

Fallbacks are transitive: when a model fails, its fallbacks are tried in
order, each followed by its own fallbacks (L{ProviderTable.attempts}). A
cycle would make that order endless, so it is a fault at load. Which
deployments of each model are tried, and in what order (decisions D15),
is the router's (L{svcd.providers.routing}): it takes this order of
models as it is.

Nothing here reads a file or the environment: the records are values,
and so can be built by hand (the tests do) as well as from the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from svcd.metering.models import CHAT, Model, Provider

__all__ = [
    "HYBRID",
    "RECALL_MODES",
    "TEXT",
    "VECTOR",
    "MemoryConfig",
    "ProviderTable",
    "modelsDocument",
]

VECTOR = "vector"
TEXT = "text"
HYBRID = "hybrid"
# How recall ranks (decisions D13, "Hybrid search"), the default first.
RECALL_MODES = (VECTOR, TEXT, HYBRID)


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
