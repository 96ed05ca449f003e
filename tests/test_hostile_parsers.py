"""
Hostile input to the two parsers that see raw client bytes first: the chat
body validator and the token parser. Hypothesis generates near-valid and
malformed input; neither parser may fail with anything but its refusal
(an ApiError of 400, or None), and every field error code of spec section
7 must be reachable from generated bodies.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from rawhttp import FIELD_CODES, bodies, outcome

from svcd.common.pat import PREFIX, SECRET_LENGTH, formatToken, newSecret, parseToken
from svcd.proxy.http.chatbody import MAX_CONTENT_BYTES, MAX_MESSAGES, ROLES


def encode(document: Any) -> bytes:
    return json.dumps(document).encode()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_chatBodiesNeverFailOtherwise(document: dict[str, Any]) -> None:
    """
    Whatever the fields hold, the validator accepts the body or refuses
    it with 400; an accepted body satisfies every rule.
    """
    result, _ = outcome(encode(document))
    if result == "ok":
        assert isinstance(document["model"], str) and len(document["model"]) <= 256
        assert 1 <= len(document["messages"]) <= MAX_MESSAGES
        for message in document["messages"]:
            assert message["role"] in ROLES
            assert len(message["content"].encode("utf-8", "surrogatepass")) <= MAX_CONTENT_BYTES


def mangled(raw: bytes, cut: int, insert: bytes) -> bytes:
    cut %= len(raw) + 1
    return raw[:cut] + insert + raw[cut:]


@settings(max_examples=400, deadline=None)
@given(
    bodies.map(encode),
    st.integers(0, 10_000),
    st.sampled_from(
        [
            b"\xff",
            b"\xc3",
            b"\xed\xa0\x80",
            b"\x00",
            b"[",
            b"{",
            b'"',
            b"\\",
            b"\\u",
            b"NaN",
            b"1e999",
        ]
    ),
)
def test_mangledBytesNeverFailOtherwise(raw: bytes, cut: int, insert: bytes) -> None:
    """
    A valid-looking body with invalid UTF-8, a stray NUL, half an escape,
    an unclosed bracket or an out-of-range number spliced in anywhere is
    still only ever refused with 400.
    """
    outcome(mangled(raw, cut, insert))


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"model": "m", "messages": [{"role": "user", "content": '
        + b'{"x":' * 50_000
        + b"1"
        + b"}" * 50_000
        + b"}]}",
    ],
    ids=["open-arrays", "closed-arrays", "objects", "messages", "content"],
)
def test_deepNestingIsInvalidJSON(body: bytes) -> None:
    """
    100,000 levels of nesting, anywhere in the body, are 400 INVALID_JSON
    (the parser's recursion limit), never a RecursionError.
    """
    assert outcome(body) == ("INVALID_JSON", set())


# The TOO_MANY example (1001 messages) makes a long repr; that is fine.
@pytest.mark.filterwarnings("ignore:Generating overly large repr")
@pytest.mark.parametrize("code", FIELD_CODES)
def test_everyFieldErrorCodeIsReachable(code: str) -> None:
    """
    Generated bodies reach each field error code of spec section 7.
    """
    find(
        bodies,
        lambda document: code in outcome(encode(document))[1],
        settings=settings(max_examples=5_000, database=None, deadline=None),
    )


# The token parser.

alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


@st.composite
def nearTokens(draw: st.DrawFn) -> str:
    """
    A real token with one of the mistakes an attacker (or a broken client)
    could make.
    """
    token = formatToken(draw(st.uuids()), draw(st.text(alphabet, min_size=43, max_size=43)))
    mistake = draw(
        st.sampled_from(
            [
                "none",
                "upper",
                "replace",
                "insert",
                "delete",
                "prefix",
                "unicodeDigit",
                "braces",
                "whitespace",
            ]
        )
    )
    position = draw(st.integers(0, len(token) - 1))
    if mistake == "upper":
        return token.upper()
    if mistake == "replace":
        return token[:position] + draw(st.characters()) + token[position + 1 :]
    if mistake == "insert":
        return token[:position] + draw(st.characters()) + token[position:]
    if mistake == "delete":
        return token[:position] + token[position + 1 :]
    if mistake == "prefix":
        return (
            draw(st.sampled_from(["SVC_PAT_", "svc_pat", "svc-pat-", "pat_"]))
            + token[len(PREFIX) :]
        )
    if mistake == "unicodeDigit":
        # Digits int() would accept: Arabic-Indic, fullwidth.
        digit = draw(st.sampled_from(["\u0661", "\uff11", "\u0967"]))
        return token[: len(PREFIX)] + digit + token[len(PREFIX) + 1 :]
    if mistake == "braces":
        tokenID = token[len(PREFIX) : len(PREFIX) + 36]
        return PREFIX + "{" + tokenID.replace("-", "")[:34] + "}" + token[len(PREFIX) + 36 :]
    if mistake == "whitespace":
        return (
            token[:position]
            + draw(st.sampled_from([" ", "\t", "\n", "\x00"]))
            + token[position + 1 :]
        )
    return token


@settings(max_examples=1_000, deadline=None)
@given(
    st.one_of(
        nearTokens(),
        st.text(max_size=200),
        st.binary(max_size=120).map(lambda raw: raw.decode("latin-1")),
    )
)
def test_tokenParserRefusesWithNone(bearer: str) -> None:
    """
    Any string is either exactly a token of our format, which formats back
    to itself, or refused with None; never an exception.
    """
    parsed = parseToken(bearer)
    if parsed is None:
        return
    assert formatToken(parsed.tokenID, parsed.secret) == bearer
    assert bearer.isascii()
    assert len(parsed.secret) == SECRET_LENGTH and set(parsed.secret) <= set(alphabet)
    assert str(parsed.tokenID) == bearer[len(PREFIX) : len(PREFIX) + 36]
    assert parsed.secret not in repr(parsed)


def test_nearMissesAreRefused() -> None:
    """
    The classic near misses are refused: non-ASCII digits, an uppercase or
    hyphenless id, a padded or too-short secret.
    """
    tokenID, secret = uuid.uuid4(), newSecret()
    good = formatToken(tokenID, secret)
    assert parseToken(good) is not None
    for bad in (
        good.replace(str(tokenID)[0], "\u0661", 1),
        PREFIX + str(tokenID).upper() + "_" + secret,
        PREFIX + tokenID.hex + "____" + "_" + secret,
        good + "=",
        good[:-1],
        good + "\n",
        " " + good,
        PREFIX + "{" + str(tokenID)[1:-1] + "}_" + secret,
    ):
        assert parseToken(bad) is None, bad


def _canonicalByHand(text: str) -> bool:
    """
    The canonical UUID spelling, checked character by character.
    """
    if len(text) != 36:
        return False
    for position, character in enumerate(text):
        if position in (8, 13, 18, 23):
            if character != "-":
                return False
        elif character not in "0123456789abcdefABCDEF":
            return False
    return True


_uuidLike = st.one_of(
    st.uuids().map(str),
    st.uuids().map(lambda value: str(value).upper()),
    st.text(alphabet="0123456789abcdefABCDEF-{}\n\u0661\u00b2g", min_size=30, max_size=40),
    st.tuples(st.uuids().map(str), st.integers(0, 35), st.characters()).map(
        lambda parts: parts[0][: parts[1]] + parts[2] + parts[0][parts[1] + 1 :]
    ),
)


@settings(max_examples=2_000, deadline=None)
@given(_uuidLike)
def test_parseUUIDAcceptsTheCanonicalSpellingOnly(text: str) -> None:
    """
    parseUUID accepts exactly the 8-4-4-4-12 ASCII hex spelling (either
    case), and then gives the UUID it spells.
    """
    from svcd.common.ids import parseUUID

    parsed = parseUUID(text)
    assert (parsed is not None) == _canonicalByHand(text)
    if parsed is not None:
        assert parsed == uuid.UUID(text)
