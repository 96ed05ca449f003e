"""
The packages a daemon needs to call providers and pay for it
(svcd.providers, svcd.ledger with its sender, svcd.limits, the floor of
values they share, svcd.metering, the metered call above them,
svcd.metered, and svcd.authclient, the connection to svc-auth the sender
rides on; issue 29) import nothing of svc-proxy: a daemon of Phase 4
(decisions D13) that imports them never imports svcd.proxy, its metrics,
its configuration or its edge; nor does svc-worker itself (svcd.worker), which is such a
daemon.

svc-proxy and svc-worker reach svc-memory through the shared package
svcd.memoryclient alone (issue 45: daemons share code only through shared
packages): importing them loads no module of svc-memory's daemon package,
svcd.memory.

In a fresh interpreter, since this test process has long imported the
proxy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every module of these packages, found on disk so that a new module
# is checked without editing this list.
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for package in (
        "providers",
        "ledger",
        "limits",
        "metering",
        "metered",
        "authclient",
        "memoryclient",
        "worker",
    )
    for path in (ROOT / "svcd" / package).glob("*.py")
)

# Every module of the two daemons that call svc-memory, subpackages too.
CALLERS = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for package in ("proxy", "worker")
    for path in (ROOT / "svcd" / package).rglob("*.py")
)

_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
proxy = [m for m in sys.modules if m == "svcd.proxy" or m.startswith("svcd.proxy.")]
print(json.dumps(sorted(proxy)))
"""


def test_packagesImportNoProxy() -> None:
    """
    Importing every module of svcd.providers, svcd.ledger, svcd.limits,
    svcd.metering, svcd.metered, svcd.authclient, svcd.memoryclient and
    svcd.worker loads no module of svcd.proxy.
    """
    assert {
        "svcd.providers.upstream",
        "svcd.ledger.outbox",
        "svcd.ledger.sender",
        "svcd.limits.limiter",
        "svcd.metering.charges",
        "svcd.metered.embedder",
        "svcd.authclient.connection",
        "svcd.authclient.feed",
        "svcd.memoryclient.client",
        "svcd.memoryclient.batches",
        "svcd.worker.tap",
    } <= set(MODULES)
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(result.stdout) == []


_MEMORY_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(
    m for m in sys.modules if m.startswith(("svcd.memory.", "svcd.memoryclient"))
    or m == "svcd.memory"
)))
"""


def test_proxyAndWorkerLoadNoMemoryDaemon() -> None:
    """
    Importing every module of svcd.proxy and svcd.worker loads no module
    of svc-memory's daemon package (svcd.memory): what they share with it
    comes from svcd.memoryclient.
    """
    assert {
        "svcd.proxy.recall",
        "svcd.proxy.observe",
        "svcd.proxy.http.routes.memories",
        "svcd.worker.processor",
        "svcd.worker.lease",
    } <= set(CALLERS)
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, *CALLERS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    loaded = json.loads(result.stdout)
    assert [name for name in loaded if not name.startswith("svcd.memoryclient")] == []
    assert "svcd.memoryclient.client" in loaded


def test_proxyConfigIsALeaf() -> None:
    """
    svc-proxy's configuration is types and parsing: importing it loads no
    other module of svcd.proxy, and neither Twisted nor gRPC (the
    providers file and the journal's path are checked by the leaf modules
    svcd.providers.providersfile and svcd.ledger.journalfile).
    """
    probe = (
        "import json, sys\n"
        "import svcd.proxy.config\n"
        "print(json.dumps(sorted(m for m in sys.modules"
        " if m.startswith(('svcd.proxy', 'twisted', 'grpc')))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(result.stdout) == ["svcd.proxy", "svcd.proxy.config"]
