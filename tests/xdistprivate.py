"""
The private names of pytest-xdist and pytest that tests/conftest.py's
scheduling relies on, reached only here, and checked when a run starts.

conftest.py keeps on one worker the tests that share a fixture wider than
a test, and runs the tests marked serial last and alone. pytest-xdist's
public API covers part of it (the C{--dist loadgroup} mode, the
C{xdist_group} marker, the C{pytest_configure_node} and
C{pytest_xdist_make_scheduler} hooks) but not all:

  - A worker decides from its own command line whether to name each
    test's group in its node id (C{config.option.loadgroup}, set by
    C{xdist.remote.setup_config}), and the node id is all the scheduler
    sees of the groups. dev/test passes C{-n auto}, not C{--dist
    loadgroup}, so conftest tells each worker through its
    C{workerinput} and sets the option itself.
  - Running the serial group last and alone subclasses
    L{xdist.scheduler.LoadGroupScheduling} and overrides or reads its
    private C{_assign_work_unit}, C{_pending_of}, C{workqueue} and
    C{assigned_work}, and the worker's C{shutting_down} and C{shutdown}.
  - Which fixtures a test uses comes from pytest's private
    C{Item._fixtureinfo.name2fixturedefs}.

None of them would fail loudly when a release renames it: the option
would be set and never read, an optional hook never called, an override
never run. That is how the scheduling silently did nothing until commit
818eb9c (a worker's C{--dist} was its own; pytest-dev/pytest-xdist#1386).
So conftest reaches them through this module, and
L{requireXdistInternals}, called from conftest's C{pytest_configure},
stops the run with one line naming what is missing and the versions this
was checked against (also the bounds of setup.py's test extra).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import pytest

# The releases this module's names were checked against.
TESTED = "pytest-xdist 3.8, pytest 9.1"

# What conftest.py overrides or reads on the scheduler, and reads on a
# worker's controller.
_SCHEDULER_METHODS = ("_assign_work_unit", "_pending_of", "mark_test_complete", "remove_node")
_SCHEDULER_ATTRIBUTES = ("workqueue", "assigned_work")
_CONTROLLER_NAMES = ("shutting_down", "shutdown")
# The hooks conftest.py implements as optional ones: pluggy never calls a
# hook that is gone, and says nothing.
_HOOKS = ("pytest_configure_node", "pytest_xdist_make_scheduler", "pytest_xdist_auto_num_workers")
# The worker's option that makes it name each test's group in its node id.
_LOADGROUP_OPTION = "loadgroup"


class XdistIncompatible(Exception):
    """
    The installed pytest-xdist or pytest lacks a private name the suite's
    scheduling relies on.
    """


def _setsInInit(cls: type, names: Iterable[str]) -> list[str]:
    """
    The C{names} that no C{__init__} in C{cls}'s MRO assigns to C{self}.
    """
    assigned: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        code = getattr(init, "__code__", None)
        if code is not None:
            assigned.update(code.co_names)
    return [name for name in names if name not in assigned]


def missingNames(
    scheduler: ModuleType | None = None,
    workermanage: ModuleType | None = None,
    remote: ModuleType | None = None,
    newhooks: ModuleType | None = None,
    fixtures: ModuleType | None = None,
    function: type | None = None,
) -> list[str]:
    """
    The private names of this module that the installed pytest-xdist and
    pytest lack. The arguments stand in for the real modules, for tests.
    """
    if scheduler is None:
        import xdist.scheduler  # type: ignore[import-untyped]

        scheduler = xdist.scheduler
    if workermanage is None:
        import xdist.workermanage  # type: ignore[import-untyped]

        workermanage = xdist.workermanage
    if remote is None:
        import xdist.remote  # type: ignore[import-untyped]

        remote = xdist.remote
    if newhooks is None:
        import xdist.newhooks  # type: ignore[import-untyped]

        newhooks = xdist.newhooks
    if fixtures is None:
        import _pytest.fixtures as fixtures
    if function is None:
        function = pytest.Function

    missing: list[str] = []
    groups = getattr(scheduler, "LoadGroupScheduling", None)
    if not isinstance(groups, type):
        missing.append("xdist.scheduler.LoadGroupScheduling")
    else:
        missing += [
            f"LoadGroupScheduling.{name}"
            for name in _SCHEDULER_METHODS
            if not callable(getattr(groups, name, None))
        ]
        missing += [
            f"LoadGroupScheduling.{name}" for name in _setsInInit(groups, _SCHEDULER_ATTRIBUTES)
        ]
    controller = getattr(workermanage, "WorkerController", None)
    if controller is None:
        missing.append("xdist.workermanage.WorkerController")
    else:
        missing += [
            f"WorkerController.{name}"
            for name in _CONTROLLER_NAMES
            if not hasattr(controller, name)
        ]
    if not _readsLoadgroup(remote):
        missing.append(f"xdist.remote's config.option.{_LOADGROUP_OPTION}")
    missing += [f"xdist.newhooks.{name}" for name in _HOOKS if not hasattr(newhooks, name)]
    info = getattr(fixtures, "FuncFixtureInfo", None)
    if info is None or "name2fixturedefs" not in getattr(info, "__dataclass_fields__", {}):
        missing.append("_pytest.fixtures.FuncFixtureInfo.name2fixturedefs")
    if _setsInInit(function, ["_fixtureinfo"]):
        missing.append("pytest.Function._fixtureinfo")
    return missing


def _readsLoadgroup(remote: ModuleType) -> bool:
    """
    Whether the worker's side of xdist sets and reads the loadgroup option.
    """
    try:
        source = inspect.getsource(remote)
    except (OSError, TypeError):
        return False
    return (
        f"config.option.{_LOADGROUP_OPTION} =" in source
        and f'getvalue("{_LOADGROUP_OPTION}")' in source
    )


def requireXdistInternals(missing: list[str] | None = None) -> None:
    """
    Refuse to run on a pytest-xdist or pytest that lacks any of these
    names.

    @param missing: what is missing, if already known (tests); by default
        L{missingNames}.
    @raise XdistIncompatible: naming the missing names, the installed
        versions and the tested ones.
    """
    if missing is None:
        missing = missingNames()
    if missing:
        import xdist

        raise XdistIncompatible(
            f"pytest-xdist {xdist.__version__} with pytest {pytest.__version__} lacks "
            f"{', '.join(missing)}, which tests/conftest.py's scheduling relies on "
            f"(tests/xdistprivate.py); install the versions it was tested with ({TESTED}), "
            f"or run without workers (-n 0)"
        )


# The accessors. Each takes Any: pytest-xdist ships no type information,
# and these names are private by nature.


def nameGroupsInNodeIDs(config: Any) -> None:
    """
    Make this worker name each test's group in its node id, as it would
    had its own command line said C{--dist loadgroup}.
    """
    config.option.loadgroup = True


def serialLastScheduling(config: pytest.Config, log: Any, serial: str) -> Any:
    """
    A L{xdist.scheduler.LoadGroupScheduling} that holds the C{serial} group
    back until every other group has been handed out, then lets the other
    workers finish and stop, and only then sends it to the one worker left:
    the serial tests run one after another with nothing of this run beside
    them. (xdist keeps each worker's last test until it has the next one or
    is told to stop, so "finished" means stopped.)
    """
    from xdist.scheduler import LoadGroupScheduling

    class SerialLastScheduling(LoadGroupScheduling):  # type: ignore[misc]
        _holder: Any = None

        def _assign_work_unit(self, node: Any) -> None:
            if serial not in self.workqueue:
                if self.workqueue:
                    super()._assign_work_unit(node)
                return
            if len(self.workqueue) > 1:
                self.workqueue.move_to_end(serial)
                super()._assign_work_unit(node)
                return
            if self._holder is None:
                self._holder = node
            self._startSerialWhenAlone()

        def _startSerialWhenAlone(self) -> None:
            others = [node for node in self.assigned_work if node is not self._holder]
            for node in others:
                if not node.shutting_down:
                    node.shutdown()
            if all(self._pending_of(self.assigned_work[node]) == 0 for node in others):
                super()._assign_work_unit(self._holder)

        def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            if self._holder is not None and serial in self.workqueue:
                self._startSerialWhenAlone()

        def remove_node(self, node: Any) -> str | None:
            crashed: str | None = super().remove_node(node)
            if node is self._holder:
                self._holder = None
            elif self._holder is not None and serial in self.workqueue:
                self._startSerialWhenAlone()
            return crashed

    return SerialLastScheduling(config, log)


def fixtureDefinitions(item: pytest.Item) -> dict[str, Any]:
    """
    The definitions of each fixture the test uses, by name (the last of
    each list overrides the others), or none for an item without
    fixtures.
    """
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return {}
    definitions: dict[str, Any] = dict(info.name2fixturedefs)
    return definitions
