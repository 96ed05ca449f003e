"""
Who may call svc-auth's internal methods (svcd.auth.callers; decisions D12,
amended): the names of SVC_GRPC_INTERNAL_SUBJECTS, how a certificate
matches them, the throttled log of denials, and the configuration rules.
The real daemon with real certificates is tests/test_security_mtls.py.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import trustme
from prometheus_client import CollectorRegistry
from twisted.logger import ILogObserver, Logger, LogLevel

from svcd.auth.callers import DenialLog
from svcd.auth.config import AuthConfig
from svcd.common.config import ConfigError
from svcd.common.internalcallers import BadSubjects, Certificate, InternalSubjects, parseSubjects


def test_subjectsAreACommaSeparatedListOfTrimmedNames() -> None:
    """
    Names are trimmed and empty entries skipped; a list that names nothing
    or holds a control character is refused.
    """
    assert parseSubjects(" svc-proxy.internal ,, Ledger Writer ,") == {
        "svc-proxy.internal",
        "Ledger Writer",
    }
    for bad in ("", " , ", ",,"):
        with pytest.raises(BadSubjects, match="names no certificate subject"):
            parseSubjects(bad)
    with pytest.raises(BadSubjects, match="control character"):
        parseSubjects("svc-proxy\x00.internal")


def certificate(commonName: str = "", *dnsNames: str) -> Certificate:
    return Certificate(commonName=commonName, dnsNames=dnsNames, subject=f"CN={commonName}")


def test_aNameMatchesTheCommonNameOrADNSName() -> None:
    """
    A certificate is admitted when its common name is a listed name
    exactly, or one of its DNS names is one regardless of ASCII case;
    names are literal (no wildcard matching), and a certificate without a
    common name never matches through it.
    """
    subjects = InternalSubjects(frozenset({"svc-proxy.internal", "ledger-writer", "*.ops"}))
    assert subjects.admits(certificate("", "svc-proxy.internal"))
    assert subjects.admits(certificate("", "other.internal", "SVC-Proxy.Internal"))
    assert subjects.admits(certificate("ledger-writer", "unlisted.internal"))
    assert not subjects.admits(certificate("Ledger-Writer"))
    assert not subjects.admits(certificate("operator", "operator.internal"))
    assert not subjects.admits(certificate("", "a.ops"))
    assert subjects.admits(certificate("", "*.ops"))
    assert not subjects.admits(certificate(""))


def test_theCertificateIsReadFromGrpcAuthContext() -> None:
    """
    The common name, the DNS names (never IP or URI names, which grpcio
    reports under other keys) and the subject, from grpcio's auth context;
    an absent or empty common name is "".
    """
    properties = {
        "transport_security_type": [b"ssl"],
        "x509_subject": [b"CN=proxy,O=svc"],
        "x509_common_name": [b"proxy"],
        "x509_subject_alternative_name": [b"svc-proxy.internal", b"10.0.0.1"],
        "peer_dns": [b"svc-proxy.internal"],
        "peer_ip": [b"10.0.0.1"],
    }
    assert Certificate.fromAuthContext(properties) == Certificate(
        "proxy", ("svc-proxy.internal",), "CN=proxy,O=svc"
    )
    assert Certificate.fromAuthContext({"x509_common_name": [b""]}) == Certificate("", (), "")
    assert Certificate.fromAuthContext({}) == Certificate("", (), "")


def test_denialsAreCountedByMethodAndLoggedOnceAMinute() -> None:
    """
    Every denial is counted by method (each method's series present from
    the start); the first is logged at once as a warning with the
    certificate's subject and DNS names, later ones within a minute only
    counted, and the next line carries how many there were.
    """
    now = [1000.0]
    registry = CollectorRegistry()
    logged: list[dict[str, Any]] = []
    denials = DenialLog(registry, clock=lambda: now[0])
    denials.log = Logger(observer=cast(ILogObserver, logged.append))
    name = "svc_auth_internal_calls_denied_total"
    assert registry.get_sample_value(name, {"method": "WatchChanges"}) == 0

    operator = Certificate("operator", ("operator.internal", "ops.internal"), "CN=operator")
    denials.denied("RecordUsage", operator, "ipv4:127.0.0.1:1")
    denials.denied("GetSpend", operator, "ipv4:127.0.0.1:1")
    now[0] += 59.0
    denials.denied("GetSpend", operator, "ipv4:127.0.0.1:1")
    now[0] += 1.5
    denials.denied("WatchChanges", certificate("", "x.internal"), "ipv4:127.0.0.1:2")

    assert [(event["method"], event["denied"], event["log_level"]) for event in logged] == [
        ("RecordUsage", 1, LogLevel.warn),
        ("WatchChanges", 3, LogLevel.warn),
    ]
    assert logged[0]["subject"] == "CN=operator"
    assert logged[0]["common_name"] == "operator"
    assert logged[0]["dns_names"] == "operator.internal,ops.internal"
    assert logged[1]["peer"] == "ipv4:127.0.0.1:2"
    assert registry.get_sample_value(name, {"method": "RecordUsage"}) == 1
    assert registry.get_sample_value(name, {"method": "GetSpend"}) == 2
    assert registry.get_sample_value(name, {"method": "WatchChanges"}) == 1


@pytest.fixture(scope="module")
def pemFiles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("pems")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    paths = {name: str(directory / f"{name}.pem") for name in ("cert", "key", "ca")}
    server.cert_chain_pems[0].write_to_path(paths["cert"])
    server.private_key_pem.write_to_path(paths["key"])
    ca.cert_pem.write_to_path(paths["ca"])
    return paths


def environment(pems: dict[str, str], clientCA: bool, subjects: str | None) -> dict[str, str]:
    variables = {
        "POSTGRES_DSN": "host=127.0.0.1",
        "SVC_GRPC_TLS_CERT": pems["cert"],
        "SVC_GRPC_TLS_KEY": pems["key"],
    }
    if clientCA:
        variables["SVC_GRPC_TLS_CLIENT_CA"] = pems["ca"]
    if subjects is not None:
        variables["SVC_GRPC_INTERNAL_SUBJECTS"] = subjects
    return variables


def test_subjectsGoWithMutualTLS(pemFiles: dict[str, str]) -> None:
    """
    With a client CA the list is required (unset, every proxy would be
    denied its ledger and change feed); without one it is refused (there
    would be no certificate to check); without either, nothing changes.
    """
    settings = AuthConfig.fromEnvironment(environment(pemFiles, True, "a.internal, b"))
    assert settings.internalSubjects == frozenset({"a.internal", "b"})
    assert AuthConfig.fromEnvironment(environment(pemFiles, False, None)).internalSubjects is None
    assert AuthConfig.fromEnvironment({"POSTGRES_DSN": "host=x"}).internalSubjects is None
    for clientCA, subjects, problem in [
        (True, None, "is required with SVC_GRPC_TLS_CLIENT_CA"),
        (True, "  ", "is required with SVC_GRPC_TLS_CLIENT_CA"),
        (True, ",", "names no certificate subject"),
        (False, "a.internal", "needs mutual TLS"),
    ]:
        with pytest.raises(ConfigError) as raised:
            AuthConfig.fromEnvironment(environment(pemFiles, clientCA, subjects))
        assert raised.value.variable == "SVC_GRPC_INTERNAL_SUBJECTS"
        assert problem in raised.value.problem
    with pytest.raises(ConfigError, match="needs mutual TLS"):
        AuthConfig.fromEnvironment(
            {"POSTGRES_DSN": "host=x", "SVC_GRPC_INTERNAL_SUBJECTS": "a.internal"}
        )
