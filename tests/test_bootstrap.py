"""
dev/bootstrap as a newcomer meets it on a fresh Debian machine: one line on
the terminal per step, saying what is installed and why; the programs' own
output in .data/bootstrap.log, whose last lines are shown only when a step
fails; curl installed when missing (dev/gateway ends by printing a curl
command); and a word about the PostgreSQL and Redis services that Debian
starts and enables at boot when it installs them.

The real script runs, unchanged, from a copy of the checkout, with PATH set
to a directory of its own: fake apt-get, sudo, dpkg and id that record how
they were called and talk as much as the real ones, a fake Python whose
"venv" and "pip" cost nothing, and links to the real commands the script
needs. C{DEV_BOOTSTRAP_SYSROOT} (for tests only) moves the fixed paths where
the script looks for PostgreSQL, Redis and Debian's Python into a temporary
directory, so that this machine's own packages are not seen.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOTSTRAP = ROOT / "dev" / "bootstrap"
PREFIX = "dev/bootstrap: "
DISABLE_SERVICES = "sudo systemctl disable --now"
# What the fake apt-get prints for each of update and install, and the fake
# pip for install: together about what a fresh Debian 12 shows.
APT_LINES = 150
PIP_LINES = 40
# The real programs the script (and the fakes) need besides the fakes.
REAL_COMMANDS = (
    "bash",
    "cat",
    "cp",
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
)


def realCommand(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is missing on this machine"
    return path


BASH = realCommand("bash")

FAKE_APT_GET = f"""#!{BASH}
# Records its arguments and DEBIAN_FRONTEND, talks, and fails when asked.
printf '%s\\n' "$*" >>"$FAKE_CALLS/apt-get"
printf '%s\\n' "${{DEBIAN_FRONTEND:-}}" >>"$FAKE_CALLS/apt-get.frontend"
verb=""
for argument; do
    case "$argument" in -*) ;; *) verb="$argument"; break ;; esac
done
for ((line = 1; line <= {APT_LINES}; line++)); do
    printf 'fake apt-get %s: line %d\\n' "$verb" "$line"
done
printf 'fake apt-get %s: on stderr\\n' "$verb" >&2
[[ "$verb" != "${{FAKE_APT_FAILS:-}}" ]] || exit 100
"""

FAKE_SUDO = f"""#!{BASH}
printf '%s\\n' "$*" >>"$FAKE_CALLS/sudo"
[[ "$1" != -n ]] || shift
exec "$@"
"""

FAKE_ID = f"""#!{BASH}
[[ "$1" == -u ]] && printf '%s\\n' "${{FAKE_UID:-0}}"
"""

# dpkg -s PACKAGE: installed only if named in FAKE_DPKG_INSTALLED.
FAKE_DPKG = f"""#!{BASH}
[[ " ${{FAKE_DPKG_INSTALLED:-}} " == *" $2 "* ]]
"""

# Both Debian's python3.11 and the Python of the .venv it makes: the version
# checks pass, "-m venv DIR" copies this file to DIR/bin/python, and
# "-m pip install" records where and with what it ran, and talks.
FAKE_PYTHON = f"""#!{BASH}
case "$1" in
--version) echo "Python 3.11.99" ;;
-c) [[ "$2" != *print* ]] || echo 3.11 ;;
-m)
    case "$2 $3" in
    "venv --clear")
        {realCommand("mkdir")} -p "$4/bin"
        {realCommand("cp")} "$0" "$4/bin/python"
        echo "fake venv: made $4"
        ;;
    "pip --version") echo "pip 99.0 (fake)" ;;
    "pip install")
        printf '%s %s\\n' "$PWD" "$*" >>"$FAKE_CALLS/pip"
        for ((line = 1; line <= {PIP_LINES}; line++)); do
            printf 'fake pip: line %d\\n' "$line"
        done
        exit "${{FAKE_PIP_STATUS:-0}}"
        ;;
    *) exit 2 ;;
    esac
    ;;
*) exit 2 ;;
esac
"""


def writeProgram(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


class Machine:
    """
    A copy of the checkout's dev/bootstrap and setup.py, and a fresh Debian
    machine around it as far as the script can tell: nothing installed but
    Python, bash and coreutils.
    """

    def __init__(self, directory: Path) -> None:
        directory = directory.resolve()
        self.checkout = directory / "checkout"
        self.bin = directory / "bin"
        self.sysroot = directory / "sysroot"
        self.calls = directory / "calls"
        for made in (self.checkout / "dev", self.bin, self.sysroot, self.calls):
            made.mkdir(parents=True)
        shutil.copy2(BOOTSTRAP, self.checkout / "dev" / "bootstrap")
        shutil.copy2(ROOT / "setup.py", self.checkout / "setup.py")
        for name in REAL_COMMANDS:
            (self.bin / name).symlink_to(realCommand(name))
        writeProgram(self.bin / "apt-get", FAKE_APT_GET)
        writeProgram(self.bin / "sudo", FAKE_SUDO)
        writeProgram(self.bin / "id", FAKE_ID)
        writeProgram(self.bin / "dpkg", FAKE_DPKG)
        # Debian's own Python, without python3.11-venv.
        debianPython = self.sysroot / "usr" / "bin" / "python3.11"
        writeProgram(debianPython, FAKE_PYTHON)
        (self.bin / "python3").symlink_to(debianPython)

    @property
    def log(self) -> Path:
        return self.checkout / ".data" / "bootstrap.log"

    def provide(self, *names: str) -> None:
        """
        Make programs found on PATH, as if their packages were installed.
        """
        for name in names:
            writeProgram(self.bin / name, f"#!{BASH}\n")

    def providePostgres(self) -> None:
        """
        PostgreSQL's server programs where Debian's postgresql puts them.
        """
        for name in ("initdb", "pg_ctl"):
            writeProgram(self.sysroot / "usr/lib/postgresql/15/bin" / name, f"#!{BASH}\n")

    def provideEverything(self) -> None:
        """
        Every package installed and .venv up to date with setup.py.
        """
        self.providePostgres()
        self.provide("redis-server", "systemd-analyze", "curl")
        venv = self.checkout / ".venv"
        writeProgram(venv / "bin" / "python", FAKE_PYTHON)
        digest = hashlib.sha256((self.checkout / "setup.py").read_bytes()).hexdigest()
        (venv / ".setup.py.sha256").write_text(digest + "\n")

    def run(self, **fakes: str) -> subprocess.CompletedProcess[str]:
        """
        Run dev/bootstrap from the checkout's root without a terminal, with
        only our PATH and the fakes' settings in its environment.
        """
        environment = {
            "PATH": str(self.bin),
            "HOME": str(self.checkout.parent),
            "LC_ALL": "C",
            "DEV_BOOTSTRAP_SYSROOT": str(self.sysroot),
            "FAKE_CALLS": str(self.calls),
            **fakes,
        }
        return subprocess.run(
            [str(self.checkout / "dev" / "bootstrap")],
            cwd=self.checkout,
            env=environment,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def recorded(self, program: str) -> list[str]:
        """
        The argument lines a fake program was called with, in order.
        """
        path = self.calls / program
        return path.read_text().splitlines() if path.exists() else []

    def installed(self) -> list[str]:
        """
        The packages of every apt-get install.
        """
        packages = []
        for arguments in self.recorded("apt-get"):
            words = arguments.split()
            if "install" in words:
                packages += [word for word in words[words.index("install") + 1 :] if word[0] != "-"]
        return packages


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    return Machine(tmp_path)


def runHeaderCount(log: str) -> int:
    return len([line for line in log.splitlines() if line.startswith("=== ")])


def terminalLines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """
    What the script showed: nothing on stdout, and its own lines on stderr.
    """
    assert result.stdout == ""
    return result.stderr.splitlines()


def test_freshMachineShowsOneLinePerStep(machine: Machine) -> None:
    """
    On a fresh machine the three steps (Debian packages, .venv, pip) show
    one line each, apt-get's and pip's hundreds of lines go to the log, and
    the packages are what a fresh machine lacks.
    """
    result = machine.run()
    assert result.returncode == 0, result.stderr
    lines = terminalLines(result)
    assert len(lines) == 3, result.stderr
    assert all(line.startswith(PREFIX) for line in lines), result.stderr
    assert "fake" not in result.stderr
    assert sorted(machine.installed()) == sorted(
        ["postgresql", "redis-server", "systemd", "curl", "python3-venv", "python3.11-venv"]
    )
    assert machine.recorded("apt-get.frontend") == ["noninteractive", "noninteractive"]
    # As root: no sudo.
    assert machine.recorded("sudo") == []
    assert (machine.checkout / ".venv" / "bin" / "python").exists()
    [pipCall] = machine.recorded("pip")
    assert pipCall.startswith(f"{machine.checkout} -m pip install")
    assert "-e .[test]" in pipCall


def test_logKeepsEverythingWithAHeaderPerRunAndStep(machine: Machine) -> None:
    """
    .data/bootstrap.log keeps every line apt-get, venv and pip printed, on
    stdout and stderr, under a header line for the run and one per step; a
    second run that has something to do appends to it.
    """
    assert machine.run().returncode == 0
    log = machine.log.read_text()
    for verb in ("update", "install"):
        for line in (1, APT_LINES):
            assert f"fake apt-get {verb}: line {line}\n" in log
        assert f"fake apt-get {verb}: on stderr\n" in log
    assert "fake venv: made" in log
    assert f"fake pip: line {PIP_LINES}\n" in log
    assert runHeaderCount(log) == 1
    assert len([line for line in log.splitlines() if line.startswith("--- ")]) >= 3
    # The packages are there now (the fake apt-get installs nothing), and
    # setup.py changes: pip runs again, and the log grows.
    machine.providePostgres()
    machine.provide("redis-server", "systemd-analyze", "curl")
    with (machine.checkout / "setup.py").open("a") as setup:
        setup.write("# changed\n")
    result = machine.run()
    assert result.returncode == 0, result.stderr
    assert len(terminalLines(result)) == 1
    assert machine.log.read_text().startswith(log)
    assert runHeaderCount(machine.log.read_text()) == 2
    assert len(machine.recorded("pip")) == 2


@pytest.mark.parametrize("step", ["update", "install"])
def test_failingAptGetShowsTheLogsTail(machine: Machine, step: str) -> None:
    """
    When apt-get fails, the script exits non-zero and shows the last 20
    lines of the log (apt-get's own last words among them, not its first)
    and the log's path, and goes no further.
    """
    result = machine.run(FAKE_APT_FAILS=step)
    assert result.returncode != 0
    assert f"fake apt-get {step}: line {APT_LINES}" in result.stderr
    assert f"fake apt-get {step}: on stderr" in result.stderr
    assert f"fake apt-get {step}: line {APT_LINES - 30}\n" not in result.stderr
    assert str(machine.log) in result.stderr
    assert len(terminalLines(result)) <= 25
    assert machine.recorded("pip") == []


def test_failingPipShowsTheLogsTail(machine: Machine) -> None:
    """
    When pip fails, the script exits non-zero with pip's last lines and the
    log's path, and remembers nothing: the next run tries pip again.
    """
    machine.provideEverything()
    (machine.checkout / ".venv" / ".setup.py.sha256").unlink()
    result = machine.run(FAKE_PIP_STATUS="1")
    assert result.returncode != 0
    assert f"fake pip: line {PIP_LINES}" in result.stderr
    assert "fake pip: line 1\n" not in result.stderr
    assert ".data/bootstrap.log" in result.stderr
    assert not (machine.checkout / ".venv" / ".setup.py.sha256").exists()
    assert machine.run().returncode == 0
    assert len(machine.recorded("pip")) == 2


def test_curlIsInstalledWhenMissing(machine: Machine) -> None:
    """
    dev/gateway ends by printing a curl command: curl is installed when it
    is missing, and the line says why.
    """
    machine.provideEverything()
    (machine.bin / "curl").unlink()
    result = machine.run()
    assert result.returncode == 0, result.stderr
    assert machine.installed() == ["curl"]
    [line] = terminalLines(result)
    assert "curl" in line
    assert "dev/gateway" in line


def test_curlIsNotInstalledWhenPresent(machine: Machine) -> None:
    """
    Nothing is installed for curl when it is there already.
    """
    machine.provideEverything()
    (machine.bin / "systemd-analyze").unlink()
    assert machine.run().returncode == 0
    assert machine.installed() == ["systemd"]


def test_pipStepSaysWhatAndHowLong(machine: Machine) -> None:
    """
    The pip step, silent for most of a minute, says what it does, roughly
    how long it takes and where its output goes, which is not the terminal.
    """
    machine.provideEverything()
    (machine.checkout / ".venv" / ".setup.py.sha256").unlink()
    result = machine.run()
    assert result.returncode == 0, result.stderr
    [line] = terminalLines(result)
    assert "test dependencies" in line
    assert "pip" in line
    assert "minute" in line
    assert ".data/bootstrap.log" in line
    assert "fake pip" not in result.stderr
    assert f"fake pip: line {PIP_LINES}" in machine.log.read_text()


def test_serverPackagesLineSaysTheirServicesRunAtBoot(machine: Machine) -> None:
    """
    Installing postgresql and redis-server starts and enables their system
    services: the line says so and how to turn them off.
    """
    machine.provideEverything()
    (machine.bin / "redis-server").unlink()
    for name in ("initdb", "pg_ctl"):
        (machine.sysroot / "usr/lib/postgresql/15/bin" / name).unlink()
    result = machine.run()
    assert result.returncode == 0, result.stderr
    [line] = terminalLines(result)
    assert "boot" in line
    assert f"{DISABLE_SERVICES} postgresql redis-server" in line
    assert sorted(machine.installed()) == ["postgresql", "redis-server"]


def test_serviceNoteNamesOnlyWhatIsInstalled(machine: Machine) -> None:
    """
    With PostgreSQL there already, the note names redis-server alone; with
    neither server package installed, there is no note.
    """
    machine.provideEverything()
    (machine.bin / "redis-server").unlink()
    result = machine.run()
    assert result.returncode == 0, result.stderr
    assert f"{DISABLE_SERVICES} redis-server" in result.stderr
    assert "postgresql" not in result.stderr
    (machine.bin / "curl").unlink()
    machine.provide("redis-server")
    result = machine.run()
    assert result.returncode == 0, result.stderr
    assert "systemctl" not in result.stderr


def test_quietWhenNothingIsToDo(machine: Machine) -> None:
    """
    With everything in place the script says nothing, calls nothing, and
    writes no log.
    """
    machine.provideEverything()
    result = machine.run()
    assert result.returncode == 0, result.stderr
    assert terminalLines(result) == []
    assert machine.recorded("apt-get") == []
    assert machine.recorded("pip") == []
    assert not (machine.checkout / ".data").exists()


def test_sudoWithoutATerminalDoesNotAsk(machine: Machine) -> None:
    """
    Not root and without a terminal, apt-get runs through "sudo -n", which
    fails at once rather than waiting for a password.
    """
    machine.provideEverything()
    (machine.bin / "systemd-analyze").unlink()
    result = machine.run(FAKE_UID="1000")
    assert result.returncode == 0, result.stderr
    sudoCalls = machine.recorded("sudo")
    assert len(sudoCalls) == 2
    for call in sudoCalls:
        assert call.startswith("-n env DEBIAN_FRONTEND=noninteractive apt-get")


def test_notDebian(machine: Machine) -> None:
    """
    Without apt-get the script names what is missing and stops.
    """
    machine.provideEverything()
    (machine.bin / "systemd-analyze").unlink()
    (machine.bin / "apt-get").unlink()
    result = machine.run()
    assert result.returncode == 1
    assert "This is not a Debian-like system" in result.stderr
    assert "systemd" in result.stderr


def test_debianPythonWithVenvNeedsNoVenvPackages(machine: Machine) -> None:
    """
    python3-venv is installed only when Debian's Python lacks it.
    """
    machine.provideEverything()
    (machine.checkout / ".venv" / "bin" / "python").unlink()
    result = machine.run(FAKE_DPKG_INSTALLED="python3.11-venv")
    assert result.returncode == 0, result.stderr
    assert machine.installed() == []
    assert (machine.checkout / ".venv" / "bin" / "python").exists()


def test_readmeQuickStartSaysWhatBootstrapDoes() -> None:
    """
    The README's Quick start names curl among what dev/bootstrap installs,
    the log, and the services Debian enables at boot with how to turn them
    off.
    """
    readme = (ROOT / "README.rst").read_text()
    quickStart = readme.split("Quick start\n===========\n", 1)[1].split("\n=====", 1)[0]
    flat = " ".join(quickStart.split())
    assert "``curl``" in flat
    assert ".data/bootstrap.log" in flat
    assert "boot" in flat
    assert f"{DISABLE_SERVICES} postgresql redis-server" in flat
