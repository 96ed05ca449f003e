"""
The personal access token format: svc_pat_<token_uuid>_<secret>.
"""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from svcd.common.pat import (
    PREFIX,
    READINESS_SENTINEL,
    SECRET_LENGTH,
    formatToken,
    newSecret,
    parseToken,
)
from svcd.common.permissions import Permission, parsePermissions


def test_newTokensRoundTrip() -> None:
    """
    A formatted token parses back to its id and secret; secrets are 256
    bits (43 base64url characters) and differ every time.
    """
    secrets = {newSecret() for _ in range(100)}
    assert len(secrets) == 100
    for secret in secrets:
        assert len(secret) == SECRET_LENGTH
        tokenID = uuid.uuid4()
        parsed = parseToken(formatToken(tokenID, secret))
        assert parsed is not None
        assert (parsed.tokenID, parsed.secret) == (tokenID, secret)


def test_reprHidesTheSecret() -> None:
    """
    Logging a parsed token by accident shows its id, never its secret.
    """
    secret = newSecret()
    parsed = parseToken(formatToken(uuid.uuid4(), secret))
    assert parsed is not None
    assert secret not in repr(parsed) and secret not in str(parsed)


def test_readinessSentinelIsMalformed() -> None:
    """
    The proxy's readiness sentinel is refused by the format check alone,
    so svc-auth answers it without a lookup or a hash.
    """
    assert parseToken(READINESS_SENTINEL) is None


@given(st.text(max_size=120))
def test_parseNeverRaises(text: str) -> None:
    """
    Any string at all either parses or is refused with None.
    """
    parsed = parseToken(text)
    if parsed is not None:
        assert text == formatToken(parsed.tokenID, parsed.secret)


@given(st.uuids(), st.text(alphabet="ABCxyz019-_!/+= ", min_size=0, max_size=50))
def test_onlyExactSecretsParse(tokenID: uuid.UUID, secret: str) -> None:
    """
    A token parses only with a 43-character base64url secret.
    """
    parsed = parseToken(f"{PREFIX}{tokenID}_{secret}")
    valid = len(secret) == SECRET_LENGTH and not set(secret) - set("ABCxyz019-_")
    assert (parsed is not None) == valid


def test_permissionNamesAndBitmaps() -> None:
    """
    Permissions are written as names or as an integer bitmap.
    """
    assert parsePermissions("ProxyChatCompletion") == 1
    assert parsePermissions("TokenCreate, TokenList") == int(
        Permission.TokenCreate | Permission.TokenList
    )
    assert parsePermissions("15") == 15
    # Digits of other scripts are no bitmap (a fullwidth "16" is not 16).
    for bad in ("Root", "2**70", str(2**63), "\uff11\uff16", "-\u0661"):
        try:
            parsePermissions(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
