"""
dev/test and the parallel runs it starts (issue 24): the whole suite on
pytest-xdist's workers by default, one file in one process, and the
user's own choice of workers respected.

dev/test runs from a copy of itself in a temporary checkout whose
dev/bootstrap does nothing and whose .venv/bin/python records its
arguments, so no pytest runs; the worker count that C{-n auto} gives is
checked on tests/conftest.py's hook directly.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from conftest import WORKERS, pytest_xdist_auto_num_workers

CHECKOUT = Path(__file__).resolve().parents[1]
TESTS = CHECKOUT / "tests"
BASH = shutil.which("bash") or "/bin/bash"


@pytest.fixture
def fakeCheckout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "dev").mkdir(parents=True)
    shutil.copy(CHECKOUT / "dev" / "test", root / "dev" / "test")
    (root / "dev" / "bootstrap").write_text("#!/usr/bin/env bash\nexit 0\n")
    (root / "dev" / "bootstrap").chmod(0o755)
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    # Records its arguments, one a line, and exits with $FAKE_STATUS.
    python.write_text(
        '#!/usr/bin/env bash\nprintf "%s\\n" "$@" >"$(dirname "$0")/../arguments"\n'
        'exit "${FAKE_STATUS:-0}"\n'
    )
    python.chmod(0o755)
    return root


def runDevTest(root: Path, *arguments: str, status: int = 0) -> tuple[list[str], int]:
    """
    Run the copy's dev/test; the arguments its pytest got, and its status.
    """
    result = subprocess.run(
        [BASH, str(root / "dev" / "test"), *arguments],
        cwd=root,
        env={"PATH": "/usr/bin:/bin", "FAKE_STATUS": str(status)},
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    recorded = (root / ".venv" / "arguments").read_text().splitlines()
    return recorded, result.returncode


def test_devTestRunsTheSuiteOnWorkers(fakeCheckout: Path) -> None:
    """
    Without arguments dev/test asks for pytest-xdist's workers (C{-n
    auto}); with arguments it passes them on after that.
    """
    assert runDevTest(fakeCheckout) == (["-m", "pytest", "-n", "auto"], 0)
    assert runDevTest(fakeCheckout, "tests/test_servers.py", "-x", "-k", "redis") == (
        ["-m", "pytest", "-n", "auto", "tests/test_servers.py", "-x", "-k", "redis"],
        0,
    )


@pytest.mark.parametrize(
    "arguments",
    [
        ("-n", "0"),
        ("-n0",),
        ("-n", "2", "tests"),
        ("--numprocesses=3",),
        ("-p", "no:xdist"),
        ("-pno:xdist", "tests/test_ids.py"),
    ],
)
def test_devTestLeavesTheWorkersToTheUser(fakeCheckout: Path, arguments: tuple[str, ...]) -> None:
    """
    Arguments that choose the workers, or turn pytest-xdist off, are
    passed on alone: C{-n auto} would override the one and be refused
    without the other.
    """
    assert runDevTest(fakeCheckout, *arguments) == (["-m", "pytest", *arguments], 0)


def test_devTestFailsARunThatCollectedNothing(fakeCheckout: Path) -> None:
    """
    pytest's status is dev/test's, and "no tests collected" (5) is a
    failure like any other.
    """
    assert runDevTest(fakeCheckout, status=1)[1] == 1
    assert runDevTest(fakeCheckout, "-k", "nothing", status=5)[1] == 5


def autoWorkers(*arguments: str) -> int | None:
    config = SimpleNamespace(args=list(arguments))
    return pytest_xdist_auto_num_workers(cast(pytest.Config, config))


def test_oneFileRunsInOneProcess(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    C{-n auto} starts no worker for one test file or tests of one file,
    one per file for fewer files than L{WORKERS}, and L{WORKERS} for a
    directory or more files.
    """
    monkeypatch.chdir(CHECKOUT)
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    assert autoWorkers("tests/test_ids.py") == 0
    assert autoWorkers("tests/test_ids.py::test_a", "tests/test_ids.py::test_b") == 0
    assert autoWorkers("tests") == WORKERS
    assert autoWorkers("tests/test_ids.py", "tests/test_pat.py") == 2
    files = sorted(str(path.relative_to(CHECKOUT)) for path in TESTS.glob("test_*.py"))
    assert autoWorkers(*files) == WORKERS
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "2")
    assert autoWorkers("tests") is None
