"""
svcd.dialects is pure code over parsed JSON: importing every module of it
loads no Twisted, no gRPC, nothing of the proxy or of the providers'
client, so that the routes, the scripted upstream and the benchmarks can
all use it (besides svcd.common.grpcruntime, which svcd's own __init__
runs: a dictionary's default, importing nothing). In a fresh interpreter,
since this test process has long imported the rest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for path in (ROOT / "svcd" / "dialects").glob("*.py")
)

_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("twisted", "grpc", "klein")
    or (m.startswith("svcd.") and not m.startswith(("svcd.dialects", "svcd.common.errors"))
        and m not in ("svcd.common", "svcd.common.grpcruntime")))))
"""


def test_dialectsImportNothingOfTheDaemons() -> None:
    """
    Importing every module of svcd.dialects loads only svcd.common.errors
    of the gateway (and svcd's grpcruntime), and neither Twisted nor gRPC.
    """
    assert {"svcd.dialects.requests", "svcd.dialects.streams", "svcd.dialects.checks"} <= set(
        MODULES
    )
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(result.stdout) == []
