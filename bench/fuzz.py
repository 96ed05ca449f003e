"""
The long schemathesis run against a live gateway.

    python bench/fuzz.py [--examples 2500] [pytest arguments...]

Runs tests/test_security_openapi.py::test_schemathesisFindsNothing (a
live svc-auth and svc-proxy forwarding to the scripted upstream, on
private PostgreSQL and Redis) with --examples generated cases instead of
the suite's few hundred, in one process, printing what the test prints:
the answers by status, and the relayed answers of the D9 routes by path,
status and media type. The checks are the test's: no 500, every answer
within the document's statuses, schemas and headers, an envelope's
request_id equal to X-Request-ID, and relayed answers of both media types.
The cases are derandomized, so a failure reproduces with the same count.
The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/test_security_openapi.py::test_schemathesisFindsNothing"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2500, help="cases to generate")
    arguments, rest = parser.parse_known_args()
    environment = {
        **os.environ,
        "SVC_SCHEMATHESIS_EXAMPLES": str(arguments.examples),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "-q", TEST, *rest]
    return subprocess.run(command, cwd=ROOT, env=environment, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
