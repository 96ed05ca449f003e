"""
The test suite's own layout: what a newcomer relies on when finding their
way in it.
"""

from __future__ import annotations

import ast
from pathlib import Path

_TESTS = Path(__file__).resolve().parent


def test_noTestModuleImportsAnother() -> None:
    """
    Shared harness lives in the fixtures and helper modules
    (gatewayfixtures.py, ledgerfixtures.py, authhelpers.py ...), never in a
    test module that others import: a module imported as a library drags
    its tests' module-level setup along, and under the name C{tests.test_x}
    it is even imported twice.
    """
    offenders: list[str] = []
    for path in sorted(_TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.removeprefix("tests.").startswith("test_"):
                    offenders.append(f"{path.name}:{node.lineno} imports {name}")
    assert offenders == []
