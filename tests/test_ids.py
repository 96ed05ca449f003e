"""
Identifiers (svcd.common.ids) and the envelope's timestamps: the fast
paths give exactly what the uuid module and strftime give.
"""

from __future__ import annotations

import datetime
import uuid

from hypothesis import given
from hypothesis import strategies as st

from svcd.common.errors import rfc3339
from svcd.common.ids import canonicalUUID, parseUUID, uuid7, uuid7Text


@given(st.integers(min_value=0, max_value=2**48 - 1))
def test_uuid7TextIsAVersion7UUID(milliseconds: int) -> None:
    """
    uuid7Text is the canonical text of a version 7, RFC 9562 variant UUID
    carrying the given milliseconds, like uuid7.
    """
    text = uuid7Text(milliseconds)
    parsed = uuid.UUID(text)
    assert str(parsed) == text
    assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
    assert parsed.int >> 80 == milliseconds
    reference = uuid7(milliseconds)
    assert (reference.version, reference.variant, reference.int >> 80) == (
        parsed.version,
        parsed.variant,
        milliseconds,
    )


def test_uuid7TextIsRandom() -> None:
    """
    Ids made in the same millisecond differ (74 random bits).
    """
    assert len({uuid7Text(1_795_000_000_000) for _ in range(1000)}) == 1000


@given(
    st.one_of(
        st.uuids().map(str),
        st.uuids().map(lambda each: str(each).upper()),
        st.uuids().map(lambda each: each.hex),
        st.text(max_size=40),
    )
)
def test_canonicalUUIDAgreesWithParseUUID(text: str) -> None:
    """
    canonicalUUID accepts what parseUUID accepts and gives its str().
    """
    parsed = parseUUID(text)
    assert canonicalUUID(text) == (None if parsed is None else str(parsed))


@given(st.datetimes(timezones=st.just(datetime.UTC)))
def test_rfc3339AsStrftime(moment: datetime.datetime) -> None:
    """
    rfc3339 (which keeps the last second's text) formats every moment as
    strftime does, whichever second came before.
    """
    expected = moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
    assert rfc3339(moment) == expected
    assert rfc3339(moment) == expected
