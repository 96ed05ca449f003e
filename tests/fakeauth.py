"""
Serving a stand-in AuthService servicer on a real grpcio server, for tests
of svc-proxy's gRPC link that script svc-auth's answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc

from svcd.auth.usage import keyOfRequestID
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc


@contextmanager
def servingAuth(servicer: auth_pb2_grpc.AuthServiceServicer, workers: int = 4) -> Iterator[int]:
    """
    Serve C{servicer} on 127.0.0.1 (a free port) for the duration of the
    block; yields the port.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    auth_pb2_grpc.add_AuthServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(0)


class LedgerAuth(auth_pb2_grpc.AuthServiceServicer):
    """
    A stand-in svc-auth for the usage ledger (decisions D12): it vouches for
    every token (one organization, the agent asked for) and keeps the rows
    of RecordUsage in C{rows} as they came, every field (kind and
    parent_request_id included, decisions D13), by their ledger key as the
    real one does (D12 amended): the ledger id, or for a row without one
    (a proxy older than the key) its request id, as
    L{svcd.auth.usage.keyOfRequestID} derives it. A row sent again as it
    was is a duplicate, recorded once; with other content it is rejected
    as a C{conflict}, and the row stays as first recorded. Requests that
    share a request id are each one row: L{rowsOf} finds them.

    Scripting, from the test's thread: C{failing} makes every RecordUsage
    answer UNAVAILABLE; C{failFirst} the next that many; C{hangFirst} makes
    the next that many calls take C{hangSeconds} before they commit (past
    the proxy's deadline: the proxy sends the batch again meanwhile).
    """

    def __init__(self, orgID: str = "0190c6a2-0000-7000-8000-00000000000a") -> None:
        self.orgID = orgID
        self.rows: dict[str, auth_pb2.UsageRow] = {}
        # Ledger keys in the order they were committed, duplicates left out.
        self.order: list[str] = []
        self.attempts = 0
        self.batches: list[int] = []
        self.failing = False
        self.failFirst = 0
        self.hangFirst = 0
        self.hangSeconds = 1.0
        self._lock = threading.Lock()

    def ValidateToken(self, request: Any, context: grpc.ServicerContext) -> Any:
        return auth_pb2.ValidateTokenResponse(
            org_id=self.orgID,
            permissions=1,
            token_id="0190c6a2-0000-7000-8000-0000000000b1",
        )

    def ValidateAgent(self, request: Any, context: grpc.ServicerContext) -> Any:
        return auth_pb2.ValidateAgentResponse(
            agent_id=request.agent_id, org_id=request.org_id, status="active"
        )

    def RecordUsage(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self.attempts += 1
            self.batches.append(len(request.rows))
            fail = self.failing or self.failFirst > 0
            if self.failFirst > 0:
                self.failFirst -= 1
            hang = not fail and self.hangFirst > 0
            if hang:
                self.hangFirst -= 1
        if fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the ledger's database is down")
        if hang:
            time.sleep(self.hangSeconds)
        recorded = duplicates = 0
        rejected = []
        with self._lock:
            for index, row in enumerate(request.rows):
                key = ledgerKey(row)
                stored = self.rows.get(key)
                if stored is None:
                    kept = auth_pb2.UsageRow()
                    kept.CopyFrom(row)
                    self.rows[key] = kept
                    self.order.append(key)
                    recorded += 1
                elif stored == row:
                    duplicates += 1
                else:
                    rejected.append(
                        auth_pb2.RejectedUsageRow(
                            index=index,
                            reason="conflict",
                            detail="ledger_id is recorded with other content",
                        )
                    )
        return auth_pb2.RecordUsageResponse(
            recorded=recorded, duplicates=duplicates, rejected=rejected
        )

    def recorded(self) -> list[str]:
        """
        The request ids of the rows recorded, in the order they were
        committed (a request id twice when two rows share it).
        """
        with self._lock:
            return [self.rows[key].request_id for key in self.order]

    def rowsOf(self, requestID: str) -> list[auth_pb2.UsageRow]:
        """
        The rows recorded with C{requestID} as their request id, in the
        order they were committed.
        """
        with self._lock:
            return [self.rows[key] for key in self.order if self.rows[key].request_id == requestID]

    def rowOf(self, requestID: str) -> auth_pb2.UsageRow:
        """
        The one row recorded with C{requestID}; an AssertionError when there
        is none or more than one.
        """
        found = self.rowsOf(requestID)
        assert len(found) == 1, f"{len(found)} rows of request {requestID!r}"
        return found[0]


def ledgerKey(row: auth_pb2.UsageRow) -> str:
    """
    The key svc-auth records C{row} under (decisions D12 amended): its
    ledger id, or for a row from a proxy older than the key its request id
    as L{keyOfRequestID} derives it.
    """
    return row.ledger_id.lower() if row.ledger_id else keyOfRequestID(row.request_id)
