"""
The text index and its BM25 ranking (svcd/memory/text.py, decisions D13
"Hybrid search"), without a database: the words of Unicode texts
(svcd/memory/words.py, D13 amended), the ranking against a
straightforward BM25 (tests/bm25reference.py) after random adds, changes
and deletes (rebuilds included), ties newest first, the fusion of
rankings, and the index's place in the cache.
"""

from __future__ import annotations

import math
import sys
import threading
import unicodedata
import uuid
from typing import Literal

import pytest
from bm25reference import Document, bm25Ranking, fusedRanking, referenceWords
from hypothesis import example, given, settings
from hypothesis import strategies as st

from svcd.memory.ranking import Hit, Ranking
from svcd.memory.store.cacheloads import CachedRow, ScopeRows, ScopeTexts
from svcd.memory.text import ScopeText, TextKey, fuse
from svcd.memory.vectorcache import CacheMetrics, ScopeKey, VectorCache
from svcd.memory.vectors import ScopeVectors
from svcd.memory.words import queryWords, words

ORG, AGENT = uuid.uuid4(), uuid.uuid4()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Alice met Bob at 10:30.", ["alice", "met", "bob", "at", "10", "30"]),
        ("snake_case and kebab-case", ["snake", "case", "and", "kebab", "case"]),
        ("Café CRÈME naïve", ["café", "crème", "naïve"]),
        ("ΣΟΦΊΑ in Москва", ["σοφία", "in", "москва"]),
        ("tea🙂coffee", ["tea", "coffee"]),
        ("٣٤ apples", ["٣٤", "apples"]),
        ("   ...!?   ", []),
    ],
)
def test_wordsAreRunsOfLettersAndNumbersCaseFolded(text: str, expected: list[str]) -> None:
    """
    A word is a run of Unicode letters and numbers in any script,
    case-folded; punctuation, spaces, the underscore and symbols (an
    emoji) separate words; the reference's character-by-character rule
    agrees.
    """
    assert words(text) == expected
    assert referenceWords(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # A combining accent is the precomposed letter (NFKC).
        ("cafe\u0301 café CAFE\u0301", ["café", "café", "café"]),
        # Case folding, not lower-casing: ß is ss, final sigma is sigma.
        ("Straße STRASSE strasse", ["strasse", "strasse", "strasse"]),
        ("ΟΔΟΣ οδος οδοσ", ["οδοσ", "οδοσ", "οδοσ"]),
        # Fullwidth letters and digits, ligatures, superscripts (NFKC).
        ("\uff21\uff22\uff23\uff11\uff12\uff13 \uff54\uff45\uff41", ["abc123", "tea"]),
        ("ﬁne x²", ["fine", "x2"]),
        # A Japanese sentence: its overlapping pairs of characters.
        (
            "東京に行きます",
            ["東京", "京に", "に行", "行き", "きま", "ます"],
        ),
        # Katakana with its prolonged sound mark, halfwidth Katakana (NFKC).
        ("コーヒー ｺｰﾋｰ", ["コー", "ーヒ", "ヒー", "コー", "ーヒ", "ヒー"]),
        # Korean syllables, and Korean written in conjoining jamo (NFKC
        # composes them).
        ("한국어", ["한국", "국어"]),
        ("\u1112\u1161\u11ab\u1100\u116e\u11a8", ["한국"]),
        # Chinese.
        ("我喜欢绿茶", ["我喜", "喜欢", "欢绿", "绿茶"]),
        # A run of one CJK character is one word.
        ("茶 と tea", ["茶", "と", "tea"]),
        # Mixed runs: the CJK part cut from the others first.
        ("東京2024年", ["東京", "2024", "年"]),
        ("iPhone用のケース", ["iphone", "用の", "のケ", "ケー", "ース"]),
        ("v2東京x", ["v2", "東京", "x"]),
        # A letter's marks stay with it (Devanagari vowel signs and virama).
        ("हिन्दी भाषा", ["हिन्दी", "भाषा"]),
        # A mark after no letter separates; one after a CJK character stays
        # with it (a variation selector here).
        ("\u0301abc", ["abc"]),
        ("葛\U000e0100西", ["葛\U000e0100西"]),
    ],
)
def test_wordsOfEveryLanguage(text: str, expected: list[str]) -> None:
    """
    Decisions D13, amended ("Words of every language"): NFKC and case
    folding, marks with their letters, and Han, Hiragana, Katakana and
    Hangul in overlapping pairs of characters; the reference agrees.
    """
    assert words(text) == expected
    assert referenceWords(text) == expected


def test_aQueryFindsWhatItsOtherFormsWrote() -> None:
    """
    A query finds a memory written in another form of its words (another
    case, composition or width), and a Japanese query the sentence that
    holds its words; a sentence is no longer one word.
    """
    index = ScopeText()
    ids = [uuid.uuid4() for _ in range(4)]
    index.upsert(ids[0], 1, "Meet at the cafe\u0301 on STRASSE 5")
    index.upsert(ids[1], 2, "ユーザーは東京に住んでいます")
    index.upsert(ids[2], 3, "사용자는 서울에 살고 있습니다")
    index.upsert(ids[3], 4, "nothing to see")
    assert [hit.memoryID for hit in index.search("Café Straße", 5)] == [ids[0]]
    assert [hit.memoryID for hit in index.search("\uff23\uff21\uff26\uff25\u0301", 5)] == [ids[0]]
    assert [hit.memoryID for hit in index.search("東京", 5)] == [ids[1]]
    assert [hit.memoryID for hit in index.search("どこに住んでいますか", 5)] == [ids[1]]
    assert [hit.memoryID for hit in index.search("서울", 5)] == [ids[2]]


# Texts that mix scripts within runs: Latin, digits, Han, kana, Hangul,
# marks (after letters and after nothing), separators and the underscore.
_MIXED = st.text(
    alphabet=st.sampled_from(
        list("aZé9 _.東京茶かカー한국ｱＡ\u0301\u093f\u094d\u3099\U000e0100\U00020b9f")
    )
    | st.characters(),
    max_size=40,
)


# Timing is no part of it: busy cores must not fail it.
@settings(deadline=None)
@given(st.text(max_size=60) | _MIXED)
def test_wordsAgreeWithTheCharacterRule(text: str) -> None:
    """
    On any text, the index's words are the reference's, character by
    character.
    """
    assert words(text) == referenceWords(text)


# Characters whose forms differ under NFKC or case folding: letters with
# accents (precomposed or not), fullwidth and halfwidth forms, ligatures,
# ß, sigma, dotted I, Greek with its iota subscript, and kana and Hangul.
_FORMS = st.text(
    alphabet=st.sampled_from(
        list(
            "aAeEiIsSß\u1e9eΣ\u03c3ςİ\u0131ΐᾳᾼ\u0345\u0301\u0308\u0323\u032d"
            "\uff21\uff22\uff41\uff11ｶﾞｰﾞﾟ\u3099がカ東京ﬁ²Å\u212b한\u1100\u1161ㄱ \u00ad_-"
        )
    )
    | st.characters(),
    max_size=30,
)


_NORMAL_FORMS: tuple[Literal["NFC", "NFD", "NFKC", "NFKD"], ...] = ("NFC", "NFD", "NFKC", "NFKD")


# Timing is no part of it: busy cores must not fail it. Case folding
# leaves marks out of their order: İ with a mark below folds to i, the dot
# above, then the mark below (NFKC puts the mark below first).
@settings(deadline=None)
@given(_FORMS)
@example("\u0130\u032d")
@example("Stra\u00dfe \u1e9e \u03a3\u03c2 \uff76\uff9e")
def test_wordsOfAnyFormAreTheSame(text: str) -> None:
    """
    The words of a text are those of its NFC, NFD, NFKC, NFKD and
    case-folded forms, and of any of these in turn.
    """
    expected = words(text)
    forms = [text.casefold(), *(unicodedata.normalize(form, text) for form in _NORMAL_FORMS)]
    forms += [unicodedata.normalize(form, each) for form in _NORMAL_FORMS for each in forms[:1]]
    forms += [each.casefold() for each in forms[1:]]
    for form in forms:
        assert words(form) == expected, ascii(form)


def test_everyCharacterIsClassedAsTheReferenceClassesIt() -> None:
    """
    Every code point, alone and beside a CJK and a Latin letter, gives the
    reference's words: the tables of marks and of CJK ranges are those of
    the running Python's Unicode. And marks are only in the planes the
    table of marks reads (0, 1 and 14).
    """
    differing = []
    for point in range(sys.maxunicode + 1):
        character = chr(point)
        if 0xD800 <= point < 0xE000:
            continue
        if unicodedata.category(character)[0] == "M":
            assert point < 0x20000 or 0xE0000 <= point < 0xF0000, hex(point)
        if not (character.isalnum() or unicodedata.category(character)[0] == "M"):
            continue
        # Alone, and after a CJK character and before a Latin letter: its
        # class (CJK, other letter or number, mark) decides which words.
        for text in (character, "東" + character + "a"):
            if words(text) != referenceWords(text):
                differing.append(hex(point))
                break
    assert differing == []


def test_aRepeatedQueryWordCountsOnce() -> None:
    assert queryWords("tea Tea TEA green tea") == ["tea", "green"]


def textRows(documents: list[Document]) -> ScopeTexts:
    return ScopeTexts(
        ids=b"".join(each.memoryID.bytes for each in documents),
        createdMicros=[int(str(each.created)) for each in documents],
        contents=[each.content for each in documents],
    )


def served(index: ScopeText, query: str, k: int) -> list[tuple[uuid.UUID, float]]:
    return [(hit.memoryID, hit.score) for hit in index.search(query, k)]


def test_tiesAreNewestFirst() -> None:
    """
    Memories of the very same words score the same and come newest first
    (then by id), whatever order they were loaded in; memories sharing no
    word with the query are not returned.
    """
    ids = [uuid.uuid4() for _ in range(5)]
    created = [20, 40, 10, 30, 50]
    contents = ["green tea", "green tea", "green tea", "green tea", "black coffee"]
    documents = [Document(*each) for each in zip(ids, created, contents, strict=True)]
    index = ScopeText.fromRows(textRows(documents))
    ranked = [memoryID for memoryID, _ in served(index, "tea", 10)]
    assert ranked == [ids[1], ids[3], ids[0], ids[2]]
    assert served(index, "tea", 10) == bm25Ranking(documents, "tea")
    assert served(index, "water", 10) == []
    assert served(index, "...", 10) == []


def test_scoresAreBM25() -> None:
    """
    A worked example: idf, k1, b and the average length as D13 states
    them, to the last bit against the reference.
    """
    documents = [
        Document(uuid.uuid4(), 1, "the cat sat on the mat"),
        Document(uuid.uuid4(), 2, "the dog"),
        Document(uuid.uuid4(), 3, "cats and dogs and the cat"),
    ]
    index = ScopeText.fromRows(textRows(documents))
    assert served(index, "cat the", 10) == bm25Ranking(documents, "cat the")
    # "cat" (not "cats") is once in 2 of 3 memories, each of 6 words; the
    # average length is 14/3; the two tie, the newer first.
    [(first, score), (second, same)] = served(index, "cat", 10)
    assert (first, second) == (documents[2].memoryID, documents[0].memoryID)
    idf = math.log(1 + 1.5 / 2.5)
    expected = idf * (1 * 2.2) / (1 + 1.2 * (0.25 + 0.75 * 6 / (14 / 3)))
    assert score == pytest.approx(expected, rel=1e-12)
    assert same == score


vocabulary = st.sampled_from(
    [
        "tea",
        "Tea",
        "\uff34\uff25\uff21",  # fullwidth
        "green",
        "café",
        "CAFÉ",
        "cafe\u0301",
        "Straße",
        "STRASSE",
        "東京",
        "東京都",
        "カフェ",
        "ｶﾌｪ",
        "한국어",
        "2025",
        "snake_case",
        "Bob",
        "bob's",
        "x",
    ]
)
separators = st.sampled_from([" ", ", ", "-", "! ", "\n"])


@st.composite
def contents(draw: st.DrawFn) -> str:
    chosen = draw(st.lists(vocabulary, min_size=0, max_size=8))
    text = "".join(word + draw(separators) for word in chosen).strip()
    return text or "?!"


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), contents()),
        st.tuples(st.just("change"), st.integers(0, 10_000), contents()),
        st.tuples(st.just("delete"), st.integers(0, 10_000)),
    ),
    max_size=250,
)


@settings(max_examples=120, deadline=None)
@given(initial=st.lists(contents(), max_size=30), changes=operations, query=contents())
def test_rankingEqualsReferenceAfterChanges(
    initial: list[str], changes: list[tuple[object, ...]], query: str
) -> None:
    """
    After a load and any adds, changes and deletes (enough of them to
    rebuild the index several times), every ranking is the reference's
    over the memories as they now are: the same memories in the same
    order with the same scores, bit for bit.
    """
    clock = iter(range(1, 1_000_000))
    documents = {}
    for content in initial:
        memoryID = uuid.uuid4()
        documents[memoryID] = Document(memoryID, next(clock), content)
    index = ScopeText.fromRows(textRows(list(documents.values())))
    for change in changes:
        if change[0] == "add":
            memoryID = uuid.uuid4()
            documents[memoryID] = Document(memoryID, next(clock), str(change[1]))
            index.upsert(memoryID, int(str(documents[memoryID].created)), str(change[1]))
        elif documents:
            memoryID = list(documents)[int(str(change[1])) % len(documents)]
            if change[0] == "change":
                old = documents[memoryID]
                documents[memoryID] = Document(memoryID, old.created, str(change[2]))
                index.upsert(memoryID, int(str(old.created)), str(change[2]))
            else:
                del documents[memoryID]
                assert index.remove([memoryID]) == 1
    assert index.count == len(documents)
    expected = bm25Ranking(list(documents.values()), query)
    assert served(index, query, 100) == expected[:100]
    assert served(index, query, 3) == expected[:3]


def test_fusionIsReciprocalRank() -> None:
    """
    Each memory scores 1/(60 + rank) summed over the rankings (first 100
    of each); equal sums come newest first.
    """
    a, b, c, d = (uuid.uuid4() for _ in range(4))
    created = {a: 1, b: 2, c: 3, d: 4}
    vector = [Hit(a, 0.9, 1), Hit(b, 0.8, 2), Hit(c, 0.1, 3)]
    text = [Hit(b, 7.0, 2), Hit(a, 3.0, 1), Hit(d, 1.0, 4)]
    fused = fuse([Ranking.fromHits(vector), Ranking.fromHits(text)], 10).hits()
    assert [(hit.memoryID, hit.score) for hit in fused] == fusedRanking(
        [[a, b, c], [b, a, d]], dict(created)
    )
    # a and b tie (1/61 + 1/62): b is newer; c and d tie (1/63): d is newer.
    assert [hit.memoryID for hit in fused] == [b, a, d, c]
    deep = [Hit(uuid.uuid4(), 1.0, number) for number in range(150)]
    assert {hit.memoryID for hit in fuse([Ranking.fromHits(deep)], 150).hits()} == {
        hit.memoryID for hit in deep[:100]
    }


def cachedRow(memoryID: uuid.UUID, content: str, created: int, model: str = "m") -> CachedRow:
    return CachedRow(memoryID, AGENT, "", model, 2, created, b"\x00\x00\x80?" * 2, content)


def test_theCacheKeepsTheIndexCurrentAndCountsItsBytes() -> None:
    """
    A text index in the cache takes every change of its subject's
    memories, whichever model embedded them (a vector scope takes only
    its model's); its bytes count toward the cache's bound, and it is
    evicted as the least recently used like a scope's vectors.
    """
    cache = VectorCache(maxBytes=10 * 1024 * 1024)
    cache.listening()
    key = TextKey(ORG, AGENT, "")
    load = cache.beginLoad(key)
    first = uuid.uuid4()
    # Heard while the load read PostgreSQL: applied before it is installed.
    cache.apply([(key.triple, first, cachedRow(first, "green tea", 1))])
    index = cache.finishLoad(load, ScopeText.fromRows(textRows([])))
    assert cache.lookup(key) is index
    assert [hit.memoryID for hit in index.search("tea", 5)] == [first]
    other = uuid.uuid4()
    cache.apply([(key.triple, other, cachedRow(other, "tea time", 2, model="another"))])
    assert [hit.memoryID for hit in index.search("tea", 5)] == [other, first]
    cache.apply([(key.triple, first, cachedRow(first, "black coffee", 1))])
    assert [hit.memoryID for hit in index.search("tea", 5)] == [other]
    cache.apply([(key.triple, other, None)])
    assert index.search("tea", 5) == []
    assert cache.totalBytes == index.nbytes
    # A vector scope of the same subject is another entry, under one bound.
    cache.maxBytes = index.nbytes
    vectorKey = ScopeKey(ORG, AGENT, "", "m", 2)
    vectors = ScopeVectors.fromRows(2, ScopeRows(b"", [], b""))
    cache.finishLoad(cache.beginLoad(vectorKey), vectors)
    assert cache.lookup(key) is None
    assert cache.lookup(vectorKey) is vectors


def test_theCacheReportsTheTextIndexesBytesApart() -> None:
    """
    svc_memory_cache_text_bytes: the cache reports, beside its whole size,
    the part its text indexes hold, kept as they grow and as they leave.
    """
    reported: dict[str, int] = {}

    def size(total: int, scopes: int) -> None:
        reported["total"] = total

    def textSize(total: int) -> None:
        reported["text"] = total

    cache = VectorCache(
        maxBytes=10 * 1024 * 1024, metrics=CacheMetrics(size=size, textSize=textSize)
    )
    cache.listening()
    vectorKey = ScopeKey(ORG, AGENT, "", "m", 2)
    vectors = ScopeVectors.fromRows(2, ScopeRows(b"", [], b""))
    cache.finishLoad(cache.beginLoad(vectorKey), vectors)
    assert reported == {"total": vectors.nbytes, "text": 0}
    key = TextKey(ORG, AGENT, "")
    index = cache.finishLoad(cache.beginLoad(key), ScopeText.fromRows(textRows([])))
    before = index.nbytes
    memoryID = uuid.uuid4()
    cache.apply([(key.triple, memoryID, cachedRow(memoryID, "green tea and lemon", 1))])
    assert index.nbytes > before
    assert reported == {"total": cache.totalBytes, "text": index.nbytes}
    cachedVectors = cache.lookup(vectorKey)
    assert cachedVectors is not None
    assert reported["total"] == index.nbytes + cachedVectors.nbytes
    cache.notListening()
    assert reported == {"total": 0, "text": 0}


def test_searchesBesideChangesSeeWholeChanges() -> None:
    """
    Searches on other threads while changes (and the rebuilds they cause)
    are applied never fail and never see a memory half added: every
    memory of this test holds the query's word, so each ranking holds
    exactly the memories present at some moment, with no duplicate. After
    the changes the ranking is the reference's.
    """
    index = ScopeText.fromRows(textRows([]))
    documents: dict[uuid.UUID, Document] = {}
    stop = threading.Event()
    problems: list[str] = []

    def search() -> None:
        while not stop.is_set():
            hits = index.search("tea", 100)
            ids = [hit.memoryID for hit in hits]
            if len(set(ids)) != len(ids) or any(hit.score <= 0 for hit in hits):
                problems.append(f"{len(ids)} ids, {len(set(ids))} distinct")

    threads = [threading.Thread(target=search) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for number in range(600):
            memoryID = uuid.uuid4()
            content = f"tea number {number} " + "green " * (number % 5)
            documents[memoryID] = Document(memoryID, number, content)
            index.upsert(memoryID, number, content)
            if number % 3 == 0:
                gone = list(documents)[number % len(documents)]
                del documents[gone]
                index.remove([gone])
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert problems == []
    assert (
        served(index, "tea green", 100) == bm25Ranking(list(documents.values()), "tea green")[:100]
    )


def test_aForgottenMemorysWordsLeaveTheIndexAtOnce() -> None:
    """
    D13, amended: a word that only a deleted (or changed) memory held
    leaves the index's vocabulary when the change is applied, not at the
    next build; words are then numbered on past it, and searches rank as
    BM25 says before and after a build.
    """
    first, second, third = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    documents = [Document(first, 1, "green tea in zanzibar"), Document(second, 2, "green tea")]
    index = ScopeText.fromRows(textRows(documents))
    assert index.remove([first]) == 1
    assert "zanzibar" not in index._vocabulary and "green" in index._vocabulary
    index.upsert(second, 2, "black coffee")
    assert "tea" not in index._vocabulary and "green" not in index._vocabulary
    index.upsert(third, 3, "coffee in oslo")
    assert [memoryID for memoryID, _ in served(index, "coffee oslo", 5)] == [third, second]
    assert served(index, "zanzibar tea", 5) == []
    # Enough changes for a build: the numbering survives it.
    more = [uuid.uuid4() for _ in range(80)]
    for number, memoryID in enumerate(more):
        index.upsert(memoryID, 10 + number, f"word{number} oslo")
    index.remove(more[:40])
    expected = bm25Ranking(
        [
            Document(second, 2, "black coffee"),
            Document(third, 3, "coffee in oslo"),
            *[
                Document(each, 10 + n + 40, f"word{n + 40} oslo")
                for n, each in enumerate(more[40:])
            ],
        ],
        "oslo word79 coffee",
    )[:5]
    assert [memoryID for memoryID, _ in served(index, "oslo word79 coffee", 5)] == [
        memoryID for memoryID, _ in expected
    ]
