"""
Fixtures shared by every test module: private PostgreSQL and Redis servers.

The servers are started by the tests themselves (L{svcd.devkit.postgres}, L{svcd.devkit.redis}),
never taken from the machine, so the suite runs the same on a fresh machine
and on one whose own PostgreSQL or Redis holds data we must not touch.

Two kinds of fixture, for two needs:

  - C{databaseDSN} and C{redisURL} give a test a clean database or a
    flushed Redis on servers shared by the whole run: cheap, for tests that
    only read and write.
  - C{privatePostgres} and C{privateRedis} give a test a server of its own,
    which it may stop, freeze and restart to see how the code under test
    copes; never do that to the shared ones.

Servers start lazily: a run that asks for none of these fixtures starts no
server. pytest-twisted installs its reactor itself; nothing here touches it.

Parallel runs. dev/test runs the suite on pytest-xdist's workers (C{-n
auto}: L{WORKERS} of them, none for a single file). Each worker is a pytest
process of its own, with its own session: its own PostgreSQL cluster and
Redis server, its own temporary directories (pytest gives each worker a
base directory), its own reactor. What they share is the machine, and so:

  - Ports. Servers and daemons listen on ports from
    L{svcd.devkit.servers.freePort}, free when it is picked; another
    worker's next call could be handed the same port before the first one's
    daemon has bound it. freePort reserves each port it hands out, machine
    wide, for as long as the process that took it lives, and passes over
    reserved ones. Nothing in the suite uses a fixed port (the closed port
    of the forwarding tests is port 1, which no test may bind) or a fixed
    file path outside its temporary directory.
  - Fixtures of a wider scope than a test (a module's gateway, the
    session's forwarding gateway) would be started once per worker that
    runs one of their tests: L{pytest_collection_modifyitems} puts their
    tests in one xdist group, and the loadgroup scheduling sends each group
    to one worker, the heaviest first (L{_heaviestFirst}: a group of tests
    that start daemons before one of unit tests). Every other test goes to
    whichever worker is free, the end-to-end ones first.
  - Time. The suite waits much more than it computes (daemons starting,
    promises of "within a second", servers frozen for seconds), so more
    workers than cores pay off: on the 2-core machine, shared with other
    engineers' runs, the suite took 31m44s in one process (without the
    million made-up ids, which alone took over 20 minutes) and 10m35s on
    four workers under about the same load (load average 10 to 13).
    Fewer workers were not measured under comparable load; more would
    start more daemons at once on two cores. On four workers the run
    computes about as much as two cores give it: 586 s of CPU in a run of
    588 s (load average 5 to 13, PostgreSQL's own aside), most of it
    processes starting (some 300 twistd daemons and 100 scripted
    upstreams, each 0.4 to 0.6 s of CPU). What shortens it is less CPU:
    a module's tests sharing daemons that none of them needs to itself
    (workerfixtures.WorkerStack, upstreamfixtures.moduleUpstream), svcctl
    forked rather than started (forkedpython.py), and so the daemons and
    scripted upstreams (forkedtwistd.py: 0.21 s of CPU to a daemon's
    /health instead of 0.65 s, 0.02 s to an upstream's port instead of
    0.26 s).
  - Load. Tests about svc-auth's 50 ms deadline keep it; the gateways of
    the others use one a loaded machine meets (PATIENT_AUTH in
    gatewayfixtures.py), since a deadline missed by scheduling alone
    turns the answer they check into a 503. Tests that measure the gateway
    under load of their own making against its pace without it (a flood's
    effect on valid traffic's latency, throughput while Redis is frozen)
    are marked C{serial}: they run last, one after another, once every
    other worker has stopped (L{xdistprivate.serialLastScheduling}), as
    they did before the suite ran in parallel. Without workers (C{-n 0},
    C{-p no:xdist}, one file) every test runs in order in one process, as
    before.
  - pytest-xdist's private names. The grouping and the serial group rely
    on names pytest-xdist and pytest do not publish; they are reached only
    through tests/xdistprivate.py, which L{pytest_configure} checks first:
    a release that lacks one stops the run with one line saying which.

End to end. Tests that start real daemons or processes (twistd, the
scripted upstream, dev/gateway) are marked C{e2e} (pytest.ini), a module
at a time with C{pytestmark}; C{dev/test -m "not e2e"} is the quick run.
tests/e2eguard.py fails a test that starts one without the mark.

Where things are. Fixtures every module may use are plugins listed in
L{pytest_plugins}; helpers the modules share (the gateway harness of
gatewayfixtures.py, the ledger stack of ledgerfixtures.py, svcctl and the
feed of authhelpers.py, raw HTTP of rawhttp.py ...) are modules imported
by name. No test module imports another (test_layout.py checks).
"""

from __future__ import annotations

import inspect
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import floorselection
import pytest
import xdistprivate
from hypothesis import HealthCheck, settings

from svcd.devkit.pgtemplate import migratedDatabase
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.redis import RedisServer
from svcd.devkit.rediscluster import RedisCluster

# Hypothesis's too_slow health check times the making of examples on the
# wall clock: on a loaded machine it failed a test whose examples were
# fine (test_dialects_checks, at load 30 to 48), which is a test failing by
# chance. Every other health check stays on; tests that set their own
# suppress_health_check keep theirs.
settings.register_profile("svc", suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("svc")

# The check that keeps the e2e marker honest (first: it must wrap
# twistdCommand before any module imports it by name); fixtures of svc-auth
# (migrated databases, tenants, a running AuthService), of the scripted
# OpenAI-compatible upstream, and of the session's forwarding gateway; the
# daemons forked from a preloaded server (forkedtwistd.py).
pytest_plugins = [
    "e2eguard",
    "authfixtures",
    "upstreamfixtures",
    "forwardingfixtures",
    "memoryfixtures",
    "forkedtwistd",
]


# A random UUID in a parameter: with dashes (any case, not the nil UUID)
# anywhere, or without them as the whole value (a trace id inside a
# traceparent is fixed). And a random PAT secret after one (not a run of
# one character, which tests choose on purpose).
_RANDOM_UUID = re.compile(
    r"(?!0{8}-0{4})[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
    r"|^[0-9a-f]{32}$"
)
_RANDOM_SECRET = re.compile(r"(?<=uuid_)(?!(.)\1*$)[A-Za-z0-9_-]{20,}$")


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str | None:
    """
    The id of a parameter that holds a random UUID or secret names its
    shape instead (C{svc_pat_uuid_short}): a test's id must be the same in
    every process that collects it, because pytest-xdist's workers each
    collect the suite and must agree on every id, and C{--deselect} and
    C{-k} need ids that do not change from one run to the next.
    """
    if not isinstance(val, str) or not _RANDOM_UUID.search(val):
        return None
    shape = _RANDOM_SECRET.sub("secret", _RANDOM_UUID.sub("uuid", val))
    # Escaped as pytest escapes the ids it makes itself.
    return shape.encode("ascii", "backslashreplace").decode("ascii")


# Parallel runs (pytest-xdist).

# How many workers "-n auto" starts for a run of more than one test file
# (see the module's docstring): the suite waits more than it computes, so
# more workers than cores pay off.
WORKERS = 4

# The group of the tests marked serial: they measure how the gateway copes
# with load they make themselves, against the machine's own pace, and run
# last, alone (see the module's docstring).
SERIAL = "serial"

# Fixtures of a wider scope than a test whose tests need not stay together:
# every worker has its own PostgreSQL and Redis servers, and starting them
# takes a second.
_PER_WORKER = frozenset({"postgresServer", "sharedRedisServer", "tmp_path_factory"})

# Decisions D16: the modules whose tests of a real Redis (C{redisURL},
# C{redisServer}, C{privateRedis}) run twice, against one server and
# against a Redis Cluster of three masters (C{redisTopology}), unchanged.
REDIS_CLUSTER_MODULES = frozenset(
    {"test_proxy_ratelimit.py", "test_proxy_limits.py", "test_proxy_budget_drift.py"}
)
_REDIS_FIXTURES = frozenset({"redisURL", "redisServer", "privateRedis"})
# The xdist group of the Cluster's runs, named as the group of the tests
# that ask for the session's Cluster itself: one Cluster per run, not one
# per worker.
REDIS_CLUSTER_GROUP = "sharedRedisCluster"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """
    The workers of C{-n auto} (what dev/test passes): none for a run of one
    test file or of tests of one file, which starts faster in one process
    and reads best there; one per file for a few files (every worker
    imports and collects them first); L{WORKERS} for a folder or more
    files. The variable C{PYTEST_XDIST_AUTO_NUM_WORKERS} still overrides
    all of these.
    """
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    paths = {argument.split("::", 1)[0] for argument in config.args}
    if all(Path(path).is_file() for path in paths):
        return 0 if len(paths) <= 1 else min(WORKERS, len(paths))
    return WORKERS


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """
    With workers, check the private names of pytest-xdist this relies on
    (L{xdistprivate}), then schedule by group (see
    L{pytest_collection_modifyitems}) rather than test by test, whether the
    workers came from C{-n auto} or C{-n 3}; an explicit C{--dist} other
    than C{load} is left alone.
    """
    workers = getattr(config.option, "dist", "no") != "no"
    if workers or hasattr(config, "workerinput"):
        # Only runs on workers schedule by group; without them the groups
        # are labels nobody reads.
        try:
            xdistprivate.requireXdistInternals()
        except xdistprivate.XdistIncompatible as incompatible:
            raise pytest.UsageError(str(incompatible)) from None
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"
        # The groups in the order the workers collected them (heaviest
        # first: L{_heaviestFirst}), not by their number of tests.
        config.option.loadscopereorder = False
    workerInput = getattr(config, "workerinput", None)
    if workerInput is not None and workerInput.get(_LOADGROUP):
        # A worker parses the command line anew and decides from C{--dist}
        # alone whether to name each test's group in its node id, which is
        # all the scheduler sees of the groups: without this, C{-n auto}
        # scheduled test by test (a module's gateway started on every
        # worker that ran one of its tests, the serial tests beside others).
        xdistprivate.nameGroupsInNodeIDs(config)
    # xdist registers its marker; without xdist (-p no:xdist) the groups
    # are harmless labels, said here so that pytest does not warn of them.
    config.addinivalue_line("markers", "xdist_group(name): xdist's loadgroup scheduling group")


# What a worker is told (its C{workerinput}) when the run schedules by group.
_LOADGROUP = "svc_loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """
    Tell each worker that this run schedules by group (see
    L{pytest_configure}).
    """
    if node.config.getvalue("dist") == "loadgroup":
        node.workerinput[_LOADGROUP] = True


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """
    xdist's loadgroup scheduling, with the L{SERIAL} group run last and
    alone (L{xdistprivate.serialLastScheduling}).
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    return xdistprivate.serialLastScheduling(config, log, SERIAL)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--twisted-floor",
        action="store_true",
        default=False,
        help="run only the test modules a Twisted release can change the outcome of "
        "(tests/floorselection.py); dev/floor passes it",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """
    With C{--twisted-floor}, first leave out the modules
    L{floorselection.leftOut} names. Then keep together on one worker the
    tests that share a fixture of a wider scope than the test (a module's
    gateway, the session's forwarding gateway): spread over several
    workers, each would start its own copy, daemons and all, which costs
    more than the parallelism gains. Other tests go one by one to whichever
    worker is free.

    The group is the widest such fixture: its name for a session's, its
    module for a module's. xdist's loadgroup scheduling then sends each
    group to one worker, in the order of the workers' collection, which
    on workers is the heaviest group first (L{_heaviestFirst}).
    """
    if config.getoption("--twisted-floor"):
        _leaveOutOfTheFloor(config, items)
    groups: dict[pytest.Item, str] = {}
    for item in items:
        group = _sharedFixtureGroup(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        groups[item] = group or item.nodeid
    workerInput = getattr(config, "workerinput", None)
    if workerInput is not None and workerInput.get(_LOADGROUP):
        items[:] = _heaviestFirst(items, groups)


def _leaveOutOfTheFloor(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept: list[pytest.Item] = []
    left: list[pytest.Item] = []
    for item in items:
        e2e = item.get_closest_marker("e2e") is not None
        (left if floorselection.leftOut(item.path, e2e) else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


# What a test costs the run, in units of a unit test's: one that starts
# real daemons (marked e2e) took about nine times a unit test's time in a
# whole run on four workers (3.7 s against 0.43 s on average, module
# fixtures' starts included), and every test in a group waits for its
# fixture's start.
E2E_WEIGHT = 8


def _heaviestFirst(items: list[pytest.Item], groups: dict[pytest.Item, str]) -> list[pytest.Item]:
    """
    The tests in the order the workers are to take their groups: the
    heaviest group first (by L{E2E_WEIGHT}), each group's tests in their
    order, ties in the order collected.

    xdist's own order (with its C{--loadscope-reorder}) is by the number
    of tests in a group, and every test outside a group is a group of one
    taken in the order collected: the slowest end-to-end tests (svcctl's,
    svc-worker's, late in the alphabet) ran last, and a module's gateway
    of a few slow tests waited behind one of many quick ones. Taking the
    heaviest first (longest processing time first), the quick unit tests
    are what is left to even out the workers at the end.
    """
    weights: dict[str, float] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        group = groups[item]
        weight = E2E_WEIGHT if item.get_closest_marker("e2e") is not None else 1
        weights[group] = weights.get(group, 0) + weight
        first.setdefault(group, index)
    return sorted(items, key=lambda item: (-weights[groups[item]], first[groups[item]]))


def _sharedFixtureGroup(item: pytest.Item) -> str | None:
    if item.get_closest_marker("serial") is not None:
        return SERIAL
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("redisTopology") == "cluster":
        return REDIS_CLUSTER_GROUP
    moduleGroup: str | None = None
    name: str
    for name, definitions in xdistprivate.fixtureDefinitions(item).items():
        if name in _PER_WORKER or not _ours(definitions[-1]):
            continue
        scope = definitions[-1].scope
        if scope == "session":
            return name
        if scope in ("package", "module", "class"):
            moduleGroup = item.nodeid.split("::", 1)[0]
    return moduleGroup


_TESTS = Path(__file__).resolve().parent


def _ours(definition: pytest.FixtureDef[object]) -> bool:
    """
    Whether a fixture is defined under tests/ (pytest-twisted's session
    fixtures, for one, are shared by every test and start nothing).
    """
    try:
        source = inspect.getsourcefile(definition.func)
    except TypeError:
        return False
    return source is not None and Path(source).resolve().is_relative_to(_TESTS)


@pytest.fixture(scope="session")
def postgresServer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """
    One private PostgreSQL cluster for the whole run; tests get their own
    database in it through C{databaseDSN}.
    """
    server = PostgresServer.create(tmp_path_factory.mktemp("postgres"), inMemory=True)
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture
def databaseDSN(postgresServer: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """
    The DSN of a new, empty database that exists for this test only. It is
    dropped afterwards even if the test left connections open to it.

    A test that asks for C{migratedDSN} too gets a copy of the migrated
    template instead (L{svcd.devkit.pgtemplate}), in which that fixture's
    migrate finds nothing left to do: the same database for about a third
    of the CPU (35 ms of PostgreSQL's and 5 of ours against 105 to 120 and
    17, made, used once and dropped).
    """
    name = f"test_{secrets.token_hex(8)}"
    if "migratedDSN" in request.fixturenames:
        dsn = migratedDatabase(postgresServer, name)
    else:
        dsn = postgresServer.createDatabase(name)
    try:
        yield dsn
    finally:
        postgresServer.dropDatabase(name)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """
    The tests of a real Redis in L{REDIS_CLUSTER_MODULES} run against one
    server and against a Redis Cluster (decisions D16).
    """
    if metafunc.definition.path.name in REDIS_CLUSTER_MODULES and _REDIS_FIXTURES.intersection(
        metafunc.fixturenames
    ):
        metafunc.parametrize("redisTopology", ["server", "cluster"], indirect=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Iterator[None]:
    """
    A Hypothesis test run more than once in a session (parametrized, as
    by C{redisTopology}) runs its examples as the first run did.
    pytest-twisted (1.14) replaces the function's C{hypothesis.inner_test}
    with its own wrapper and leaves it there, so that a second item of
    the same function wrapped the wrapper, and its first example failed
    with "blockon cannot be called from the twisted greenlet".
    """
    hypothesis = getattr(pyfuncitem.obj, "hypothesis", None)
    original = getattr(hypothesis, "inner_test", None)
    yield
    if original is not None:
        hypothesis.inner_test = original  # type: ignore[union-attr]


@pytest.fixture
def redisTopology(request: pytest.FixtureRequest) -> str:
    """
    What C{redisServer}, C{redisURL} and C{privateRedis} are: one server
    (C{"server"}), or a Redis Cluster of three masters (C{"cluster"}).
    """
    return str(getattr(request, "param", "server"))


@pytest.fixture(scope="session")
def sharedRedisServer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """
    One private Redis server for the whole run; tests reach it through
    C{redisServer} and C{redisURL}, which empties it first.
    """
    server = RedisServer.create(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def sharedRedisCluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """
    One private Redis Cluster (three masters) for the whole run, started
    by the first test of L{REDIS_CLUSTER_MODULES} run against one.
    """
    cluster = RedisCluster.create(tmp_path_factory.mktemp("rediscluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def redisServer(request: pytest.FixtureRequest, redisTopology: str) -> RedisServer:
    """
    The Redis server shared by the whole run, or its Redis Cluster (which
    answers the same commands: L{RedisCluster}) when C{redisTopology}
    says so.
    """
    if redisTopology == "cluster":
        cluster: RedisServer = request.getfixturevalue("sharedRedisCluster")
        return cluster
    server: RedisServer = request.getfixturevalue("sharedRedisServer")
    return server


@pytest.fixture
def redisURL(redisServer: RedisServer) -> str:
    """
    The URL of the shared Redis server, with every key of the tests before
    this one deleted.
    """
    redisServer.flushAll()
    return redisServer.url


@pytest.fixture
def privatePostgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """
    A running PostgreSQL cluster of this test's own, which it may stop,
    freeze, thaw and start again; it is destroyed afterwards, frozen or not.
    """
    server = PostgresServer.create(tmp_path_factory.mktemp("privatePostgres"), inMemory=True)
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture
def privateRedis(
    tmp_path_factory: pytest.TempPathFactory, redisTopology: str
) -> Iterator[RedisServer]:
    """
    A running Redis server of this test's own, which it may stop, freeze,
    thaw and start again (on the same port); destroyed afterwards. A
    Redis Cluster of its own, every master at once, when
    C{redisTopology} says so.
    """
    server: RedisServer | RedisCluster
    if redisTopology == "cluster":
        server = RedisCluster.create(tmp_path_factory.mktemp("privateRedisCluster"))
    else:
        server = RedisServer.create(tmp_path_factory.mktemp("privateRedis"))
    try:
        server.start()
        # A Cluster answers what the tests ask of a server.
        yield cast(RedisServer, server)
    finally:
        server.destroy()
