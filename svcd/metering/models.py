"""
The models the providers file names and the providers that serve them
(decisions D9), as plain values: what a model is called upstream, which
organizations may use it, its fallbacks, its output caps (D11, D12
amended), its price (D12), its kind and vector length (D13), and the
deployments that serve it and how a request chooses among them (D15).

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
# Decisions D15: the most deployments a model may list.
MAX_DEPLOYMENTS = 32
# Decisions D13: what a model answers, the route that may name it.
CHAT = "chat"
EMBEDDING = "embedding"
MODEL_KINDS = (CHAT, EMBEDDING)
# Decisions D14: the dialect a provider speaks, its C{api}: OpenAI's chat
# completions (the default) or Anthropic's Messages API.
OPENAI = "openai"
ANTHROPIC = "anthropic"
APIS = (OPENAI, ANTHROPIC)
# Decisions D15: how a request chooses among a model's deployments, the
# default first (L{svcd.providers.routing}).
WEIGHTED = "weighted"
LEAST_BUSY = "least_busy"
LATENCY = "latency"
ROUTINGS = (WEIGHTED, LEAST_BUSY, LATENCY)
# Decisions D15: a deployment failing this many times within
# svcd.providers.cooldowns.FAILURE_WINDOW seconds is skipped for the
# model's cooldown, in seconds.
DEFAULT_COOLDOWN = 10.0
DEFAULT_COOLDOWN_FAILURES = 3


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


def _providerName(deployment: Deployment) -> str:
    return deployment.provider.name


@attrs.frozen
class Deployment:
    """
    One upstream that serves a model (decisions D15): a provider and the
    name the model has there. A model named with one C{provider} is
    served by one deployment of weight 1, its provider's.

    @ivar weight: its share of the requests under C{weighted} routing (and
        the tie-break of C{least_busy} and C{latency}), relative to the
        model's other deployments.
    @ivar name: what metrics and the access log call it among the model's
        deployments: its provider's name, or C{provider/upstream_model}
        where the model has another deployment on the same provider (the
        providers file makes it so; unique within a model).
    """

    provider: Provider
    upstreamModel: str
    weight: float = 1.0
    name: str = attrs.field(default=attrs.Factory(_providerName, takes_self=True))


def _ownName(model: Model) -> str:
    return model.name


def _oneDeployment(model: Model) -> tuple[Deployment, ...]:
    return (Deployment(model.provider, model.upstreamModel),)


@attrs.frozen
class Model:
    """
    A model name that clients may send, and where it is served.

    @ivar provider: its first deployment's provider.
    @ivar upstreamModel: the C{model} sent to the provider (its first
        deployment's).
    @ivar orgs: canonical lowercase ids of the organizations that may use
        it, or None for every organization.
    @ivar fallbacks: names of the models tried, in order, when this one
        fails before answering (see
        L{svcd.providers.table.ProviderTable.attempts}).
    @ivar deployments: the upstreams that serve it (decisions D15), one to
        L{MAX_DEPLOYMENTS}; by default one, of C{provider} and
        C{upstreamModel}. The first is always C{provider} and
        C{upstreamModel}, so that code that knows one provider per model
        reads the first deployment's, and a model given C{deployments}
        must name its first deployment's as those too.
    @ivar routing: how a request orders the deployments it tries
        (L{ROUTINGS}, L{svcd.providers.routing}).
    @ivar maxAttempts: the most tries a request naming this model makes,
        over its deployments and its fallbacks' (decisions D15); None for
        one try of each (the default: the deployments plus the fallbacks).
    @ivar firstByteTimeout: seconds a try waits for the first byte of an
        answer before the next deployment is tried; None to wait for the
        provider's own timeouts (D9).
    @ivar cooldown: seconds a deployment is skipped after
        C{cooldownFailures} failures within
        L{svcd.providers.cooldowns.FAILURE_WINDOW} seconds.
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
    deployments: tuple[Deployment, ...] = attrs.field(
        default=attrs.Factory(_oneDeployment, takes_self=True)
    )
    routing: str = WEIGHTED
    maxAttempts: int | None = None
    firstByteTimeout: float | None = None
    cooldown: float = DEFAULT_COOLDOWN
    cooldownFailures: int = DEFAULT_COOLDOWN_FAILURES
    # The model as a try on each deployment but the first sees it
    # (L{atDeployment}), made once here rather than on each try. Not the
    # model itself: a model holding itself would be a reference cycle.
    _views: tuple[Model, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if not 1 <= len(self.deployments) <= MAX_DEPLOYMENTS:
            raise ValueError(f"a model has 1 to {MAX_DEPLOYMENTS} deployments")
        first = self.deployments[0]
        if first.provider != self.provider or first.upstreamModel != self.upstreamModel:
            raise ValueError("a model's provider and upstreamModel are its first deployment's")
        views = []
        for deployment in self.deployments[1:]:
            views.append(
                attrs.evolve(
                    self,
                    provider=deployment.provider,
                    upstreamModel=deployment.upstreamModel,
                    deployments=(deployment,),
                )
            )
        object.__setattr__(self, "_views", tuple(views))

    def atDeployment(self, index: int) -> Model:
        """
        This model as one try on its deployment C{index} sees it: the
        deployment's provider and upstream model in C{provider} and
        C{upstreamModel}, everything else the model's, so that the code
        that sends, translates and bills a try reads one model as before
        (decisions D15). The first deployment's is the model itself.
        """
        if index == 0:
            return self
        return self._views[index - 1]

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
