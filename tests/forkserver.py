"""
The part of a fork server both tests/forkedpython.py (svcctl's commands)
and tests/forkedtwistd.py (the daemons) share: the server process, started
with the libraries it preloads and the code that forks what it is asked,
the address a request is sent to, and the pipe whose closing tells it to
leave with the pytest process that started it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path


class ForkServer:
    """
    One fork server: C{code} run by this interpreter (C{python -c}) with
    the listening socket's descriptor, the pipe's, the address and the
    names of C{preloaded} as its arguments, in C{environment}.
    """

    def __init__(
        self, prefix: str, code: str, preloaded: Sequence[str], environment: dict[str, str]
    ) -> None:
        self.address = str(Path(tempfile.mkdtemp(prefix=prefix)) / "server")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.address)
        listener.listen(64)
        # The server leaves once this end is closed, with this process.
        gone, self._alive = os.pipe()
        self.environment = environment
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                str(listener.fileno()),
                str(gone),
                self.address,
                *preloaded,
            ],
            pass_fds=(listener.fileno(), gone),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=environment,
        )
        listener.close()
        os.close(gone)
        self.pid = os.getpid()

    def usable(self) -> bool:
        """
        Whether this process started the server and it still runs (a
        forked pytest process, or a server that died, needs a new one).
        """
        return self.pid == os.getpid() and self.process.poll() is None

    def connection(self) -> socket.socket:
        """
        A new connection to the server, one per process it is to fork.
        """
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            connection.connect(self.address)
        except BaseException:
            connection.close()
            raise
        return connection

    def close(self) -> None:
        """
        Stop the server (it leaves when this end of its pipe closes, and
        removes its address).
        """
        os.close(self._alive)
        self.process.wait(10)
