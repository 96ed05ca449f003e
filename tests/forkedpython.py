"""
C{python -m MODULE ...} for the tests that run svcctl, without paying each
time for the interpreter's start and the libraries' imports.

The suite runs svcctl some two hundred times, each a new interpreter that
spent about 0.35 s of CPU, most of it importing numpy, psycopg, protobuf
and prometheus_client, before doing a few milliseconds of work: a tenth
of the suite's CPU, on a 2-core machine. Forked, a command takes 0.05 s
(20 calls each way, load average 7). L{run} has a process that
imported those libraries once (the fork server, one per pytest process)
fork a new process for each command, which then runs the module as C{-m}
does, with the command's arguments, environment, working directory and
standard streams, and ends with the exit status the interpreter would
give it.

What stays as it was: every command is a process of its own, with its own
pid, stdin, stdout and stderr, environment and exit status; the project's
own modules (C{svcd}) are imported afresh by each, never by the server, so
a module that reads its environment or keeps state when imported does so
in every command as before. What is shared is the import of the libraries
listed in L{PRELOADED}, which read nothing of the command's environment
when imported. A command whose environment differs from the server's in a
variable the interpreter itself reads at its start (C{PYTHON*}, the
locale's) runs as a real subprocess, as does any command that is not
C{sys.executable -m MODULE}.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from forkserver import ForkServer

# The libraries svcctl imports, the bulk of its start (python -X importtime).
PRELOADED = (
    "argparse",
    "csv",
    "decimal",
    "json",
    "uuid",
    "zoneinfo",
    "attrs",
    "google.protobuf.message",
    "numpy",
    "prometheus_client",
    "psycopg",
    "psycopg_pool",
)

# The server: imports PRELOADED, then for each connection forks a monitor,
# which receives the command and its three standard streams, forks the
# command's process and reports its pid and then its exit status. The
# server leaves when its client (the pytest process) is gone.
_SERVER = r"""
import atexit, json, os, runpy, selectors, signal, socket, sys, traceback

def exitCode(exit):
    code = exit.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1

def command(request, streams):
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # As python -m: the working directory first on the path, the module's
    # file as argv[0] (run_module's alter_sys), the module as __main__.
    sys.path[0] = os.getcwd()
    sys.argv = ["-m", *request["arguments"]]
    status = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        status = exitCode(exit)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    # What the interpreter does on its way out.
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            status = 120
    os._exit(status)

def monitor(connection):
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    message, streams, _, _ = socket.recv_fds(connection, 1 << 22, 3)
    assert len(streams) == 3, streams
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        connection.close()
        command(request, streams)
    for fd in streams:
        os.close(fd)
    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status, usage = os.wait4(pid, 0)
    report = {
        "status": os.waitstatus_to_exitcode(status),
        "cpu": usage.ru_utime + usage.ru_stime,
    }
    connection.sendall(json.dumps(report).encode() + b"\n")
    os._exit(0)

listener = socket.socket(fileno=int(sys.argv[1]))
client = int(sys.argv[2])
address = sys.argv[3]
for name in sys.argv[4:]:
    __import__(name)
assert not [name for name in sys.modules if name.split(".")[0] == "svcd"], "svcd preloaded"
# Monitors are reaped by the kernel; each monitor waits for its command.
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
selector = selectors.DefaultSelector()
selector.register(listener, selectors.EVENT_READ)
selector.register(client, selectors.EVENT_READ)
while True:
    for key, _ in selector.select():
        if key.fileobj == client:
            # The client is gone (a pytest worker may end without its
            # atexit functions): take the address away with the server.
            os.unlink(address)
            os.rmdir(os.path.dirname(address))
            os._exit(0)
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            os.close(client)
            monitor(connection)
        connection.close()
"""


def _interpreterVariable(name: str) -> bool:
    """
    Whether the interpreter reads variable C{name} when it starts (so that
    a forked process could not honour a new value).
    """
    return name.startswith(("PYTHON", "LC_")) or name in ("LANG", "LANGUAGE")


class _Server(ForkServer):
    """
    The fork server of this process, started at its first command.
    """

    def __init__(self) -> None:
        super().__init__("forkedpython-", _SERVER, PRELOADED, dict(os.environ))

    def run(
        self, module: str, arguments: Sequence[str], environment: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", module, *arguments]
        outRead, outWrite = os.pipe()
        errRead, errWrite = os.pipe()
        try:
            connection = self.connection()
            request = {
                "module": module,
                "arguments": list(arguments),
                "env": dict(environment),
                "cwd": os.getcwd(),
            }
            socket.send_fds(connection, [json.dumps(request).encode()], [0, outWrite, errWrite])
        finally:
            os.close(outWrite)
            os.close(errWrite)
        return _collect(connection, outRead, errRead, command, timeout)


def _collect(
    connection: socket.socket, outRead: int, errRead: int, command: list[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """
    Read the command's stdout and stderr to their ends and its pid and exit
    status from its monitor; kill it once C{timeout} has passed.
    """
    deadline = time.monotonic() + timeout
    output = {outRead: bytearray(), errRead: bytearray()}
    report = bytearray()
    pid: int | None = None
    status: int | None = None
    selector = selectors.DefaultSelector()
    for fd in (outRead, errRead, connection.fileno()):
        selector.register(fd, selectors.EVENT_READ)
    try:
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(
                    command, timeout, bytes(output[outRead]), bytes(output[errRead])
                )
            for key, _ in selector.select(left):
                fd = key.fd
                chunk = os.read(fd, 65536)
                if not chunk:
                    selector.unregister(fd)
                elif fd in output:
                    output[fd] += chunk
                else:
                    report += chunk
                    lines = report.split(b"\n")
                    for line in lines[:-1]:
                        message = json.loads(line)
                        pid = message.get("pid", pid)
                        status = message.get("status", status)
                        _spent(message.get("cpu", 0.0))
                    report = lines[-1]
    finally:
        selector.close()
        connection.close()
        os.close(outRead)
        os.close(errRead)
    if status is None:
        raise RuntimeError(f"the fork server lost {command} (pid {pid})")
    return subprocess.CompletedProcess(
        command,
        status,
        _text(bytes(output[outRead])),
        _text(bytes(output[errRead])),
    )


def _text(data: bytes) -> str:
    """
    Bytes read from a pipe as C{subprocess.run(text=True)} decodes them:
    the locale's encoding, universal newlines.
    """
    return data.decode(_ENCODING).replace("\r\n", "\n").replace("\r", "\n")


# subprocess.run(text=True) decodes with locale.getencoding() (3.11:
# getpreferredencoding(False)).
_ENCODING = __import__("locale").getpreferredencoding(False)

_lock = threading.Lock()
_server: _Server | None = None

# The CPU time the forked commands of this process took: they are not its
# children, and so not in its RUSAGE_CHILDREN (bench/ and a timing plugin
# that measures the suite can add it).
_cpuSeconds = 0.0


def _spent(seconds: float) -> None:
    global _cpuSeconds
    with _lock:
        _cpuSeconds += seconds


def cpuSeconds() -> float:
    """
    The CPU time (user and system) the commands forked for this process
    have taken so far.
    """
    return _cpuSeconds


def _serverFor(environment: Mapping[str, str]) -> _Server | None:
    """
    This process's fork server, started if need be; None when
    C{environment} differs from the server's in a variable the
    interpreter reads at its start.
    """
    global _server
    with _lock:
        if _server is None or not _server.usable():
            _server = _Server()
            atexit.register(_server.close)
        server = _server
    names = set(environment) | set(server.environment)
    if any(
        _interpreterVariable(name) and environment.get(name) != server.environment.get(name)
        for name in names
    ):
        return None
    return server


def run(
    command: Sequence[str], env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """
    What C{subprocess.run(command, env=env, capture_output=True, text=True,
    timeout=timeout, check=False)} returns, forked from this process's fork
    server when C{command} is C{sys.executable -m MODULE ...}.
    """
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m":
        server = _serverFor(env)
        if server is not None:
            return server.run(command[2], command[3:], env, timeout)
    return subprocess.run(
        list(command), env=dict(env), capture_output=True, text=True, timeout=timeout, check=False
    )
