"""
Prices and costs of decisions D12, in integers: decimal strings of dollars
read exactly, costs in nano-dollars checked to the nano-dollar on usage
shaped like real providers' (OpenAI's cached prompt tokens and reasoning
tokens), price versions, and the providers file's price table.
"""

from __future__ import annotations

import decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from svcd.common.config import ConfigError
from svcd.ledger.rows import usageRow
from svcd.metering.charges import chargeOf
from svcd.metering.prices import BadPrice, Price, formatDollars, parseDollars
from svcd.metering.usage import Usage
from svcd.providers.providersfile import loadProviders
from svcd.providers.relay import usageOf


@pytest.mark.parametrize(
    ("text", "nano"),
    [
        ("2.50", 2_500_000_000),
        ("10", 10_000_000_000),
        ("0.075", 75_000_000),
        ("0.000000001", 1),
        ("1.25", 1_250_000_000),
        ("0", 0),
    ],
)
def test_parseDollars(text: str, nano: int) -> None:
    """
    A decimal string of dollars is read exactly into nano-dollars.
    """
    assert parseDollars(text) == nano


@pytest.mark.parametrize(
    "text",
    [
        "",
        "2,50",
        "-1",
        "1e3",
        "0.0000000001",
        " 2.50",
        "2.",
        ".5",
        "NaN",
        "Infinity",
        "1000001",
        "1_000",
        # Digits of other scripts, which \d matches and int() reads:
        # fullwidth "20" and "2.50", Arabic-Indic "20", a mixed "1.5".
        "\uff12\uff10",
        "\uff12.\uff15\uff10",
        "\u0662\u0660",
        "1.\uff15",
        "\u00b2",
    ],
)
def test_badDollars(text: str) -> None:
    """
    Anything but ASCII digits with at most 9 decimals (and at most a
    million dollars per million tokens) is refused (decisions D12,
    amended: amounts of money are ASCII decimals).
    """
    with pytest.raises(BadPrice):
        parseDollars(text)


@given(st.integers(min_value=-(10**15), max_value=10**15))
def test_formatDollarsIsExact(nano: int) -> None:
    """
    Nano-dollars as dollars: exact (read back as a Decimal), at least two
    decimals, no exponent.
    """
    text = formatDollars(nano)
    assert "e" not in text.lower()
    assert decimal.Decimal(text) * 10**9 == nano
    assert len(text.split(".")[1]) >= 2


def test_formatDollarsExamples() -> None:
    assert formatDollars(0) == "0.00"
    assert formatDollars(2_500_000_000) == "2.50"
    assert formatDollars(1_234_567) == "0.001234567"
    assert formatDollars(10**9 * 12 + 10**7) == "12.01"


GPT4O = Price(
    input=parseDollars("2.50"), output=parseDollars("10.00"), cachedInput=parseDollars("1.25")
)
MINI = Price(
    input=parseDollars("0.15"), output=parseDollars("0.60"), cachedInput=parseDollars("0.075")
)
O3 = Price(
    input=parseDollars("2.00"), output=parseDollars("8.00"), cachedInput=parseDollars("0.50")
)


@pytest.mark.parametrize(
    ("price", "usage", "nano"),
    [
        # No cached tokens: 1000 * 2500 + 500 * 10000 nano per token.
        (GPT4O, {"prompt_tokens": 1000, "completion_tokens": 500}, 2_500_000 + 5_000_000),
        # OpenAI's shape with 768 cached of 1000: 232 * 2500 + 768 * 1250 + 20 * 10000.
        (
            GPT4O,
            {
                "prompt_tokens": 1000,
                "completion_tokens": 20,
                "prompt_tokens_details": {"cached_tokens": 768, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0},
            },
            232 * 2500 + 768 * 1250 + 20 * 10_000,
        ),
        # Reasoning tokens are part of completion_tokens: billed once.
        (
            O3,
            {
                "prompt_tokens": 75,
                "completion_tokens": 1186,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 1024},
            },
            75 * 2000 + 1186 * 8000,
        ),
        # Fractions of a nano-dollar per token: 13 * 150 + 7 * 75 + 3 * 600,
        # exact here; 1 token at 0.075 nano-dollars... rounds half up.
        (
            MINI,
            {
                "prompt_tokens": 20,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 7},
            },
            13 * 150 + 7 * 75 + 3 * 600,
        ),
    ],
    ids=["plain", "cached", "reasoning", "mini"],
)
def test_costToTheNanoDollar(price: Price, usage: dict[str, object], nano: int) -> None:
    """
    The cost of D12's formula on usage payloads shaped like real
    providers', to the nano-dollar.
    """
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    assert isinstance(prompt, int) and isinstance(completion, int) and isinstance(cached, int)
    assert price.cost(prompt, cached, completion) == nano


def test_costRoundsHalfUpOnce() -> None:
    """
    A price finer than a nano-dollar per token is summed over the tokens
    before the one division, rounding half up: at $0.0005 per million a
    token costs 0.5 nano-dollars (1 token: 1; 3 tokens: 1.5, so 2); at
    $0.000000001 per million, 499,999 tokens cost 0 and 500,000 cost 1.
    """
    half = Price(input=parseDollars("0.0005"), output=0, cachedInput=parseDollars("0.0005"))
    assert half.cost(1, 0, 0) == 1
    assert half.cost(3, 0, 0) == 2
    assert half.cost(4, 0, 0) == 2
    finest = Price(input=parseDollars("0.000000001"), output=0, cachedInput=0)
    assert finest.cost(499_999, 0, 0) == 0
    assert finest.cost(500_000, 0, 0) == 1


def test_worstCaseCountsNoPromptAsCached() -> None:
    """
    A budget reserves the prompt at the dearer of input and cached_input.
    """
    assert GPT4O.worstCase(100, 50) == 100 * 2500 + 50 * 10_000


def test_priceVersionFollowsThePrice() -> None:
    """
    The same prices make the same version; any change makes another;
    cached_input left out is cached_input equal to input.
    """
    same = Price(input=2_500_000_000, output=10_000_000_000, cachedInput=1_250_000_000)
    assert same.version == GPT4O.version and len(GPT4O.version) == 16
    assert Price(input=1, output=1, cachedInput=1).version != Price(1, 2, 1).version


def providersFile(tmp_path: Path, price: str) -> Path:
    path = tmp_path / "providers.toml"
    path.write_text(
        f"""
[[providers]]
name = "local"
base_url = "http://127.0.0.1:8000/v1"

[[models]]
name = "fast"
provider = "local"
{price}
"""
    )
    return path


def test_priceInTheProvidersFile(tmp_path: Path) -> None:
    """
    A model's price table is read exactly; cached_input defaults to input;
    a model without one has no price.
    """
    table = loadProviders(
        str(providersFile(tmp_path, 'price = { input = "2.50", output = "10.00" }')),
        {},
        lambda: 0.0,
    )
    price = table.models["fast"].price
    assert price == Price(input=2_500_000_000, output=10_000_000_000, cachedInput=2_500_000_000)
    unpriced = loadProviders(str(providersFile(tmp_path, "")), {}, lambda: 0.0)
    assert unpriced.models["fast"].price is None


@pytest.mark.parametrize(
    ("price", "fault"),
    [
        ('price = { input = 2.5, output = "10" }', "price.input must be a decimal string"),
        ('price = { input = "2.5" }', "price.output is required"),
        ('price = { input = "2.5", output = "1", cache = "1" }', 'unknown key "cache"'),
        ('price = { input = "2.5", output = "-1" }', "price.output must be a decimal string"),
        ('price = { input = "0.0000000001", output = "1" }', "at most 9 decimals"),
        ('price = "2.50"', "price must be a table"),
        (
            'price = { input = "\uff12.\uff15\uff10", output = "10" }',
            "price.input must be a decimal string",
        ),
    ],
    ids=["float", "no output", "unknown key", "negative", "too fine", "not a table", "fullwidth"],
)
def test_badPriceStopsTheProxy(tmp_path: Path, price: str, fault: str) -> None:
    """
    A bad price is a fault of the file, naming the model and the key.
    """
    with pytest.raises(ConfigError) as caught:
        loadProviders(str(providersFile(tmp_path, price)), {}, lambda: 0.0)
    assert fault in str(caught.value)
    assert 'model "fast"' in str(caught.value)


def test_rowsOfAnswersThatFailed() -> None:
    """
    usageRow, counting chargeOf: an upstream_error before the first byte
    has no tokens; one after it (a stream broken mid-way) without usage
    has the reservation's, at the price; with usage, the provider's.
    """
    price = Price(input=2_500_000_000, output=10_000_000_000, cachedInput=1_250_000_000)
    common: dict[str, Any] = {
        "ledgerID": "0190f0c4-1d2e-7a3b-8c4d-5e6f7a8b9c0d",
        "requestID": "r",
        "orgID": "o",
        "agentID": None,
        "tokenID": None,
        "modelRequested": "m",
        "model": "m",
        "provider": "p",
        "upstreamModel": "u",
        "stream": True,
        "outcome": "upstream_error",
        "startedAt": 1.0,
        "endedAt": 2.0,
    }

    def row(usage: Usage | None, afterFirstByte: bool = False) -> Any:
        charge = chargeOf(usage, common["outcome"], (8, 10), price, afterFirstByte)
        return usageRow(charge=charge, **common)

    before = row(None)
    assert (before.prompt_tokens, before.completion_tokens, before.tokens_from) == (
        0,
        0,
        "provider",
    )
    assert before.cost_nano_usd == 0
    # The ledger's key is the gateway's id; the client's request id is kept.
    assert (before.ledger_id, before.request_id) == (common["ledgerID"], "r")
    after = row(None, afterFirstByte=True)
    assert (after.prompt_tokens, after.completion_tokens, after.tokens_from) == (
        8,
        10,
        "reservation",
    )
    assert after.cost_nano_usd == 8 * 2500 + 10 * 10_000
    counted = row(Usage(100, 5, 40, 2), afterFirstByte=True)
    assert (counted.prompt_tokens, counted.cached_tokens, counted.tokens_from) == (
        100,
        40,
        "provider",
    )
    assert (counted.cache_write_tokens, counted.cost_nano_usd) == (
        0,
        60 * 2500 + 40 * 1250 + 5 * 10_000,
    )


# Cache writes (decisions D14)

# Anthropic's prices for a Claude model: reads a tenth of the input, writes
# (five minutes) a quarter more.
SONNET = Price(
    input=parseDollars("3.00"),
    output=parseDollars("15.00"),
    cachedInput=parseDollars("0.30"),
    cacheWrite=parseDollars("3.75"),
)


def test_cacheWritesArePricedApart() -> None:
    """
    A prompt of 100 uncached tokens, 2,000 read from the cache and 500
    written to it (Anthropic's input_tokens, cache_read_input_tokens and
    cache_creation_input_tokens), and 300 of output: each part at its own
    price, to the nano-dollar; C{prompt} is all three inputs.
    """
    assert SONNET.cost(2600, 2000, 300, 500) == (
        100 * 3000 + 2000 * 300 + 500 * 3750 + 300 * 15_000
    )
    # Without writes, D12's formula as it always was.
    assert SONNET.cost(2600, 2000, 300) == 600 * 3000 + 2000 * 300 + 300 * 15_000


def test_cacheWritesNeverCountPastThePrompt() -> None:
    """
    Writes are never more than the prompt's tokens that are not reads,
    nor fewer than none; the prompt is never billed twice.
    """
    assert SONNET.cost(100, 40, 0, 500) == 40 * 300 + 60 * 3750
    assert SONNET.cost(100, 400, 0, 500) == 100 * 300
    assert SONNET.cost(100, 0, 0, -5) == 100 * 3000


def test_cacheWriteDefaultsToTheInputPrice() -> None:
    """
    A price without cache_write bills writes as input: the cost of any
    usage is D12's, whatever part of it was written.
    """
    assert GPT4O.cacheWrite == GPT4O.input
    assert GPT4O.cost(1000, 200, 10, 300) == GPT4O.cost(1000, 200, 10)


def test_priceVersionsOfEveryPriceBeforeCacheWritesStayTheSame() -> None:
    """
    The version of a price whose cache_write is its input (every price
    written before decisions D14) is the one its ledger rows already
    keep; a cache_write of its own makes another version.
    """
    assert GPT4O.version == "81d58b4fb98401db"
    assert Price(1, 2, 1).version == "a8150f58834f653d"
    explicit = Price(
        input=2_500_000_000,
        output=10_000_000_000,
        cachedInput=1_250_000_000,
        cacheWrite=2_500_000_000,
    )
    assert explicit == GPT4O and explicit.version == GPT4O.version
    assert Price(1, 2, 1, cacheWrite=3).version not in {Price(1, 2, 1).version, ""}
    assert Price(1, 2, 1, cacheWrite=3).version != Price(1, 2, 1, cacheWrite=4).version


@given(
    prices=st.tuples(*[st.integers(min_value=0, max_value=10**15)] * 4),
    prompt=st.integers(min_value=0, max_value=10**9),
    completion=st.integers(min_value=0, max_value=10**9),
    parts=st.tuples(*[st.integers(min_value=-10, max_value=10**9)] * 3),
)
def test_noAnswerWithinTheCapsCostsMoreThanTheWorstCase(
    prices: tuple[int, int, int, int],
    prompt: int,
    completion: int,
    parts: tuple[int, int, int],
) -> None:
    """
    Decisions D12 amended with D14: whatever a provider makes of a prompt
    of at most C{prompt} tokens (some read from its cache, some written to
    it, in any proportion, at any prices) and an answer of at most
    C{completion}, it costs no more than the worst case a budget reserved.
    """
    inputPrice, output, cachedInput, cacheWrite = prices
    price = Price(inputPrice, output, cachedInput, cacheWrite)
    used, cached, written = parts
    used = min(max(used, 0), prompt)
    assert price.cost(used, cached, completion, written) <= price.worstCase(prompt, completion)


def test_theWorstCaseCountsEveryPromptTokenAsAWriteWhenWritesAreDearest() -> None:
    """
    A model whose cache writes cost more than its input reserves every
    prompt token at the write price (any of them may be written); one
    whose reads cost more (an odd price, but a price) at the read price.
    """
    assert SONNET.worstCase(100, 50) == 100 * 3750 + 50 * 15_000
    assert SONNET.cost(100, 0, 50, 100) == SONNET.worstCase(100, 50)
    odd = Price(input=1000, output=0, cachedInput=3000, cacheWrite=2000)
    assert odd.worstCase(10**6, 0) == 3000


def test_usageOfAnOpenAIShapedAnswerWithCacheWrites() -> None:
    """
    OpenAI's shape of a usage with cache writes (decisions D14:
    C{prompt_tokens_details.cache_write_tokens}, as a translated answer
    carries it and some providers send it) is read with its reads and
    writes apart; writes past what the reads leave of the prompt are cut
    to it; a usage without them has none.
    """
    usage = usageOf(
        {
            "usage": {
                "prompt_tokens": 2600,
                "completion_tokens": 300,
                "prompt_tokens_details": {"cached_tokens": 2000, "cache_write_tokens": 500},
            }
        }
    )
    assert usage == Usage(2600, 300, cachedTokens=2000, cacheWriteTokens=500)
    cut = usageOf(
        {
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 9},
            }
        }
    )
    assert cut is not None and (cut.cachedTokens, cut.cacheWriteTokens) == (4, 6)
    for odd in (-1, "5", 2.5, True, None):
        strange = usageOf(
            {
                "usage": {
                    "prompt_tokens": 10,
                    "completion_tokens": 1,
                    "prompt_tokens_details": {"cache_write_tokens": odd},
                }
            }
        )
        assert strange is not None and strange.cacheWriteTokens == 0
    plain = usageOf({"usage": {"prompt_tokens": 10, "completion_tokens": 1}})
    assert plain is not None and plain.cacheWriteTokens == 0


def test_aRowCountsAndCostsCacheWrites() -> None:
    """
    chargeOf and usageRow: a row from the provider's usage counts its
    cache writes and costs them at cache_write; a row from the reservation
    or of a fault before the first byte counts none.
    """
    charge = chargeOf(Usage(2600, 300, 2000, 0, 500), "ok", (8, 10), SONNET)
    assert (charge.promptTokens, charge.cachedTokens, charge.cacheWriteTokens) == (2600, 2000, 500)
    assert charge.cost == 100 * 3000 + 2000 * 300 + 500 * 3750 + 300 * 15_000
    assert charge.priceVersion == SONNET.version
    row = usageRow(
        ledgerID="0190f0c4-1d2e-7a3b-8c4d-5e6f7a8b9c0d",
        requestID="r",
        orgID="o",
        agentID=None,
        tokenID=None,
        modelRequested="m",
        model="m",
        provider="p",
        upstreamModel="u",
        stream=True,
        outcome="ok",
        charge=charge,
        startedAt=1.0,
        endedAt=2.0,
    )
    assert (row.prompt_tokens, row.cached_tokens, row.cache_write_tokens) == (2600, 2000, 500)
    assert row.cost_nano_usd == charge.cost
    # Writes past what the reads leave of the prompt count what is left.
    assert chargeOf(Usage(100, 1, 40, 0, 500), "ok", (8, 10), SONNET).cacheWriteTokens == 60
    estimated = chargeOf(None, "client_gone", (8, 10), SONNET)
    assert (estimated.cacheWriteTokens, estimated.tokensFrom) == (0, "reservation")
    failed = chargeOf(None, "upstream_error", (8, 10), SONNET)
    assert (failed.cacheWriteTokens, failed.cost) == (0, 0)


def test_cacheWriteInTheProvidersFile(tmp_path: Path) -> None:
    """
    A model's price may name cache_write, read exactly; without it, writes
    cost the input price, and the version is D12's.
    """
    table = loadProviders(
        str(
            providersFile(
                tmp_path,
                'price = { input = "3.00", output = "15.00", cached_input = "0.30",'
                ' cache_write = "3.75" }',
            )
        ),
        {},
        lambda: 0.0,
    )
    assert table.models["fast"].price == SONNET
    plain = (
        loadProviders(
            str(providersFile(tmp_path, 'price = { input = "2.50", output = "10.00" }')),
            {},
            lambda: 0.0,
        )
        .models["fast"]
        .price
    )
    assert plain is not None and plain.cacheWrite == 2_500_000_000
    assert plain.version == Price(2_500_000_000, 10_000_000_000, 2_500_000_000).version


@pytest.mark.parametrize(
    ("price", "fault"),
    [
        ('price = { input = "2.5", output = "1", cache_write = 3 }', "price.cache_write must be"),
        ('price = { input = "2.5", output = "1", cache_write = "-1" }', "price.cache_write"),
        (
            'price = { input = "2.5", output = "1", cache_write = "0.0000000001" }',
            "at most 9 decimals",
        ),
    ],
    ids=["number", "negative", "too fine"],
)
def test_aBadCacheWriteStopsTheProxy(tmp_path: Path, price: str, fault: str) -> None:
    with pytest.raises(ConfigError) as caught:
        loadProviders(str(providersFile(tmp_path, price)), {}, lambda: 0.0)
    assert fault in str(caught.value)
    assert 'model "fast"' in str(caught.value)
