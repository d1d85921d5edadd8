-- The model registry (pipeline_assets/registry/models.py): app.models; and the
-- per-model HNSW indexes on app.embeddings (pipeline_assets/registry/vector_index.py).

-- name: insert_model
-- Register a model; RETURNING yields a row only when it was new.
INSERT INTO app.models (model_id, provider, name, dimension, max_input_tokens, max_chunk_tokens, tokenizer)
VALUES (%(model)s, %(provider)s, %(name)s, %(dimension)s, %(max_input_tokens)s, %(max_chunk_tokens)s,
        %(tokenizer)s)
ON CONFLICT (model_id) DO NOTHING
RETURNING model_id

-- name: update_limits
-- A registered model's input window as its provider now states it (e.g.
-- PIPELINE_MODEL_MAX_INPUT_TOKENS set after the model was first seen); the
-- window never changes a vector, so it is not part of the model id.
UPDATE app.models
SET max_input_tokens = %(max_input_tokens)s, max_chunk_tokens = %(max_chunk_tokens)s, tokenizer = %(tokenizer)s
WHERE model_id = %(model)s
  AND (max_input_tokens, max_chunk_tokens, tokenizer)
      IS DISTINCT FROM (%(max_input_tokens)s, %(max_chunk_tokens)s, %(tokenizer)s)

-- name: active_limits
-- Every active model's input window: the chunk size must fit each of them.
SELECT model_id, coalesce(max_input_tokens, max_chunk_tokens) AS max_input_tokens,
       coalesce(max_chunk_tokens, max_input_tokens) AS max_chunk_tokens, tokenizer
FROM app.models
WHERE active AND coalesce(max_chunk_tokens, max_input_tokens) IS NOT NULL
ORDER BY model_id

-- name: input_limits
-- For `status`, per active model: its window, current chunks longer than its largest chunk, and
-- answered calls whose usage shows truncation (at least inputs x window tokens), counted with the
-- inputs the local model refused as too long (docs/models.md, input windows).
WITH longest AS (SELECT max(token_count) AS tokens FROM app.chunks),
over AS (
    SELECT m.model_id, count(c.*) AS chunks
    FROM app.models m LEFT JOIN app.chunks c ON c.token_count > coalesce(m.max_chunk_tokens, m.max_input_tokens)
    WHERE m.active GROUP BY m.model_id
)
SELECT m.model_id, m.max_input_tokens, coalesce(m.max_chunk_tokens, m.max_input_tokens) AS max_chunk_tokens,
       m.tokenizer, (SELECT tokens FROM longest) AS longest_chunk_tokens, o.chunks AS chunks_over_window,
       (SELECT count(*) FROM app.provider_calls p
        WHERE p.model_id = m.model_id AND p.outcome = 'ok' AND p.inputs > 0
          AND p.tokens >= p.inputs * m.max_input_tokens) AS truncated_calls,
       (SELECT coalesce(sum(p.inputs), 0) FROM app.provider_calls p
        WHERE p.model_id = m.model_id AND p.outcome = 'ok' AND p.inputs > 0
          AND p.tokens >= p.inputs * m.max_input_tokens) AS truncated_inputs,
       (SELECT count(*) FROM app.embedding_jobs j
        WHERE j.model_id = m.model_id AND j.status = 'failed' AND j.error_class = 'input_too_long')
           AS refused_too_long
FROM app.models m JOIN over o ON o.model_id = m.model_id
WHERE m.active
ORDER BY m.model_id

-- name: reactivate
-- `models activate`: back after `models retire` (only ever by a person's decision).
-- Row-locked against a concurrent purge (purge_lock): one of them waits.
UPDATE app.models SET active = true, retired_at = NULL, purged_at = NULL
WHERE model_id = %(model)s AND NOT active

-- name: dimension
-- A model's vector dimension (NULL until known).
SELECT dimension FROM app.models WHERE model_id = %(model)s

-- name: record_dimension
-- First response of a model whose dimension was unknown.
UPDATE app.models SET dimension = %(dimension)s WHERE model_id = %(model)s AND dimension IS NULL

-- name: may_build_index
-- Whether this session's role may create an index on app.embeddings (it owns it, or is a
-- member of its owner): a worker role without DDL may not, and leaves the build to the owner.
SELECT pg_has_role(current_user, c.relowner, 'USAGE') FROM pg_class c WHERE c.oid = 'app.embeddings'::regclass

-- name: try_lock_index_build
-- One builder per index at a time, across hosts: a session lock (CREATE INDEX CONCURRENTLY runs
-- outside any transaction), released by unlock_index_build or when the builder's connection dies.
SELECT pg_try_advisory_lock(%(namespace)s, hashtext(%(name)s))

-- name: unlock_index_build
-- Release the build lock of a model's index.
SELECT pg_advisory_unlock(%(namespace)s, hashtext(%(name)s))

-- name: index_build_inputs
-- What a build's memory is sized from: the model's vectors (an index-only count
-- on embeddings_model_created) and the session's maintenance_work_mem in bytes
-- (the server's or role's setting: a build never takes less).
SELECT (SELECT count(*) FROM app.embeddings WHERE model_id = %(model)s) AS vectors,
       pg_size_bytes(current_setting('maintenance_work_mem')) AS session_memory

-- name: set_index_build_memory
-- The memory one build may use, for the builder's own session only (SET LOCAL cannot scope it
-- outside a transaction); see docs/decisions/0002-index-built-after-inserts.md.
SELECT set_config('maintenance_work_mem', %(memory)s, false)


-- name: index_state
-- valid: NULL when the index does not exist, false while it is being built
-- or after a build failed (an INVALID index), true when usable. building:
-- some session holds the build lock of this index in this database.
SELECT (SELECT i.indisvalid FROM pg_index i
        JOIN pg_class c ON c.oid = i.indexrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'app' AND c.relname = %(name)s) AS valid,
       EXISTS (SELECT 1 FROM pg_locks l
               WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
                 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                 AND l.classid = %(namespace)s::int4::oid AND l.objid = hashtext(%(name)s)::oid) AS building

-- name: index_build_progress
-- The build of this index in this database, as pg_stat_progress_create_index
-- reports it: the backend holding its build lock (try_lock_index_build). No row
-- when no build runs.
SELECT p.phase, p.blocks_done, p.blocks_total, p.tuples_done, p.tuples_total
FROM pg_stat_progress_create_index p
JOIN pg_locks l ON l.pid = p.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = %(namespace)s::int4::oid AND l.objid = hashtext(%(name)s)::oid

-- name: create_hnsw_index
-- A psycopg.sql template (DDL takes no parameters): a partial expression index per model, halfvec
-- above 2,000 dimensions; CONCURRENTLY, so it runs outside any transaction.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON app.embeddings
USING hnsw ((embedding::{kind}({dim})) {opclass})
WHERE model_id = {model}

-- name: drop_index
-- A psycopg.sql template: name is an sql.Identifier. Drops an INVALID index
-- left by a failed or cancelled build, or a purged model's index (outside any
-- transaction, like the build).
DROP INDEX CONCURRENTLY IF EXISTS app.{name}

-- name: is_active
-- Whether a model is active (NULL: never registered).
SELECT active FROM app.models WHERE model_id = %(model)s

-- name: resolve_model_id
-- A configured model name (PIPELINE_EMBEDDING_MODEL) to its model_id.
SELECT model_id FROM app.models WHERE name = %(name)s OR model_id = %(name)s
ORDER BY active DESC, created_at DESC LIMIT 1

-- name: active_dimensions
-- Active models and their dimensions (their vector indexes in `status`).
SELECT model_id, dimension FROM app.models WHERE active ORDER BY model_id

-- name: active_model_ids
-- The active models, in a stable order.
SELECT model_id FROM app.models WHERE active ORDER BY model_id

-- name: model_row
-- One registered model: what builds its provider again (name, dimension) and whether it is active.
SELECT model_id, name, provider, dimension, active FROM app.models WHERE model_id = %(model)s

-- name: list_models
-- Every model with its job counts by state, for `models list`.
SELECT m.model_id, m.name, m.provider, m.dimension, m.active,
       count(j.job_id) FILTER (WHERE j.status = 'ready') AS ready,
       count(j.job_id) FILTER (WHERE j.status IN ('pending', 'retry', 'processing')) AS outstanding
FROM app.models m LEFT JOIN app.embedding_jobs j ON j.model_id = m.model_id
GROUP BY m.model_id ORDER BY m.created_at

-- name: deactivate
-- `models retire`: new content is no longer enqueued for it; its grace period
-- starts (retiring again keeps the first date).
UPDATE app.models SET active = false, retired_at = coalesce(retired_at, now()) WHERE model_id = %(model)s

-- ---------------------------------------------------------------- the served model (migration 012)

-- name: serve_first
-- The first model registered is served at once: there is nothing to switch from.
INSERT INTO app.served_model (model_id)
SELECT m.model_id FROM app.models m
WHERE m.model_id = %(model)s AND m.active AND NOT EXISTS (SELECT 1 FROM app.served_model)
ON CONFLICT (singleton) DO NOTHING

-- name: served_model
-- The model search and export read, with what a provider for it is built from.
SELECT s.model_id, s.previous_model_id, s.served_at, m.provider, m.name, m.dimension
FROM app.served_model s JOIN app.models m ON m.model_id = s.model_id

-- name: serve
-- Switch search and export to an active model: one row, one statement, so
-- there is never a moment with no served model. A row comes back only when
-- the served model changed (previous_model_id NULL: nothing was served).
INSERT INTO app.served_model (model_id)
SELECT m.model_id FROM app.models m WHERE m.model_id = %(model)s AND m.active
ON CONFLICT (singleton) DO UPDATE
SET model_id = EXCLUDED.model_id, previous_model_id = app.served_model.model_id, served_at = now()
WHERE app.served_model.model_id <> EXCLUDED.model_id
RETURNING previous_model_id

-- name: coverage
-- How much of the current corpus one model covers: distinct current checksums, those with a
-- vector, and the rest by their job's state (waiting, dead-lettered, no live job).
WITH wanted AS (SELECT DISTINCT chunk_checksum FROM app.chunks)
SELECT count(*) AS wanted,
       count(*) FILTER (WHERE e.chunk_checksum IS NOT NULL) AS ready,
       count(*) FILTER (WHERE e.chunk_checksum IS NULL AND j.status IN ('pending', 'retry', 'processing'))
           AS waiting,
       count(*) FILTER (WHERE e.chunk_checksum IS NULL AND j.status = 'failed') AS failed,
       count(*) FILTER (WHERE e.chunk_checksum IS NULL
                          AND (j.job_id IS NULL OR j.status IN ('ready', 'superseded'))) AS no_job
FROM wanted w
LEFT JOIN app.embeddings e ON e.chunk_checksum = w.chunk_checksum AND e.model_id = %(model)s
LEFT JOIN app.job_keys k ON k.chunk_checksum = w.chunk_checksum AND k.model_id = %(model)s
LEFT JOIN app.embedding_jobs j ON j.job_id = k.job_id

-- name: model_states
-- Every model with whether it is served and where its retirement stands.
SELECT m.model_id, m.active, s.model_id IS NOT NULL AS served, m.retired_at, m.purged_at,
       m.retired_at + make_interval(secs => %(grace)s) AS purge_after
FROM app.models m LEFT JOIN app.served_model s ON s.model_id = m.model_id
ORDER BY m.created_at, m.model_id

-- name: purge_due
-- Retired models whose grace period is over and whose vectors are not deleted
-- yet. Never the served model.
SELECT m.model_id FROM app.models m
WHERE NOT m.active AND m.purged_at IS NULL
  AND m.retired_at <= now() - make_interval(secs => %(grace)s)
  AND NOT EXISTS (SELECT 1 FROM app.served_model s WHERE s.model_id = m.model_id)
ORDER BY m.model_id

-- name: purge_lock
-- Lock one due model's row for its purge (a concurrent `models activate` waits);
-- no row: it was activated or purged meanwhile.
SELECT m.model_id FROM app.models m
WHERE m.model_id = %(model)s AND NOT m.active AND m.purged_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM app.served_model s WHERE s.model_id = m.model_id)
FOR UPDATE

-- name: purge_vectors
-- Delete a retired model's vectors.
DELETE FROM app.embeddings WHERE model_id = %(model)s

-- name: supersede_purged_jobs
-- Every job of a purged model that is not superseded yet (ready, failed, and
-- any still held) -> superseded: its vector is gone; `models activate`
-- revives the ones whose content is still wanted.
UPDATE app.embedding_jobs
SET status = 'superseded', lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
WHERE model_id = %(model)s AND status <> 'superseded'

-- name: mark_purged
-- Record that a retired model's vectors are gone.
UPDATE app.models SET purged_at = now() WHERE model_id = %(model)s
