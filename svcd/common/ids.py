"""
Identifiers: UUID v7 request ids and strict UUID parsing.

Python 3.11's uuid module has no uuid7, and the rule we need is small
(RFC 9562 section 5.7), so it is written here rather than added as a
dependency.
"""

from __future__ import annotations

import os
import re
import time
import uuid

# 8-4-4-4-12 ASCII hex digits, matched whole (fullmatch: no trailing newline).
_CANONICAL = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
)


def uuid7(nowMilliseconds: int | None = None) -> uuid.UUID:
    """
    Make a UUID version 7: 48 bits of Unix milliseconds, then random bits,
    so that ids sort by creation time in logs and indexes.
    """
    if nowMilliseconds is None:
        nowMilliseconds = time.time_ns() // 1_000_000
    value = (nowMilliseconds & 0xFFFF_FFFF_FFFF) << 80
    value |= int.from_bytes(os.urandom(10), "big")
    value &= ~(0xF << 76)
    value |= 0x7 << 76  # version
    value &= ~(0x3 << 62)
    value |= 0x2 << 62  # RFC 9562 variant
    return uuid.UUID(int=value)


def uuid7Text(nowMilliseconds: int | None = None) -> str:
    """
    L{uuid7} in its canonical text form, formatted directly: a request id
    is made for every request, and going through L{uuid.UUID} cost three
    times as much.
    """
    if nowMilliseconds is None:
        nowMilliseconds = time.time_ns() // 1_000_000
    random = int.from_bytes(os.urandom(10), "big")
    # 48 bits of time, version 7, 12 random bits; variant 10, 62 random bits.
    high = (nowMilliseconds & 0xFFFF_FFFF_FFFF) << 16 | 0x7000 | (random >> 68) & 0xFFF
    low = 0x8000_0000_0000_0000 | random & 0x3FFF_FFFF_FFFF_FFFF
    text = f"{high:016x}{low:016x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def canonicalUUID(text: str) -> str | None:
    """
    The lower-case canonical spelling of C{text} when it is a UUID in the
    form L{parseUUID} accepts, else None; without making a L{uuid.UUID}.
    """
    if len(text) != 36 or _CANONICAL.fullmatch(text) is None:
        return None
    return text.lower()


def parseUUID(text: str) -> uuid.UUID | None:
    """
    Parse the canonical 36-character form (8-4-4-4-12 hex digits) and
    nothing else.

    uuid.UUID itself also accepts braces, a urn: prefix and missing
    hyphens; ids on the wire and in URLs must have one spelling, so
    those are refused here.
    """
    if len(text) != 36 or _CANONICAL.fullmatch(text) is None:
        return None
    return uuid.UUID(text)


def isUUID(text: str) -> bool:
    """
    Is C{text} a UUID in canonical form?
    """
    return parseUUID(text) is not None


def parseRequestID(text: str | None) -> uuid.UUID | None:
    """
    Accept an inbound request id only when it is a canonical UUID of
    version 4 or 7 with the RFC variant; anything else is ignored by the
    caller, which then makes a fresh UUID v7.
    """
    if text is None:
        return None
    parsed = parseUUID(text)
    if parsed is None or parsed.version not in (4, 7):
        return None
    if parsed.variant != uuid.RFC_4122:
        return None
    return parsed
