"""
The daemons forked by tests/forkedtwistd.py are what a new interpreter
would be: their own process, argv, environment, working directory, output,
signal dispositions and exit status, with neither svcd nor the reactor
imported before they run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import forkedtwistd
import pytest

from svcd.devkit.daemons import DaemonProcess

# Starts processes (a fork server and its children).
pytestmark = pytest.mark.e2e

# What a forked process tells of itself, as JSON on its stdout.
_REPORT = """
import faulthandler, json, os, signal, sys, threading
print(json.dumps({
    "faulthandler": faulthandler.is_enabled(),
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "variable": os.environ.get("FORKED_VARIABLE"),
    "inherited": os.environ.get("FORKED_INHERITED"),
    "svcd": sorted(name for name in sys.modules if name.split(".")[0] == "svcd"),
    "reactor": "twisted.internet.reactor" in sys.modules,
    "sigint": repr(signal.getsignal(signal.SIGINT)),
    "sigterm": repr(signal.getsignal(signal.SIGTERM)),
    "sigpipe": repr(signal.getsignal(signal.SIGPIPE)),
    "threads": threading.active_count(),
    "pid": os.getpid(),
    "ppid": os.getppid(),
}))
print("to stderr", file=sys.stderr)
"""


def _start(code: str, tmp_path: Path, **variables: str) -> tuple[DaemonProcess, Path]:
    log = tmp_path / "out.log"
    environment = {"PYTHONFAULTHANDLER": "1", **os.environ, **variables}
    with log.open("ab") as output:
        process = forkedtwistd.launch(
            [sys.executable, "-c", code, "first", "--second"], environment, output, tmp_path
        )
    return process, log


def test_forkedAsANewInterpreter(tmp_path: Path) -> None:
    """
    argv, environment, working directory, stdout and stderr are the
    command's; svcd and the reactor are not imported; the signals are as a
    new interpreter has them; it exits 0 through the interpreter's exit.
    """
    process, log = _start(_REPORT, tmp_path, FORKED_VARIABLE="given")
    assert isinstance(process, forkedtwistd.ForkedProcess)
    assert process.wait(60) == 0
    first, second = log.read_text().splitlines()
    report = json.loads(first)
    assert second == "to stderr"
    assert report["argv"] == ["-c", "first", "--second"]
    assert report["cwd"] == str(tmp_path)
    assert report["variable"] == "given"
    assert report["svcd"] == [] and report["reactor"] is False
    # As exec from this process leaves it: an xdist worker ignores SIGINT.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert report["sigint"] == repr(signal.SIG_IGN if ignored else signal.default_int_handler)
    assert report["sigterm"] == repr(signal.SIG_DFL)
    assert report["sigpipe"] == repr(signal.SIG_IGN)
    assert report["threads"] == 1
    assert report["faulthandler"] is True
    assert report["pid"] == process.pid and report["ppid"] != os.getpid()


def test_handledSigintIsTheInterpreters(tmp_path: Path) -> None:
    """
    A signal this process handles is the interpreter's default in the
    daemon (exec resets it; the interpreter then installs
    default_int_handler for SIGINT).
    """
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process, log = _start(_REPORT, tmp_path)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert process.wait(60) == 0
    report = json.loads(log.read_text().splitlines()[0])
    assert report["sigint"] == repr(signal.default_int_handler)


def test_ignoredSigintStaysIgnored(tmp_path: Path) -> None:
    """
    As exec leaves it: a signal ignored in the pytest process is ignored in
    the daemon (a shell's background job ignores SIGINT).
    """
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process, log = _start(_REPORT, tmp_path)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert process.wait(60) == 0
    assert json.loads(log.read_text().splitlines()[0])["sigint"] == repr(signal.SIG_IGN)


def test_faultHandlerAsTheEnvironmentSays(tmp_path: Path) -> None:
    """
    Without PYTHONFAULTHANDLER, the fault handler is off, as in a new
    interpreter.
    """
    log = tmp_path / "out.log"
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    with log.open("ab") as output:
        process = forkedtwistd.launch(
            [sys.executable, "-c", _REPORT], environment, output, tmp_path
        )
    assert isinstance(process, forkedtwistd.ForkedProcess)
    assert process.wait(60) == 0
    assert json.loads(log.read_text().splitlines()[0])["faulthandler"] is False


def test_moduleAsPythonDashM(tmp_path: Path) -> None:
    """
    C{python -m MODULE ...} (the scripted upstream's way): the module runs
    as __main__ with its arguments; stdout is /dev/null, stderr the log.
    """
    log = tmp_path / "err.log"
    missing = tmp_path / "missing.json"
    with log.open("ab") as output:
        process = forkedtwistd.launchUpstream(
            [sys.executable, "-m", "json.tool", str(missing)], output, tmp_path
        )
    assert isinstance(process, forkedtwistd.ForkedProcess)
    assert process.wait(60) == 2
    text = log.read_text()
    assert "usage: python -m json.tool" in text and "missing.json" in text


@pytest.mark.parametrize(
    ("code", "status", "says"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("raise ValueError('broken')", 1, "ValueError: broken"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
        (
            "import atexit; atexit.register(print, 'at exit'); "
            "import threading, time; threading.Thread(target=time.sleep, args=(0.2,)).start()",
            0,
            "at exit",
        ),
    ],
)
def test_exitStatus(tmp_path: Path, code: str, status: int, says: str) -> None:
    """
    The exit status the interpreter would give: SystemExit's code, 1 and a
    traceback for an exception nothing caught, minus the signal that
    killed it; atexit functions run once non-daemon threads are done.
    """
    process, log = _start(code, tmp_path)
    assert process.wait(60) == status
    assert says in log.read_text()
    assert process.poll() == status == process.returncode


def test_signalledFrozenAndThawed(tmp_path: Path) -> None:
    """
    The daemon is a process the test signals itself: SIGSTOP stops every
    one of its threads, SIGCONT resumes it, SIGTERM ends it.
    """
    code = (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    process, log = _start(code, tmp_path)
    deadline = time.monotonic() + 60
    while "up" not in log.read_text():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    assert len(list(Path(f"/proc/{process.pid}/task").iterdir())) == 2
    process.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{process.pid}/stat").read_text().split(")")[1].split()[0] != "T":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGCONT)
    assert process.poll() is None
    process.terminate()
    assert process.wait(60) == -signal.SIGTERM


def test_interpreterVariablesMakeANewProcess(tmp_path: Path) -> None:
    """
    A daemon whose PYTHON* variables differ from the server's, or a test
    marked freshinterpreter, gets a new interpreter.
    """
    process, _ = _start("pass", tmp_path, PYTHONPATH=str(tmp_path))
    assert not isinstance(process, forkedtwistd.ForkedProcess)
    assert process.wait(60) == 0


@pytest.mark.freshinterpreter
def test_freshInterpreterMark(tmp_path: Path) -> None:
    process, _ = _start("pass", tmp_path)
    assert not isinstance(process, forkedtwistd.ForkedProcess)
    assert process.wait(60) == 0
