"""
One spelling per route: the proxy refuses request paths that another
spelling of the same route could walk around (decisions D10).

A front proxy (nginx, an API gateway, a WAF) often guards routes by their
literal path: "deny /v1/internal/". Twisted Web splits the path on C{/}
and percent-decodes each segment, and the Klein router the edge once
used joined the decoded segments back for werkzeug, which merged
repeated slashes; so C{//v1/internal/auth-probe},
C{/v1/internal/auth%2Dprobe} and C{/v1%2Finternal%2Fauth-probe} all
reached the auth probe, and a rule written on the literal path missed
every one. The edge asks L{isCanonicalPath} about the raw path, once,
before routing (with L{RouteTable}, on that same raw path), and answers
any other spelling 404 NOT_FOUND.

A canonical path (the part of the request target before C{?}):

  - starts with C{/} (origin form);
  - has no empty segment: no C{//}, and no trailing C{/} (no route ends
    with one; C{/health/} was 404 under Klein's router too, and still
    is);
  - has no dot segment (C{.} or C{..}), which RFC 3986 would remove;
  - has no percent-escape of an unreserved character (C{ALPHA DIGIT - . _
    ~}), which RFC 3986 says to write unescaped, nor of C{/}, which
    decodes into a separator inside one segment (a router that joins
    decoded segments, as Klein's did, reads it as one), and no C{%} that
    does not start an escape of two hex digits.

Other escapes stay allowed and decoded as before: they spell characters
no route name holds (C{%3A}, C{%20}, C{%25}), so they cannot reach a route
under another spelling; in the one variable segment, the org id of
C{/v1/orgs/{org_id}/auth-probe}, they are refused as before with 400
VALIDATION_ERROR (not a UUID). The query string is not looked at.

L{RouteTable} then finds the route of a canonical path. Being canonical
leaves it little to do: no slashes to merge, no escapes that could spell a
route's name. A template is a path whose segments are names or, whole, a
variable (C{{org_id}}); a template without variables is one dictionary
lookup on the raw path, one with variables matches a path of as many
segments whose other segments are equal, and its variables take their
segments percent-decoded (as UTF-8).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar
from urllib.parse import unquote_to_bytes

# Decisions D14: the routes of Anthropic's Messages API, whose clients
# speak its dialect (errors in its envelope, the token in x-api-key too).
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

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


R = TypeVar("R")


class RouteTable(Generic[R]):
    """
    Routes by path template (see the module docstring): a template without
    variables before any with them, and those in the order given.
    """

    def __init__(self, routes: Iterable[tuple[str, R]]) -> None:
        self._exact: dict[bytes, R] = {}
        # By template with variables: its segments (bytes to equal, or the
        # name of a variable) and its route.
        self._variable: list[tuple[tuple[bytes | str, ...], R]] = []
        for template, route in routes:
            segments = template.split("/")
            if segments[0] != "" or "" in segments[1:]:
                raise ValueError(f"not a path template: {template!r}")
            parts = tuple(
                segment[1:-1]
                if segment.startswith("{") and segment.endswith("}")
                else segment.encode("ascii")
                for segment in segments[1:]
            )
            if all(isinstance(part, bytes) for part in parts):
                self._exact[template.encode("ascii")] = route
            else:
                self._variable.append((parts, route))

    def routeOf(self, path: bytes) -> tuple[R, Mapping[str, str]] | None:
        """
        The route of a canonical C{path} and its variables, or None.

        @raise UnicodeDecodeError: a variable's segment is not UTF-8 once
            percent-decoded.
        """
        route = self._exact.get(path)
        if route is not None:
            return route, {}
        if not self._variable:
            return None
        segments = path[1:].split(b"/")
        for parts, route in self._variable:
            if len(parts) != len(segments):
                continue
            values: dict[str, str] = {}
            for part, segment in zip(parts, segments, strict=True):
                if isinstance(part, str):
                    values[part] = unquote_to_bytes(segment).decode("utf-8")
                elif part != segment:
                    break
            else:
                return route, values
        return None
