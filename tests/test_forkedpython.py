"""
tests/forkedpython.py: a command forked from the fork server ends as the
same command run by subprocess.run would (status, stdout, stderr), in a
process of its own that imports the project afresh.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import forkedpython
import pytest

PROGRAM = r"""
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd() == os.environ.get("EXPECTED_CWD"))
print("dsn", os.environ.get("POSTGRES_DSN"), "pid", os.getpid() != int(os.environ["CALLER"]))
print("fresh", "svcd" not in sys.modules)
if os.environ.get("SHOW_PRELOADED"):
    print("preloaded", "numpy" in sys.modules)
print("main", __name__, os.path.basename(sys.argv[0]))
print("é to stderr", file=sys.stderr)
what = sys.argv[1]
if what == "exit3":
    sys.exit(3)
if what == "message":
    sys.exit("a message for stderr")
if what == "raise":
    raise ValueError("uncaught")
if what == "sleep":
    import time
    time.sleep(60)
if what == "buffered":
    sys.stdout.write("x" * 300000)
"""


@pytest.fixture
def program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """
    A module in the working directory (as C{python -m} finds one), named
    for this test.
    """
    (tmp_path / "forkedprogram.py").write_text(PROGRAM)
    monkeypatch.chdir(tmp_path)
    return "forkedprogram"


def environment(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "POSTGRES_DSN": "postgresql:///nowhere",
        "EXPECTED_CWD": str(tmp_path),
        "CALLER": str(os.getpid()),
    }


@pytest.mark.parametrize("what", ["ok", "exit3", "message", "raise", "buffered"])
def test_theSameAsSubprocess(program: str, tmp_path: Path, what: str) -> None:
    """
    Status, stdout and stderr as subprocess.run gives them: a normal end,
    sys.exit with a number and with a message, an uncaught exception (its
    traceback, status 1), and more output than a pipe holds.
    """
    command = [sys.executable, "-m", program, what, "--flag"]
    forked = forkedpython.run(command, env=environment(tmp_path), timeout=60)
    real = subprocess.run(
        command,
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert forked.returncode == real.returncode
    assert forked.stdout == real.stdout
    # The traceback's lines are the same but for the frames above the
    # module's own (runpy's, at other line numbers).
    assert forked.stderr.splitlines()[-1:] == real.stderr.splitlines()[-1:]
    assert forked.stderr.count("\n") >= (2 if what == "raise" else 1)
    assert forked.args == command
    assert "fresh True" in forked.stdout


def test_forkedWithTheLibrariesImported(program: str, tmp_path: Path) -> None:
    """
    The command is forked from the server (numpy is already imported; a
    new interpreter would not have it), and the project is not.
    """
    env = {**environment(tmp_path), "SHOW_PRELOADED": "yes"}
    result = forkedpython.run([sys.executable, "-m", program, "ok"], env=env, timeout=60)
    assert "preloaded True" in result.stdout
    assert "fresh True" in result.stdout


def test_svcctlAsBefore() -> None:
    """
    svcctl's usage error (argparse's, on stderr, status 2) is the same.
    """
    command = [sys.executable, "-m", "svcd.ctl", "limits", "frobnicate"]
    env = {**os.environ, "POSTGRES_DSN": "postgresql:///nowhere"}
    forked = forkedpython.run(command, env=env, timeout=60)
    real = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        real.returncode,
        real.stdout,
        real.stderr,
    )
    assert forked.returncode == 2


def test_timeoutKills(program: str, tmp_path: Path) -> None:
    """
    Past its timeout the command is killed and TimeoutExpired raised, as
    subprocess.run does.
    """
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forkedpython.run(
            [sys.executable, "-m", program, "sleep"], env=environment(tmp_path), timeout=2
        )
    assert time.monotonic() - began < 10


def test_commandsRunAtOnce(program: str, tmp_path: Path) -> None:
    """
    Commands from several threads run side by side, not one after the
    other: three that each sleep until killed all time out together.
    """
    errors: list[BaseException] = []

    def one() -> None:
        try:
            forkedpython.run(
                [sys.executable, "-m", program, "sleep"], env=environment(tmp_path), timeout=3
            )
        except BaseException as error:
            errors.append(error)

    began = time.monotonic()
    threads = [threading.Thread(target=one) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.monotonic() - began < 8
    assert [type(each) for each in errors] == [subprocess.TimeoutExpired] * 3


def test_anInterpreterVariableRunsARealProcess(program: str, tmp_path: Path) -> None:
    """
    A variable the interpreter reads at its start, changed: the command
    runs as a subprocess (PYTHONIOENCODING shows in its stderr's encoding).
    """
    env = {**environment(tmp_path), "PYTHONIOENCODING": "ascii:backslashreplace"}
    result = forkedpython.run([sys.executable, "-m", program, "ok"], env=env, timeout=60)
    assert result.returncode == 0
    assert "\\xe9 to stderr" in result.stderr
