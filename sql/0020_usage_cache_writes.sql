-- Cache writes in the ledger and its rollup (decisions D14).
--
-- usage_ledger gains cache_write_tokens: the prompt's tokens the provider
-- wrote to its cache (Anthropic's cache_creation_input_tokens, OpenAI's
-- shape prompt_tokens_details.cache_write_tokens), part of prompt_tokens
-- as cached_tokens (the reads) are, and priced apart at the model's
-- cache_write. Every row recorded before this migration counts none: until
-- then a write was billed and counted as an uncached input, which it is
-- at a price without cache_write (the default is input). Part of a row's
-- content, as every column is: a ledger id sent again with another count
-- is a conflict (svcd/auth/store/ledger.py compares every column), and a
-- batch an older proxy sends again (no field: 0) is the duplicate it is.
--
-- usage_rollup sums it beside the other counts, so that svcctl usage and
-- GetUsage report cache writes from the rollup like every other sum; every
-- existing rollup row sums rows without writes, so 0 is right for each.
-- The service may add to it (UPDATE of the sums only, as sql/0007 grants
-- for the others).
--
-- What it costs on a big ledger, as sql/0008_usage_kind.sql: ADD COLUMN
-- with a constant default changes the catalog only (no row is rewritten,
-- the existing rows read the default), and the checks are added NOT VALID
-- so that no row is read under the table's exclusive lock (the rows there
-- hold 0, which passes; PostgreSQL enforces them on every row written from
-- now on).
--
-- Row-level security is untouched: both tables stay enabled and forced,
-- and their policies cover the new columns (a policy is on rows).

ALTER TABLE usage_ledger ADD COLUMN cache_write_tokens bigint NOT NULL DEFAULT 0;
ALTER TABLE usage_ledger
    ADD CONSTRAINT usage_ledger_cache_write_tokens_check
        CHECK (cache_write_tokens >= 0) NOT VALID;

ALTER TABLE usage_rollup ADD COLUMN cache_write_tokens numeric NOT NULL DEFAULT 0;
ALTER TABLE usage_rollup
    ADD CONSTRAINT usage_rollup_cache_write_tokens_check
        CHECK (cache_write_tokens >= 0) NOT VALID;
GRANT UPDATE (cache_write_tokens) ON usage_rollup TO svc_auth_app;
