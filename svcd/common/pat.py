"""
The personal access token (PAT) wire format: C{svc_pat_<token_uuid>_<secret>}.

The secret is 32 random bytes from L{secrets} (256 bits), written as 43
characters of unpadded base64url. Parsing is strict and cheap, so a
malformed bearer is refused before any database lookup or hash.
"""

from __future__ import annotations

import secrets
import uuid

import attrs

from svcd.common.ids import canonicalUUID

PREFIX = "svc_pat_"
SECRET_BYTES = 32
SECRET_LENGTH = 43  # len(base64url(32 bytes)) without padding
_SECRET_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_TOKEN_LENGTH = len(PREFIX) + 36 + 1 + SECRET_LENGTH

# The bearer svc-proxy's readiness check sends to ValidateToken: it fails
# the format check, so svc-auth answers Unauthenticated at once, touching
# neither the database nor the hash, and the answer proves reachability.
READINESS_SENTINEL = "svc_pat_readiness-probe"


@attrs.frozen(repr=False)
class ParsedToken:
    """
    A bearer value split into its token id and its secret.

    The repr hides the secret so that a stray log of this object leaks
    nothing.
    """

    tokenID: uuid.UUID
    secret: str

    def __repr__(self) -> str:
        return f"ParsedToken(tokenID={self.tokenID}, secret=<hidden>)"


def newSecret() -> str:
    """
    A fresh 256-bit secret.
    """
    return secrets.token_urlsafe(SECRET_BYTES)


def formatToken(tokenID: uuid.UUID, secret: str) -> str:
    """
    The full bearer value of a token.
    """
    return f"{PREFIX}{tokenID}_{secret}"


def isToken(bearer: str) -> bool:
    """
    Is C{bearer} exactly a PAT of our format: the right prefix, a
    lowercase canonical UUID, an underscore, and a 43-character base64url
    secret?
    """
    if len(bearer) != _TOKEN_LENGTH or not bearer.startswith(PREFIX):
        return False
    idText = bearer[len(PREFIX) : len(PREFIX) + 36]
    return (
        bearer[len(PREFIX) + 36] == "_"
        and canonicalUUID(idText) == idText
        and _SECRET_ALPHABET.issuperset(bearer[len(PREFIX) + 37 :])
    )


def parseToken(bearer: str) -> ParsedToken | None:
    """
    Split a bearer value, or return None when it is not a PAT of our
    format (L{isToken}).
    """
    if not isToken(bearer):
        return None
    return ParsedToken(
        uuid.UUID(bearer[len(PREFIX) : len(PREFIX) + 36]), bearer[len(PREFIX) + 37 :]
    )
