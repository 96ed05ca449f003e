-- Observations are idempotent by a key the gateway makes (decisions D13,
-- read with D12 amended), no longer by the client's request id. A
-- client's X-Request-ID is the observation's request_id still (the
-- worker's ledger rows name it as their parent, an extracted memory as its
-- source), but clients reuse one: an application that hands its own
-- inbound request id to every call it makes, or a client that sends the
-- same id each turn, had every observation after the first answered as
-- queued before and never processed, silently; two agents of one
-- organization sending the same id, the same. The key is now svc-proxy's
-- ledger id of the observed chat completion (UUID v7, one per forwarded
-- request), which a resent copy carries too. Rows queued before this
-- migration are keyed by their request id, as a proxy of an earlier
-- release keys what it sends.
ALTER TABLE memory_observations ADD COLUMN observation_key text;
UPDATE memory_observations SET observation_key = request_id;
ALTER TABLE memory_observations
    ALTER COLUMN observation_key SET NOT NULL,
    ADD CONSTRAINT memory_observations_key_length
        CHECK (char_length(observation_key) BETWEEN 1 AND 200),
    ADD CONSTRAINT memory_observations_org_key UNIQUE (org_id, observation_key),
    DROP CONSTRAINT memory_observations_org_id_request_id_key;

-- What was processed is remembered by the same key.
ALTER TABLE memory_observations_done ADD COLUMN observation_key text;
UPDATE memory_observations_done SET observation_key = request_id;
ALTER TABLE memory_observations_done
    ALTER COLUMN observation_key SET NOT NULL,
    ADD CONSTRAINT memory_observations_done_key_length
        CHECK (char_length(observation_key) BETWEEN 1 AND 200),
    DROP CONSTRAINT memory_observations_done_pkey,
    ADD PRIMARY KEY (org_id, observation_key);

CREATE OR REPLACE FUNCTION svc_prune_observations_done(retention_seconds double precision,
                                                       prune_limit integer)
    RETURNS integer
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
        WITH old AS (
            SELECT done.org_id, done.observation_key
            FROM public.memory_observations_done AS done
            WHERE done.done_at < now() - make_interval(secs => retention_seconds)
            ORDER BY done.done_at
            LIMIT prune_limit
            FOR UPDATE SKIP LOCKED
        ), gone AS (
            DELETE FROM public.memory_observations_done AS done
            USING old
            WHERE done.org_id = old.org_id AND done.observation_key = old.observation_key
            RETURNING 1
        )
        SELECT count(*)::integer FROM gone
    $$;

-- Until every svc-memory runs the release that names the key: an earlier
-- one inserts no observation_key where it finishes an observation (its
-- queueing names the former unique key, which is gone, and is refused
-- before any row is made, so proxies keep their observations until a new
-- replica takes them). What it finishes is remembered by request id, as
-- the rows above were, instead of refused after the worker paid the
-- extraction. Only on the table of finished observations: a new release
-- that forgot the key on a waiting one must fail, not be keyed by the
-- client's request id again. A later migration drops it, once no earlier
-- svc-memory can be running.
CREATE FUNCTION svc_observation_key_from_request_id() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
    AS $$
    BEGIN
        IF NEW.observation_key IS NULL THEN
            NEW.observation_key := NEW.request_id;
        END IF;
        RETURN NEW;
    END
    $$;
CREATE TRIGGER memory_observations_done_key_from_request_id
    BEFORE INSERT ON memory_observations_done
    FOR EACH ROW EXECUTE FUNCTION svc_observation_key_from_request_id();
