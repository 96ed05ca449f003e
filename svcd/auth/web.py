"""
svc-auth's HTTP operational routes: /health, /ready, /metrics (spec 4.2),
and the site serving them: the shared operations app of
L{svcd.common.opsweb}, with svc-auth's checks (postgres, grpc) and
registry given by its assembly (L{svcd.auth.assembly}).
"""

from __future__ import annotations

from svcd.common import opsweb


class AuthOperationsWeb(opsweb.OperationsWeb):
    """
    The Klein app of svc-auth's HTTP port.
    """


class OperationsSite(opsweb.OperationsSite):
    """
    The site of svc-auth's HTTP port; its DEBUG lines carry the namespace
    C{svcd.auth.web.OperationsSite}, as they always have.
    """
