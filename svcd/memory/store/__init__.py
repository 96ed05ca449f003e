"""
All SQL of svc-memory (sql/0009_memory.sql), a store per domain (as
Synapse's C{synapse/storage/databases/main/}), all of them in
L{MemoryStore}:

  - L{base}: the connections, one transaction per call, what a call raises;
  - L{memories}: a scope's memories, and an agent's for svcctl;
  - L{cacheloads}: what a replica's caches load;
  - L{queue}: the observations waiting for svc-worker;
  - L{leases}: the observations svc-worker holds;
  - L{deletions}: forgetting a memory, a scope or an agent;
  - L{jobs}: the observations not yet done, for svcctl.

As in svc-auth's store (L{svcd.auth.store}), every method blocks and so
runs off the reactor thread (grpcio's server threads, the change
listener's thread, the HTTP side's database pool, svcctl), and each call
is one transaction that first names its organization with
C{set_config('svc.org_id', ..., true)}; row-level security, forced on both
tables for the role svc_memory_app, does the rest. A query in the wrong
organization's context finds nothing, and a write there is refused by the
database itself.

Ids of other organizations' rows cannot be seen, yet a memory of another
organization or agent must be answered "forbidden" rather than "not
found" (decisions D13): L{base.MemoryForbidden} comes from
C{svc_memory_exists(id)}, which answers whether an id exists at all and
nothing else.
"""

from __future__ import annotations

from svcd.memory.store.cacheloads import CacheLoadsStore
from svcd.memory.store.deletions import DeletionsStore
from svcd.memory.store.jobs import JobsStore
from svcd.memory.store.leases import LeasesStore
from svcd.memory.store.memories import MemoriesStore
from svcd.memory.store.queue import ObservationQueueStore


class MemoryStore(
    MemoriesStore,
    CacheLoadsStore,
    ObservationQueueStore,
    LeasesStore,
    DeletionsStore,
    JobsStore,
):
    """
    The tenant-scoped queries of svc-memory over a source of connections
    that act as svc_memory_app: every store of the package in one, as the
    daemon, its change listener and svcctl take it (the parameters are
    L{BaseStore}'s).
    """
