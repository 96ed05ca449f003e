"""
svc-memory (decisions D13): each agent's memories, stored in PostgreSQL under
row-level security and searched exactly from per-replica caches of vectors.
"""
