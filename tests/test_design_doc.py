"""
docs/design.rst against the repository: every decision D1 to D13 (and "D12
amended") has its section there, with its stable anchor and a title that
starts with its number, and every decision cited anywhere in the code,
tests, SQL, proto, configuration or docs ("D9", "decisions D10", "D12
amended", "D12, amended") names one of those sections, so that whoever
reads a citation can look the decision up in the repository itself.

Plain text only: no daemon, no docutils (not a dependency); the document's
rendering is checked by hand (see the Development section of the README).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.rst"

# The decisions that exist: D1 to D13, and the amendments of D12 and D13.
DECISIONS = range(1, 17)
AMENDED = {12, 13}

# Where citations are looked for: every text file of these places.
_PLACES = ("svcd", "tests", "proto", "sql", "etc", "bench", "dev", "docs", "twisted")
_TOP_FILES = ("README.rst", "SECURITY.rst", "setup.py")
_SKIPPED_PARTS = {"__pycache__", ".venv", ".data", ".git", ".mypy_cache", ".ruff_cache"}

# A citation: "D" and a number as a word, optionally followed by
# "amended" (after a comma, whitespace, or a line break with a comment
# marker, as wrapped comments and docstrings have it).
_CITATION = re.compile(r"\bD(\d+)\b(?P<amended>,?(?:\s|#|//|--)*amended\b)?")

# An anchored section: ".. _d9:", a blank line, the title, its underline.
_SECTION = re.compile(
    r"^\.\. _(?P<anchor>[a-z0-9-]+):\n\n(?P<title>[^\n]+)\n(?P<rule>[=\-~^]+)\n",
    re.MULTILINE,
)


def anchorOf(number: int, amended: bool) -> str:
    """
    The anchor of the section a citation names in docs/design.rst.
    """
    return f"d{number}-amended" if amended else f"d{number}"


def citations(text: str) -> Iterator[tuple[int, str]]:
    """
    Each decision C{text} cites: (line number, anchor of its section).
    """
    for match in _CITATION.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        yield line, anchorOf(int(match.group(1)), match.group("amended") is not None)


def sections(text: str) -> dict[str, str]:
    """
    The anchored sections of an rst document: anchor to title (only those
    whose underline is at least as long as their title, as docutils
    requires).
    """
    return {
        match["anchor"]: match["title"]
        for match in _SECTION.finditer(text)
        if len(match["rule"]) >= len(match["title"])
    }


def citingFiles() -> Iterator[Path]:
    for name in _TOP_FILES:
        yield ROOT / name
    for place in _PLACES:
        for path in sorted((ROOT / place).rglob("*")):
            if path.is_file() and not _SKIPPED_PARTS.intersection(path.parts):
                yield path


def test_everyDecisionHasItsSection() -> None:
    """
    docs/design.rst has a section for each of D1 to D13, anchored
    C{d<n>}, whose title starts with C{D<n>.}, and one for D12 amended,
    anchored C{d12-amended}, whose title starts with C{D12 amended}.
    """
    found = sections(DESIGN.read_text(encoding="utf-8"))
    expected = {f"d{n}": f"D{n}. " for n in DECISIONS}
    expected.update({f"d{n}-amended": f"D{n} amended" for n in AMENDED})
    wrong = {
        anchor: found.get(anchor, "(missing)")
        for anchor, start in expected.items()
        if not found.get(anchor, "").startswith(start)
    }
    assert not wrong, f"sections missing or mistitled in docs/design.rst: {wrong}"


def test_everyCitationNamesASection() -> None:
    """
    Every decision cited in the repository (code, tests, SQL, proto, etc,
    bench, dev, docs, README, SECURITY) names a section of docs/design.rst.
    """
    known = set(sections(DESIGN.read_text(encoding="utf-8")))
    unknown: list[str] = []
    count = 0
    for path in citingFiles():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for line, anchor in citations(text):
            count += 1
            if anchor not in known:
                unknown.append(f"{path.relative_to(ROOT)}:{line} cites {anchor}")
    # The repository cites hundreds of decisions; none found means the
    # search itself is broken, not that the citations are fine.
    assert count > 300
    assert not unknown, "decisions cited with no section in docs/design.rst:\n" + "\n".join(unknown)


def test_citationForms() -> None:
    """
    The forms of citation in use are each read as the section they name,
    across a wrapped line too; a number with no decision is still read,
    so that the test above reports it.
    """
    # Built from parts, so that this file cites no decision that does not
    # exist.
    unknown = "D" + "14"
    text = "\n".join(
        [
            "(decisions D9)",
            "see D12, amended, and D12 amended",
            "# Which clients may call (decisions D12,",
            "# amended).",
            "-- the ledger (decisions D12).",
            f"a decision that does not exist: {unknown}",
            "not a citation: UUID4D12 or D12x or xD3",
        ]
    )
    assert list(citations(text)) == [
        (1, "d9"),
        (2, "d12-amended"),
        (2, "d12-amended"),
        (3, "d12-amended"),
        (5, "d12"),
        (6, "d14"),
    ]


def test_sectionsNeedAnchorTitleAndRule() -> None:
    """
    A section counts only with its anchor, a blank line, its title and an
    underline at least as long as the title.
    """
    text = (
        ".. _d1:\n\nD1. Installation\n================\n\n"
        ".. _d2:\n\nD2. svcctl\n====\n\n"
        ".. _d3:\nD3. Permissions\n===============\n"
    )
    assert sections(text) == {"d1": "D1. Installation"}
