"""
The suite's twistd daemons forked from a process that has imported their
third-party libraries once, instead of each a new interpreter importing
them again.

The suite starts some three hundred daemons (L{svcd.devkit.daemons.Daemon}),
each of which spent 0.65 s of CPU before it answered /health, two thirds
of it importing Twisted, grpcio, protobuf, OpenTelemetry, cryptography,
psycopg, numpy and prometheus_client (forked: 0.21 s), and some hundred
scripted upstreams (0.26 s to listen; forked: 0.02 s): a large part of
the suite's CPU on a 2-core machine. This plugin sets
L{svcd.devkit.daemons.launcher} (and the scripted upstream's,
L{svcd.devkit.upstream.client.launcher}) so that L{Daemon.start} asks
this pytest process's fork server (started at its first daemon) for the
daemon: the server, a fresh interpreter that imported L{PRELOADED}, forks
a monitor, which forks the daemon's process and reports its pid, then its
exit status.

What stays as it was: each daemon is a process of its own, with its own
pid (signalled directly: SIGTERM, SIGINT, SIGKILL, SIGSTOP and SIGCONT),
its own threads in /proc, its own argv, environment, working directory,
stdin and log file as stdout and stderr, the signal dispositions a new
interpreter started from this process would have, and the exit status the
interpreter gives it (a signal's as a negative number, as
C{subprocess.Popen} says). The daemon runs twistd's C{run()} as
C{python -c} would, in C{__main__}, and leaves through the interpreter's
own exit (non-daemon threads joined, atexit functions, streams flushed), or
with the traceback of an exception nothing caught. The project's own
modules (C{svcd}) and the reactor are never imported by the server: each
daemon installs its reactor, imports svcd and reads its environment
itself. None of the preloaded libraries creates a thread, a channel or a
connection when imported (grpcio is safe to fork until a channel or
server exists); numpy's OpenBLAS threads are stopped by OpenBLAS itself
before a fork and started again when needed.

A daemon runs as a real subprocess, as before, when its environment
differs from this process's in a variable that the interpreter or a
preloaded library reads when it starts or is imported (L{_readAtStart}:
a sitecustomize on PYTHONPATH, say), when its command is not C{python -c
CODE ...} (the upstream's, C{python -m MODULE ...}), and in the tests
marked C{freshinterpreter}: those about twistd's own start
(test_proxy_daemon, test_auth_daemon, test_memory_daemon).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import BinaryIO

import pytest
from forkserver import ForkServer

import svcd.devkit.daemons
import svcd.devkit.upstream.client
from svcd.devkit.daemons import DaemonProcess, popen
from svcd.devkit.upstream.client import popen as upstreamPopen

# What the four daemons import from outside the standard library and svcd
# (python -X importtime), minus what installs the reactor when imported
# (klein, txredisapi): these import every module of that list.
PRELOADED = (
    "concurrent.futures.thread",
    "tomllib",
    "twisted.scripts.twistd",
    "twisted.web.client",
    "twisted.web.server",
    "twisted.web.template",
    "twisted.application.internet",
    "twisted.application.strports",
    "twisted.internet.endpoints",
    "twisted.internet.ssl",
    "twisted.internet.default",
    "twisted.internet.epollreactor",
    "twisted.internet.stdio",
    "twisted.internet.threads",
    "twisted.python.systemd",
    "twisted.spread.pb",
    "twisted.cred.checkers",
    "grpc",
    "grpc.experimental.aio",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "google.protobuf.json_format",
    "google.protobuf.descriptor_pb2",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk.resources",
    "opentelemetry.sdk.metrics",
    "opentelemetry.trace.propagation.tracecontext",
    "opentelemetry.semconv.resource",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "prometheus_client",
    "psycopg",
    "psycopg_pool",
    "numpy",
    "numpy.typing",
    "cryptography.x509",
    "OpenSSL",
    "service_identity",
    "hyperlink",
    "automat",
    "httptools",
    "werkzeug.routing",
    "argon2",
    "attrs",
    "zope.interface",
    "threadpoolctl",
)

# The server. It imports PRELOADED, then forks a monitor for each
# connection (and reaps it once ended); the monitor receives the daemon's
# request and its three standard streams, forks the daemon and reports its
# pid, then its exit status and CPU time. main() returns only in a
# daemon's process, which then becomes what `python -c CODE` (or `python
# -m MODULE`) would have been.
_SERVER = r"""
import json, os, selectors, signal, socket, sys, threading

def daemon(request, streams):
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    for fd in streams:
        os.close(fd)
    # Dispositions as exec leaves them from the pytest process (an ignored
    # signal stays ignored, subprocess.Popen sets SIGPIPE and SIGXFSZ back
    # to their defaults), then as the interpreter sets them at its start.
    ignored = set(request["ignored"])
    for number in signal.valid_signals():
        if number in (signal.SIGKILL, signal.SIGSTOP):
            continue
        keep = number in ignored and number not in (signal.SIGPIPE, signal.SIGXFSZ)
        try:
            signal.signal(number, signal.SIG_IGN if keep else signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    import faulthandler
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(all_threads=True)
    else:
        faulthandler.disable()
    os.chdir(request["cwd"])
    if "module" in request:
        # As python -m: the working directory first on the path, the
        # module's file as argv[0] (run_module's alter_sys).
        sys.path[0] = os.getcwd()
        sys.argv = ["-m", *request["arguments"]]
    else:
        sys.argv = ["-c", *request["arguments"]]

def monitor(connection):
    message, streams, _, _ = socket.recv_fds(connection, 1 << 22, 3)
    assert len(streams) == 3, streams
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        connection.close()
        daemon(request, streams)
        return request
    for fd in streams:
        os.close(fd)
    connection.sendall(json.dumps({"pid": pid}).encode())
    _, status, usage = os.wait4(pid, 0)
    report = {
        "status": os.waitstatus_to_exitcode(status),
        "cpu": usage.ru_utime + usage.ru_stime,
    }
    try:
        connection.sendall(json.dumps(report).encode())
    finally:
        os._exit(0)

def reap():
    # Ended monitors are reaped here, so that their daemons' CPU time is in
    # this process's RUSAGE_CHILDREN, and so in the pytest process's.
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return

def main():
    listener = socket.socket(fileno=int(sys.argv[1]))
    client = int(sys.argv[2])
    address = sys.argv[3]
    for name in sys.argv[4:]:
        try:
            __import__(name)
        except ImportError:
            # Not in this environment (an older Twisted): not preloaded.
            pass
    assert "twisted.internet.reactor" not in sys.modules, "reactor preloaded"
    assert not [name for name in sys.modules if name.split(".")[0] == "svcd"], "svcd preloaded"
    assert threading.active_count() == 1, threading.enumerate()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(client, selectors.EVENT_READ)
    while True:
        reap()
        for key, _ in selector.select(1.0):
            if key.fileobj == client:
                # The pytest process is gone: take the address away.
                reap()
                os.unlink(address)
                os.rmdir(os.path.dirname(address))
                os._exit(0)
            connection, _ = listener.accept()
            if os.fork() == 0:
                selector.close()
                listener.close()
                os.close(client)
                return monitor(connection)
            connection.close()

_request = main()
_code = _request.get("code")
_module = _request.get("module")
del json, os, selectors, signal, socket, sys, threading, daemon, monitor, reap, main, _request
if _module is None:
    exec(compile(_code, "<string>", "exec"))
else:
    __import__("runpy").run_module(_module, run_name="__main__", alter_sys=True)
"""

# Variables that the interpreter reads when it starts, or that a preloaded
# library reads when imported (grpcio's fork support and poller, the
# OpenTelemetry context, prometheus_client's multiprocess mode, psycopg's
# implementation, OpenSSL's configuration, OpenBLAS's threads).
_AT_START_PREFIXES = (
    "PYTHON",
    "LC_",
    "GRPC_",
    "OTEL_PYTHON_",
    "PROMETHEUS_",
    "prometheus_",
    "PSYCOPG",
    "OPENSSL_",
    "OPENBLAS_",
    "OMP_",
    "NUMPY_",
    "MKL_",
)


def _readAtStart(name: str) -> bool:
    """
    Whether variable C{name} is read before a forked daemon could see its
    new value.
    """
    return name.startswith(_AT_START_PREFIXES) or name in ("LANG", "LANGUAGE")


class ForkedProcess:
    """
    A daemon forked by the server: what L{DaemonProcess} asks of it, as
    C{subprocess.Popen} does it, its exit status read from its monitor.
    """

    def __init__(self, connection: socket.socket, args: list[str]) -> None:
        self._connection = connection
        self.args = args
        self.returncode: int | None = None
        self.pid: int = self._message(60.0)["pid"]

    def _message(self, timeout: float | None) -> dict[str, int]:
        ready, _, _ = select.select([self._connection], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        data = self._connection.recv(65536)
        if not data:
            raise RuntimeError(f"the fork server lost {self.args}")
        message: dict[str, int] = json.loads(data)
        return message

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            report = self._message(timeout)
            _spent(float(report["cpu"]))
            self.returncode = report["status"]
            self._connection.close()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                return self.wait(0.0)
            except subprocess.TimeoutExpired:
                return None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # As Popen does: never a signal to a pid that may be another's now.
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server(ForkServer):
    """
    The fork server of this process, started at its first daemon.
    """

    def __init__(self, environment: dict[str, str]) -> None:
        super().__init__("forkedtwistd-", _SERVER, PRELOADED, environment)

    def fork(
        self,
        command: list[str],
        environment: dict[str, str],
        streams: tuple[int, int, int],
        cwd: Path,
    ) -> ForkedProcess:
        """
        C{command} (C{python -c CODE ...} or C{python -m MODULE ...}) forked
        with C{environment}, C{streams} as its stdin, stdout and stderr,
        in C{cwd}.
        """
        ignored = [
            number
            for number in signal.valid_signals()
            if signal.getsignal(number) == signal.SIG_IGN
        ]
        request = {
            "code" if command[1] == "-c" else "module": command[2],
            "arguments": command[3:],
            "env": environment,
            "cwd": str(cwd),
            "ignored": [int(number) for number in ignored],
        }
        connection: socket.socket | None = None
        try:
            connection = self.connection()
            socket.send_fds(connection, [json.dumps(request).encode()], list(streams))
            return ForkedProcess(connection, command)
        except BaseException as error:
            if connection is not None:
                connection.close()
            status = self.process.poll()
            if status is not None:
                # Its traceback (a preloaded library that now installs the
                # reactor or starts a thread) is on this process's stderr.
                raise RuntimeError(
                    f"the fork server of tests/forkedtwistd.py exited with {status}"
                ) from error
            raise


_lock = threading.Lock()
_server: _Server | None = None
# Set while a test marked freshinterpreter runs (its fixtures included).
_fresh = False
_cpuSeconds = 0.0


def _spent(seconds: float) -> None:
    global _cpuSeconds
    with _lock:
        _cpuSeconds += seconds


def cpuSeconds() -> float:
    """
    The CPU time (user and system) of the daemons forked for this process
    that have ended: they are not its children, so not in its
    RUSAGE_CHILDREN.
    """
    return _cpuSeconds


def _atStart(environment: Mapping[str, str]) -> dict[str, str]:
    # The fault handler is set in each forked process (as its environment
    # says), not at the server's start.
    return {
        name: value
        for name, value in environment.items()
        if _readAtStart(name) and name != "PYTHONFAULTHANDLER"
    }


def _serverFor(environment: dict[str, str]) -> _Server | None:
    """
    This process's fork server, started if need be; None unless
    C{environment} has this process's values of the variables read at
    start.
    """
    global _server
    if _atStart(environment) != _atStart(os.environ):
        return None
    with _lock:
        if _server is None or not _server.usable():
            _server = _Server(environment)
            atexit.register(_server.close)
        return _server


def launch(
    command: list[str], environment: dict[str, str], output: BinaryIO, cwd: Path
) -> DaemonProcess:
    """
    L{svcd.devkit.daemons.launcher} for the suite: the daemon forked from
    the fork server when it can be, else a new process.
    """
    server = None if _fresh or command[:2] != [sys.executable, "-c"] else _serverFor(environment)
    with _lock:
        _starts["forked" if server is not None else "new"] += 1
    if server is None:
        return popen(command, environment, output, cwd)
    return server.fork(command, environment, (0, output.fileno(), output.fileno()), cwd)


def launchUpstream(command: list[str], log: BinaryIO, cwd: Path) -> DaemonProcess:
    """
    L{svcd.devkit.upstream.client.launcher} for the suite: the scripted
    upstream (C{python -m svcd.devkit.upstream ...}, this process's
    environment, stdin and stdout /dev/null) forked when it can be.
    """
    environment = dict(os.environ)
    server = None if command[:2] != [sys.executable, "-m"] else _serverFor(environment)
    with _lock:
        _starts["upstreams forked" if server is not None else "upstreams new"] += 1
    if server is None:
        return upstreamPopen(command, log, cwd)
    with open(os.devnull, "r+b") as null:
        return server.fork(command, environment, (null.fileno(), null.fileno(), log.fileno()), cwd)


# How many daemons this process started each way: the run's closing
# summary says how many twistd the suite starts (Daemon.start) and how.
_starts = {"forked": 0, "new": 0, "upstreams forked": 0, "upstreams new": 0}


def pytest_sessionfinish(session: pytest.Session) -> None:
    # An xdist worker hands its counts to the controller.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["forkedtwistd"] = json.dumps(_starts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    counts = json.loads(getattr(node, "workeroutput", {}).get("forkedtwistd", "{}"))
    with _lock:
        for way, count in counts.items():
            _starts[way] += count


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if any(_starts.values()):
        terminalreporter.write_line(
            f"forkedtwistd: {_starts['forked']} daemons forked from the preloaded server, "
            f"{_starts['new']} started as new interpreters (Daemon.start); scripted "
            f"upstreams: {_starts['upstreams forked']} forked, {_starts['upstreams new']} new"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    global _fresh
    _fresh = item.get_closest_marker("freshinterpreter") is not None
    try:
        yield
    finally:
        _fresh = False


svcd.devkit.daemons.launcher = launch
svcd.devkit.upstream.client.launcher = launchUpstream
