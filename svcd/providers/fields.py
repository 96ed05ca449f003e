"""
What every check of the providers file (L{svcd.providers.providersfile})
shares: its faults, each a L{ConfigError} for C{SVC_PROVIDERS_FILE}
(L{VARIABLE}) naming the file and the fault; the words that show a value
of the file in an error (quoted, escaped to one line of ASCII, cut short,
never a number of thousands of digits); and L{FieldChecker}, the checks
of a table's keys and values that are the same whatever the table.
"""

from __future__ import annotations

import json
import re
from datetime import date, time
from typing import Any

from svcd.common.config import ConfigError, parseDuration

__all__ = [
    "MAX_DURATION",
    "VARIABLE",
    "FieldChecker",
    "article",
    "fault",
    "quote",
    "show",
    "tomlType",
]

VARIABLE = "SVC_PROVIDERS_FILE"

# A bound against the absurd, well above any sensible value.
MAX_DURATION = 3600.0

# Unknown keys that look like someone putting a key in the file.
_SECRET_LIKE = frozenset(
    {"api_key", "apikey", "key", "token", "secret", "password", "authorization"}
)


def fault(path: str, problem: str) -> ConfigError:
    shownPath = path if path.isprintable() else ascii(path)
    return ConfigError(VARIABLE, f"{shownPath}: {problem}")


def quote(text: str, limit: int = 64) -> str:
    """
    A value of the file as it may appear in an error: double-quoted,
    escaped to one line of ASCII, and cut short.
    """
    if len(text) > limit:
        return json.dumps(text[:limit])[:-1] + '..."'
    return json.dumps(text)


def tomlType(value: object) -> str:
    """
    The TOML type of a value, for an error that says what was found.
    """
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, (date, time)):
        return "a date or time"
    return type(value).__name__


def show(value: object) -> str:
    """
    A scalar of the file as it may appear in an error. An integer of
    thousands of digits is not written out: str() refuses it.
    """
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value) if abs(value) < 10**18 else "a very large number"
    if isinstance(value, float):
        return repr(value)
    return tomlType(value)


def article(kind: str) -> str:
    """
    C{kind} with its indefinite article, for an error: "a chat", "an
    embedding".
    """
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


class FieldChecker:
    """
    The checks of a table's keys and values that every table of the file
    shares; each raises for the fault it finds (L{fault}).
    """

    def __init__(self, path: str) -> None:
        self._path = path

    def fault(self, problem: str) -> ConfigError:
        return fault(self._path, problem)

    def boundedInteger(
        self, table: dict[str, Any], key: str, default: int, least: int, most: int, where: str
    ) -> int:
        value = table.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fault(f"{where}{key} must be an integer, got {tomlType(value)}")
        if not least <= value <= most:
            raise self.fault(f"{where}{key} must be from {least} to {most:,}, got {show(value)}")
        return value

    def score(self, table: dict[str, Any], key: str, default: float, where: str) -> float:
        """
        A cosine similarity: a number from -1 to 1 (an integer is taken as
        the number it is).
        """
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fault(f"{where}{key} must be a number, got {tomlType(value)}")
        if not -1.0 <= value <= 1.0:
            raise self.fault(f"{where}{key} must be from -1 to 1, got {show(value)}")
        return float(value)

    def refuseUnknownKeys(
        self,
        table: dict[str, Any],
        known: tuple[str, ...],
        where: str,
        unlisted: tuple[str, ...] = (),
    ) -> None:
        """
        Refuse the first key of C{table} that is neither C{known} (which
        the fault lists) nor C{unlisted} (known, but not listed: keys that
        only some entries need, such as a provider's C{api}, so that the
        fault of a file that uses none of them reads as it always has).
        """
        for key in table:
            if key in known or key in unlisted:
                continue
            hint = ""
            if key.lower() in _SECRET_LIKE:
                hint = (
                    "; a key never sits in the file: name the environment variable "
                    "that holds it with api_key_env"
                )
            raise self.fault(f"{where}unknown key {quote(key)} (expected {', '.join(known)}){hint}")

    def arrayOfTables(self, document: dict[str, Any], key: str) -> list[dict[str, Any]]:
        value = document.get(key)
        if value is None or value == []:
            raise self.fault(f"has no [[{key}]] table")
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise self.fault(f"{key} must be written as [[{key}]] tables, got {tomlType(value)}")
        return value

    def where(
        self,
        kind: str,
        table: dict[str, Any],
        number: int,
        pattern: re.Pattern[str],
        maxLength: int,
    ) -> str:
        """
        How errors name a table: by its name when that is valid, else by
        its place in the file.
        """
        name = table.get("name")
        if isinstance(name, str) and len(name) <= maxLength and pattern.fullmatch(name):
            return f"{kind} {quote(name)}: "
        return f"[[{kind}s]] table {number}: "

    def text(
        self,
        table: dict[str, Any],
        key: str,
        where: str,
        pattern: re.Pattern[str],
        maxLength: int,
        rule: str,
    ) -> str | None:
        """
        An optional string key that must follow C{pattern}; None when
        absent.
        """
        value = table.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fault(f"{where}{key} must be a string, got {tomlType(value)}")
        if not value.strip():
            raise self.fault(f"{where}{key} must not be empty")
        if len(value) > maxLength:
            raise self.fault(f"{where}{key} is longer than {maxLength} characters")
        if not pattern.fullmatch(value):
            raise self.fault(f"{where}{key} {quote(value)} may hold only {rule}")
        return value

    def requiredText(
        self,
        table: dict[str, Any],
        key: str,
        where: str,
        pattern: re.Pattern[str],
        maxLength: int,
        rule: str,
    ) -> str:
        value = self.text(table, key, where, pattern, maxLength, rule)
        if value is None:
            raise self.fault(f"{where}{key} is required")
        return value

    def duration(self, table: dict[str, Any], key: str, default: float, where: str) -> float:
        """
        A duration written as the variables' (C{60s}, C{500ms}, C{2m}, a
        bare number of seconds), as a string or a TOML number.
        """
        value = table.get(key)
        if value is None:
            return default
        if isinstance(value, str):
            try:
                seconds = parseDuration(value)
            except ValueError as error:
                raise self.fault(f"{where}{key} {error}, got {show(value)}") from None
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if not value > 0:
                raise self.fault(f"{where}{key} must be greater than zero, got {show(value)}")
            seconds = value
        else:
            raise self.fault(
                f'{where}{key} must be a duration such as "60s", got {tomlType(value)}'
            )
        if seconds > MAX_DURATION:
            raise self.fault(
                f"{where}{key} must be at most {MAX_DURATION:.0f}s (one hour), got {show(value)}"
            )
        return float(seconds)

    def stringArray(
        self, table: dict[str, Any], key: str, where: str, what: str
    ) -> list[str] | None:
        value = table.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.fault(f"{where}{key} must be an array of {what} (strings)")
        return value
