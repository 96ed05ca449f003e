"""
Which test modules dev/floor runs on the oldest Twisted setup.py allows:
those whose outcome a Twisted release can change. conftest.py applies
L{leftOut} to a run given C{--twisted-floor}; dev/floor passes it.

A Twisted release can change a test's outcome only through Twisted code
that the test runs: in the test process (in-process services, clients,
the reactor), or in a twistd it starts. So a module is left out of the
floor when it runs neither, or when the Twisted it runs is already run on
the floor by others:

  - I{Drives a gateway from outside} (L{GATEWAY_FROM_OUTSIDE}): whole
    gateways of twistd daemons driven over HTTP and gRPC from a test that
    runs no Twisted itself. The daemons' Twisted code is the application
    code the unit tests run in the test process on the floor's Twisted, and
    twistd's own part (plugins, options, daemonising, signals, stopping
    with work in flight, the private-API fence) is what the daemon modules
    (test_*_daemon.py, test_observability_shutdown.py) test, which the
    floor keeps. These modules took most of the floor's time. svc-worker's
    behaviour driven from outside (test_worker_e2e.py, test_worker_dedupe.py)
    is left out for the same reason: its loop and lease are unit-tested
    in-process, its twistd part in test_worker_daemon.py.
  - I{Reaches no Twisted} (L{reachesTwisted}): a module not marked e2e
    (so it starts no twistd and no scripted upstream: e2eguard.py fails
    one that does) whose imports, followed through tests/ and svcd/,
    never import Twisted, and none of which imports a module by a name
    computed at run time or starts this interpreter again (importlib,
    __import__, sys.executable: what those reach cannot be read from the
    source): what it runs is the same code whichever Twisted is
    installed.
  - I{Tests a program that imports no Twisted} (L{TWISTED_FREE}): modules
    that reach Twisted only through a helper module's other fixtures; what
    they run (named, and checked by test_floorselection.py) imports none.
    pytest-twisted still calls each of their test functions through the
    reactor (a Deferred and a greenlet switch), as it calls every test's:
    that part of Twisted is run on the floor by every module kept there.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent

GATEWAY_FROM_OUTSIDE = (
    "tests/test_gateway_*.py",
    "tests/test_security_*.py",
    "tests/test_faults_*.py",
    "tests/*_e2e.py",
    "tests/test_hostile_gateway.py",
    "tests/test_gc_cycles.py",
    "tests/test_rolling_restart.py",
    "tests/test_devstack.py",
    # svc-worker driven from outside beside svc-auth and svc-memory (the
    # module's *_e2e.py, and the dedupe test's replicas): the worker's loop
    # and lease run in-process in test_worker_lease and test_worker_units,
    # its twistd part in test_worker_daemon, all kept.
    "tests/test_worker_dedupe.py",
)

# Modules whose tests run only the code named, which imports no Twisted
# (test_floorselection.py imports each in a new interpreter to check).
# Every svcd module such a test module imports must be named here (also
# checked), so that one importing Twisted cannot come in unseen.
TWISTED_FREE: dict[str, tuple[str, ...]] = {
    # svcctl, run as a process, and the synchronous Store and migrations
    # the tests set its database up with.
    "tests/test_svcctl.py": ("svcd.ctl.main", "svcd.auth.store", "svcd.common.migrations"),
    # svc-auth's synchronous Store on psycopg and psycopg_pool (threads, no
    # reactor), the migrations and row-level security, PostgreSQL restarted
    # under a pool: 11.6 s of the floor's run. Its pool's warning of a
    # server turned read-only imports Twisted's logger, and no test here
    # turns one read-only.
    "tests/test_auth_store.py": (
        "svcd.auth.store",
        "svcd.auth.store.base",
        "svcd.common.migrations",
        "svcd.common.pgtransactions",
        "svcd.devkit.postgres",
    ),
    # svc-memory's synchronous MemoryStore on its own psycopg_pool
    # (memoryfixtures.storeOn), no service: 10.1 s.
    "tests/test_memory_store.py": (
        "svcd.auth.store",
        "svcd.common.migrations",
        "svcd.common.pgtransactions",
        "svcd.memory.extracted",
        "svcd.memory.records",
        "svcd.memory.store",
        "svcd.memory.store.base",
        "svcd.memory.store.leases",
        "svcd.memoryclient.records",
    ),
    # Hypothesis against the chat body's parser and the token's, pure
    # functions (rawhttp.outcome calls parseChatBody): 15.6 s and 6.8 s.
    "tests/test_hostile_parsers.py": (
        "svcd.common.errors",
        "svcd.common.ids",
        "svcd.common.pat",
        "svcd.proxy.http.chatbody",
    ),
    "tests/test_hostile_json.py": ("svcd.common.errors", "svcd.proxy.http.chatbody"),
    # svc-memory's text ranking and caches, in memory: 4.7 s.
    "tests/test_memory_text.py": (
        "svcd.memory.ranking",
        "svcd.memory.store.cacheloads",
        "svcd.memory.text",
        "svcd.memory.vectorcache",
        "svcd.memory.vectors",
        "svcd.memory.words",
    ),
}


@functools.cache
def leftOut(path: Path, e2e: bool) -> str | None:
    """
    Why the test module at C{path} is left out of the floor, or None when
    it runs there.

    @param e2e: whether its tests are marked e2e.
    """
    name = path.resolve().relative_to(_ROOT).as_posix()
    if any(fnmatch.fnmatch(name, pattern) for pattern in GATEWAY_FROM_OUTSIDE):
        return "drives a gateway from outside"
    if name in TWISTED_FREE:
        return "tests a program that imports no Twisted"
    if not e2e and not reachesTwisted(path):
        return "reaches no Twisted"
    return None


@functools.cache
def reachesTwisted(path: Path) -> bool:
    """
    Whether the module at C{path}, or any module of tests/ or svcd/ it
    imports (at any depth, function bodies included), imports Twisted, or
    may (it imports by a computed name, or runs this interpreter).
    """
    seen: set[Path] = set()
    waiting = [path.resolve()]
    while waiting:
        module = waiting.pop()
        if module in seen:
            continue
        seen.add(module)
        if _importsAtRunTime(module):
            return True
        for name in _imports(module):
            if name.split(".")[0] == "twisted" and _source(name) is None:
                return True
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                source = _source(".".join(parts[:end]))
                if source is not None and source not in seen:
                    waiting.append(source)
    return False


@functools.cache
def _imports(module: Path) -> frozenset[str]:
    """
    The absolute names C{module} imports (each C{from a import b} as both
    C{a} and C{a.b}, since b may be a module).
    """
    package = _packageOf(module)
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text(), str(module))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            names.add(origin)
            names.update(f"{origin}.{alias.name}" for alias in node.names)
    return frozenset(names)


@functools.cache
def _importsAtRunTime(module: Path) -> bool:
    """
    Whether C{module} imports a module by a name computed at run time, or
    starts this interpreter (whose imports the source does not show).
    """
    source = module.read_text()
    return any(word in source for word in ("import_module", "__import__", "sys.executable"))


def _packageOf(module: Path) -> str:
    relative = module.relative_to(_ROOT)
    if relative.parts[0] == "tests":
        return ""
    parts = relative.with_suffix("").parts
    return ".".join(parts if parts[-1] == "__init__" else parts[:-1]).removesuffix(".__init__")


@functools.cache
def _source(name: str) -> Path | None:
    """
    The file of module C{name} in the checkout (svcd's, the twisted/plugins
    directory's, or a helper module of tests/), or None for any other.
    """
    parts = name.split(".")
    for base in (_ROOT, _ROOT / "tests"):
        candidate = base.joinpath(*parts)
        for source in (candidate.with_suffix(".py"), candidate / "__init__.py"):
            if source.is_file():
                return source
    return None
