"""
A probe of what a daemon leaves to the cycle collector, for tests only
(tests/test_gc_cycles.py): this directory goes first on a daemon's
PYTHONPATH, with C{SVC_GC_PROBE_DIR} naming a directory the probe writes
to; without that variable this module does nothing.

Each SIGUSR2 makes the daemon's reactor run a full collection, write what
it found since the last signal to C{<dir>/window-<n>.json} (C{n} counting
from 1) and go on saving whatever the collector finds
(C{gc.DEBUG_SAVEALL}). So between two signals, C{objects} is every
object the collector had to free, that reference counting alone would
have leaked: the objects in reference cycles and all they alone held.
The first window covers the start and is not meant to be read.

The file holds C{objects}, the count by type name (C{types}), and, for
finding a cycle, C{modules}: the count by the module of each object's
type, with functions, cells and frames given to the module whose code
they run.
"""

from __future__ import annotations

import gc
import json
import os
import signal
from collections import Counter
from pathlib import Path

_DIRECTORY = os.environ.get("SVC_GC_PROBE_DIR")


def _where(thing: object) -> str:
    code = getattr(thing, "__code__", None) or getattr(thing, "f_code", None)
    if code is None and type(thing).__name__ == "cell":
        try:
            code = getattr(thing.cell_contents, "__code__", None)  # type: ignore[attr-defined]
        except ValueError:
            code = None
    if code is not None:
        return str(code.co_filename).rsplit("site-packages/", 1)[-1]
    return str(type(thing).__module__)


def _window(directory: Path, number: int) -> None:
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    found = list(gc.garbage)
    del gc.garbage[:]
    document = {
        "objects": len(found),
        "types": dict(Counter(type(thing).__qualname__ for thing in found).most_common()),
        "modules": dict(Counter(_where(thing) for thing in found).most_common()),
    }
    del found
    partial = directory / f"window-{number}.json.partial"
    partial.write_text(json.dumps(document))
    # Free what was found (saved, it would be found again by the next
    # collection), and what this bookkeeping left, before the next window
    # starts: the file appears once it holds nothing of this one.
    gc.set_debug(0)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    partial.rename(directory / f"window-{number}.json")


def _install(directory: Path) -> None:
    windows = [0]

    def measure() -> None:
        windows[0] += 1
        _window(directory, windows[0])

    def onSignal(signum: int, frame: object) -> None:
        from twisted.internet import reactor

        reactor.callFromThread(measure)  # type: ignore[attr-defined]

    signal.signal(signal.SIGUSR2, onSignal)


if _DIRECTORY:
    _install(Path(_DIRECTORY))
