"""
The words of text search (decisions D13, amended: "Words of every
language"), one definition for memories and queries alike.

The text is put in Unicode NFKC and case-folded (C{str.casefold}), then
in NFKC again: case folding can leave a text's combining marks out of
their canonical order (a capital I with a dot above and a mark below
folds to an i, the dot, then the mark below), and the second pass makes
the words of a text and of its folded or normalized forms the same
(L{normalized}). A word is then a run of letters and numbers (the
characters C{str.isalnum} accepts: categories L* and N*), each with the
combining marks (categories M*) that follow it; everything else (spaces,
punctuation, the underscore, symbols, a mark that follows no letter)
separates words. A run is cut where it passes between Han, Hiragana,
Katakana or Hangul (L{_CJK_BLOCKS}) and other characters; each such CJK
part, in which words are not separated by spaces, gives its overlapping
pairs of characters (a part of one character is one word), and each
other part is one word: C{"東京2024年"} is C{"東京"}, C{"2024"}, C{"年"}.

Speed: the index is built from every memory of a scope when the scope is
loaded, so the common cases take the short ways: ASCII text is
lower-cased and cut by one expression; other text, once normalized, is
searched once for a mark or a CJK character, and without either is cut
by one expression too.
"""

from __future__ import annotations

import operator
import re
import unicodedata
from collections.abc import Iterable, Sequence

import attrs


def _ranges(points: Iterable[int]) -> list[tuple[int, int]]:
    """
    Code points, in increasing order, as ranges (first, last).
    """
    ranges: list[tuple[int, int]] = []
    for point in points:
        if ranges and ranges[-1][1] == point - 1:
            ranges[-1] = (ranges[-1][0], point)
        else:
            ranges.append((point, point))
    return ranges


def _markRanges() -> list[tuple[int, int]]:
    """
    The combining marks (categories Mn, Mc, Me) of the running Python's
    Unicode. Only planes 0, 1 and 14 hold marks (2 and 3 hold ideographs,
    4 to 13 nothing, 15 and 16 private use; a test checks it): a seventh
    of the code points, read at import.
    """
    category = unicodedata.category
    return _ranges(
        point
        for first, end in ((0, 0x20000), (0xE0000, 0xF0000))
        for point in range(first, end)
        if category(chr(point))[0] == "M"
    )


# The blocks of Han, Hiragana, Katakana and Hangul: the letters and
# numbers in them (L{_cjkRanges}) are those of the four scripts, with the
# kana marks that Unicode gives to both kana scripts, such as the
# prolonged sound mark U+30FC. Halfwidth forms and other compatibility
# characters are not here: NFKC has replaced them.
_CJK_BLOCKS = (
    (0x1100, 0x11FF),  # Hangul Jamo
    (0x3000, 0x303F),  # CJK Symbols and Punctuation: iteration marks, numerals
    (0x3040, 0x309F),  # Hiragana
    (0x30A0, 0x30FF),  # Katakana
    (0x3130, 0x318F),  # Hangul Compatibility Jamo
    (0x31F0, 0x31FF),  # Katakana Phonetic Extensions
    (0x3400, 0x4DBF),  # CJK Unified Ideographs Extension A
    (0x4E00, 0x9FFF),  # CJK Unified Ideographs
    (0xA960, 0xA97F),  # Hangul Jamo Extended-A
    (0xAC00, 0xD7FF),  # Hangul Syllables, Hangul Jamo Extended-B
    (0xF900, 0xFAFF),  # CJK Compatibility Ideographs
    (0x16FE3, 0x16FE3),  # old Chinese iteration mark
    (0x1AFF0, 0x1B16F),  # Kana Extended-B, Supplement, Extended-A, Small Kana
    (0x20000, 0x3FFFF),  # planes 2 and 3: ideographs only
)


def _cjkRanges() -> list[tuple[int, int]]:
    """
    The letters and numbers (C{str.isalnum}) of L{_CJK_BLOCKS} in the
    running Python's Unicode: not their punctuation, symbols, marks (a
    mark goes with the character before it) or unassigned points.
    """
    return _ranges(
        point
        for first, last in _CJK_BLOCKS
        for point in range(first, last + 1)
        if chr(point).isalnum()
    )


def _characterClass(ranges: Iterable[tuple[int, int]]) -> str:
    """
    Ranges of code points as the inside of a regular expression's class.
    """
    return "".join(f"\\U{low:08x}-\\U{high:08x}" for low, high in ranges)


@attrs.frozen
class _Patterns:
    """
    The regular expressions that cut words, for one set of marks and CJK
    characters.

    @ivar hasMark: finds a mark.
    @ivar hasCJK: finds a CJK character.
    @ivar markedRun: a run in a text with marks: a letter or a number, then
        letters, numbers and marks (the underscore, a word character to
        C{re}, is replaced by a space first).
    @ivar cjkPart: a text's CJK parts, as L{re.split} keeps them (odd
        places), in a text without marks; C{markedCJKPart}, with them.
    @ivar cjkCharacter: a CJK character with its marks.
    """

    hasMark: re.Pattern[str]
    hasCJK: re.Pattern[str]
    markedRun: re.Pattern[str]
    cjkPart: re.Pattern[str]
    markedCJKPart: re.Pattern[str]
    cjkCharacter: re.Pattern[str]

    @classmethod
    def of(cls, marks: Sequence[tuple[int, int]], cjk: Sequence[tuple[int, int]]) -> _Patterns:
        markClass, cjkClass = _characterClass(marks), _characterClass(cjk)
        return cls(
            hasMark=re.compile(f"[{markClass}]"),
            hasCJK=re.compile(f"[{cjkClass}]"),
            markedRun=re.compile(f"\\w[\\w{markClass}]*"),
            cjkPart=re.compile(f"([{cjkClass}]+)"),
            markedCJKPart=re.compile(f"((?:[{cjkClass}][{markClass}]*)+)"),
            cjkCharacter=re.compile(f"[{cjkClass}][{markClass}]*"),
        )


_MARK_RANGES = _markRanges()
_CJK_RANGES = _cjkRanges()
# For C{re}, a class of code points below U+10000 alone is one bitmap,
# while each range past it is one more test of every character the bitmap
# does not hold: a text that holds no character past U+FFFF (most) is cut
# with the classes of the code points below it (L{_BMP}), and only the
# others with the whole classes (L{_ALL}).
_BMP = _Patterns.of(
    [each for each in _MARK_RANGES if each[1] < 0x10000],
    [each for each in _CJK_RANGES if each[1] < 0x10000],
)
_ALL = _Patterns.of(_MARK_RANGES, _CJK_RANGES)
_ASTRAL = re.compile("[\\U00010000-\\U0010ffff]")
# Whether a text may hold a mark or a CJK character, in one search: a
# text without (most text of alphabetic scripts, once in NFKC) is cut into
# runs at once.
_SPECIAL = re.compile(
    "["
    + _characterClass(each for each in (*_MARK_RANGES, *_CJK_RANGES) if each[1] < 0x10000)
    + "\\U00010000-\\U0010ffff]"
)
# A run, in a text without marks: letters and numbers.
_RUN = re.compile(r"[^\W_]+")
_ASCII_WORD = re.compile("[a-z0-9]+")


def normalized(text: str) -> str:
    """
    C{text} as words are cut from it: in NFKC, case-folded, in NFKC again
    (see the module's docstring).
    """
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())


def words(text: str) -> list[str]:
    """
    The words of C{text}, in order, repeats kept (see the module's
    docstring).
    """
    if text.isascii():
        # NFKC leaves ASCII as it is, and folds it as str.lower does; its
        # letters and numbers are [a-z0-9].
        return _ASCII_WORD.findall(text.lower())
    text = normalized(text)
    if _SPECIAL.search(text) is None:
        return _RUN.findall(text)
    patterns = _BMP if _ASTRAL.search(text) is None else _ALL
    marked = patterns.hasMark.search(text) is not None
    if marked:
        text = text.replace("_", " ")
    runs = patterns.markedRun if marked else _RUN
    if patterns.hasCJK.search(text) is None:
        return runs.findall(text)
    # The text cut at the ends of its CJK parts, which are also where a run
    # passes between CJK and other characters: the pieces between are cut
    # into runs as a text without CJK is.
    parts = patterns.markedCJKPart if marked else patterns.cjkPart
    found: list[str] = []
    for index, piece in enumerate(parts.split(text)):
        if not index % 2:
            if piece and not piece.isspace():
                found.extend(runs.findall(piece))
            continue
        # A CJK part: its overlapping pairs of characters (each character
        # with its marks, when the text has any), or its one character.
        characters: Sequence[str] = patterns.cjkCharacter.findall(piece) if marked else piece
        if len(characters) == 1:
            found.append(piece)
        else:
            found.extend(map(operator.add, characters, characters[1:]))
    return found


def queryWords(text: str) -> list[str]:
    """
    The distinct words of a query, in the order they first appear: the
    order a memory's score is summed in.
    """
    return list(dict.fromkeys(words(text)))
