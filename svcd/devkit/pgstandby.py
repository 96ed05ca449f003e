"""
A primary and a streaming standby (L{StreamingPair}) of private PostgreSQL
servers (L{svcd.devkit.postgres}), for the tests of a failover (decisions
D16): the standby copied from the primary with C{pg_basebackup -R},
streaming, synchronous unless asked otherwise; then the primary killed and
the standby promoted, as a failover manager (Patroni, pg_auto_failover, a
cloud's) would after a crash.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from svcd.devkit.postgres import PostgresServer
from svcd.devkit.servers import DEFAULT_TIMEOUT, LOOPBACK, ServerError, waitUntil


class StreamingPair:
    """
    Two servers: C{primary}, and C{standby} streaming its changes.

    Replication is synchronous by default (the primary's
    C{synchronous_standby_names} is C{'*'} and its C{synchronous_commit}
    on): a commit returns once the standby has the transaction, so that
    nothing a daemon acknowledged is lost when the primary dies, which is
    what svc promises only with such a standby (with an asynchronous one
    the last transactions before a crash may be missing on the new
    primary). The setting is the primary's own (ALTER SYSTEM after the
    copy), so the standby, promoted, waits for no standby of its own.
    """

    def __init__(self, primary: PostgresServer, standby: PostgresServer) -> None:
        self.primary = primary
        self.standby = standby

    @classmethod
    def start(
        cls,
        baseDirectory: Path,
        synchronous: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        inMemory: bool = False,
    ) -> StreamingPair:
        """
        Make both servers under C{baseDirectory} (C{primary/}, C{standby/})
        and return once the standby streams (and is the synchronous one,
        when C{synchronous}). With C{inMemory}, both clusters' files are on
        a tmpfs (L{PostgresServer.create}), as the tests want.

        @raise svcd.devkit.servers.MissingBinaries: PostgreSQL's server
            programs or pg_basebackup are not installed.
        @raise ServerError: a server did not start, or the standby did not
            stream within C{timeout}.
        """
        primary = PostgresServer.create(
            baseDirectory / "primary", timeout=timeout, inMemory=inMemory
        )
        standby: PostgresServer | None = None
        try:
            primary.start(timeout)
            standby = primary.makeStandby(baseDirectory / "standby", timeout)
            pair = cls(primary, standby)
            standby.start(timeout)
            pair.waitUntilStreaming(timeout)
            if synchronous:
                primary.alterSystem({"synchronous_standby_names": "*", "synchronous_commit": "on"})
                pair.waitUntilStreaming(timeout, synchronous=True)
        except BaseException:
            if standby is not None:
                standby.destroy()
            primary.destroy()
            raise
        return pair

    def waitUntilStreaming(self, timeout: float, synchronous: bool = False) -> None:
        """
        Wait until the primary's pg_stat_replication shows the standby
        streaming (and synchronous, if asked).
        """

        def streaming() -> bool:
            with self.primary.connect() as connection:
                rows = connection.execute(
                    "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'"
                ).fetchall()
            return any(not synchronous or row[0] == "sync" for row in rows)

        if not waitUntil(streaming, timeout, interval=0.05):
            raise ServerError(
                f"the standby on port {self.standby.port} did not stream from port "
                f"{self.primary.port} within {timeout:.0f} s"
            )

    def dsn(self, dbname: str, user: str = "postgres") -> str:
        """
        A libpq URI naming both servers, the primary first, which connects
        to whichever takes writes (C{target_session_attrs=read-write}).
        """
        hosts = ",".join(f"{LOOPBACK}:{server.port}" for server in (self.primary, self.standby))
        return (
            f"postgresql://{quote(user, safe='')}@{hosts}/{quote(dbname, safe='')}"
            "?target_session_attrs=read-write"
        )

    def failOver(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """
        Kill the primary (SIGKILL, every process: a crash) and promote the
        standby; return once it takes writes.
        """
        self.primary.kill()
        self.standby.promote(timeout)

    def destroy(self) -> None:
        """
        Stop both servers and remove their directories, whatever state
        they are in.
        """
        try:
            self.standby.destroy()
        finally:
            self.primary.destroy()
