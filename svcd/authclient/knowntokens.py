"""
The token ids svc-auth may accept, as svc-proxy knows them from the change
feed (decisions D8): a Bloom filter, so that a made-up token id is refused
401 with no call to svc-auth.

Why a Bloom filter and not an exact set: a Python set of a million 16-byte
ids costs about 60 MB (an object per id plus the table); this filter takes
16 bits per id of room and is sized for twice the snapshot, so 4 MB for a
million tokens, and it answers "maybe known" for an unknown id about once
in 40,000 while half full (as after a snapshot), at worst about once in
1,100 when full (then a new layer takes the next ids). A false positive only
costs that request the call to svc-auth it would have made without the
filter, which then refuses it; a false negative would refuse a valid
token, and a Bloom filter has none: every id added is found.

It grows without a rebuild: when a layer holds as many ids as it was sized
for, a new layer twice as large takes the next ones, and an id is known
when any layer has it. Ids are never removed (a revoked token's id staying
"known" costs only a call); a new feed session starts a new filter from
its snapshot, which leaves revoked and expired tokens out.

Positions come from a keyed BLAKE2b digest of the id (a random key made at
start), so they do not depend on how ids are made (random today, perhaps
time-ordered tomorrow) and cannot be chosen by a client.
"""

from __future__ import annotations

import hashlib
import os

# Bits of room per id a layer is sized for, and positions set per id:
# with 16 and 6, a full layer answers "maybe" for an unknown id about
# once in 1,100 times; a half-full one about once in 40,000.
_BITS_PER_ID = 16
_POSITIONS = 6
_DIGEST_BYTES = 4 * _POSITIONS
_WORD = 0xFFFFFFFF

# The smallest layer: 128 KiB of bits, for 65,536 ids.
MINIMUM_CAPACITY = 65_536


class _Layer:
    __slots__ = ("bits", "capacity", "count", "size")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = capacity * _BITS_PER_ID
        self.bits = bytearray(self.size // 8)
        self.count = 0


class KnownTokens:
    """
    A growing Bloom filter of 16-byte token ids.

    @param expected: how many ids are about to be added (the snapshot's
        count); the first layer has room for twice as many.
    @param key: the digest key; random unless a test fixes it.
    """

    def __init__(self, expected: int = 0, key: bytes | None = None) -> None:
        self._key = key if key is not None else os.urandom(16)
        self._layers = [_Layer(max(MINIMUM_CAPACITY, 2 * expected))]
        self._count = 0

    def _digest(self, tokenID: bytes) -> int:
        return int.from_bytes(
            hashlib.blake2b(tokenID, key=self._key, digest_size=_DIGEST_BYTES).digest(), "little"
        )

    def add(self, tokenID: bytes) -> None:
        """
        Remember C{tokenID} (16 bytes).
        """
        layer = self._layers[-1]
        if layer.count >= layer.capacity:
            layer = _Layer(2 * layer.capacity)
            self._layers.append(layer)
        digest = self._digest(tokenID)
        bits, size = layer.bits, layer.size
        for _ in range(_POSITIONS):
            position = (digest & _WORD) % size
            bits[position >> 3] |= 1 << (position & 7)
            digest >>= 32
        layer.count += 1
        self._count += 1

    def addPacked(self, packed: bytes) -> None:
        """
        Remember every id of C{packed}, 16-byte ids concatenated (the feed's
        snapshot).
        """
        add = self.add
        for offset in range(0, len(packed) - 15, 16):
            add(packed[offset : offset + 16])

    def __contains__(self, tokenID: bytes) -> bool:
        digest = self._digest(tokenID)
        for layer in self._layers:
            bits, size, remaining = layer.bits, layer.size, digest
            for _ in range(_POSITIONS):
                position = (remaining & _WORD) % size
                if not bits[position >> 3] & (1 << (position & 7)):
                    break
                remaining >>= 32
            else:
                return True
        return False

    def __len__(self) -> int:
        """
        How many ids were added (the same id twice counts twice).
        """
        return self._count

    def memoryBytes(self) -> int:
        """
        The bytes the filter's bits take.
        """
        return sum(len(layer.bits) for layer in self._layers)
