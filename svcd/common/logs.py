"""
Structured logs for both daemons: JSON lines (the default) or readable text,
filtered by level, written to stdout or to twistd's --logfile.

twistd builds its own text observer unless the Application carries an
ILogObserver component; L{LoggingRootService} sets that component when
twistd attaches it to the Application, which is the one moment a plugin
can reach the Application before logging starts.

Lines logged while a request is handled carry its C{request_id} and
C{trace_id} even when the code that logs knows neither (the auth client,
the rate limiter): the proxy puts the request id in L{REQUEST_ID}, a
context variable, and makes its span OpenTelemetry's current span; both
live in the request coroutine's contextvars context, which Twisted keeps
across every await (including results handed over with callFromThread)
and copies into the coroutines it starts. The observers run synchronously
in the context of the code that logs, and add what is missing.

Lines are written in batches (L{LineWriter}), as nginx buffers its access
log: at most 0.2 s late, and a warning or worse at once with everything
before it. Writing every line with its own system call cost the proxy
about 6% of its CPU per request under load.
"""

from __future__ import annotations

import atexit
import contextvars
import datetime
import json
import logging
import string
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import IO, Any, Protocol

from opentelemetry import trace
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import ILogObserver, Logger, LogLevel, formatEvent
from twisted.python import logfile
from twisted.python.components import Componentized
from zope.interface import implementer

from svcd.common import config
from svcd.common.lifecycle import StartupError


class TextOutput(Protocol):
    """
    Where the observers write their lines: a text file or a L{LineWriter}.
    """

    def write(self, text: str, /) -> Any: ...

    def flush(self) -> None: ...


LEVELS = {
    "DEBUG": LogLevel.debug,
    "INFO": LogLevel.info,
    "WARN": LogLevel.warn,
    "WARNING": LogLevel.warn,
    "ERROR": LogLevel.error,
}

# Keys of legacy twisted.python.log events and twisted.logger bookkeeping
# that are either shown as "message" or are noise in a structured line.
_HIDDEN_KEYS = frozenset({"format", "message", "isError", "system", "time", "why", "failure"})


# The request id of the request being handled, set by the proxy's
# outermost layer for the duration of the request.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "svc_request_id", default=None
)


# Values written as they are; anything else as its str().
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _jsonable(value: object) -> object:
    if type(value) in _PLAIN or isinstance(value, (str, int, float)):
        return value
    return str(value)


def eventFields(event: Mapping[str, Any]) -> dict[str, object]:
    """
    The keyword fields an event was logged with, minus bookkeeping keys,
    plus the C{request_id} and C{trace_id} of the request or call in
    whose context it was logged, when the event does not name them.
    """
    fields = {
        key: value if type(value) in _PLAIN else _jsonable(value)
        for key, value in event.items()
        if key[:4] != "log_" and key not in _HIDDEN_KEYS
    }
    if "request_id" not in fields:
        requestID = REQUEST_ID.get()
        if requestID:
            fields["request_id"] = requestID
    if "trace_id" not in fields:
        spanContext = trace.get_current_span().get_span_context()
        if spanContext.is_valid:
            fields["trace_id"] = format(spanContext.trace_id, "032x")
    return fields


# The last whole second formatted by _timestamp, and its text: consecutive
# lines mostly fall in the same second, and strftime is the dearest part.
_lastSecond: tuple[int, str] = (-1, "")


def _timestamp(event: Mapping[str, Any]) -> str:
    """
    RFC 3339 UTC with milliseconds, e.g. C{2026-11-21T12:00:00.123Z}.
    """
    global _lastSecond
    when = event.get("log_time", 0.0)
    second = int(when)
    cached, text = _lastSecond
    if second != cached:
        moment = datetime.datetime.fromtimestamp(second, datetime.UTC)
        text = moment.strftime("%Y-%m-%dT%H:%M:%S.")
        _lastSecond = (second, text)
    return f"{text}{int((when - second) * 1000):03d}Z"


class _MessageFormats:
    """
    The message of an event, from its C{log_format}, like
    L{twisted.logger.formatEvent} but with each format parsed once.

    A format whose fields are all plain names (C{"{method} {route}"}, the
    only kind this project logs) is rendered by joining its parts; any
    other (attribute access, C{!r}, format specs, Twisted's C{"{f()}"}
    calls) and any event missing a field go to formatEvent, which also
    knows how to report a format that fails.
    """

    def __init__(self, limit: int = 1000) -> None:
        self._parsed: dict[str, tuple[tuple[str, str | None], ...] | None] = {}
        self._limit = limit

    def _parse(self, text: str) -> tuple[tuple[str, str | None], ...] | None:
        parts: list[tuple[str, str | None]] = []
        try:
            for literal, field, spec, conversion in string.Formatter().parse(text):
                if field is not None and (spec or conversion or not field.isidentifier()):
                    return None
                parts.append((literal, field))
        except ValueError:
            return None
        return tuple(parts)

    def __call__(self, event: Mapping[str, Any]) -> str:
        text = event.get("log_format")
        if not isinstance(text, str):
            return formatEvent(dict(event))
        try:
            parts = self._parsed[text]
        except KeyError:
            parts = self._parse(text)
            if len(self._parsed) < self._limit:
                self._parsed[text] = parts
        if parts is None:
            return formatEvent(dict(event))
        pieces = []
        for literal, field in parts:
            pieces.append(literal)
            if field is not None:
                if field not in event:
                    return formatEvent(dict(event))
                pieces.append(str(event[field]))
        return "".join(pieces)


_message = _MessageFormats()

# One encoder for every line (json.dumps with options makes a new one each
# call).
_LINE_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)

# Lines written out at once rather than with the next batch.
_FLUSHED_LEVELS = frozenset({LogLevel.warn, LogLevel.error, LogLevel.critical})


def _reentrantLock() -> threading.RLock:
    """
    The lock of a step of the log path. Reentrant, as Python's
    C{logging.Handler} lock is: Twisted's SIGTERM and SIGINT handlers log
    ("Received SIGTERM, shutting down."), and a signal handler runs in the
    main thread between two bytecodes of whatever it was doing, such as
    writing a log line under this very lock. A plain lock then waits for
    itself forever: the daemon hangs instead of stopping (seen in CI: a
    SIGTERM that came while svc-proxy wrote a warning).
    """
    return threading.RLock()


@implementer(ILogObserver)
class JSONLinesObserver:
    """
    One JSON object per line: timestamp, level, service (when named),
    namespace, message, the event's keyword fields, and the traceback of a
    logged failure.

    Writes are serialised by a lock: grpcio's server threads log too. A
    warning or worse is flushed at once; other lines are written when
    C{outFile} (a L{LineWriter} in the daemons) decides.
    """

    def __init__(self, outFile: TextOutput, service: str | None = None) -> None:
        self._outFile = outFile
        self._service = service
        self._lock = _reentrantLock()

    def __call__(self, event: Mapping[str, Any]) -> None:
        level = event.get("log_level", LogLevel.info)
        record: dict[str, object] = {
            "timestamp": _timestamp(event),
            "level": level.name,
        }
        if self._service is not None:
            record["service"] = self._service
        record["namespace"] = event.get("log_namespace", "")
        record["message"] = _message(event)
        record.update(eventFields(event))
        failure = event.get("log_failure")
        if failure is not None:
            record["exception"] = failure.getTraceback()
        line = _LINE_ENCODER.encode(record) + "\n"
        with self._lock:
            self._outFile.write(line)
            if level in _FLUSHED_LEVELS:
                self._outFile.flush()


@implementer(ILogObserver)
class TextLinesObserver:
    """
    Readable lines for a terminal: time, level, namespace, message, then
    the keyword fields as key=value. Flushed as L{JSONLinesObserver}.
    """

    def __init__(self, outFile: TextOutput) -> None:
        self._outFile = outFile
        self._lock = _reentrantLock()

    def __call__(self, event: Mapping[str, Any]) -> None:
        level = event.get("log_level", LogLevel.info)
        fields = " ".join(f"{key}={value}" for key, value in eventFields(event).items())
        line = (
            f"{_timestamp(event)} {level.name.upper():5} [{event.get('log_namespace', '')}] "
            f"{_message(event)}"
        )
        if fields:
            line += "  " + fields
        failure = event.get("log_failure")
        if failure is not None:
            line += "\n" + failure.getTraceback()
        with self._lock:
            self._outFile.write(line + "\n")
            if level in _FLUSHED_LEVELS:
                self._outFile.flush()


class LineWriter:
    """
    A daemon's log file, written in batches: a line is written out once
    C{maxDelay} seconds have passed since the oldest line waiting, once
    C{maxBytes} are waiting, or on L{flush} (which the observers call for
    a warning or worse, and L{LoggingRootService} every C{maxDelay} seconds
    and at stop). Under load that is a few writes a second instead of
    two per request; when idle a line is at most C{maxDelay} late.

    Thread-safe: grpcio's threads log as well as the reactor's. Safe to
    re-enter from a signal handler that logs while this thread is inside
    L{write} or L{flush} (see L{_reentrantLock}): such a line joins the
    waiting ones, and if the interrupted code was writing them out it is
    written by the next write-out, at most C{maxDelay} later; the file
    itself is never written re-entrantly (the io module refuses that).
    """

    def __init__(
        self,
        outFile: IO[str],
        monotonic: Callable[[], float] = time.monotonic,
        maxDelay: float = 0.2,
        maxBytes: int = 64 * 1024,
    ) -> None:
        self._outFile = outFile
        self._monotonic = monotonic
        self.maxDelay = maxDelay
        self._maxBytes = maxBytes
        self._lock = _reentrantLock()
        # Lines not yet written, oldest first; appended and taken one at a
        # time, so a re-entrant call at any point loses none.
        self._waiting: deque[str] = deque()
        self._size = 0
        self._oldest = 0.0
        # True while this object's holder writes to the file.
        self._writing = False

    def write(self, text: str) -> None:
        with self._lock:
            now = self._monotonic()
            if not self._waiting:
                self._oldest = now
            self._waiting.append(text)
            self._size += len(text)
            if self._size >= self._maxBytes or now - self._oldest >= self.maxDelay:
                self._writeOut()

    def flush(self) -> None:
        with self._lock:
            self._writeOut()

    def flushAtExit(self) -> None:
        """
        L{flush}, when the file may already be closed (twistd's log file).
        """
        try:
            self.flush()
        except (OSError, ValueError):
            pass

    def _writeOut(self) -> None:
        if self._writing:
            # Re-entered from a signal handler while this thread writes:
            # the lines wait for the next write-out.
            return
        self._writing = True
        try:
            lines = []
            while self._waiting:
                lines.append(self._waiting.popleft())
            self._size = 0
            if lines:
                self._outFile.write("".join(lines))
            self._outFile.flush()
        finally:
            self._writing = False


def logSettings(environ: Mapping[str, str]) -> tuple[str, LogLevel]:
    """
    Read SVC_LOG_FORMAT (json or text) and SVC_LOG_LEVEL (DEBUG, INFO,
    WARN, ERROR).
    """
    logFormat = config.choice(environ, "SVC_LOG_FORMAT", "json", ("json", "text"))
    levelName = config.choice(
        environ, "SVC_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARN", "WARNING", "ERROR")
    )
    return logFormat, LEVELS[levelName]


def makeObserver(
    logFormat: str, level: LogLevel, outFile: TextOutput, service: str | None = None
) -> ILogObserver:
    """
    Build the filtered observer for a format, level and output file;
    JSON lines name C{service} (where logs of several daemons meet).
    """
    inner: ILogObserver
    if logFormat == "json":
        inner = JSONLinesObserver(outFile, service)
    else:
        inner = TextLinesObserver(outFile)
    return LevelFilter(inner, level)


@implementer(ILogObserver)
class LevelFilter:
    """
    Pass on the events of C{level} and above: what Twisted's
    C{FilteringLogObserver} with a C{LogLevelFilterPredicate} of one level
    for every namespace does (an event without a level or a namespace is
    dropped too), decided by one set lookup. That pair compared log levels
    through C{constantly}'s ordering and walked the namespace's segments for
    every event, about a sixth of the cost of a logged line, and as much
    again for each line filtered out (the DEBUG ones at INFO).
    """

    def __init__(self, observer: ILogObserver, level: LogLevel) -> None:
        self._observer = observer
        self._admitted = frozenset(each for each in LogLevel.iterconstants() if each >= level)

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("log_level") in self._admitted and event.get("log_namespace"):
            self._observer(event)


def daemonLogWriter(twistdOptions: Mapping[str, Any] | None) -> LineWriter:
    """
    The L{LineWriter} over L{twistdOutput}, also flushed when the process
    exits, for the lines twistd logs after the services have stopped.
    """
    writer = LineWriter(twistdOutput(twistdOptions))
    atexit.register(writer.flushAtExit)
    return writer


def twistdOutput(twistdOptions: Mapping[str, Any] | None) -> IO[str]:
    """
    Where twistd would have written its log: stdout for C{-n} without
    C{--logfile} (or C{--logfile -}), else the named file with twistd's
    rotation, C{twistd.log} when daemonised without one.
    """
    if twistdOptions is None:
        return sys.stdout
    name = twistdOptions.get("logfile") or ""
    if name == "-" or (not name and twistdOptions.get("nodaemon")):
        return sys.stdout
    rotating: IO[str] = logfile.LogFile.fromFullPath(name or "twistd.log")
    return rotating


_STDLIB_LEVELS = (
    (logging.ERROR, LogLevel.error),
    (logging.WARNING, LogLevel.warn),
    (logging.INFO, LogLevel.info),
)


class StdlibLogBridge(logging.Handler):
    """
    Sends the records of Python's C{logging} (grpcio, the OpenTelemetry
    SDK and its exporter use it) to twisted.logger, so they come out as
    the daemon's JSON or text lines instead of bare text on stderr.
    """

    def emit(self, record: logging.LogRecord) -> None:
        level = LogLevel.debug
        for threshold, twistedLevel in _STDLIB_LEVELS:
            if record.levelno >= threshold:
                level = twistedLevel
                break
        try:
            text = record.getMessage()
        except Exception:  # a bad format string must not kill the caller
            text = str(record.msg)
        Logger(namespace=record.name).emit(level, "{text}", text=text)


def stdlibLevel(level: LogLevel) -> int:
    """
    The C{logging} level matching a twisted.logger level.
    """
    return {
        LogLevel.debug: logging.DEBUG,
        LogLevel.info: logging.INFO,
        LogLevel.warn: logging.WARNING,
        LogLevel.error: logging.ERROR,
        LogLevel.critical: logging.CRITICAL,
    }[level]


class LoggingRootService(MultiService):
    """
    The top service of a daemon: hands its log observer to the twistd
    Application it is attached to, so twistd logs through it; routes
    Python C{logging} records into it while running; turns a failure to
    bind its ports into one clear line and exit status 1; and stops its
    children one at a time, last added first.

    The sequential stop is what a graceful shutdown needs: the listener
    stops and requests in flight drain before the connections they use
    (database pool, Redis, gRPC channel) close, and the spans of those
    requests are flushed after they end. L{MultiService} would stop them
    all at once.

    @param level: the configured level. Python C{logging} records pass
        at WARNING and above (or ERROR, if that is the level): the
        libraries' own INFO and DEBUG chatter is not the daemon's.
    @param writer: the observer's L{LineWriter}, flushed every
        C{writer.maxDelay} seconds on C{clock} while running, and at stop.
    """

    log = Logger()

    def __init__(
        self,
        observer: ILogObserver,
        daemonName: str = "svc",
        level: LogLevel = LogLevel.info,
        writer: LineWriter | None = None,
        clock: IReactorTime | None = None,
    ) -> None:
        super().__init__()
        self.logObserver = observer
        self.daemonName = daemonName
        self._bridge = StdlibLogBridge(max(stdlibLevel(level), logging.WARNING))
        self._writer = writer
        self._flushing: LoopingCall | None = None
        if writer is not None and clock is not None:
            self._flushing = LoopingCall(writer.flush)
            self._flushing.clock = clock

    def startService(self) -> None:
        logging.getLogger().addHandler(self._bridge)
        if self._flushing is not None and self._writer is not None:
            self._flushing.start(self._writer.maxDelay, now=True)
        super().startService()

    def stopService(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._stopInOrder())

    async def _stopInOrder(self) -> None:
        # Service.stopService only clears C{running}; the children are ours.
        Service.stopService(self)
        for child in reversed(list(self)):
            try:
                await maybeDeferred(child.stopService)
            except Exception:
                self.log.failure("Stopping {child} failed", child=type(child).__name__)
        logging.getLogger().removeHandler(self._bridge)
        if self._flushing is not None and self._flushing.running:
            self._flushing.stop()
        if self._writer is not None:
            self._writer.flush()

    def privilegedStartService(self) -> None:
        # twistd binds ports here, before the reactor runs; an exception
        # would end the process with a traceback.
        try:
            super().privilegedStartService()
        except (StartupError, CannotListenError) as error:
            self.log.critical("Cannot start: {reason}", reason=str(error))
            # twistd has redirected sys.stderr into the log by now.
            if sys.__stderr__ is not None:
                sys.__stderr__.write(f"{self.daemonName}: cannot start: {error}\n")
            raise SystemExit(1) from None

    def setServiceParent(self, parent: Any) -> None:
        if isinstance(parent, Componentized) and parent.getComponent(ILogObserver) is None:
            parent.setComponent(ILogObserver, self.logObserver)
        super().setServiceParent(parent)
