"""
A straightforward BM25 and reciprocal-rank fusion, written from decisions
D13 ("Hybrid search") without svcd/memory/text.py and words.py: what the
tests hold the served rankings to. Slow and obvious on purpose: words cut
out character by character (decisions D13, amended), every statistic
counted from scratch for each query.
"""

from __future__ import annotations

import math
import unicodedata
import uuid
from collections.abc import Sequence

import attrs

K1 = 1.2
B = 0.75


@attrs.frozen
class Document:
    memoryID: uuid.UUID
    created: object  # anything ordered: microseconds, or a datetime
    content: str


# What makes a letter or number one of Han, Hiragana, Katakana or Hangul,
# by the start of its Unicode name: written from the scripts' names, not
# from the code point blocks of svcd/memory/words.py.
_CJK_NAMES = (
    "CJK UNIFIED IDEOGRAPH",
    "CJK COMPATIBILITY IDEOGRAPH",
    "IDEOGRAPHIC ITERATION MARK",
    "IDEOGRAPHIC CLOSING MARK",
    "IDEOGRAPHIC NUMBER ZERO",
    "VERTICAL IDEOGRAPHIC ",
    "HANGZHOU NUMERAL ",
    "OLD CHINESE ITERATION MARK",
    "HIRAGANA ",
    "HENTAIGANA ",
    "KATAKANA ",
    "KATAKANA-HIRAGANA ",
    "VERTICAL KANA ",
    "MASU MARK",
    "HANGUL ",
)


def isCJK(character: str) -> bool:
    """
    Whether a letter or number is Han, Hiragana, Katakana or Hangul.
    """
    return unicodedata.name(character, "").startswith(_CJK_NAMES)


def referenceWords(text: str) -> list[str]:
    """
    Decisions D13, amended ("Words of every language"): the text in NFKC,
    case-folded (and in NFKC again: folding can leave marks out of their
    canonical order); runs of letters and numbers (str.isalnum) with the
    combining marks after each; a run cut where it passes between CJK and
    other characters, each CJK part giving its overlapping pairs of
    characters (one character: itself), each other part one word.
    Character by character.
    """
    text = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())
    found: list[str] = []
    # The current run: its characters, each with its marks and whether it
    # is CJK.
    run: list[tuple[str, bool]] = []

    def endRun() -> None:
        index = 0
        while index < len(run):
            cjk = run[index][1]
            part = []
            while index < len(run) and run[index][1] == cjk:
                part.append(run[index][0])
                index += 1
            if not cjk or len(part) == 1:
                found.append("".join(part))
            else:
                found.extend(part[at] + part[at + 1] for at in range(len(part) - 1))
        run.clear()

    for character in text:
        if character.isalnum():
            run.append((character, isCJK(character)))
        elif unicodedata.category(character).startswith("M") and run:
            run[-1] = (run[-1][0] + character, run[-1][1])
        else:
            endRun()
    endRun()
    return found


def bm25Ranking(documents: Sequence[Document], query: str) -> list[tuple[uuid.UUID, float]]:
    """
    Every document sharing a word with C{query}, best first, ties newest
    first, then by id, descending; a repeated query word counts once.
    """
    if not documents:
        return []
    texts = [referenceWords(each.content) for each in documents]
    count = len(documents)
    average = sum(len(each) for each in texts) / count
    distinct: list[str] = []
    for word in referenceWords(query):
        if word not in distinct:
            distinct.append(word)
    scored = []
    for document, text in zip(documents, texts, strict=True):
        score = 0.0
        shared = False
        for word in distinct:
            tf = text.count(word)
            if not tf:
                continue
            shared = True
            holding = sum(1 for other in texts if word in other)
            weight = math.log(1.0 + (count - holding + 0.5) / (holding + 0.5))
            score += weight * (tf * (K1 + 1)) / (tf + K1 * (1 - B + B * len(text) / average))
        if shared:
            scored.append((score, document.created, document.memoryID.int, document.memoryID))
    scored.sort(reverse=True)
    return [(memoryID, score) for score, _, _, memoryID in scored]


def fusedRanking(
    rankings: Sequence[Sequence[uuid.UUID]], created: dict[uuid.UUID, object]
) -> list[tuple[uuid.UUID, float]]:
    """
    Reciprocal-rank fusion of the rankings' first 100 each, 1 / (60 +
    rank), rank from 1; ties newest first, then by id, descending.
    """
    scores: dict[uuid.UUID, float] = {}
    for ranking in rankings:
        for rank, memoryID in enumerate(ranking[:100], start=1):
            scores[memoryID] = scores.get(memoryID, 0.0) + 1.0 / (60 + rank)
    order = sorted(scores, key=lambda each: (scores[each], created[each], each.int), reverse=True)
    return [(each, scores[each]) for each in order]
