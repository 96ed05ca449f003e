"""
Reading a parsed JSON body field by field, for the translations: each
accessor returns the value in the type asked for, or raises
L{Untranslatable} naming the field, so that a body of the wrong shape is a
400 naming the field and never a C{TypeError} (a 500) in the middle of a
translation. Only the edge's checks of each route come before (decisions
D4): the translations cannot assume more than those.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from svcd.dialects.errors import Untranslatable

TO_ANTHROPIC = "has no counterpart in Anthropic's Messages API"
TO_OPENAI = "has no counterpart in OpenAI's chat completions"


def isInteger(value: object) -> bool:
    # A boolean is an int in Python, never a count.
    return isinstance(value, int) and not isinstance(value, bool)


def isNumber(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def text(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise Untranslatable(path, "must be a string")
    return value


def mapping(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise Untranslatable(path, "must be an object")
    return value


def array(value: object, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise Untranslatable(path, "must be an array")
    return value


def boolean(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise Untranslatable(path, "must be a boolean")
    return value


def number(value: object, path: str) -> int | float:
    if not isNumber(value):
        raise Untranslatable(path, "must be a number")
    assert isinstance(value, int | float)
    return value


def integer(value: object, path: str) -> int:
    if not isInteger(value):
        raise Untranslatable(path, "must be an integer")
    assert isinstance(value, int)
    return value


def only(
    document: Mapping[str, Any],
    known: Iterable[str],
    path: str,
    why: str,
) -> None:
    """
    Refuse the first key of C{document} that is not C{known} and not
    C{null} (a C{null} counts as absent, as in the edge's checks).
    """
    allowed = known if isinstance(known, frozenset | set) else frozenset(known)
    for key, value in document.items():
        if value is not None and key not in allowed:
            raise Untranslatable(join(path, key), why)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
