"""
A search of one scope (decisions D13): the vectors from the replica's
cache (L{svcd.memory.vectorcache}), or its text index (L{svcd.memory.text}),
or both fused by rank, each loaded from PostgreSQL on a miss, and the
hits' records from its cache of records (L{svcd.memory.recordcache}): a
search of a cached scope reads nothing from the database. A scope's
records are loaded on a thread of their own after its first search, which
reads its few hits by id meanwhile: the load (about as long again as the
vectors' for a scope of short texts) never lengthens a search.

Runs on a grpcio thread, as every call of svc-memory: the load on a miss
blocks that thread only, and the product releases the GIL.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

import attrs
from prometheus_client import Histogram
from twisted.logger import Logger

from svcd.common.metrics import Children
from svcd.memory.config import DEFAULT_PARALLEL_ROWS, PARALLEL_DIMENSIONS
from svcd.memory.exact import normalised
from svcd.memory.ranking import Hit, Ranking, parallelProduct
from svcd.memory.recordcache import RecordCache
from svcd.memory.records import OTHER_LENGTH, Query
from svcd.memory.store import MemoryStore
from svcd.memory.store.cacheloads import CachedRow
from svcd.memory.text import FUSED_DEPTH, ScopeText, TextKey, fuse
from svcd.memory.vectorcache import ScopeKey, VectorCache
from svcd.memory.vectors import ScopeVectors
from svcd.memory.wire import encodedMemory
from svcd.memoryclient.records import Embedding, InvalidMemory, Scope

# How a search ranks (decisions D13, "Hybrid search").
VECTOR = "vector"
TEXT = "text"
HYBRID = "hybrid"
MODES = (VECTOR, TEXT, HYBRID)


def usableCores(cgroup: str = "/sys/fs/cgroup") -> int:
    """
    The cores this process may run on, not the machine's: its affinity
    (which a container's cpuset sets), and no more than its cgroup's CPU
    quota (C{cpu.max}, which C{--cpus} and Kubernetes' limits set), rounded
    up. A split product's blocks beyond them would only wait for each
    other.
    """
    try:
        cores = len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        with open(os.path.join(cgroup, "cpu.max")) as limits:
            quota, period = limits.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        # No cgroup v2 here, or no limit it says: the affinity's count.
        pass
    return cores


@attrs.frozen
class PendingSync:
    """
    A sync marker a write's transaction sends (L{Searcher.expectWrite}),
    and the event set once the listener hears it.
    """

    nonce: str
    heard: threading.Event = attrs.field(repr=False)


class Searcher:
    """
    @param searchSeconds: svc_memory_search_duration_seconds, by mode and by whether
        the scope was cached (C{cache="hit"}) or loaded (C{"miss"}).
    @param workers: threads a search of a large scope splits its product
        over (L{parallelProduct}); the cores this process may run on (L{usableCores}) by default.
    @param parallelRows: how many memories make a scope large; 0: no
        scope is (one thread computes every product).
    @param records: the cache of records; None: each search reads its
        hits from PostgreSQL by id.
    @param recordLoads: where scopes' records are loaded; a thread of the
        searcher's own by default.
    """

    log = Logger()

    def __init__(
        self,
        store: MemoryStore,
        cache: VectorCache,
        searchSeconds: Histogram | None = None,
        workers: int | None = None,
        parallelRows: int = DEFAULT_PARALLEL_ROWS,
        records: RecordCache | None = None,
        recordLoads: Executor | None = None,
    ) -> None:
        self._store = store
        self._cache = cache
        self._records = records
        self._recordLoads = recordLoads or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="svc-memory-records"
        )
        self._searchSeconds = searchSeconds
        self._children = Children()
        workers = workers or usableCores()
        # The other blocks' threads: the calling thread computes one.
        self._executor = ThreadPoolExecutor(
            max_workers=max(1, workers - 1), thread_name_prefix="svc-memory-product"
        )
        self._product = parallelProduct(
            self._executor,
            workers if parallelRows else 1,
            parallelRows,
            dimensions=PARALLEL_DIMENSIONS,
        )

    def vectorsOf(
        self, key: ScopeKey, scope: Scope, strict: bool = False
    ) -> tuple[ScopeVectors, bool]:
        """
        The vectors of C{key}, and whether they came from the cache.

        @param strict: refuse a query whose length is not that of the
            scope's vectors of its model (decisions D13 amended, "Vectors
            never mix": the provider's fault, which it compared with
            nothing, silently), as a scope loaded without a vector of its
            length finds by one more look-up (L{MemoryStore.scopeLength});
            nothing is cached then.
        @raise InvalidMemory: on the field C{query}, L{OTHER_LENGTH}.
        """
        cached = self._cache.lookup(key)
        if cached is not None:
            assert isinstance(cached, ScopeVectors)
            return cached, True
        load = self._cache.beginLoad(key)
        try:
            rows = self._store.scopeRows(scope, key.model, key.dimensions)
            if strict and not rows.count:
                held = self._store.scopeLength(scope, key.model)
                if held is not None and held != key.dimensions:
                    raise InvalidMemory("query", OTHER_LENGTH)
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
        if not self._cache.isListening() or not self._watches(scope):
            return
        nonce = uuid.uuid4().hex
        heard = self._cache.expectSync(nonce)
        try:
            self._store.notifySync(nonce)
            heard.wait(timeout)
        finally:
            self._cache.forgetSync(nonce)

    def expectWrite(self) -> PendingSync | None:
        """
        A sync marker for a write about to be made (L{settleWrite}), for its
        transaction to send last (C{sync:<nonce>} on the listeners'
        channel, after the changes it makes: PostgreSQL delivers a
        transaction's notifications in the order they were sent, at its
        commit); None when nothing is cached now. One transaction fewer than
        L{settle}'s marker, sent after the commit in a transaction of its
        own.
        """
        if not self._cache.isListening():
            return None
        nonce = uuid.uuid4().hex
        return PendingSync(nonce, self._cache.expectSync(nonce))

    def settleWrite(
        self, scope: Scope, pending: PendingSync | None, written: bool, timeout: float = 1.0
    ) -> None:
        """
        After a write to C{scope} whose transaction sent the marker of
        C{pending} (L{expectWrite}) has committed, or failed: when it wrote
        something, return once this replica's cache holds it (as
        L{settle}); the marker is forgotten either way. A write whose
        transaction sent none (the listener was not listening then) is
        settled by L{settle}.
        """
        try:
            if not written:
                return
            if pending is None:
                self.settle(scope, timeout)
            elif self._cache.isListening() and self._watches(scope):
                pending.heard.wait(timeout)
        finally:
            if pending is not None:
                self._cache.forgetSync(pending.nonce)

    def expectWritten(self, rows: Sequence[CachedRow]) -> None:
        """
        Rows a transaction of this replica is about to commit, for the
        change listener to take instead of reading them back
        (L{VectorCache.expectWritten}).
        """
        self._cache.expectWritten(rows)

    def forgetWritten(self, memoryIDs: Sequence[uuid.UUID]) -> None:
        """
        Rows given to L{expectWritten} whose transaction failed.
        """
        if memoryIDs:
            self._cache.forgetWritten(memoryIDs)

    def _watches(self, scope: Scope) -> bool:
        triple = (scope.orgID, scope.agentID, scope.subject)
        return self._cache.watches(*triple) or (
            self._records is not None and self._records.watches(*triple)
        )

    def search(
        self,
        scope: Scope,
        query: Query | None,
        k: int,
        minScore: float | None,
        mode: str = VECTOR,
        text: str = "",
    ) -> list[tuple[bytes, float]]:
        """
        The C{k} best memories of C{scope}, best first, ties newest first,
        with their scores, ranked by C{mode}:

          - C{"vector"}: those made by C{query}'s model whose vectors are
            most similar to it (cosine); only those scoring at least
            C{minScore} when given;
          - C{"text"}: by BM25 of the query's words, C{text}
            (L{svcd.memory.text}); C{query} and C{minScore} unused;
          - C{"hybrid"}: the first L{FUSED_DEPTH} of both rankings fused by
            reciprocal rank; C{minScore} unused.

        Each memory in its wire encoding (L{svcd.memory.wire.encodedMemory}).
        Memories are named by their ids' 128-bit ints from the ranking to
        the answer: a search makes no L{uuid.UUID}.

        @raise InvalidMemory: C{query} is not the length of the scope's
            vectors of its model (L{vectorsOf}, strict).
        """
        started = time.perf_counter()
        ranking, cached = self._ranked(scope, query, k, minScore, mode, text, strict=True)
        encoded = self.recordsOf(scope, ranking.keys)
        if self._searchSeconds is not None:
            self._children.of(self._searchSeconds, "hit" if cached else "miss", mode).observe(
                time.perf_counter() - started
            )
        # A memory deleted since the ranking has no record: dropped.
        return [
            (encoded[key], score)
            for key, score in zip(ranking.keys, ranking.scores, strict=True)
            if key in encoded
        ]

    def nearest(self, scope: Scope, embedding: Embedding, minScore: float) -> Hit | None:
        """
        The memory of C{scope} whose vector is nearest C{embedding}'s, when
        it scores at least C{minScore} and still exists: what a worker's
        memory replaces (decisions D13, C{dedupe_score}). Its id and score
        only, without decoding a record.
        """
        query = Query(embedding.model, normalised(embedding.vector))
        ranking, _ = self._ranked(scope, query, 1, minScore, VECTOR, "")
        present = self.recordsOf(scope, ranking.keys)
        return next((hit for hit in ranking.hits() if hit.memoryID.int in present), None)

    def _ranked(
        self,
        scope: Scope,
        query: Query | None,
        k: int,
        minScore: float | None,
        mode: str,
        text: str,
        strict: bool = False,
    ) -> tuple[Ranking, bool]:
        """
        L{search}'s ranking, and whether every index it read was cached.

        @param strict: as L{vectorsOf}'s.
        """
        cached = True
        rankings: list[Ranking] = []
        if mode != TEXT:
            assert query is not None
            key = ScopeKey(scope.orgID, scope.agentID, scope.subject, query.model, query.dimensions)
            vectors, cached = self.vectorsOf(key, scope, strict)
            rankings.append(
                vectors.rank(
                    query.unit,
                    k if mode == VECTOR else FUSED_DEPTH,
                    minScore if mode == VECTOR else None,
                    self._product,
                )
            )
        if mode != VECTOR:
            index, textCached = self.textOf(scope)
            cached = cached and textCached
            rankings.append(index.rank(text, k if mode == TEXT else FUSED_DEPTH))
        return (fuse(rankings, k) if mode == HYBRID else rankings[0]), cached

    def recordsOf(self, scope: Scope, keys: list[int]) -> dict[int, bytes]:
        """
        The encoded records of those memories of C{scope} named by C{keys}
        (their ids' ints) that exist: from the cache of records. One it
        does not hold (its scope's records not loaded yet, a memory deleted
        while it was being ranked, nothing cached while the listener is
        down) is read from PostgreSQL, in the scope, and missing if it is
        gone. A scope whose records are not held has them loaded for the
        next searches.
        """
        if not keys:
            return {}
        found: dict[int, bytes] | None = None
        if self._records is not None:
            triple = (scope.orgID, scope.agentID, scope.subject)
            found = self._records.lookup(triple, keys)
            if found is None:
                self._loadRecords(scope)
        found = found or {}
        missing = [uuid.UUID(int=key) for key in keys if key not in found]
        if missing:
            found.update(
                (record.memoryID.int, encodedMemory(record))
                for record in self._store.memoriesByID(scope, missing)
            )
        return found

    def _loadRecords(self, scope: Scope) -> None:
        """
        Load the scope's records into the cache on the loading thread,
        unless nothing may be cached now or a load of them is under way.
        The load is registered here, before this search's hits are read:
        every change committed from now on reaches it (see
        L{RecordCache.finishLoad}).
        """
        assert self._records is not None
        records = self._records
        load = records.beginLoad((scope.orgID, scope.agentID, scope.subject))
        if load is None:
            return

        def run() -> None:
            try:
                loaded = {
                    record.memoryID.int: encodedMemory(record)
                    for record in self._store.scopeRecords(scope)
                }
            except Exception as error:
                records.abandonLoad(load)
                # Searches read their hits by id until a later miss loads
                # the scope again.
                self.log.warn(
                    "Loading a scope's records failed: {error}", error=type(error).__name__
                )
                return
            records.finishLoad(load, loaded, [])

        try:
            self._recordLoads.submit(run)
        except RuntimeError:
            # The executor is shut down: svc-memory is stopping.
            records.abandonLoad(load)
