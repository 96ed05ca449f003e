"""
A replica's cache of memories' records (decisions D13): what a search
answers of each hit (content, metadata, source, agent, subject, times), so
that a search of a cached scope reads nothing from PostgreSQL. Beside the
cache of vectors (L{svcd.memory.vectorcache}), not in it: the vectors' bytes
per memory keep their bound (1.2 x 4 x the dimensions) whatever the
contents weigh, and each cache is sized on its own.

What is cached. Per scope (organization, agent, subject: every memory of
it, whatever model made its vector), each memory's record in its
MemoryService wire encoding (a serialized svc.memory.v1.Memory, see
L{svcd.memory.wire}), by its id's 128-bit int (the ranking's own key,
which hashes in C where a L{uuid.UUID} hashes in Python): an answer is
assembled from these bytes, with no Python object per field nor a
formatted time per hit, and a record costs its encoding plus
L{RECORD_OVERHEAD_BYTES}.

Bounded. At most C{maxBytes} (SVC_MEMORY_RECORD_CACHE_MB), least recently
searched scope out first. A scope larger than the whole cache is read for
the search at hand and not kept; its later searches read their hits by id
(as without this cache) rather than the whole scope again, until the
listener reconnects.

Filled by reads. A search whose scope's records are not held has them
all loaded, in one query (L{svcd.memory.store.MemoryStore.scopeRecords}),
on a thread of their own (L{svcd.memory.search.Searcher}), its own hits
read by id meanwhile; from then on the scope's hits are read here.

Kept current as promptly as the vectors, by the same listener
(L{svcd.memory.listener}): every change of a memory of a scope held here
(or being loaded) is handed to L{RecordCache.apply} with the row read anew
after the change committed, before the vectors hear of it, so a memory is
never ranked before its record is here. Changes heard during a load are
applied to what it read before it is installed. While the listener is not
connected nothing is held, and searches read their hits by id: slower,
never stale. Forgetting is deletion here too: a deleted memory's record
leaves the cache when its change is heard, within the second.

Threads. Searches (grpcio's threads) and the listener share one lock,
held only for dictionary operations: encoding happens before it is taken.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterable, Sequence

import attrs

from svcd.memory.followed import FollowedCache
from svcd.memory.records import MemoryRecord
from svcd.memory.vectorcache import CacheMetrics
from svcd.memory.wire import encodedMemory

Triple = tuple[uuid.UUID, uuid.UUID, str]

# What a record costs besides its encoding: the dictionary's slot (with
# room for growth), the id's int and the bytes object's header (measured
# with tracemalloc: about 163 bytes before a dictionary grows, when the
# key was a UUID object; an int is smaller, and the bound is kept).
RECORD_OVERHEAD_BYTES = 200
# What a scope costs besides its records.
SCOPE_OVERHEAD_BYTES = 1024
# How many scopes too large for the cache are remembered as such.
MAX_TOO_LARGE = 10_000


class ScopeRecords:
    """
    The records of one scope, encoded, by id; changed only under the
    cache's lock.
    """

    def __init__(self, encoded: dict[int, bytes]) -> None:
        self._encoded = encoded
        self.nbytes = SCOPE_OVERHEAD_BYTES + sum(
            len(each) + RECORD_OVERHEAD_BYTES for each in encoded.values()
        )

    def __len__(self) -> int:
        return len(self._encoded)

    def keys(self) -> list[int]:
        return list(self._encoded)

    def found(self, keys: Iterable[int]) -> dict[int, bytes]:
        """
        The encodings of those of the memories named by C{keys} held here.
        """
        found = {}
        held = self._encoded.get
        for key in keys:
            encoded = held(key)
            if encoded is not None:
                found[key] = encoded
        return found

    def put(self, key: int, encoded: bytes | None) -> None:
        """
        Hold C{encoded} as the record of the memory named by C{key}; None:
        drop it.
        """
        old = self._encoded.pop(key, None)
        if old is not None:
            self.nbytes -= len(old) + RECORD_OVERHEAD_BYTES
        if encoded is not None:
            self._encoded[key] = encoded
            self.nbytes += len(encoded) + RECORD_OVERHEAD_BYTES


@attrs.define(eq=False)
class _Load:
    """
    A load of one scope's records in progress: the changes heard meanwhile,
    to apply to what it read before it is installed.
    """

    triple: Triple
    epoch: int
    changes: list[tuple[int, bytes | None]] = attrs.Factory(list)


def _encodedFor(triple: Triple, record: MemoryRecord | None) -> bytes | None:
    """
    The encoding to hold for a change heard about C{triple}: None when the
    memory is gone, or is no longer the scope's (never another scope's
    record under this one).
    """
    if record is None or (record.orgID, record.agentID, record.subject) != triple:
        return None
    return encodedMemory(record)


class RecordCache(FollowedCache):
    """
    Scopes' records by organization, agent and subject, at most
    C{maxBytes} of them, least recently searched out first.
    """

    def __init__(self, maxBytes: int, metrics: CacheMetrics | None = None) -> None:
        self.maxBytes = maxBytes
        self._metrics = metrics or CacheMetrics()
        super().__init__()
        self._scopes: collections.OrderedDict[Triple, ScopeRecords] = collections.OrderedDict()
        self._loads: dict[Triple, list[_Load]] = {}
        self._tooLarge: set[Triple] = set()
        # How many triples, held or loading, each organization and agent
        # has, and the triple each held record is in, by its id's int: a
        # notification names a memory's organization, agent and id, never
        # its subject (sql/0019_notify_ids.sql).
        self._agents: collections.Counter[tuple[uuid.UUID, uuid.UUID]] = collections.Counter()
        self._home: dict[int, Triple] = {}

    @property
    def totalBytes(self) -> int:
        with self._lock:
            return sum(each.nbytes for each in self._scopes.values())

    def scopeCount(self) -> int:
        with self._lock:
            return len(self._scopes)

    def _clear(self) -> None:
        self._scopes.clear()
        self._loads.clear()
        self._tooLarge.clear()
        self._agents.clear()
        self._home.clear()
        self._reportSize()

    # Searches.

    def lookup(self, triple: Triple, keys: Sequence[int]) -> dict[int, bytes] | None:
        """
        The held encodings of the memories named by C{keys}, or None when the scope's
        records are not held (a miss: load them). Nothing is held of a
        scope too large for the cache: its hits are read by id.
        """
        with self._lock:
            self._expireIfLate()
            scope = self._scopes.get(triple)
            if scope is not None:
                self._scopes.move_to_end(triple)
                found = scope.found(keys)
            tooLarge = triple in self._tooLarge
        if scope is None:
            self._metrics.miss()
            return {} if tooLarge else None
        self._metrics.hit()
        return found

    def beginLoad(self, triple: Triple) -> _Load | None:
        """
        A token for a load of the scope's records about to read
        PostgreSQL, or None when nothing may be cached now (the listener is
        down) or a load of them is under way already.
        """
        with self._lock:
            self._expireIfLate()
            if not self._listening or triple in self._loads:
                return None
            load = _Load(triple, self._epoch)
            self._countIn(triple)
            self._loads.setdefault(triple, []).append(load)
            return load

    def finishLoad(
        self, load: _Load, encoded: dict[int, bytes], keys: Sequence[int]
    ) -> dict[int, bytes]:
        """
        Install what a load read (the scope's every record, encoded, by
        its id's int), with the changes heard since it began; the
        encodings of the memories named by C{keys}, as current as the
        cache's.
        """
        with self._lock:
            self._forgetLoad(load)
            loaded = ScopeRecords(encoded)
            for key, change in load.changes:
                loaded.put(key, change)
            if not self._isCurrent(load.epoch):
                return loaded.found(keys)
            installed = self._scopes.get(load.triple)
            if installed is not None:
                # Another search loaded it first, and it has been kept
                # current since.
                self._scopes.move_to_end(load.triple)
                return installed.found(keys)
            if loaded.nbytes <= self.maxBytes:
                self._countIn(load.triple)
                self._scopes[load.triple] = loaded
                for key in loaded.keys():
                    self._home[key] = load.triple
                self._evictBeyond(self.maxBytes, keep=load.triple)
                self._reportSize()
            else:
                if len(self._tooLarge) >= MAX_TOO_LARGE:
                    self._tooLarge.clear()
                self._tooLarge.add(load.triple)
            return loaded.found(keys)

    def abandonLoad(self, load: _Load) -> None:
        with self._lock:
            self._forgetLoad(load)

    def _forgetLoad(self, load: _Load) -> None:
        pending = self._loads.get(load.triple, [])
        if load in pending:
            pending.remove(load)
            if not pending:
                del self._loads[load.triple]
                self._countOut(load.triple)

    def _countIn(self, triple: Triple) -> None:
        """
        Count C{triple} in its agent's, unless held or loading already.
        """
        if triple not in self._scopes and triple not in self._loads:
            self._agents[triple[:2]] += 1

    def _countOut(self, triple: Triple) -> None:
        """
        Count C{triple} out of its agent's, unless still held or loading.
        """
        if triple in self._scopes or triple in self._loads:
            return
        agent = triple[:2]
        self._agents[agent] -= 1
        if self._agents[agent] <= 0:
            del self._agents[agent]

    def _evictBeyond(self, limit: int, keep: Triple | None = None) -> None:
        total = sum(each.nbytes for each in self._scopes.values())
        if total <= limit:
            # Before listing the keys, which hashes each (see
            # L{svcd.memory.vectorcache.VectorCache._evictBeyond}).
            return
        for triple in list(self._scopes):
            if total <= limit:
                return
            if triple == keep:
                continue
            scope = self._scopes.pop(triple)
            total -= scope.nbytes
            self._countOut(triple)
            for key in scope.keys():
                if self._home.get(key) == triple:
                    del self._home[key]
            self._metrics.evicted()

    def _reportSize(self) -> None:
        self._metrics.size(sum(each.nbytes for each in self._scopes.values()), len(self._scopes))

    # The listener's changes.

    def watches(self, orgID: uuid.UUID, agentID: uuid.UUID, subject: str) -> bool:
        """
        Whether this scope's records are held or being loaded: only then
        is a change of it worth reading.
        """
        triple = (orgID, agentID, subject)
        with self._lock:
            self._expireIfLate()
            return triple in self._scopes or triple in self._loads

    def watchesAgent(self, orgID: uuid.UUID, agentID: uuid.UUID) -> bool:
        """
        Whether records of this organization and agent, any subject, are
        held or being loaded.
        """
        with self._lock:
            self._expireIfLate()
            return (orgID, agentID) in self._agents

    def apply(self, changes: Sequence[tuple[Triple, uuid.UUID, MemoryRecord | None]]) -> None:
        """
        Apply changes heard by the listener, in order: each names a
        memory's organization, agent and subject, its id, and its record
        as it is now (None: deleted).
        """
        encoded = [
            (triple, memoryID, _encodedFor(triple, record)) for triple, memoryID, record in changes
        ]
        with self._lock:
            self._expireIfLate()
            touched = False
            for triple, memoryID, change in encoded:
                touched = self._putOne(triple, memoryID.int, change) or touched
            if touched:
                self._evictBeyond(self.maxBytes)
                self._reportSize()

    def applyHeard(
        self, changes: Sequence[tuple[uuid.UUID, uuid.UUID, uuid.UUID, MemoryRecord | None]]
    ) -> None:
        """
        Apply changes heard by the listener, in order, each named as a
        notification names it: a memory's organization, agent and id, with
        its record as it is now (None: deleted). The record leaves the
        triple it is held in when that is not its triple now, and every
        load in progress of the agent when it is gone (see
        L{svcd.memory.vectorcache.VectorCache.applyHeard}).
        """
        named = [
            (
                orgID,
                agentID,
                memoryID.int,
                None if record is None else (orgID, record.agentID, record.subject),
                record,
            )
            for orgID, agentID, memoryID, record in changes
        ]
        # Only the records of scopes held or being loaded are encoded (a
        # worker's writes are heard for every scope it writes, whose
        # records are seldom held), before the lock is taken for the
        # changes; one whose scope began to load in between is encoded
        # under it.
        with self._lock:
            wanted = {now for _, _, _, now, _ in named if self._holdsOrLoads(now)}
        encoded = {
            key: encodedMemory(record)
            for _, _, key, now, record in named
            if record is not None and now in wanted
        }
        with self._lock:
            self._expireIfLate()
            touched = False
            for orgID, agentID, key, now, record in named:
                home = self._home.get(key)
                if home is not None and home != now:
                    touched = self._putOne(home, key, None) or touched
                if now is not None:
                    assert record is not None
                    if self._holdsOrLoads(now):
                        change = encoded.get(key)
                        if change is None:
                            change = encodedMemory(record)
                        touched = self._putOne(now, key, change) or touched
                    continue
                for triple, loads in self._loads.items():
                    if triple[:2] == (orgID, agentID) and triple != home:
                        for load in loads:
                            load.changes.append((key, None))
            if touched:
                self._evictBeyond(self.maxBytes)
                self._reportSize()

    def _holdsOrLoads(self, triple: Triple | None) -> bool:
        """
        Whether this scope's records are held or being loaded (under
        C{_lock}): only then does a change of them do anything here.
        """
        return triple is not None and (triple in self._scopes or triple in self._loads)

    def _putOne(self, triple: Triple, key: int, change: bytes | None) -> bool:
        """
        One change of a memory of C{triple} (under C{_lock}); whether a
        held scope changed.
        """
        for load in self._loads.get(triple, ()):
            load.changes.append((key, change))
        scope = self._scopes.get(triple)
        if scope is None:
            return False
        scope.put(key, change)
        if change is not None:
            self._home[key] = triple
        elif self._home.get(key) == triple:
            del self._home[key]
        return True
