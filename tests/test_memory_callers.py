"""
Who may call which of svc-memory's methods (svcd/memory/callers.py;
decisions D13, amended: "Internal methods by caller"): with mutual TLS the
worker's methods (claim, renew, store, release, complete observations)
answer only the certificates SVC_GRPC_WORKER_SUBJECTS names, the others
only those of SVC_GRPC_INTERNAL_SUBJECTS; against a real grpcio server with
real certificates (trustme), and the configuration's rules, down to the
daemon that refuses to start.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import attrs
import grpc
import pytest
import trustme
from authfixtures import Tenant
from memoryservice import RunningMemoryService

from svcd.common.config import ConfigError
from svcd.common.grpcserver import ServerTLS
from svcd.devkit.daemons import Daemon, memoryEnvironment, twistdCommand
from svcd.memory.callers import WORKER_METHODS
from svcd.memory.config import MemoryConfig
from svcd.memory.grpcservice import METHODS
from svcd.pb.memory.v1 import memory_pb2, memory_pb2_grpc

PROXY_NAME = "svc-proxy.internal"
WORKER_NAME = "svc-worker.internal"


@attrs.frozen
class Certificates:
    ca: bytes
    server: tuple[bytes, bytes]
    proxy: tuple[bytes, bytes]
    worker: tuple[bytes, bytes]


@pytest.fixture(scope="module")
def certificates() -> Certificates:
    ca = trustme.CA()

    def issued(*names: str) -> tuple[bytes, bytes]:
        made = ca.issue_cert(*names)
        return made.cert_chain_pems[0].bytes(), made.private_key_pem.bytes()

    return Certificates(
        ca=ca.cert_pem.bytes(),
        server=issued("127.0.0.1", "localhost"),
        proxy=issued(PROXY_NAME),
        worker=issued(WORKER_NAME),
    )


@pytest.fixture
def mutualService(migratedDSN: str, certificates: Certificates) -> Iterator[RunningMemoryService]:
    service = RunningMemoryService(
        migratedDSN,
        tls=ServerTLS(
            certificate=certificates.server[0],
            privateKey=certificates.server[1],
            clientCA=certificates.ca,
        ),
        internalSubjects=frozenset({PROXY_NAME}),
        workerSubjects=frozenset({WORKER_NAME}),
    ).start()
    try:
        yield service
    finally:
        service.stop()


def stubOf(
    service: RunningMemoryService, certificates: Certificates, client: tuple[bytes, bytes]
) -> tuple[grpc.Channel, memory_pb2_grpc.MemoryServiceStub]:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=certificates.ca, private_key=client[1], certificate_chain=client[0]
    )
    channel = grpc.secure_channel(service.address, credentials)
    return channel, memory_pb2_grpc.MemoryServiceStub(channel)


def test_theWorkersMethodsAreTheOnesThatClaimRenewStoreOrRelease() -> None:
    """
    The worker's methods are exactly those that claim, renew, store,
    release or complete observations, all of them MemoryService's.
    """
    assert set(WORKER_METHODS) == {
        "ClaimObservations",
        "RenewObservationLease",
        "StoreObservation",
        "ReleaseObservation",
        "CompleteObservation",
    }
    assert set(WORKER_METHODS) <= set(METHODS)


def test_eachCertificateCallsOnlyItsOwnMethods(
    mutualService: RunningMemoryService, certificates: Certificates, acme: Tenant
) -> None:
    """
    A proxy's certificate (named in SVC_GRPC_INTERNAL_SUBJECTS) queues and
    searches but is PERMISSION_DENIED on ClaimObservations and the other
    worker's methods, so it cannot read another organization's queued
    conversations; a worker's certificate (SVC_GRPC_WORKER_SUBJECTS) claims
    and completes but is PERMISSION_DENIED on Search and QueueObservations.
    Each refusal names the list to change, and is counted by method.
    """
    scope = memory_pb2.Scope(org_id=str(acme.orgID), agent_id=str(acme.agentID), subject="u")
    proxyChannel, proxy = stubOf(mutualService, certificates, certificates.proxy)
    workerChannel, worker = stubOf(mutualService, certificates, certificates.worker)
    with proxyChannel, workerChannel:
        proxy.QueueObservations(
            memory_pb2.QueueObservationsRequest(
                observations=[
                    memory_pb2.Observation(
                        scope=scope,
                        request_id="req-1",
                        messages=[memory_pb2.ObservedMessage(role="user", content="I sail.")],
                    )
                ]
            ),
            timeout=10,
        )
        search = memory_pb2.SearchRequest(scope=scope, mode="text", text="sail", k=1)
        assert list(proxy.Search(search, timeout=10).results) == []
        claim = memory_pb2.ClaimObservationsRequest(owner="w", limit=10, lease_seconds=60)
        refusals = []
        for call in (
            lambda: proxy.ClaimObservations(claim, timeout=10),
            lambda: proxy.CompleteObservation(
                memory_pb2.CompleteObservationRequest(
                    org_id=str(acme.orgID), id=str(acme.agentID), owner="w"
                ),
                timeout=10,
            ),
            lambda: worker.Search(search, timeout=10),
            lambda: worker.QueueObservations(
                memory_pb2.QueueObservationsRequest(observations=[]), timeout=10
            ),
        ):
            with pytest.raises(grpc.RpcError) as raised:
                call()
            refusals.append((raised.value.code(), raised.value.details()))
        assert [code for code, _ in refusals] == [grpc.StatusCode.PERMISSION_DENIED] * 4
        assert all("SVC_GRPC_WORKER_SUBJECTS" in details for _, details in refusals[:2])
        assert all("SVC_GRPC_INTERNAL_SUBJECTS" in details for _, details in refusals[2:])
        [held] = worker.ClaimObservations(claim, timeout=10).observations
        assert held.request_id == "req-1"
        completed = worker.CompleteObservation(
            memory_pb2.CompleteObservationRequest(
                org_id=str(acme.orgID), id=held.id, owner="w", lease_token=held.lease_token
            ),
            timeout=10,
        )
        assert completed.completed
    denied = {
        method: mutualService.registry.get_sample_value(
            "svc_memory_internal_calls_denied_total", {"method": method}
        )
        for method in ("ClaimObservations", "CompleteObservation", "Search", "QueueObservations")
    }
    assert denied == dict.fromkeys(denied, 1.0)


@pytest.fixture(scope="module")
def pemFiles(
    tmp_path_factory: pytest.TempPathFactory, certificates: Certificates
) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("pems")
    paths = {name: directory / f"{name}.pem" for name in ("cert", "key", "ca")}
    paths["cert"].write_bytes(certificates.server[0])
    paths["key"].write_bytes(certificates.server[1])
    paths["ca"].write_bytes(certificates.ca)
    return {name: str(path) for name, path in paths.items()}


def environment(
    pems: dict[str, str], clientCA: bool, internal: str | None, worker: str | None
) -> dict[str, str]:
    variables = {
        "POSTGRES_DSN": "host=127.0.0.1",
        "SVC_GRPC_TLS_CERT": pems["cert"],
        "SVC_GRPC_TLS_KEY": pems["key"],
    }
    if clientCA:
        variables["SVC_GRPC_TLS_CLIENT_CA"] = pems["ca"]
    if internal is not None:
        variables["SVC_GRPC_INTERNAL_SUBJECTS"] = internal
    if worker is not None:
        variables["SVC_GRPC_WORKER_SUBJECTS"] = worker
    return variables


def test_workerSubjectsGoWithMutualTLS(pemFiles: dict[str, str]) -> None:
    """
    With a client CA, SVC_GRPC_WORKER_SUBJECTS is required as
    SVC_GRPC_INTERNAL_SUBJECTS is (unset, the rolling upgrade stops at the
    first replica rather than keep every proxy able to claim, or deny
    every worker); without one it is refused (no certificate to check);
    without TLS neither is read and every method answers as before.
    """
    settings = MemoryConfig.fromEnvironment(
        environment(pemFiles, True, PROXY_NAME, f"{WORKER_NAME}, w2")
    )
    assert settings.internalSubjects == frozenset({PROXY_NAME})
    assert settings.workerSubjects == frozenset({WORKER_NAME, "w2"})
    plain = MemoryConfig.fromEnvironment({"POSTGRES_DSN": "host=x"})
    assert (plain.internalSubjects, plain.workerSubjects) == (None, None)
    for clientCA, worker, problem in [
        (True, None, "is required with SVC_GRPC_TLS_CLIENT_CA"),
        (True, " ", "is required with SVC_GRPC_TLS_CLIENT_CA"),
        (True, ",", "names no certificate subject"),
    ]:
        with pytest.raises(ConfigError) as raised:
            MemoryConfig.fromEnvironment(environment(pemFiles, clientCA, PROXY_NAME, worker))
        assert raised.value.variable == "SVC_GRPC_WORKER_SUBJECTS"
        assert problem in raised.value.problem
    for variables in (
        environment(pemFiles, False, None, WORKER_NAME),
        {"POSTGRES_DSN": "host=x", "SVC_GRPC_WORKER_SUBJECTS": WORKER_NAME},
    ):
        with pytest.raises(ConfigError, match="needs mutual TLS") as raised:
            MemoryConfig.fromEnvironment(variables)
        assert raised.value.variable == "SVC_GRPC_WORKER_SUBJECTS"


@pytest.mark.e2e
def test_theDaemonRefusesToStartWithoutWorkerSubjects(
    pemFiles: dict[str, str], migratedDSN: str, tmp_path: Path
) -> None:
    """
    svc-memory with mutual TLS and no SVC_GRPC_WORKER_SUBJECTS refuses to
    start with one stderr line naming the variable, and a non-zero exit.
    """
    variables = environment(pemFiles, True, PROXY_NAME, None)
    del variables["POSTGRES_DSN"]
    result = subprocess.run(
        twistdCommand("svc-memory"),
        env={
            **{
                key: value
                for key, value in os.environ.items()
                if not key.startswith(("SVC_", "POSTGRES_", "OTEL_", "REDIS_"))
            },
            **memoryEnvironment(migratedDSN, **variables),
        },
        capture_output=True,
        text=True,
        timeout=Daemon.START_TIMEOUT,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "SVC_GRPC_WORKER_SUBJECTS: is required with SVC_GRPC_TLS_CLIENT_CA" in lines[0]
