"""
The committed generated modules match proto/.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generatedModulesAreUpToDate() -> None:
    """
    Regenerating from proto/ with the pinned grpcio-tools gives exactly the
    committed svcd/pb modules; otherwise someone edited the .proto without
    running tools/genproto.py.
    """
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "genproto.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_serviceIsDeclaredInPackageSvcAuthV1() -> None:
    """
    Clients address the service as svc.auth.v1.AuthService with the five
    methods of the spec, plus the change feed of decisions D8, a
    server-streaming method, and the ledger's methods of decisions D12.
    """
    from svcd.pb.auth.v1 import auth_pb2

    service = auth_pb2.DESCRIPTOR.services_by_name["AuthService"]
    assert service.full_name == "svc.auth.v1.AuthService"
    assert {method.name for method in service.methods} == {
        "ValidateToken",
        "ValidateAgent",
        "CreateToken",
        "RevokeToken",
        "ListTokens",
        "WatchChanges",
        "RecordUsage",
        "GetSpend",
        "GetUsage",
    }
    streaming = {method.name for method in service.methods if method.server_streaming}
    assert streaming == {"WatchChanges"}
    request = auth_pb2.ValidateTokenRequest.DESCRIPTOR
    assert [field.name for field in request.fields] == ["access_token"]


def test_memoryServiceIsDeclaredInPackageSvcMemoryV1() -> None:
    """
    svc-memory's service is svc.memory.v1.MemoryService (decisions D13),
    every method unary.
    """
    from svcd.pb.memory.v1 import memory_pb2

    service = memory_pb2.DESCRIPTOR.services_by_name["MemoryService"]
    assert service.full_name == "svc.memory.v1.MemoryService"
    assert {method.name for method in service.methods} == {
        "AddMemory",
        "GetMemory",
        "ListMemories",
        "UpdateMemory",
        "DeleteMemory",
        "DeleteScope",
        "Search",
        "SearchMany",
        "QueueObservations",
        "ClaimObservations",
        "CompleteObservation",
        "ReleaseObservation",
        "RenewObservationLease",
        "StoreObservation",
    }
    assert not any(m.server_streaming or m.client_streaming for m in service.methods)
