"""
The usage ledger's way out of a real C{twistd -n svc-proxy} (decisions
D12): with a providers file (a scripted upstream) and a stand-in svc-auth
whose RecordUsage keeps rows by ledger key (L{LedgerAuth}), each answered
request's row reaches svc-auth; rows still waiting at SIGTERM are sent
before the proxy exits; and with SVC_USAGE_JOURNAL, rows a kill -9 left
unacknowledged are sent by the next start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fakeauth import LedgerAuth, servingAuth
from proxydoubles import newToken

from svcd.devkit.daemons import Daemon, twistdCommand
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.ledger.journal import Journal
from svcd.pb.auth.v1 import auth_pb2

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

# Bounds on waits for what the proxy does on its own: far above what it
# takes, a guard against a hang on a loaded machine.
WAIT = 30.0


@pytest.fixture
def ledgerAuth() -> Iterator[tuple[LedgerAuth, int]]:
    servicer = LedgerAuth()
    with servingAuth(servicer) as port:
        yield servicer, port


def proxyEnvironment(
    tmp_path: Path, upstream: ScriptedUpstream, grpcPort: int, **overrides: str
) -> dict[str, str]:
    providers = tmp_path / "providers.toml"
    providers.write_text(
        f'[[providers]]\nname = "scripted"\nbase_url = "{upstream.baseURL}"\n'
        '\n[[models]]\nname = "echo"\nprovider = "scripted"\n'
    )
    return {
        "SVC_HOST": "127.0.0.1",
        "SVC_PORT": str(freePort()),
        "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{grpcPort}",
        "SVC_PROVIDERS_FILE": str(providers),
        # The stand-in has no change feed: validate every request.
        "SVC_AUTH_CACHE_SIZE": "0",
        "SVC_AUTH_VALIDATE_TIMEOUT": "5s",
        "SVC_START_TIMEOUT": "30s",
        "SVC_SHUTDOWN_TIMEOUT": "10s",
        **overrides,
    }


def chat(daemon: Daemon, requestID: str | None = None) -> str:
    """
    One answered chat request (with C{requestID} as its X-Request-ID, when
    given); its request id.
    """
    request = urllib.request.Request(
        daemon.url("/v1/chat/completions"),
        data=json.dumps(
            {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
        ).encode(),
        headers={
            "Authorization": "Bearer " + newToken(),
            "X-SVC-Agent-ID": str(uuid.uuid4()),
            "Content-Type": "application/json",
            **({"X-Request-ID": requestID} if requestID else {}),
        },
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=WAIT) as answer:
        assert answer.status == 200
        answer.read()
        return str(answer.headers["X-Request-ID"])


def waitUntil(
    condition: Callable[[], bool], what: str, daemon: Daemon, limit: float = WAIT
) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {limit} s; {daemon.describe()}"
        time.sleep(0.02)


def test_answeredRequestsReachTheLedger(
    ledgerAuth: tuple[LedgerAuth, int], scriptedUpstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """
    Each answered request's row reaches svc-auth once, in order, with what
    the request was: its org, agent, model and provider, ok, the
    provider's tokens.
    """
    servicer, grpcPort = ledgerAuth
    proxy = Daemon(
        "svc-proxy", proxyEnvironment(tmp_path, scriptedUpstream, grpcPort), tmp_path / "p.log"
    ).start()
    try:
        proxy.waitForHealth()
        requestIDs = [chat(proxy) for _ in range(3)]
        waitUntil(lambda: servicer.recorded() == requestIDs, "the rows at svc-auth", proxy)
        row = servicer.rowOf(requestIDs[0])
        assert (row.org_id, row.model, row.provider, row.outcome) == (
            servicer.orgID,
            "echo",
            "scripted",
            "ok",
        )
        assert row.tokens_from == "provider" and row.prompt_tokens > 0
    finally:
        assert proxy.terminate() == 0
    assert "usage row(s) not acknowledged" not in proxy.output()


def test_sigtermSendsTheWaitingRows(
    ledgerAuth: tuple[LedgerAuth, int], scriptedUpstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """
    Rows waiting (svc-auth failing RecordUsage) when SIGTERM arrives are
    sent during the graceful stop, once svc-auth takes them again, before
    the proxy exits 0.
    """
    servicer, grpcPort = ledgerAuth
    servicer.failing = True
    proxy = Daemon(
        "svc-proxy", proxyEnvironment(tmp_path, scriptedUpstream, grpcPort), tmp_path / "p.log"
    ).start()
    try:
        proxy.waitForHealth()
        requestIDs = [chat(proxy) for _ in range(3)]
        waitUntil(lambda: servicer.attempts >= 1, "a RecordUsage attempt", proxy)
        proxy.signal(signal.SIGTERM)
        waitUntil(
            lambda: "usage row(s) to svc-auth before stopping" in proxy.output(), "flush", proxy
        )
        servicer.failing = False
        assert proxy.process is not None
        assert proxy.process.wait(WAIT) == 0
    finally:
        proxy.terminate()
    assert servicer.recorded() == requestIDs
    assert "usage row(s) not acknowledged" not in proxy.output()


def test_killedProxyResendsFromItsJournal(
    ledgerAuth: tuple[LedgerAuth, int], scriptedUpstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """
    With SVC_USAGE_JOURNAL, rows answered but not acknowledged when the
    proxy is killed (kill -9) are sent by the next start, once each.
    """
    servicer, grpcPort = ledgerAuth
    servicer.failing = True
    journal = tmp_path / "usage.journal"
    environment = proxyEnvironment(
        tmp_path, scriptedUpstream, grpcPort, SVC_USAGE_JOURNAL=str(journal)
    )
    proxy = Daemon("svc-proxy", environment, tmp_path / "first.log").start()
    try:
        proxy.waitForHealth()
        requestIDs = [chat(proxy) for _ in range(3)]
        # Journalled before the answer's end is recorded anywhere else.
        waitUntil(
            lambda: all(each.encode() in journal.read_bytes() for each in requestIDs),
            "the rows in the journal",
            proxy,
        )
        proxy.signal(signal.SIGKILL)
        assert proxy.process is not None
        assert proxy.process.wait(WAIT) == -signal.SIGKILL
    finally:
        proxy.terminate()
    assert servicer.recorded() == []

    servicer.failing = False
    again = Daemon("svc-proxy", environment, tmp_path / "second.log").start()
    try:
        waitUntil(lambda: servicer.recorded() == requestIDs, "the rows at svc-auth", again)
        again.waitForHealth()
    finally:
        assert again.terminate() == 0
    assert "3 usage row(s) not acknowledged by svc-auth; sending them first" in again.output()
    assert servicer.recorded() == requestIDs


def test_aSecondProxyWithTheSameJournalRefusesToStart(
    ledgerAuth: tuple[LedgerAuth, int], scriptedUpstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """
    Only one process may hold a journal: with one svc-proxy running on
    SVC_USAGE_JOURNAL, a second one naming the same file (another port)
    exits 1 with one line naming it, and the first goes on recording.
    """
    servicer, grpcPort = ledgerAuth
    journal = tmp_path / "usage.journal"
    environment = proxyEnvironment(
        tmp_path, scriptedUpstream, grpcPort, SVC_USAGE_JOURNAL=str(journal)
    )
    first = Daemon("svc-proxy", environment, tmp_path / "first.log").start()
    try:
        first.waitForHealth()
        variables = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("SVC_", "REDIS"))
        }
        second = subprocess.run(
            twistdCommand("svc-proxy"),
            env={**variables, **environment, "SVC_PORT": str(freePort())},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            check=False,
        )
        assert second.returncode == 1, second.stderr
        [line] = [each for each in second.stderr.splitlines() if "cannot start" in each]
        assert line.startswith("svc-proxy: cannot start: ")
        assert repr(str(journal)) in line and "held by another process" in line
        assert "Traceback" not in second.stderr + second.stdout
        requestID = chat(first)
        waitUntil(lambda: servicer.recorded() == [requestID], "the row at svc-auth", first)
    finally:
        assert first.terminate() == 0


class RefusingAuth(LedgerAuth):
    """
    svc-auth with per-row rejects (issue 28): the rows of the request ids
    in C{refuse} are listed as rejected ("invalid"); C{refused} counts how
    often it saw them.
    """

    def __init__(self, refuse: set[str]) -> None:
        super().__init__()
        self.refuse = refuse
        self.refused = 0

    def RecordUsage(self, request: Any, context: grpc.ServicerContext) -> Any:
        bad = [index for index, each in enumerate(request.rows) if each.request_id in self.refuse]
        self.refused += len(bad)
        good = auth_pb2.RecordUsageRequest(
            rows=[each for index, each in enumerate(request.rows) if index not in bad]
        )
        response = super().RecordUsage(good, context)
        response.rejected.extend(
            auth_pb2.RejectedUsageRow(index=index, reason="invalid", detail="refused by the test")
            for index in bad
        )
        return response


def test_aRejectedRowIsSetAsideAndNeverSentAgain(
    scriptedUpstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """
    A row svc-auth rejects does not hold up the others: they are recorded,
    it is in <journal>.rejects, and after a kill -9 and a restart it is not
    sent again from the journal.
    """
    refused = str(uuid.uuid4())
    servicer = RefusingAuth({refused})
    journal = tmp_path / "usage.journal"
    with servingAuth(servicer) as grpcPort:
        environment = proxyEnvironment(
            tmp_path, scriptedUpstream, grpcPort, SVC_USAGE_JOURNAL=str(journal)
        )
        proxy = Daemon("svc-proxy", environment, tmp_path / "first.log").start()
        try:
            proxy.waitForHealth()
            first = chat(proxy)
            assert chat(proxy, requestID=refused) == refused
            last = chat(proxy)
            waitUntil(lambda: servicer.recorded() == [first, last], "the good rows", proxy)
            # Every row acknowledged in the journal before the kill.
            waitUntil(
                lambda: Journal(str(journal))._replay(journal.read_bytes()) == [],
                "the acknowledgements in the journal",
                proxy,
            )
            proxy.signal(signal.SIGKILL)
            assert proxy.process is not None
            assert proxy.process.wait(WAIT) == -signal.SIGKILL
        finally:
            proxy.terminate()
        [line] = (tmp_path / "usage.journal.rejects").read_text().splitlines()
        rejected = json.loads(line)
        assert rejected["row"]["request_id"] == refused
        assert (rejected["reason"], rejected["detail"]) == ("invalid", "refused by the test")
        assert "rejected usage row" in proxy.output() and "refused by the test" in proxy.output()

        again = Daemon("svc-proxy", environment, tmp_path / "second.log").start()
        try:
            again.waitForHealth()
            another = chat(again)
            waitUntil(lambda: servicer.recorded() == [first, last, another], "the next row", again)
        finally:
            assert again.terminate() == 0
    assert servicer.refused == 1
    assert "sending them first" not in again.output()
