"""
Client-supplied values as they may appear on a log line (decisions D10).

A client chooses the method, the path, the header values and the model it
sends; written verbatim, one request could put megabytes on a log line (a
5,000-character HTTP method was), and control characters in a value could
forge a line of the text format or drive a terminal. Every value a client
chose goes through one of these two functions before it is logged (or
set on a span):

  - L{loggedText}: at most L{MAX_LOGGED_CHARACTERS} characters, then
    L{CUT_MARKER} when the value was longer; control characters (C0, DEL,
    C1) written as C{\\xNN} escapes.

  - L{loggedMethod}: the method as received when it is a token of RFC 9110
    (C{tchar}s only) of at most 16 characters, else C{OTHER}, as the
    C{method} label of metrics does.
"""

from __future__ import annotations

import re

MAX_LOGGED_CHARACTERS = 256
CUT_MARKER = "…[cut]"
MAX_LOGGED_METHOD = 16
OTHER_METHOD = "OTHER"

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
# RFC 9110, 5.6.2: token = 1*tchar.
_METHOD_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1," + str(MAX_LOGGED_METHOD) + "}")


def _escape(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def loggedText(value: str) -> str:
    """
    C{value} bounded for a log line: its first L{MAX_LOGGED_CHARACTERS}
    characters (after escaping control characters), followed by
    L{CUT_MARKER} when anything was cut.
    """
    cut = len(value) > MAX_LOGGED_CHARACTERS
    text = value[:MAX_LOGGED_CHARACTERS] if cut else value
    if _CONTROL.search(text) is not None:
        text = _CONTROL.sub(_escape, text)
        if len(text) > MAX_LOGGED_CHARACTERS:
            text = text[:MAX_LOGGED_CHARACTERS]
            cut = True
    return text + CUT_MARKER if cut else text


def loggedMethod(method: str) -> str:
    """
    C{method} as received when it is an RFC 9110 token of at most
    L{MAX_LOGGED_METHOD} characters, else L{OTHER_METHOD}.
    """
    if _METHOD_TOKEN.fullmatch(method) is not None:
        return method
    return OTHER_METHOD
