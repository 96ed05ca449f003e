"""
Helpers of the svc-auth modules: running svcctl against a test's database
(L{svcctl}, L{document}, L{failure}), reading the change feed
(L{FeedReader}), validating tokens and agents over gRPC, a verifier that
counts its calls, and the usage records of the ledger tests.

Moved here from the test modules that first wrote them (test_svcctl,
test_auth_feed, test_auth_limits, test_auth_cache, test_auth_usage), so that
the modules that share them import a library rather than another test
module.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import forkedpython
import grpc
from authfixtures import Tenant
from authservice import RunningAuthService

from svcd.common.ids import uuid7Text
from svcd.pb.auth.v1 import auth_pb2


def svcctl(dsn: str | None, *arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "POSTGRES_DSN"}
    if dsn is not None:
        environment["POSTGRES_DSN"] = dsn
    # A process of its own forked from one that has svcctl's libraries
    # imported already (forkedpython.py says what stays as it was).
    return forkedpython.run(
        [sys.executable, "-m", "svcd.ctl", *arguments], env=environment, timeout=60
    )


def document(result: subprocess.CompletedProcess[str]) -> Any:
    """
    The one JSON document a successful command printed.
    """
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def failure(result: subprocess.CompletedProcess[str]) -> str:
    """
    The one stderr line of a failed command, which printed nothing on
    stdout.
    """
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


class StreamFailed(Exception):
    """
    The stream ended with an error status before its snapshot was read.
    """


class FeedReader:
    """
    A WatchChanges stream read on a thread of its own into a queue, so a
    test can wait for what it expects with a bounded deadline.
    """

    def __init__(self, service: RunningAuthService) -> None:
        self.call: Any = service.stub.WatchChanges(auth_pb2.WatchChangesRequest(), timeout=60)
        self.changes: queue.Queue[auth_pb2.Change | grpc.RpcError | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for change in self.call:
                self.changes.put(change)
        except grpc.RpcError as error:
            self.changes.put(error)
            return
        self.changes.put(None)

    def next(self, limit: float = 5.0) -> auth_pb2.Change | grpc.RpcError | None:
        return self.changes.get(timeout=limit)

    def snapshot(self) -> set[uuid.UUID]:
        """
        Read the snapshot at the start of the stream: the token ids, which
        it returns, then every limits row, budget and memory settings row,
        kept in C{limits}, C{budgets} and C{memorySettings}.
        """
        ids: set[uuid.UUID] = set()
        self.limits: dict[tuple[bytes, bytes], auth_pb2.Limits] = {}
        self.budgets: dict[tuple[bytes, bytes], auth_pb2.Budget] = {}
        self.memorySettings: dict[tuple[bytes, bytes], auth_pb2.MemorySettings] = {}
        while True:
            change = self.next()
            if isinstance(change, grpc.RpcError):
                raise StreamFailed(change.code())
            assert isinstance(change, auth_pb2.Change), change
            kind = change.WhichOneof("kind")
            if kind == "snapshot_complete":
                assert change.snapshot_complete.token_count == len(ids)
                return ids
            if kind == "limits_changed":
                row = change.limits_changed
                assert row.HasField("limits")
                self.limits[(row.org_id, row.agent_id)] = row.limits
                continue
            if kind == "budget_changed":
                budget = change.budget_changed
                assert budget.HasField("budget")
                self.budgets[(budget.org_id, budget.agent_id)] = budget.budget
                continue
            if kind == "memory_settings_changed":
                settings = change.memory_settings_changed
                assert settings.HasField("settings")
                self.memorySettings[(settings.org_id, settings.agent_id)] = settings.settings
                continue
            assert kind == "known_token_ids", kind
            assert not self.limits, "token ids after limits rows"
            assert not self.budgets, "token ids after budgets"
            assert not self.memorySettings, "token ids after memory settings"
            raw = change.known_token_ids
            ids.update(uuid.UUID(bytes=raw[at : at + 16]) for at in range(0, len(raw), 16))

    def waitFor(self, kind: str, value: object = None, limit: float = 1.0) -> float:
        """
        Read until a change of C{kind} (with C{value}) arrives; return how
        long that took, or fail after C{limit} seconds.
        """
        started = time.monotonic()
        while True:
            remaining = limit - (time.monotonic() - started)
            assert remaining > 0, f"no {kind} within {limit}s"
            try:
                change = self.next(remaining)
            except queue.Empty:
                continue
            assert isinstance(change, auth_pb2.Change), change
            if change.WhichOneof("kind") == kind and (
                value is None or getattr(change, kind) == value
            ):
                return time.monotonic() - started

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(5)


def validateToken(service: RunningAuthService, tenant: Tenant) -> auth_pb2.ValidateTokenResponse:
    return cast(
        auth_pb2.ValidateTokenResponse,
        service.call("ValidateToken", auth_pb2.ValidateTokenRequest(access_token=tenant.token)),
    )


def validateAgent(service: RunningAuthService, tenant: Tenant) -> auth_pb2.ValidateAgentResponse:
    return cast(
        auth_pb2.ValidateAgentResponse,
        service.call(
            "ValidateAgent",
            auth_pb2.ValidateAgentRequest(agent_id=str(tenant.agentID), org_id=str(tenant.orgID)),
            bearer=tenant.token,
        ),
    )


class CountingVerifier:
    """
    Wraps svcd.auth.authority.verifySecret to count argon2 verifications
    and how many ran at once.
    """

    def __init__(
        self,
        real: Callable[[str, str], bool],
        delay: float = 0.0,
        gate: threading.Event | None = None,
    ) -> None:
        self._real = real
        self._delay = delay
        self._gate = gate
        self._lock = threading.Lock()
        self.calls = 0
        self.running = 0
        self.mostAtOnce = 0

    def __call__(self, storedHash: str, secret: str) -> bool:
        with self._lock:
            self.calls += 1
            self.running += 1
            self.mostAtOnce = max(self.mostAtOnce, self.running)
        try:
            if self._delay:
                time.sleep(self._delay)
            if self._gate is not None:
                # Held until the test opens the gate (bounded, so a broken
                # test cannot hang the run).
                self._gate.wait(10)
            return self._real(storedHash, secret)
        finally:
            with self._lock:
                self.running -= 1


UTC = datetime.UTC


JUNE = datetime.datetime(2025, 6, 1, tzinfo=UTC)


def microseconds(moment: datetime.datetime) -> int:
    return int(moment.timestamp()) * 10**6 + moment.microsecond


def usageRow(tenant: Tenant, **changes: Any) -> auth_pb2.UsageRow:
    """
    A well-formed row of C{tenant}'s agent and token, with C{changes}.
    """
    fields: dict[str, Any] = {
        "ledger_id": uuid7Text(),
        "request_id": str(uuid.uuid4()),
        "org_id": str(tenant.orgID),
        "agent_id": str(tenant.agentID),
        "token_id": str(tenant.tokenID),
        "model_requested": "fast",
        "model": "fast",
        "provider": "local",
        "upstream_model": "llama-3.1-8b",
        "stream": False,
        "outcome": "ok",
        "prompt_tokens": 100,
        "cached_tokens": 10,
        "completion_tokens": 50,
        "reasoning_tokens": 5,
        "tokens_from": "provider",
        "cost_nano_usd": 1_234_567,
        "price_version": "0123456789abcdef",
        "started_at_us": microseconds(JUNE + datetime.timedelta(hours=1)),
        "duration_us": 250_000,
    }
    fields.update(changes)
    return auth_pb2.UsageRow(**fields)


def record(service: RunningAuthService, rows: list[auth_pb2.UsageRow]) -> tuple[int, int]:
    """
    Record C{rows}, none of which may be rejected: (recorded, duplicates).
    """
    answer = service.call("RecordUsage", auth_pb2.RecordUsageRequest(rows=rows))
    assert list(answer.rejected) == []
    return answer.recorded, answer.duplicates


def recordAnswer(
    service: RunningAuthService, rows: list[auth_pb2.UsageRow]
) -> tuple[int, int, list[tuple[int, str, str]]]:
    """
    Record C{rows}: (recorded, duplicates, [(index, reason, detail)] of the
    rejected rows).
    """
    answer = service.call("RecordUsage", auth_pb2.RecordUsageRequest(rows=rows))
    rejected = [(each.index, each.reason, each.detail) for each in answer.rejected]
    assert answer.recorded + answer.duplicates + len(rejected) == len(rows)
    return answer.recorded, answer.duplicates, rejected
