"""
Where and how the files of a private PostgreSQL cluster (L{svcd.devkit.postgres})
are made: initdb, and for a cluster in memory the tmpfs it lives on and a
copy of one initdb made once (L{copyInitdb}).
"""

# Running initdb and cp is this module's purpose; every command is a fixed
# program with arguments we build, never a shell string.
# ruff: noqa: S603

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from svcd.devkit.servers import LOOPBACK, ServerError, logTail, processExists

# The system account that owns PostgreSQL's files on Debian. initdb and the
# postmaster refuse to run as root, so root runs them as this user.
POSTGRES_SYSTEM_USER = "postgres"

# Where a cluster asked to be in memory lives (L{PostgresServer.create}): a
# tmpfs. CREATE DATABASE writes a database's every file: on this machine's
# ext4 150 to 280 ms of system CPU a database, on tmpfs 10 to 20 ms.
MEMORY_DIRECTORY = Path("/dev/shm")  # noqa: S108

# The free room MEMORY_DIRECTORY must have for a cluster to go there: a
# cluster holds some 40 MB, its WAL up to max_wal_size more, and every
# database of it some 8 MB while it exists.
MEMORY_ROOM = 2 * 1024**3

# The file in a cluster's directory under MEMORY_DIRECTORY naming the
# process that made it: once that process is gone and no server runs
# there, a later create removes the directory, which would otherwise hold
# memory until the machine restarts (a run killed before its teardown).
OWNER_FILE = "owner.pid"

# The settings every cluster gets, after initdb's own: it is private and
# disposable, and speed matters more to tests than durability.
SETTINGS = (
    "\n# Added by svcd.devkit.postgres: a private, disposable server.\n"
    f"listen_addresses = '{LOOPBACK}'\n"
    "fsync = off\n"
    "synchronous_commit = off\n"
    "full_page_writes = off\n"
)

# The prefix of the directory under MEMORY_DIRECTORY holding the one initdb
# that clusters in memory copy; its key follows (L{copyInitdb}).
INITDB_PREFIX = "svc-postgres-initdb-"


def giveToPostgresUser(path: Path) -> None:
    """
    As root, make C{path} belong to the user that runs PostgreSQL.
    """
    if os.geteuid() == 0:
        account = pwd.getpwnam(POSTGRES_SYSTEM_USER)
        os.chown(path, account.pw_uid, account.pw_gid)


def hasRoom(directory: Path) -> bool:
    try:
        status = os.statvfs(directory)
    except OSError:
        return False
    return status.f_bavail * status.f_frsize >= MEMORY_ROOM


def removeAbandoned(directory: Path) -> None:
    """
    Remove the clusters under C{directory} whose maker (L{OWNER_FILE}) has
    exited and where no server runs: what a killed run left in memory.
    """
    for candidate in directory.glob("svc-postgres-*"):
        try:
            owner = int((candidate / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if processExists(owner):
            continue
        try:
            postmaster = int((candidate / "data" / "postmaster.pid").read_text().split("\n")[0])
        except (OSError, ValueError):
            postmaster = None
        if postmaster is None or not processExists(postmaster):
            shutil.rmtree(candidate, ignore_errors=True)


def runLogged(command: list[str], log: Path, timeout: float, cwd: Path | None = None) -> int:
    """
    Run one of PostgreSQL's programs (initdb, pg_basebackup, a copy) with
    no input and its output appended to C{log}, which the error raised on
    its failure quotes; its exit status.
    """
    with log.open("ab") as output:
        return subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            timeout=timeout,
            check=False,
        ).returncode


def initdb(
    binaries: Path, clusterDirectory: Path, runAs: list[str], log: Path, timeout: float
) -> None:
    """
    Run initdb into C{clusterDirectory/data} and add our settings.

    initdb writes into data.new, renamed once complete, so an interrupted
    initdb never leaves a directory that looks like a usable cluster.
    """
    incomplete = clusterDirectory / "data.new"
    for locale in ("C.UTF-8", "C"):
        shutil.rmtree(incomplete, ignore_errors=True)
        command = [
            *runAs,
            str(binaries / "initdb"),
            "-D",
            str(incomplete),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            f"--locale={locale}",
            "--no-sync",
        ]
        if runLogged(command, log, timeout * 4, cwd=clusterDirectory) == 0:
            break
    else:
        raise ServerError(f"initdb failed; the end of {log}:\n{logTail(log)}")
    with (incomplete / "postgresql.conf").open("a") as conf:
        conf.write(SETTINGS)
    incomplete.rename(clusterDirectory / "data")


def copyInitdb(
    binaries: Path, clusterDirectory: Path, runAs: list[str], log: Path, timeout: float
) -> None:
    """
    What L{initdb} makes, copied (as the user that runs PostgreSQL) from one
    initdb kept under L{MEMORY_DIRECTORY}, made first if there is none for
    these binaries and settings: initdb cost 0.5 s of CPU on tmpfs (0.8 to
    1.1 s on ext4), the copy 0.0x s, and the suite makes some 30 clusters.
    The copies share one system identifier, which only a streaming standby
    compares, and a standby is copied from its own primary anyway.
    """
    postgres = binaries / "postgres"
    key = hashlib.sha256(
        f"{postgres.resolve()}\0{postgres.stat().st_mtime_ns}\0{SETTINGS}".encode()
    ).hexdigest()[:16]
    kept = MEMORY_DIRECTORY / f"{INITDB_PREFIX}{key}"
    if kept.exists() and not _trusted(kept):
        initdb(binaries, clusterDirectory, runAs, log, timeout)
        return
    if not (kept / "data" / "PG_VERSION").is_file():
        # mkdtemp makes a fresh 0700 directory; the owner file lets a later
        # removeAbandoned take it if this process dies before the rename.
        building = Path(tempfile.mkdtemp(prefix="svc-postgres-building-", dir=MEMORY_DIRECTORY))
        (building / OWNER_FILE).write_text(f"{os.getpid()}\n")
        giveToPostgresUser(building)
        try:
            initdb(binaries, building, runAs, log, timeout)
            (building / OWNER_FILE).unlink()
            # Atomic: of two processes making it at once, the second finds
            # the name taken (a directory that is not empty) and uses it.
            building.rename(kept)
        except OSError:
            if not (kept / "data" / "PG_VERSION").is_file():
                raise
        finally:
            shutil.rmtree(building, ignore_errors=True)
    incomplete = clusterDirectory / "data.new"
    if runLogged([*runAs, "cp", "-a", str(kept / "data"), str(incomplete)], log, timeout) != 0:
        raise ServerError(f"copying {kept} failed; the end of {log}:\n{logTail(log)}")
    incomplete.rename(clusterDirectory / "data")


def _trusted(directory: Path) -> bool:
    """
    Whether C{directory}, at a name anyone may take in the shared tmpfs, was
    made by us (or the PostgreSQL user we run as) and only we may change it:
    a cluster copied from it runs what its configuration says.
    """
    status = directory.lstat()
    owners = {os.geteuid()}
    if os.geteuid() == 0:
        owners.add(pwd.getpwnam(POSTGRES_SYSTEM_USER).pw_uid)
    return directory.is_dir() and status.st_uid in owners and not status.st_mode & 0o022
