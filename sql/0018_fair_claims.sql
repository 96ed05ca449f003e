-- No organization holds up another (decisions D13, amended). Claims took
-- the oldest due observations of every organization together, first in
-- first out: an organization that queued 400 conversations made one that
-- queued a single one a moment later wait for 398 of them. A claim now
-- takes the organizations in turn, and svc-memory refuses an
-- organization's observations past SVC_MEMORY_MAX_WAITING_PER_ORG
-- waiting (a count it makes with the index below, bounded by the cap).

-- Each organization's waiting observations, oldest due first: the claim
-- walks the organizations (one descent each) and reads the head of each
-- one's queue; queueing counts an organization's waiting ones here,
-- index only. It replaces the index of the first-in-first-out claim:
-- nothing else reads that one, and a plan that did would walk the other
-- organizations' rows to find one organization's.
CREATE INDEX memory_observations_org_due
    ON memory_observations (org_id, next_attempt_at, id) WHERE state = 'waiting';
DROP INDEX memory_observations_due;

-- The observations a worker holds (released, completed or failed ones
-- have no lease; an expired lease stays until claimed again), so that
-- the claim counts cheaply how many each organization has in hand.
CREATE INDEX memory_observations_org_leased
    ON memory_observations (org_id, lease_expires_at)
    WHERE state = 'waiting' AND lease_expires_at IS NOT NULL;

-- The claim, fair across organizations. Its signature and columns are
-- those of sql/0013 (a worker and an svc-memory of the previous release
-- call it during a rolling upgrade).
--
-- An organization's turn for each of its due observations: how many it
-- has in hand (leased, the lease not run out), plus the observation's
-- place among the organization's due ones, oldest due first. The claim
-- takes the lowest turns, the oldest due first among equal turns:
-- every organization's first before any organization's second, and an
-- organization whose observations fill the workers goes after one that
-- has none in hand, so that a worker claiming one observation at a time
-- as each ends (svc-worker does, its concurrency full) takes the newcomer
-- next, not the rest of the backlog.
--
-- Cheap whatever the queue holds: the organizations are walked with one
-- index descent each (a loose index scan of memory_observations_org_due);
-- their counts in hand read memory_observations_org_leased; the level of
-- turns the claim reaches is computed from those counts alone (the least
-- turn T for which the organizations with a due observation have at least
-- claim_limit turns up to T, were their backlogs endless), and only the
-- turns up to T of each organization are read, from the head of its
-- queue: about claim_limit rows plus one per organization, never a
-- backlog. An organization with fewer due than its turns up to T leaves
-- the claim short: a next pass (the counts in hand now hold what this one
-- leased) shares the rest among those that have more.
--
-- Each candidate is locked in the order of turns, one at a time, until
-- claim_limit are (a lateral FOR UPDATE by primary key under the sorted
-- candidates): those not needed are never locked, and no plan can join
-- the candidates to the whole table. Rows another claim holds locked are
-- skipped (SKIP LOCKED). Two workers claiming at once read the same heads,
-- and the second would skip them and take fewer than it asked, though
-- more are due, and wait its poll interval: so when a pass could not take
-- candidates it read (locked, or leased by a claim that committed since),
-- what is left of the limit is filled with the due rows not locked of the
-- organizations fewest in hand first, as many of each as come. A pass
-- that took every candidate and still fewer than it wanted (organizations
-- with fewer due than their turns) is followed by another; one that found
-- no candidate ends the claim.
CREATE OR REPLACE FUNCTION svc_claim_observations(claim_owner text,
                                                  lease_seconds double precision,
                                                  claim_limit integer)
    RETURNS TABLE (
        id uuid, org_id uuid, agent_id uuid, subject text, request_id text, messages jsonb,
        attempts integer, lease_expires_at timestamptz, lease_token uuid
    )
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    -- The planner cannot know how few rows the heads are (their LIMITs are
    -- computed), and its estimate of a backlog's worth would have each
    -- claim compiled (some 50 ms): never worth it here.
    SET jit = off
    AS $$
    #variable_conflict use_column
    DECLARE
        wanted integer := claim_limit;
        offered bigint;
        leased public.memory_observations[];
        taken integer;
    BEGIN
        LOOP
            WITH RECURSIVE organizations AS (
                -- (In the order of memory_observations_org_due, which
                -- holds waiting rows only: another index would walk the
                -- failed ones.)
                (SELECT waiting.org_id FROM public.memory_observations AS waiting
                 WHERE waiting.state = 'waiting'
                 ORDER BY waiting.org_id, waiting.next_attempt_at, waiting.id LIMIT 1)
                UNION ALL
                SELECT (SELECT waiting.org_id FROM public.memory_observations AS waiting
                        WHERE waiting.state = 'waiting'
                          AND waiting.org_id > organizations.org_id
                        ORDER BY waiting.org_id, waiting.next_attempt_at, waiting.id LIMIT 1)
                FROM organizations WHERE organizations.org_id IS NOT NULL
            ), ready AS (
                -- The organizations with a due observation, and how many
                -- they have in hand.
                SELECT organizations.org_id, in_hand.held
                FROM organizations
                CROSS JOIN LATERAL (
                    SELECT count(*) AS held FROM public.memory_observations AS leased
                    WHERE leased.org_id = organizations.org_id AND leased.state = 'waiting'
                      AND leased.lease_expires_at IS NOT NULL
                      AND leased.lease_expires_at > now()
                ) AS in_hand
                WHERE organizations.org_id IS NOT NULL
                  -- The head of its queue (not an EXISTS, which may walk
                  -- an organization's rows in another index's order).
                  AND (SELECT waiting.id FROM public.memory_observations AS waiting
                       WHERE waiting.org_id = organizations.org_id
                         AND waiting.state = 'waiting' AND waiting.next_attempt_at <= now()
                         AND (waiting.lease_expires_at IS NULL
                              OR waiting.lease_expires_at <= now())
                       ORDER BY waiting.org_id, waiting.next_attempt_at, waiting.id
                       LIMIT 1) IS NOT NULL
            ), levels AS (
                -- With the k organizations fewest in hand, turns up to
                -- level give at least what is wanted: the least such level
                -- of all k is the claim's.
                SELECT greatest(
                           ceil((wanted + sum(ready.held) OVER fewer)::numeric
                                / row_number() OVER fewer),
                           ready.held + 1) AS level
                FROM ready
                WINDOW fewer AS (ORDER BY ready.held ROWS UNBOUNDED PRECEDING)
            ), candidates AS (
                SELECT due.id, due.next_attempt_at, ready.held + due.place AS turn
                FROM ready
                CROSS JOIN (SELECT min(levels.level) AS level FROM levels) AS reached
                CROSS JOIN LATERAL (
                    SELECT head.id, head.next_attempt_at,
                           row_number() OVER (ORDER BY head.next_attempt_at, head.id) AS place
                    FROM (
                        SELECT waiting.id, waiting.next_attempt_at
                        FROM public.memory_observations AS waiting
                        WHERE waiting.org_id = ready.org_id AND waiting.state = 'waiting'
                          AND waiting.next_attempt_at <= now()
                          AND (waiting.lease_expires_at IS NULL
                               OR waiting.lease_expires_at <= now())
                        ORDER BY waiting.org_id, waiting.next_attempt_at, waiting.id
                        LIMIT greatest(reached.level - ready.held, 0)
                    ) AS head
                ) AS due
            ), chosen AS (
                SELECT locked.id
                FROM (SELECT candidates.id, candidates.turn, candidates.next_attempt_at
                      FROM candidates
                      ORDER BY candidates.turn, candidates.next_attempt_at, candidates.id
                     ) AS ordered
                CROSS JOIN LATERAL (
                    SELECT waiting.id FROM public.memory_observations AS waiting
                    -- Again on the row locked: a claim that committed in
                    -- between leased it.
                    WHERE waiting.id = ordered.id AND waiting.state = 'waiting'
                      AND waiting.next_attempt_at <= now()
                      AND (waiting.lease_expires_at IS NULL
                           OR waiting.lease_expires_at <= now())
                    FOR UPDATE SKIP LOCKED
                ) AS locked
                ORDER BY ordered.turn, ordered.next_attempt_at, ordered.id
                LIMIT wanted
            )
            , took AS (
                UPDATE public.memory_observations AS claimed
                SET lease_owner = claim_owner,
                    lease_expires_at = now() + make_interval(secs => lease_seconds),
                    lease_token = gen_random_uuid(),
                    updated_at = now()
                FROM chosen WHERE claimed.id = chosen.id
                RETURNING claimed
            )
            SELECT (SELECT count(*) FROM candidates),
                   coalesce((SELECT array_agg(took.claimed) FROM took), '{}')
            INTO offered, leased;
            taken := cardinality(leased);
            RETURN QUERY
            SELECT each.id, each.org_id, each.agent_id, each.subject, each.request_id,
                   each.messages, each.attempts, each.lease_expires_at, each.lease_token
            FROM unnest(leased) AS each;
            wanted := wanted - taken;
            -- Done; or nothing due (the common case of a short claim); or
            -- some candidates were locked: the second pass below.
            EXIT WHEN wanted <= 0 OR taken = 0 OR offered > taken;
        END LOOP;
        IF wanted <= 0 OR offered <= taken THEN
            RETURN;
        END IF;
        RETURN QUERY
        WITH RECURSIVE organizations AS (
            (SELECT waiting.org_id FROM public.memory_observations AS waiting
             WHERE waiting.state = 'waiting'
             ORDER BY waiting.org_id, waiting.next_attempt_at, waiting.id LIMIT 1)
            UNION ALL
            SELECT (SELECT waiting.org_id FROM public.memory_observations AS waiting
                    WHERE waiting.state = 'waiting' AND waiting.org_id > organizations.org_id
                    ORDER BY waiting.org_id, waiting.next_attempt_at, waiting.id LIMIT 1)
            FROM organizations WHERE organizations.org_id IS NOT NULL
        ), fewest AS (
            SELECT organizations.org_id, in_hand.held
            FROM organizations
            CROSS JOIN LATERAL (
                SELECT count(*) AS held FROM public.memory_observations AS leased
                WHERE leased.org_id = organizations.org_id AND leased.state = 'waiting'
                  AND leased.lease_expires_at IS NOT NULL AND leased.lease_expires_at > now()
            ) AS in_hand
            WHERE organizations.org_id IS NOT NULL
            ORDER BY in_hand.held, organizations.org_id
        ), chosen AS (
            SELECT locked.id
            FROM fewest
            CROSS JOIN LATERAL (
                SELECT waiting.id FROM public.memory_observations AS waiting
                WHERE waiting.org_id = fewest.org_id AND waiting.state = 'waiting'
                  AND waiting.next_attempt_at <= now()
                  AND (waiting.lease_expires_at IS NULL OR waiting.lease_expires_at <= now())
                ORDER BY waiting.org_id, waiting.next_attempt_at, waiting.id
                LIMIT wanted
                FOR UPDATE SKIP LOCKED
            ) AS locked
            LIMIT wanted
        )
        UPDATE public.memory_observations AS claimed
        SET lease_owner = claim_owner,
            lease_expires_at = now() + make_interval(secs => lease_seconds),
            lease_token = gen_random_uuid(),
            updated_at = now()
        FROM chosen WHERE claimed.id = chosen.id
        RETURNING claimed.id, claimed.org_id, claimed.agent_id, claimed.subject,
                  claimed.request_id, claimed.messages, claimed.attempts,
                  claimed.lease_expires_at, claimed.lease_token;
    END
    $$;
