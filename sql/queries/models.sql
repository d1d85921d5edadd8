-- The model registry (pipeline_assets/jobs/models.py): app.models; and the
-- per-model HNSW indexes on app.embeddings (pipeline_assets/jobs/vector_index.py).

-- name: insert_model
-- Register a model; RETURNING yields a row only when it was new.
INSERT INTO app.models (model_id, provider, name, dimension, max_input_tokens)
VALUES (%(model)s, %(provider)s, %(name)s, %(dimension)s, %(max_input_tokens)s)
ON CONFLICT (model_id) DO NOTHING
RETURNING model_id

-- name: reactivate
-- `models activate`: back after `models retire` (only ever by a person's decision).
UPDATE app.models SET active = true WHERE model_id = %(model)s AND NOT active

-- name: dimension
SELECT dimension FROM app.models WHERE model_id = %(model)s

-- name: record_dimension
-- First response of a model whose dimension was unknown.
UPDATE app.models SET dimension = %(dimension)s WHERE model_id = %(model)s AND dimension IS NULL

-- name: try_lock_index_build
-- One builder per index at a time (per database, across hosts). A session
-- lock, not a transaction lock: CREATE INDEX CONCURRENTLY runs outside any
-- transaction. Released by unlock_index_build, or when the builder's
-- connection dies, so a killed builder never blocks the next one.
SELECT pg_try_advisory_lock(%(namespace)s, hashtext(%(name)s))

-- name: unlock_index_build
SELECT pg_advisory_unlock(%(namespace)s, hashtext(%(name)s))

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

-- name: create_hnsw_index
-- A psycopg.sql template, not a parameterised query (DDL takes no parameters):
-- name, kind (vector or halfvec) and opclass are sql.Identifier values, dim and
-- model are sql.Literal values. A partial expression index, since one column
-- holds vectors of several dimensions; halfvec above 2,000 dimensions (the
-- limit of HNSW on vector). CONCURRENTLY: completions keep writing while it
-- builds, so it must run outside any transaction.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON app.embeddings
USING hnsw ((embedding::{kind}({dim})) {opclass})
WHERE model_id = {model}

-- name: drop_index
-- A psycopg.sql template: name is an sql.Identifier. Drops an INVALID index
-- left by a failed or cancelled build (outside any transaction, like the build).
DROP INDEX CONCURRENTLY IF EXISTS app.{name}

-- name: is_active
SELECT active FROM app.models WHERE model_id = %(model)s

-- name: resolve_model_id
-- A configured model name (PIPELINE_EMBEDDING_MODEL) to its model_id.
SELECT model_id FROM app.models WHERE name = %(name)s OR model_id = %(name)s
ORDER BY active DESC, created_at DESC LIMIT 1

-- name: active_dimensions
-- Active models and their dimensions (their vector indexes in `status`).
SELECT model_id, dimension FROM app.models WHERE active ORDER BY model_id

-- name: active_model_ids
SELECT model_id FROM app.models WHERE active ORDER BY model_id

-- name: list_models
SELECT m.model_id, m.name, m.provider, m.dimension, m.active,
       count(j.job_id) FILTER (WHERE j.status = 'ready') AS ready,
       count(j.job_id) FILTER (WHERE j.status IN ('pending', 'retry', 'processing')) AS outstanding
FROM app.models m LEFT JOIN app.embedding_jobs j ON j.model_id = m.model_id
GROUP BY m.model_id ORDER BY m.created_at

-- name: deactivate
-- `models retire`: new content is no longer enqueued for it.
UPDATE app.models SET active = false WHERE model_id = %(model)s
