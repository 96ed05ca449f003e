"""
The models the providers file names and the providers that serve them
(decisions D9), as plain values: what a model is called upstream, which
organizations may use it, its fallbacks, its output caps (D11, D12
amended), its price (D12) and its kind and vector length (D13).

Read and checked from the file by L{svcd.providers.table}; read by the
limits (what a request reserves, L{svcd.limits.reservation}), by the
forwarder (where a request goes) and by the metered call
(L{svcd.metered}), none of which need the reading to name a model.
"""

from __future__ import annotations

import attrs

from svcd.metering.prices import Price

# A provider's timeouts and bound when the file gives none.
DEFAULT_TIMEOUT = 60.0
DEFAULT_IDLE_TIMEOUT = 30.0
DEFAULT_MAX_CONNECTIONS = 16
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
# Decisions D14: the dialect a provider speaks, its C{api}: OpenAI's chat
# completions (the default) or Anthropic's Messages API.
OPENAI = "openai"
ANTHROPIC = "anthropic"
APIS = (OPENAI, ANTHROPIC)


@attrs.frozen
class Provider:
    """
    One endpoint of an OpenAI-compatible API, or of Anthropic's Messages
    API (decisions D14).

    @ivar baseURL: C{http(s)://host[:port][/path]} without a trailing
        slash; requests go to C{<baseURL>/chat/completions} and
        C{<baseURL>/embeddings} (D13), or to C{<baseURL>/messages} for an
        Anthropic provider (D14).
    @ivar apiKey: read at load from the variable named C{apiKeyEnv}, sent
        as C{Authorization: Bearer} (an Anthropic provider's as
        C{x-api-key}); None for a provider without a key. Never in a repr,
        a log line, an error or a span.
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
    # Decisions D14: the dialect it speaks, OPENAI or ANTHROPIC.
    api: str = OPENAI

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

    @property
    def messagesURL(self) -> str:
        """
        Where an Anthropic provider's messages are sent (D14).
        """
        return self.baseURL + "/messages"


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
        fails before answering (see
        L{svcd.providers.table.ProviderTable.attempts}).
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
