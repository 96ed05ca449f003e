"""
Hashing and checking token secrets with argon2id.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from argon2 import PasswordHasher, Type
from argon2.exceptions import InvalidHashError, VerificationError

# Why these argon2id parameters (1 pass, 4 MiB, 1 lane): a token secret is
# 256 bits from the secrets module, not a human password. Argon2's memory
# hardness exists to slow guessing of low-entropy passwords; against 2**256
# candidates no work factor matters, so the hash only has to make a leaked
# database useless (no secret can be recovered from it), which any argon2id
# setting does. Cheap parameters keep a cold verification near 2 ms on one
# core, which bounds what a flood of wrong secrets can cost. Verification
# reads the parameters from the stored hash, so they can change later
# without invalidating existing tokens.
HASHER = PasswordHasher(
    time_cost=1,
    memory_cost=4096,
    parallelism=1,
    hash_len=32,
    salt_len=16,
    type=Type.ID,
)


def hashSecret(secret: str) -> str:
    """
    The argon2id PHC string to store for C{secret}.
    """
    return HASHER.hash(secret)


def verifySecret(storedHash: str, secret: str) -> bool:
    """
    Does C{secret} match C{storedHash}? libargon2 compares in constant time.
    """
    try:
        return HASHER.verify(storedHash, secret)
    except (VerificationError, InvalidHashError):
        return False


class SecretDigester:
    """
    A keyed BLAKE2b digest of secrets, for remembering in memory which
    secret a cached token was verified with, without keeping the secret.

    The key is random per process, so a memory dump of the cache is no
    shortcut to a secret, and digests compare in constant time.
    """

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else os.urandom(32)

    def digest(self, secret: str) -> bytes:
        return hashlib.blake2b(secret.encode("ascii"), key=self._key, digest_size=32).digest()

    @staticmethod
    def same(left: bytes, right: bytes) -> bool:
        return hmac.compare_digest(left, right)
