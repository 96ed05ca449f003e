"""
svc-memory's HTTP operational routes: /health, /ready, /metrics, from the
shared operations app of L{svcd.common.opsweb}, with svc-memory's checks
(postgres, grpc, listener) and registry given by L{svcd.memory.assembly}.
"""

from __future__ import annotations

from svcd.common import opsweb


class MemoryOperationsWeb(opsweb.OperationsWeb):
    """
    The Klein app of svc-memory's HTTP port.
    """


class MemoryOperationsSite(opsweb.OperationsSite):
    """
    The site of svc-memory's HTTP port; its DEBUG lines carry the namespace
    C{svcd.memory.web.MemoryOperationsSite}.
    """
