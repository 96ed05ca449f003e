"""
What the parts of a C{dev/gateway} run share: the lines it prints of its
own (L{say}), its error (L{DevStackError}), the files it keeps (written
whole, for its owner only), svcctl, and the record of its children that
lets the next run stop what a killed one left running (L{stopLeftovers}).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

# The checkout this module belongs to: dev/gateway runs from there, and
# twistd finds the svc plugins in its twisted/plugins/ even where the
# project is not installed.
CHECKOUT = Path(__file__).resolve().parents[3]

STOP_TIMEOUT = 15.0


class DevStackError(Exception):
    """
    Something went wrong that the developer must fix; shown as one line,
    without a traceback.
    """


@attrs.define
class Daemon:
    """
    A child process (a twistd daemon, the model server) and the URL that
    answers 200 once it is ready, or None when it is ready once started.
    """

    name: str
    readyURL: str | None
    process: subprocess.Popen[bytes]


def say(message: str) -> None:
    """
    A line of our own, told apart from the daemons' output by its prefix.
    """
    print(f"dev/gateway: {message}", file=sys.stderr, flush=True)


def writePrivateJSON(path: Path, document: object) -> None:
    """
    Write C{document} to C{path}, readable by its owner only (it holds a
    token), replacing the old file in one step so a crash never leaves half
    a file.
    """
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as output:
        # The file may have existed with looser permissions.
        os.fchmod(output.fileno(), 0o600)
        json.dump(document, output, indent=2)
        output.write("\n")
    os.replace(temporary, path)


def executableBeside(name: str) -> str | None:
    """
    The console script C{name} of the virtualenv we run in, else on PATH.
    """
    beside = Path(sys.executable).parent / name
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def _commandLine(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def startedCommandLine(pid: int, timeout: float = 5.0) -> list[str] | None:
    """
    The command line of a child we have just started, or None once it has
    exited. Popen returns as soon as the child's exec has closed its
    close-on-exec descriptors, which is before the kernel has set up the
    new program's arguments: /proc then shows an empty command line (most
    of the time, on a busy machine), and a record of that would never match
    in L{stopLeftovers}. So wait, briefly, until there is one.
    """
    deadline = time.monotonic() + timeout
    while True:
        command = _commandLine(pid)
        if command or command is None or time.monotonic() >= deadline:
            return command
        time.sleep(0.01)


def stopLeftovers(record: Path, timeout: float = STOP_TIMEOUT) -> None:
    """
    Stop the processes that an earlier run recorded in C{record} and left
    running because it was killed (SIGKILL, a crash): they would hold the
    ports this run needs. A process counts only if its command line is the
    one recorded, so a reused process id is never signalled.
    """
    try:
        entries = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    survivors = []
    for entry in entries if isinstance(entries, list) else []:
        pid, command = entry.get("pid"), entry.get("command")
        if isinstance(pid, int) and command and _commandLine(pid) == command:
            say(f"stopping {entry.get('name', pid)} left running by an earlier run (pid {pid})")
            os.kill(pid, signal.SIGTERM)
            survivors.append((pid, command))
    deadline = time.monotonic() + timeout
    while survivors and time.monotonic() < deadline:
        time.sleep(0.1)
        survivors = [(pid, command) for pid, command in survivors if _commandLine(pid) == command]
    for pid, _ in survivors:
        os.kill(pid, signal.SIGKILL)
    record.unlink(missing_ok=True)


def svcctl(
    environ: Mapping[str, str], *arguments: str, dsn: str, show: bool = False
) -> dict[str, Any]:
    """
    Run one svcctl command against C{dsn}, in C{environ}, and return the
    JSON object it prints. Its stderr goes to the terminal; its stdout is
    never shown unless C{show}, since it may hold a token.
    """
    script = executableBeside("svcctl")
    command = [script] if script else [sys.executable, "-m", "svcd.ctl"]
    what = "svcctl " + " ".join(arguments[:2])
    try:
        result = subprocess.run(  # noqa: S603 - our own svcctl, arguments we built
            [*command, *arguments],
            env={**environ, "POSTGRES_DSN": dsn},
            cwd=CHECKOUT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            timeout=300,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise DevStackError(f"{what} did not finish within 300 s") from None
    if result.returncode != 0:
        raise DevStackError(f"{what} failed with exit status {result.returncode} (see above)")
    try:
        document = json.loads(result.stdout)
    except ValueError:
        raise DevStackError(f"{what} did not print a JSON document") from None
    if not isinstance(document, dict):
        raise DevStackError(f"{what} printed JSON that is not an object")
    if show:
        say(f"{what}: {json.dumps(document, sort_keys=True)}")
    return document
