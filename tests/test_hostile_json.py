"""
JSON that cannot be forwarded as standard JSON (decisions D10): a number
that is not finite once parsed, or a string holding a lone surrogate,
anywhere in a chat body, keys and unknown keys included, is 400
INVALID_JSON. Hypothesis plants such a value at a random place of a
generated body (tests/test_hostile_parsers.py generates the bodies); the
look-alikes that are standard JSON (an escaped surrogate pair, an escaped
backslash before "ud800", the largest double, an underflow to 0) are
never refused for it. The same through the real daemons is in
tests/test_faults_edge.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rawhttp import bodies, outcome, values

from svcd.common.errors import ApiError
from svcd.proxy.http.chatbody import parseChatBody

# A string the generated bodies do not hold, replaced by the planted JSON
# text once the document is encoded.
MARK = "@@planted@@"

NOT_FINITE = ["1e999999", "-1e999999", "1E400", "1e+309", "-2.5e308", "1" + "0" * 309 + ".5"]
LONE_SURROGATES = [
    r'"\ud800"',
    r'"\uDBFF"',
    r'"\udc00"',
    r'"x\uDFFFy"',
    r'"\ude00\ud83d"',
    r'"\ud83d\u0041"',
    r'"\ud83d\ud83d"',
    r'"\\\ud800"',
]
LOOK_ALIKES = [
    r'"\ud83d\ude00"',
    r'"\uD83D\uDE00"',
    r'"\\ud800"',
    r'"\uD7FF\uE000"',
    '"\\u00e9"',
    "1.7976931348623157e308",
    "1e-999999",
    "-0.0",
    "5e-324",
    "1" + "0" * 400,
]

VALID = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@st.composite
def planted(draw: st.DrawFn, keys: bool) -> str:
    """
    A generated chat body encoded as JSON text with L{MARK} at a random
    place: a value, a list item or (with C{keys}) an object key, at any
    depth, in known or unknown keys.
    """
    # A copy: the drawn value is changed below, and st.just hands out one
    # object to every example.
    document: Any = json.loads(json.dumps(draw(st.one_of(bodies, st.just(VALID)))))
    spot = document
    while True:
        children = [
            child
            for child in (spot.values() if isinstance(spot, dict) else spot)
            if isinstance(child, dict | list)
        ]
        if not children or draw(st.booleans()):
            break
        spot = draw(st.sampled_from(children))
    if isinstance(spot, list):
        spot.insert(draw(st.integers(0, len(spot))), MARK)
    elif keys and draw(st.booleans()):
        spot[MARK] = draw(values)
    else:
        spot[draw(st.text(max_size=8))] = MARK
    return json.dumps(document, ensure_ascii=False)


def plant(text: str, value: str) -> bytes:
    quoted = json.dumps(MARK)
    assert quoted in text
    return text.replace(quoted, value).encode("utf-8")


@settings(max_examples=300, deadline=None)
@given(planted(keys=False), st.sampled_from(NOT_FINITE))
def test_notFiniteAnywhereIsInvalidJSON(text: str, number: str) -> None:
    """
    A number that overflows a double, anywhere in the body, is 400
    INVALID_JSON.
    """
    assert outcome(plant(text, number)) == ("INVALID_JSON", set())


@settings(max_examples=300, deadline=None)
@given(planted(keys=True), st.sampled_from(LONE_SURROGATES))
def test_loneSurrogateAnywhereIsInvalidJSON(text: str, string: str) -> None:
    """
    A string holding a lone surrogate escape (high or low, reversed, or
    after an escaped backslash), as a value or a key anywhere, is 400
    INVALID_JSON.
    """
    assert outcome(plant(text, string)) == ("INVALID_JSON", set())


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(LOOK_ALIKES).flatmap(
        # Only a string can be a key.
        lambda value: st.tuples(planted(keys=value.startswith('"')), st.just(value))
    )
)
def test_standardLookAlikesAreNotRefusedForIt(planting: tuple[str, str]) -> None:
    """
    Standard JSON that looks close (a surrogate pair, an escaped backslash
    before "ud800", the largest double, an underflow to 0, a huge
    integer) is never INVALID_JSON; a body accepted whole can be written
    back as standard JSON in UTF-8.
    """
    text, value = planting
    body = plant(text, value)
    result, _ = outcome(body)
    assert result != "INVALID_JSON"
    if result == "ok":
        document = json.loads(body)
        json.dumps(document, allow_nan=False, ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("value", [*NOT_FINITE, *LONE_SURROGATES])
@pytest.mark.parametrize("where", ["temperature", "content", "unknown", "nested", "key"])
def test_eachPlaceOfAValidBody(value: str, where: str) -> None:
    """
    Every refused value, in each kind of place of an otherwise valid body,
    is 400 INVALID_JSON (a string where the field wants a number would
    otherwise be a VALIDATION_ERROR: the parse decides first).
    """
    if where == "key" and not value.startswith('"'):
        return
    document: dict[str, Any] = json.loads(json.dumps(VALID))
    if where == "temperature":
        document["temperature"] = MARK
    elif where == "content":
        document["messages"][0]["content"] = MARK
    elif where == "unknown":
        document["tools"] = [{"function": {"parameters": MARK}}]
    elif where == "nested":
        document["metadata"] = {"a": [[{"b": MARK}]]}
    else:
        document["metadata"] = {MARK: 1}
    with pytest.raises(ApiError) as raised:
        parseChatBody(plant(json.dumps(document), value))
    assert raised.value.code.value == "INVALID_JSON"
    assert raised.value.status == 400


@pytest.mark.parametrize("size", [100, 20_000, 100_000])
@pytest.mark.parametrize(
    ("value", "refused"),
    [(r'"\ud800"', True), (r'"\udc00x"', True), (r'"\ud83d\ude00"', False), (r'"\\ud800"', False)],
)
def test_smallAndLargeBodies(size: int, value: str, refused: bool) -> None:
    """
    The surrogate rule holds on both sides of the size up to which the raw
    bytes are searched for a surrogate escape before the document is
    walked: in a body of 100 bytes and in bodies of 20,000 and 100,000
    (with newlines and non-ASCII text around it, as chat bodies have).
    """
    document = {
        "model": "m",
        "messages": [
            {"role": "user", "content": ("caf\u00e9\n" * size)[:size]},
            {"role": "assistant", "content": MARK},
        ],
    }
    body = plant(json.dumps(document), value)
    assert (len(body) > 16 * 1024) == (size > 16 * 1024)
    result, _ = outcome(body)
    assert (result == "INVALID_JSON") == refused, result
