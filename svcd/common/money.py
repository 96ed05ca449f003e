"""
Amounts of US dollars as integers of nano-dollars (10^-9 dollars), read
from and written as exact decimal strings (decisions D12): never through a
float, so a price, a budget or a report's total is exact to the
nano-dollar.

Shared by svc-proxy (the providers file's prices) and svc-auth (budgets
set with svcctl, the cost_usd of reports).
"""

from __future__ import annotations

import re

NANO_PER_DOLLAR = 10**9

# ASCII digits, then at most 9 decimals (decisions D12, amended): never \d,
# which also matches other scripts' digits (fullwidth U+FF12 U+FF10,
# Arabic-Indic U+0662 U+0660), and int() would read those as 20.
_DECIMAL = re.compile(r"([0-9]+)(?:\.([0-9]{1,9}))?")
# The default ceiling of parseDollars: far above any model's price
# (dollars per million tokens).
MAX_DOLLARS = 1_000_000


class BadDollars(ValueError):
    """
    Text that is not a decimal string of dollars with at most 9 decimals,
    or a value past the ceiling (the message says why).
    """


def parseDollars(text: str, maximum: int = MAX_DOLLARS) -> int:
    """
    A decimal string of dollars as nano-dollars, exactly.

    @param maximum: the largest amount accepted, in whole dollars.
    @raise BadDollars: for anything but ASCII digits with at most 9
        decimals, or a value past C{maximum}.
    """
    match = _DECIMAL.fullmatch(text)
    if match is None:
        raise BadDollars(
            f'must be a decimal string of dollars such as "2.50" with at most 9 decimals,'
            f" got {text!r}"
        )
    whole, fraction = match.group(1), match.group(2) or ""
    nano = int(whole) * NANO_PER_DOLLAR + int(fraction.ljust(9, "0"))
    if nano > maximum * NANO_PER_DOLLAR:
        raise BadDollars(f"must be at most {maximum} dollars, got {text!r}")
    return nano


def formatDollars(nano: int) -> str:
    """
    Nano-dollars as an exact decimal string of dollars: at least 2
    decimals, no trailing zero beyond them, never an exponent.
    """
    sign = "-" if nano < 0 else ""
    whole, fraction = divmod(abs(nano), NANO_PER_DOLLAR)
    decimals = f"{fraction:09d}".rstrip("0").ljust(2, "0")
    return f"{sign}{whole}.{decimals}"
