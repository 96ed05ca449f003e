"""
How many tokens a chat completion reserves at admission (decisions D11).

A token limit must hold before the answer exists, so the request reserves
its worst case when it is admitted and is settled to the provider's usage
when the answer ends. The worst case is the prompt's estimate plus the
output cap:

  - the prompt: the UTF-8 bytes of every message's content, divided by 3
    and rounded up, plus 4 tokens per message (a tokenizer's typical ratio
    for English is 4 bytes per token; 3 errs on the side of reserving
    more, and the 4 per message stand for the role and framing);
  - the output cap: the request's C{max_completion_tokens}, else its
    C{max_tokens}, else the agent's or organization's C{max_output_tokens},
    else the model's in the providers file, else L{DEFAULT_OUTPUT_CAP}.

That estimate is what rpm and tpm count. A budget needs more: an upper
bound of what the answer can cost, so that no number of requests at once
can pass it (decisions D12, amended; L{worstCaseCost}):

  - the output cap it assumes is sent to the provider when the request
    named none (the edge passes it to the forwarder), each choice of
    C{n} may be that long, and a request naming both caps is bounded by
    the larger;
  - the prompt is at most one token per byte of the body sent (a
    byte-level tokenizer makes at most one token of a byte), so tools,
    schemas, tool calls and digits are all counted;
  - the price is that of the dearest model that may answer (the model
    and its fallbacks, measured with each one's own body).

An embeddings request (decisions D13) has no output: it reserves its
inputs' estimate (L{inputsEstimate}: D11's bytes / 3 per input, no
tokens per message, no cap), which is what rpm and tpm count, and under
a budget a worst case bounded the same way as a chat prompt's: one token
per byte of the body sent, at the dearest input price of the model and
its fallbacks (L{reserveEmbeddings}). The estimate alone would not bound
the cost: a tokenizer may make a token of every byte (and some add a
token or two per input), three times the estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from svcd.common.errors import ApiError, FieldError, FieldErrorCode, validationError
from svcd.limits.book import Applicable
from svcd.metering.bodies import attemptBody, embeddingsBody
from svcd.metering.models import Model
from svcd.providers.routing import bodyKey

DEFAULT_OUTPUT_CAP = 4096
TOKENS_PER_MESSAGE = 4
BYTES_PER_TOKEN = 3

# The body sent to a model for a request's object and the cap sent with it,
# or None when that model cannot be sent it and is never tried (decisions
# D14: a translation that fails); L{attemptBody} by default.
BodyMaker = Callable[[Mapping[str, Any], Model, "int | None"], "bytes | None"]


class AttemptOrder(Protocol):
    """
    What the reservation reads of the providers file: the models that may
    answer a request, in order (L{svcd.providers.table.ProviderTable} is
    one). A Protocol, so that the limits import nothing of the providers.
    """

    def attempts(self, model: Model, orgID: str) -> tuple[Model, ...]: ...


class ChatBody(Protocol):
    """
    What the worst case reads of a chat completion's request: svc-proxy's
    parsed body (L{svcd.proxy.http.chatbody.ChatRequest}) is one. A
    Protocol, so that the limits import nothing of a daemon.
    """

    @property
    def messages(self) -> Sequence[Mapping[str, Any]]: ...

    @property
    def document(self) -> Mapping[str, Any]:
        """
        The whole JSON object, as it is forwarded.
        """

    @property
    def maxTokens(self) -> int | None: ...

    @property
    def maxCompletionTokens(self) -> int | None: ...

    @property
    def choices(self) -> int:
        """
        How many choices the answer has (C{n}), each up to the cap.
        """


def promptEstimate(messages: Sequence[Mapping[str, Any]]) -> int:
    """
    The prompt's tokens, estimated from its messages' contents.
    """
    contentBytes = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            contentBytes += len(content.encode("utf-8", "surrogatepass"))
        elif isinstance(content, list):
            # Decisions D14: text parts (to a model of an Anthropic
            # provider) count as the string they would be.
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    contentBytes += len(text.encode("utf-8", "surrogatepass"))
    return -(-contentBytes // BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE * len(messages)


def _requested(document: Mapping[str, Any], name: str) -> int | None:
    value = document.get(name)
    # A boolean is an int in Python, never a token count.
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def outputCap(document: Mapping[str, Any], applicable: Applicable, modelCap: int | None) -> int:
    """
    The most tokens the answer may have, as far as the gateway can know.
    """
    for cap in (
        _requested(document, "max_completion_tokens"),
        _requested(document, "max_tokens"),
        applicable.maxOutputTokens,
        modelCap,
    ):
        if cap is not None:
            return cap
    return DEFAULT_OUTPUT_CAP


def namedCap(chat: ChatBody) -> int | None:
    """
    The output cap the request named itself: the larger of
    C{max_completion_tokens} and C{max_tokens} when it names both (a
    provider may honour either), None when it names neither.
    """
    caps = [cap for cap in (chat.maxCompletionTokens, chat.maxTokens) if cap is not None]
    return max(caps) if caps else None


def worstCaseCost(
    chat: ChatBody,
    attempts: Sequence[Model],
    cap: int,
    sentCap: int | None,
    extraBytes: int = 0,
    bodies: dict[str, bytes] | None = None,
    body: BodyMaker = attemptBody,
) -> int:
    """
    The most the answer to C{chat} can cost, in nano-dollars, whichever of
    C{attempts} answers it (decisions D12, amended): for each, its prompt
    is the byte length of the body it is sent (L{attemptBody}, with
    C{sentCap} added when the request named none), its answer C{n} choices
    of the cap it is bound by (C{sentCap} as that model is sent it, else
    the request's own C{cap}), at its price; the largest of those. Models
    without a price count nothing (under a budget they are never tried).
    C{extraBytes} are bytes the gateway may add to the body before it is
    sent (decisions D13: a recall's message of memories, at its bound).
    C{bodies}, when given, gets each body measured, by
    L{svcd.providers.routing.bodyKey} (every deployment of each model,
    decisions D15: the worst case is the largest over them), so that the
    forwarder sends it without serializing the request again. C{body}
    makes each body (decisions D14: translated for a provider of another
    dialect; a model it makes none for is never tried, and counts nothing).
    """
    worst = 0
    for model in attempts:
        price = model.price
        if price is None:
            continue
        completion = min(sentCap, model.outputCeiling) if sentCap is not None else cap
        # Decisions D15: every deployment may answer, each sent its own
        # body (its upstream model, its provider's dialect).
        for index in range(len(model.deployments)):
            sent = body(chat.document, model.atDeployment(index), sentCap)
            if sent is None:
                continue
            if bodies is not None:
                bodies[bodyKey(model, index)] = sent
            worst = max(worst, price.worstCase(len(sent) + extraBytes, completion * chat.choices))
    return worst


def attemptsOf(
    providers: AttemptOrder, model: Model, orgID: str, budgeted: bool
) -> tuple[Model, ...]:
    """
    The models a request may be answered by, in order: under a budget,
    never one without a price (decisions D12, amended: never billed at
    zero); the model asked for has one, or the request was refused
    (L{modelRefusal}).
    """
    attempts = providers.attempts(model, orgID)
    if budgeted:
        attempts = tuple(attempt for attempt in attempts if attempt.price is not None)
    return attempts


def reserve(
    chat: ChatBody,
    model: Model,
    providers: AttemptOrder,
    orgID: str,
    applicable: Applicable,
    extraBytes: int = 0,
    bodies: dict[str, bytes] | None = None,
    body: BodyMaker = attemptBody,
) -> tuple[int, int, int | None, int]:
    """
    What a chat completion that will be forwarded to C{model} reserves at
    admission (decisions D11, D12), as C{(prompt, cap, sentCap, cost)}:
    its prompt's estimate and its output cap in tokens (the tokens it
    reserves are their sum); the cap to send to the provider because the
    request named none (under a budget only: the worst case holds only if
    the provider is told the cap it assumes), else None; its worst-case
    cost in nano-dollars (0 without a budget), with C{extraBytes} the
    gateway may add to the body (L{worstCaseCost}, which fills C{bodies}).
    """
    prompt = promptEstimate(chat.messages)
    cap = outputCap(chat.document, applicable, model.maxOutputTokens)
    sentCap = None
    cost = 0
    if applicable.budgeted:
        named = namedCap(chat)
        if named is None:
            sentCap = cap
        cost = worstCaseCost(
            chat,
            attemptsOf(providers, model, orgID, True),
            named or cap,
            sentCap,
            extraBytes,
            bodies,
            body,
        )
    return prompt, cap, sentCap, cost


def estimateOf(chat: ChatBody, model: Model, applicable: Applicable) -> tuple[int, int]:
    """
    The prompt's estimate and the output cap of a request that reserved
    nothing (no token limit nor budget applied to it): what its usage row
    counts when no usage came (L{svcd.metering.charges.chargeOf}).
    """
    return (
        promptEstimate(chat.messages),
        outputCap(chat.document, applicable, model.maxOutputTokens),
    )


def modelRefusal(chat: ChatBody, model: Model, budgeted: bool) -> ApiError | None:
    """
    The 400 of a request its model cannot take (decisions D12, amended),
    every rule at once: an output cap past the model's ceiling (its
    C{max_output_tokens}, by default 1,048,576), and under a budget, a
    model without a price (NO_PRICE: never billed at zero). None when
    there is nothing to refuse.
    """
    errors: list[FieldError] = []
    if budgeted and model.price is None:
        errors.append(
            FieldError(
                "model", FieldErrorCode.NO_PRICE, "The model has no price, and a budget applies."
            )
        )
    ceiling = model.outputCeiling
    for field, cap in (
        ("max_tokens", chat.maxTokens),
        ("max_completion_tokens", chat.maxCompletionTokens),
    ):
        if cap is not None and cap > ceiling:
            errors.append(
                FieldError(
                    field, FieldErrorCode.TOO_MANY, f"must be at most {ceiling} for this model"
                )
            )
    return validationError(errors) if errors else None


class EmbeddingsBody(Protocol):
    """
    What the reservation reads of an embeddings request (decisions D13):
    svc-proxy's parsed body
    (L{svcd.proxy.http.embeddingsbody.EmbeddingsRequest}) is one.
    """

    @property
    def inputs(self) -> Sequence[str]: ...

    @property
    def document(self) -> Mapping[str, Any]:
        """
        The whole JSON object, as it is forwarded.
        """

    @property
    def dimensions(self) -> int | None: ...


def inputsEstimate(inputs: Sequence[str]) -> int:
    """
    The tokens of an embeddings request's inputs, estimated by D11's rule
    for each: its UTF-8 bytes divided by 3, rounded up.
    """
    total = 0
    for text in inputs:
        total += -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)
    return total


def reserveEmbeddings(
    embeddings: EmbeddingsBody,
    model: Model,
    providers: AttemptOrder,
    orgID: str,
    applicable: Applicable,
    attempts: Sequence[Model] | None = None,
) -> tuple[int, int]:
    """
    What an embeddings request that will be forwarded to C{model} reserves
    at admission (decisions D11, D12, D13), as C{(tokens, cost)}: its
    inputs' estimate, and under a budget its worst-case cost in
    nano-dollars (else 0): for each model that may answer (priced ones
    only, L{attemptsOf}), one token per byte of the body it is sent at its
    input price, the largest of those.

    @param attempts: the models that may answer when not L{attemptsOf}'s
        (the gateway's own embeddings: the model alone), priced ones only.
    """
    cost = 0
    if applicable.budgeted:
        if attempts is None:
            attempts = attemptsOf(providers, model, orgID, True)
        for attempt in attempts:
            price = attempt.price
            assert price is not None
            for index in range(len(attempt.deployments)):
                body = embeddingsBody(embeddings.document, attempt.atDeployment(index))
                cost = max(cost, price.worstCase(len(body), 0))
    return inputsEstimate(embeddings.inputs), cost


def embeddingsRefusal(embeddings: EmbeddingsBody, model: Model, budgeted: bool) -> ApiError | None:
    """
    The 400 of an embeddings request its model cannot take, every rule at
    once: under a budget, a model without a price (NO_PRICE, as for chat:
    never billed at zero); C{dimensions} past the model's own, when the
    providers file gives them (a model cannot make longer vectors than
    its own). None when there is nothing to refuse.
    """
    errors: list[FieldError] = []
    if budgeted and model.price is None:
        errors.append(
            FieldError(
                "model", FieldErrorCode.NO_PRICE, "The model has no price, and a budget applies."
            )
        )
    wanted, own = embeddings.dimensions, model.dimensions
    if wanted is not None and own is not None and wanted > own:
        errors.append(
            FieldError(
                "dimensions", FieldErrorCode.TOO_MANY, f"must be at most {own} for this model"
            )
        )
    return validationError(errors) if errors else None
