"""
grpcio's transport settled by importing svcd (svcd/common/grpcruntime.py):
the default when the environment names no experiments, an operator's own
value kept, and grpcio still knowing every experiment it turns off (a
grpcio that does not logs "Unknown experiment" at import: an upgrade must
revisit the setting then).
"""

from __future__ import annotations

import os
import subprocess
import sys

from svcd.common.grpcruntime import GRPC_EXPERIMENTS, POLLING_THREAD_READS, settleGrpcTransport

# A fresh interpreter: grpcio reads the variable once, at its import.
_PROBE = "import os, svcd, grpc; print(os.environ['GRPC_EXPERIMENTS'])"


def _probe(environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def _without(name: str) -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != name}


def test_theDefaultIsSetWhenNoneIsNamed() -> None:
    environ: dict[str, str] = {}
    settleGrpcTransport(environ)
    assert environ == {GRPC_EXPERIMENTS: POLLING_THREAD_READS}


def test_anOperatorsValueIsKept() -> None:
    for theirs in ("", "-event_engine_listener", "event_engine_dns"):
        environ = {GRPC_EXPERIMENTS: theirs}
        settleGrpcTransport(environ)
        assert environ == {GRPC_EXPERIMENTS: theirs}


def test_importingSvcdSettlesItBeforeGrpcio() -> None:
    """
    In a process that imports svcd and then grpcio, as every daemon and
    svcctl does, the variable is the default when grpcio reads it, and
    grpcio knows each experiment named (it says nothing on stderr).
    """
    done = _probe(_without(GRPC_EXPERIMENTS))
    assert done.stdout.strip() == POLLING_THREAD_READS
    assert "experiment" not in done.stderr.lower(), done.stderr
    for experiment in POLLING_THREAD_READS.split(","):
        assert experiment.startswith("-event_engine_")


def test_grpcioNamesAnUnknownExperiment() -> None:
    """
    The check above can fail: grpcio does say so of an experiment it does
    not know.
    """
    environment = _without(GRPC_EXPERIMENTS)
    environment[GRPC_EXPERIMENTS] = "-no_such_experiment_of_svc"
    done = _probe(environment)
    assert done.stdout.strip() == "-no_such_experiment_of_svc"
    assert "Unknown experiment: no_such_experiment_of_svc" in done.stderr
