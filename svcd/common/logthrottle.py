"""
Warnings about a dependency that is down, at most one per interval.

When Redis or the auth service is down every request notices; one warning
per request would flood the log at exactly the moment an operator reads
it. L{ThrottledWarning} logs the first occurrence, then at most one line
per interval carrying how many were suppressed in between.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger

from svcd.common.clocks import Clock


class ThrottledWarning:
    """
    A warning logged at most once per C{interval} seconds of C{clock}.
    """

    def __init__(self, log: Logger, clock: Clock, interval: float = 10.0) -> None:
        self._log = log
        self._clock = clock
        self._interval = interval
        self._lastLogged: float | None = None
        self._suppressed = 0

    def warn(self, format: str, **fields: Any) -> bool:
        """
        Log C{format} with C{fields} (plus C{suppressed}, the number of
        occurrences not logged since the last line) unless a line was
        logged less than the interval ago.

        @return: whether a line was logged.
        """
        now = self._clock.seconds()
        if self._lastLogged is not None and now - self._lastLogged < self._interval:
            self._suppressed += 1
            return False
        self._lastLogged = now
        suppressed, self._suppressed = self._suppressed, 0
        self._log.warn(format, suppressed=suppressed, **fields)
        return True
