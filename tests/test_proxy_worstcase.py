"""
A budget's worst case is an upper bound (decisions D12 amended), cache
writes included (decisions D14), on both routes (C{/v1/chat/completions}
and C{/v1/messages}) to both kinds of provider (OpenAI-compatible and
Anthropic), as a property of the real pieces: each route's parsed body
and reservation (L{svcd.limits.reservation.reserve}, measuring the body
each attempt is sent, translated or not: the route's
L{svcd.providers.operations.Operation.sendable}), the admission against
in-memory counters (L{svcd.limits.admission.Admission} over
L{svcd.limits.limiter.RedisRateLimiter}), the charge of an answer
(L{svcd.metering.charges.chargeOf}) and its settlement.

Hypothesis draws the prices (input, cache reads, cache writes and output,
in any order of dearness), a model and a dearer or cheaper fallback, each
of either kind of provider, a budget, and a sequence of requests, some in
flight at once; each answer is any a provider could give within what it
was sent: a prompt of at most one token per byte of the body it received,
split in any way between uncached inputs, cache reads and cache writes,
and at most the cap it received for each choice. No sequence passes the
budget: the counter never holds more than the budget, and the ledger's
total of the admitted requests (their charges) stays within it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from limitshelpers import AGENT_ID, ORG_DAY, ORG_ID, WINDOW, budgetBook, fakeClock
from proxydoubles import MemoryCounters
from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from svcd.common.errors import ApiError, ErrorCode
from svcd.common.ids import uuid7Text
from svcd.limits.admission import Admission
from svcd.limits.limiter import RedisRateLimiter
from svcd.limits.records import Budget, Reservation
from svcd.limits.reservation import attemptsOf, reserve
from svcd.metering.bodies import attemptBody
from svcd.metering.charges import OK, chargeOf
from svcd.metering.models import ANTHROPIC, MAX_TOKENS, OPENAI, Model, Provider
from svcd.metering.prices import Price
from svcd.metering.usage import Usage
from svcd.providers.operations import CHAT_COMPLETIONS, MESSAGES, Operation
from svcd.providers.table import ProviderTable
from svcd.proxy.http.chatbody import parseChatBody
from svcd.proxy.http.messagesbody import parseMessagesRequest
from svcd.proxy.metrics import ProxyMetrics

# Prices in nano-dollars per million tokens: up to $1,000 a million.
prices = st.builds(
    Price,
    input=st.integers(0, 10**12),
    output=st.integers(0, 10**12),
    cachedInput=st.integers(0, 10**12),
    cacheWrite=st.integers(0, 10**12),
)


@attrs.frozen
class Ask:
    """
    One request of a sequence: its text, choices and the cap it names
    (None: the budget's assumed cap is sent), and the model it names.
    """

    content: str
    choices: int
    cap: int | None
    model: str


asks = st.builds(
    Ask,
    content=st.text(min_size=1, max_size=40).filter(str.strip),
    choices=st.integers(1, 3),
    cap=st.one_of(st.none(), st.integers(1, 64)),
    model=st.sampled_from(["asked", "fallback"]),
)


def providers(
    asked: Price, fallback: Price, ceiling: int, apis: tuple[str, str] = (OPENAI, OPENAI)
) -> ProviderTable:
    """
    A model that falls back to another (with a longer upstream name; an
    OpenAI-compatible one takes the older C{max_tokens}), both priced,
    both with the output ceiling C{ceiling}, their providers of the
    C{apis} given (decisions D14).
    """
    first = Provider("first", "http://127.0.0.1:9/v1", api=apis[0])
    second = Provider("second", "http://127.0.0.1:9/v2", api=apis[1])
    models = {
        "asked": Model(
            "asked", first, "a", fallbacks=("fallback",), maxOutputTokens=ceiling, price=asked
        ),
        "fallback": Model(
            "fallback",
            second,
            "a-longer-upstream-name",
            maxOutputTokens=ceiling,
            price=fallback,
            capField=MAX_TOKENS,
        ),
    }
    return ProviderTable(
        providers={"first": first, "second": second}, models=models, path="p", loadedAt=0
    )


@attrs.frozen
class Route:
    """
    A route as its reservation sees it: the body a client sends for an
    L{Ask}, how the route parses it, and the operation that makes each
    attempt's body.
    """

    document: Callable[[Ask, int], dict[str, Any]]
    parse: Callable[[bytes], Any]
    operation: Operation


def chatDocument(ask: Ask, ceiling: int) -> dict[str, Any]:
    document: dict[str, Any] = {
        "model": ask.model,
        "messages": [{"role": "user", "content": ask.content}],
    }
    if ask.choices > 1:
        document["n"] = ask.choices
    if ask.cap is not None:
        document["max_completion_tokens"] = min(ask.cap, ceiling)
    return document


def messagesDocument(ask: Ask, ceiling: int) -> dict[str, Any]:
    # Anthropic's max_tokens is required; no choices.
    return {
        "model": ask.model,
        "max_tokens": min(ask.cap or ceiling, ceiling),
        "messages": [{"role": "user", "content": ask.content}],
    }


ROUTES = {
    "chat": Route(chatDocument, parseChatBody, CHAT_COMPLETIONS),
    "messages": Route(messagesDocument, parseMessagesRequest, MESSAGES),
}


def now(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """
    The outcome of a coroutine over the in-memory counters, which answer
    at once.
    """
    outcomes: list[Any] = []
    Deferred.fromCoroutine(coroutine).addBoth(outcomes.append)
    assert outcomes, "the admission did not end at once"
    if isinstance(outcomes[0], Failure):
        outcomes[0].raiseException()
    return outcomes[0]


def receivedCap(body: bytes) -> int:
    """
    The most tokens of answer a provider that received C{body} may give
    for each choice: the larger cap it was sent (either key).
    """
    document = json.loads(body)
    caps = [document[key] for key in ("max_completion_tokens", "max_tokens") if key in document]
    assert caps, "a request under a budget always reaches its provider with a cap"
    return int(max(caps))


@attrs.define
class InFlight:
    reservation: Reservation | None
    reserved: int
    body: bytes
    model: Model
    choices: int


@attrs.frozen
class Scenario:
    """
    What one example draws: the prices of the model and its fallback,
    their providers' kinds, their output ceiling, the budget, and the
    sequence of requests (each with how many of those in flight are then
    answered).
    """

    asked: Price
    fallback: Price
    apis: tuple[str, str]
    ceiling: int
    budget: int
    sequence: list[tuple[Ask, int]]


scenarios = st.builds(
    Scenario,
    asked=prices,
    fallback=prices,
    apis=st.tuples(*[st.sampled_from([OPENAI, ANTHROPIC])] * 2),
    ceiling=st.integers(1, 64),
    # Budgets that admit a few requests, and budgets that admit most.
    budget=st.one_of(st.integers(1, 10**9), st.integers(10**9, 10**11)),
    sequence=st.lists(st.tuples(asks, st.integers(0, 3)), min_size=1, max_size=12),
)
# One property per route: pytest-twisted wraps a Hypothesis test once per
# function, so a parametrized one would be wrapped twice.
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(scenario=scenarios, data=st.data())
def test_noSequenceOfChatAnswersWithinTheCapsPassesABudget(
    scenario: Scenario, data: st.DataObject
) -> None:
    """
    L{assertTheBudgetHolds} on C{/v1/chat/completions}.
    """
    assertTheBudgetHolds("chat", scenario, data)


@PROPERTY
@given(scenario=scenarios, data=st.data())
def test_noSequenceOfMessagesAnswersWithinTheCapsPassesABudget(
    scenario: Scenario, data: st.DataObject
) -> None:
    """
    L{assertTheBudgetHolds} on C{/v1/messages}.
    """
    assertTheBudgetHolds("messages", scenario, data)


def assertTheBudgetHolds(route: str, scenario: Scenario, data: st.DataObject) -> None:
    """
    Requests are admitted against an organization's day budget as the
    route admits them; after each, up to three of those in flight are
    answered (by the model or its fallback, whichever the draw says, of
    those that can be sent the request) with any usage within what the
    provider received, cache reads and writes in any proportion, and
    settled at the price of the model that answered. The budget's counter
    never passes the budget, no settlement passes its reservation, and the
    admitted requests' charges add up to at most the budget.
    """
    asked, fallback, apis = scenario.asked, scenario.fallback, scenario.apis
    ceiling, budget, sequence = scenario.ceiling, scenario.budget, scenario.sequence
    table = providers(asked, fallback, ceiling, apis)
    way = ROUTES[route]
    clock = fakeClock(WINDOW + 30)
    counters = MemoryCounters()
    limiter = RedisRateLimiter(
        counters,
        clock,
        10**9,
        book=budgetBook(org=Budget(budget, "day")),
        spend=lambda *_: succeed(0),
        settleDelay=0,
    )
    metrics = ProxyMetrics()
    admission = Admission(limiter, metrics, clock)
    inFlight: list[InFlight] = []
    charged: list[int] = []

    def answer(request: InFlight) -> None:
        sent = len(request.body)
        prompt = data.draw(st.integers(0, sent), label="prompt")
        reads = data.draw(st.integers(0, prompt), label="reads")
        writes = data.draw(st.integers(0, prompt - reads), label="writes")
        completion = data.draw(
            st.integers(0, receivedCap(request.body) * request.choices), label="completion"
        )
        usage = Usage(prompt, completion, cachedTokens=reads, cacheWriteTokens=writes)
        charge = chargeOf(usage, OK, (0, 0), request.model.price)
        assert charge.cost <= request.reserved, (charge, request.reserved)
        charged.append(charge.cost)
        admission.settleUsage(request.reservation, usage, request.model, ORG_ID, "r", "l")
        clock.advance(0)

    for ask, answered in sequence:
        chat = way.parse(json.dumps(way.document(ask, ceiling)).encode())
        model = table.models[ask.model]
        applicable = admission.applicable(ORG_ID, AGENT_ID)
        assert applicable.budgeted
        sendable = way.operation.sendable
        attempts = [
            each
            for each in attemptsOf(table, model, ORG_ID, True)
            if sendable(chat.document, each, None) is not None
        ]
        if not attempts:
            # Refused 400 before anything is forwarded (a field the
            # providers' dialect cannot carry): nothing reserved.
            continue
        prompt, cap, sentCap, cost = reserve(chat, model, table, ORG_ID, applicable, body=sendable)
        try:
            reservation = now(
                admission.admit(
                    ORG_ID, AGENT_ID, [], tokens=prompt + cap, cost=cost, ledgerID=uuid7Text()
                )
            )
        except ApiError as refused:
            assert refused.code is ErrorCode.BUDGET_EXCEEDED
        else:
            which = data.draw(st.sampled_from(attempts), label="answered by")
            sent = sendable(chat.document, which, sentCap)
            assert sent is not None
            inFlight.append(InFlight(reservation, cost, sent, which, chat.choices))
        assert counters.counts.get(ORG_DAY, 0) <= budget
        for _ in range(min(answered, len(inFlight))):
            answer(inFlight.pop(data.draw(st.integers(0, len(inFlight) - 1), label="which")))
            assert counters.counts.get(ORG_DAY, 0) <= budget
    for request in inFlight:
        answer(request)
    assert sum(charged) <= budget
    assert counters.counts.get(ORG_DAY, 0) == sum(charged)
    assert metrics.registry.get_sample_value("svc_proxy_reservation_overruns_total") in (0, None)


def test_aPromptWrittenToTheCacheIsReservedAtTheWritePrice() -> None:
    """
    The bound is tight where cache writes are dearest: a provider that
    writes every byte it received to its cache and answers the whole cap
    costs exactly the reservation, to the nano-dollar; reserved at the
    input price (D12 before D14) it would have passed it.
    """
    sonnet = Price(
        input=3_000_000_000,
        output=15_000_000_000,
        cachedInput=300_000_000,
        cacheWrite=3_750_000_000,
    )
    table = providers(sonnet, sonnet, 64)
    chat = parseChatBody(b'{"model": "asked", "messages": [{"role": "user", "content": "hi"}]}')
    clock = fakeClock(WINDOW + 30)
    limiter = RedisRateLimiter(
        MemoryCounters(),
        clock,
        10**9,
        book=budgetBook(org=Budget(10**9, "day")),
        spend=lambda *_: succeed(0),
    )
    applicable = limiter.applicable(ORG_ID, AGENT_ID)
    _, _, sentCap, cost = reserve(chat, table.models["asked"], table, ORG_ID, applicable)
    for model in attemptsOf(table, table.models["asked"], ORG_ID, True):
        body = attemptBody(chat.document, model, sentCap)
        usage = Usage(len(body), receivedCap(body), cacheWriteTokens=len(body))
        billed = chargeOf(usage, OK, (0, 0), sonnet).cost
        assert billed <= cost
        atInputPrice = len(body) * 3000 + receivedCap(body) * 15_000
        assert billed > atInputPrice
    longest = attemptBody(chat.document, table.models["fallback"], sentCap)
    assert cost == len(longest) * 3750 + 64 * 15_000
