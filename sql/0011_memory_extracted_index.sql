-- svc-worker's adds are idempotent (decisions D13, "Observation and the
-- worker"): an observation processed again (a worker killed after some of
-- its adds, a lease that ran out) must never store a memory twice, whatever
-- the similarity of a fact to itself comes out as. svc-memory's AddMemory
-- with source 'extracted' first looks for a memory of the same scope made
-- from the same request with the same content, and answers it instead of
-- adding another (svcd/memory/store/memories.py, MemoryStore.add).
--
-- This index finds those memories of a request without reading the scope:
-- a scope may hold 10,000 memories, and a worker adds many a second.
-- Partial: the API's own memories are never looked up this way.
CREATE INDEX memories_extracted_from
    ON memories (org_id, source_request_id) WHERE source = 'extracted';
