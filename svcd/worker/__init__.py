"""
svc-worker (decisions D13): claims observations from svc-memory, extracts
memories from them with the organization's provider calls (limited,
budgeted, in the ledger), embeds them and merges them into the scope's
memories, at least once and never twice.
"""
