-- Forgetting reaches every copy (decisions D13, amended). A deletion (one
-- memory, a subject's memories, an agent's) is final for everything said
-- before it: an observation of an answer that ended at or before it and
-- that reaches svc-memory after it (an outbox's retry, a journal replayed
-- at a proxy's restart) is dropped, never queued. So each deletion leaves
-- its time here, one row per scope (organization, agent, subject) and one
-- per whole agent, holding the latest deletion (upserted).
--
-- The subject itself is not kept: a forgotten user must not stay named.
-- scope_digest is SHA-256 over the organization, the agent and the subject
-- (a whole agent's row over the organization, the agent and a marker of
-- its own; svcd/memory/forgetting.py spells both), which svc-memory
-- computes again from each observation it is sent. Identifiers and a time
-- only. Rows are kept for as long as the agent may be sent observations:
-- a proxy's journal may replay one after any time, so no retention would
-- be safe; they are bounded by the scopes ever deleted.
CREATE TABLE memory_deletions (
    org_id        uuid NOT NULL,
    agent_id      uuid NOT NULL,
    scope_digest  bytea NOT NULL CHECK (octet_length(scope_digest) = 32),
    deleted_at    timestamptz NOT NULL,
    PRIMARY KEY (org_id, scope_digest)
);

GRANT SELECT, INSERT, UPDATE ON memory_deletions TO svc_memory_app;

ALTER TABLE memory_deletions ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory_deletions FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON memory_deletions TO svc_memory_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());

DO $$
BEGIN
    EXECUTE format(
        'CREATE POLICY svc_owner_all ON memory_deletions TO %I'
        ' USING (true) WITH CHECK (true)', current_user);
END
$$;

-- When the observed answer ended (Observation.ended_at, at most the time
-- it was queued), which a deletion is compared with. NULL for the rows
-- queued before this migration: their created_at stands for it.
ALTER TABLE memory_observations ADD COLUMN ended_at timestamptz;

-- An observation that failed for good keeps its messages (content) for
-- svcctl memory jobs retry only SVC_MEMORY_FAILED_RETENTION after its
-- failure (updated_at), then is deleted (the partial index finds them
-- without reading the queue): at most prune_limit of them,
-- over every organization (as the schema owner, like the claim); how many.
-- A failed row a worker still holds under a lease is passed by (SKIP
-- LOCKED) and deleted at a later prune.
CREATE INDEX memory_observations_failed
    ON memory_observations (updated_at) WHERE state = 'failed';

CREATE FUNCTION svc_prune_observations_failed(retention_seconds double precision,
                                              prune_limit integer)
    RETURNS integer
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
        WITH old AS (
            SELECT failed.id FROM public.memory_observations AS failed
            WHERE failed.state = 'failed'
              AND failed.updated_at < now() - make_interval(secs => retention_seconds)
            ORDER BY failed.updated_at
            LIMIT prune_limit
            FOR UPDATE SKIP LOCKED
        ), gone AS (
            DELETE FROM public.memory_observations AS failed
            USING old WHERE failed.id = old.id AND failed.state = 'failed'
            RETURNING 1
        )
        SELECT count(*)::integer FROM gone
    $$;
REVOKE ALL ON FUNCTION svc_prune_observations_failed(double precision, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_prune_observations_failed(double precision, integer)
    TO svc_memory_app;
