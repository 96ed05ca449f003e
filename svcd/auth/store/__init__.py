"""
All SQL of svc-auth, a store per domain as Synapse keeps its storage
(synapse/storage/databases/main): L{tokens}, L{organizations} (and their
agents), L{limits}, L{budgets}, L{memorysettings} and the usage L{ledger},
each a class of the queries of its tables with the records they answer,
built on L{base}. L{Store} is all of them in one object, which is what
svc-auth's authority, listener and servicer and svcctl hold.

Every method blocks and so runs off the reactor thread: in grpcio's server
threads, in the HTTP side's dedicated database thread pool, or in svcctl.
Each call is one transaction that first names its tenant with
C{set_config('svc.org_id', ..., true)} (transaction-local, so a pooled
connection never carries one request's tenant into the next); row-level
security does the rest (sql/0002_row_level_security.sql).
"""

from __future__ import annotations

from svcd.auth.store.budgets import BudgetsStore
from svcd.auth.store.ledger import LedgerStore
from svcd.auth.store.limits import LimitsStore
from svcd.auth.store.memorysettings import MemorySettingsStore
from svcd.auth.store.organizations import OrganizationsStore
from svcd.auth.store.tokens import TokensStore


class Store(
    TokensStore,
    OrganizationsStore,
    LimitsStore,
    BudgetsStore,
    MemorySettingsStore,
    LedgerStore,
):
    """
    The tenant-scoped queries of svc-auth over a source of connections,
    every domain's (L{svcd.auth.store.base.StoreBase} says what it is made
    with).
    """
