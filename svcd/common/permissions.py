"""
The permission bitmap carried by every token (decisions D3).
"""

from __future__ import annotations

import enum


class Permission(enum.IntFlag):
    """
    Bits of the int64 permission bitmap.

    The auth-probe routes need a valid token and an active agent but no
    bit; the chat routes need ProxyChatCompletion, the embeddings route
    ProxyEmbeddings, the memory routes MemoryRead or MemoryWrite; GetUsage
    needs UsageRead.
    """

    ProxyChatCompletion = 1
    TokenCreate = 2
    TokenRevoke = 4
    TokenList = 8
    # Decisions D12: the gRPC method GetUsage, the usage sums of the
    # token's own organization.
    UsageRead = 16
    # Decisions D13: POST /v1/embeddings; reading the agent's memories
    # (list, get, search); writing them (add, change, delete, observe).
    ProxyEmbeddings = 32
    MemoryRead = 64
    MemoryWrite = 128


def parsePermissions(text: str) -> int:
    """
    Read a permission list as operators write it: a comma-separated list of
    names (C{ProxyChatCompletion,TokenList}) or an integer bitmap.

    @raise ValueError: for an unknown name or an integer outside int64.
    """
    stripped = text.strip()
    digits = stripped.lstrip("-")
    # ASCII only: int() also reads other scripts' digits (fullwidth "16").
    if digits.isascii() and digits.isdigit():
        value = int(stripped)
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"permission bitmap {value} does not fit in 64 bits")
        return value
    bitmap = 0
    for name in stripped.split(","):
        name = name.strip()
        if not name:
            continue
        try:
            bitmap |= Permission[name]
        except KeyError:
            known = ", ".join(member.name for member in Permission if member.name)
            raise ValueError(f"unknown permission {name!r} (known: {known})") from None
    return bitmap
