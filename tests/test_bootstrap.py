"""
dev/bootstrap as a newcomer meets it on a fresh Debian machine (issue 14):
one line per step on the terminal, the programs' own output in
C{.data/bootstrap.log}, the log's last lines when a step fails, curl
installed when it is missing, the pip step saying what it does and how
long it takes, and the system services of postgresql and redis-server named
with the command that disables them.

The real script runs from a copy of the checkout in a temporary directory,
with a PATH of its own: symlinks to the real programs it needs, and fakes
for the rest. The fake apt-get, sudo and Pythons record their arguments and
print as much as the real ones do, so nothing is installed and every run
takes a fraction of a second. The one change to the copy points the two
places off PATH where the script looks for Debian's PostgreSQL and Redis
(constants at its top) into the temporary directory, so that this machine's
own servers do not count.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from collections.abc import Iterable
from pathlib import Path

import attrs
import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
BOOTSTRAP = CHECKOUT / "dev" / "bootstrap"
README = CHECKOUT / "README.rst"

# The real programs dev/bootstrap runs besides the faked ones.
REAL_PROGRAMS = (
    "bash",
    "cat",
    "cut",
    "date",
    "dirname",
    "env",
    "flock",
    "mkdir",
    "readlink",
    "rm",
    "sha256sum",
    "tail",
    "tr",
)

# How many lines the fake apt-get prints per install: about what the real
# one printed for postgresql and redis-server on a minimal Debian 12.
APT_LINES = 300
PIP_LINES = 120
TAIL_LINES = 20
PREFIX = "dev/bootstrap: "
DISABLE_BOTH = "sudo systemctl disable --now postgresql redis-server"
BASH = shutil.which("bash") or "/bin/bash"

Completed = subprocess.CompletedProcess[str]

# Each fake appends one line to $FAKE_CALLS per call: its name and arguments.
FAKE_APT_GET = """\
printf 'apt-get %s DEBIAN_FRONTEND=%s\\n' "$*" "${DEBIAN_FRONTEND:-}" >>"$FAKE_CALLS"
if [[ "$1" == update ]]; then
    printf 'Get:%d http://deb.debian.org/debian bookworm InRelease\\n' 1 2 3
else
    for ((i = 1; i <= APT_LINES; i++)); do
        printf 'Selecting previously unselected package %s (apt line %d of %s).\\n' \\
            "${@: -1}" "$i" "$*"
    done
fi
for word in "$@"; do
    if [[ -n "${FAKE_APT_FAIL:-}" && "$word" == "$FAKE_APT_FAIL" ]]; then
        echo "E: Unable to locate package $word" >&2
        exit 100
    fi
done
""".replace("APT_LINES", str(APT_LINES))

# With $FAKE_SUDO_PASSWORD set, sudo -n fails as the real one does when it
# would have to ask for a password.
FAKE_SUDO = """\
printf 'sudo %s\\n' "$*" >>"$FAKE_CALLS"
if [[ "$1" == -n ]]; then
    if [[ -n "${FAKE_SUDO_PASSWORD:-}" ]]; then
        echo "sudo: a password is required" >&2
        exit 1
    fi
    shift
fi
exec "$@"
"""

# dpkg -s: nothing is installed.
FAKE_DPKG = """\
printf 'dpkg %s\\n' "$*" >>"$FAKE_CALLS"
exit 1
"""

FAKE_ID = """\
case "$1" in
    -u) echo "$FAKE_UID" ;;
    -un) if [[ "$FAKE_UID" == 0 ]]; then echo root; else echo newcomer; fi ;;
    *) exit 1 ;;
esac
"""

# The Python dev/bootstrap finds on PATH: recent enough, and it makes a
# "virtualenv" by copying the fake venv Python below.
FAKE_PYTHON = """\
case "$1" in
    -c) exit 0 ;;
    --version) echo "Python 3.11.99" ;;
    -m)
        printf 'python3 %s\\n' "$*" >>"$FAKE_CALLS"
        [[ "$2 $3" == "venv --clear" ]] || exit 2
        "$mkdir" -p "$4/bin"
        "$cp" "$FAKE_VENV_PYTHON" "$4/bin/python"
        echo "made a virtualenv in $4"
        ;;
esac
"""

# .venv/bin/python: healthy (recent, with pip), and its pip install prints
# what this machine's pip configuration prints.
FAKE_VENV_PYTHON = """\
case "$1 ${2:-} ${3:-}" in
    "-m pip --version") echo "pip 99.0" ;;
    "-m pip install")
        printf 'pip %s in %s\\n' "$*" "$PWD" >>"$FAKE_CALLS"
        for ((i = 1; i <= PIP_LINES; i++)); do
            echo "WARNING: Location 'file:///opt/pypi/simple/p$i/' is ignored (pip line $i)" >&2
        done
        if [[ -n "${FAKE_PIP_FAIL:-}" ]]; then
            echo "ERROR: No matching distribution found for twisted" >&2
            exit 1
        fi
        ;;
    *) [[ "$1" == -c ]] || exit 2 ;;
esac
""".replace("PIP_LINES", str(PIP_LINES))

# Present when a test says so.
FAKE_PRESENT = """\
printf '%s %s\\n' "$("$basename" "$0")" "$*" >>"$FAKE_CALLS"
"""


def writeProgram(path: Path, body: str) -> None:
    """
    An executable bash script at C{path}, which finds the tools it uses
    itself ($cp, $mkdir, $basename) outside the sandbox's PATH.
    """
    tools = "".join(f"{tool}={shutil.which(tool)}\n" for tool in ("cp", "mkdir", "basename"))
    path.write_text(f"#!{BASH}\nset -u\n{tools}{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@attrs.define
class Sandbox:
    """
    A copy of the checkout's dev/bootstrap and setup.py, a PATH made of fakes
    and symlinks, and what the fakes recorded.
    """

    root: Path
    bin: Path
    calls: Path
    systemDirectory: Path
    environment: dict[str, str]

    @property
    def log(self) -> Path:
        return self.root / ".data" / "bootstrap.log"

    @property
    def venvPython(self) -> Path:
        return self.root / ".venv" / "bin" / "python"

    @property
    def stamp(self) -> Path:
        return self.root / ".venv" / ".setup.py.sha256"

    def provide(self, *names: str) -> None:
        """
        Put programs that only need to exist on PATH (curl, redis-server,
        initdb ...).
        """
        for name in names:
            writeProgram(self.bin / name, FAKE_PRESENT)

    def remove(self, name: str) -> None:
        (self.bin / name).unlink()

    def provideEverything(self) -> None:
        """
        A machine where dev/bootstrap has already run: the Debian programs,
        a healthy .venv, and the stamp of the current setup.py.
        """
        self.provide("curl", "systemd-analyze", "initdb", "pg_ctl", "redis-server")
        self.venvPython.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.systemDirectory / "venv-python", self.venvPython)
        self.run()
        self.calls.write_text("")

    def run(self, stdin: int = subprocess.DEVNULL, **environment: str) -> Completed:
        """
        Run dev/bootstrap from the copy's root, without a terminal unless
        C{stdin} is one.
        """
        return subprocess.run(
            [BASH, str(self.root / "dev" / "bootstrap")],
            cwd=self.root,
            env={**self.environment, **environment},
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def recorded(self, program: str) -> list[str]:
        """
        The calls of one fake, one line each.
        """
        if not self.calls.exists():
            return []
        return [line for line in self.calls.read_text().splitlines() if line.startswith(program)]


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    """
    A fresh machine: nothing of what dev/bootstrap installs is there, and we
    are not root.
    """
    root = tmp_path / "checkout"
    (root / "dev").mkdir(parents=True)
    shutil.copy(CHECKOUT / "setup.py", root / "setup.py")
    systemDirectory = tmp_path / "system"
    systemDirectory.mkdir()
    script = BOOTSTRAP.read_text()
    for name, value in (
        ("postgres_versions", "/usr/lib/postgresql"),
        ("redis_sbin", "/usr/sbin/redis-server"),
        ("redis_sentinel_bin", "/usr/bin/redis-sentinel"),
    ):
        line = f"{name}={value}\n"
        assert script.count(line) == 1, f"dev/bootstrap no longer says {line!r}"
        script = script.replace(line, f"{name}={systemDirectory / name}\n")
    (root / "dev" / "bootstrap").write_text(script)
    (root / "dev" / "bootstrap").chmod(0o755)

    bin = tmp_path / "bin"
    bin.mkdir()
    for program in REAL_PROGRAMS:
        found = shutil.which(program)
        assert found is not None, program
        (bin / program).symlink_to(found)
    for name, body in (
        ("apt-get", FAKE_APT_GET),
        ("sudo", FAKE_SUDO),
        ("dpkg", FAKE_DPKG),
        ("id", FAKE_ID),
        ("python3", FAKE_PYTHON),
    ):
        writeProgram(bin / name, body)
    writeProgram(systemDirectory / "venv-python", FAKE_VENV_PYTHON)
    calls = tmp_path / "calls"
    environment = {
        "PATH": str(bin),
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "FAKE_CALLS": str(calls),
        "FAKE_UID": "1000",
        "FAKE_VENV_PYTHON": str(systemDirectory / "venv-python"),
    }
    return Sandbox(root, bin, calls, systemDirectory, environment)


def terminalLines(result: Completed) -> list[str]:
    assert result.stdout == ""
    return result.stderr.splitlines()


def lineAbout(lines: Iterable[str], words: str) -> str:
    """
    The one terminal line that starts with C{dev/bootstrap: words}.
    """
    found = [line for line in lines if line.startswith(PREFIX + words)]
    assert len(found) == 1, (words, lines)
    return found[0]


def test_freshMachineShowsOneLinePerStep(sandbox: Sandbox) -> None:
    """
    On a machine with nothing installed, each step is one line on the
    terminal (what is installed and why), however much apt-get and pip
    print; their output goes to .data/bootstrap.log, which the first line
    names.
    """
    result = sandbox.run()
    assert result.returncode == 0, result.stderr
    lines = terminalLines(result)
    assert all(line.startswith(PREFIX) for line in lines), lines
    starts = [
        "updating Debian's package lists to install postgresql redis-server systemd curl",
        "installing postgresql redis-server: ",
        "installing systemd: ",
        "installing curl: ",
        f"creating .venv with {sandbox.bin / 'python3'} (Python 3.11.99)",
        "installing the project and its test dependencies into .venv"
        " (pip, about a minute the first time; log: .data/bootstrap.log)",
    ]
    assert len(lines) == len(starts), lines
    for line, start in zip(lines, starts, strict=True):
        assert line.startswith(PREFIX + start), (line, start)
    assert lines[0].endswith("goes to .data/bootstrap.log)")
    assert "WARNING" not in result.stderr and "Selecting" not in result.stderr
    # The whole output is in the log, under a header for the run and each step.
    log = sandbox.log.read_text()
    assert log.count("==== dev/bootstrap") == 1
    steps = [line.split(": ", 1)[1] for line in log.splitlines() if line.startswith("---- ")]
    assert steps == [
        "apt-get update",
        "apt-get install postgresql redis-server",
        "apt-get install systemd",
        "apt-get install curl",
        f"{sandbox.bin / 'python3'} -m venv --clear {sandbox.root / '.venv'}",
        "pip install -e '.[test]'",
    ]
    assert log.count("Selecting previously unselected package") == 3 * APT_LINES
    assert log.count("WARNING: Location") == PIP_LINES
    assert "made a virtualenv" in log


def test_aptGetRunsNoninteractiveThroughSudoWithoutPrompt(sandbox: Sandbox) -> None:
    """
    Without a terminal, apt-get runs through sudo -n (which fails at once
    rather than waiting for a password), non-interactive, updating the
    package lists first, and the project is installed with pip from the
    checkout; then the setup.py stamp is written.
    """
    result = sandbox.run()
    assert result.returncode == 0, result.stderr
    aptGet = "sudo -n env DEBIAN_FRONTEND=noninteractive apt-get"
    assert sandbox.recorded("sudo") == [
        f"{aptGet} update -q",
        f"{aptGet} install -y -q --no-install-recommends postgresql redis-server",
        f"{aptGet} install -y -q --no-install-recommends systemd",
        f"{aptGet} install -y -q --no-install-recommends curl",
    ]
    assert all(
        call.endswith("DEBIAN_FRONTEND=noninteractive") for call in sandbox.recorded("apt-get")
    )
    assert sandbox.recorded("pip") == [
        f"pip -m pip install --progress-bar off -e .[test] in {sandbox.root}"
    ]
    setupHash = hashlib.sha256((sandbox.root / "setup.py").read_bytes()).hexdigest()
    assert sandbox.stamp.read_text() == setupHash + "\n"


def test_servicesLineSaysTheyRunAtBootAndHowToDisableThem(sandbox: Sandbox) -> None:
    """
    The line for postgresql and redis-server says that Debian starts their
    system services now and at every boot, that svc does not use them, and
    gives the command that stops and disables them.
    """
    lines = terminalLines(sandbox.run())
    line = lineAbout(lines, "installing postgresql redis-server")
    assert "every boot" in line and "never uses" in line
    assert line.endswith(f"(to stop and disable them: {DISABLE_BOTH})")


def test_servicesLineNamesOnlyWhatIsInstalled(sandbox: Sandbox) -> None:
    """
    As root, with only Redis missing, the command names redis-server alone
    and has no sudo, and apt-get runs without sudo.
    """
    sandbox.provide("initdb", "pg_ctl")
    result = sandbox.run(FAKE_UID="0")
    assert result.returncode == 0, result.stderr
    line = lineAbout(terminalLines(result), "installing redis-server")
    assert line.endswith("(to stop and disable them: systemctl disable --now redis-server)")
    assert sandbox.recorded("sudo") == []
    assert (
        "apt-get install -y -q --no-install-recommends redis-server"
        " DEBIAN_FRONTEND=noninteractive" in sandbox.recorded("apt-get")
    )


def test_sentinelOnlyWhenAsked(sandbox: Sandbox) -> None:
    """
    redis-sentinel (the Sentinel tests, decisions D16) is installed only
    with SVC_INSTALL_HA=1, as .ci/run asks: a developer's run installs
    nothing new.
    """
    sandbox.provideEverything()
    quiet = sandbox.run(FAKE_UID="0")
    assert quiet.returncode == 0, quiet.stderr
    assert sandbox.recorded("apt-get") == []
    asked = sandbox.run(FAKE_UID="0", SVC_INSTALL_HA="1")
    assert asked.returncode == 0, asked.stderr
    line = lineAbout(terminalLines(asked), "installing redis-sentinel: ")
    assert line.endswith("(SVC_INSTALL_HA=1)")
    assert (
        "apt-get install -y -q --no-install-recommends redis-sentinel"
        " DEBIAN_FRONTEND=noninteractive" in sandbox.recorded("apt-get")
    )
    sandbox.calls.write_text("")
    sandbox.provide("redis-sentinel")
    again = sandbox.run(FAKE_UID="0", SVC_INSTALL_HA="1")
    assert again.returncode == 0, again.stderr
    assert sandbox.recorded("apt-get") == []


def test_curlIsInstalledWhenMissing(sandbox: Sandbox) -> None:
    """
    On a machine that has everything else, a missing curl is installed
    (dev/gateway prints curl commands), with one line saying why after the
    one for apt-get update.
    """
    sandbox.provideEverything()
    sandbox.remove("curl")
    result = sandbox.run(FAKE_UID="0")
    assert result.returncode == 0, result.stderr
    assert [call.split(" DEBIAN")[0] for call in sandbox.recorded("apt-get")] == [
        "apt-get update -q",
        "apt-get install -y -q --no-install-recommends curl",
    ]
    lines = terminalLines(result)
    assert len(lines) == 2, lines
    assert "dev/gateway prints curl commands" in lineAbout(lines, "installing curl: ")


def test_curlIsInstalledThroughSudoFromATerminal(sandbox: Sandbox) -> None:
    """
    Not root, in a terminal, curl is installed through plain sudo, which
    may ask for a password there.
    """
    sandbox.provideEverything()
    sandbox.remove("curl")
    controller, terminal = os.openpty()
    try:
        result = sandbox.run(stdin=terminal)
    finally:
        os.close(controller)
        os.close(terminal)
    assert result.returncode == 0, result.stderr
    aptGet = "sudo env DEBIAN_FRONTEND=noninteractive apt-get"
    assert sandbox.recorded("sudo") == [
        f"{aptGet} update -q",
        f"{aptGet} install -y -q --no-install-recommends curl",
    ]


def test_missingCurlAloneStopsNothingWithoutATerminal(sandbox: Sandbox) -> None:
    """
    Not root and without a terminal (an editor running dev/test), where sudo
    could not ask for a password, a missing curl alone is one line saying
    so; dev/bootstrap goes on, since the tests do not need curl.
    """
    sandbox.provideEverything()
    sandbox.remove("curl")
    result = sandbox.run()
    assert result.returncode == 0, result.stderr
    [line] = terminalLines(result)
    assert line.startswith(PREFIX + "curl is missing (dev/gateway prints curl commands")
    assert "install it yourself" in line
    assert sandbox.recorded("sudo") == sandbox.recorded("apt-get") == []


def test_curlIsNotAskedForWhenPresent(sandbox: Sandbox) -> None:
    """
    With curl there, apt-get installs what is missing (systemd here) and
    not curl.
    """
    sandbox.provideEverything()
    sandbox.remove("systemd-analyze")
    result = sandbox.run(FAKE_UID="0")
    assert result.returncode == 0, result.stderr
    assert [call.split(" DEBIAN")[0] for call in sandbox.recorded("apt-get")] == [
        "apt-get update -q",
        "apt-get install -y -q --no-install-recommends systemd",
    ]
    assert "curl" not in result.stderr


@pytest.mark.parametrize("uid", ["0", "1000"])
def test_quietWhenNothingIsToDo(sandbox: Sandbox, uid: str) -> None:
    """
    With everything there, dev/bootstrap says nothing, runs neither apt-get
    nor pip, and writes no log.
    """
    sandbox.provideEverything()
    sandbox.log.unlink()
    result = sandbox.run(FAKE_UID=uid)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert sandbox.recorded("apt-get") == sandbox.recorded("pip") == []
    assert not sandbox.log.exists()


def test_debianPythonGetsItsVenvPackages(sandbox: Sandbox) -> None:
    """
    When the Python found is Debian's own and dpkg says its venv package is
    missing, python3-venv and python3.X-venv are installed first, on a
    line that says why; here apt-get fails, so no .venv is made.
    """
    debianPython = Path("/usr/bin/python3")
    if not debianPython.exists():
        pytest.skip("this machine has no /usr/bin/python3")
    version = subprocess.run(
        [str(debianPython), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if version not in {"3.11", "3.12", "3.13", "3.14"}:
        pytest.skip("this machine has no Debian Python 3.11 or newer in /usr/bin")
    sandbox.provide("curl", "systemd-analyze", "initdb", "pg_ctl", "redis-server")
    sandbox.remove("python3")
    (sandbox.bin / "python3").symlink_to(debianPython)
    result = sandbox.run(FAKE_UID="0", FAKE_APT_FAIL="python3-venv")
    assert result.returncode == 1
    packages = f"python3-venv python{version}-venv"
    line = lineAbout(terminalLines(result), f"installing {packages}: ")
    assert line.endswith(f"{sandbox.bin / 'python3'} needs them to make .venv")
    assert sandbox.recorded("dpkg") == [f"dpkg -s python{version}-venv"]
    assert f"apt-get install {packages} failed" in result.stderr
    assert not sandbox.venvPython.exists()


def test_failedStepShowsTheLogsLastLines(sandbox: Sandbox) -> None:
    """
    When apt-get fails, dev/bootstrap names the step and the log, shows the
    log's last 20 lines (apt-get's error among them), goes no further and
    exits non-zero.
    """
    result = sandbox.run(FAKE_APT_FAIL="systemd")
    assert result.returncode == 1
    lines = terminalLines(result)
    failure = lineAbout(lines, "apt-get install systemd failed")
    assert failure.endswith(f"the last {TAIL_LINES} lines of .data/bootstrap.log:")
    shown = lines[lines.index(failure) + 1 :]
    assert shown == sandbox.log.read_text().splitlines()[-TAIL_LINES - 1 : -1]
    assert shown[-1] == "E: Unable to locate package systemd"
    assert f"apt line {APT_LINES} of" in shown[-2]
    lastLogLine = sandbox.log.read_text().splitlines()[-1]
    assert lastLogLine.startswith("---- apt-get install systemd failed")
    assert not any("curl" in call for call in sandbox.recorded("apt-get"))
    assert sandbox.recorded("pip") == []


def test_failedPipShowsTheLogsLastLines(sandbox: Sandbox) -> None:
    """
    When pip fails, its last lines are shown with the log's path, and the
    stamp is not written, so that the next run tries again.
    """
    sandbox.provideEverything()
    sandbox.stamp.unlink()
    result = sandbox.run(FAKE_PIP_FAIL="yes")
    assert result.returncode == 1
    lines = terminalLines(result)
    assert len(lines) == 2 + TAIL_LINES
    assert lines[1].startswith(PREFIX + "pip install -e '.[test]' failed (exit status 1)")
    assert lines[-1] == "ERROR: No matching distribution found for twisted"
    assert not sandbox.stamp.exists()


def test_changedSetupPyAppendsToTheLog(sandbox: Sandbox) -> None:
    """
    A changed setup.py reinstalls the project with one line that says why;
    the log keeps the earlier run and gains a header for this one.
    """
    sandbox.provideEverything()
    before = sandbox.log.read_text()
    with (sandbox.root / "setup.py").open("a") as setup:
        setup.write("# changed\n")
    result = sandbox.run()
    assert result.returncode == 0, result.stderr
    [line] = terminalLines(result)
    assert line.startswith(PREFIX + "installing the project and its test dependencies into .venv")
    assert "setup.py has changed" in line and "log: .data/bootstrap.log" in line
    log = sandbox.log.read_text()
    assert log.startswith(before)
    assert log.count("==== dev/bootstrap") == 2
    assert log.count("WARNING: Location") == 2 * PIP_LINES


def test_logIsNamedInFullFromElsewhere(sandbox: Sandbox) -> None:
    """
    Run from another directory (dev/test tests/... from a subdirectory),
    the log is named by its absolute path.
    """
    sandbox.provideEverything()
    sandbox.stamp.unlink()
    elsewhere = sandbox.root / "dev"
    result = subprocess.run(
        [BASH, "bootstrap"],
        cwd=elsewhere,
        env=sandbox.environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"log: {sandbox.log})" in result.stderr


def test_notDebianStillStopsWithItsMessage(sandbox: Sandbox) -> None:
    """
    Without apt-get, missing servers stop dev/bootstrap with the message it
    always gave; a missing curl alone does not stop it.
    """
    sandbox.remove("apt-get")
    result = sandbox.run()
    assert result.returncode == 1
    assert result.stderr.startswith(
        PREFIX + "missing: postgresql redis-server systemd curl."
        " This is not a Debian-like system (no apt-get): install"
    )
    sandbox.provideEverything()
    sandbox.remove("curl")
    result = sandbox.run(FAKE_UID="0")
    assert result.returncode == 0, result.stderr
    assert "curl is missing" in result.stderr and "no apt-get" in result.stderr


def test_readmeQuickStartSaysWhatBootstrapDoes() -> None:
    """
    README's Quick start names what dev/bootstrap installs (curl too), its
    log, and that the system PostgreSQL and Redis services now run at
    every boot, with the command that disables them.
    """
    text = README.read_text()
    quickStart = text[text.index("Quick start\n===") : text.index("Running the daemons\n===")]
    flat = " ".join(quickStart.split())
    for words in (
        "``curl``",
        "``.data/bootstrap.log``",
        "every boot",
        DISABLE_BOTH,
    ):
        assert words in flat, words


def test_sudoNeedingAPasswordWithoutATerminalFailsAtOnce(sandbox: Sandbox) -> None:
    """
    Without a terminal, a sudo that needs a password fails at once (sudo
    -n) rather than waiting, and its complaint is among the lines shown.
    """
    result = sandbox.run(FAKE_SUDO_PASSWORD="yes")
    assert result.returncode == 1
    lines = terminalLines(result)
    assert lines[1].startswith(PREFIX + "apt-get update failed (exit status 1)")
    assert lines[-1] == "sudo: a password is required"
    assert sandbox.recorded("apt-get") == []


def test_withoutSudoSaysToRunAsRoot(sandbox: Sandbox) -> None:
    """
    Not root and without sudo, dev/bootstrap says what is missing and the
    command to run as root, as it always did.
    """
    sandbox.remove("sudo")
    result = sandbox.run()
    assert result.returncode == 1
    missing = "postgresql redis-server systemd curl"
    assert result.stderr == (
        f"{PREFIX}missing: {missing}. Run as root: apt-get update && apt-get install -y {missing}\n"
    )
