"""
One spelling per route: the proxy refuses request paths that another
spelling of the same route could walk around (decisions D10).

A front proxy (nginx, an API gateway, a WAF) often guards routes by their
literal path: "deny /v1/internal/". Twisted Web splits the path on C{/}
and percent-decodes each segment, and Klein joins the decoded segments
back for werkzeug, which merges repeated slashes; so
C{//v1/internal/auth-probe}, C{/v1/internal/auth%2Dprobe} and
C{/v1%2Finternal%2Fauth-probe} all reached the auth probe, and a rule
written on the literal path missed every one. The edge asks
L{isCanonicalPath} about the raw path, once, before routing, and answers
any other spelling 404 NOT_FOUND.

A canonical path (the part of the request target before C{?}):

  - starts with C{/} (origin form);
  - has no empty segment: no C{//}, and no trailing C{/} (no route ends
    with one; werkzeug already answered C{/health/} 404, so this is
    today's behaviour for the trailing slash, kept);
  - has no dot segment (C{.} or C{..}), which RFC 3986 would remove;
  - has no percent-escape of an unreserved character (C{ALPHA DIGIT - . _
    ~}), which RFC 3986 says to write unescaped, nor of C{/}, which Klein
    would read as a separator, and no C{%} that does not start an escape
    of two hex digits.

Other escapes stay allowed and decoded as before: they spell characters
no route name holds (C{%3A}, C{%20}, C{%25}), so they cannot reach a route
under another spelling; in the one variable segment, the org id of
C{/v1/orgs/{org_id}/auth-probe}, they are refused as before with 400
VALIDATION_ERROR (not a UUID). The query string is not looked at.
"""

from __future__ import annotations

import re

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_SEPARATOR = ord("/")
_ESCAPE = re.compile(rb"%(?:([0-9A-Fa-f]{2})|)")


def isCanonicalPath(path: bytes) -> bool:
    """
    Whether C{path} (raw, before percent-decoding, without the query) is
    the only spelling of what it names (see the module docstring).
    """
    if path[:1] != b"/":
        return False
    # The common case, decided by three scans.
    if b"%" not in path and b"//" not in path and b"/." not in path and path[-1:] != b"/":
        return True
    for segment in path[1:].split(b"/"):
        if segment in (b"", b".", b".."):
            return False
    for escape in _ESCAPE.finditer(path):
        digits = escape.group(1)
        if digits is None:
            return False
        byte = int(digits, 16)
        if byte in _UNRESERVED or byte == _SEPARATOR:
            return False
    return True
