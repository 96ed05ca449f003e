"""
svcctl: the operator's command line (decisions D2).

It talks to PostgreSQL directly, with POSTGRES_DSN or --dsn, because the
first organization, agent and token cannot be made through an API that
needs a token. It acts as the schema owner (the role that ran svcctl
migrate), which row-level security lets see every organization.

Every command prints exactly one JSON document on stdout and exits 0 (or,
for svcctl usage --format csv, the report's rows as CSV); on failure it
prints one line on stderr and exits non-zero: 2 for a command line it
cannot take (a bad date, amount or UUID), 1 for anything else (an unknown
organization, the database).

A module per command group: L{svcd.ctl.organizations} (org, agent),
L{svcd.ctl.tokens}, L{svcd.ctl.limits}, L{svcd.ctl.budgets},
L{svcd.ctl.usage} and L{svcd.ctl.memory} (svc-memory's memories and jobs,
and the memory settings of svc-auth's tables), on what
L{svcd.ctl.commandline} gives them all; L{svcd.ctl.main} reads the
command line and runs one command (setup.py's console script, and
C{python -m svcd.ctl}). svcctl is the one package that reaches both
svc-auth's tables (L{svcd.auth.store}) and svc-memory's
(L{svcd.memory.store}).
"""
