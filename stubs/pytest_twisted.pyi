# Types for the parts of pytest-twisted the tests use (it ships none).
# Both decorators only mark the function for pytest-twisted's plugin and
# return it unchanged (pytest_twisted/__init__.py), so each is typed as the
# identity: a decorated test or fixture keeps its own signature.
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")

def ensureDeferred(
    f: Callable[_P, Coroutine[Any, Any, _T]],
) -> Callable[_P, Coroutine[Any, Any, _T]]: ...
def async_yield_fixture(
    f: Callable[_P, AsyncIterator[_T]],
) -> Callable[_P, AsyncIterator[_T]]: ...
