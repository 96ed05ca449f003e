-- Observations processed are remembered for a while (decisions D13,
-- "Observation and the worker"): a proxy's journal resends a batch whose
-- acknowledgement it never read (killed between svc-memory's commit and
-- its own), and a processed observation's row is deleted with its
-- completion, so the resent one was queued and processed again: its facts
-- stored once (sql/0011), but its extraction paid twice. Queueing now also
-- looks here, and a request processed within the retention is answered as
-- queued before (the same observation id), and not queued again.
--
-- Identifiers and a time only, never the messages. svc-memory deletes the
-- rows older than SVC_MEMORY_DONE_RETENTION (svc_prune_observations_done,
-- called every few seconds by its change listener).
CREATE TABLE memory_observations_done (
    org_id          uuid NOT NULL,
    request_id      text NOT NULL CHECK (char_length(request_id) BETWEEN 1 AND 200),
    observation_id  uuid NOT NULL,
    done_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, request_id)
);
CREATE INDEX memory_observations_done_at ON memory_observations_done (done_at);

GRANT SELECT, INSERT, DELETE ON memory_observations_done TO svc_memory_app;

ALTER TABLE memory_observations_done ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory_observations_done FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON memory_observations_done TO svc_memory_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());

DO $$
BEGIN
    EXECUTE format(
        'CREATE POLICY svc_owner_all ON memory_observations_done TO %I'
        ' USING (true) WITH CHECK (true)', current_user);
END
$$;

-- The rows older than retention_seconds, at most prune_limit of them,
-- over every organization (as the schema owner, like the claim); how many
-- were deleted.
CREATE FUNCTION svc_prune_observations_done(retention_seconds double precision,
                                            prune_limit integer)
    RETURNS integer
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
        WITH old AS (
            SELECT done.org_id, done.request_id FROM public.memory_observations_done AS done
            WHERE done.done_at < now() - make_interval(secs => retention_seconds)
            ORDER BY done.done_at
            LIMIT prune_limit
            FOR UPDATE SKIP LOCKED
        ), gone AS (
            DELETE FROM public.memory_observations_done AS done
            USING old WHERE done.org_id = old.org_id AND done.request_id = old.request_id
            RETURNING 1
        )
        SELECT count(*)::integer FROM gone
    $$;
REVOKE ALL ON FUNCTION svc_prune_observations_done(double precision, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_prune_observations_done(double precision, integer)
    TO svc_memory_app;
