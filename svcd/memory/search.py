"""
A search of one scope (decisions D13): the vectors from the replica's
cache (L{svcd.memory.vectors}), or its text index (L{svcd.memory.text}),
or both fused by rank, each loaded from PostgreSQL on a miss; the
memories themselves read by id afterwards.

Runs on a grpcio thread, as every call of svc-memory: the load on a miss
blocks that thread only, and the product releases the GIL.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import Histogram

from svcd.memory.records import Embedding, MemoryRecord, Scope
from svcd.memory.store import MemoryStore
from svcd.memory.text import FUSED_DEPTH, ScopeText, TextKey, fuse
from svcd.memory.vectors import (
    Ranking,
    ScopeKey,
    ScopeVectors,
    VectorCache,
    normalised,
    parallelProduct,
)

# How a search ranks (decisions D13, "Hybrid search").
VECTOR = "vector"
TEXT = "text"
HYBRID = "hybrid"
MODES = (VECTOR, TEXT, HYBRID)

# From about this many memories a search's product is split over the
# cores: below it, one thread reads the matrix faster than threads can be
# handed its blocks (measured: 10,000 x 768 takes about 1 ms alone).
PARALLEL_ROWS = 32_768


class Searcher:
    """
    @param searchSeconds: svc_memory_search_duration_seconds, by whether
        the scope was cached (C{cache="hit"}) or loaded (C{"miss"}).
    @param workers: threads a search of a large scope splits its product
        over (L{parallelProduct}); the machine's cores by default.
    @param parallelRows: how many memories make a scope large.
    """

    def __init__(
        self,
        store: MemoryStore,
        cache: VectorCache,
        searchSeconds: Histogram | None = None,
        workers: int | None = None,
        parallelRows: int = PARALLEL_ROWS,
    ) -> None:
        self._store = store
        self._cache = cache
        self._searchSeconds = searchSeconds
        workers = workers or os.cpu_count() or 1
        # The other blocks' threads: the calling thread computes one.
        self._executor = ThreadPoolExecutor(
            max_workers=max(1, workers - 1), thread_name_prefix="svc-memory-product"
        )
        self._product = parallelProduct(self._executor, workers, parallelRows)

    def vectorsOf(self, key: ScopeKey, scope: Scope) -> tuple[ScopeVectors, bool]:
        """
        The vectors of C{key}, and whether they came from the cache.
        """
        cached = self._cache.lookup(key)
        if cached is not None:
            assert isinstance(cached, ScopeVectors)
            return cached, True
        load = self._cache.beginLoad(key)
        try:
            rows = self._store.scopeRows(scope, key.model, key.dimensions)
            loaded = ScopeVectors.fromRows(key.dimensions, rows)
        except BaseException:
            self._cache.abandonLoad(load)
            raise
        return self._cache.finishLoad(load, loaded), False

    def textOf(self, scope: Scope) -> tuple[ScopeText, bool]:
        """
        The text index of C{scope}, and whether it came from the cache:
        built on the first text or hybrid search of the scope, from its
        memories in PostgreSQL, and kept current by the change listener as
        the vectors are.
        """
        key = TextKey(scope.orgID, scope.agentID, scope.subject)
        cached = self._cache.lookup(key)
        if cached is not None:
            assert isinstance(cached, ScopeText)
            return cached, True
        load = self._cache.beginLoad(key)
        try:
            loaded = ScopeText.fromRows(self._store.scopeTexts(scope))
        except BaseException:
            self._cache.abandonLoad(load)
            raise
        return self._cache.finishLoad(load, loaded), False

    def settle(self, scope: Scope, timeout: float = 1.0) -> None:
        """
        After a write to C{scope} through this replica has committed:
        return once this replica's cache holds it (read your writes), or
        after C{timeout} (it will, by the listener's promise). Without a
        cached copy of the scope there is nothing to wait for.
        """
        if not self._cache.isListening() or not self._cache.watches(
            scope.orgID, scope.agentID, scope.subject
        ):
            return
        nonce = uuid.uuid4().hex
        heard = self._cache.expectSync(nonce)
        try:
            self._store.notifySync(nonce)
            heard.wait(timeout)
        finally:
            self._cache.forgetSync(nonce)

    def search(
        self,
        scope: Scope,
        embedding: Embedding | None,
        k: int,
        minScore: float | None,
        mode: str = VECTOR,
        text: str = "",
    ) -> list[tuple[MemoryRecord, float]]:
        """
        The C{k} best memories of C{scope}, best first, ties newest first,
        with their scores, ranked by C{mode}:

          - C{"vector"}: those made by C{embedding}'s model whose vectors
            are most similar to it (cosine); only those scoring at least
            C{minScore} when given;
          - C{"text"}: by BM25 of the query's words, C{text}
            (L{svcd.memory.text}); C{embedding} and C{minScore} unused;
          - C{"hybrid"}: the first L{FUSED_DEPTH} of both rankings fused by
            reciprocal rank; C{minScore} unused.
        """
        started = time.perf_counter()
        cached = True
        rankings: list[Ranking] = []
        if mode != TEXT:
            assert embedding is not None
            key = ScopeKey(
                scope.orgID, scope.agentID, scope.subject, embedding.model, embedding.dimensions
            )
            vectors, cached = self.vectorsOf(key, scope)
            rankings.append(
                vectors.rank(
                    normalised(embedding.vector),
                    k if mode == VECTOR else FUSED_DEPTH,
                    minScore if mode == VECTOR else None,
                    self._product,
                )
            )
        if mode != VECTOR:
            index, textCached = self.textOf(scope)
            cached = cached and textCached
            rankings.append(index.rank(text, k if mode == TEXT else FUSED_DEPTH))
        hits = (fuse(rankings, k) if mode == HYBRID else rankings[0]).hits()
        records: dict[uuid.UUID, MemoryRecord] = {
            each.memoryID: each
            for each in self._store.memoriesByID(scope, [hit.memoryID for hit in hits])
        }
        if self._searchSeconds is not None:
            self._searchSeconds.labels(cache="hit" if cached else "miss").observe(
                time.perf_counter() - started
            )
        # A memory deleted since the ranking is not in the read: dropped.
        return [(records[hit.memoryID], hit.score) for hit in hits if hit.memoryID in records]
