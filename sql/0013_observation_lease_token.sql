-- Renewable leases of observations (decisions D13, "Observation and the
-- worker"; issue 33). A worker whose extraction takes longer than its
-- lease renews the lease while it works, instead of being cut at the
-- lease's end. A renewal must be refused once the lease has passed to
-- another claim, even one by the same worker process (which leases under
-- one owner name): so each claim gets a token of its own, and a renewal,
-- a completion or a release names it. A lease that ran out but that no
-- claim took since can still be renewed (its token is unchanged: nobody
-- else has worked on the observation).
ALTER TABLE memory_observations ADD COLUMN lease_token uuid;

DROP FUNCTION svc_claim_observations(text, double precision, integer);

-- As in sql/0009_memory.sql, and each claimed row gets a new lease_token.
CREATE FUNCTION svc_claim_observations(claim_owner text, lease_seconds double precision,
                                       claim_limit integer)
    RETURNS TABLE (
        id uuid, org_id uuid, agent_id uuid, subject text, request_id text, messages jsonb,
        attempts integer, lease_expires_at timestamptz, lease_token uuid
    )
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
        WITH due AS (
            SELECT waiting.id FROM public.memory_observations AS waiting
            WHERE waiting.state = 'waiting' AND waiting.next_attempt_at <= now()
              AND (waiting.lease_expires_at IS NULL OR waiting.lease_expires_at <= now())
            ORDER BY waiting.next_attempt_at, waiting.id
            LIMIT claim_limit
            FOR UPDATE SKIP LOCKED
        )
        UPDATE public.memory_observations AS claimed
        SET lease_owner = claim_owner,
            lease_expires_at = now() + make_interval(secs => lease_seconds),
            lease_token = gen_random_uuid(),
            updated_at = now()
        FROM due WHERE claimed.id = due.id
        RETURNING claimed.id, claimed.org_id, claimed.agent_id, claimed.subject,
                  claimed.request_id, claimed.messages, claimed.attempts,
                  claimed.lease_expires_at, claimed.lease_token
    $$;
REVOKE ALL ON FUNCTION svc_claim_observations(text, double precision, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_claim_observations(text, double precision, integer)
    TO svc_memory_app;
